"""The OpenAI Responses API wire format: the request schema and its
validation, the translation of a request (and the stored conversation that
``previous_response_id`` names) to the internal request -- a validated
chat-completions body, what every API's wire module translates to -- and the
answer made of the agent loop's events: output items, the ``Response`` object
and the typed server-sent events (:class:`OutputBuilder`).

Decisions:

* **One internal request.**  Input items become chat messages exactly as the
  chat path would send them back (assistant text as written; ``function_call``
  items as ``tool_calls`` of the assistant message before them;
  ``function_call_output`` as ``tool`` messages), so a follow-up's rendered
  prompt starts with the stored prompt + reply and adopts the kept engine
  context (gateway/retention.py matches by token prefix).  Server-side calls
  (``mcp_call`` items) are kept in the conversation as the call and its
  result, in the order they ran, since that is what the context holds.
* **Refused, never ignored.**  A field outside the schema is a 400 naming it;
  a field Interlace does not implement is accepted only at its neutral value
  (``truncation: "disabled"``, an empty ``reasoning``, ``top_logprobs: 0``,
  ``include`` values that change nothing here since no such item is ever
  produced -- ``reasoning.encrypted_content``, which Codex sends, among them).
* **Errors name this API's fields.**  The planner names chat fields
  (``messages``, ``max_tokens``, ``response_format``); :func:`rename_error`
  maps them back (``input``, ``max_output_tokens``, ``text.format``).
* **Reasoning** (a model with a reasoning parser) is a ``reasoning`` output item
  with one ``reasoning_text`` part (``summary`` empty: nothing summarizes it),
  before the message or calls of its turn; streamed as OpenAI streams one
  (``response.output_item.added``, ``response.content_part.added``,
  ``response.reasoning_text.delta`` ... ``.done``, ``response.content_part.done``,
  ``response.output_item.done``).  A ``reasoning`` input item (sent back by a
  client that manages its own context) is accepted: its ``content`` text becomes
  the ``reasoning_content`` of the assistant turn that follows it (the prompt
  renderer decides whether the model sees it again); its ``summary`` and
  ``encrypted_content`` are not used.  A stored response keeps it the same way.
* **A withdrawn call** (completions.py: a client call that failed after it was
  passed on) is a ``function_call`` item done with ``status: "incomplete"``,
  its arguments closed to a valid JSON object.  The response is ``incomplete``
  (``max_output_tokens``) when the output limit cut it, else ``completed``: the
  model did finish, with a broken call, and ``incomplete_details`` has no reason
  for that; the item's status is what tells a client not to run it.
* Remote MCP servers (``server_url``) are refused: ``{"type": "mcp",
  "server_label": NAME}`` names a configured ``mcp_servers`` entry, and
  ``server_label: "interlace"`` the gateway's own plugin tools.  They run in
  the same agent loop, under the same key permissions, as
  ``interlace.server_tools``; only ``require_approval: "never"`` is possible.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from ..config import RESERVED_MCP_LABEL
from ..errors import APIError, GatewayError, api_error
from ..openai import wire as chat_wire
from ..openai.completions import CallArgs, CallStart, Content, Finish, ReasoningText, ServerToolResult
from ..sampling import PROPERTIES as SAMPLING_PROPERTIES, RequestValidator

#: ``server_label`` of the gateway's own plugin tools (no configured MCP server may take it).
INTERLACE_LABEL = RESERVED_MCP_LABEL

_TEXT = {"type": "string"}
_INPUT_TEXT = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
               "properties": {"type": {"const": "input_text"}, "text": _TEXT}}
_OUTPUT_TEXT = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                "properties": {"type": {"const": "output_text"}, "text": _TEXT,
                               "annotations": {"type": "array", "maxItems": 0},
                               "logprobs": {"type": ["array", "null"]}}}
_REFUSAL = {"type": "object", "required": ["type", "refusal"], "additionalProperties": False,
            "properties": {"type": {"const": "refusal"}, "refusal": _TEXT}}
_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
_ITEM_SCHEMAS: Dict[str, Any] = {
    "message": {"type": "object", "required": ["role", "content"], "additionalProperties": False,
                "properties": {"type": {"const": "message"}, "id": _TEXT, "status": _STATUS,
                               "role": {"enum": ["user", "assistant", "system", "developer"]},
                               "phase": {"enum": ["commentary", "final_answer", None]},
                               "content": {"oneOf": [_TEXT, {"type": "array", "items": {
                                   "oneOf": [_INPUT_TEXT, _OUTPUT_TEXT, _REFUSAL]}}]}}},
    "function_call": {"type": "object", "required": ["type", "call_id", "name", "arguments"],
                      "additionalProperties": False,
                      "properties": {"type": {"const": "function_call"}, "id": _TEXT, "status": _STATUS,
                                     "call_id": {"type": "string", "minLength": 1},
                                     "name": chat_wire.FUNCTION_NAME, "arguments": _TEXT}},
    "function_call_output": {"type": "object", "required": ["type", "call_id", "output"],
                             "additionalProperties": False,
                             "properties": {"type": {"const": "function_call_output"}, "id": {"type": ["string", "null"]},
                                            "status": {"enum": ["in_progress", "completed", "incomplete", None]},
                                            "call_id": {"type": "string", "minLength": 1},
                                            "output": {"oneOf": [_TEXT, {"type": "array", "items": _INPUT_TEXT}]}}},
    # a reasoning item of an earlier response: its text is the next assistant turn's reasoning
    "reasoning": {"type": "object", "required": ["type"], "additionalProperties": False,
                  "properties": {"type": {"const": "reasoning"}, "id": _TEXT, "status": _STATUS,
                                 "summary": {"type": "array", "items": {
                                     "type": "object", "required": ["type", "text"], "additionalProperties": False,
                                     "properties": {"type": {"const": "summary_text"}, "text": _TEXT}}},
                                 "content": {"type": ["array", "null"], "items": {
                                     "type": "object", "required": ["type", "text"], "additionalProperties": False,
                                     "properties": {"type": {"const": "reasoning_text"}, "text": _TEXT}}},
                                 "encrypted_content": {"type": ["string", "null"]}}},
    "mcp_call": {"type": "object", "required": ["type", "id", "server_label", "name", "arguments"],
                 "additionalProperties": False,
                 "properties": {"type": {"const": "mcp_call"}, "id": _TEXT, "server_label": _TEXT,
                                "name": _TEXT, "arguments": _TEXT, "output": {"type": ["string", "null"]},
                                "error": {"type": ["object", "string", "null"]},
                                "approval_request_id": {"type": ["string", "null"]},
                                "status": {"enum": ["in_progress", "completed", "incomplete", "calling", "failed",
                                                    None]}}},
}
_ITEM_VALIDATORS = {k: RequestValidator(v) for k, v in _ITEM_SCHEMAS.items()}

_FUNCTION_TOOL = {"type": "object", "required": ["type", "name"], "additionalProperties": False,
                  "properties": {"type": {"const": "function"}, "name": chat_wire.FUNCTION_NAME,
                                 "description": {"type": ["string", "null"]},
                                 "parameters": {"type": ["object", "null"]},
                                 "strict": {"type": ["boolean", "null"]}}}
_MCP_TOOL = {"type": "object", "required": ["type", "server_label"], "additionalProperties": False,
             "properties": {"type": {"const": "mcp"}, "server_label": {"type": "string", "minLength": 1},
                            "server_description": {"type": ["string", "null"]},
                            "allowed_tools": {"oneOf": [{"type": "null"}, {"type": "array", "items": _TEXT},
                                                        {"type": "object", "additionalProperties": False,
                                                         "properties": {"tool_names": {"type": "array",
                                                                                       "items": _TEXT}}}]},
                            "require_approval": {"enum": ["never", None]}}}
_TOOL_VALIDATORS = {"function": RequestValidator(_FUNCTION_TOOL), "mcp": RequestValidator(_MCP_TOOL)}

RESPONSES_REQUEST_SCHEMA = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": ["string", "null"]},
        "tools": {"type": ["array", "null"], "items": {"type": "object", "required": ["type"]}},
        "tool_choice": {"oneOf": [
            {"type": "null"}, {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "name"], "additionalProperties": False,
             "properties": {"type": {"const": "function"}, "name": {"type": "string"}}},
            {"type": "object", "required": ["type", "server_label", "name"], "additionalProperties": False,
             "properties": {"type": {"const": "mcp"}, "server_label": {"type": "string"},
                            "name": {"type": "string"}}},
        ]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "text": {"type": ["object", "null"], "additionalProperties": False, "properties": {
            "verbosity": {"enum": ["medium", None]},
            "format": {"oneOf": [
                {"type": "null"},
                {"type": "object", "required": ["type"], "additionalProperties": False,
                 "properties": {"type": {"enum": ["text", "json_object"]}}},
                {"type": "object", "required": ["type", "name", "schema"], "additionalProperties": False,
                 "properties": {"type": {"const": "json_schema"}, "name": {"type": "string"},
                                "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]},
                                "description": {"type": ["string", "null"]}}},
            ]}}},
        "max_output_tokens": SAMPLING_PROPERTIES["max_tokens"],
        "temperature": SAMPLING_PROPERTIES["temperature"],
        "top_p": SAMPLING_PROPERTIES["top_p"],
        "store": {"type": ["boolean", "null"]},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                           "properties": {"include_obfuscation": {"type": ["boolean", "null"]}}},
        "background": {"type": ["boolean", "null"]},
        "previous_response_id": {"type": ["string", "null"], "minLength": 1},
        "metadata": chat_wire.CHAT_REQUEST_SCHEMA["properties"]["metadata"],
        # accepted and ignored: they do not change what is generated (as on the chat route)
        "user": {"type": ["string", "null"]},
        "safety_identifier": {"type": ["string", "null"]},
        "prompt_cache_key": {"type": ["string", "null"], "maxLength": chat_wire.PROMPT_CACHE_KEY_CHARS},
        "service_tier": {"type": ["string", "null"]},
        "include": {"type": ["array", "null"], "items": {"type": "string"}},
        "truncation": {"enum": ["disabled", None]},
        "interlace": chat_wire.CHAT_REQUEST_SCHEMA["properties"]["interlace"],
    },
}


def _all_null(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and all(x is None for x in v.values()))


#: Responses parameters Interlace does not implement: accepted only at their neutral value, else refused.
UNSUPPORTED: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "reasoning": (_all_null, "reasoning settings are not supported (a model configured with a reasoning parser "
                             "answers its reasoning as a reasoning item whatever they say)"),
    "top_logprobs": (chat_wire.number_is(0), "top_logprobs is not supported (only 0)"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported (interlace.max_tool_rounds bounds "
                                            "server-side tool rounds)"),
    "prompt": (chat_wire.empty, "prompt templates are not supported"),
    "conversation": (chat_wire.empty, "conversations are not supported: use previous_response_id"),
    "context_management": (chat_wire.empty, "context_management is not supported"),
    "prompt_cache_retention": (lambda v: v is None, "prompt_cache_retention is not supported"),
    "prompt_cache_options": (chat_wire.empty, "prompt_cache_options is not supported"),
    "background_options": (chat_wire.empty, "background_options is not supported"),
    "moderation": (chat_wire.empty, "moderation is not supported"),
    "image": (chat_wire.empty, "image settings are not supported"),
    "access_programs": (chat_wire.empty, "access_programs is not supported"),
}
KNOWN_FIELDS = frozenset(RESPONSES_REQUEST_SCHEMA["properties"]) | frozenset(UNSUPPORTED)
#: ``include`` values that would change the answer; every other value names items never produced here.
INCLUDE_REFUSED = {"message.output_text.logprobs": "logprobs in the Responses API are not supported"}

_validator = RequestValidator(RESPONSES_REQUEST_SCHEMA)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def _check_against(validator: Any, value: Any, where: str) -> None:
    import jsonschema

    err = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if err is not None:
        path = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        if err.validator == "additionalProperties":  # name the field itself, not the object holding it
            extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
            if extra:
                raise APIError(400, f"{path}.{extra[0]}: unrecognized (or unsupported) field", param=f"{path}.{extra[0]}",
                               code="unknown_parameter")
        raise _bad(path, err.message)


# ------------------------------------------------------------------ the request
def validate_request(body: Any) -> Dict[str, Any]:
    """Check a parsed ``POST /v1/responses`` body; a 400 naming the field on the first problem."""
    chat_wire.check_fields(body, KNOWN_FIELDS, UNSUPPORTED)
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # said plainly, not as "not one of text..."
        for name in ("name", "schema"):
            if name not in fmt:
                raise APIError(400, f"text.format.{name} is required with type json_schema",
                               param=f"text.format.{name}", code="missing_required_parameter")
    chat_wire.check_schema(body, _validator)
    for i, value in enumerate(body.get("include") or []):
        if value in INCLUDE_REFUSED:
            raise APIError(400, f"include[{i}]: {INCLUDE_REFUSED[value]}", param=f"include[{i}]",
                           code="unsupported_parameter")
    items = body.get("input")
    if isinstance(items, list):
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            if not isinstance(kind, str) or kind not in _ITEM_VALIDATORS:
                raise APIError(400, f"input[{i}].type: input items of type {kind!r} are not supported (only "
                                    f"{', '.join(_ITEM_SCHEMAS)})", param=f"input[{i}].type",
                               code="unsupported_parameter")
            if kind == "message" and isinstance(item.get("content"), list):
                for j, part in enumerate(item["content"]):
                    ptype = part.get("type") if isinstance(part, dict) else None
                    if isinstance(ptype, str) and ptype not in ("input_text", "output_text", "refusal"):
                        raise APIError(400, f"input[{i}].content[{j}].type: content parts of type {ptype!r} are "
                                            "not supported (only text)", param=f"input[{i}].content[{j}].type",
                                       code="unsupported_parameter")
                    if ptype in ("output_text", "refusal") and item.get("role") != "assistant":
                        raise _bad(f"input[{i}].content[{j}].type", f"{ptype!r} parts belong to assistant messages")
            _check_against(_ITEM_VALIDATORS[kind], item, f"input[{i}]")
            if kind in ("function_call", "mcp_call"):
                try:
                    chat_wire.parse_json(item["arguments"])
                except APIError as e:
                    raise _bad(f"input[{i}].arguments", f"not valid JSON: {e.message}") from None
    for i, tool in enumerate(body.get("tools") or []):
        kind = tool["type"]
        if not isinstance(kind, str) or kind not in _TOOL_VALIDATORS:
            raise APIError(400, f"tools[{i}].type: tools of type {kind!r} are not supported (only function and "
                                "mcp)", param=f"tools[{i}].type", code="unsupported_parameter")
        if kind == "mcp" and "server_url" in tool:
            raise APIError(400, f"tools[{i}].server_url: remote MCP servers are not supported; name a server of "
                                "the gateway's mcp_servers by its server_label (or 'interlace' for its plugin "
                                "tools)", param=f"tools[{i}].server_url", code="unsupported_parameter")
        _check_against(_TOOL_VALIDATORS[kind], tool, f"tools[{i}]")
    if body.get("background") and body.get("stream"):
        raise APIError(400, "background: a background response cannot be streamed here (poll it with GET "
                            "/v1/responses/{id})", param="background", code="unsupported_parameter")
    if body.get("background") and body.get("store") is False:
        raise APIError(400, "background: a background response must be stored (store: true)",
                       param="background", code="invalid_value")
    return body


@dataclass
class Translation:
    """A Responses request as the internal request, and what the answer and the store need of it."""

    body: Dict[str, Any]                     # the internal (chat-completions) request
    input_items: List[Dict[str, Any]]        # this request's input items, with ids (GET input_items)
    input_messages: List[Dict[str, Any]]     # the chat messages of this request's input (no instructions)
    #: what each internal message came from (rename_error): "instructions", "previous_response_id", "input[i]"
    sources: List[str] = field(default_factory=list)
    mcp_tools: bool = False                  # the server-side tools came from mcp tools
    tool_index: List[int] = field(default_factory=list)  # the request's index of each internal function tool


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", p.get("refusal", "")) for p in content)


def _normalized(item: Dict[str, Any]) -> Dict[str, Any]:
    """An input item as GET input_items lists it: with its type, an id and a status."""
    kind = item.get("type", "message")
    out = dict(item, type=kind)
    if kind == "message":
        content = item["content"]
        part = "output_text" if item["role"] == "assistant" else "input_text"
        out["content"] = ([{"type": part, "text": content, **({"annotations": []} if part == "output_text" else {})}]
                          if isinstance(content, str) else content)
    out.setdefault("id", new_id({"message": "msg", "function_call": "fc", "function_call_output": "fco",
                                 "mcp_call": "mcp", "reasoning": "rs"}[kind]))
    if out["id"] is None:
        out["id"] = new_id("fco")
    if kind != "mcp_call" and out.get("status") is None:
        out["status"] = "completed"
    return out


def split_tool_name(name: str, mcp_servers: Iterable[str]) -> Tuple[str, str]:
    """(server_label, the tool's own name) of a runtime tool name: ``NAME.TOOL`` of a configured MCP server,
    else a plugin tool of the gateway's own (``interlace``)."""
    head, dot, rest = name.partition(".")
    return (head, rest) if dot and head in set(mcp_servers) else (INTERLACE_LABEL, name)


def _server_tools(tools: List[Dict[str, Any]], available: Mapping[str, Any], mcp_servers: Iterable[str]) -> List[str]:
    """The runtime names of the server-side tools ``tools``' mcp entries ask for."""
    servers = set(mcp_servers)
    names: List[str] = []
    for i, t in enumerate(tools):
        if t["type"] != "mcp":
            continue
        label = t["server_label"]
        if label != INTERLACE_LABEL and label not in servers:
            raise APIError(400, f"tools[{i}].server_label: no MCP server {label!r} is configured (configured: "
                                f"{', '.join(sorted(servers)) or 'none'}; 'interlace' names the gateway's plugin "
                                "tools)", param=f"tools[{i}].server_label", code="unknown_tool")
        offered = {own: full for full, tool in available.items() if tool.enabled
                   for lab, own in [split_tool_name(full, servers)] if lab == label}
        allowed = t.get("allowed_tools")
        if isinstance(allowed, dict):
            allowed = allowed.get("tool_names")
        if allowed is None:
            wanted = list(offered)
        else:
            wanted = list(allowed)
            for j, n in enumerate(wanted):
                if n not in offered:
                    raise APIError(400, f"tools[{i}].allowed_tools: {n!r} is not a tool of {label!r} (it has: "
                                        f"{', '.join(offered) or 'none'})", param=f"tools[{i}].allowed_tools",
                                   code="unknown_tool")
        if not wanted:
            raise APIError(400, f"tools[{i}]: {label!r} serves no enabled tool", param=f"tools[{i}]",
                           code="unknown_tool")
        names += [offered[n] for n in wanted if offered[n] not in names]
    return names


def call_ids(messages: Iterable[Dict[str, Any]]) -> set:
    return {c.get("id") for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []}


def translate(req: Dict[str, Any], history: List[Dict[str, Any]], *, available: Mapping[str, Any],
              mcp_servers: Iterable[str]) -> Translation:
    """The internal request of the validated ``req``, continuing ``history`` (the stored conversation of
    ``previous_response_id``; [] without one).  The request's own instructions lead as a system message."""
    raw = req.get("input")
    items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])
    if not items and not history:
        raise APIError(400, "input: a response needs input (or a previous_response_id to continue)",
                       param="input", code="missing_required_parameter")
    servers = list(mcp_servers)
    messages: List[Dict[str, Any]] = []
    sources: List[str] = []
    known = call_ids(history) | {it["call_id"] for it in items if it.get("type") == "function_call"}
    reasoning: Optional[str] = None  # a reasoning item's text, for the assistant turn that follows it
    for i, it in enumerate(items):
        kind, where = it.get("type", "message"), f"input[{i}]"
        last = messages[-1] if messages else None
        if kind == "reasoning":
            text = "".join(part["text"] for part in it.get("content") or [])
            reasoning = text if reasoning is None else reasoning + text
            continue
        thought, reasoning = reasoning, None  # only the next assistant turn takes it (else it is dropped)
        if kind == "message":
            messages.append({"role": it["role"], "content": _text_of(it["content"])})
            if thought is not None and it["role"] == "assistant":
                messages[-1]["reasoning_content"] = thought
        elif kind in ("function_call", "mcp_call"):
            if kind == "function_call":
                call = {"id": it["call_id"], "type": "function",
                        "function": {"name": it["name"], "arguments": it["arguments"]}}
            else:
                name = it["name"] if it["server_label"] == INTERLACE_LABEL else f"{it['server_label']}.{it['name']}"
                call = {"id": it["id"], "type": "function", "function": {"name": name, "arguments": it["arguments"]}}
            if last is not None and last["role"] == "assistant" and sources[-1].startswith("input") \
                    and not (thought is not None and last.get("reasoning_content") is not None):
                last.setdefault("tool_calls", []).append(call)
                if thought is not None:
                    last["reasoning_content"] = thought
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                 **({"reasoning_content": thought} if thought is not None else {})})
                sources.append(where)
            if kind == "mcp_call":
                error = it.get("error")
                messages.append({"role": "tool", "tool_call_id": it["id"], "content": it.get("output") or (
                    json.dumps(error) if isinstance(error, dict) else str(error or ""))})
                sources.append(where)
            continue
        else:  # function_call_output
            if it["call_id"] not in known:
                raise APIError(400, f"{where}.call_id: no function_call with call_id {it['call_id']!r} in the "
                                    "conversation" + (" (the stored response's or this input's)" if history else ""),
                               param=f"{where}.call_id", code="invalid_value")
            messages.append({"role": "tool", "tool_call_id": it["call_id"], "content": _text_of(it["output"])})
        sources.append(where)
    instructions = req.get("instructions")
    lead = [{"role": "system", "content": instructions}] if instructions else []
    body: Dict[str, Any] = {"model": req["model"], "messages": lead + list(history) + messages}
    tools = req.get("tools") or []
    functions = [{"type": "function", "function": {k: v for k, v in (
        ("name", t["name"]), ("description", t.get("description")), ("parameters", t.get("parameters")),
        ("strict", t.get("strict"))) if v is not None}} for t in tools if t["type"] == "function"]
    if functions:
        body["tools"] = functions
    ext = dict(req.get("interlace") or {})
    server = _server_tools(tools, available, servers)
    if server:
        asked = ext.get("server_tools")
        ext["server_tools"] = True if asked is True else list(dict.fromkeys((asked or []) + server))
    if ext:
        body["interlace"] = ext
    choice = req.get("tool_choice")
    if isinstance(choice, dict):
        name = choice["name"] if choice["type"] == "function" or choice["server_label"] == INTERLACE_LABEL \
            else f"{choice['server_label']}.{choice['name']}"
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = (req.get("text") or {}).get("format")
    if fmt and fmt["type"] == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {k: fmt[k] for k in (
            "name", "schema", "strict", "description") if fmt.get(k) is not None}}
    elif fmt:
        body["response_format"] = {"type": fmt["type"]}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user"),
                     ("safety_identifier", "safety_identifier"), ("prompt_cache_key", "prompt_cache_key")):
        if req.get(src) is not None:
            body[dst] = req[src]
    all_sources = ["instructions"] * len(lead) + ["previous_response_id"] * len(history) + sources
    t = Translation(body, [_normalized(it) for it in items], messages, all_sources, mcp_tools=bool(server),
                    tool_index=[i for i, tool in enumerate(tools) if tool["type"] == "function"])
    try:  # the chat checks that remain (tool schemas, json_schema, tool_choice against the tools)
        chat_wire.validate_chat_request(body)
    except APIError as e:
        raise rename_error(e, t) from None
    return t


