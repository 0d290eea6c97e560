"""The OpenAI chat-completions route, and the answer it makes of the agent
loop's events: one ``chat.completion`` object (:func:`collect`) or a stream of
``chat.completion.chunk`` events (:func:`stream_chunks`); beside it, the
wing's other routes: ``GET /v1/models/{id}`` (:func:`model_object`) and the
legacy ``POST /v1/completions`` (text_completions.py).

The route validates (wire.py), plans (plan.py) and runs the loop
(completions.py); errors are raised, never answered here (gateway/errors.py
shapes them).  Validating and planning run in a worker thread: their cost
grows with the body (a 3.5 MB prompt held the event loop 15 s, tokenizing),
and nothing in them needs the loop.  A streamed answer starts only once the
loop's first event is there, so everything that can go wrong before it (a
context too long, an engine that refuses the sampling) is still an HTTP
error; after the first byte, an error is an event in OpenAI's shape followed
by ``[DONE]``.
:func:`collect` and :func:`stream_chunks` take the metrics they count
requests and tokens in, not the gateway.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Tuple

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...engine_ext.errors import EngineError
from ...engine_ext.native.setup import ZOO_PREFIX
from ...engine_ext.variant_engine import VariantEngine
from .. import http_guard as guard_
from ..errors import APIError, engine_error
from ..http_guard import until_disconnected
from ..metrics import Metrics
from . import wire as api
from .completions import (CallArgs, CallStart, CompletionPlan, Content, Finish, ReasoningText, ServerToolResult,
                          TokenLogprob, run_completion)
from .plan import build_plan
from .streaming import ClosingStreamingResponse, chain, first_event, stream_error
from .text_completions import build_routes as text_completion_routes

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ..models import ModelServer


def prepare_plan(gw: Any, config: Any, caller: Any, body: Dict[str, Any]) -> Tuple[ModelServer, CompletionPlan]:
    """A validated request in the internal shape (a chat-completions body: what every API's wire
    module translates to) planned for its model: the model looked up (404), the caller's rights to
    the extensions checked (403), the plan built (400s name chat-completions fields; the other APIs'
    wire modules rename them).  CPU work that grows with the body: call it in a worker thread."""
    model = gw.models.get(body["model"])
    if model is None:
        raise APIError(404, f"the model {body['model']!r} does not exist (available: "
                            f"{', '.join(gw.models)})", param="model", code="model_not_found")
    tools = gw.runtime.tools if gw.runtime else {}
    guard_.authorize(config, caller, body, [n for n, t in tools.items() if t.enabled])
    plan = build_plan(model, body, available_tools=tools, default_max_tokens=config.default_max_tokens,
                      max_tool_rounds=config.max_tool_rounds, caller=caller.name if caller else None)
    return model, plan


def build_routes(gw: Any, config: Any) -> List[Route]:
    """The route, bound to the gateway ``gw`` (its models and tool runtime are made at start-up)."""

    def prepare(raw: bytes, caller: Any) -> Tuple[Dict[str, Any], ModelServer, CompletionPlan]:
        """The request's body checked and planned (in a worker thread: nothing here touches the loop)."""
        body = api.validate_chat_request(api.parse_json(raw))
        return (body, *prepare_plan(gw, config, caller, body))

    async def chat_completions(request: Request) -> Response:
        arrived = time.perf_counter()  # the time to first token counts from here
        caller = guard_.authenticate(config, request)
        guard_.require_json(request)
        raw = await guard_.read_body(request, config.max_request_bytes)
        # parsing, validation, rendering, tokenizing and grammar compilation are CPU work that grows
        # with the body: a worker thread does it, so other clients are answered meanwhile
        body, model, plan = await anyio.to_thread.run_sync(prepare, raw, caller)
        plan.arrived_at = arrived
        events = run_completion(model, plan, gw.runtime, gw.metrics)
        if not body.get("stream"):
            return JSONResponse(await until_disconnected(request, collect(gw.metrics, model, plan, events)))
        # Start generating before the response does: an error up to the first event (a context
        # too long, an engine that refuses the sampling) is still an HTTP error, not a broken stream.
        try:
            first = await until_disconnected(request, first_event(events))
        except BaseException:
            await events.aclose()
            raise
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return ClosingStreamingResponse(stream_chunks(gw.metrics, model, events, first, include_usage,
                                                      plan.arrived_at, server_tools=bool(plan.server_tools)),
                                        on_close=events.aclose, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def list_models(request: Request) -> Response:
        guard_.authenticate(config, request)
        return JSONResponse({"object": "list", "data": [model_object(m) for m in gw.models.values()]})

    async def retrieve_model(request: Request) -> Response:
        guard_.authenticate(config, request)
        model = gw.models.get(request.path_params["id"])
        if model is None:
            raise APIError(404, f"the model {request.path_params['id']!r} does not exist (available: "
                                f"{', '.join(gw.models)})", param="model", code="model_not_found")
        return JSONResponse(model_object(model))

    return [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            # ids may hold slashes (a zoo variant's zoo/NAME, a served org/model)
            Route("/v1/models/{id:path}", retrieve_model, methods=["GET"]),
            *text_completion_routes(gw, config)]


def model_object(m: ModelServer) -> Dict[str, Any]:
    """A served model as OpenAI's model object, as ``GET /v1/models`` lists it and
    ``GET /v1/models/{id}`` answers it (openai's ``models.retrieve``)."""
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "interlace",
            "max_model_len": m.max_model_len,
            # a zoo variant (vLLM's LoRA convention): its zoo path and the base it shares blocks with
            **({"root": m.spec.path, "parent": ZOO_PREFIX + m.engine.inner.name}
               if isinstance(m.engine, VariantEngine) else {})}


