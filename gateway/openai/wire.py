"""The OpenAI chat-completions wire format: the request schema and its
validation (a body is checked whole before anything is planned), and the
pieces every answer is made of (ids, stream chunks, server-sent events).

What grows with the body is bounded before it is walked (``metadata`` as
OpenAI limits it, the request's JSON schemas to :data:`MAX_SCHEMA_NODES`
values); the rest runs in a worker thread (routes.py).

A client mistake is a 4xx ``APIError`` (gateway/errors.py: one error shape
for every route) -- the official clients retry 5xx, so a bad request must
never look like a server failure.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

import jsonschema
import numpy as np

from ...parsers.jsonscan import loads as strict_loads
from ..errors import APIError
from ..sampling import PROPERTIES as SAMPLING_PROPERTIES, RequestValidator

FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}
#: Nesting depth a request body may have, counting every object and array.  A chat request
#: needs about 6; 64 leaves room for tool parameter schemas and keeps every recursive
#: consumer of the body (json, jsonschema, the grammar compiler) far from the interpreter's limit.
MAX_JSON_DEPTH = 64

#: JSON values a request's schemas (response_format's, the tools' parameters) may hold together:
#: every object, array, string, number, boolean and null counts.  Checking and compiling a schema
#: grows with it (5,000 required properties took 3 s); a tool with a few dozen parameters is a few
#: hundred values.
MAX_SCHEMA_NODES = 10_000
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
#: ``prompt_cache_key``: OpenAI refuses a longer one (400); here it places requests (completions.py)
PROMPT_CACHE_KEY_CHARS = 64

TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
             "properties": {"type": {"const": "text",
                                     "description": "only text parts are supported (no images, audio, files)"},
                            "text": {"type": "string"}}}
CONTENT = {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": TEXT_PART}]}

CHAT_REQUEST_SCHEMA = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array", "minItems": 1,
            "items": {
                "type": "object", "required": ["role"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                    "content": CONTENT,
                    "name": {"type": "string"},
                    "tool_call_id": {"type": "string"},
                    "tool_calls": {
                        "type": ["array", "null"],
                        "items": {
                            "type": "object", "required": ["function"],
                            "properties": {
                                "id": {"type": "string"},
                                "type": {"const": "function"},
                                "function": {"type": "object", "required": ["name", "arguments"],
                                             "properties": {"name": FUNCTION_NAME,
                                                            "arguments": {"type": "string"}}},
                            },
                        },
                    },
                    # an assistant turn's reasoning, as this server (vLLM, DeepSeek) answered it: kept on
                    # the message for the prompt renderer; vLLM's newer name ``reasoning`` is the same
                    "reasoning_content": {"type": ["string", "null"]},
                    "reasoning": {"type": ["string", "null"]},
                    # what the official clients send back when an assistant message is reused as-is
                    "refusal": {"type": "null"},
                    "audio": {"type": "null"},
                    "function_call": {"type": "null"},
                    "annotations": {"type": ["array", "null"]},
                },
            },
        },
        "tools": {
            "type": ["array", "null"],
            "items": {
                "type": "object", "required": ["type", "function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"],
                                 "properties": {"name": FUNCTION_NAME, "description": {"type": "string"},
                                                "parameters": {"type": "object"},
                                                "strict": {"type": ["boolean", "null"]}}},
                },
            },
        },
        "tool_choice": {"oneOf": [
            {"type": "null"},
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"],
             "properties": {"type": {"const": "function"},
                            "function": {"type": "object", "required": ["name"],
                                         "properties": {"name": {"type": "string"}}}}},
        ]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "response_format": {
            "type": ["object", "null"], "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": {"type": "object", "required": ["name"],
                                "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                               "strict": {"type": ["boolean", "null"]},
                                               "description": {"type": "string"}}},
            },
        },
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                           "properties": {"include_usage": {"type": ["boolean", "null"]},
                                          "include_obfuscation": {"type": ["boolean", "null"]}}},
        # max_tokens, temperature, top_p, top_k, seed, stop: the limits both API surfaces share
        **SAMPLING_PROPERTIES,
        "max_completion_tokens": SAMPLING_PROPERTIES["max_tokens"],
        "logprobs": {"type": ["boolean", "null"]},
        # accepted and ignored: they do not change what is generated
        "user": {"type": ["string", "null"]},
        "safety_identifier": {"type": ["string", "null"]},
        # nor does this: requests sharing it are placed on one replica (completions.py, "Placement")
        "prompt_cache_key": {"type": ["string", "null"], "maxLength": PROMPT_CACHE_KEY_CHARS},
        # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
        "metadata": {"type": ["object", "null"], "maxProperties": METADATA_PAIRS,
                     "propertyNames": {"maxLength": METADATA_KEY_CHARS},
                     "additionalProperties": {"type": "string", "maxLength": METADATA_VALUE_CHARS}},
        "store": {"type": ["boolean", "null"]},
        "service_tier": {"type": ["string", "null"]},
        "interlace": {
            "type": ["object", "null"], "additionalProperties": False,
            "properties": {
                "server_tools": {"oneOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "string"}}]},
                "partial_execution": {"type": "boolean"},
                "max_tool_rounds": {"type": "integer", "minimum": 1, "maximum": 64},
                "replay": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
                           "description": "force the model to emit this recorded output (benchmarks, tests); "
                                          "a list gives one piece per tool round"},
            },
        },
    },
}


def number_is(value: float) -> Callable[[Any], bool]:
    return lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == value)


def empty(v: Any) -> bool:
    return v is None or v == {} or v == []


#: OpenAI parameters Interlace does not implement: accepted only at their neutral value
#: (so clients that always send the default keep working), refused otherwise -- never ignored.
UNSUPPORTED: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "n": (number_is(1), "only n=1 is supported"),
    "frequency_penalty": (number_is(0), "frequency_penalty is not supported (only 0)"),
    "presence_penalty": (number_is(0), "presence_penalty is not supported (only 0)"),
    "logit_bias": (empty, "logit_bias is not supported"),
    "top_logprobs": (number_is(0), "top_logprobs is not supported (only 0: logprobs gives the sampled "
                                    "token's log-probability)"),
    "audio": (empty, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
    "prediction": (empty, "predicted outputs are not supported"),
    "functions": (empty, "the legacy 'functions' parameter is not supported: use 'tools'"),
    "function_call": (empty, "the legacy 'function_call' parameter is not supported: use 'tool_choice'"),
    "reasoning_effort": (empty, "reasoning_effort is not supported"),
    "verbosity": (empty, "verbosity is not supported"),
    "web_search_options": (empty, "web search is not supported"),
}

KNOWN_FIELDS = frozenset(CHAT_REQUEST_SCHEMA["properties"]) | frozenset(UNSUPPORTED)


_validator = RequestValidator(CHAT_REQUEST_SCHEMA)


# ------------------------------------------------------------------ parsing
#: A JSON string, closed or not (so an unterminated one cannot make the scan quadratic).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)


def json_depth(raw: bytes) -> int:
    """The deepest nesting of objects/arrays in ``raw`` (UTF-8 JSON), found without parsing:
    strings are blanked out, then a cumulative sum of the brackets runs in numpy.  Linear and
    in C, so a hostile body is measured before any recursive parser sees it."""
    a = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    step = (a == 0x5B).astype(np.int32) + (a == 0x7B) - (a == 0x5D) - (a == 0x7D)
    return int(step.cumsum().max(initial=0))


def parse_json(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON for requests: UTF-8, at most ``max_depth`` levels deep, finite numbers only
    (no ``NaN``, ``Infinity``, ``1e999``) and no lone surrogates (``"\\ud800"``) -- each of these
    would otherwise get through ``json.loads`` and fail later, far from the cause."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise APIError(400, f"the request body is not valid UTF-8: {e}", code="invalid_json") from None
    else:
        text, raw = raw, raw.encode("utf-8", "surrogatepass")
    depth = json_depth(raw)
    if depth > max_depth:
        raise APIError(400, f"JSON nested {depth} levels deep; at most {max_depth} are allowed",
                       code="invalid_json")
    try:
        value = strict_loads(text)
    except ValueError as e:  # JSONDecodeError, NaN/Infinity/1e999, int() of an over-long integer literal
        raise APIError(400, f"invalid JSON: {str(e)[:200]}", code="invalid_json") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "a string holds a lone UTF-16 surrogate (such as \\ud800), which is not valid "
                            "Unicode", code="invalid_json") from None
    return value


def _path(err: jsonschema.ValidationError) -> Optional[str]:
    out = ""
    for p in err.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _refuse_non_text_parts(messages: Any) -> None:
    """Images, audio and files are understood but not supported: say so, rather than
    the schema's "'text' was expected"."""
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise APIError(400, f"messages[{i}].content[{j}]: content parts of type {kind!r} are not "
                                    "supported (only 'text')", param=f"messages[{i}].content[{j}].type",
                               code="unsupported_parameter")


