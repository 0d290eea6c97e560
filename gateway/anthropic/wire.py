"""The Anthropic Messages wire format: the request schema and its validation,
its translation to the internal request (the validated chat-completions body
every API runs as: gateway/openai/wire.py), and the answer made of the agent
loop's events -- one ``message`` object or Anthropic's server-sent events.

Decisions worth knowing (README, "Anthropic Messages (Claude Code)"):

* Every field, block type and tool type outside what is listed in
  :data:`REQUEST_SCHEMA` is refused with a 400 naming it, never ignored.
  ``cache_control`` is accepted everywhere Anthropic takes it and has no
  effect: Interlace keeps prefixes itself (the prefix cache, the retained
  context of a tool call), and reports the hits as ``cache_read_input_tokens``.
* Consecutive turns of one role are merged into one turn, as Anthropic does;
  text blocks of a turn are joined by a blank line.  A first assistant turn
  is allowed; a *final* assistant turn (a prefill Anthropic continues) is
  refused: the chat renderer closes every assistant turn and opens a new one,
  so it cannot continue one.
* A ``tool_use`` turn becomes the chat path's assistant message with
  ``tool_calls`` (the arguments as JSON), a ``tool_result`` a ``tool``
  message naming the same id: the follow-up renders to the very tokens the
  chat path's follow-up does, so the retention store adopts the context the
  ``tool_use`` answer left (``cache_read_input_tokens``).  A ``tool_result``
  must answer a ``tool_use`` of the turn before it (Anthropic's rule), else
  400.  ``is_error: true`` prefixes the result with ``Error: `` so the model
  sees the tool failed.
* The ids of ``tool_use`` blocks are the agent loop's call ids, unchanged:
  no mapping to keep, and the follow-up's ``tool_result`` names what the
  retained context was made with.
* Usage: Anthropic's ``input_tokens`` excludes cache reads, so it is the
  prompt's tokens less ``cache_read_input_tokens``; ``cache_creation_input_tokens``
  is always 0 (nothing is written on request).  A stream's ``message_start``
  cannot know the cache reads yet (the engine adopts the context as it
  starts): it says the whole prompt, and ``message_delta`` gives the final
  ``input_tokens`` and ``cache_read_input_tokens`` (the client's stream
  helper takes them over).
* ``max_tokens`` larger than the context leaves is not an error: the output
  stops at the window with ``stop_reason: "model_context_window_exceeded"``,
  as Anthropic's current models do (Claude Code asks for 32,000 tokens by
  default, more than a small model's whole context).
* ``thinking`` is accepted (disabled, enabled with a budget, adaptive): a
  budget bounds the thinking and is not enforced apart from ``max_tokens``.
  A model configured with a reasoning parser answers its reasoning as a
  ``thinking`` block (``signature`` empty: nothing signs it) before its text
  and ``tool_use`` blocks, streamed with ``thinking_delta`` and closed with a
  ``signature_delta`` as Anthropic's are; a model without one writes no
  thinking blocks.  Assistant ``thinking`` blocks sent back become the turn's
  ``reasoning_content`` (the prompt renderer decides whether the model sees
  them again; the signature is not checked), ``redacted_thinking`` blocks are
  dropped (nothing here can read them).
* A ``tool_use`` block that the loop withdrew (it failed after it was passed
  on: completions.py) keeps a valid JSON ``input``, and the message's
  ``stop_reason`` is ``max_tokens`` when the output limit cut it, else
  ``end_turn`` -- never ``tool_use``, so Claude Code does not run it.
* ``role: "system"`` turns inside ``messages`` (Claude
  Code's mid-conversation system messages) are system messages where they
  stand.  A system block that starts with ``x-anthropic-billing-header:``
  (Claude Code's first block, different on every request) is not rendered:
  it is metadata for Anthropic's billing, and it would change every prompt
  from its first tokens on, so no kept context could be adopted.
* ``anthropic-beta`` headers are accepted and have no effect: a beta only
  unlocks request fields, block types or tool types, and each of those is
  refused here when used; Claude Code sends several on every request.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Dict, List, Optional, Tuple

import jsonschema

from ..errors import APIError, GatewayError, api_error
from ..openai import wire as chat_wire
from ..openai.completions import CallArgs, CallStart, Content, Finish, ReasoningText
from ..sampling import INT32_MAX, RequestValidator

#: Anthropic's ``cache_control``: accepted, no effect (see the module docstring).
CACHE_CONTROL = {"type": ["object", "null"], "required": ["type"], "additionalProperties": False,
                 "properties": {"type": {"const": "ephemeral"}, "ttl": {"enum": ["5m", "1h"]}}}
TEXT_BLOCK = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}, "cache_control": CACHE_CONTROL,
                             "citations": {"type": ["array", "null"], "maxItems": 0}}}
TOOL_USE_BLOCK = {"type": "object", "required": ["type", "id", "name", "input"], "additionalProperties": False,
                  "properties": {"type": {"const": "tool_use"}, "id": {"type": "string", "minLength": 1},
                                 "name": chat_wire.FUNCTION_NAME, "input": {"type": "object"},
                                 "cache_control": CACHE_CONTROL}}
TOOL_RESULT_BLOCK = {"type": "object", "required": ["type", "tool_use_id"], "additionalProperties": False,
                     "properties": {"type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
                                    "content": {"oneOf": [{"type": "string"},
                                                          {"type": "array", "items": TEXT_BLOCK}]},
                                    "is_error": {"type": "boolean"}, "cache_control": CACHE_CONTROL}}
#: An assistant turn's thinking, sent back (its text becomes the turn's reasoning_content; the
#: signature, opaque to clients, is not checked), and Anthropic's redacted thinking (dropped).
THINKING_BLOCK = {"type": "object", "required": ["type", "thinking"], "additionalProperties": False,
                  "properties": {"type": {"const": "thinking"}, "thinking": {"type": "string"},
                                 "signature": {"type": ["string", "null"]}}}
REDACTED_THINKING_BLOCK = {"type": "object", "required": ["type", "data"], "additionalProperties": False,
                           "properties": {"type": {"const": "redacted_thinking"}, "data": {"type": "string"}}}
#: The block types each role may send.
BLOCKS = {"user": {"text": TEXT_BLOCK, "tool_result": TOOL_RESULT_BLOCK},
          "assistant": {"text": TEXT_BLOCK, "tool_use": TOOL_USE_BLOCK, "thinking": THINKING_BLOCK,
                        "redacted_thinking": REDACTED_THINKING_BLOCK},
          # a system turn inside the conversation (Claude Code's mid-conversation system messages)
          "system": {"text": TEXT_BLOCK}}

REQUEST_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": INT32_MAX},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}]},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"enum": ["user", "assistant", "system"]},
                           # the blocks were checked against their role's types before (_check_blocks)
                           "content": {"oneOf": [{"type": "string"}, {"type": "array"}]}}}},
        "tools": {"type": "array", "items": {
            "type": "object", "required": ["name", "input_schema"], "additionalProperties": False,
            "properties": {"type": {"enum": ["custom", None]}, "name": chat_wire.FUNCTION_NAME,
                           "description": {"type": "string"},
                           "input_schema": {"type": "object", "required": ["type"],
                                            "properties": {"type": {"const": "object"}}},
                           "cache_control": CACHE_CONTROL}}},
        "tool_choice": {"type": "object", "required": ["type"], "additionalProperties": False,
                        "properties": {"type": {"enum": ["auto", "any", "tool", "none"]},
                                       "name": {"type": "string"},
                                       "disable_parallel_tool_use": {"type": "boolean"}}},
        "stop_sequences": {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1}},
        # Anthropic's range: 0 to 1
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
        "stream": {"type": "boolean"},
        "metadata": {"type": "object", "additionalProperties": False,
                     "properties": {"user_id": {"type": ["string", "null"], "maxLength": 256}}},
        # a budget is a bound, not enforced apart from max_tokens (module docstring)
        "thinking": {"type": "object", "required": ["type"], "additionalProperties": False,
                     "properties": {"type": {"enum": ["disabled", "enabled", "adaptive"]},
                                    "budget_tokens": {"type": "integer", "minimum": 1024, "maximum": INT32_MAX},
                                    "display": {"enum": ["summarized", "omitted"]}}},
        "service_tier": {"enum": ["auto", "standard_only"]},
        "output_config": {"type": "object", "additionalProperties": False, "properties": {
            "effort": {"type": "null", "description": "effort is not supported"},
            "format": {"type": ["object", "null"], "required": ["type", "schema"], "additionalProperties": False,
                       "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}}}},
        "interlace": {"type": "object", "additionalProperties": False, "properties": {
            "replay": chat_wire.CHAT_REQUEST_SCHEMA["properties"]["interlace"]["properties"]["replay"]}},
    },
}
#: What ``/v1/messages/count_tokens`` takes: the prompt's fields, nothing about generating.
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config")
COUNT_SCHEMA: Dict[str, Any] = {"type": "object", "required": ["model", "messages"],
                                "properties": {k: REQUEST_SCHEMA["properties"][k] for k in COUNT_FIELDS}}

_validators = {False: RequestValidator(REQUEST_SCHEMA), True: RequestValidator(COUNT_SCHEMA)}
_block_validators = {(role, kind): RequestValidator(schema) for role, kinds in BLOCKS.items()
                     for kind, schema in kinds.items()}

#: What the model reads before a failed tool's result (``tool_result.is_error``).
ERROR_PREFIX = "Error: "
#: Text blocks of one turn (the system's, a merged turn's) are joined by this.
BLOCK_SEPARATOR = "\n\n"


# ------------------------------------------------------------------ validation
def _refuse(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _check_fields(body: Any, count: bool) -> None:
    """A JSON object with no field outside the schema; the features Anthropic has and Interlace
    does not (extended thinking, server tools, server-side extension tools) named in the refusal."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_body")
    schema = COUNT_SCHEMA if count else REQUEST_SCHEMA
    known = schema["properties"]
    for name in body:
        if name not in known:
            raise APIError(400, f"{name}: unknown or unsupported field"
                                f"{' for count_tokens' if name in REQUEST_SCHEMA['properties'] else ''}",
                           param=name, code="unknown_parameter")
    for name in schema["required"]:
        if name not in body:
            raise APIError(400, f"{name}: field required", param=name, code="missing_required_parameter")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and (thinking.get("type") == "enabled") != ("budget_tokens" in thinking):
        raise _refuse("thinking.budget_tokens is required with type 'enabled' and only with it",
                      "thinking.budget_tokens")
    ext = body.get("interlace")
    if isinstance(ext, dict):
        for name in ext:
            if name != "replay":
                raise _refuse(f"interlace.{name} is not supported on /v1/messages (only interlace.replay; "
                              "server-side tools run on /v1/chat/completions and /v1/responses)",
                              f"interlace.{name}")
    for i, t in enumerate(body.get("tools") if isinstance(body.get("tools"), list) else ()):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in (None, "custom"):
            raise _refuse(f"tools[{i}].type: tools of type {kind!r} are not supported (only client tools: "
                          "name, description, input_schema)", f"tools[{i}].type")