async def collect(metrics: Metrics, model: ModelServer, plan: CompletionPlan, events: Any) -> Dict[str, Any]:
    """The whole completion as one ``chat.completion`` object."""
    content: List[str] = []
    reasoning: List[str] = []
    calls: Dict[int, Dict[str, Any]] = {}
    results: List[Dict[str, Any]] = []
    logprobs: List[Dict[str, Any]] = []
    finish: Optional[Finish] = None
    first = True
    try:
        async with contextlib.aclosing(events):
            async for ev in events:
                if first and isinstance(ev, FIRST_TOKEN):
                    metrics.ttft.labels(model.name).observe(time.perf_counter() - plan.arrived_at)
                    first = False
                if isinstance(ev, Content):
                    content.append(ev.text)
                elif isinstance(ev, ReasoningText):
                    reasoning.append(ev.text)
                elif isinstance(ev, TokenLogprob):
                    logprobs.append(_logprob_entry(ev))
                elif isinstance(ev, CallStart) and not ev.server:
                    calls[ev.index] = {"id": ev.id, "type": "function",
                                       "function": {"name": ev.name, "arguments": ""}}
                elif isinstance(ev, CallArgs) and not ev.server and ev.index in calls:
                    calls[ev.index]["function"]["arguments"] += ev.fragment
                elif isinstance(ev, ServerToolResult):
                    results.append(ev.to_dict())
                elif isinstance(ev, Finish):
                    finish = ev
    except EngineError as e:
        raise engine_error(e) from e
    if finish is None:
        raise APIError(500, "the completion ended without a finish event", "server_error", code="internal_error")
    metrics.request("/v1/chat/completions", model.name, 200)
    metrics.usage(model.name, finish.usage)
    message: Dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if reasoning:  # vLLM's and DeepSeek's field; absent when the model wrote none
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    out = {"id": api.completion_id(), "object": "chat.completion", "created": api.now(), "model": model.name,
           "choices": [{"index": 0, "message": message, "finish_reason": finish.reason,
                        "logprobs": {"content": logprobs, "refusal": None} if plan.sampling.logprobs else None}],
           "usage": finish.usage}
    ext = finish_extension(finish, results if plan.server_tools else None)
    if ext:
        out["interlace"] = ext
    return out


#: the loop's events that are the completion's first token (its time to first token): reasoning too
FIRST_TOKEN = (Content, ReasoningText, CallStart)


