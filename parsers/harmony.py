"""The harmony format of OpenAI's gpt-oss models: reasoning, preambles, calls and the answer, as messages.

After the generation prompt (``<|start|>assistant``) the model writes a sequence of messages,
each ``{header}<|message|>{body}`` closed by ``<|end|>``, ``<|return|>`` (done) or ``<|call|>``
(a tool call); every message after the first opens with ``<|start|>assistant``::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The header holds the channel (``<|channel|>analysis``), the recipient (``to=functions.NAME``,
before or after the channel: ``assistant to=functions.f<|channel|>commentary json`` too) and
the content type (``<|constrain|>json``, or a bare ``json``; optional).  This parser owns the
whole output grammar, reasoning included, and decides, following vLLM's harmony path (its
``openai`` tool parser and its streaming delta extraction) and openai-harmony's own header parser:

* ``analysis`` messages are :class:`~.events.Reasoning`, streamed as they decode (two analysis
  messages are joined with a newline, as vLLM joins them); never content.  Channel names are
  matched by prefix, case aside (``ANALYSIS``), as SGLang matches them.
* A message to ``functions.NAME`` is a call of ``NAME`` (whatever its channel, as vLLM's
  parser reads it); so is a message to a bare ``NAME`` that is one of the request's tools
  (``to=get_weather``, which SGLang's detector accepts).  Its body is JSON arguments, scanned
  by :class:`~.jsonscan.JsonCall`, so ``ArgumentsDelta`` carries the model's bytes and
  ``FieldComplete`` fires per field.  An empty body is ``{}`` (vLLM passes ``""`` on); a body
  that is not a JSON object is a ``ParserError`` (vLLM passes the raw text on as arguments,
  which no OpenAI client can use).  The call ends when its object closes (text after it up to
  the message's end is a ``ParserError``).
* A message to any other recipient (gpt-oss's built-in ``browser.search``, ``python``,
  ``container.exec``) is not a call: the gateway offers functions only, and vLLM's Responses
  path turns these into reasoning items.  Its body is ``Reasoning``, never content or a call
  (a gateway tool named ``python`` is called as ``functions.python``, the name the prompt gives it).
* ``commentary`` without a recipient (a preamble, shown to users), ``final``, a message with
  no channel or an unknown one: ``Text``, as vLLM's chat path treats them.
* Messages of other roles in the output (a model writing ``<|start|>functions.f
  to=assistant...``, a made-up tool result) are dropped, as vLLM drops them.
* Output that does not open with a header (a model that answers plain text) is ``Text`` up to
  the next ``<|start|>``/``<|channel|>`` (a message follows) or end marker (dropped); so is text
  between or after messages (SGLang keeps it too).  A header is recognised by its first
  characters: ``<|start|>``, ``<|channel|>``, ``<|constrain|>``, ``<|message|>``, ``to=`` or
  ``assistant`` followed by one of those.  Text decoded with the markers stripped
  (``analysis...assistantfinal...``, SGLang's fallback) is not read: this format's markers are
  special tokens the gateway always decodes for the parser.
* Several calls in one output.  Real gpt-oss ends its turn at ``<|call|>`` (a stop token), so it
  calls one function per turn; a harmony-rendered transcript chains them as ``...<|call|><|start|>
  assistant<|channel|>commentary to=functions.g...``, which vLLM's parser reads as several calls.
  This parser reads on after ``<|call|>`` the same way: every later message is parsed, calls
  included (``render_calls`` and the parallel grammar write several calls like that), and a
  final answer after a call is content (as vLLM keeps it; SGLang drops it).
* Lenient where peers' outputs need it: a header may start right after a message's end without
  ``<|start|>assistant`` (SGLang's abbreviated headers; a turn opened by a non-harmony chat
  template; a kept reasoning followed by its calls); ``<|start|>`` inside a body ends that body
  (llama.cpp's server strips ``<|end|>``); a stray end marker is dropped.  A recipient is only ever ``to=X``: a
  bare word in the header is the content type (openai-harmony would read a lone bare word as
  the recipient, which would make ``<|channel|>final json`` a call to ``json``).
* Whitespace between messages is layout; bodies come out verbatim.  A header cut off by the
  end of the stream, or broken by an end marker before ``<|message|>``, is dropped, unless it
  names a function: then it is a ``ParserError`` (a call that never got its arguments).

:class:`HarmonyFormat` writes the same grammar: tools as the TypeScript-like ``namespace
functions`` of the developer message, calls as above, results as ``<|start|>functions.NAME
to=assistant<|channel|>commentary<|message|>...<|end|>`` messages, earlier reasoning as an
``analysis`` message, and the forcing grammar writes the call message directly (no analysis
message first: a forced reply is the call).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .base import IdFactory, StreamingParser, split_text
from .events import ArgumentsDelta, ParserError, ToolCallEnd
from .formats import CannotForce, ToolFormat
from .jsonscan import JsonCall

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"

_WS = " \t\r\n"
#: markers that close a message body (``<|start|>`` only implicitly: it opens the next one)
_ENDS = (END, RETURN, CALL)
_BODY_STOP = (END, RETURN, CALL, START)
#: what ends a header: ``<|message|>``, or (malformed) a marker that ends or opens a message
_HEADER_STOP = (MESSAGE, END, RETURN, CALL, START)
#: plain text ends where a message opens or an end marker stands
_PLAIN_STOP = (START, CHANNEL, END, RETURN, CALL)
#: how a header opens when ``<|start|>`` is not written (the generation prompt wrote it)
_HEADS = (CHANNEL, CONSTRAIN, MESSAGE, "to=", "assistant" + CHANNEL, "assistant to=", "assistant" + MESSAGE,
          "assistant" + CONSTRAIN)
_FUNCTIONS = "functions."


# ===================================================================== the format
def _ts_type(schema: Any, indent: str = "") -> str:
    """A JSON schema as the TypeScript-like type harmony's developer message uses (a compact version
    of openai-harmony's ``json_schema_to_typescript``: descriptions as comments, ``?`` for optional
    properties, enums as unions of literals, ``integer`` as ``number``).  A description is written
    whole after ``//`` (openai-harmony comments each of its lines): the prompt renderer passes it as
    untrusted text, whose characters must come through unchanged."""
    if not isinstance(schema, Mapping):
        return "any"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in enum)
    for key in ("oneOf", "anyOf"):
        alts = schema.get(key)
        if isinstance(alts, list) and alts:
            return " | ".join(_ts_type(a, indent) for a in alts)
    ty = schema.get("type")
    if isinstance(ty, list):
        return " | ".join("number" if t == "integer" else str(t) for t in ty) or "any"
    if ty == "object" or (ty is None and "properties" in schema):
        props = schema.get("properties")
        if not isinstance(props, Mapping) or not props:
            return "object"
        req = schema.get("required")
        required = {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()
        inner = indent + "  "
        lines = ["{"]
        for key, sub in props.items():
            desc = sub.get("description") if isinstance(sub, Mapping) else None
            if isinstance(desc, str) and desc:
                lines.append(f"{inner}// {desc}")
            line = f"{inner}{key}{'' if key in required else '?'}: {_ts_type(sub, inner)},"
            if isinstance(sub, Mapping) and "default" in sub:
                line += f" // default: {json.dumps(sub['default'], ensure_ascii=False)}"
            lines.append(line)
        lines.append(indent + "}")
        return "\n".join(lines)
    if ty == "array":
        items = schema.get("items")
        if not isinstance(items, Mapping):
            return "Array<any>"
        item = _ts_type(items, indent)
        return f"({item})[]" if " | " in item else f"{item}[]"
    return {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
            "null": "null"}.get(ty, "any")  # type: ignore[arg-type]


class HarmonyFormat(ToolFormat):
    """gpt-oss's harmony messages; see the module docstring.

    ``call_end`` is ``<|call|>``, which closes every call message (on gpt-oss a stop token);
    ``call_start`` is where a forced call's text begins.  A tool result needs the name of the
    call it answers (its author is ``functions.NAME``): ``results_named`` tells the prompt
    renderer to pass the names to :meth:`render_results`.
    """

    name = "harmony"
    call_end = (CALL,)
    special_tokens = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
    call_start = (CHANNEL + "commentary to=",)
    #: a call message after the first of a turn opens a new assistant message
    call_separator = START + "assistant"
    #: gpt-oss keeps the reasoning of the assistant turns after the last user message (the tool-calling
    #: chain in progress) and drops it once a turn ended in a ``final`` answer: its chat template and
    #: the harmony guide ("drop any previous CoT ... the exception is tool/function calling")
    reasoning_keep = "last"
    #: :meth:`render_results` / :meth:`render_result` take the names of the calls answered
    results_named = True

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        """The developer message's ``# Tools`` section, harmony style, and how a call is written."""
        out = ["# Tools", "", "## functions", "", "namespace functions {", ""]
        for fn in functions:
            desc = fn.get("description")
            if isinstance(desc, str) and desc:
                out.append(f"// {desc}")
            params = fn.get("parameters")
            if isinstance(params, Mapping) and params.get("properties"):
                out.append(f"type {fn['name']} = (_: {_ts_type(params)}) => any;")
            else:
                out.append(f"type {fn['name']} = () => any;")
            out.append("")
        out.append("} // namespace functions")
        return ("\n".join(out) + "\n\nCalls to these tools must go to the commentary channel: 'functions'. "
                "To call one, write " + self.render_call("NAME", {}).replace("{}", "<JSON arguments>"))

    def render_call(self, name: str, arguments: Any) -> str:
        return (f"{CHANNEL}commentary to={_FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"
                f"{json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)}{CALL}")

    def render_result(self, content: str, name: str | None = None) -> str:
        """A tool message: its author is the function (``functions`` alone when the name is unknown)."""
        author = _FUNCTIONS + name if name else "functions"
        return f"{START}{author} to=assistant{CHANNEL}commentary{MESSAGE}{content}{END}"

    def render_results(self, contents: Sequence[str], names: Sequence[str | None] | None = None) -> str:
        names = list(names or ())
        return "".join(self.render_result(c, names[i] if i < len(names) else None) for i, c in enumerate(contents))

    def render_reasoning(self, text: str) -> str:
        """An earlier turn's kept reasoning (see ``reasoning_keep``): the ``analysis`` message that opens
        the assistant turn.  What follows it in the turn (its calls, its answer) opens with a header
        directly, which the parser reads as the next message."""
        return f"{CHANNEL}analysis{MESSAGE}{text}{END}"

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        functions = compiler.functions(tools, force)
        ch, cons, msg, call = (compiler.marker(m) for m in (CHANNEL, CONSTRAIN, MESSAGE, CALL))
        rules: list[str] = []
        alts: list[str] = []
        for i, (name, params) in enumerate(functions.items()):
            if any(c.isspace() for c in name) or "<|" in name:
                raise CannotForce(f"tools: function name {name!r} cannot be written in a harmony header "
                                  "(no whitespace or '<|' allowed)")
            rules.append(f"args_{i}: {compiler.json_rule(params)}")
            head = compiler.literal(f"commentary to={_FUNCTIONS}{name} ")
            alts.append(f'{ch} {head} {cons} "json" {msg} args_{i} {call}')
        more = f' ({compiler.marker(START)} "assistant" call)*' if parallel else ""
        lark = "\n".join([f"start: call{more}", "call: " + "\n    | ".join(alts)] + rules) + "\n"
        return compiler.tool_grammar(lark, functions)


