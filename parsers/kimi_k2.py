"""Kimi-K2 tool calls (``kimi_k2``).

The calls of a turn form one section; each call's header is its *call id*,
``functions.NAME:IDX``, then its JSON arguments object::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"timezone": "Europe/Paris"}<|tool_call_end|><|tool_calls_section_end|>

(one line in the model's output).  The state machine is the one DeepSeek's
format shares (:class:`~interlace.parsers.deepseek.MarkerSectionParser`: JSON
arguments scanned in ``JsonCall``'s ``name=`` mode, markers bounding each call,
broken calls skipped to the next marker so their siblings are still read,
layout whitespace between markers, stray closing markers dropped from text, a
lone ``<|tool_call_begin|>`` outside a section read as a call); this module says
what the header means and how the format is written.

Decisions (and where they come from):

* The call id gives the name: ``functions.`` is stripped once from its front and
  ``:IDX`` (ASCII digits) from its end, so ``functions.mcp__portal__search-docs:2``
  names ``mcp__portal__search-docs`` and ``get_weather:0`` (no prefix) names
  ``get_weather`` (SGLang).  Dotted names stay whole (``functions.a.b:0`` is
  ``a.b``, as SGLang reads it; vLLM would keep only ``b``).  An id without
  ``:IDX`` (``functions.f.0``, ``weird@id``) names no function: that call is a
  ``ParserError`` and its siblings are read (vLLM and SGLang skip it).
* A bare counter as id (``<|tool_call_begin|>3<|tool_call_argument_begin|>``, which
  SGLang accepts) names the request's only function when it has exactly one.
  SGLang also guesses the function among several from the argument names; that
  is refused here: a call would run a tool the model never named.
* The model's id is kept as the call's OpenAI id (as vLLM does).  Kimi's chat
  template writes ``<|tool_call_begin|>{{ tool_call.id }}`` and ``## Return of
  {{ tool_call_id }}`` back into the prompt, and the model was trained on its own
  ``functions.NAME:IDX`` ids there; a generated ``call_...`` id would show it
  ids it never writes (and the re-rendered turn would no longer match the tokens
  the model wrote, which retained contexts are matched on).  An id that repeats
  one already given in this output (a model restarting its counter) gets a
  generated id instead, so ids stay unique within a response.
* Both spellings of the section markers are read: ``<|tool_calls_section_begin|>``
  and the singular ``<|tool_call_section_begin|>`` (and their ends) that vLLM
  accepts.  ``call_end`` is both section ends (not the per-call end: a pause there
  would cut a parallel turn short; see :mod:`.deepseek`).
* Writing calls: the ``IDX`` of each call counts from 0 in its turn (the format
  is not told the conversation's earlier calls, which Kimi's global counter
  would continue).  Results are written as Kimi's template writes a tool message,
  ``## Return of <id>``; the format is given their contents in call order and
  the names of the calls they answer (``results_named``), so the id is
  ``functions.NAME:<i>`` with ``i`` the result's position in the turn, as the
  calls were numbered (``call <i>`` where the name is not known).
* Text between the section's markers that is not a call (vLLM suppresses it as
  "header noise") is a ``ParserError`` without index, reported with its text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .base import IdFactory
from .sections import MarkerSectionParser, forced_name
from .events import ToolCallStart
from .formats import ToolFormat

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
SECTION_BEGIN_1 = "<|tool_call_section_begin|>"  # the singular spelling vLLM also accepts
SECTION_END_1 = "<|tool_call_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_MARKERS = (SECTION_BEGIN, SECTION_END, SECTION_BEGIN_1, SECTION_END_1, CALL_BEGIN, ARGS_BEGIN, CALL_END)

_ID = re.compile(r"(?P<name>.+):(?P<idx>[0-9]+)", re.DOTALL)
_COUNTER = re.compile(r"[0-9]+")
_PREFIX = "functions."


def call_id(name: str, index: int) -> str:
    """Kimi's id of the ``index``-th call, to ``name``."""
    return f"{_PREFIX}{name}:{index}"