def _check_blocks(messages: Any) -> None:
    """Each content block against its role's block types: an unknown or unsupported type (an image,
    a document, a server-tool block) is named as such, not as the schema's best guess."""
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in BLOCKS \
                or not isinstance(m.get("content"), list):
            continue  # the schema names what is wrong
        for j, block in enumerate(m["content"]):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(kind, str) or kind not in BLOCKS[m["role"]]:
                raise _refuse(f"{where}.type: blocks of type {kind!r} are not supported in {m['role']} turns "
                              f"(only {', '.join(BLOCKS[m['role']])})", f"{where}.type")
            err = jsonschema.exceptions.best_match(_block_validators[m["role"], kind].iter_errors(block))
            if err is not None:
                param = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
                raise _refuse(f"{param}: {err.message}", param)


def validate_request(body: Any, *, count: bool = False) -> Dict[str, Any]:
    """Check a parsed ``/v1/messages`` body (``count``: a ``count_tokens`` body) and translate it to
    the internal request.  Raises :class:`APIError` (400, ``param`` naming the Anthropic field)."""
    _check_fields(body, count)
    _check_blocks(body.get("messages"))
    chat_wire.check_schema(body, _validators[count])
    for i, t in enumerate(body.get("tools") or []):
        try:
            jsonschema.Draft202012Validator.check_schema(t["input_schema"])
        except jsonschema.SchemaError as e:
            raise _refuse(f"tools[{i}].input_schema is not a valid JSON Schema: {e.message}",
                          f"tools[{i}].input_schema")
    names = [t["name"] for t in body.get("tools") or []]
    if len(set(names)) != len(names):
        raise _refuse("tools: tool names must be unique", "tools")
    choice = body.get("tool_choice")
    if choice is not None:
        if choice["type"] == "tool" and "name" not in choice:
            raise _refuse("tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice.name")
        if choice["type"] != "tool" and "name" in choice:
            raise _refuse("tool_choice.name is only for tool_choice.type 'tool'", "tool_choice.name")
        if choice["type"] == "none" and "disable_parallel_tool_use" in choice:
            raise _refuse("tool_choice.disable_parallel_tool_use does not apply to type 'none'",
                          "tool_choice.disable_parallel_tool_use")
        if choice["type"] == "tool" and choice["name"] not in names:
            raise _refuse(f"tool_choice.name: {choice['name']!r} is not one of the tools "
                          f"({', '.join(names) or 'none given'})", "tool_choice.name")
        if choice["type"] == "any" and not names:
            raise _refuse("tool_choice 'any' needs at least one tool in tools", "tool_choice.type")
    chat = to_chat(body)
    try:  # what the chat path checks too (sizes, schemas): named in this API's fields
        chat_wire.validate_chat_request(chat)
    except APIError as e:
        raise rename(e) from None
    return chat