# ------------------------------------------------------------ field names back
_RENAMES = (("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"))


def rename(param: Optional[str], t: Optional[Translation]) -> Optional[str]:
    """A chat-completions field name as this API's."""
    if param is None:
        return None
    if param.startswith("messages"):
        rest = param[len("messages"):]
        if rest.startswith("[") and t is not None:
            idx, _, tail = rest[1:].partition("]")
            if idx.isdigit() and int(idx) < len(t.sources):
                return t.sources[int(idx)] + (tail if t.sources[int(idx)].startswith("input") else "")
        return "input"
    if param.startswith("tools[") and t is not None:
        idx, _, tail = param[len("tools["):].partition("]")
        if idx.isdigit() and int(idx) < len(t.tool_index):
            return f"tools[{t.tool_index[int(idx)]}]" + tail.replace(".function.", ".", 1).replace(".function", "", 1)
        return "tools"
    if param == "interlace.server_tools" and t is not None and t.mcp_tools:
        return "tools"
    for old, new in _RENAMES:
        if param == old or param.startswith(old + ".") or param.startswith(old + "["):
            return new + param[len(old):]
    return param


def rename_error(err: Exception, t: Optional[Translation]) -> Exception:
    """``err`` (an :class:`APIError` or a domain error naming a chat field) naming this API's field,
    its message's leading field name rewritten too."""
    e = api_error(err) if isinstance(err, GatewayError) else err
    if not isinstance(e, APIError) or e.param is None:
        return e
    new = rename(e.param, t)
    if new != e.param:
        message = e.message
        if message.startswith(e.param):
            message = new + message[len(e.param):]
        e = APIError(e.status, message, e.type, param=new, code=e.code, headers=e.headers)
    return e


