"""DeepSeek-V3.1 / V3.2 tool calls (``deepseek_v31``), and the engine of the marker-section formats.

The calls of a turn form one *section*; each call is a header, then its JSON
arguments object, between markers (``｜`` is U+FF5C, ``▁`` is U+2581)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"timezone": "Europe/Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(one line in the model's output: calls are chained without separators).  Kimi-K2
(:mod:`.kimi_k2`) has the same shape with other markers and a call id as header,
so :class:`~.sections.MarkerSectionParser` is the state machine of both; each module
says what its header means and how its format is written.

Decisions (and where they come from):

* The name is the header between ``<｜tool▁call▁begin｜>`` and ``<｜tool▁sep｜>``,
  surrounding whitespace stripped (SGLang strips it; vLLM does not, and a name
  with surrounding spaces names no tool).  The arguments are one JSON object,
  scanned by :class:`~interlace.parsers.jsonscan.JsonCall` in its ``name=`` mode
  (the object *is* the arguments): ``ArgumentsDelta`` carries the model's exact
  bytes, ``FieldComplete`` fires per top-level field, the call starts at the
  object's ``{``.  Whitespace around the object is layout.
* The older DeepSeek-V3 / R1-0528 form inside the same markers is read too, as
  vLLM's ``deepseek_v3`` parser reads it: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``,
  a newline, the arguments in a ```` ```json ```` fence, ``<｜tool▁call▁end｜>``.
  A header followed by ``{`` is V3.1; anything else after ``<｜tool▁sep｜>`` is read
  as the V3 name line (the fence's language tag, and the fence itself, may be
  missing).  This format writes and forces only the V3.1 form.
* Markers bound everything: a call's arguments end at the next marker whatever
  the JSON says (as the peers' ``.*?<｜tool▁call▁end｜>`` patterns do), so an
  unterminated object fails at ``<｜tool▁call▁end｜>`` (``ParserError`` with the
  call's index) and the next call is still read.  A call whose JSON breaks
  earlier fails at the first bad character and is skipped to the next marker.
  Text inside a section that is not a call (noise between calls, a name with no
  ``<｜tool▁call▁begin｜>``) is a ``ParserError`` without index, its text as ``raw``,
  reported when the next marker (or the end) shows what it swallowed; vLLM drops
  such text silently, but nothing the model writes disappears here unreported.
* ``<｜tool▁call▁begin｜>`` outside a section opens a single call (SGLang's
  streaming detector accepts it); the section end may be missing (or cut) at the
  end of the stream: calls are complete when their objects close.  A stray closing
  marker (section end, call end, separator) in plain text is dropped, as SGLang
  strips them: those are control tokens, not words of the answer.
* ``call_end`` is the section end only.  A pause at ``<｜tool▁call▁end｜>`` would
  stop a parallel turn after its first call, with the rest of the section
  unwritten; partial execution does not need a pause, since a tool starts on
  ``ToolCallStart`` / ``FieldComplete`` while decoding goes on.  ``in_call`` is
  true from the section's (or lone call's) opening marker to its end, so a pause
  inside arguments is seen as spurious.
* DeepSeek's wire format has no call id: ids are generated.  In DeepSeek's own
  tokenizer these markers are added tokens marked ``special: false`` (decoded
  either way); ``special_tokens`` lists them so the gateway keeps them for a
  tokenizer where they are special.
* Not read: the DSML form of DeepSeek-V3.2 (final) and later
  (``<｜DSML｜function_calls>``), a different, XML-style format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .base import IdFactory, split_text
from .events import ParserError
from .formats import ToolFormat
from .jsonscan import JsonCall
from .sections import MarkerSectionParser, forced_name

_WS = " \t\r\n"
_LANG = re.compile(r"[A-Za-z0-9_+\-]*")

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
FENCE = "```"


class DeepSeekV31Format(ToolFormat):
    """DeepSeek-V3.1 / V3.2 calls, written as DeepSeek-V3.1's chat template writes them (module docstring)."""

    name = "deepseek_v31"
    call_end = (CALLS_END,)
    special_tokens = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    call_start = (CALLS_BEGIN,)
    call_separator = ""

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        """The tools block DeepSeek-V3.1's model card puts in the system prompt."""
        parts = ["## Tools\nYou have access to the following tools:\n"]
        for f in functions:
            params = json.dumps(f.get("parameters") or {}, ensure_ascii=False)
            parts.append(f"\n### {f.get('name', '')}\nDescription: {f.get('description') or ''}\n\n"
                         f"Parameters: {params}\n")
        parts.append("\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
                     f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}"
                     f"{{additional_tool_calls}}{CALLS_END}\n\n"
                     "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n"
                     "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
                     "- For multiple tool calls, chain them directly without separators or spaces")
        return "".join(parts)

    def _one(self, name: str, arguments: Any) -> str:
        args = json.dumps({} if arguments is None else arguments, ensure_ascii=False)
        return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"

    def render_call(self, name: str, arguments: Any) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return CALLS_BEGIN + "".join(self._one(n, a) for n, a in calls) + CALLS_END

    def render_result(self, content: str) -> str:
        return f"{OUTPUT_BEGIN}{content}{OUTPUT_END}"

    def render_results(self, contents: Sequence[str]) -> str:
        """V3.1 chains the results of one turn (no ``<｜tool▁outputs▁begin｜>`` wrapper, which was V3's)."""
        return "".join(self.render_result(c) for c in contents)

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        begin, sep, end = compiler.marker(CALL_BEGIN), compiler.marker(SEP), compiler.marker(CALL_END)
        markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

        def call(name_lit: str, args: str) -> str:
            name = forced_name(name_lit, markers, self.name)
            return f"{begin} {compiler.literal(name)} {sep} {args} {end}"

        return compiler.envelope(tools, force=force, parallel=parallel, open=compiler.marker(CALLS_BEGIN),
                                 close=compiler.marker(CALLS_END), call=call)


