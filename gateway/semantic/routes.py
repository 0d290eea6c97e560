"""The HTTP routes of sessions, Semantic Variables and semantic calls
(contract: docs/semantic-variables.md; schema: ``GET /openapi.json``).

    POST   /v1/sessions                              create (API key when configured) -> id, token; with
                                                     "calls": [...] a first batch, in the same request
    GET    /v1/sessions/{sid}                        state and usage (tokens forked, filled, ...)
    DELETE /v1/sessions/{sid}                        free everything it holds
    POST   /v1/sessions/{sid}/variables              create (declared, or with a value)
    PUT    /v1/sessions/{sid}/variables/{vid}        set a declared variable's value
    GET    /v1/sessions/{sid}/variables/{vid}        wait for the value (criterion, stream, timeout_s)
    POST   /v1/sessions/{sid}/calls                  submit a semantic call (LLM template or tool node),
                                                     or {"calls": [...]}: a batch, all or nothing
    GET    /v1/sessions/{sid}/calls/{cid}            a call's state, error and deduced objective

Every route but the first authenticates with the session's token; those
are mounted under ``/v1/sessions`` (a Starlette ``Mount``).  Errors are raised,
never answered here: the handlers registered once in ``create_app``
(gateway/errors.py) shape them.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, List

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route

from ...engine_ext.policies.objectives import OBJECTIVES
from .. import http_guard as guard_
from ..errors import APIError, LimitReached
from ..http_guard import until_disconnected
from ..openai.wire import parse_json, sse
from .dag import Variable
from .sessions import Session


def _error_body(var: Variable) -> dict:
    err = var.error or {}
    code = "session_closed" if err.get("code") == "session_closed" else "producer_failed"
    return {"error": {"message": err.get("message"), "type": "failed_dependency", "param": None, "code": code,
                      "call": err.get("call"), "producer_code": err.get("code")}}


def _call_json(call: Any) -> dict:
    return {"id": call.id, "outputs": {k: o.var.id for k, o in call.outputs.items()}, "state": call.state}


def _timed_out(var: Variable, timeout: Any) -> APIError:
    return APIError(408, f"variable {var.id} has no value after {timeout} s; ask again", code="timeout")


def _by_method(path: str, **endpoints: Callable[[Request], Awaitable[Response]]) -> Route:
    """One route serving each method of ``path`` with its endpoint (HEAD as GET).  Starlette answers
    another method (OPTIONS too) with 405 and the ``Allow`` of the first route matching the path, so
    routes split by method advertised only their own (``OPTIONS /v1/sessions/x`` allowed no DELETE)."""
    async def endpoint(request: Request) -> Response:
        return await endpoints["GET" if request.method == "HEAD" else request.method](request)
    return Route(path, endpoint, methods=list(endpoints))


def _check_batch(s: Session, calls: Any) -> None:
    """A batch of more calls than the session may have pending is refused before any call is read:
    50,000 calls were read one by one (4.5 s of the event loop) before their 429."""
    limit = s.graph.limits.max_pending_calls
    if isinstance(calls, list) and len(calls) > limit:
        raise LimitReached(f"a batch of {len(calls)} calls is over the session's limit of {limit} calls pending "
                           "or running", param="calls", code="session_limit")


def build_routes(gw: Any, config: Any) -> List[BaseRoute]:
    """The routes, bound to the gateway ``gw`` (its ``sessions`` store is made at start-up)."""

    def in_session(fn: Callable[[Request, Session], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """The route with its session: the token checked, the session held in use while it runs."""
        async def route(request: Request) -> Response:
            s = gw.sessions.authorize(request, request.path_params["sid"])
            with s.in_use():
                return await fn(request, s)
        return route

    async def body_of(request: Request, optional: bool = False) -> Any:
        raw = await guard_.read_body(request, config.max_request_bytes)
        if optional and not raw.strip():
            return {}
        guard_.require_json(request)
        body = await anyio.to_thread.run_sync(parse_json, raw)  # grows with the body: off the event loop
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        return body

    async def create_session(request: Request) -> Response:
        caller = guard_.authenticate(config, request)
        body = await body_of(request, optional=True)
        unknown = sorted(set(body) - {"ttl_s", "calls"})
        if unknown:
            raise APIError(400, f"unknown key(s) {unknown}; a session takes only ttl_s and calls", param=unknown[0])
        s = gw.sessions.create(caller, body.get("ttl_s"))
        out = {"id": s.id, "token": s.token, "ttl_s": s.ttl_s, "expires_at": round(s.expires_at, 3),
               "limits": s.graph.limits.as_dict()}
        if "calls" in body:  # a whole DAG with the session, in one round trip; nothing kept if it is refused
            try:
                _check_batch(s, body["calls"])
                out["calls"] = [_call_json(c) for c in s.graph.submit_many(body["calls"])]
            except Exception:
                await gw.sessions.delete(s)
                raise
        return JSONResponse(out, status_code=201)

    async def session_info(request: Request, s: Session) -> Response:
        return JSONResponse(s.describe())

    async def delete_session(request: Request, s: Session) -> Response:
        await gw.sessions.delete(s)
        return JSONResponse({"id": s.id, "deleted": True})

    async def create_variable(request: Request, s: Session) -> Response:
        body = await body_of(request, optional=True)
        unknown = sorted(set(body) - {"name", "value"})
        if unknown:
            raise APIError(400, f"unknown key(s) {unknown}; a variable takes name and value", param=unknown[0])
        var = s.graph.create_variable(body.get("name"), body.get("value"))
        return JSONResponse(var.describe(), status_code=201)

    async def set_variable(request: Request, s: Session) -> Response:
        body = await body_of(request)
        if set(body) != {"value"}:
            raise APIError(400, "the body must be {\"value\": text}", param="value")
        var = s.graph.set_variable(request.path_params["vid"], body["value"])
        return JSONResponse(var.describe())

    async def get_variable(request: Request, s: Session) -> Response:
        var = s.graph.variable(request.path_params["vid"])
        q = request.query_params
        unknown = sorted(set(q) - {"criterion", "stream", "timeout_s"})
        if unknown:
            raise APIError(400, f"unknown query parameter(s) {unknown}", param=unknown[0])
        criterion = q.get("criterion")
        if criterion is not None and criterion not in OBJECTIVES:
            raise APIError(400, f"criterion must be one of {list(OBJECTIVES)}", param="criterion")
        stream = q.get("stream", "false").lower()
        if stream not in ("true", "false", "1", "0"):
            raise APIError(400, "stream must be true or false", param="stream")
        timeout = None
        if "timeout_s" in q:
            try:
                timeout = float(q["timeout_s"])
            except ValueError:
                timeout = -1.0
            if not 0 <= timeout <= 86400:  # 0: answer at once (408 if no value yet)
                raise APIError(400, "timeout_s must be a number of seconds in [0, 86400]", param="timeout_s")
        s.graph.note_criterion(var, criterion)
        if stream in ("true", "1"):
            return StreamingResponse(_stream(s, var, timeout), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async def wait() -> None:
            try:
                if timeout == 0 and not var.done:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(var.wait(), timeout)
            except asyncio.TimeoutError:
                raise _timed_out(var, timeout) from None

        await until_disconnected(request, wait())
        if var.error is not None:
            status = 404 if var.error.get("code") == "session_closed" else 424
            return JSONResponse(_error_body(var), status_code=status)
        return JSONResponse({"id": var.id, "name": var.name, "value": var.value})

    async def _stream(s: Session, var: Variable, timeout: Any) -> AsyncIterator[bytes]:
        with s.in_use():
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            it = var.deltas().__aiter__()
            while True:
                try:
                    left = None if deadline is None else max(0.0, deadline - loop.time())
                    delta = await asyncio.wait_for(it.__anext__(), left)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    yield sse(_timed_out(var, timeout).body())
                    yield b"data: [DONE]\n\n"
                    return
                yield sse({"delta": delta})
            yield sse(_error_body(var) if var.error is not None else {"value": var.value})
            yield b"data: [DONE]\n\n"

    async def submit_call(request: Request, s: Session) -> Response:
        body = await body_of(request)
        if isinstance(body, dict) and "calls" in body:  # a batch: the whole DAG in one request
            if set(body) != {"calls"}:
                raise APIError(400, "a batch body has only 'calls'", param="calls")
            _check_batch(s, body["calls"])
            calls = s.graph.submit_many(body["calls"])
            return JSONResponse({"calls": [_call_json(c) for c in calls]}, status_code=201)
        return JSONResponse(_call_json(s.graph.submit(body)), status_code=201)

    async def call_info(request: Request, s: Session) -> Response:
        cid = request.path_params["cid"]
        call = s.graph.calls.get(cid)
        if call is None:
            raise APIError(404, f"no call {cid!r} in this session", param="call", code="call_not_found")
        return JSONResponse(call.describe())

    async def to_bare(request: Request) -> Response:
        # /v1/sessions/ is inside the mount, which would answer 404: redirect it to /v1/sessions, as
        # Starlette's redirect_slashes does for every other route
        return RedirectResponse(request.url.replace(path=request.url.path.rstrip("/")), status_code=307)

    # POST /v1/sessions stays beside the mount: a Mount matches only the paths below it
    return [
        Route("/v1/sessions", create_session, methods=["POST"]),
        Mount("/v1/sessions", routes=[
            Route("/", to_bare, methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False),
            _by_method("/{sid}", GET=in_session(session_info), DELETE=in_session(delete_session)),
            Route("/{sid}/variables", in_session(create_variable), methods=["POST"]),
            _by_method("/{sid}/variables/{vid}", PUT=in_session(set_variable), GET=in_session(get_variable)),
            Route("/{sid}/calls", in_session(submit_call), methods=["POST"]),
            Route("/{sid}/calls/{cid}", in_session(call_info), methods=["GET"]),
        ]),
    ]