def finish_extension(finish: Finish, results: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """The ``interlace`` extension of a finished completion (the answer's, the finish chunk's):
    ``tool_calls``, the server-side calls' records (``results``; None: server tools were not asked
    for, else always there, so clients can read it whether or not a call ran), and
    ``withdrawn_tool_calls``, the client calls passed on and then withdrawn (completions.py), only
    when there are any."""
    ext: Dict[str, Any] = {}
    if results is not None:
        ext["tool_calls"] = results
    if finish.withdrawn:
        ext["withdrawn_tool_calls"] = list(finish.withdrawn)
    return ext


def _logprob_entry(ev: TokenLogprob) -> Dict[str, Any]:
    return {"token": ev.text, "logprob": ev.logprob, "bytes": list(ev.text.encode()), "top_logprobs": []}


async def stream_chunks(metrics: Metrics, model: ModelServer, events: Any, first_event: Any,
                        include_usage: bool, arrived_at: float, *, server_tools: bool = False) -> AsyncIterator[bytes]:
    """Server-sent events of one completion whose first event is already known.
    Whatever goes wrong after the first byte, the client gets an error event in
    OpenAI's shape and then ``[DONE]`` -- never a connection that just stops.
    ``arrived_at``: the request's arrival (``time.perf_counter()``), where the time to first token starts.
    ``server_tools``: the request asked for server-side tools, so the finish chunk carries their records."""
    cid, created, name = api.completion_id(), api.now(), model.name
    first = True
    pending_logprobs: List[Dict[str, Any]] = []
    results: List[Dict[str, Any]] = []  # the server-side calls' records, for the finish chunk
    yield api.sse(api.chunk(cid, name, created, {"role": "assistant", "content": ""}))
    try:
        async with contextlib.aclosing(events):
            async for ev in chain(first_event, events):
                if first and isinstance(ev, FIRST_TOKEN):
                    metrics.ttft.labels(name).observe(time.perf_counter() - arrived_at)
                    first = False
                if isinstance(ev, TokenLogprob):
                    pending_logprobs.append(_logprob_entry(ev))
                elif isinstance(ev, ReasoningText):
                    c = api.chunk(cid, name, created, {"reasoning_content": ev.text})
                    if pending_logprobs:
                        c["choices"][0]["logprobs"] = {"content": pending_logprobs, "refusal": None}
                        pending_logprobs = []
                    yield api.sse(c)
                elif isinstance(ev, Content):
                    c = api.chunk(cid, name, created, {"content": ev.text})
                    if pending_logprobs:
                        c["choices"][0]["logprobs"] = {"content": pending_logprobs, "refusal": None}
                        pending_logprobs = []
                    yield api.sse(c)
                elif isinstance(ev, CallStart):
                    if ev.server:
                        yield api.sse(api.chunk(cid, name, created, {}, interlace={
                            "tool_call_start": {"index": ev.index, "id": ev.id, "name": ev.name}}))
                    else:
                        yield api.sse(api.chunk(cid, name, created, {"tool_calls": [{
                            "index": ev.index, "id": ev.id, "type": "function",
                            "function": {"name": ev.name, "arguments": ""}}]}))
                elif isinstance(ev, CallArgs):
                    if ev.server:
                        yield api.sse(api.chunk(cid, name, created, {}, interlace={
                            "tool_call_arguments": {"index": ev.index, "fragment": ev.fragment}}))
                    else:
                        yield api.sse(api.chunk(cid, name, created, {"tool_calls": [{
                            "index": ev.index, "function": {"arguments": ev.fragment}}]}))
                elif isinstance(ev, ServerToolResult):
                    results.append(ev.to_dict())
                    yield api.sse(api.chunk(cid, name, created, {}, interlace={"tool_result": results[-1]}))
                elif isinstance(ev, Finish):
                    metrics.request("/v1/chat/completions", name, 200)
                    metrics.usage(name, ev.usage)
                    # server tools asked for: the finish chunk carries every call's record, as the
                    # non-streamed answer's `interlace` does (an empty list when none ran); and the
                    # withdrawn calls, if any
                    ext = finish_extension(ev, results if server_tools else None)
                    yield api.sse(api.chunk(cid, name, created, {}, ev.reason, **({"interlace": ext} if ext else {})))
                    if include_usage:
                        yield api.sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                                       "model": name, "choices": [], "usage": ev.usage})
    except Exception as e:  # noqa: BLE001  (reported to the client, logged with its traceback)
        err = stream_error(e)
        metrics.request("/v1/chat/completions", name, err.status)
        yield api.sse(err.body())
    yield b"data: [DONE]\n\n"
