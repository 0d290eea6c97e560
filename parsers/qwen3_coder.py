"""Parser and format for Qwen3-Coder's XML tool calls (also written by Qwen3.5 / Qwen3.6)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Several calls follow one another; text before (and between) calls is ``Text``.
A parameter's value is raw text, not JSON: one leading and one trailing newline
are the layout and are stripped (exactly one each, as vLLM's and SGLang's
parsers do), and the value is typed by the tool's JSON schema,
``tools[name]["properties"][key]`` (:func:`typed_value`, shared with
:mod:`.glm45`): a string parameter keeps the raw text; integer, number,
boolean, object, array and null parameters are decoded (JSON, then JSON with
its escapes undone, then a Python literal, as the reference parsers fall back;
``null``/``None`` is null where the schema allows it); a value that decodes to
nothing stays the string.  A parameter with no schema (an unknown tool, a key
the schema does not name, a property without a type) is JSON if it parses as
JSON, else the string.  ``ArgumentsDelta`` carries a JSON rendering built
parameter by parameter (``{"city": "Paris"`` when ``city`` closes, ``, "days":
3`` at the next, ``}`` at ``</function>``), so its concatenation is exactly
``json.dumps`` of the arguments ``ToolCallEnd`` carries.

What ends a value (the decision, after vLLM's ``qwen3coder_tool_parser.py``
and SGLang's ``qwen3_coder_detector.py``).  Values are raw text, so a value
may hold the format's own tags (code that writes this format, a Jinja
template, a parser's test fixture).  A tag ends the value only where it is
*structural*:

* ``</parameter>`` followed (after whitespace) by ``<parameter=NAME>`` with a
  NAME of the tool's schema (any NAME when the schema is unknown), by
  ``</function>``, by ``</tool_call>``, or by the end of the output.  Anything
  else after it (``</parameter>`` then ``foo``) makes it part of the value.  The
  decision waits for the next tag (a few tokens): ``FieldComplete`` comes then.
  A ``<parameter=NAME>`` at the start of a line of the value that does not end
  it (below) opens a literal block, and the next ``</parameter>`` closes that
  block, not the value (vLLM's depth count: a value holding a whole literal
  call stays whole).
* A missing ``</parameter>``: a ``<parameter=NAME>`` at the start of a line,
  NAME a parameter of the schema not written yet in this call (SGLang's and
  vLLM's "implicit close"); ``</function>`` or ``</tool_call>`` followed by the
  next call (``<tool_call>``, ``<function=``) or by the end of the output.

A call ends at ``</function>`` (``ToolCallEnd`` there); ``</tool_call>`` after
it is optional (vLLM's and SGLang's tests accept it missing), and a bare
``<function=NAME>`` block without ``<tool_call>`` is a call too (both peers
accept it) -- but only once its body starts like one (``<parameter=`` or
``</function>``), so prose that mentions ``<function=x>`` stays text.  A
``</tool_call>`` in the body ends the call (``</function>`` missing).  Text in
the body that is not a tag is dropped, as the peers drop it.

Errors (the policy of :mod:`.base`).  A bad function name (vLLM's rule: no
whitespace, quotes, braces or angle brackets) or anything but ``<function=``
after ``<tool_call>`` fails the envelope: ``ParserError(None)`` once
``</function>`` / ``</tool_call>`` ends what it swallowed, and parsing goes on
after it (vLLM's test keeps a good call after a broken one).  A bad parameter
name fails its call (``ParserError`` with its index).  A call still open at
the end of the output is unterminated: a ``ParserError``, not a call -- vLLM
runs a call cut off by ``max_tokens`` whose ``</function>`` never came; we do
not (its last value may be truncated).  A boolean that is not ``true``/``false``
stays a string (vLLM makes it ``false``).

Writing calls (:class:`Qwen3CoderFormat`): as Qwen3-Coder's chat template does
(strings raw, everything else JSON); results as ``<tool_response>...``.  The
forcing grammar writes the same text.  A string value is written raw, so the
grammar forbids in it the tags that could end it (``</parameter>``,
``<parameter=``, ``</function>``, ``</tool_call>``); ``render_call`` writes what
it is given (as the model's template does), which reads back unchanged unless
a string holds one of those tags structurally.  In JSON values (objects,
arrays) ``render_call`` escapes the slash of those tags (``<\\/parameter>``),
so their strings cannot hold one; the grammar cannot make the model do so (it
writes JSON as llguidance does), but a JSON string cannot hold a raw newline
either, so only the unlikely ``</parameter> </function>`` (or ``</function>
</tool_call>``) inside a forced JSON string would be read as structural.
Values are typed by the schema, so a rendering reads back as the same JSON when the parser
has the tools' schemas (as it does when serving): without them a string that
parses as JSON (``"42"``) reads back as that JSON.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .base import IdFactory, StreamingParser, quietly, split_text
from .events import ArgumentsDelta, FieldComplete, ParserError, ToolCallEnd
from .formats import CannotForce, ToolFormat, _functions_json
from .jsonscan import loads as _strict_loads

_WS = " \t\r\n"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
#: longest function / parameter name read; a longer one is malformed (keeps prose from being held)
NAME_MAX = 256
#: a function name (vLLM's ``_is_valid_function_name``): no whitespace, quotes, braces or angle brackets
_FUNC_NAME = re.compile(r"[^{}<>\"'\s]*")
#: a parameter name: anything up to ``>`` on one line, without ``<``
_PARAM_NAME = re.compile(r"[^<>\r\n]*")


# ======================================================================= typing values by the schema
_FAIL = object()
#: type names that keep the raw text (JSON Schema's ``string`` and the aliases vLLM accepts)
STRING_TYPES = frozenset(("string", "str", "text", "varchar", "char", "enum"))
_CONTAINERS = ("object", "array", "arr", "dict", "list")
_NULLS = ("null", "none")


def schema_types(schema: Any) -> list[str]:
    """The type names a property schema allows: its ``type`` (a name or a list), else the ``type`` of each
    ``anyOf`` / ``oneOf`` option (one level: what Pydantic writes for ``Optional[T]``), lower-cased."""
    if not isinstance(schema, Mapping):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t.strip().lower()]
    if isinstance(t, list):
        return [x.strip().lower() for x in t if isinstance(x, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            for o in options:
                ot = o.get("type") if isinstance(o, Mapping) else None
                out += [ot.strip().lower()] if isinstance(ot, str) else [
                    x.strip().lower() for x in ot if isinstance(x, str)] if isinstance(ot, list) else []
    return out


def value_kind(schema: Any) -> tuple[str | None, bool]:
    """``(primary type, nullable)``: the first type that is not ``null`` (None: no type, any JSON), and
    whether ``null`` is allowed.  A primary string type means the raw text is the value."""
    types = schema_types(schema)
    return next((t for t in types if t != "null"), None), "null" in types


def _json_compatible(value: Any) -> Any:
    """``value`` as JSON data (tuples become lists), or _FAIL (sets, bytes, NaN, infinities...)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return _FAIL