HARMONY = HarmonyFormat()


# ===================================================================== the parser
def _parse_header(header: str, role_given: bool) -> tuple[str, str | None, str | None]:
    """``(role, channel, recipient)`` of a header (the text between ``<|start|>`` or the output's
    start and ``<|message|>``), read as openai-harmony reads it: the channel is the word after
    ``<|channel|>``; the rest split on whitespace is the role (when ``<|start|>`` was written), the
    recipient (``to=X``) and the content type (``<|constrain|>json``, ``json``; ignored)."""
    channel = None
    i = header.find(CHANNEL)
    if i != -1:
        j = k = i + len(CHANNEL)
        while k < len(header) and not header[k].isspace() and header[k] != "<":
            k += 1
        channel = header[j:k]
        header = header[:i] + " " + header[k:]
    parts = header.replace(CONSTRAIN, " " + CONSTRAIN).split()
    role = "assistant"
    if role_given and parts and not parts[0].startswith(("to=", CONSTRAIN)):
        role = parts.pop(0).split(":", 1)[0]  # ``assistant:name`` is the assistant too
    elif parts and parts[0] == "assistant":
        parts.pop(0)
    recipient = None
    for p in parts:
        if p.startswith("to="):
            recipient = p[3:]
    if recipient == "all":
        recipient = None
    return role, channel, recipient


