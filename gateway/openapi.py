"""The OpenAPI 3.1 document served at ``GET /openapi.json``.

Built from the application's own route table, so an endpoint cannot exist
without being listed; each operation's description lives here, beside its
request and answer schemas (``tests/test_semantic_api.py`` checks that every
route has one).  The full contract of the session endpoints is
docs/semantic-variables.md.

The document says what *this* server does: which operations need a key
follows its configuration (``server.api_keys``, ``server.metrics_key``), and
the chat request's schema is the one the server validates with.
``tests/test_openapi_conformance.py`` runs schemathesis against a live
gateway to hold it to that (statuses, bodies, content types, ``Allow``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Iterator, List, Tuple

from starlette.routing import BaseRoute, Mount, Route

from ..version import __version__
from .anthropic.wire import COUNT_SCHEMA as MESSAGES_COUNT_SCHEMA, REQUEST_SCHEMA as MESSAGES_REQUEST_SCHEMA
from .openai.text_completions import COMPLETION_REQUEST_SCHEMA
from .openai.wire import CHAT_REQUEST_SCHEMA
from .responses.wire import RESPONSES_REQUEST_SCHEMA
from .sampling import PROPERTIES as SAMPLING_PROPERTIES

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                     "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
                                     "call": {"type": ["string", "null"], "description": "424: the failed producer"}}}}}
SAMPLING = {"type": "object", "additionalProperties": False, "properties": SAMPLING_PROPERTIES}
TRANSFORM = {"type": "object", "additionalProperties": False, "properties": {
    "strip": {"type": "boolean"}, "json_field": {"type": "string", "description": "dotted path: a.b.0"},
    "regex": {"type": "string", "maxLength": 512}, "group": {"type": ["integer", "string"]}}}
OUTPUT = {"type": "object", "additionalProperties": False, "properties": {
    "variable": {"type": "string", "description": "a declared variable to write (else a new one)"},
    "name": {"type": "string"}, "sampling": SAMPLING, "transform": TRANSFORM,
    "criterion": {"enum": ["latency", "throughput"]}}}
BINDING = {"oneOf": [{"type": "string", "description": "a variable id"},
                     {"type": "object", "required": ["value"], "properties": {"value": {"type": "string"}},
                      "additionalProperties": False},
                     {"type": "object", "required": ["call", "output"], "additionalProperties": False,
                      "description": "in a batch: the output of an earlier call of the batch",
                      "properties": {"call": {"type": "integer", "minimum": 0}, "output": {"type": "string"}}}]}
LLM_CALL = {"type": "object", "required": ["model"], "additionalProperties": False, "properties": {
    "model": {"type": "string"},
    "template": {"type": "string", "description": "text with {{input:NAME}} and {{output:NAME}} placeholders"},
    "messages": {"type": "array", "description": "instead of template: a chat prompt, rendered as the chat endpoint "
                 "renders it; the last message is {role: assistant, content: '{{output:NAME}}'}",
                 "items": {"type": "object", "required": ["role", "content"], "additionalProperties": False,
                           "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]},
                                          "content": {"type": "string"}}}},
    "inputs": {"type": "object", "additionalProperties": BINDING},
    "outputs": {"type": "object", "additionalProperties": OUTPUT},
    "chat": {"type": "boolean", "description": "wrap the text before the first output in the chat template"}}}
TOOL_CALL = {"type": "object", "required": ["tool", "outputs"], "additionalProperties": False, "properties": {
    "tool": {"type": "string", "description": "a registered, enabled plugin tool"},
    "arguments": {"type": "object", "description": "string leaves may hold {{input:NAME}}"},
    "inputs": {"type": "object", "additionalProperties": BINDING},
    "outputs": {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": OUTPUT}}}
VARIABLE = {"type": "object", "properties": {"id": {"type": "string"}, "name": {"type": ["string", "null"]},
                                             "ready": {"type": "boolean"}, "failed": {"type": "boolean"},
                                             "producer": {"type": ["string", "null"]}}}


def _json(schema: Dict[str, Any]) -> Dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


#: Server-sent events (a streamed completion, a streamed variable); OpenAPI 3.1's ``schema`` of an
#: event stream describes one event
SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON object; the last event is [DONE]"},
    "event": {"type": "string"}}}}}


def _answer(desc: str, schema: Any) -> Dict[str, Any]:
    """A documented response: JSON of ``schema``, or the media types ``schema`` maps (a str key: a media type)."""
    if schema is None:
        return {"description": desc}
    if all(isinstance(k, str) and "/" in k for k in schema):
        return {"description": desc, "content": schema}
    return {"description": desc, **_json(schema)}


def _op(summary: str, answers: Dict[int, Any], body: Any = None, params: Tuple[Dict[str, Any], ...] = (),
        auth: str = "apiKey", body_required: bool = True) -> Dict[str, Any]:
    op: Dict[str, Any] = {"summary": summary, "responses": {
        str(code): _answer(desc, schema) for code, (desc, schema) in answers.items()}}
    if body is not None:
        op["requestBody"] = {"required": body_required, **_json(body)}
    if params:
        op["parameters"] = list(params)
    op["security"] = [] if auth == "none" else [{auth: []}]
    return op


def _q(name: str, schema: Dict[str, Any], desc: str) -> Dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": desc}


ERR = ("error (OpenAI-style body)", ERROR)
#: Anthropic's error body, which the /v1/messages routes answer with
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
AERR = ("error (Anthropic's body: {type: error, error: {type, message}})", ANTHROPIC_ERROR)
LIST = {"type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}}}}
MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"],
         "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                        "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}
SESSION_ERRS = {401: ("no session token", ERROR), 403: ("another session's token", ERROR),
                404: ("no such session (or variable / call in it)", ERROR)}

OPERATIONS: Dict[Tuple[str, str], Dict[str, Any]] = {
    ("/health", "get"): _op("Liveness and the served models", {200: ("ok", {
        "type": "object", "required": ["status", "models"],
        "properties": {"status": {"const": "ok"}, "models": {"type": "array", "items": {"type": "string"}}}})},
        auth="none"),
    ("/metrics", "get"): _op(
        "Prometheus metrics (text format), labelled by route template, model and tool: no client ids",
        {200: ("metrics", {"text/plain": {"schema": {"type": "string"}}}),
         401: ("server.metrics_key is set and the request does not carry it", ERROR)}, auth="metricsKey"),
    ("/openapi.json", "get"): _op("This document", {200: ("OpenAPI 3.1", {"type": "object"})}, auth="none"),
    ("/v1/models", "get"): _op("The configured models (OpenAI list)", {200: ("models", LIST), 401: ERR}),
    ("/v1/models/{id}", "get"): _op(
        "One configured model (OpenAI's models.retrieve); an id may hold slashes",
        {200: ("the model", MODEL), 401: ERR, 404: ("no such model (code model_not_found)", ERROR)}),
    ("/v1/completions", "post"): _op(
        "OpenAI legacy text completions: a raw prompt (text or token ids, no chat template) continued; "
        "streaming, the chat route's sampling and limits (README)",
        {200: ("a text_completion, or server-sent text_completion chunks when stream is true",
               {"application/json": {"schema": {"type": "object"}}, **SSE}),
         400: ERR, 401: ERR, 404: ERR, 413: ERR, 415: ERR, 429: ERR},
        # the schema the server validates with; other fields are refused (400 unknown_parameter), and
        # the unimplemented ones are accepted only at their neutral value (text_completions.UNSUPPORTED)
        body={**COMPLETION_REQUEST_SCHEMA, "additionalProperties": False}),
    ("/v1/plugins", "get"): _op("Installed plugins, their tools and parsers", {200: ("plugins", LIST), 401: ERR}),
    ("/v1/chat/completions", "post"): _op(
        "OpenAI chat completions: tools (arguments streamed member by member; a call that fails after it was "
        "passed on is withdrawn: interlace.withdrawn_tool_calls), structured output, streaming, a reasoning "
        "model's reasoning_content, Interlace extensions (README)",
        {200: ("a chat.completion, or server-sent chunks when stream is true",
               {"application/json": {"schema": {"type": "object"}}, **SSE}),
         400: ERR, 401: ERR, 403: ERR, 404: ERR, 413: ERR, 415: ERR, 429: ERR},
        # the schema the server validates with; other fields are refused (400 unknown_parameter), and
        # OpenAI's unimplemented ones are accepted only at their neutral value (wire.UNSUPPORTED)
        body={**CHAT_REQUEST_SCHEMA, "additionalProperties": False}),
    ("/v1/messages", "post"): _op(
        "Anthropic Messages (Claude Code): text / tool_use / tool_result / thinking blocks, tools, tool_choice, "
        "streaming with Anthropic's events; errors in Anthropic's shape (README)",
        {200: ("a message, or Anthropic's server-sent events when stream is true",
               {"application/json": {"schema": {"type": "object"}}, **SSE}),
         400: AERR, 401: AERR, 403: AERR, 404: AERR, 413: AERR, 415: AERR, 429: AERR},
        body={**MESSAGES_REQUEST_SCHEMA, "additionalProperties": False}),
    ("/v1/messages/count_tokens", "post"): _op(
        "Anthropic count_tokens: the tokens of the prompt the request renders to, tools included",
        {200: ("the count", {"type": "object", "required": ["input_tokens"],
                             "properties": {"input_tokens": {"type": "integer"}}}),
         400: AERR, 401: AERR, 404: AERR, 413: AERR, 415: AERR, 429: AERR},
        body={**MESSAGES_COUNT_SCHEMA, "additionalProperties": False}),
    ("/v1/responses", "post"): _op(
        "OpenAI Responses: input items, function and mcp tools, reasoning items, text.format, typed stream "
        "events, previous_response_id (the kept engine context), background (README)",
        {200: ("a response, or its typed server-sent events when stream is true",
               {"application/json": {"schema": {"type": "object"}}, **SSE}),
         400: ERR, 401: ERR, 403: ERR, 404: ERR, 413: ERR, 415: ERR, 429: ERR,
         503: ("the response store failed (nothing was kept)", ERROR)},
        # the schema the server validates with; other fields are refused (400 unknown_parameter), and
        # the unimplemented ones are accepted only at their neutral value (responses/wire.UNSUPPORTED)
        body={**RESPONSES_REQUEST_SCHEMA, "additionalProperties": False}),
    ("/v1/responses/{id}", "get"): _op(
        "A stored response of the caller's key (another key's: 404)",
        {200: ("the response", {"type": "object"}), 401: ERR, 404: ERR, 503: ERR}),
    ("/v1/responses/{id}", "delete"): _op(
        "Delete a stored response of the caller's key (a running background one is cancelled first)",
        {200: ("deleted", {"type": "object", "required": ["id", "object", "deleted"]}), 401: ERR, 404: ERR,
         503: ERR}),
    ("/v1/responses/{id}/input_items", "get"): _op(
        "The input items of a stored response (OpenAI list)",
        {200: ("the items", LIST), 400: ERR, 401: ERR, 404: ERR, 503: ERR},
        params=(_q("order", {"enum": ["asc", "desc"]}, "default desc"),
                _q("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "default 20"),
                _q("after", {"type": "string"}, "an item id: the items after it"),
                _q("include", {"type": "array", "items": {"type": "string"}}, "accepted, no effect"))),
    ("/v1/responses/{id}/cancel", "post"): _op(
        "Cancel a queued or in-progress background response",
        {200: ("the cancelled response", {"type": "object"}), 400: ERR, 401: ERR, 404: ERR,
         409: ("the response has already ended", ERROR), 503: ERR}),
    ("/v1/sessions", "post"): _op(
        "Create a Semantic Variables session; answers its id and bearer token (and submits a first batch of "
        "calls with it, all or nothing: a refused batch leaves no session)",
        {201: ("the session", {"type": "object", "properties": {
            "id": {"type": "string"}, "token": {"type": "string"}, "ttl_s": {"type": "number"},
            "expires_at": {"type": "number"}, "limits": {"type": "object"}, "calls": {"type": "array"}}}),
         400: ERR, 401: ERR, 403: ERR, 404: ERR, 409: ERR, 413: ERR, 415: ERR, 429: ERR},
        body={"type": "object", "properties": {"ttl_s": {"type": "number", "exclusiveMinimum": 0},
                                               "calls": {"type": "array", "items": {"oneOf": [LLM_CALL, TOOL_CALL]}}},
              "additionalProperties": False}, body_required=False),
    ("/v1/sessions/{sid}", "get"): _op(
        "A session's state and usage (prompt, filled and forked tokens)",
        {200: ("state", {"type": "object"}), **SESSION_ERRS}, auth="sessionToken"),
    ("/v1/sessions/{sid}", "delete"): _op(
        "Delete a session: abort its calls, free its variables and engine contexts",
        {200: ("deleted", {"type": "object"}), **SESSION_ERRS}, auth="sessionToken"),
    ("/v1/sessions/{sid}/variables", "post"): _op(
        "Create a Semantic Variable, declared or with a value",
        {201: ("the variable", VARIABLE), 400: ERR, 413: ERR, 415: ERR, 429: ERR, **SESSION_ERRS},
        body={"type": "object", "additionalProperties": False,
              "properties": {"name": {"type": "string"}, "value": {"type": "string"}}}, auth="sessionToken"),
    ("/v1/sessions/{sid}/variables/{vid}", "put"): _op(
        "Set a declared variable's value (once); calls waiting for it are dispatched",
        {200: ("the variable", VARIABLE), 400: ERR, 409: ERR, 413: ERR, 415: ERR, **SESSION_ERRS},
        body={"type": "object", "required": ["value"], "properties": {"value": {"type": "string"}},
              "additionalProperties": False}, auth="sessionToken"),
    ("/v1/sessions/{sid}/variables/{vid}", "get"): _op(
        "Wait for a variable's value (or stream it as generated); the criterion guides scheduling",
        {200: ("the value, or server-sent events {delta} ... {value} | {error}, [DONE] when stream=true",
               {"application/json": {"schema": {"type": "object", "properties": {
                   "id": {"type": "string"}, "value": {"type": "string"}}}}, **SSE}),
         400: ERR, 408: ("timeout_s elapsed; ask again", ERROR), 424: ("its producer failed", ERROR),
         **SESSION_ERRS},
        params=(_q("criterion", {"enum": ["latency", "throughput"]}, "what the application waits for"),
                _q("stream", {"type": "boolean"}, "server-sent events of the text as generated"),
                _q("timeout_s", {"type": "number"}, "give up after this many seconds (408)")),
        auth="sessionToken"),
    ("/v1/sessions/{sid}/calls", "post"): _op(
        "Submit a semantic call (an LLM prompt, or a tool node), or a batch of them, into the session's DAG",
        {201: ("the call and its output variables (a batch: {calls: [...]} of them)", {
            "type": "object", "properties": {"id": {"type": "string"}, "outputs": {"type": "object"},
                                             "state": {"type": "string"}, "calls": {"type": "array"}}}),
         400: ERR, 403: ERR, 409: ERR, 413: ERR, 415: ERR, 429: ERR, **SESSION_ERRS},
        body={"oneOf": [LLM_CALL, TOOL_CALL, {
            "type": "object", "required": ["calls"], "additionalProperties": False,
            "description": "a batch, all or nothing; an input may be {call: i, output: NAME}, an earlier call's output",
            "properties": {"calls": {"type": "array", "items": {"oneOf": [LLM_CALL, TOOL_CALL]}}}}]},
        auth="sessionToken"),
    ("/v1/sessions/{sid}/calls/{cid}", "get"): _op(
        "A call's state, error, and deduced objective and task group",
        {200: ("the call", {"type": "object"}), **SESSION_ERRS}, auth="sessionToken"),
}


def _endpoints(routes: Iterable[BaseRoute], prefix: str = "", names: Tuple[str, ...] = ()
               ) -> Iterator[Tuple[str, List[str], Route]]:
    """(full path, path parameter names, route) of every route, mounted groups included."""
    for r in routes:
        if isinstance(r, Mount):
            yield from _endpoints(r.routes, prefix + r.path, (*names, *(p for p in r.param_convertors if p != "path")))
        elif isinstance(r, Route) and r.include_in_schema:
            # OpenAPI names a parameter without its converter: /v1/models/{id:path} is /v1/models/{id}
            yield re.sub(r"\{(\w+):\w+\}", r"{\1}", prefix + r.path), [*names, *r.param_convertors], r


def openapi_document(routes: Iterable[BaseRoute], api_keys: bool = True, metrics_key: bool = False
                     ) -> Dict[str, Any]:
    """Every route of ``routes`` with its operation (a route without a
    description here is still listed, marked undocumented).  ``api_keys``:
    whether the server has API keys (without, the operations that would need
    one are open); ``metrics_key``: whether ``/metrics`` needs its key."""
    open_schemes = {s for s, on in (("apiKey", api_keys), ("metricsKey", metrics_key)) if not on}
    paths: Dict[str, Dict[str, Any]] = {}
    for path, names, r in _endpoints(routes):
        methods = sorted(m.lower() for m in (r.methods or {"GET"}) if m != "HEAD")
        for m in methods:
            op = OPERATIONS.get((path, m)) or {"summary": "(undocumented)", "responses": {"200": {"description": ""}}}
            params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in names]
            if params:
                op = {**op, "parameters": params + op.get("parameters", [])}
            if any(scheme in open_schemes for req in op.get("security", []) for scheme in req):
                op = {**op, "security": []}
            paths.setdefault(path, {})[m] = op
    return {"openapi": "3.1.0",
            "info": {"title": "Interlace gateway", "version": __version__,
                     "description": "OpenAI-compatible chat completions with server-side tools, and Parrot-style "
                                    "Semantic Variables (docs/semantic-variables.md)."},
            "components": {"securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer",
                           "description": "a server API key (server.api_keys); none needed when none is configured"},
                "sessionToken": {"type": "http", "scheme": "bearer",
                                 "description": "the token POST /v1/sessions answered for that session"},
                "metricsKey": {"type": "http", "scheme": "bearer",
                               "description": "server.metrics_key; /metrics is open when none is configured"}}},
            "paths": paths}