def _decode(text: str) -> Any:
    """``text`` decoded: JSON (finite numbers only); JSON with its escapes undone once (SGLang's
    fallback for ``[{\\"a\\": 1}]``); a Python literal (``{'a': 1}``, ``True``); else _FAIL."""
    try:
        return _strict_loads(text)
    except (ValueError, RecursionError):
        pass
    if "\\" in text:
        try:
            return _strict_loads(_strict_loads('"' + text + '"'))
        except (ValueError, RecursionError, TypeError):
            pass
    try:
        value = quietly(ast.literal_eval, text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _FAIL
    return _json_compatible(value)


def typed_value(raw: str, schema: Any) -> Any:
    """A raw XML parameter value typed by its property ``schema`` (None: no schema); see the module doc."""
    if not isinstance(schema, Mapping):
        return _loose(raw)
    types = schema_types(schema)
    primary = next((t for t in types if t != "null"), None)
    text = raw.strip()
    low = text.lower()
    if "null" in types and low in _NULLS:
        return None
    if primary is None:
        return _loose(raw)
    if primary in STRING_TYPES:
        return raw
    if low in _NULLS:
        return None
    if primary.startswith(("bool", "binary")) and low in ("true", "false"):
        return low == "true"
    value = _decode(text)
    if value is _FAIL:
        return raw
    if isinstance(value, str) and primary.startswith(_CONTAINERS) and not STRING_TYPES.intersection(types):
        # a container written as a JSON string of its Python repr ("{'k': 'v'}"): vLLM decodes it twice
        inner = _decode(value.strip())
        if isinstance(inner, (dict, list)):
            return inner
    return value


def _loose(raw: str) -> Any:
    value = _decode(raw.strip())
    return raw if value is _FAIL else value


def arguments_delta(index: int, first: bool, key: str, value: Any) -> ArgumentsDelta:
    sep = "{" if first else ", "
    return ArgumentsDelta(index, f"{sep}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")


def render_value(value: Any, end_tags: Sequence[str] = ()) -> str:
    """A value as the XML formats' templates write it: a string raw, anything else as JSON -- in which each of
    the format's ``end_tags`` (``</...>``) is written with JSON's escaped slash (``<\\/...>``, the same string
    once decoded), so no string inside it can end the value."""
    if isinstance(value, str):
        return value
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    for tag in end_tags:
        if tag.startswith("</") and tag in text:
            text = text.replace(tag, "<\\/" + tag[2:])
    return text


def name_end(text: str, start: int, chars: re.Pattern[str]) -> tuple[str, int]:
    """Where the name at ``text[start:]`` (closed by ``>``) ends: ``("ok", i)`` (``text[i]`` is ``>``),
    ``("more", -1)`` (undecided yet) or ``("bad", i)`` (``text[i]`` is the first character that cannot be
    in the name: a name is 1 to :data:`NAME_MAX` characters matching ``chars``)."""
    m = chars.match(text, start)
    end = m.end()  # type: ignore[union-attr]
    if end - start > NAME_MAX:
        return "bad", start + NAME_MAX
    if end == len(text):
        return "more", -1
    if text[end] != ">" or end == start:
        return "bad", end
    return "ok", end


# ======================================================================= grammar helpers (shared with glm45)
_RE_META = frozenset("\\.+*?()|[]{}^$/")


def _re_literal(text: str) -> str:
    """``text`` as a literal inside an llguidance ``/regex/`` (``<`` and ``>`` stay bare: ``\\<`` is a
    word boundary in Rust's regex)."""
    out = []
    for c in text:
        if c in _RE_META:
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:
            out.append(f"\\x{{{ord(c):x}}}")
    return "".join(out)


def _pattern_regex(pattern: str) -> str:
    """A JSON Schema ``pattern`` (a search, anchored only by ``^`` / ``$``) as a whole-string regex."""
    head = pattern.startswith("^")
    tail = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[1 if head else 0: len(pattern) - (1 if tail else 0)]
    core = re.sub(r"(?<!\\)/", r"\/", core)
    return ("" if head else "(?s:.*)") + f"(?:{core})" + ("" if tail else "(?s:.*)")


def _string_branch(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a property schema that constrains its strings: the schema, or its first string option."""
    if "string" in schema_types({k: v for k, v in schema.items() if k == "type"}):
        return schema
    for key in ("anyOf", "oneOf"):
        for o in schema.get(key) or ():
            if isinstance(o, Mapping) and "string" in schema_types({"type": o.get("type")}):
                return o
    return schema


def raw_string_terminal(schema: Mapping[str, Any], forbidden: Sequence[str], where: str) -> str:
    """The llguidance terminal (Lark, with its ``&`` / ``~``) of raw text that is a valid string for
    ``schema`` (enum / const, minLength / maxLength, pattern; ``format`` is not enforced) and holds none
    of ``forbidden``.  Raises :class:`CannotForce` when no such string exists."""
    s = _string_branch(schema)
    values = s.get("enum") if isinstance(s.get("enum"), list) else [s["const"]] if "const" in s else None
    if values is not None:
        ok = [v for v in values if isinstance(v, str) and not any(f in v for f in forbidden)]
        if not ok:
            raise CannotForce(f"tools: {where} allows no string this format can write raw "
                              f"(its values hold one of {', '.join(forbidden)})")
        alts = " | ".join(json.dumps(v, ensure_ascii=False) for v in ok if v)
        return alts if "" not in ok else f"({alts})?" if alts else '""'
    lo, hi = s.get("minLength"), s.get("maxLength")
    rep = "*" if lo is None and hi is None else f"{{{int(lo or 0)},{'' if hi is None else int(hi)}}}"
    parts = [f"/(?s:.{rep})/"]
    if forbidden:
        parts.append("~/(?s:.*)(?:" + "|".join(_re_literal(f) for f in forbidden) + ")(?s:.*)/")
    if isinstance(s.get("pattern"), str):
        parts.append(f"/{_pattern_regex(s['pattern'])}/")
    return " & ".join(parts)


def parameters_of(params: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], bool]]:
    """``(name, schema, required)`` of a function's parameters in schema order (required names the schema
    does not describe last, as any JSON); each schema carries the function's ``$defs``."""
    props = params.get("properties") if isinstance(params.get("properties"), Mapping) else {}
    required = [r for r in params.get("required") or () if isinstance(r, str)]
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    out = []
    for key, sub in list(props.items()) + [(r, {}) for r in required if r not in props]:
        sub = dict(sub) if isinstance(sub, Mapping) else {}
        sub.update(defs)
        out.append((key, sub, key in required))
    return out


def optional_chain(prefix: str, items: Sequence[tuple[str, bool]]) -> list[str]:
    """Lark rules for ``items`` in order, each optional one skippable; ``{prefix}_0`` matches them all."""
    n = len(items)
    rules = [f'{prefix}_{n}: ""']
    for k in range(n - 1, -1, -1):
        expr, required = items[k]
        rules.append(f"{prefix}_{k}: {expr} {prefix}_{k + 1}" + ("" if required else f" | {prefix}_{k + 1}"))
    return rules


def is_raw_string(schema: Any) -> bool:
    """The parser keeps this property's value as raw text (its primary type is a string)."""
    primary, _ = value_kind(schema)
    return primary is not None and primary in STRING_TYPES


# ======================================================================= the format
class Qwen3CoderFormat(ToolFormat):
    """``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``.

    Written as Qwen3-Coder's chat template writes calls (strings raw, other
    values as JSON, calls one per line) and results (``<tool_response>``
    blocks in a user turn); ``instructions`` is that template's tools section.
    ``<tool_call>`` / ``</tool_call>`` are added tokens of Qwen3's tokenizer;
    ``<function=`` and ``<parameter=`` are plain text.
    """

    name = "qwen3_coder"
    call_end = (CLOSE,)
    call_start = (OPEN,)
    special_tokens = (OPEN, CLOSE)
    call_separator = "\n"
    #: what a raw string value may not hold (see the module doc); the grammar forbids them
    FORBIDDEN_IN_STRINGS = (PARAM_END, PARAM, FUNC_END, CLOSE)

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                f"{_functions_json(functions)}\n</tools>\n\n"
                "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
                "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
                "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
                "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
                "- Function calls MUST follow the specified format: an inner <function=...></function> block must "
                "be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
                "- You may provide optional reasoning for your function call in natural language BEFORE the "
                "function call, but NOT after\n- If there is no function call available, answer the question "
                "like normal with your current knowledge and do not tell the user about function calls\n"
                "</IMPORTANT>")

    def render_call(self, name: str, arguments: Any) -> str:
        params = "".join(f"{PARAM}{k}>\n{render_value(v, self.FORBIDDEN_IN_STRINGS)}\n{PARAM_END}\n"
                         for k, v in (arguments or {}).items())
        return f"{OPEN}\n{FUNC}{name}>\n{params}{FUNC_END}\n{CLOSE}"

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        functions = compiler.functions(tools, force)
        open_, close = compiler.marker(OPEN), compiler.marker(CLOSE)
        end_value = compiler.literal(f"\n{PARAM_END}\n")
        rules: list[str] = []
        alts: list[str] = []
        for i, (name, params) in enumerate(functions.items()):
            if not name or _FUNC_NAME.fullmatch(name) is None or len(name) > NAME_MAX:
                raise CannotForce(f"tools: function name {name!r} cannot be written in the {self.name} format "
                                  "(it holds whitespace, quotes, braces or angle brackets)")
            items: list[tuple[str, bool]] = []
            for j, (key, sub, required) in enumerate(parameters_of(params)):
                if not key or _PARAM_NAME.fullmatch(key) is None or len(key) > NAME_MAX:
                    raise CannotForce(f"tools: parameter {key!r} of {name!r} cannot be written in the "
                                      f"{self.name} format (it holds '<', '>' or a line break)")
                head = compiler.literal(f"{PARAM}{key}>\n")
                if is_raw_string(sub):
                    rules.append(f"RAW_{i}_{j}: " + raw_string_terminal(sub, self.FORBIDDEN_IN_STRINGS,
                                                                        f"parameter {key!r} of {name!r}"))
                    rules.append(f"VAL_{i}_{j}: RAW_{i}_{j} {end_value}")
                    items.append((f"{head} VAL_{i}_{j}", required))
                else:
                    rules.append(f"v_{i}_{j}: {compiler.json_rule(sub)}")
                    items.append((f"{head} v_{i}_{j} {end_value}", required))
            rules += optional_chain(f"a_{i}", items)
            alts.append(f"{open_} {compiler.literal(chr(10) + FUNC + name + '>' + chr(10))} a_{i}_0 "
                        f"{compiler.literal(FUNC_END + chr(10))} {close}")
        more = f" ({compiler.literal(self.call_separator)} call)*" if parallel else ""
        lark = "\n".join([f"start: call{more}", "call: " + "\n    | ".join(alts)] + rules) + "\n"
        return compiler.tool_grammar(lark, functions)