def _text(content: Any) -> str:
    return content if isinstance(content, str) else BLOCK_SEPARATOR.join(b["text"] for b in content)


#: The first system block Claude Code sends: billing metadata for Anthropic's API (its ``cch=``
#: changes with every request), not instructions.  Left in, it would make every request's prompt
#: differ from its first tokens on, so no kept context or cached prefix could ever match.
BILLING_HEADER = "x-anthropic-billing-header:"


def _system_text(system: Any) -> str:
    """The system prompt: a string, or its text blocks joined, without Claude Code's billing block."""
    if not isinstance(system, list):
        return system or ""
    return BLOCK_SEPARATOR.join(b["text"] for b in system if not b["text"].startswith(BILLING_HEADER))


def _merged(messages: List[Dict[str, Any]]) -> List[Tuple[str, List[Dict[str, Any]], int]]:
    """Consecutive turns of one role as one turn (Anthropic merges them): ``(role, blocks, index of
    the turn's last message)``, a string content as one text block."""
    out: List[Tuple[str, List[Dict[str, Any]], int]] = []
    for i, m in enumerate(messages):
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else list(m["content"])
        if out and out[-1][0] == m["role"]:
            out[-1] = (m["role"], out[-1][1] + blocks, i)
        else:
            out.append((m["role"], blocks, i))
    return out