class KimiK2Format(ToolFormat):
    """Kimi-K2 calls, written as Kimi-K2's chat template writes them (module docstring)."""

    name = "kimi_k2"
    call_end = (SECTION_END, SECTION_END_1)
    special_tokens = _MARKERS
    call_start = (SECTION_BEGIN,)
    call_separator = ""

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        """Kimi's template declares the tools as one JSON list; the call syntax is spelled out for a model
        that was not trained on it."""
        tools = json.dumps([{"type": "function", "function": f} for f in functions], ensure_ascii=False)
        return ("# Tools\n\nYou can call the following functions:\n" + tools + "\n\n"
                f"To call functions, write {SECTION_BEGIN}, then each call as {CALL_BEGIN}functions.<name>:<index>"
                f"{ARGS_BEGIN}<arguments as a JSON object>{CALL_END}, numbering the calls from 0, then "
                f"{SECTION_END}. Each result comes back as \"## Return of functions.<name>:<index>\" followed by the "
                "result.")

    def render_call(self, name: str, arguments: Any) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return SECTION_BEGIN + "".join(
            f"{CALL_BEGIN}{call_id(n, i)}{ARGS_BEGIN}{json.dumps({} if a is None else a, ensure_ascii=False)}"
            f"{CALL_END}" for i, (n, a) in enumerate(calls)) + SECTION_END

    #: :meth:`render_results` takes the names of the calls answered (the prompt renderer passes them)
    results_named = True

    def render_result(self, content: str, name: str | None = None) -> str:
        return self.render_results([content], [name])

    def render_results(self, contents: Sequence[str], names: Sequence[str | None] | None = None) -> str:
        """``## Return of <id>`` per result, the id as :meth:`render_calls` numbers the calls of a turn
        (``call <i>`` where the call's name is not known)."""
        names = list(names or ())
        ids = [call_id(names[i], i) if i < len(names) and names[i] else f"call {i}" for i in range(len(contents))]
        return "\n".join(f"## Return of {ident}\n{c}" for ident, c in zip(ids, contents))

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        begin, args_begin, end = compiler.marker(CALL_BEGIN), compiler.marker(ARGS_BEGIN), compiler.marker(CALL_END)

        def call(name_lit: str, args: str) -> str:
            name = forced_name(name_lit, _MARKERS, self.name)
            # the index: any counter the model picks (Kimi's continues over the conversation), bounded
            return f"{begin} {compiler.literal(_PREFIX + name + ':')} /[0-9]{{1,4}}/ {args_begin} {args} {end}"

        return compiler.envelope(tools, force=force, parallel=parallel, open=compiler.marker(SECTION_BEGIN),
                                 close=compiler.marker(SECTION_END), call=call)


KIMI_K2 = KimiK2Format()


class KimiK2Parser(MarkerSectionParser):
    """Kimi-K2 tool calls; the call id names the function and is kept as the call's id (module docstring)."""

    name = "kimi_k2"
    format = KIMI_K2
    SECTION_BEGIN = (SECTION_BEGIN, SECTION_BEGIN_1)
    SECTION_END = (SECTION_END, SECTION_END_1)
    CALL_BEGIN = CALL_BEGIN
    HEAD_END = ARGS_BEGIN
    CALL_END = CALL_END

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self._ids: set[str] = set()
        self._call_id: str | None = None

    def _header(self, head: str) -> str | None:
        m = _ID.fullmatch(head)
        name = None
        if m is not None:
            name = m["name"][len(_PREFIX):] if m["name"].startswith(_PREFIX) else m["name"]
        elif _COUNTER.fullmatch(head) and len(self.tools) == 1:
            name = next(iter(self.tools))
        if not name:
            self._envelope_error(f"tool-call id {head!r} is not functions.NAME:INDEX")
            return None
        self._call_id = head if head not in self._ids else None
        self._ids.add(head)
        return name

    def _start_call(self, name: str) -> int:
        """The call's id is the model's (see the module docstring)."""
        index = self._next_index
        self._next_index += 1
        self._out.append(ToolCallStart(index, self._call_id or self._new_id(), name))
        return index


__all__ = ["KimiK2Parser", "KimiK2Format", "KIMI_K2", "call_id"]