QWEN3_CODER = Qwen3CoderFormat()


# ======================================================================= the parser
class Qwen3CoderParser(StreamingParser):
    """Qwen3-Coder XML tool calls; see the module docstring."""

    name = "qwen3_coder"
    format = QWEN3_CODER
    _CALL_STATES = frozenset(("open", "name", "body", "pname", "value", "skip"))

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self._state = "text"
        self._wrapped = False            # the call opened with <tool_call> (else a bare <function=)
        self._raw: list[str] = []        # the current call's text so far, for ParserError.raw
        self._index: int | None = None
        self._fn = ""
        self._props: Mapping[str, Any] | None = None  # the function's properties (None: unknown)
        self._args: dict[str, Any] = {}
        self._key = ""
        self._vscan = 0                  # in a value, no tag starts before this offset
        self._vdepth = 0                 # literal <parameter=...> blocks open in the value (see _decide)
        self._skip_msg: str | None = None

    @property
    def in_call(self) -> bool:
        return self._state in self._CALL_STATES

    # -- helpers ----------------------------------------------------------------
    def _take(self, n: int) -> None:
        """Consume ``n`` characters of the call's text."""
        buf = self._buf
        self._raw.append(buf[:n])
        self._buf = buf[n:]

    def _start(self, name: str) -> None:
        self._fn = name
        self._index = self._start_call(name)
        params = self.tools.get(name) if isinstance(self.tools, Mapping) else None
        props = params.get("properties") if isinstance(params, Mapping) else None
        self._props = props if isinstance(props, Mapping) and props else None
        self._args = {}

    def _end_call(self) -> None:
        index = self._index
        assert index is not None
        self._out.append(ArgumentsDelta(index, "}" if self._args else "{}"))
        self._out.append(ToolCallEnd(index, self._fn, self._args))
        self._index = None
        self._raw = []

    def _call_error(self, msg: str, extra: str = "") -> None:
        """The started call is malformed: report it, then drop its text up to ``</function>``/``</tool_call>``."""
        self._out.append(ParserError(self._index, msg, "".join(self._raw) + extra))
        self._index = None
        self._raw = []
        self._state = "skip"

    def _envelope_error(self, msg: str) -> None:
        """No call started: the error is reported with all it swallowed, once the skip ends."""
        self._skip_msg = msg
        self._state = "skip"

    def _end_skip(self) -> None:
        if self._skip_msg is not None:
            self._out.append(ParserError(None, self._skip_msg, "".join(self._raw)))
            self._skip_msg = None
        self._raw = []

    def _known(self, name: str, implicit: bool) -> bool:
        """Whether ``<parameter=name>`` inside a value is structural (see the module doc)."""
        if implicit and (name == self._key or name in self._args):
            return False
        return self._props is None or name in self._props

    def _field(self, text: str) -> None:
        if text.startswith("\n"):
            text = text[1:]
        if text.endswith("\n"):
            text = text[:-1]
        key = self._key
        value = typed_value(text, self._props.get(key) if self._props is not None else None)
        index = self._index
        assert index is not None
        self._out.append(arguments_delta(index, not self._args, key, value))
        self._args[key] = value
        self._out.append(FieldComplete(index, key, value))

    # -- the state machine ------------------------------------------------------
    def _feed(self, final: bool = False) -> None:  # noqa: C901
        while True:
            st = self._state
            buf = self._buf
            if st == "text":
                end, marker = split_text(buf, (OPEN, FUNC))
                if final and marker is None:
                    end = len(buf)
                self._emit_text(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                self._buf = buf[end + len(marker):]
                self._raw = [marker]
                self._wrapped = marker == OPEN
                self._state = "open" if self._wrapped else "name"
            elif st == "open":
                k = len(buf) - len(buf.lstrip(_WS))
                rest = buf[k:]
                if not rest:
                    return
                if rest.startswith(FUNC):
                    self._take(k + len(FUNC))
                    self._state = "name"
                elif FUNC.startswith(rest):
                    return  # undecided (at the end of the output: unterminated)
                else:
                    self._envelope_error(f"expected {FUNC}NAME> after {OPEN}")
            elif st == "name":
                how, i = name_end(buf, 0, _FUNC_NAME)
                if how == "more":
                    return
                if how == "bad":
                    if self._wrapped:
                        self._take(i)
                        self._envelope_error("malformed function name")
                    else:  # a bare "<function=" in prose: text
                        self._emit_text(FUNC)
                        self._raw = []
                        self._state = "text"
                    continue
                name = buf[:i]
                self._take(i + 1)
                if self._wrapped:
                    self._start(name)
                    self._state = "body"
                else:
                    self._fn = name
                    self._state = "confirm"
            elif st == "confirm":  # a bare <function=NAME>: a call only if its body starts like one
                k = len(buf) - len(buf.lstrip(_WS))
                rest = buf[k:]
                if not rest:
                    return
                if rest.startswith((PARAM, FUNC_END)):
                    self._take(k)
                    self._start(self._fn)
                    self._state = "body"
                elif (PARAM.startswith(rest) or FUNC_END.startswith(rest)) and not final:
                    return
                else:
                    self._emit_text("".join(self._raw))
                    self._raw = []
                    self._state = "text"
            elif st == "body":
                k = len(buf) - len(buf.lstrip(_WS))
                rest = buf[k:]
                if not rest:
                    self._take(k)
                    return
                if rest.startswith(PARAM):
                    self._take(k + len(PARAM))
                    self._state = "pname"
                elif rest.startswith(FUNC_END):
                    self._take(k + len(FUNC_END))
                    self._end_call()
                    self._state = "post"
                elif rest.startswith(CLOSE):  # </function> missing
                    self._take(k + len(CLOSE))
                    self._end_call()
                    self._state = "text"
                elif rest.startswith((OPEN, FUNC)):
                    self._take(k)
                    self._call_error(f"expected {FUNC_END} before the next call")
                    self._state = "text"
                elif any(m.startswith(rest) for m in (PARAM, FUNC_END, CLOSE, OPEN, FUNC)) and not final:
                    self._take(k)
                    return
                else:  # text that is not a tag: dropped, as the reference parsers drop it
                    j = rest.find("<", 1)
                    self._take(k + (len(rest) if j == -1 else j))
            elif st == "pname":
                how, i = name_end(buf, 0, _PARAM_NAME)
                if how == "more":
                    return
                if how == "bad":
                    self._call_error("malformed parameter name", buf[:i])
                    self._buf = buf[i:]
                    continue
                self._key = buf[:i]
                self._take(i + 1)
                self._vscan = self._vdepth = 0
                self._state = "value"
            elif st == "value":
                if not self._value(final):
                    return
            elif st == "post":  # after </function>: an optional </tool_call>
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest.startswith(CLOSE):
                    self._buf = rest[len(CLOSE):]
                    self._state = "text"
                elif CLOSE.startswith(rest) and not final:
                    return
                else:
                    self._state = "text"
            else:  # skip: drop a broken call's text up to </function> or </tool_call>
                end, marker = split_text(buf, (FUNC_END, CLOSE))
                if marker is None:
                    self._raw.append(buf[:end])
                    self._buf = buf[end:]
                    return
                self._raw.append(buf[:end])
                self._end_skip()
                self._buf = buf[end + len(marker):]
                self._state = "post" if marker == FUNC_END else "text"

    def _value(self, final: bool) -> bool:
        """Look for the tag that ends the current value; True once the value is complete."""
        v = self._buf
        i = self._vscan
        while True:
            j = v.find("<", i)
            if j == -1:
                self._vscan = len(v)
                return False
            if self._vdepth and v.startswith(PARAM_END, j):  # closes a literal <parameter=...> of the value
                self._vdepth -= 1
                i = j + 1
                continue
            how = self._decide(v, j, final)
            if how is None:
                self._vscan = j
                return False
            if how <= 0:
                self._vdepth -= how  # -1: a literal <parameter=...> opens inside the value
                i = j + 1
                continue
            text = v[:j]
            self._take(j + len(PARAM_END) if how == 1 else j)
            self._field(text)
            self._state = "body"
            return True

    def _after(self, look: str, tags: tuple[str, ...], final: bool) -> int | None:
        """After an end tag: 2 (an implicit close) if ``look`` (what follows it, whitespace stripped) starts
        with one of ``tags`` or the output ends there, 0 if it cannot, None if it cannot tell yet."""
        if not look:
            return 2 if final else None
        if look.startswith(tags):
            return 2
        return None if not final and any(t.startswith(look) for t in tags) else 0

    def _decide(self, v: str, j: int, final: bool) -> int | None:  # noqa: C901
        """The tag at ``v[j]`` (outside literal ``<parameter=`` blocks of the value): 1 closes the value
        (``</parameter>``, consumed), 2 closes it implicitly (the tag stays for the body), 0 is text of the
        value, -1 opens a literal ``<parameter=...>`` block in it, None: cannot tell yet."""
        wait = 0 if final else None
        if v.startswith(PARAM_END, j):
            look = v[j + len(PARAM_END):].lstrip(_WS)
            if not look:
                return 1 if final else None
            if look.startswith(PARAM):
                how, i = name_end(look, len(PARAM), _PARAM_NAME)
                if how == "more":
                    return wait
                return 1 if how == "ok" and self._known(look[len(PARAM):i], False) else 0
            if look.startswith((FUNC_END, CLOSE)):
                return 1
            return wait if any(m.startswith(look) for m in (PARAM, FUNC_END, CLOSE)) else 0
        if v.startswith(PARAM, j):
            if j and v[j - 1] != "\n":
                return 0
            how, i = name_end(v, j + len(PARAM), _PARAM_NAME)
            if how == "more":
                return wait
            if how == "bad":
                return 0
            return 2 if self._known(v[j + len(PARAM):i], True) else -1
        if v.startswith(FUNC_END, j):  # </parameter> missing: the call ends here if another one follows
            look = v[j + len(FUNC_END):].lstrip(_WS)
            if look.startswith(CLOSE):
                return self._after(look[len(CLOSE):].lstrip(_WS), (OPEN, FUNC), final)
            if CLOSE.startswith(look) and look and not final:
                return None
            return self._after(look, (OPEN, FUNC), final)
        if v.startswith(CLOSE, j):  # </parameter> and </function> missing
            return self._after(v[j + len(CLOSE):].lstrip(_WS), (OPEN, FUNC), final)
        rest = v[j:j + len(PARAM_END)]
        return wait if any(m.startswith(rest) for m in (PARAM_END, PARAM, FUNC_END, CLOSE)) else 0

    def _finish(self) -> None:
        self._feed(final=True)
        st = self._state
        buf = self._buf
        if st in ("text", "post"):
            self._emit_text(buf)
        elif st == "name" and not self._wrapped:  # "<function=..." at the very end: it was text
            self._emit_text(FUNC + buf)
        elif st == "confirm":
            self._emit_text("".join(self._raw) + buf)
        elif st == "skip":
            self._raw.append(buf)
            self._end_skip()
        else:  # open, name, body, pname, value: a call cut off
            self._out.append(ParserError(self._index, "unterminated tool call", "".join(self._raw) + buf))
            self._index = None
        self._buf = ""
        self._raw = []
