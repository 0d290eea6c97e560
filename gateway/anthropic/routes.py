"""The Anthropic Messages routes: ``POST /v1/messages`` (one ``message``, or
Anthropic's server-sent events) and ``POST /v1/messages/count_tokens``.

A request is checked and translated by wire.py into the internal request
(a chat-completions body), planned by the chat route's ``prepare_plan`` and
run by the same agent loop (``run_completion``): nothing below this module
knows which API called.  Errors are raised, never answered here: the
registered handlers answer every ``/v1/messages`` path in Anthropic's shape
(gateway/errors.py).  As for chat, checking and planning run in a worker
thread (their cost grows with the body), and a stream starts only once the
loop's first event is there, so an error up to it is an HTTP error; after the
first byte it is an ``error`` event.
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
from .. import http_guard as guard_
from ..errors import APIError, GatewayError, anthropic_body, engine_error
from ..http_guard import until_disconnected
from ..metrics import Metrics
from ..openai import wire as chat_wire
from ..openai.completions import CompletionPlan, Finish, run_completion
from ..openai.routes import FIRST_TOKEN, prepare_plan
from ..openai.streaming import ClosingStreamingResponse, chain, first_event, stream_error
from ..prompt import render_messages
from . import wire

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ..models import ModelServer

PATH = "/v1/messages"


def build_routes(gw: Any, config: Any) -> List[Route]:
    """The routes, bound to the gateway ``gw`` (its models and tool runtime are made at start-up)."""

    def prepare(raw: bytes, caller: Any) -> Tuple[Dict[str, Any], ModelServer, CompletionPlan, Optional[int]]:
        """The body checked, translated and planned (in a worker thread); with the room the context
        leaves when ``max_tokens`` asks for more (then the output stops at the window, as
        Anthropic's does: ``model_context_window_exceeded``), else None."""
        body = wire.validate_request(chat_wire.parse_json(raw))
        try:
            model, plan = prepare_plan(gw, config, caller, {k: v for k, v in body.items() if k != "max_tokens"})
        except (APIError, GatewayError) as e:  # named in chat-completions fields: say this API's
            raise wire.rename(e) from None
        room = model.max_model_len - len(plan.prompt_ids)
        plan.sampling.max_tokens = min(body["max_tokens"], room)
        return body, model, plan, room if body["max_tokens"] > room else None

    def count(raw: bytes) -> int:
        body = wire.validate_request(chat_wire.parse_json(raw), count=True)
        model = gw.models.get(body["model"])
        if model is None:
            raise APIError(404, f"the model {body['model']!r} does not exist (available: "
                                f"{', '.join(gw.models)})", param="model", code="model_not_found")
        try:
            return len(render_messages(model.tokenizer, body["messages"], body.get("tools") or [],
                                       model.tool_format, model.reasoning_format))
        except ValueError as e:
            raise APIError(400, f"messages could not be rendered for this model: {e}", param="messages",
                           code="invalid_value") from None

    async def messages(request: Request) -> Response:
        arrived = time.perf_counter()  # the time to first token counts from here
        caller = guard_.authenticate(config, request)
        guard_.require_json(request)
        raw = await guard_.read_body(request, config.max_request_bytes)
        body, model, plan, window = await anyio.to_thread.run_sync(prepare, raw, caller)
        plan.arrived_at = arrived
        events = run_completion(model, plan, gw.runtime, gw.metrics)
        if not body.get("stream"):
            return JSONResponse(await until_disconnected(request, collect(gw.metrics, model, plan, events, window)))
        try:
            first = await until_disconnected(request, first_event(events))
        except BaseException:
            await events.aclose()
            raise
        return ClosingStreamingResponse(stream_events(gw.metrics, model, plan, events, first, window),
                                        on_close=events.aclose, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def count_tokens(request: Request) -> Response:
        guard_.authenticate(config, request)
        guard_.require_json(request)
        raw = await guard_.read_body(request, config.max_request_bytes)
        return JSONResponse({"input_tokens": await anyio.to_thread.run_sync(count, raw)})

    return [Route(PATH, messages, methods=["POST"]),
            Route(PATH + "/count_tokens", count_tokens, methods=["POST"])]


def _start(model: ModelServer, plan: CompletionPlan) -> Dict[str, Any]:
    """The message before any event: no content, the whole prompt as its input (the cache reads
    are known at the end: ``message_delta`` says them)."""
    return wire.message(wire.message_id(), model.name, [], None, None,
                        {"input_tokens": len(plan.prompt_ids), "output_tokens": 0,
                         "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0})


async def _translated(metrics: Metrics, model: ModelServer, plan: CompletionPlan, events: AsyncIterator[Any],
                      window: Optional[int]) -> AsyncIterator[Dict[str, Any]]:
    """The loop's events as Anthropic's content events, counted in ``metrics`` as they pass
    (``window``: :class:`wire.Blocks`'s)."""
    blocks, first = wire.Blocks(window), True
    async for ev in events:
        if first and isinstance(ev, FIRST_TOKEN):
            metrics.ttft.labels(model.name).observe(time.perf_counter() - plan.arrived_at)
            first = False
        if isinstance(ev, Finish):
            metrics.request(PATH, model.name, 200)
            metrics.usage(model.name, ev.usage)
            for out in blocks.finish(ev):
                yield out
            return
        for out in blocks.feed(ev):
            yield out
    raise APIError(500, "the completion ended without a finish event", "server_error", code="internal_error")


async def collect(metrics: Metrics, model: ModelServer, plan: CompletionPlan, events: Any,
                  window: Optional[int] = None) -> Dict[str, Any]:
    """The whole completion as one ``message``."""
    try:
        async with contextlib.aclosing(events):
            out = [e async for e in _translated(metrics, model, plan, events, window)]
    except EngineError as e:
        raise engine_error(e) from e
    return wire.fold(_start(model, plan), out)


async def stream_events(metrics: Metrics, model: ModelServer, plan: CompletionPlan, events: Any,
                        first: Any, window: Optional[int] = None) -> AsyncIterator[bytes]:
    """Anthropic's server-sent events of one completion whose first event is already known:
    ``message_start``, a ``ping``, the blocks, ``message_delta``, ``message_stop``.  Whatever goes
    wrong after the first byte, the client gets an ``error`` event -- never a stream that just stops."""
    yield wire.sse({"type": "message_start", "message": _start(model, plan)})
    yield wire.sse({"type": "ping"})
    try:
        async with contextlib.aclosing(events):
            async for out in _translated(metrics, model, plan, chain(first, events), window):
                yield wire.sse(out)
    except Exception as e:  # noqa: BLE001  (reported to the client, logged with its traceback)
        err = stream_error(e)
        metrics.request(PATH, model.name, err.status)
        yield wire.sse(anthropic_body(err))
