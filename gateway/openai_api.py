"""The OpenAI chat-completions surface: request validation, OpenAI-shaped
errors, and response / stream-chunk shaping.

Client mistakes are 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}`` -- the official clients
retry 5xx, so a bad request must never look like a server failure.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional

import jsonschema

FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}

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
                    "content": {"type": ["string", "array", "null"]},
                    "name": {"type": "string"},
                    "tool_call_id": {"type": "string"},
                    "tool_calls": {
                        "type": "array",
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
                },
            },
        },
        "tools": {
            "type": "array",
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
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"],
             "properties": {"type": {"const": "function"},
                            "function": {"type": "object", "required": ["name"],
                                         "properties": {"name": {"type": "string"}}}}},
        ]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "response_format": {
            "type": "object", "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": {"type": "object", "required": ["name"],
                                "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                               "strict": {"type": ["boolean", "null"]},
                                               "description": {"type": "string"}}},
            },
        },
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": 0},
        "seed": {"type": ["integer", "null"]},
        "stop": {"oneOf": [{"type": "string"}, {"type": "null"},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 1},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 0,
                         "description": "only 0 is supported: the sampled token's logprob is returned"},
        "user": {"type": "string"},
        "interlace": {
            "type": "object", "additionalProperties": False,
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

_validator = jsonschema.Draft202012Validator(CHAT_REQUEST_SCHEMA)


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _path(err: jsonschema.ValidationError) -> Optional[str]:
    out = ""
    for p in err.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validate_chat_request(body: Any) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_body")
    err = jsonschema.exceptions.best_match(_validator.iter_errors(body))
    if err is not None:
        param = _path(err)
        raise APIError(400, f"{param or 'body'}: {err.message}", param=param, code="invalid_value")
    msgs = body["messages"]
    ids = set()
    for i, m in enumerate(msgs):
        for j, c in enumerate(m.get("tool_calls") or []):
            try:
                json.loads(c["function"]["arguments"])
            except ValueError:
                raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                               param=f"messages[{i}].tool_calls[{j}].function.arguments", code="invalid_value")
            ids.add(c.get("id"))
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
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools",
                           param="tool_choice", code="unknown_tool")
    elif choice == "required" and not names:
        raise APIError(400, "tool_choice 'required' needs at least one tool", param="tool_choice",
                       code="invalid_value")
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
