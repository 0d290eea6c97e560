"""Clients, sessions, variables and calls: the HTTP API of docs/semantic-variables.md
as Python objects, over httpx, in a sync and an asyncio flavour.

The objects mirror the server's: a :class:`Session` holds
:class:`SemanticVariable` s and :class:`Call` s; a call's outputs are
variables that the server fills while the client does something else, and
the client only waits where it reads a value (``get``/``stream``).  This is
what lets a chain of calls run on the server without a round trip between
them (Parrot's point): the SDK never waits on a submit.

Requests are built once in :mod:`._wire` and only *sent* here, so the sync
and the async classes cannot drift apart in what they ask.
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar, Token
from typing import Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import httpx

from . import _wire as wire
from .errors import APIConnectionError, APITimeoutError, GetTimeoutError, InterlaceError, NotFoundError, error_from_body
from .spec import CRITERIA, Output, convert_arguments, to_server_template

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
#: Seconds for connecting and for an ordinary answer (not for a variable's wait, see POLL_S).
DEFAULT_TIMEOUT = 60.0
#: The longest single blocking ``get``: a longer wait asks again (the contract's 408 says
#: "ask again"), so no HTTP request has to stay open longer than this plus the timeout.
POLL_S = 30.0

AnySession = Union["Session", "AsyncSession"]
#: What an input may be bound to: a variable (its value flows on the server) or a constant.
InputValue = Union["SemanticVariable", str]
#: An output's settings: an :class:`Output`, a declared variable to fill, the raw JSON, or None.
OutputValue = Union[Output, "SemanticVariable", Mapping[str, Any], None]

_current: ContextVar[Optional[AnySession]] = ContextVar("interlace_session", default=None)


def current_session() -> Optional[AnySession]:
    """The innermost session entered with ``with``/``async with`` in this context (thread,
    task), where a semantic function called without ``session=`` submits."""
    return _current.get()


@contextlib.contextmanager
def _transport_errors() -> Iterator[None]:
    """httpx's transport failures as the SDK's own errors, so callers catch one family."""
    try:
        yield
    except httpx.TimeoutException as e:
        raise APITimeoutError(f"the request to the Interlace server timed out ({type(e).__name__}: {e})") from e
    except httpx.TransportError as e:
        raise APIConnectionError(f"cannot talk to the Interlace server ({type(e).__name__}: {e})") from e


class _ClientBase:
    def __init__(self, base_url: str, api_key: Optional[str], model: Optional[str], timeout: Optional[float]):
        self.base_url = base_url
        self.api_key = api_key
        self.model = model
        self.timeout = timeout

    def _timeout(self, req: wire.Request) -> Any:
        """A blocking get may take ``wait_s`` longer than an ordinary answer before it is late."""
        if not req.wait_s or self.timeout is None:
            return httpx.USE_CLIENT_DEFAULT
        return httpx.Timeout(self.timeout, read=self.timeout + req.wait_s)

    #: A blocking get holds its connection while it waits, so a pool bound would make the
    #: 101st concurrent ``aget`` wait for a connection instead of for its value.
    LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=32)

    def _stream_timeout(self) -> httpx.Timeout:
        # A producer may wait on its inputs for as long as they take: no read timeout between events.
        return httpx.Timeout(self.timeout, read=None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, model={self.model!r})"


class Client(_ClientBase):
    """A blocking client.  ``with Client(...) as client:`` closes its connections at the end.

    ``api_key`` is needed to create sessions when the server has
    ``server.api_keys``; ``model`` is the default model of every call that
    does not name one; ``timeout`` bounds connecting and each ordinary answer
    (a variable's wait has its own ``timeout``).  ``transport`` replaces
    httpx's (tests pass an ``httpx.MockTransport``)."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: Optional[str] = None, model: Optional[str] = None,
                 timeout: Optional[float] = DEFAULT_TIMEOUT, *, transport: Optional[httpx.BaseTransport] = None):
        super().__init__(base_url, api_key, model, timeout)
        self._http = httpx.Client(base_url=base_url, timeout=timeout, limits=self.LIMITS, transport=transport)

    def session(self, ttl_s: Optional[float] = None, calls: Optional[Sequence[Mapping[str, Any]]] = None
                ) -> "Session":
        """Create a session (``POST /v1/sessions``).  Use it as ``with client.session() as s:``
        to make it the current session and free it at the end; ``ttl_s`` is how long it may
        stay idle before the server frees it anyway.  ``calls`` (as for
        :meth:`Session.submit_calls`) are submitted with it, in the same request: ``s.calls``."""
        return Session(self, self._send(wire.create_session(self.api_key, ttl_s, _calls(calls))))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, req: wire.Request) -> Any:
        with _transport_errors():
            r = self._http.request(req.method, req.path, json=req.json, params=req.params or None,
                                   headers=wire.headers(req.token), timeout=self._timeout(req))
        return wire.decode(r)

    def _stream(self, req: wire.Request) -> Iterator[Dict[str, Any]]:
        with _transport_errors():
            with self._http.stream(req.method, req.path, params=req.params or None, headers=wire.headers(req.token),
                                   timeout=self._stream_timeout()) as r:
                if not r.is_success:
                    r.read()
                    wire.decode(r)  # raises the typed error
                yield from wire.sse_events(r.iter_lines())


