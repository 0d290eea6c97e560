"""The Responses API routes: ``POST /v1/responses`` (plain, streamed or in the
background), ``GET`` / ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel``.

A request is validated and translated (wire.py) to the internal request,
planned by the chat path's ``prepare_plan`` and run by the same agent loop
(gateway/openai/completions.py); the answer is made of the loop's events by
:class:`~.wire.OutputBuilder`.  Errors are raised (gateway/errors.py shapes
them); the planner's chat field names are renamed to this API's.

Decisions:

* **previous_response_id is the engine context.**  A stored response keeps its
  conversation as chat messages (gateway/responses/store.py); a follow-up's
  prompt is that conversation + its input, after its own ``instructions``
  (OpenAI does not carry instructions over).  With ``store`` (the default)
  the loop also keeps the finished context (``retain_at_stop``), so the
  follow-up's prompt, which starts with the stored prompt + reply, adopts it
  (gateway/retention.py) and is not prefilled again; when the KV was dropped
  meanwhile, the follow-up refills from the text, correctly.
* **Never a lost write reported as success.**  The response is stored before
  it is answered: a store that fails is a 503 (streamed: an ``error`` event and
  ``response.failed`` instead of ``response.completed``).
* **Owners.**  Stored responses belong to the caller's API key (its name):
  another key's id is a 404, exactly as an unknown one.  A key holds at most
  ``server.responses.max_per_key`` live responses (429 beyond).
* **Store disabled** (``server.responses.enabled: false``, ``gw.responses``
  None): ``store: true`` is served as ``store: false`` (nothing kept; the
  answer says ``store: false``), ``previous_response_id`` and the id routes
  are 404, ``background`` a 400.
* **Background** responses (``background: true``, which needs ``store``) are
  tasks the gateway holds (:class:`BackgroundRuns`, ``gw.response_runs``;
  cancelled at shutdown), stored ``queued`` -> ``in_progress`` ->
  ``completed`` / ``incomplete`` / ``failed`` / ``cancelled``, and count
  against the key's ``max_concurrent_requests`` while they run (the run
  takes over the slot of the request that started it).  They cannot
  be streamed (``background`` with ``stream``: 400): poll ``GET``.  One that
  a restart interrupted stays ``in_progress`` in the store; cancelling it
  marks it ``cancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...engine_ext.errors import EngineError
from .. import http_guard as guard_
from ..errors import APIError, Conflict, GatewayError, LimitReached, NotFound, engine_error
from ..http_guard import until_disconnected
from ..key_limits import key_name
from ..openai import wire as chat_wire
from ..openai.completions import run_completion
from ..openai.routes import FIRST_TOKEN, prepare_plan
from ..openai.streaming import ClosingStreamingResponse, chain, first_event, stream_error
from . import wire
from .store import StoreError, StoredResponse

log = logging.getLogger(__name__)

PATH = "/v1/responses"
#: OpenAI's bounds of ``GET /v1/responses/{id}/input_items?limit=``.
MAX_LIST_LIMIT, DEFAULT_LIST_LIMIT = 100, 20


def store_unavailable(e: StoreError) -> APIError:
    return APIError(503, f"the response store failed: {e}", "server_error", code="store_unavailable")


@dataclass
class Run:
    """One response being made: the request, what it was translated to and where it is kept."""

    id: str
    req: Dict[str, Any]
    t: wire.Translation
    model: Any
    plan: Any
    owner: Optional[str]
    history: List[Dict[str, Any]]
    keep: bool                      # stored (store: true and a store)
    created_at: float = field(default_factory=time.time)

    def response(self, status: str, builder: Optional[wire.OutputBuilder] = None,
                 error: Optional[APIError] = None) -> Dict[str, Any]:
        req = dict(self.req, store=self.keep)
        finish = builder.finish if builder is not None else None
        return wire.response_object(
            self.id, req, self.model.name, self.created_at, status,
            output=wire.copy_json(builder.output) if builder is not None else [],
            usage_=wire.usage(finish.usage) if finish is not None else None,
            error={"code": error.code or "server_error", "message": error.message} if error is not None else None,
            incomplete="max_output_tokens" if status == "incomplete" else None)

    def stored(self, response: Dict[str, Any], builder: Optional[wire.OutputBuilder], store: Any) -> StoredResponse:
        return StoredResponse(
            id=self.id, owner=self.owner, model=self.model.name, created_at=self.created_at,
            expires_at=store.expires_at(self.created_at), status=response["status"], response=response,
            input_items=self.t.input_items,
            conversation=list(self.history) + self.t.input_messages + (builder.messages if builder else []),
            previous_response_id=self.req.get("previous_response_id"))


class BackgroundRuns:
    """The background responses this gateway is running, by id (``gw.response_runs``)."""

    def __init__(self) -> None:
        self.tasks: Dict[str, asyncio.Task] = {}

    async def stop(self, rid: str) -> bool:
        """Cancel the run ``rid`` and wait until it has stored its end; False when it is not running here."""
        task = self.tasks.get(rid)
        if task is None:
            return False
        task.cancel()
        await asyncio.wait([task])
        return True

    async def close(self) -> None:
        """Cancel every run (gateway shutdown: before the response store closes, so each stores its end)."""
        for rid in list(self.tasks):
            await self.stop(rid)


async def _consume(events: Any, builder: wire.OutputBuilder, metrics: Any, run: Run) -> None:
    """Feed the whole completion to ``builder`` (no stream events kept); engine errors as the API's."""
    first = True
    try:
        async with contextlib.aclosing(events):
            async for ev in events:
                if first and isinstance(ev, FIRST_TOKEN):
                    metrics.ttft.labels(run.model.name).observe(time.perf_counter() - run.plan.arrived_at)
                    first = False
                builder.feed(ev)
    except EngineError as e:
        raise engine_error(e) from e
    if builder.finish is None:
        raise APIError(500, "the completion ended without a finish event", "server_error", code="internal_error")


