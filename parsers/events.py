"""Events a streaming parser emits while a model's output is still decoding.

A parser turns text deltas into these events so the gateway can act on a tool
call before the model has finished writing it (Conveyor-style partial
execution): start a worker on :class:`ToolCallStart`, hand it each
:class:`FieldComplete` or :class:`LineComplete` as it becomes available, and
forward :class:`ArgumentsDelta` to OpenAI-style streaming clients unchanged.

Ordering guarantees, for every call ``index``:

* :class:`ToolCallStart` comes first, :class:`ToolCallEnd` or
  :class:`ParserError` last; nothing for that index follows either.
* The ``ArgumentsDelta`` fragments, concatenated, are the JSON text of the
  arguments (for JSON formats, exactly the model's bytes of the arguments
  object; for the other formats, a JSON rendering of the final arguments).
* A :class:`FieldComplete` is preceded by the deltas that cover its value.

Events are frozen (hashable, comparable) so tests can compare sequences and
consumers can share them between tasks without copying.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True, slots=True)
class Text:
    """Plain output text, outside any tool call (may arrive in many pieces)."""

    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    """Model reasoning (``<think>`` text, a harmony ``analysis`` channel): never content, never a call.

    Emitted by a reasoning parser (:mod:`.reasoning`) or by a tool-call parser whose format
    carries reasoning itself (harmony).  The gateway shows it apart from the answer
    (``reasoning_content``, a Responses reasoning item, a Messages thinking block).
    """

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call has begun and its name is known; arguments may follow."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    """A raw fragment of the call's JSON arguments text, as OpenAI streams it."""

    index: int
    fragment: str


@dataclass(frozen=True, slots=True)
class FieldComplete:
    """A top-level argument ``key`` whose JSON ``value`` is complete and parsed.

    Emitted as soon as the value closes, typically long before the call ends,
    so a tool can start on the fields it has.
    """

    index: int
    key: str
    value: Any


@dataclass(frozen=True, slots=True)
class LineComplete:
    """A complete unit of code for a code tool.

    For Python this is one complete top-level statement (a ``def`` or ``for``
    block arrives as one multi-line unit, once the next top-level line starts or
    the block ends), without its trailing newline.
    """

    index: int
    line: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """The call is complete; ``arguments`` is the final parsed arguments dict.

    Code tools (the markdown parser) use ``{"code": <source>}``.
    """

    index: int
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ParserError:
    """A tool call that could not be parsed (malformed or unterminated).

    ``index`` is the call's index when a :class:`ToolCallStart` was already
    emitted for it (the consumer should abandon that call), else ``None``.
    ``raw`` is the model text of the failed call, so it can be shown back to
    the model or logged.  Parsers never raise on bad model output: a model
    that writes a broken call is a normal event, not a gateway failure.
    """

    index: int | None
    message: str
    raw: str


Event = Union[Text, Reasoning, ToolCallStart, ArgumentsDelta, FieldComplete, LineComplete, ToolCallEnd, ParserError]

__all__ = [
    "Text",
    "Reasoning",
    "ToolCallStart",
    "ArgumentsDelta",
    "FieldComplete",
    "LineComplete",
    "ToolCallEnd",
    "ParserError",
    "Event",
]