class AsyncClient(_ClientBase):
    """The asyncio client: as :class:`Client`, with coroutines.
    ``async with AsyncClient(...) as client:`` closes its connections at the end."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: Optional[str] = None, model: Optional[str] = None,
                 timeout: Optional[float] = DEFAULT_TIMEOUT, *, transport: Optional[httpx.AsyncBaseTransport] = None):
        super().__init__(base_url, api_key, model, timeout)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=self.LIMITS,
                                       transport=transport)

    def session(self, ttl_s: Optional[float] = None, calls: Optional[Sequence[Mapping[str, Any]]] = None
                ) -> "_OpeningSession":
        """A session to open: ``async with client.session() as s:`` (current, freed at the end)
        or ``s = await client.session()`` (then ``await s.close()``); ``calls`` as for
        :meth:`Client.session`."""
        return _OpeningSession(self, ttl_s, _calls(calls))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _send(self, req: wire.Request) -> Any:
        with _transport_errors():
            r = await self._http.request(req.method, req.path, json=req.json, params=req.params or None,
                                         headers=wire.headers(req.token), timeout=self._timeout(req))
        return wire.decode(r)

    async def _stream(self, req: wire.Request) -> AsyncIterator[Dict[str, Any]]:
        with _transport_errors():
            async with self._http.stream(req.method, req.path, params=req.params or None,
                                         headers=wire.headers(req.token), timeout=self._stream_timeout()) as r:
                if not r.is_success:
                    await r.aread()
                    wire.decode(r)
                async with contextlib.aclosing(wire.asse_events(r.aiter_lines())) as events:
                    async for event in events:
                        yield event


# ----------------------------------------------------------------- sessions
class _SessionBase:
    """What both sessions hold, and the request bodies they build the same way."""

    client: Any

    def __init__(self, client: Any, body: Mapping[str, Any]):
        self.client = client
        self.id: str = body["id"]
        self.token: str = body["token"]
        self.ttl_s: Optional[float] = body.get("ttl_s")
        self.expires_at: Optional[float] = body.get("expires_at")
        self.limits: Dict[str, Any] = dict(body.get("limits") or {})
        self.closed = False
        #: the calls submitted with the session (``client.session(calls=[...])``), in order
        self.calls: List["Call"] = [self._call(c) for c in body.get("calls") or []]
        self._entered: List[Token] = []

    def _enter(self) -> None:
        self._entered.append(_current.set(self))  # type: ignore[arg-type]

    def _leave(self) -> None:
        _current.reset(self._entered.pop())

    def _variable_request(self, value: Optional[str], name: Optional[str]) -> wire.Request:
        return wire.create_variable(self.id, self.token, None if value is None else _text(value), name)

    def _variable(self, body: Mapping[str, Any], value: Optional[str]) -> "SemanticVariable":
        return SemanticVariable(self, body["id"], body.get("name"), value)

    def _call_body(self, template: Optional[str], inputs: Optional[Mapping[str, InputValue]],
                   outputs: Mapping[str, OutputValue], model: Optional[str], chat: bool,
                   messages: Optional[Sequence[Mapping[str, str]]] = None) -> Dict[str, Any]:
        ins = {name: _input_json(name, value) for name, value in (inputs or {}).items()}
        outs = {name: _output_json(name, spec) for name, spec in outputs.items()}
        body: Dict[str, Any] = {"inputs": ins, "outputs": outs}
        if (template is None) == (messages is None):
            raise TypeError("give either a template or messages")
        if messages is None:
            body.update(template=to_server_template(template, ins, outs), chat=bool(chat))
        else:
            body["messages"] = [{"role": m["role"], "content": m["content"]} for m in messages]
        model = model or self.client.model
        if model is not None:
            body["model"] = model
        return body

    def _tool_body(self, name: str, arguments: Mapping[str, Any], inputs: Optional[Mapping[str, InputValue]],
                   output: OutputValue, output_name: str) -> Dict[str, Any]:
        ins = {n: _input_json(n, value) for n, value in (inputs or {}).items()}
        return {"tool": name, "arguments": convert_arguments(dict(arguments), ins), "inputs": ins,
                "outputs": {output_name: _output_json(output_name, output)}}

    def _call(self, body: Mapping[str, Any]) -> "Call":
        call = Call(self, body["id"], {}, body.get("state"))
        for name, vid in (body.get("outputs") or {}).items():
            call.outputs[name] = SemanticVariable(self, vid, name, producer=call)
        return call

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}{', closed' if self.closed else ''})"


class Session(_SessionBase):
    """A server-side session: its variables and calls live until :meth:`close` (or the
    session's idle ``ttl_s``).  ``with client.session() as s:`` makes it the current
    session of semantic functions and frees it when the block ends, error or not."""

    client: Client

    def variable(self, value: Optional[str] = None, name: Optional[str] = None) -> "SemanticVariable":
        """A new variable: set to ``value``, or declared (a call may produce it, or :meth:`SemanticVariable.set`)."""
        return self._variable(self.client._send(self._variable_request(value, name)), value)

    def submit(self, template: Optional[str] = None, inputs: Optional[Mapping[str, InputValue]] = None,
               outputs: Optional[Mapping[str, OutputValue]] = None, model: Optional[str] = None,
               chat: bool = False, messages: Optional[Sequence[Mapping[str, str]]] = None) -> "Call":
        """Submit an LLM call and return at once; its outputs fill on the server.

        ``template`` may write placeholders as ``{{name}}`` or in the server's
        ``{{input:name}}`` / ``{{output:name}}``; ``inputs`` binds each input
        to a variable or a constant string; ``outputs`` gives each output's
        settings (an :class:`Output`, or a declared variable to fill).
        Instead of a template, ``messages`` is a chat prompt rendered as the
        chat endpoint renders it, ``[{"role", "content"}, ...]`` ending with
        ``{"role": "assistant", "content": "{{output:NAME}}"}``, placeholders
        in the server's syntax (``{{input:name}}``)."""
        body = self._call_body(template, inputs, outputs or {}, model, chat, messages)
        return self._call(self.client._send(wire.submit_call(self.id, self.token, body)))

    def submit_calls(self, calls: Sequence[Mapping[str, Any]]) -> List["Call"]:
        """Submit a whole DAG in one request, all or nothing: ``calls`` are call bodies in
        the server's syntax (docs/semantic-variables.md); an input may be
        ``{"call": i, "output": NAME}``, the output of an earlier call of the list."""
        body = {"calls": _calls(calls)}
        return [self._call(c) for c in self.client._send(wire.submit_call(self.id, self.token, body))["calls"]]

    def tool(self, name: str, arguments: Mapping[str, Any], inputs: Optional[Mapping[str, InputValue]] = None,
             output: OutputValue = None, output_name: str = "result") -> "Call":
        """Submit a tool node: the server runs the registered tool ``name`` once its inputs are
        ready (``{{input}}`` placeholders in string arguments); ``call.output`` gets the result."""
        body = self._tool_body(name, arguments, inputs, output, output_name)
        return self._call(self.client._send(wire.submit_call(self.id, self.token, body)))

    def info(self) -> Dict[str, Any]:
        """State and usage: ``variables``, ``calls`` by state, ``usage`` (prompt, completion,
        filled and forked tokens, bytes)."""
        return self.client._send(wire.session_info(self.id, self.token))

    def delete(self) -> Dict[str, Any]:
        """Free the session now (its running calls are aborted); raises if it is already gone."""
        body = self.client._send(wire.delete_session(self.id, self.token))
        self.closed = True
        return body

    def close(self) -> None:
        """Free the session if it still exists (an expired one is already freed); idempotent."""
        if self.closed:
            return
        try:
            self.delete()
        except NotFoundError:
            self.closed = True

    def __enter__(self) -> "Session":
        self._enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._leave()
        self.close()


class AsyncSession(_SessionBase):
    """:class:`Session` for :class:`AsyncClient`: the same methods, as coroutines."""

    client: AsyncClient

    async def variable(self, value: Optional[str] = None, name: Optional[str] = None) -> "SemanticVariable":
        return self._variable(await self.client._send(self._variable_request(value, name)), value)

    async def submit(self, template: Optional[str] = None, inputs: Optional[Mapping[str, InputValue]] = None,
                     outputs: Optional[Mapping[str, OutputValue]] = None, model: Optional[str] = None,
                     chat: bool = False, messages: Optional[Sequence[Mapping[str, str]]] = None) -> "Call":
        body = self._call_body(template, inputs, outputs or {}, model, chat, messages)
        return self._call(await self.client._send(wire.submit_call(self.id, self.token, body)))

    async def submit_calls(self, calls: Sequence[Mapping[str, Any]]) -> List["Call"]:
        body = {"calls": _calls(calls)}
        return [self._call(c) for c in (await self.client._send(wire.submit_call(self.id, self.token, body)))["calls"]]

    async def tool(self, name: str, arguments: Mapping[str, Any], inputs: Optional[Mapping[str, InputValue]] = None,
                   output: OutputValue = None, output_name: str = "result") -> "Call":
        body = self._tool_body(name, arguments, inputs, output, output_name)
        return self._call(await self.client._send(wire.submit_call(self.id, self.token, body)))

    async def info(self) -> Dict[str, Any]:
        return await self.client._send(wire.session_info(self.id, self.token))

    async def delete(self) -> Dict[str, Any]:
        body = await self.client._send(wire.delete_session(self.id, self.token))
        self.closed = True
        return body

    async def close(self) -> None:
        if self.closed:
            return
        try:
            await self.delete()
        except NotFoundError:
            self.closed = True

    async def __aenter__(self) -> "AsyncSession":
        self._enter()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._leave()
        await self.close()


class _OpeningSession:
    """What ``AsyncClient.session()`` returns: creating a session is I/O, so it happens in
    ``await`` or ``async with``, not in the call."""

    def __init__(self, client: AsyncClient, ttl_s: Optional[float], calls: Optional[List[Dict[str, Any]]] = None):
        self._client, self._ttl_s, self._calls = client, ttl_s, calls
        self._session: Optional[AsyncSession] = None

    async def _open(self) -> AsyncSession:
        return AsyncSession(self._client, await self._client._send(
            wire.create_session(self._client.api_key, self._ttl_s, self._calls)))

    def __await__(self) -> Any:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._open()
        return await self._session.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        assert self._session is not None
        await self._session.__aexit__(*exc)


# ---------------------------------------------------------------- variables
class _Deadline:
    """Splits a variable's wait into polls of at most :data:`POLL_S` seconds."""

    def __init__(self, timeout: Optional[float]):
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be >= 0")
        self.end = None if timeout is None else time.monotonic() + timeout

    def next_wait(self) -> float:
        if self.end is None:
            return POLL_S
        # 0 asks "has it a value yet?" and is answered at once
        return max(0.0, min(POLL_S, self.end - time.monotonic()))

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


class SemanticVariable:
    """A value that lives on the server, set by the client or produced by a call.

    Pass it to calls as an input without reading it: the value then flows on
    the server.  Read it with :meth:`get` / :meth:`stream` (or :meth:`aget`
    / :meth:`astream` for a variable of an :class:`AsyncSession`); once read,
    ``value`` holds it (after a stream: the transformed value, not the
    concatenated deltas).  ``producer`` is the :class:`Call` that writes it, when this
    client submitted that call."""

    def __init__(self, session: AnySession, id: str, name: Optional[str] = None, value: Optional[str] = None,
                 producer: Optional["Call"] = None):
        self.session = session
        self.id = id
        self.name = name
        self.value = value
        self.producer = producer

    def __repr__(self) -> str:
        return f"SemanticVariable(id={self.id!r}, name={self.name!r}, value={self.value!r})"

    def _of(self, cls: type, method: str) -> Any:
        if not isinstance(self.session, cls):
            other = {"get": "aget", "set": "aset", "stream": "astream", "aget": "get", "aset": "set",
                     "astream": "stream"}[method]
            kind = "an async" if isinstance(self.session, AsyncSession) else "a sync"
            raise TypeError(f"{self!r} belongs to {kind} session: use .{other}() instead of .{method}()")
        return self.session

    def _request(self, criterion: Optional[str], wait_s: Optional[float], stream: bool = False) -> wire.Request:
        if criterion is not None and criterion not in CRITERIA:
            raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
        return wire.get_variable(self.session.id, self.session.token, self.id, criterion, wait_s, stream)

    def _event(self, event: Mapping[str, Any]) -> Optional[str]:
        """A stream event: the delta to yield, or None (the value is kept; an error raised)."""
        if "error" in event:
            raise error_from_body(event)
        if "value" in event:
            self.value = event["value"]
            return None
        delta = event.get("delta")
        return delta if isinstance(delta, str) and delta else None

    def _no_value(self) -> InterlaceError:
        return APIConnectionError(f"the stream of {self.id} ended without a value or an error")

    # sync
    def get(self, criterion: Optional[str] = None, timeout: Optional[float] = None) -> str:
        """The value, waiting until it exists.  ``criterion`` (``"latency"`` /
        ``"throughput"``) tells the scheduler what the wait is for; ``timeout``
        seconds elapsed raises :class:`GetTimeoutError` (None: wait as long as it takes).
        A failed producer raises :class:`ProducerFailedError`."""
        session = self._of(Session, "get")
        deadline = _Deadline(timeout)
        while True:
            try:
                body = session.client._send(self._request(criterion, deadline.next_wait()))
            except GetTimeoutError:
                if deadline.passed():
                    raise
                continue
            self.value = body["value"]
            return self.value

    def set(self, value: str) -> None:
        """Give a declared variable its value; calls waiting for it start."""
        session = self._of(Session, "set")
        session.client._send(wire.set_variable(session.id, session.token, self.id, _text(value)))
        self.value = value

    def stream(self, criterion: Optional[str] = None) -> Iterator[str]:
        """The producer's text as it is generated (raw, before the transform); afterwards
        ``value`` is the final, transformed value.  A failure raises as :meth:`get` does."""
        session = self._of(Session, "stream")
        self.value = None
        for event in session.client._stream(self._request(criterion, None, stream=True)):
            delta = self._event(event)
            if delta is not None:
                yield delta
        if self.value is None:
            raise self._no_value()

    # async
    async def aget(self, criterion: Optional[str] = None, timeout: Optional[float] = None) -> str:
        """:meth:`get` for a variable of an :class:`AsyncSession`."""
        session = self._of(AsyncSession, "aget")
        deadline = _Deadline(timeout)
        while True:
            try:
                body = await session.client._send(self._request(criterion, deadline.next_wait()))
            except GetTimeoutError:
                if deadline.passed():
                    raise
                continue
            self.value = body["value"]
            return self.value

    async def aset(self, value: str) -> None:
        session = self._of(AsyncSession, "aset")
        await session.client._send(wire.set_variable(session.id, session.token, self.id, _text(value)))
        self.value = value

    async def astream(self, criterion: Optional[str] = None) -> AsyncIterator[str]:
        session = self._of(AsyncSession, "astream")
        self.value = None
        # aclosing: an error event ends the HTTP stream now, not when the generator is collected.
        async with contextlib.aclosing(session.client._stream(self._request(criterion, None, stream=True))) as events:
            async for event in events:
                delta = self._event(event)
                if delta is not None:
                    yield delta
        if self.value is None:
            raise self._no_value()


class Call:
    """A submitted call: its ``id``, its output variables by name, and its state when submitted."""

    def __init__(self, session: AnySession, id: str, outputs: Dict[str, SemanticVariable], state: Optional[str]):
        self.session = session
        self.id = id
        self.outputs = outputs
        self.state = state

    @property
    def output(self) -> SemanticVariable:
        """The output of a call that has exactly one."""
        if len(self.outputs) != 1:
            raise ValueError(f"call {self.id} has {len(self.outputs)} outputs; pick one from .outputs")
        return next(iter(self.outputs.values()))

    def __getitem__(self, name: str) -> SemanticVariable:
        return self.outputs[name]

    def info(self) -> Dict[str, Any]:
        """The call's state now (``GET .../calls/{id}``): state, error, objective, task group."""
        if not isinstance(self.session, Session):
            raise TypeError("this call belongs to an async session: use await call.ainfo()")
        return self.session.client._send(wire.call_info(self.session.id, self.session.token, self.id))

    async def ainfo(self) -> Dict[str, Any]:
        if not isinstance(self.session, AsyncSession):
            raise TypeError("this call belongs to a sync session: use call.info()")
        return await self.session.client._send(wire.call_info(self.session.id, self.session.token, self.id))

    def __repr__(self) -> str:
        return f"Call(id={self.id!r}, outputs={list(self.outputs)}, state={self.state!r})"


# ------------------------------------------------------------------ helpers
def _calls(calls: Optional[Sequence[Mapping[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    return None if calls is None else [dict(c) for c in calls]


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a variable's value is text (str), got {type(value).__name__}")
    return value


def _input_json(name: str, value: Any) -> Union[str, Dict[str, str]]:
    """An input binding as the server wants it: a variable's id, or ``{"value": constant}``."""
    if isinstance(value, SemanticVariable):
        return value.id
    if isinstance(value, str):
        return {"value": value}
    raise TypeError(f"input {name!r} must be a SemanticVariable or a str, got {type(value).__name__}")


def _output_json(name: str, spec: Any) -> Dict[str, Any]:
    if spec is None:
        return {}
    if isinstance(spec, Output):
        return spec.to_json()
    if isinstance(spec, SemanticVariable):
        return {"variable": spec.id}
    if isinstance(spec, Mapping):
        return dict(spec)
    raise TypeError(f"output {name!r} must be an Output, a declared SemanticVariable, a dict or None, "
                    f"got {type(spec).__name__}")