def build_routes(gw: Any, config: Any) -> List[Route]:
    """The routes, bound to the gateway ``gw`` (its store, ``gw.responses``, is opened at start-up)."""
    runs = BackgroundRuns()
    gw.response_runs = runs  # Gateway.stop closes it (before the store)

    def servers() -> List[str]:
        return list(config.mcp_servers)

    def prepare(req: Dict[str, Any], history: List[Dict[str, Any]], caller: Any) -> Tuple[wire.Translation, Any, Any]:
        """Translated and planned (in a worker thread: its cost grows with the conversation)."""
        t = wire.translate(req, history, available=gw.runtime.tools if gw.runtime else {}, mcp_servers=servers())
        try:
            model, plan = prepare_plan(gw, config, caller, t.body)
        except (APIError, GatewayError) as e:
            raise wire.rename_error(e, t) from None
        return t, model, plan

    async def load(owner: Optional[str], rid: str, param: Optional[str] = None) -> StoredResponse:
        """The caller's stored response ``rid``: 404 when it is unknown, another key's, expired or not kept."""
        stored = None
        if gw.responses is not None:
            try:
                stored = await gw.responses.get(owner, rid)
            except StoreError as e:
                raise store_unavailable(e) from e
        if stored is None:
            raise APIError(404, f"no response with id {rid!r} found" + (
                "" if gw.responses is not None else " (the gateway stores no responses: server.responses.enabled "
                                                     "is false)"), param=param, code="response_not_found")
        return stored

    async def save(run: Run, response: Dict[str, Any], builder: Optional[wire.OutputBuilder]) -> None:
        try:
            await gw.responses.put(run.stored(response, builder, gw.responses))
        except StoreError as e:
            raise store_unavailable(e) from e

    async def create(request: Request) -> Response:
        arrived = time.perf_counter()
        caller = guard_.authenticate(config, request)
        guard_.require_json(request)
        raw = await guard_.read_body(request, config.max_request_bytes)
        req = await anyio.to_thread.run_sync(lambda: wire.validate_request(chat_wire.parse_json(raw)))
        owner, store = key_name(caller), gw.responses
        if req.get("background") and store is None:
            raise APIError(400, "background: background responses need the response store (server.responses."
                                "enabled is false)", param="background", code="invalid_value")
        keep = store is not None and req.get("store") is not False
        history: List[Dict[str, Any]] = []
        if req.get("previous_response_id"):
            history = (await load(owner, req["previous_response_id"], "previous_response_id")).conversation
        if keep:
            try:
                held = await store.count(owner)
            except StoreError as e:
                raise store_unavailable(e) from e
            limit = config.responses.max_per_key
            if held >= limit:
                who = f"key {owner!r}" if owner is not None else "the server's callers (no API keys)"
                raise LimitReached(f"per-key limit server.responses.max_per_key reached: {who} may keep at most "
                                   f"{limit} stored responses; delete some or let them expire (or send store: "
                                   "false)", param="store", code="rate_limit_exceeded")
        t, model, plan = await anyio.to_thread.run_sync(prepare, req, history, caller)
        plan.arrived_at = arrived
        plan.retain_at_stop = keep
        run = Run(wire.new_id("resp"), req, t, model, plan, owner, history, keep)
        if req.get("background"):
            return await start_background(run, caller)
        events = run_completion(model, plan, gw.runtime, gw.metrics)
        if not req.get("stream"):
            builder = wire.OutputBuilder(servers())
            await until_disconnected(request, _consume(events, builder, gw.metrics, run))
            response = run.response(builder.status, builder)
            if keep:
                await save(run, response, builder)
            gw.metrics.request(PATH, model.name, 200)
            gw.metrics.usage(model.name, builder.finish.usage)
            return JSONResponse(response)
        try:  # an error up to the first event is still an HTTP error
            first = await until_disconnected(request, first_event(events))
        except BaseException:
            await events.aclose()
            raise
        return ClosingStreamingResponse(stream(run, events, first), on_close=events.aclose,
                                        media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream(run: Run, events: Any, first: Any) -> AsyncIterator[bytes]:
        """The typed events of one response whose first loop event is known; after the first byte an error
        is an ``error`` event and ``response.failed``, never a connection that just stops."""
        seq = 0
        builder = wire.OutputBuilder(servers())
        name = run.model.name

        def emit(ev: Dict[str, Any]) -> bytes:
            nonlocal seq
            ev["sequence_number"] = seq
            seq += 1
            return wire.sse(ev)

        started = run.response("in_progress")
        yield emit({"type": "response.created", "response": started})
        yield emit({"type": "response.in_progress", "response": started})
        first_token = True
        try:
            async with contextlib.aclosing(events):
                async for ev in chain(first, events):
                    if first_token and isinstance(ev, FIRST_TOKEN):
                        gw.metrics.ttft.labels(name).observe(time.perf_counter() - run.plan.arrived_at)
                        first_token = False
                    for out in builder.feed(ev):
                        yield emit(out)
            if builder.finish is None:
                raise APIError(500, "the completion ended without a finish event", "server_error",
                               code="internal_error")
            final = run.response(builder.status, builder)
            if run.keep:
                await save(run, final, builder)
            gw.metrics.request(PATH, name, 200)
            gw.metrics.usage(name, builder.finish.usage)
            yield emit({"type": f"response.{builder.status}", "response": final})
        except Exception as e:  # noqa: BLE001  (reported to the client; a 5xx is logged by stream_error)
            err = e if isinstance(e, APIError) else stream_error(e)
            gw.metrics.request(PATH, name, err.status)
            yield emit({"type": "error", "code": err.code, "message": err.message, "param": err.param})
            yield emit({"type": "response.failed", "response": run.response("failed", builder, err)})

    async def start_background(run: Run, caller: Any) -> Response:
        # the run takes over this request's slot (a key allowed one request in flight may run one in the
        # background); a 429 (LimitReached) when the key's other work already holds every slot
        gw.key_limits.enter(caller, within_request=True)
        try:
            queued = run.response("queued")
            await save(run, queued, None)
        except BaseException:
            gw.key_limits.leave(caller)
            raise
        runs.tasks[run.id] = asyncio.create_task(background(run, caller), name=f"response {run.id}")
        return JSONResponse(queued)

    async def background(run: Run, caller: Any) -> None:
        builder = wire.OutputBuilder(servers())
        try:
            await save(run, run.response("in_progress"), None)
            await _consume(run_completion(run.model, run.plan, gw.runtime, gw.metrics), builder, gw.metrics, run)
            await save(run, run.response(builder.status, builder), builder)
            gw.metrics.request(PATH, run.model.name, 200)
            gw.metrics.usage(run.model.name, builder.finish.usage)
        except asyncio.CancelledError:
            await quiet_save(run, run.response("cancelled", builder), builder)
        except Exception as e:  # noqa: BLE001  (stored as the response's error; a 5xx is logged)
            err = e if isinstance(e, APIError) else stream_error(e)
            gw.metrics.request(PATH, run.model.name, err.status)
            await quiet_save(run, run.response("failed", builder, err), builder)
        finally:
            gw.key_limits.leave(caller)
            runs.tasks.pop(run.id, None)

    async def quiet_save(run: Run, response: Dict[str, Any], builder: wire.OutputBuilder) -> None:
        """Store how a background run ended; a store that fails now has nobody to tell but the log."""
        try:
            await save(run, response, builder)
        except APIError as e:
            log.error("background response %s ended %s but could not be stored: %s", run.id, response["status"],
                      e.message)

    async def one(request: Request) -> Response:
        """``GET`` (the stored Response object) and ``DELETE`` (one route: its ``Allow`` names both)."""
        caller = guard_.authenticate(config, request)
        owner, rid = key_name(caller), request.path_params["id"]
        if request.method == "GET":
            return JSONResponse((await load(owner, rid)).response)
        await load(owner, rid)  # 404 for another key's: its run is not ours to stop
        await runs.stop(rid)
        try:
            deleted = await gw.responses.delete(owner, rid)
        except StoreError as e:
            raise store_unavailable(e) from e
        if not deleted:
            raise NotFound(f"no response with id {rid!r} found", code="response_not_found")
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def cancel(request: Request) -> Response:
        caller = guard_.authenticate(config, request)
        owner, rid = key_name(caller), request.path_params["id"]
        stored = await load(owner, rid)
        if not stored.response.get("background"):
            raise APIError(400, "only background responses can be cancelled", param="id", code="invalid_value")
        if await runs.stop(rid):
            return JSONResponse((await load(owner, rid)).response)
        if stored.status == "cancelled":
            return JSONResponse(stored.response)
        if stored.status in ("queued", "in_progress"):  # its run is gone (a restart): it will never end
            stored.response = dict(stored.response, status="cancelled", completed_at=time.time())
            stored.status = "cancelled"
            try:
                await gw.responses.put(stored)
            except StoreError as e:
                raise store_unavailable(e) from e
            return JSONResponse(stored.response)
        raise Conflict(f"the response {rid!r} is already {stored.status}; only a queued or in-progress response "
                       "can be cancelled", param="id", code="invalid_state")

    async def input_items(request: Request) -> Response:
        caller = guard_.authenticate(config, request)
        q = request.query_params
        for name in q:
            if name not in ("order", "limit", "after", "include"):
                raise APIError(400, f"unrecognized query parameter: {name}", param=name, code="unknown_parameter")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order: must be 'asc' or 'desc', got {order!r}", param="order", code="invalid_value")
        try:
            limit = int(q.get("limit", DEFAULT_LIST_LIMIT))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise APIError(400, f"limit: must be an integer from 1 to {MAX_LIST_LIMIT}, got {q.get('limit')!r}",
                           param="limit", code="invalid_value")
        items = list((await load(key_name(caller), request.path_params["id"])).input_items)
        if order == "desc":
            items.reverse()
        after = q.get("after")
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in this response", param="after",
                               code="invalid_value")
            items = items[ids.index(after) + 1:]
        out = wire.list_object(items[:limit])
        out["has_more"] = len(items) > limit
        return JSONResponse(out)

    return [Route(PATH, create, methods=["POST"]),
            Route(PATH + "/{id}", one, methods=["GET", "DELETE"]),
            Route(PATH + "/{id}/input_items", input_items, methods=["GET"]),
            Route(PATH + "/{id}/cancel", cancel, methods=["POST"])]