def json_nodes(value: Any, limit: int) -> int:
    """How many JSON values ``value`` holds (itself, and everything inside), counted without
    recursion and given up past ``limit`` (then ``limit + 1``)."""
    n, todo = 0, [value]
    while todo and n <= limit:
        v = todo.pop()
        n += 1
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return n


def _schemas(body: Dict[str, Any]) -> Iterator[Tuple[str, Any]]:
    """``(param, schema)`` of every JSON Schema a request carries."""
    for i, t in enumerate(body.get("tools") if isinstance(body.get("tools"), list) else ()):
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and "parameters" in fn:
            yield f"tools[{i}].function.parameters", fn["parameters"]
    rf = body.get("response_format")
    js = rf.get("json_schema") if isinstance(rf, dict) else None
    if isinstance(js, dict) and "schema" in js:
        yield "response_format.json_schema.schema", js["schema"]


def _check_sizes(body: Dict[str, Any]) -> None:
    """What costs more the larger it is, bounded before anything walks it: ``metadata`` (OpenAI's
    limits) and the request's schemas together (:data:`MAX_SCHEMA_NODES`)."""
    meta = body.get("metadata")
    if isinstance(meta, dict) and len(meta) > METADATA_PAIRS:
        raise APIError(400, f"metadata: at most {METADATA_PAIRS} key-value pairs, got {len(meta)}",
                       param="metadata", code="invalid_value")
    left = MAX_SCHEMA_NODES
    for param, schema in _schemas(body):
        left -= json_nodes(schema, left)
        if left < 0:
            raise APIError(400, f"{param}: the request's JSON schemas hold more than {MAX_SCHEMA_NODES} values "
                                "together (objects, arrays, strings, numbers), the most the gateway compiles",
                           param=param, code="schema_too_large")


