"""The streaming-parser base class and the name -> parser registry.

One parser instance serves one output stream (and every tool that stream may
call): the gateway feeds it each decoded text delta and acts on the events it
returns.  Parsers are plain synchronous state machines with no I/O; a feed must
cost a few microseconds per token so that parsing never slows decoding.

Error policy (the same for every built-in parser): bad model output never
raises.  A tool call that is malformed (invalid JSON, wrong shape) or still
unterminated when :meth:`StreamingParser.finish` is called produces a
:class:`~interlace.parsers.events.ParserError` event carrying the raw text;
the call gets no :class:`~interlace.parsers.events.ToolCallEnd`.  An error in a
call that has started is reported at the first bad character (so the gateway can
cancel work begun on partial arguments); an error before any call started is
reported once the text it swallowed is known.  The one exception is text that only *looked* like it might start a call and turned out
not to (a partial marker at the end of the stream, a bare ``{`` that is not a
``{"name": ...}`` object for ``llama3_json``): that is returned as ``Text``.

Layout is not text.  Whitespace that only separates calls or surrounds them
(the ``"\\n"`` between two hermes ``<tool_call>`` blocks, a newline before the
first call or after the last) belongs to the format, not to the answer: a
stretch of text holding nothing but whitespace is dropped when a call (or a
failed call) borders it, for every parser, in :meth:`StreamingParser.feed`.
Only such whitespace-only stretches are: text with a word in it comes back
whole, its whitespace included; an answer that is only whitespace and has no
call stays as it is.  So ``tool_choice: "required"`` answers ``content: null``
(the forcing grammars write a separator between calls, as the formats render
them), and under ``"auto"`` a reply of calls has no whitespace-only content,
as OpenAI answers.  Whitespace at the start of a stretch is held back until
the next character decides (a few tokens at most).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from .events import Event, Reasoning, Text, ToolCallStart

IdFactory = Callable[[], str]
_T = TypeVar("_T")


def random_call_id() -> str:
    """An OpenAI-style tool-call id: ``call_`` + 24 random hex digits."""
    return "call_" + os.urandom(12).hex()


def counting_ids(prefix: str = "call_") -> IdFactory:
    """Deterministic ids (``call_0``, ``call_1``, ...) for tests and replays."""
    n = -1

    def next_id() -> str:
        nonlocal n
        n += 1
        return f"{prefix}{n}"

    return next_id


def split_text(buf: str, markers: Sequence[str]) -> tuple[int, str | None]:
    """Find where plain text in ``buf`` ends.

    Returns ``(end, marker)``: ``buf[:end]`` is certainly text.  If ``marker`` is
    not None it occurs at ``end``; otherwise ``buf[end:]`` is a proper prefix of
    some marker and must be held back until more input disambiguates it (so a
    delta ending in ``<tool_`` is not emitted as text too early).
    """
    n = len(buf)
    best, found, hold = -1, None, n
    for m in markers:
        i = buf.find(m[0])
        if i == -1:
            continue  # the common case for prose: one C-level scan per marker
        j = buf.find(m, i)
        if j != -1:
            if best == -1 or j < best:
                best, found = j, m
            continue
        start = n - len(m) + 1
        i = buf.find(m[0], start if start > i else i)
        while i != -1 and i < hold:
            if m.startswith(buf[i:]):
                hold = i
                break
            i = buf.find(m[0], i + 1)
    if found is not None:
        return best, found
    return hold, None


class StreamingParser:
    """Base class: feed text deltas in, get events out.

    Subclasses implement :meth:`_feed` (consume ``self._buf`` as far as it can be
    decided) and :meth:`_finish` (flush at end of stream), appending events with
    the ``_emit*`` helpers.  The contract that tests check for every parser: any
    split of an output into deltas yields the same events as the unsplit output,
    up to merging of adjacent ``Text`` and same-index ``ArgumentsDelta`` events.
    """

    #: Registry name of the format; informational.
    name: ClassVar[str] = ""
    #: How this parser's format is written (contract 4, :class:`~interlace.parsers.formats.ToolFormat`):
    #: prompt instructions, call/result rendering, call-end markers, special tokens, grammar.
    #: Every registered parser must set it; :meth:`ParserRegistry.register` checks.
    format: ClassVar[Any] = None

    @property
    def in_call(self) -> bool:
        """Whether a call (or call list) has begun and is not complete yet.

        A pause at one of ``format.call_end`` while this is true is spurious
        (the marker occurred inside arguments): decoding should go on.
        """
        return False

    def __init__(self, *, id_factory: IdFactory | None = None,
                 tools: Mapping[str, Any] | None = None) -> None:
        #: the request's functions, ``{name: parameters schema}`` (None: unknown).  Formats whose
        #: arguments are untyped text (qwen3_coder's and glm45's XML parameters) type each value by
        #: its schema, as their reference parsers do; the JSON formats ignore it.
        self.tools: Mapping[str, Any] = tools or {}
        self._buf = ""
        self._out: list[Event] = []
        self._new_id: IdFactory = id_factory or random_call_id
        self._next_index = 0
        self._finished = False
        self._layout = ""          # whitespace held at the start of a stretch of text (see the module doc)
        self._worded = False       # the current stretch of text has had a non-whitespace character
        self._bordered = False     # a call (or failed call) has been seen: held whitespace is layout

    # -- public API -------------------------------------------------------
    def feed(self, delta: str) -> list[Event]:
        """Consume one text delta; return the events it completes."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if delta:
            buf, self._buf = self._buf, ""
            buf += delta  # grows in place when it can (refcount 1)
            self._buf = buf
            del buf
            self._feed()
        out, self._out = self._out, []
        return self._without_layout(out)

    def finish(self) -> list[Event]:
        """End of stream: flush held-back text, report unterminated calls."""
        if self._finished:
            return []
        self._finished = True
        self._finish()
        out, self._out = self._out, []
        out = self._without_layout(out)
        if self._layout and not self._bordered:  # a whitespace-only answer with no call: it is the answer
            out.append(Text(self._layout))
        self._layout = ""
        return out

    def _without_layout(self, events: list[Event]) -> list[Event]:
        """``events`` less the whitespace-only stretches of text that border a call (the module doc).
        Whitespace opening a stretch is held in ``_layout``: the next word makes it text, the next
        call (any event that is not ``Text``) makes it layout."""
        if not events:
            return events
        out: list[Event] = []
        for ev in events:
            if type(ev) is Reasoning:  # beside the answer, not in it: neither text nor a call's border
                out.append(ev)
            elif type(ev) is not Text:
                self._layout, self._worded, self._bordered = "", False, True
                out.append(ev)
            elif self._worded:
                out.append(ev)
            elif ev.text.isspace():  # type: ignore[union-attr]
                self._layout += ev.text  # type: ignore[union-attr]
            else:
                out.append(Text(self._layout + ev.text) if self._layout else ev)  # type: ignore[union-attr]
                self._layout, self._worded = "", True
        return out

    def parse(self, text: str) -> list[Event]:
        """Convenience: parse a whole output at once (feed + finish)."""
        return self.feed(text) + self.finish()

    # -- for subclasses ---------------------------------------------------
    def _feed(self) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _emit_text(self, text: str) -> None:
        if text:
            out = self._out
            if out and type(out[-1]) is Text:
                out[-1] = Text(out[-1].text + text)  # type: ignore[union-attr]
            else:
                out.append(Text(text))

    def _emit_reasoning(self, text: str) -> None:
        if text:
            out = self._out
            if out and type(out[-1]) is Reasoning:
                out[-1] = Reasoning(out[-1].text + text)  # type: ignore[union-attr]
            else:
                out.append(Reasoning(text))

    def _start_call(self, name: str) -> int:
        """Allocate the next call index and emit its ToolCallStart."""
        index = self._next_index
        self._next_index += 1
        self._out.append(ToolCallStart(index, self._new_id(), name))
        return index