class HarmonyParser(StreamingParser):
    """gpt-oss harmony output: reasoning, preambles, calls and the answer (see the module docstring).

    States: ``expect`` (a message may open; whitespace here is layout), ``header`` (up to
    ``<|message|>``), ``body`` (a message that is not a call: text, reasoning or dropped),
    ``args_pre`` / ``args`` / ``args_post`` (a call's body: before, inside and after its JSON
    object), ``skip`` (the rest of a broken call message), ``plain`` (text with no header).
    """

    name = "harmony"
    format = HARMONY

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self._state = "expect"
        self._ws = ""              # whitespace held in ``expect``: layout before a header, text before plain text
        self._seen = False         # a message (or plain text) has been read: whitespace in ``expect`` is layout
        self._header = ""          # the current header so far
        self._role_given = False   # the header followed ``<|start|>``: it names its role
        self._kind = "text"        # body: "text" | "reasoning" | "drop"
        self._fname = ""           # the function a call message names
        self._call: JsonCall | None = None
        self._fresh = False        # at the start of a body (a reasoning body may need its separator)
        self._reasoned = False     # a reasoning message has been emitted (the next one is joined by "\n")
        self._err: str | None = None  # a ParserError reported when the broken message ends
        self._raw = ""             # the text that error swallowed

    @property
    def in_call(self) -> bool:
        return self._state in ("args_pre", "args")

    # -- states ---------------------------------------------------------------
    def _feed(self) -> None:  # noqa: C901 - one state machine
        while True:
            st = self._state
            buf = self._buf
            if not buf:
                return
            if st == "expect":
                rest = buf.lstrip(_WS)
                self._ws += buf[: len(buf) - len(rest)]
                self._buf = rest
                if not rest:
                    return
                if rest.startswith(START):
                    self._open(rest[len(START):], True)
                elif rest.startswith(_ENDS):  # a stray end marker: nothing to close
                    m = next(e for e in _ENDS if rest.startswith(e))
                    self._buf = rest[len(m):]
                elif rest.startswith(_HEADS):
                    self._open(rest, False)
                elif any(h.startswith(rest) for h in (START, *_ENDS, *_HEADS)):
                    return  # a header may be opening: wait for the next characters
                else:  # plain text: the whitespace before it is its own
                    self._emit_text(self._ws)
                    self._ws = ""
                    self._seen = True
                    self._state = "plain"
            elif st == "plain":
                end, marker = split_text(buf, _PLAIN_STOP)
                self._emit_text(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                if marker == START:
                    self._open(buf[end + len(START):], True)
                elif marker == CHANNEL:
                    self._open(buf[end:], False)
                else:
                    self._buf = buf[end + len(marker):]
                    self._state = "expect"
            elif st == "header":
                end, marker = split_text(buf, _HEADER_STOP)
                self._header += buf[:end]
                if marker is None:
                    self._buf = buf[end:]
                    return
                if marker == MESSAGE:
                    self._buf = buf[end + len(marker):]
                    self._begin_body()
                else:
                    self._bad_header("malformed tool call: its header has no <|message|>")
                    if marker == START:
                        self._open(buf[end + len(START):], True)
                    else:
                        self._buf = buf[end + len(marker):]
                        self._state = "expect"
            elif st == "body":
                end, marker = split_text(buf, _BODY_STOP)
                self._body(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                self._end_message(buf, end, marker)
            elif st == "args_pre":
                rest = buf.lstrip(_WS)
                self._raw += buf[: len(buf) - len(rest)]
                self._buf = rest
                if not rest:
                    return
                if rest[0] == "{":
                    self._call = JsonCall(self, name=self._fname)
                    self._state = "args"
                    continue
                m = next((e for e in _BODY_STOP if rest.startswith(e)), None)
                if m is not None:  # an empty body: a call without arguments
                    index = self._start_call(self._fname)
                    self._out += [ArgumentsDelta(index, "{}"), ToolCallEnd(index, self._fname, {})]
                    self._end_message(rest, 0, m)
                elif any(e.startswith(rest) for e in _BODY_STOP):
                    return
                else:
                    self._err = f"the arguments of {self._fname!r} are not a JSON object"
                    self._raw = self._header + MESSAGE + self._raw
                    self._state = "skip"
            elif st == "args":
                call = self._call
                assert call is not None
                self._buf = ""
                call.feed(buf)
                if call.done:
                    self._buf = call.text[call.end:]
                    self._state = "args_post"
                elif call.error is not None:
                    self._out.append(ParserError(call.index, call.error, call.text[: call.pos]))
                    self._buf = call.text[call.pos:]
                    self._err, self._raw = None, ""  # reported: the rest of the message is skipped quietly
                    self._state = "skip"
                else:
                    return
            elif st == "args_post":
                rest = buf.lstrip(_WS)
                m = next((e for e in _BODY_STOP if rest.startswith(e)), None)
                if m is not None:
                    self._end_message(rest, 0, m)
                elif not rest or any(e.startswith(rest) for e in _BODY_STOP):
                    return
                else:  # the call has ended: what follows up to the message's end is reported alone
                    self._err = "unexpected text after a tool call's arguments"
                    self._raw = ""
                    self._state = "skip"
            else:  # skip: the rest of a broken call message, up to its end
                end, marker = split_text(buf, _BODY_STOP)
                self._raw += buf[:end]
                if marker is None:
                    self._buf = buf[end:]
                    return
                self._report()
                self._end_message(buf, end, marker)

    def _finish(self) -> None:
        st = self._state
        buf = self._buf
        if st == "expect":
            rest = self._ws + buf
            if rest.strip(_WS) or not self._seen:  # a partial marker is text; whitespace alone is the answer
                self._emit_text(rest)
        elif st == "plain":
            self._emit_text(buf)
        elif st == "header":
            self._header += buf
            self._bad_header("unterminated tool call")
        elif st == "body":
            self._body(buf)
        elif st == "args_pre":
            self._out.append(ParserError(None, "unterminated tool call", self._header + MESSAGE + self._raw + buf))
        elif st == "args":
            call = self._call
            assert call is not None
            self._out.append(ParserError(call.index, "unterminated tool call", call.text))
        elif st == "args_post":  # a complete call; a cut-off end marker after it is nothing
            rest = buf.lstrip(_WS)
            if rest and not any(e.startswith(rest) for e in _BODY_STOP):
                self._out.append(ParserError(None, "malformed tool call: unexpected text after a tool call's "
                                             "arguments", buf))
        else:
            self._raw += buf
            self._report()
        self._buf = ""
        self._ws = ""

    # -- helpers ----------------------------------------------------------------
    def _open(self, rest: str, role_given: bool) -> None:
        """A header opens; ``rest`` is the input from its first character."""
        self._buf = rest
        self._ws = ""
        self._seen = True
        self._header = ""
        self._role_given = role_given
        self._state = "header"

    def _begin_body(self) -> None:
        role, channel, recipient = _parse_header(self._header, self._role_given)
        self._raw = ""
        self._fresh = True
        if role != "assistant":
            self._kind, self._state = "drop", "body"
        elif recipient is not None and (recipient.startswith(_FUNCTIONS) or recipient in self.tools):
            self._fname = recipient[len(_FUNCTIONS):] if recipient.startswith(_FUNCTIONS) else recipient
            if self._fname:
                self._state = "args_pre"
            else:
                self._err, self._state = "a tool call names no function", "skip"
                self._raw = self._header + MESSAGE
        else:
            analysis = channel is not None and channel.lower().startswith("analysis")
            self._kind = "reasoning" if recipient is not None or analysis else "text"
            self._state = "body"

    def _body(self, text: str) -> None:
        if not text:
            return
        if self._kind == "text":
            self._emit_text(text)
        elif self._kind == "reasoning":
            if self._fresh and self._reasoned:
                text = "\n" + text  # two reasoning messages: one reasoning, a line apart
            self._fresh = False
            self._reasoned = True
            self._emit_reasoning(text)

    def _end_message(self, buf: str, end: int, marker: str) -> None:
        """The current message ends at ``buf[end:]``, which starts with ``marker``."""
        if marker == START:
            self._open(buf[end + len(START):], True)
        else:
            self._buf = buf[end + len(marker):]
            self._state = "expect"

    def _bad_header(self, message: str) -> None:
        """A header that never reached ``<|message|>``: an error if it named a function, else nothing."""
        _, _, recipient = _parse_header(self._header, self._role_given)
        if recipient is not None and (recipient.startswith(_FUNCTIONS) or recipient in self.tools):
            self._out.append(ParserError(None, message, self._header))

    def _report(self) -> None:
        if self._err is not None:
            self._out.append(ParserError(None, f"malformed tool call: {self._err}", self._raw))
            self._err = None
        self._raw = ""


__all__ = ["HarmonyFormat", "HarmonyParser", "HARMONY"]