def to_chat(body: Dict[str, Any]) -> Dict[str, Any]:
    """A checked Messages body as the internal request (a chat-completions body)."""
    messages: List[Dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    turns = _merged(body["messages"])
    if turns[-1][0] != "user":
        raise _refuse(f"messages[{turns[-1][2]}]: a final {turns[-1][0]} turn is not supported (an assistant one "
                      "would be a prefill to continue); the conversation must end with a user turn",
                      f"messages[{turns[-1][2]}].role")
    asked: Dict[str, int] = {}  # the tool_use ids of the turn before, not yet answered
    for role, blocks, last in turns:
        if role == "system":
            messages.append({"role": "system", "content": BLOCK_SEPARATOR.join(b["text"] for b in blocks)})
            continue
        if role == "assistant":
            text = BLOCK_SEPARATOR.join(b["text"] for b in blocks if b["type"] == "text")
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}}
                     for b in blocks if b["type"] == "tool_use"]
            if len({c["id"] for c in calls}) != len(calls):
                raise _refuse(f"messages[{last}]: tool_use ids must be unique", f"messages[{last}].content")
            thoughts = [b["thinking"] for b in blocks if b["type"] == "thinking"]
            messages.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {}),
                             **({"reasoning_content": BLOCK_SEPARATOR.join(thoughts)} if thoughts else {})})
            asked = {c["id"]: last for c in calls}
            continue
        texts: List[str] = []
        for b in blocks:
            if b["type"] == "text":
                texts.append(b["text"])
                continue
            if texts:  # text before a result: its own user turn, in order
                messages.append({"role": "user", "content": BLOCK_SEPARATOR.join(texts)})
                texts = []
            if b["tool_use_id"] not in asked:
                raise _refuse(f"messages[{last}]: tool_result names tool_use_id {b['tool_use_id']!r}, which no "
                              "tool_use block of the previous assistant turn has (or another tool_result answered)",
                              f"messages[{last}].content")
            del asked[b["tool_use_id"]]
            result = _text(b.get("content", ""))
            messages.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                             "content": ERROR_PREFIX + result if b.get("is_error") else result})
        if texts:
            messages.append({"role": "user", "content": BLOCK_SEPARATOR.join(texts)})
        asked = {}
    chat: Dict[str, Any] = {"model": body["model"], "messages": messages}
    if "max_tokens" in body:
        chat["max_tokens"] = body["max_tokens"]
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {
            "name": t["name"], "parameters": t["input_schema"],
            **({"description": t["description"]} if "description" in t else {})}} for t in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice["type"]) or {
            "type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("stop_sequences", "stop"), ("stream", "stream")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if (body.get("metadata") or {}).get("user_id") is not None:
        chat["user"] = body["metadata"]["user_id"]
    fmt = (body.get("output_config") or {}).get("format")
    if fmt:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if "interlace" in body:
        chat["interlace"] = dict(body["interlace"])
    return chat


#: Internal (chat-completions) field names and the Messages fields they came from.
_RENAMES = [(re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
            (re.compile(r"^tools\[(\d+)\]\.function\.(\w+)"), r"tools[\1].\2"),
            (re.compile(r"^messages(\[\d+\][\w.\[\]]*)?"), "messages"),
            (re.compile(r"^stop\b"), "stop_sequences"),
            (re.compile(r"^max_completion_tokens\b"), "max_tokens"),
            (re.compile(r"^response_format(\.json_schema)?"), "output_config.format"),
            (re.compile(r"^user\b"), "metadata.user_id")]


def _rename_field(name: str) -> str:
    for pattern, repl in _RENAMES:
        if pattern.match(name):
            return pattern.sub(repl, name, count=1)
    return name


def rename(err: Exception) -> APIError:
    """An error that names internal (chat-completions) fields -- the plan's, the chat checks' --
    naming this API's fields instead (the message's leading field too)."""
    e = api_error(err) if isinstance(err, GatewayError) else err
    assert isinstance(e, APIError)
    if not e.param:
        return e
    new = _rename_field(e.param)
    message = new + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, e.type, param=new, code=e.code, headers=e.headers)


# ------------------------------------------------------------------ answers
def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def stop_reason(finish: Finish, window: Optional[int] = None) -> str:
    """Anthropic's ``stop_reason`` of the loop's finish; ``window``: the output tokens the context
    had room for when ``max_tokens`` asked for more (None: it did not)."""
    if finish.reason == "tool_calls":
        return "tool_use"
    if finish.reason == "length":
        full = window is not None and finish.usage["completion_tokens"] >= window
        return "model_context_window_exceeded" if full else "max_tokens"
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"


def usage(u: Dict[str, Any]) -> Dict[str, int]:
    """Anthropic's usage of the loop's (chat) usage: ``input_tokens`` excludes the cache reads."""
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message(mid: str, model: str, content: List[Dict[str, Any]], stop: Optional[str],
            stop_sequence: Optional[str], use: Dict[str, int]) -> Dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": stop_sequence, "usage": use}


def sse(event: Dict[str, Any]) -> bytes:
    """One server-sent event, named by its ``type`` as Anthropic's are."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


class Blocks:
    """The agent loop's events as Anthropic's stream events: thinking, text and ``tool_use`` blocks
    in order, each opened, filled and closed (a thinking block with a ``signature_delta`` of its
    empty signature before it closes, as Anthropic's).  Whitespace the model writes before a call is not a block (the
    chat path renders it away when the conversation comes back, so the follow-up's tokens match);
    whitespace before text is kept with it.  The non-streamed answer is these events folded
    (:func:`fold`), so both answers are one translation."""

    def __init__(self, window: Optional[int] = None) -> None:
        self.window = window           # the output's room in the context, when max_tokens asked for more
        self.n = 0                     # blocks opened
        self.open: Optional[str] = None
        self.pending = ""              # whitespace not yet shown: it opens a text block only with text after it
        self.calls = 0

    def _start(self, block: Dict[str, Any]) -> List[Dict[str, Any]]:
        out = self.close()
        self.open = block["type"]
        out.append({"type": "content_block_start", "index": self.n, "content_block": block})
        self.n += 1
        return out

    def close(self) -> List[Dict[str, Any]]:
        if self.open is None:
            return []
        out: List[Dict[str, Any]] = []
        if self.open == "thinking":
            out.append({"type": "content_block_delta", "index": self.n - 1,
                        "delta": {"type": "signature_delta", "signature": ""}})
        self.open = None
        return out + [{"type": "content_block_stop", "index": self.n - 1}]

    def _text(self, text: str) -> List[Dict[str, Any]]:
        return [{"type": "content_block_delta", "index": self.n - 1, "delta": {"type": "text_delta", "text": text}}]

    def feed(self, ev: Any) -> List[Dict[str, Any]]:
        if isinstance(ev, ReasoningText):
            out = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
            return out + [{"type": "content_block_delta", "index": self.n - 1,
                           "delta": {"type": "thinking_delta", "thinking": ev.text}}]
        if isinstance(ev, Content):
            if self.open == "text":
                return self._text(ev.text)
            text, self.pending = self.pending + ev.text, ""
            if not text.strip():
                self.pending = text
                return []
            return self._start({"type": "text", "text": ""}) + self._text(text)
        if isinstance(ev, CallStart) and not ev.server:
            self.pending, self.calls = "", self.calls + 1
            return self._start({"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        if isinstance(ev, CallArgs) and not ev.server and self.open == "tool_use":
            return [{"type": "content_block_delta", "index": self.n - 1,
                     "delta": {"type": "input_json_delta", "partial_json": ev.fragment}}]
        return []

    def finish(self, finish: Finish) -> List[Dict[str, Any]]:
        """The events that end the message: the last block closed, ``message_delta``, ``message_stop``."""
        out: List[Dict[str, Any]] = []
        if self.pending and not self.calls:  # an answer of whitespace only is still the answer
            out += self._start({"type": "text", "text": ""}) + self._text(self.pending)
        self.pending = ""
        out += self.close()
        out.append({"type": "message_delta", "delta": {"stop_reason": stop_reason(finish, self.window),
                                                       "stop_sequence": finish.stop_sequence},
                    "usage": usage(finish.usage)})
        out.append({"type": "message_stop"})
        return out


def fold(msg: Dict[str, Any], events: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The ``message`` that ``events`` (of :class:`Blocks`) build on ``msg`` (``message_start``'s)."""
    args: Dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            msg["content"].append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            kind = e["delta"]["type"]
            if kind == "text_delta":
                msg["content"][e["index"]]["text"] += e["delta"]["text"]
            elif kind == "thinking_delta":
                msg["content"][e["index"]]["thinking"] += e["delta"]["thinking"]
            elif kind == "signature_delta":
                msg["content"][e["index"]]["signature"] = e["delta"]["signature"]
            else:
                args[e["index"]] = args.get(e["index"], "") + e["delta"]["partial_json"]
        elif e["type"] == "content_block_stop" and e["index"] in args:
            msg["content"][e["index"]]["input"] = json.loads(args[e["index"]])
        elif e["type"] == "message_delta":
            msg.update(e["delta"])
            msg["usage"] = e["usage"]
    return msg