def quietly(fn: Callable[..., _T], *args: object) -> _T:
    """Call ``fn`` (``ast.parse``, ``ast.literal_eval``) with warnings silenced.

    Model-written code with e.g. an invalid escape sequence would otherwise
    print a SyntaxWarning on the gateway's stderr every time it is parsed.
    Those warnings come from backslash escapes, so text without a backslash
    skips the (global, microseconds-costly) warnings-filter juggling.
    """
    if not any(type(a) is str and "\\" in a for a in args):
        return fn(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


ParserFactory = Callable[[], StreamingParser]


class UnknownParserError(KeyError):
    """A model configuration names a parser that nobody registered."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown parser {self.name!r}; registered: {', '.join(self.known) or '(none)'}"


class DuplicateParserError(ValueError):
    """Two plugins registered a parser under the same name."""


class ParserRegistry:
    """Maps parser names (as used in model configs) to zero-argument factories.

    ``register`` has the signature the ``register_parsers`` hook passes to
    plugins, so ``pm.hook.register_parsers(register=registry.register)`` fills
    it.  Each :meth:`create` returns a fresh parser: one per output stream.
    Two kinds share the hook and have a namespace each, as a model config names
    one of each (``parser: glm45``, ``reasoning_parser: glm45``): tool-call
    parsers carry a ``format``, reasoning parsers (:mod:`.reasoning`) a
    ``reasoning``.
    """

    def __init__(self) -> None:
        self._factories: dict[str, ParserFactory] = {}
        self._reasoning: dict[str, ParserFactory] = {}

    def register(self, name: str, factory: ParserFactory) -> None:
        """Add a parser; refuses one whose factory has no valid ``format`` (contract 4) or ``reasoning``.

        Checking here makes a plugin with an incomplete parser fail when the
        gateway starts (the registry is filled then), with a message naming it,
        rather than falling back to another format's prompt on every request.
        """
        from .formats import check_format
        from .reasoning import check_reasoning

        if not name or not isinstance(name, str):
            raise ValueError(f"parser name must be a non-empty string, got {name!r}")
        what = f"{name!r} ({getattr(factory, '__qualname__', factory)!r})"
        if getattr(factory, "reasoning", None) is not None:
            if name in self._reasoning:
                raise DuplicateParserError(f"reasoning parser {name!r} is already registered")
            check_reasoning(factory.reasoning, what)  # type: ignore[attr-defined]
            self._reasoning[name] = factory
            return
        if name in self._factories:
            raise DuplicateParserError(f"parser {name!r} is already registered")
        check_format(getattr(factory, "format", None), what)
        self._factories[name] = factory

    def get(self, name: str) -> ParserFactory:
        try:
            return self._factories[name]
        except KeyError:
            raise UnknownParserError(name, self._factories) from None

    def get_reasoning(self, name: str) -> ParserFactory:
        try:
            return self._reasoning[name]
        except KeyError:
            raise UnknownParserError(name, self._reasoning) from None

    def create(self, name: str) -> StreamingParser:
        return self.get(name)()

    def names(self) -> list[str]:
        return sorted(self._factories)

    def reasoning_names(self) -> list[str]:
        return sorted(self._reasoning)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def __len__(self) -> int:
        return len(self._factories)
