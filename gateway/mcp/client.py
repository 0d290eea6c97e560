"""MCP servers as tool providers: each configured server's tools become Interlace tools.

Most tools agent developers already have are Model Context Protocol servers.
The gateway connects to each server in ``mcp_servers`` (a program it starts
and speaks to over stdio, or a streamable HTTP endpoint) with the official
SDK (``mcp``), lists its tools and registers each as ``SERVER.TOOL``: a
:class:`McpTool`, an :class:`~interlace.gateway.tools.base.AsyncTool` whose call
is one ``tools/call`` request.  From there an MCP tool is a tool like any
other: listed in ``/v1/plugins`` and ``interlace plugins``, usable as a
server-side tool in the agent loop, its arguments checked against the
server's JSON Schema field by field while the model writes them (early
abort), its durations learned by the interception policy, its use granted by
the same ``server_tools`` permissions and ``before_tool_execution`` hooks.

Each server is registered with the plugin host as a plugin of its own,
``mcp.SERVER``, whose ``register_tools`` hook registers the tools listed.

Failure model (what :class:`McpServer` guarantees):

* a server that does not start, or does not answer ``initialize`` and
  ``tools/list`` within ``startup_timeout_s``, gets one clear log line and is
  retried with exponential back-off (0.5 s doubling to 30 s; back to 0.5 s
  once a connection has lived a minute);
* a server that dies, or stops answering a liveness probe (every 10 s idle), is restarted
  the same way; meanwhile its tools stay registered but are *unavailable*: a
  call gets an immediate error result saying so, never a hung request;
* a call in flight when its server dies ends at once with a
  :class:`~interlace.gateway.tools.base.ToolCrashed` result; one that runs past
  ``timeout_s`` with :class:`~interlace.gateway.tools.base.ToolTimeout` (the
  runtime's wall-time limit); an error the tool reports (``isError``) is an
  error result with the server's text;
* when a restarted server lists different tools, the host and the runtime
  get the new list (:attr:`McpHub.on_change`).

Threat model: a stdio server is a program the operator's configuration
names; it runs as the gateway's user with the SDK's minimal environment
(``HOME``, ``PATH``, ``USER``, ...) plus the ``env`` the configuration gives
it, never the gateway's own variables (API keys).  Clients never choose a
server, a command or a URL, only tools by name, under their key's permissions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ... import hookspecs
from ..config import McpServerSpec
from ..tools.base import AsyncTool, Granularity, ToolCrashed, ToolError, ToolUnavailable

__all__ = ["McpHub", "McpServer", "McpTool", "result_content"]

log = logging.getLogger(__name__)

#: Back-off between attempts to (re)start a server: first, factor, ceiling, and how
#: long a connection must live before the next failure starts again from the first.
BACKOFF_FIRST_S = 0.5
BACKOFF_FACTOR = 2.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_AFTER_S = 60.0
#: An idle connection is probed (ping or server/discover) this often; no answer in PROBE_TIMEOUT_S marks it dead.
PROBE_INTERVAL_S = 10.0
PROBE_TIMEOUT_S = 10.0
#: Pages of ``tools/list`` read at most (a server that pages forever cannot hang start-up).
MAX_LIST_PAGES = 100


class McpTool(AsyncTool):
    """One tool of an MCP server, served as ``SERVER.TOOL``."""

    granularity = Granularity.ON_FINISH  # one tools/call with the complete arguments
    validate_early = True

    def __init__(self, server: McpServer, remote: Any) -> None:
        self.server = server
        self.remote_name: str = remote.name
        self.name = f"{server.name}.{remote.name}"
        self.description = remote.description or remote.title or ""
        schema = dict(remote.input_schema or {})
        self.parameters = schema if schema else {"type": "object", "properties": {}}
        self.timeout_s = server.spec.timeout_s

    async def call(self, arguments: dict[str, Any], request: Any) -> Any:
        return await self.server.call(self.remote_name, arguments)

    def unavailable(self) -> str | None:
        return self.server.unavailable()

    def info(self) -> dict[str, Any]:
        return {"mcp_server": self.server.name, "mcp_tool": self.remote_name,
                "available": self.server.state == "ready"}

    def signature(self) -> tuple[str, str, str]:
        """What a re-listing compares: a tool whose signature changed is replaced."""
        import json

        return self.name, self.description, json.dumps(self.parameters, sort_keys=True)


class _ServerPlugin:
    """The plugin the host registers for one server (``mcp.SERVER``): its tools through the usual hook."""

    def __init__(self, server: McpServer) -> None:
        self.__name__ = f"mcp.{server.name}"
        self._server = server

    @hookspecs.hookimpl
    def register_tools(self, register: Callable[[Any], None]) -> None:
        for tool in self._server.tools.values():
            register(tool)

    def plugin_status(self) -> dict[str, Any]:
        """Shown in ``/v1/plugins`` and ``interlace plugins``: the server, its state, its last error
        (never its command line, URL or headers: those may hold secrets)."""
        return {"mcp_server": self._server.name, **self._server.status()}


class McpServer:
    """One configured MCP server: its connection, its tools, its restarts.

    A supervisor task owns the connection (the SDK's ``Client``, entered and
    left in that one task, as anyio requires); calls from request handlers use
    the client while it is ``ready``.  States: ``starting`` (the first
    attempt), ``ready``, ``unavailable`` (waiting to restart), ``closed``.
    """

    def __init__(self, spec: McpServerSpec, hub: McpHub) -> None:
        self.spec = spec
        self.name = spec.name
        self.hub = hub
        self.state = "starting"
        self.tools: dict[str, McpTool] = {}
        self.last_error: str | None = None
        self.restarts = 0
        self.in_flight = 0  # calls sent and not answered yet
        self.next_attempt_at: float | None = None  # time.time() of the next attempt while unavailable
        self.first_attempt = asyncio.Event()
        self._client: Any = None
        self._dead = asyncio.Event()  # set when the current connection is gone (or on close)
        self._closing = False
        self._closed = asyncio.Event()  # wakes the supervisor from its back-off sleep
        self._task: asyncio.Task[None] | None = None

    # -- what the tools ask -------------------------------------------------------------

    def describe(self) -> str:
        return f"stdio: {' '.join([self.spec.command or '', *self.spec.args])}" if self.spec.command \
            else f"streamable HTTP: {self.spec.url}"

    def unavailable(self) -> str | None:
        if self.state == "ready":
            return None
        if self.state == "closed":
            return f"MCP server {self.name!r} is shut down"
        why = f" ({self.last_error})" if self.last_error else ""
        when = ""
        if self.next_attempt_at is not None:
            when = f"; restarting in {max(0.0, self.next_attempt_at - time.time()):.1f}s"
        return f"MCP server {self.name!r} is unavailable{why}{when}"

    def status(self) -> dict[str, Any]:
        return {"transport": self.spec.transport, "state": self.state, "last_error": self.last_error,
                "restarts": self.restarts, "calls_in_flight": self.in_flight}

    async def call(self, remote: str, arguments: dict[str, Any]) -> Any:
        """One ``tools/call``; raises :class:`ToolError` (a subclass) for every failure.

        The call races the connection: when the server dies mid-call the
        result is an error at once, whether or not the SDK notices."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        client, dead = self._client, self._dead
        if self.state != "ready" or client is None or dead.is_set():
            raise ToolUnavailable(self.unavailable() or f"MCP server {self.name!r} is unavailable")
        call = asyncio.ensure_future(client.call_tool(remote, arguments))
        gone = asyncio.ensure_future(dead.wait())
        self.in_flight += 1
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the runtime cancels us (wall time, client gone): the SDK cancels it on the server
            self.in_flight -= 1
            gone.cancel()
            if not call.done():
                call.cancel()
        if not call.done() or call.cancelled():
            raise ToolCrashed(f"MCP server {self.name!r} went away during the call ({self.last_error})")
        try:
            result = call.result()
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                self._lost("the connection closed during a call")
                raise ToolCrashed(f"MCP server {self.name!r} closed the connection during the call") from None
            raise ToolError(f"MCP server {self.name!r}: {exc.message}", error_type="McpError") from None
        except Exception as exc:  # the transport broke (a pipe, an HTTP connection)
            self._lost(_describe(exc))
            raise ToolCrashed(f"MCP server {self.name!r} failed during the call: {_describe(exc)}") from None
        if result.is_error:
            raise ToolError(result_content(result, prefer_text=True) or "the tool reported an error",
                            error_type="McpToolError")
        return result_content(result)

    # -- the connection -----------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name=f"mcp-{self.name}")

    async def close(self) -> None:
        self._closing = True
        self._closed.set()
        self._dead.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            except asyncio.TimeoutError:
                log.error("MCP server %r did not shut down in 10 s; cancelling", self.name)
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
        self.state = "closed"

    def _lost(self, why: str) -> None:
        """The connection is gone (seen by a call or a ping): the supervisor restarts it."""
        if not self._dead.is_set() and not self._closing:
            self.last_error = why
            self.state = "unavailable"  # at once: calls fail fast while the supervisor restarts it
            self._dead.set()

    def _client_context(self, stack: contextlib.ExitStack) -> Any:
        """The SDK client for this server (not entered yet); what it needs closed afterwards goes on ``stack``."""
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        spec = self.spec
        if spec.command:
            params = StdioServerParameters(command=spec.command, args=list(spec.args), env=dict(spec.env),
                                           cwd=spec.cwd)
            return Client(stdio_client(params, errlog=stack.enter_context(_StderrToLog(self.name))), cache=None)
        from mcp.client.streamable_http import streamable_http_client

        import httpx2

        http = httpx2.AsyncClient(headers=dict(spec.headers), timeout=httpx2.Timeout(30.0, read=300.0))
        return _HttpClient(Client(streamable_http_client(spec.url, http_client=http), cache=None), http)

    async def _connection(self, ready: asyncio.Future[tuple[Any, list[Any]]], dead: asyncio.Event) -> None:
        """Connect, list the tools, hand both over through ``ready``, hold the connection until ``dead``."""
        with contextlib.ExitStack() as stack:
            async with self._client_context(stack) as client:
                await self._hold(client, ready, dead)

    @staticmethod
    async def _hold(client: Any, ready: asyncio.Future[tuple[Any, list[Any]]], dead: asyncio.Event) -> None:
        listed: list[Any] = []
        cursor = None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        ready.set_result((client, listed))
        await dead.wait()

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        delay = BACKOFF_FIRST_S
        while not self._closing:
            self._dead = dead = asyncio.Event()
            ready: asyncio.Future[tuple[Any, list[Any]]] = loop.create_future()
            conn = loop.create_task(self._connection(ready, dead), name=f"mcp-{self.name}-connection")
            up_since = None
            closing = asyncio.ensure_future(self._closed.wait())
            try:
                await asyncio.wait({ready, conn, closing}, timeout=self.spec.startup_timeout_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                closing.cancel()
                if self._closing:
                    pass
                elif ready.done():
                    client, listed = ready.result()
                    self._client = client
                    self._set_tools(listed)
                    self.state, self.last_error, self.next_attempt_at = "ready", None, None
                    up_since = loop.time()
                    log.info("MCP server %r (%s): ready, %d tool(s): %s", self.name, self.describe(),
                             len(self.tools), ", ".join(self.tools) or "none")
                    self.first_attempt.set()
                    await self._watch(client, dead, conn)
                elif conn.done():
                    exc = conn.exception()
                    self.last_error = self._start_error(exc) if exc else "it closed the connection"
                else:
                    self.last_error = (f"no answer to initialize and tools/list within "
                                       f"{self.spec.startup_timeout_s:g}s")
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the supervision
                log.exception("MCP server %r: supervisor error", self.name)
                self.last_error = _describe(exc)
            finally:
                self._client = None
                dead.set()
                await _finish(conn, grace_s=10.0 if ready.done() else 0.0)
            if self._closing:
                break
            if conn.done() and not conn.cancelled() and conn.exception() is not None and self.last_error is None:
                self.last_error = _describe(conn.exception())
            if up_since is not None and loop.time() - up_since >= BACKOFF_RESET_AFTER_S:
                delay = BACKOFF_FIRST_S
            self.state = "unavailable"
            self.next_attempt_at = time.time() + delay
            verb = "stopped" if up_since is not None else "did not start"
            log.error("MCP server %r (%s) %s: %s; restarting in %.1fs (its tools are unavailable meanwhile)",
                      self.name, self.describe(), verb, self.last_error, delay)
            self.first_attempt.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closed.wait(), delay)
            delay = min(delay * BACKOFF_FACTOR, BACKOFF_MAX_S)
            self.restarts += 1

    def _start_error(self, exc: BaseException) -> str:
        while getattr(exc, "exceptions", None):
            exc = exc.exceptions[0]
        if isinstance(exc, OSError) and self.spec.command and not isinstance(exc, ConnectionError):
            return f"cannot start {self.spec.command!r}: {exc.strerror or exc}"
        return _describe(exc)

    async def _watch(self, client: Any, dead: asyncio.Event, conn: asyncio.Task[None]) -> None:
        """Until the connection is gone: probe it every PROBE_INTERVAL_S, notice its task ending."""
        while not dead.is_set():
            ended = asyncio.ensure_future(dead.wait())
            done, _ = await asyncio.wait({ended, conn}, timeout=PROBE_INTERVAL_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            ended.cancel()
            if conn in done:
                self._lost(_describe(conn.exception()) if not conn.cancelled() and conn.exception()
                           else "the connection ended")
                return
            if dead.is_set():
                return
            try:
                await asyncio.wait_for(_probe(client), PROBE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure to answer the probe
                self._lost(f"no answer to a liveness probe ({_describe(exc)})")

    def _set_tools(self, listed: Iterable[Any]) -> None:
        """The tools of a new connection; tell the hub when they differ from the last ones."""
        tools: dict[str, McpTool] = {}
        for remote in listed:
            try:
                tool = McpTool(self, remote)
                tool.check()
            except Exception as exc:  # noqa: BLE001 - one bad tool must not hide the others
                log.warning("MCP server %r: tool %r skipped: %s", self.name, getattr(remote, "name", "?"), exc)
                continue
            tools[tool.name] = tool
        before = {t.signature() for t in self.tools.values()}
        if before == {t.signature() for t in tools.values()}:
            return  # the same tools: keep the instances the host and runtime hold
        old = list(self.tools)
        self.tools = tools
        if self.hub.on_change is not None:
            try:
                self.hub.on_change(self, list(tools.values()), old)
            except Exception:  # noqa: BLE001 - the old tools stay served
                log.exception("MCP server %r: its new tool list could not be registered", self.name)


class _StderrToLog:
    """A stdio server's stderr, into the gateway's log line by line (``mcp.SERVER: ...``).

    The SDK hands the server a file to write its stderr to; a pipe read in the
    event loop keeps its output with the gateway's (and works where
    ``sys.stderr`` is not a real file)."""

    MAX_LINE = 2000

    def __init__(self, server: str) -> None:
        self.log = logging.getLogger(f"{__name__}.{server}")
        self._buffer = b""

    def __enter__(self) -> Any:
        import os

        self._read, write = os.pipe()
        os.set_blocking(self._read, False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._read, self._drain)
        self._write = os.fdopen(write, "w", encoding="utf-8", errors="replace")
        return self._write

    def _drain(self) -> None:
        import os

        try:
            data = os.read(self._read, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._loop.remove_reader(self._read)
            return
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            self._emit(line)
        if len(self._buffer) > self.MAX_LINE:
            self._emit(self._buffer)
            self._buffer = b""

    def _emit(self, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip()
        if text:
            self.log.info("%s", text[: self.MAX_LINE])

    def __exit__(self, *exc: Any) -> None:
        import os

        self._write.close()
        self._drain()
        self._loop.remove_reader(self._read)
        if self._buffer:
            self._emit(self._buffer)
        os.close(self._read)


class _HttpClient:
    """An SDK client over streamable HTTP together with the HTTP client it owns (closed after it)."""

    def __init__(self, client: Any, http: Any) -> None:
        self._client, self._http = client, http

    async def __aenter__(self) -> Any:
        await self._http.__aenter__()
        try:
            return await self._client.__aenter__()
        except BaseException:
            await self._http.__aexit__(None, None, None)
            raise

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self._client.__aexit__(*exc)
        finally:
            await self._http.__aexit__(None, None, None)


class McpHub:
    """Every configured MCP server, started together; one plugin per server for the host."""

    def __init__(self, specs: Mapping[str, McpServerSpec]) -> None:
        self.specs = dict(specs)
        self.servers: dict[str, McpServer] = {}
        #: ``on_change(server, tools, removed_names)``: a restarted server lists other tools.
        self.on_change: Callable[[McpServer, list[McpTool], list[str]], None] | None = None

    async def start(self) -> None:
        """Start every server and wait for each one's first attempt (bounded by its
        ``startup_timeout_s``).  A server that fails is not an error here: it is
        logged and retried in the background."""
        for name, spec in self.specs.items():
            self.servers[name] = server = McpServer(spec, self)
            server.start()
        await asyncio.gather(*(s.first_attempt.wait() for s in self.servers.values()))

    def plugins(self) -> list[Any]:
        return [_ServerPlugin(s) for s in self.servers.values()]

    def tools(self) -> dict[str, McpTool]:
        return {name: tool for s in self.servers.values() for name, tool in s.tools.items()}

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.servers.values()))

    async def __aenter__(self) -> McpHub:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def result_content(result: Any, *, prefer_text: bool = True) -> Any:
    """What a ``CallToolResult`` says, for the model: its text blocks joined by
    newlines (other blocks named in brackets), else its structured content."""
    parts: list[str] = []
    for block in result.content or ():
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif kind == "resource_link":
            parts.append(f"[resource: {block.uri}]")
        elif kind == "resource":
            res = block.resource
            parts.append(res.text if getattr(res, "text", None) is not None else f"[resource: {res.uri}]")
        else:
            parts.append(f"[{kind} content]")
    if parts and prefer_text:
        return "\n".join(parts)
    if result.structured_content is not None:
        return result.structured_content
    return "\n".join(parts)


async def _probe(client: Any) -> None:
    """One request that any live server answers: ``ping`` on a connection of the
    handshake era, ``server/discover`` on one of the 2026-07-28 era (which removed ping)."""
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    version = client.protocol_version
    if version in MODERN_PROTOCOL_VERSIONS:
        await client.session.send_discover(version)
    else:
        await client.session.send_ping()


def _describe(exc: BaseException | None) -> str:
    """One line for a failure, looking inside anyio's exception groups for the cause."""
    if exc is None:
        return "unknown error"
    while getattr(exc, "exceptions", None):  # an (anyio) exception group: its first cause
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, ToolError) else f"{type(exc).__name__}: {text}"


async def _finish(task: asyncio.Task[Any], grace_s: float) -> None:
    """Let a connection task end (``dead`` told it to); cancel it after ``grace_s``
    (at once for one still connecting: it is not listening to ``dead``)."""
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved: reported through last_error
        return
    try:
        await asyncio.wait_for(asyncio.shield(task), grace_s)
    except asyncio.TimeoutError:
        task.cancel()
    except BaseException:  # noqa: BLE001 - its failure is reported through last_error
        pass
    if not task.done():
        with contextlib.suppress(BaseException):
            await task