# ------------------------------------------------------------- the answer
def usage(u: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The loop's usage (chat's names) as the Responses API's."""
    if u is None:
        return None
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def response_object(rid: str, req: Dict[str, Any], model: str, created_at: float, status: str, *,
                    output: Optional[List[Dict[str, Any]]] = None, usage_: Optional[Dict[str, Any]] = None,
                    error: Optional[Dict[str, Any]] = None,
                    incomplete: Optional[str] = None) -> Dict[str, Any]:
    """The ``Response`` object of request ``req`` in the state ``status``, echoing the request's settings."""
    text = dict(req.get("text") or {})
    text["format"] = text.get("format") or {"type": "text"}
    text.setdefault("verbosity", "medium")
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": status,
        "completed_at": time.time() if status in ("completed", "incomplete", "failed", "cancelled") else None,
        "background": bool(req.get("background")), "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
        "max_tool_calls": None, "model": model, "output": output or [],
        "parallel_tool_calls": req.get("parallel_tool_calls") is not False,
        "previous_response_id": req.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
        "service_tier": "default", "store": req.get("store") is not False,
        "temperature": 1.0 if req.get("temperature") is None else req["temperature"],
        "text": text, "tool_choice": req.get("tool_choice") or "auto", "tools": list(req.get("tools") or []),
        "top_logprobs": 0, "top_p": 1.0 if req.get("top_p") is None else req["top_p"], "truncation": "disabled",
        "usage": usage_, "user": req.get("user"), "safety_identifier": req.get("safety_identifier"),
        "prompt_cache_key": req.get("prompt_cache_key"), "metadata": req.get("metadata") or {},
    }