DEEPSEEK_V31 = DeepSeekV31Format()


class DeepSeekV31Parser(MarkerSectionParser):
    """DeepSeek-V3.1 / V3.2 tool calls, and the V3 / R1-0528 form inside the same markers (module docstring)."""

    name = "deepseek_v31"
    format = DEEPSEEK_V31
    SECTION_BEGIN = (CALLS_BEGIN,)
    SECTION_END = (CALLS_END,)
    CALL_BEGIN = CALL_BEGIN
    HEAD_END = SEP
    CALL_END = CALL_END
    _CLOSING = frozenset(("v3close",))

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self._line = ""  # V3: the name line after the separator

    def _header(self, head: str) -> str | None:
        if not head:
            self._envelope_error("tool call without a function name")
            return None
        self._after = "post"
        self._line = ""
        return head

    def _no_object(self, rest: str) -> None:
        """V3 / R1-0528: ``function<｜tool▁sep｜>NAME`` then the arguments in a fence."""
        self._line = ""
        self._buf = rest
        self._state = "v3name"

    def _pending_raw(self) -> str:
        return self._head_raw() + self._line

    def _closers(self) -> tuple[str, ...]:
        return (*super()._closers(), FENCE)

    def _feed_more(self, st: str) -> bool:  # noqa: C901
        buf = self._buf
        if st == "v3name":  # the name, up to the end of its line (or the fence)
            end, m = split_text(buf, (*self._markers, "\n", FENCE))
            self._line += buf[:end]
            self._buf = buf[end:]
            if m is None:
                return False
            name = self._line.strip(_WS)
            if m in self._markers or not name:
                self._fail_envelope(f"expected a JSON object or a function name after {SEP}", self._buf,
                                    self._pending_raw())
                return True
            self._name = name
            self._state = "v3open"
            return True
        if st == "v3open":  # ```json (optional), then the object
            rest = buf.lstrip(_WS)
            if not rest:
                return False
            if rest[0] == "{":
                self._call = JsonCall(self, name=self._name)
                self._after = "v3close"
                self._buf = rest
                self._state = "call"
                return True
            if rest.startswith(FENCE):
                lang = _LANG.match(rest, len(FENCE)).end()  # type: ignore[union-attr]
                if lang == len(rest):
                    return False  # the language tag may go on
                self._line += buf[: len(buf) - len(rest)] + rest[:lang]
                self._buf = rest[lang:]
                self._state = "v3brace"
                return True
            if FENCE.startswith(rest):
                return False
            self._fail_envelope("expected ```json and the arguments object", rest, self._pending_raw())
            return True
        if st == "v3brace":
            rest = buf.lstrip(_WS)
            if not rest:
                return False
            if rest[0] == "{":
                self._call = JsonCall(self, name=self._name)
                self._after = "v3close"
                self._buf = rest
                self._state = "call"
            else:
                self._fail_envelope("expected the arguments object", rest, self._pending_raw())
            return True
        if st == "v3close":  # the closing fence, then the call end (in ``post``)
            rest = buf.lstrip(_WS)
            if not rest:
                return False
            if rest.startswith(FENCE):
                self._buf = rest[len(FENCE) :]
            elif FENCE.startswith(rest):
                return False
            self._state = "post"
            return True
        return super()._feed_more(st)


__all__ = ["DeepSeekV31Parser", "DeepSeekV31Format", "DEEPSEEK_V31", "MarkerSectionParser"]