def check_fields(body: Any, known: Iterable[str], unsupported: Dict[str, Tuple[Callable[[Any], bool], str]]) -> None:
    """The checks every OpenAI request body gets first (chat and text completions): a JSON object,
    no field outside ``known``, each of ``unsupported`` at its neutral value."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_body")
    for name in body:
        if name not in known:
            raise APIError(400, f"unrecognized request argument supplied: {name}", param=name,
                           code="unknown_parameter")
    for name, (neutral, why) in unsupported.items():
        if name in body and not neutral(body[name]):
            raise APIError(400, f"{why}; got {name}={body[name]!r}", param=name, code="unsupported_parameter")


def check_schema(body: Dict[str, Any], validator: Any) -> None:
    """A 400 naming the field (``messages[0].content``) of the schema error that best explains why
    ``body`` fails ``validator`` (a ``sampling.RequestValidator`` of the request's schema)."""
    err = jsonschema.exceptions.best_match(validator.iter_errors(body))
    if err is not None:
        param = _path(err)
        raise APIError(400, f"{param or 'body'}: {err.message}", param=param, code="invalid_value")


def validate_chat_request(body: Any) -> Dict[str, Any]:
    """Check a parsed request body; raise :class:`APIError` (400, ``param`` naming the field) on the
    first problem.  Unknown fields and unsupported parameters are refused rather than ignored: a
    client that asks for something must not silently get something else."""
    check_fields(body, KNOWN_FIELDS, UNSUPPORTED)
    _check_sizes(body)
    _refuse_non_text_parts(body.get("messages"))
    check_schema(body, _validator)
    msgs = body["messages"]
    ids = set()
    for i, m in enumerate(msgs):
        for j, c in enumerate(m.get("tool_calls") or []):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                parse_json(c["function"]["arguments"])
            except APIError as e:
                raise APIError(400, f"{where} is not valid JSON: {e.message}", param=where, code="invalid_value")
            ids.add(c.get("id"))
        alias = m.pop("reasoning", None)  # one name for the renderer: reasoning_content
        if m.get("reasoning_content") is None and alias is not None:
            m["reasoning_content"] = alias
        if m["role"] == "tool" and "tool_call_id" not in m:
            raise APIError(400, f"messages[{i}]: a tool message needs tool_call_id",
                           param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
    names = [t["function"]["name"] for t in body.get("tools") or []]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools", code="invalid_value")
    for i, t in enumerate(body.get("tools") or []):
        params = t["function"].get("parameters")
        if params is not None:
            try:
                jsonschema.Draft202012Validator.check_schema(params)
            except jsonschema.SchemaError as e:
                raise APIError(400, f"tools[{i}].function.parameters is not a valid JSON Schema: {e.message}",
                               param=f"tools[{i}].function.parameters", code="invalid_value")
    # a forced call may be to a server-side tool the request asked for (interlace.server_tools); with
    # `server_tools: true` which tools those are is the gateway's to say: the plan checks (plan.py)
    server = (body.get("interlace") or {}).get("server_tools") or []
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if server is not True and name not in names and name not in server:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools"
                                f"{' or interlace.server_tools' if server else ''}",
                           param="tool_choice", code="unknown_tool")
    elif choice == "required" and not names and not server:
        raise APIError(400, "tool_choice 'required' needs at least one tool (in tools or "
                            "interlace.server_tools)", param="tool_choice", code="invalid_value")
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        if schema is None:
            raise APIError(400, "response_format.json_schema.schema is required",
                           param="response_format.json_schema.schema", code="missing_required_parameter")
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            raise APIError(400, f"response_format.json_schema.schema is not a valid JSON Schema: {e.message}",
                           param="response_format.json_schema.schema", code="invalid_value")
    return body


# ---------------------------------------------------------------- responses
def completion_id() -> str:
    import uuid

    return "chatcmpl-" + uuid.uuid4().hex


def chunk(cid: str, model: str, created: int, delta: Dict[str, Any], finish: Optional[str] = None,
          **extra: Any) -> Dict[str, Any]:
    out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    out.update(extra)
    return out


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def now() -> int:
    return int(time.time())