def sse(event: Dict[str, Any]) -> bytes:
    """One typed server-sent event (``event: TYPE`` and its JSON)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


class OutputBuilder:
    """The loop's events as output items (in the order they happened) and as the conversation's chat
    messages, with the stream events each step makes (:meth:`feed` returns them, without
    ``sequence_number``: the route numbers what it sends).

    Reasoning is a ``reasoning`` item (its text one ``reasoning_text`` part, streamed with
    ``response.reasoning_text.delta``) before the message or calls it led to; in the conversation it
    is that assistant turn's ``reasoning_content``.  A client call's item is added when the loop
    passes the call on, gets its arguments as the loop releases them (member by member), and is done
    when the next event (or the finish) comes: ``status: "incomplete"`` when the loop withdrew it
    (``Finish.withdrawn``: it failed after it was passed on; its arguments are still a valid JSON
    object, and a client must not run it).  A server-side call is an ``mcp_call`` item from its start
    to its result (several may run in one round)."""

    def __init__(self, mcp_servers: Iterable[str]):
        self.servers = list(mcp_servers)
        self.output: List[Dict[str, Any]] = []
        self.messages: List[Dict[str, Any]] = []     # the output as chat messages (for the store)
        self.text: Optional[Dict[str, Any]] = None  # the open message item
        self.thought: Optional[Dict[str, Any]] = None  # the open reasoning item
        self.call: Optional[Dict[str, Any]] = None  # the open client call item
        self.call_index = -1                         # its index in the loop's numbering
        self.server: Dict[int, Dict[str, Any]] = {}  # server call index -> its open mcp_call item
        self.chat_calls: Dict[str, Dict[str, Any]] = {}  # item id -> its call in ``messages``
        self.finish: Optional[Finish] = None

    def _index(self, item: Dict[str, Any]) -> int:
        return self.output.index(item)

    def _close(self, status: str = "completed", withdrawn: Iterable[int] = ()) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        if self.thought is not None:
            item, self.thought = self.thought, None
            i, part = self._index(item), item["content"][0]
            item["status"] = status
            out += [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": i,
                     "content_index": 0, "text": part["text"]},
                    {"type": "response.content_part.done", "item_id": item["id"], "output_index": i,
                     "content_index": 0, "part": dict(part)},
                    {"type": "response.output_item.done", "output_index": i, "item": copy_json(item)}]
        if self.text is not None:
            item, self.text = self.text, None
            i, part = self._index(item), item["content"][0]
            item["status"] = status
            out += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": i,
                     "content_index": 0, "text": part["text"], "logprobs": []},
                    {"type": "response.content_part.done", "item_id": item["id"], "output_index": i,
                     "content_index": 0, "part": dict(part)},
                    {"type": "response.output_item.done", "output_index": i, "item": copy_json(item)}]
        if self.call is not None:
            item, self.call = self.call, None
            i = self._index(item)
            item["status"] = "incomplete" if self.call_index in set(withdrawn) else "completed"
            out += [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": i,
                     "name": item["name"], "arguments": item["arguments"]},
                    {"type": "response.output_item.done", "output_index": i, "item": copy_json(item)}]
        return out

    def _assistant(self) -> Dict[str, Any]:
        """The assistant message calls attach to: the last message when it is the assistant's."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            self.messages.append({"role": "assistant", "content": None})
        return self.messages[-1]

    def _reply(self) -> Dict[str, Any]:
        """The assistant message text starts: the last one when it holds only its reasoning so far."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or last.get("reasoning_content") is None \
                or last.get("content") is not None or last.get("tool_calls"):
            last = {"role": "assistant", "content": None}
            self.messages.append(last)
        last["content"] = ""
        return last

    def feed(self, ev: Any) -> List[Dict[str, Any]]:
        if isinstance(ev, ReasoningText):
            out = self._close() if self.text is not None or self.call is not None else []
            if self.thought is None:
                part = {"type": "reasoning_text", "text": ""}
                self.thought = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [part],
                                "status": "in_progress"}
                self.output.append(self.thought)
                i = self._index(self.thought)
                out += [{"type": "response.output_item.added", "output_index": i,
                         "item": dict(self.thought, content=[])},
                        {"type": "response.content_part.added", "item_id": self.thought["id"], "output_index": i,
                         "content_index": 0, "part": dict(part)}]
                self.messages.append({"role": "assistant", "content": None, "reasoning_content": ""})
            self.thought["content"][0]["text"] += ev.text
            self.messages[-1]["reasoning_content"] += ev.text
            out.append({"type": "response.reasoning_text.delta", "item_id": self.thought["id"],
                        "output_index": self._index(self.thought), "content_index": 0, "delta": ev.text})
            return out
        if isinstance(ev, Content):
            out = self._close() if self.call is not None or self.thought is not None else []
            if self.text is None:
                part = {"type": "output_text", "text": "", "annotations": []}
                self.text = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                             "content": [part]}
                self.output.append(self.text)
                i = self._index(self.text)
                out += [{"type": "response.output_item.added", "output_index": i,
                         "item": dict(self.text, content=[])},
                        {"type": "response.content_part.added", "item_id": self.text["id"], "output_index": i,
                         "content_index": 0, "part": dict(part)}]
                self._reply()
            self.text["content"][0]["text"] += ev.text
            self.messages[-1]["content"] = (self.messages[-1]["content"] or "") + ev.text
            out.append({"type": "response.output_text.delta", "item_id": self.text["id"],
                        "output_index": self._index(self.text), "content_index": 0, "delta": ev.text, "logprobs": []})
            return out
        if isinstance(ev, CallStart):
            out = self._close()
            call = {"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
            self._assistant().setdefault("tool_calls", []).append(call)
            if ev.server:
                label, own = split_tool_name(ev.name, self.servers)
                item = {"id": new_id("mcp"), "type": "mcp_call", "server_label": label, "name": own,
                        "arguments": "", "output": None, "error": None, "status": "in_progress"}
                self.server[ev.index] = item
                self.chat_calls[item["id"]] = call
                self.output.append(item)
                i = self._index(item)
                return out + [{"type": "response.output_item.added", "output_index": i, "item": copy_json(item)},
                              {"type": "response.mcp_call.in_progress", "item_id": item["id"], "output_index": i}]
            self.call = {"id": new_id("fc"), "type": "function_call", "call_id": ev.id, "name": ev.name,
                         "arguments": "", "status": "in_progress"}
            self.call_index = ev.index
            self.chat_calls[self.call["id"]] = call
            self.output.append(self.call)
            return out + [{"type": "response.output_item.added", "output_index": self._index(self.call),
                           "item": copy_json(self.call)}]
        if isinstance(ev, CallArgs):
            item = self.server.get(ev.index) if ev.server else self.call
            if item is None:
                return []
            item["arguments"] += ev.fragment
            self.chat_calls[item["id"]]["function"]["arguments"] = item["arguments"]
            kind = "response.mcp_call_arguments.delta" if ev.server else "response.function_call_arguments.delta"
            return [{"type": kind, "item_id": item["id"], "output_index": self._index(item), "delta": ev.fragment}]
        if isinstance(ev, ServerToolResult):
            out = self._close()
            item = self.server.pop(ev.index, None)
            if item is None:  # a call not announced (cannot happen today): its item now
                label, own = split_tool_name(ev.name, self.servers)
                item = {"id": new_id("mcp"), "type": "mcp_call", "server_label": label, "name": own,
                        "arguments": "", "output": None, "error": None, "status": "in_progress"}
                self.output.append(item)
            if not item["arguments"]:
                item["arguments"] = json.dumps(ev.arguments, ensure_ascii=False)
                if item["id"] in self.chat_calls:
                    self.chat_calls[item["id"]]["function"]["arguments"] = item["arguments"]
            i = self._index(item)
            result = ev.content if isinstance(ev.content, str) else json.dumps(ev.content, ensure_ascii=False)
            if ev.ok:
                item.update(output=result, status="completed")
            else:
                item.update(status="failed", error={"type": "mcp_tool_execution_error",
                                                    "content": [{"type": "text", "text": ev.error or ""}]})
            self.messages.append({"role": "tool", "tool_call_id": ev.id,
                                  "content": result if ev.ok else f"error: {ev.error}"})
            return out + [{"type": "response.mcp_call_arguments.done", "item_id": item["id"], "output_index": i,
                           "arguments": item["arguments"]},
                          {"type": "response.mcp_call.completed" if ev.ok else "response.mcp_call.failed",
                           "item_id": item["id"], "output_index": i},
                          {"type": "response.output_item.done", "output_index": i, "item": copy_json(item)}]
        if isinstance(ev, Finish):
            self.finish = ev
            out = self._close("incomplete" if ev.reason == "length" else "completed", ev.withdrawn)
            for item in self.server.values():  # announced, never run (the loop ended first)
                item["status"] = "incomplete"
            self.server = {}
            return out
        return []  # TokenLogprob: not asked for here

    @property
    def status(self) -> str:
        return "incomplete" if self.finish is not None and self.finish.reason == "length" else "completed"


def copy_json(item: Dict[str, Any]) -> Dict[str, Any]:
    return json.loads(json.dumps(item))


def list_object(items: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}
