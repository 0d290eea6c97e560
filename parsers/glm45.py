"""Parser and format for GLM-4.5 / GLM-4.6 / GLM-4.7 tool calls::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7 writes the same without the line breaks
(``<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>``);
both are read, and so is a call without arguments (``<tool_call>get_time</tool_call>``).
Text before and between calls is ``Text``.

The function name is what follows ``<tool_call>`` up to the first line break,
``<arg_key>`` or ``</tool_call>``, stripped (vLLM's and SGLang's rule; GLM-4.5-Air
writes ``<tool_call>ls <arg_key>``).  SGLang also accepts a literal backslash-n
(the two characters ``\\n``) where a line break goes, which some GLM outputs
hold: so do we, after the name and between the tags.  Keys are stripped.  A
value is everything up to the first ``</arg_value>``, typed by the tool's JSON
schema exactly as :mod:`.qwen3_coder` types its parameters
(:func:`~interlace.parsers.qwen3_coder.typed_value`, shared: a string
parameter keeps its raw text, whitespace included, as vLLM keeps it; other
types are decoded, including SGLang's escaped JSON ``[{\\"id\\": \\"1\\"}]``;
without a schema, JSON if it parses, else the string).  ``ArgumentsDelta`` is
the JSON rendering built pair by pair, ``FieldComplete`` comes at each
``</arg_value>``, ``ToolCallEnd`` at ``</tool_call>``.  Text between the pairs
that is not a tag is dropped, as the reference parsers drop it.

Errors (the policy of :mod:`.base`).  A missing or malformed name (whitespace,
quotes, braces inside it; ``<tool_call></tool_call>``) fails the envelope:
``ParserError(None)`` when ``</tool_call>`` ends what it swallowed.  A key that
is not closed by ``</arg_key>`` before another tag (vLLM's "malformed XML"
test), a key without a value, or a new ``<tool_call>`` before ``</tool_call>``
fails the call (``ParserError`` with its index); the text up to
``</tool_call>`` is dropped and parsing goes on.  A call still open at the end
of the output is unterminated (vLLM does not extract it either).  Calls to
functions that were not offered are still calls here (SGLang drops them in its
detector): the gateway refuses them, with the same message for every format.

Writing calls (:class:`Glm45Format`): as the GLM-4.5 / 4.6 chat template writes
them (strings raw, other values as JSON, one tag pair per line), and results as
``<tool_response>`` blocks.  GLM's template opens the results turn with its
``<|observation|>`` role token; here results go into the user turn that the
gateway's fallback prompt gives them (only models whose own template has no
tools section use it), so the blocks alone are written.  The forcing grammar
writes the same call text and forbids ``</arg_value>`` inside raw string values
(the one tag that ends a value).  ``render_call`` writes JSON values with that
tag escaped (``<\\/arg_value>``), so they never hold it either; a forced JSON
value is written as llguidance writes JSON, so a model writing
``</arg_value>`` inside a JSON string there ends the value early (the call is
then malformed).  ``<tool_call>``, ``</tool_call>``, ``<arg_key>``,
``</arg_key>``, ``<arg_value>`` and ``</arg_value>`` are added tokens of GLM's
tokenizer: the grammar writes them as those tokens where the vocabulary has
them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .base import IdFactory, StreamingParser, split_text
from .events import ArgumentsDelta, FieldComplete, ParserError, ToolCallEnd
from .formats import CannotForce, ToolFormat, _functions_json
from .qwen3_coder import (
    NAME_MAX,
    arguments_delta,
    is_raw_string,
    optional_chain,
    parameters_of,
    raw_string_terminal,
    render_value,
    typed_value,
)

_WS = " \t\r\n"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
#: a literal backslash-n, which SGLang accepts where a line break goes
_BSN = "\\n"
#: the characters of a name, up to its end (a line break, a backslash, a tag); checked once stripped
_NAME_CHARS = re.compile(r"[^\n\\<>{}\"']*")
_BAD_IN_NAME = re.compile(r"\s")


def _skip_layout(buf: str) -> int:
    """How many leading characters of ``buf`` are layout: whitespace and literal ``\\n`` pairs."""
    i, n = 0, len(buf)
    while i < n:
        c = buf[i]
        if c in _WS:
            i += 1
        elif buf.startswith(_BSN, i):
            i += 2
        else:
            break
    return i


class Glm45Format(ToolFormat):
    """``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>`` (GLM-4.5+)."""

    name = "glm45"
    call_end = (CLOSE,)
    call_start = (OPEN,)
    special_tokens = (OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END)
    call_separator = "\n"
    #: what a raw string value may not hold: the tag that ends it
    FORBIDDEN_IN_STRINGS = (VALUE_END,)

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{_functions_json(functions)}\n</tools>\n\n"
                "For each function call, output the function name and arguments within the following XML format:\n"
                "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
                "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>")

    def render_call(self, name: str, arguments: Any) -> str:
        pairs = "".join(f"{KEY}{k}{KEY_END}\n{VALUE}{render_value(v, self.FORBIDDEN_IN_STRINGS)}{VALUE_END}\n"
                        for k, v in (arguments or {}).items())
        return f"{OPEN}{name}\n{pairs}{CLOSE}"

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        functions = compiler.functions(tools, force)
        m = {t: compiler.marker(t) for t in self.special_tokens}
        nl = compiler.literal("\n")
        token_end = m[VALUE_END].startswith("<[")  # </arg_value> is a special token: it cannot be in a terminal
        rules: list[str] = []
        alts: list[str] = []
        for i, (name, params) in enumerate(functions.items()):
            if not name or len(name) > NAME_MAX or _NAME_CHARS.fullmatch(name) is None or _BAD_IN_NAME.search(name):
                raise CannotForce(f"tools: function name {name!r} cannot be written in the {self.name} format "
                                  "(it holds whitespace, quotes, braces, backslashes or angle brackets)")
            items: list[tuple[str, bool]] = []
            for j, (key, sub, required) in enumerate(parameters_of(params)):
                if "<" in key or key != key.strip(_WS):
                    raise CannotForce(f"tools: parameter {key!r} of {name!r} cannot be written in the {self.name} "
                                      "format (it holds '<' or begins or ends with whitespace)")
                head = f"{m[KEY]} {compiler.literal(key)} {m[KEY_END]} {nl} {m[VALUE]}"
                if is_raw_string(sub):
                    rules.append(f"RAW_{i}_{j}: " + raw_string_terminal(sub, self.FORBIDDEN_IN_STRINGS,
                                                                        f"parameter {key!r} of {name!r}"))
                    if token_end:
                        items.append((f"{head} RAW_{i}_{j} {m[VALUE_END]} {nl}", required))
                    else:
                        rules.append(f"VAL_{i}_{j}: RAW_{i}_{j} {m[VALUE_END]}")
                        items.append((f"{head} VAL_{i}_{j} {nl}", required))
                else:
                    rules.append(f"v_{i}_{j}: {compiler.json_rule(sub)}")
                    items.append((f"{head} v_{i}_{j} {m[VALUE_END]} {nl}", required))
            rules += optional_chain(f"a_{i}", items)
            alts.append(f"{m[OPEN]} {compiler.literal(name + chr(10))} a_{i}_0 {m[CLOSE]}")
        more = f" ({compiler.literal(self.call_separator)} call)*" if parallel else ""
        lark = "\n".join([f"start: call{more}", "call: " + "\n    | ".join(alts)] + rules) + "\n"
        return compiler.tool_grammar(lark, functions)


GLM45 = Glm45Format()


class Glm45Parser(StreamingParser):
    """GLM-4.5 / 4.6 / 4.7 ``<tool_call>`` calls with ``<arg_key>`` / ``<arg_value>`` pairs; see the module doc."""

    name = "glm45"
    format = GLM45
    _CALL_STATES = frozenset(("name", "body", "key", "between", "value", "skip"))

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self._state = "text"
        self._raw: list[str] = []        # the current call's text so far, for ParserError.raw
        self._index: int | None = None
        self._fn = ""
        self._props: Mapping[str, Any] | None = None
        self._args: dict[str, Any] = {}
        self._key = ""
        self._vscan = 0
        self._skip_msg: str | None = None

    @property
    def in_call(self) -> bool:
        return self._state in self._CALL_STATES

    def _take(self, n: int) -> None:
        buf = self._buf
        self._raw.append(buf[:n])
        self._buf = buf[n:]

    def _fail(self, msg: str) -> None:
        """The call (or, before its name, the envelope) is malformed: drop its text up to ``</tool_call>``.
        A started call is reported now; an envelope error once the drop ends, with all it swallowed."""
        if self._index is not None:
            self._out.append(ParserError(self._index, msg, "".join(self._raw)))
            self._index = None
            self._raw = []
        else:
            self._skip_msg = msg
        self._state = "skip"

    def _end_call(self) -> None:
        index = self._index
        assert index is not None
        self._out.append(ArgumentsDelta(index, "}" if self._args else "{}"))
        self._out.append(ToolCallEnd(index, self._fn, self._args))
        self._index = None
        self._raw = []

    def _feed(self, final: bool = False) -> None:  # noqa: C901
        while True:
            st = self._state
            buf = self._buf
            if st == "text":
                end, marker = split_text(buf, (OPEN,))
                if final and marker is None:
                    end = len(buf)
                self._emit_text(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                self._buf = buf[end + len(OPEN):]
                self._raw = [OPEN]
                self._state = "name"
            elif st == "name":
                k = len(buf) - len(buf.lstrip(_WS))
                e = _NAME_CHARS.match(buf, k).end()  # type: ignore[union-attr]
                if e - k > NAME_MAX:
                    self._take(k + NAME_MAX)
                    self._fail("malformed function name")
                    continue
                if e == len(buf):
                    return
                c, rest = buf[e], buf[e:]
                if c == "\n":
                    term = 1
                elif rest.startswith(_BSN):
                    term = 2
                elif rest.startswith((KEY, CLOSE)):
                    term = 0
                elif rest == "\\" or KEY.startswith(rest) or CLOSE.startswith(rest):
                    return  # undecided (at the end of the output: unterminated)
                else:
                    term = -1
                name = buf[k:e].strip(_WS)
                if term < 0 or not name or _BAD_IN_NAME.search(name):
                    self._take(e)
                    self._fail("malformed function name")
                    continue
                self._take(e + term)
                self._fn = name
                self._index = self._start_call(name)
                params = self.tools.get(name) if isinstance(self.tools, Mapping) else None
                props = params.get("properties") if isinstance(params, Mapping) else None
                self._props = props if isinstance(props, Mapping) and props else None
                self._args = {}
                self._state = "body"
            elif st == "body":
                k = _skip_layout(buf)
                rest = buf[k:]
                if not rest or (rest == "\\" and not final):
                    self._take(k)
                    return
                if rest.startswith(KEY):
                    self._take(k + len(KEY))
                    self._state = "key"
                elif rest.startswith(CLOSE):
                    self._take(k + len(CLOSE))
                    self._end_call()
                    self._state = "text"
                elif rest.startswith(OPEN):
                    self._take(k)
                    self._fail(f"expected {CLOSE} before the next call")
                    self._state = "text"
                elif any(t.startswith(rest) for t in (KEY, CLOSE, OPEN)) and not final:
                    self._take(k)
                    return
                else:  # text that is not a tag: dropped, as the reference parsers drop it
                    j = rest.find("<", 1)
                    self._take(k + (len(rest) if j == -1 else j))
            elif st == "key":
                j = buf.find("<")
                if j == -1 or j > NAME_MAX:
                    if len(buf) > NAME_MAX:
                        self._take(NAME_MAX)
                        self._fail(f"expected {KEY_END}")
                        continue
                    return
                if buf.startswith(KEY_END, j):
                    self._key = buf[:j].strip(_WS)
                    self._take(j + len(KEY_END))
                    self._state = "between"
                elif KEY_END.startswith(buf[j:]):
                    return
                else:
                    self._take(j)
                    self._fail(f"expected {KEY_END}")
            elif st == "between":
                k = _skip_layout(buf)
                rest = buf[k:]
                if not rest or (rest == "\\" and not final):
                    self._take(k)
                    return
                if rest.startswith(VALUE):
                    self._take(k + len(VALUE))
                    self._vscan = 0
                    self._state = "value"
                elif VALUE.startswith(rest):
                    self._take(k)
                    return
                else:
                    self._take(k)
                    self._fail(f"expected {VALUE} after {KEY_END}")
            elif st == "value":
                j = buf.find(VALUE_END, self._vscan)
                if j == -1:
                    self._vscan = max(0, len(buf) - len(VALUE_END) + 1)
                    return
                raw = buf[:j]
                self._take(j + len(VALUE_END))
                key = self._key
                value = typed_value(raw, self._props.get(key) if self._props is not None else None)
                index = self._index
                assert index is not None
                self._out.append(arguments_delta(index, not self._args, key, value))
                self._args[key] = value
                self._out.append(FieldComplete(index, key, value))
                self._state = "body"
            else:  # skip: drop a broken call's text up to </tool_call>
                end, marker = split_text(buf, (CLOSE,))
                self._raw.append(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                if self._skip_msg is not None:
                    self._out.append(ParserError(None, self._skip_msg, "".join(self._raw)))
                    self._skip_msg = None
                self._raw = []
                self._buf = buf[end + len(CLOSE):]
                self._state = "text"

    def _finish(self) -> None:
        self._feed(final=True)
        st = self._state
        buf = self._buf
        if st == "text":
            self._emit_text(buf)
        elif st == "skip":
            if self._skip_msg is not None:
                self._out.append(ParserError(None, self._skip_msg, "".join(self._raw) + buf))
                self._skip_msg = None
        else:  # name, body, key, between, value: a call cut off
            self._out.append(ParserError(self._index, "unterminated tool call", "".join(self._raw) + buf))
            self._index = None
        self._buf = ""
        self._raw = []
