"""Interlace's own tools served as a Model Context Protocol server (``interlace mcp serve``).

The tools the gateway runs server-side (the built-ins and every plugin's) are
offered to any MCP client: ``tools/list`` gives each enabled tool's name,
description and JSON Schema, ``tools/call`` runs it in the same contained
worker processes the gateway uses (:class:`~interlace.gateway.tools.runtime.ToolRuntime`),
through the same ``before_tool_execution`` policy plugins.  Built on the
official MCP SDK's low-level :class:`mcp.server.lowlevel.Server`.

Who may call what (docs/security.md, "The HTTP surface"):

* **stdio** is the local user who launched the process: every served tool,
  as for anything else that user runs (:data:`LOCAL_CALLER`).
* **Streamable HTTP** identifies the caller exactly as the gateway does:
  with ``server.api_keys`` configured every request needs
  ``Authorization: Bearer <key>`` (401 otherwise, from
  :func:`~interlace.gateway.http_guard.authenticate`), and the key's
  ``server_tools`` decides which tools it sees and may call; without keys
  everyone gets the server-level ``server.server_tools`` (``false`` by
  default, so the default configuration serves nothing over HTTP and
  :func:`check_http_tools` refuses to start).  A 401 carries
  ``WWW-Authenticate: Bearer realm="interlace"`` (no OAuth: no
  ``resource_metadata``).  Browser origins are refused as the gateway refuses
  them (``server.cors_origins``; the server's own origin under an address or
  ``localhost`` passes, which the MCP conformance suite's DNS-rebinding check
  expects), and the SDK's DNS-rebinding protection (``Host``) stays on for
  loopback hosts.

The caller is decided per HTTP request: :class:`BearerGuard` authenticates
it and puts a :class:`Caller` into the ASGI scope; the SDK hands handlers the
Starlette request (``ServerRequestContext.request``), whose scope is the
same dict, so every ``tools/list`` and ``tools/call`` reads the caller of the
request that carried it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import mcp_types as types
from mcp.server.lowlevel import Server

from ...version import __version__
from ..config import GatewayConfig, ServerTools, may_use_tool
from ..tools.base import Tool

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "MCP_PATH",
    "Caller",
    "LOCAL_CALLER",
    "McpServeError",
    "BearerGuard",
    "build_server",
    "to_call_result",
    "error_result",
    "http_callers",
    "check_http_tools",
    "http_app",
    "load_tools",
    "start_runtime",
    "divert_stdio",
    "serve_stdio",
    "serve_http",
]

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
MCP_PATH = "/mcp"

#: Where :class:`BearerGuard` leaves the request's :class:`Caller` in the ASGI scope.
SCOPE_KEY = "interlace.mcp.caller"


class McpServeError(Exception):
    """A start-up problem the user can fix; its text is one line (the CLI prints it, exit 2)."""


@dataclass(frozen=True)
class Caller:
    """Who is calling: the API key's name (``None``: anonymous or local) and the tools it may use."""

    key: Optional[str]
    tools: ServerTools

    def may_use(self, tool: str) -> bool:
        return may_use_tool(self.tools, tool)

    def describe(self) -> str:
        return f"the API key {self.key!r}" if self.key else "an unauthenticated caller"


#: The stdio caller: the local user who started the server, trusted with every served tool.
LOCAL_CALLER = Caller(key=None, tools=True)
#: What an HTTP request that did not pass :class:`BearerGuard` gets (fail closed).
NOBODY = Caller(key=None, tools=False)


def _local(ctx: Any) -> Caller:
    return LOCAL_CALLER


def _http_caller(ctx: Any) -> Caller:
    """The caller :class:`BearerGuard` found for the HTTP request carrying this message; nobody without one."""
    scope = getattr(getattr(ctx, "request", None), "scope", None)
    caller = scope.get(SCOPE_KEY) if isinstance(scope, Mapping) else None
    return caller if isinstance(caller, Caller) else NOBODY


# =========================================================================== results


def error_result(text: str) -> types.CallToolResult:
    """A failed call as MCP reports it: an ``isError`` result the model can read, not a protocol error."""
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def to_call_result(result: Any) -> types.CallToolResult:
    """A :class:`~interlace.gateway.tools.call.ToolResult` as MCP's ``CallToolResult``.

    Success: the text the model would see (``to_text()``), plus the content as
    ``structuredContent`` when it is a JSON object.  Failure: ``isError`` with
    ``"<error_type>: <error>"`` (e.g. ``InvalidToolArguments: invalid argument 'expression': ...``).
    """
    if not result.ok:
        return error_result(result.to_text())
    structured = result.content if isinstance(result.content, dict) else None
    return types.CallToolResult(content=[types.TextContent(text=result.to_text())],
                                structured_content=structured, is_error=False)


# =========================================================================== the server


def build_server(runtime: Any, *, identify: Callable[[Any], Caller] = _local, name: str = "interlace") -> Server:
    """An MCP low-level :class:`~mcp.server.lowlevel.Server` serving ``runtime``'s enabled tools.

    ``identify(ctx)`` says who sent a message (``ctx`` is the SDK's
    ``ServerRequestContext``); the default trusts every message with every
    tool (stdio).  ``tools/list`` shows a caller only the tools it may use;
    ``tools/call`` of any other name is an ``isError`` result naming it.  Each
    call runs as ``runtime.run(name, arguments, request={"model": None,
    "user": None, "key": <key name or None>, "via": "mcp"})``, so
    ``before_tool_execution`` policies see it as they see the gateway's calls.
    """

    def served() -> dict[str, Tool]:
        return {n: t for n, t in runtime.tools.items() if t.enabled}

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        caller = identify(ctx)
        return types.ListToolsResult(tools=[
            types.Tool(name=t.name, description=t.description or None, input_schema=dict(t.parameters))
            for n, t in served().items() if caller.may_use(n)
        ])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        caller = identify(ctx)
        tool = params.name
        if tool not in served():
            return error_result(f"UnknownTool: unknown tool {tool!r}")
        if not caller.may_use(tool):
            log.info("MCP call of %r refused: %s may not use it", tool, caller.describe())
            allowed = ", ".join(n for n in served() if caller.may_use(n)) or "none"
            return error_result(f"PermissionDenied: {caller.describe()} may not use the tool {tool!r} "
                                f"(allowed: {allowed})")
        request = {"model": None, "user": None, "key": caller.key, "via": "mcp"}
        try:
            result = await runtime.run(tool, dict(params.arguments or {}), request=request)
        except Exception as exc:  # run() reports tool failures as results; this is the runtime itself failing
            log.exception("MCP call of %r failed in the tool runtime", tool)
            return error_result(f"{type(exc).__name__}: {exc}")
        return to_call_result(result)

    return Server(name, version=__version__, on_list_tools=list_tools, on_call_tool=call_tool)


# =========================================================================== tools and runtime


def load_tools(config: GatewayConfig, only: Optional[Sequence[str]] = None, *,
               plugins: Iterable[object] = ()) -> tuple[Any, dict[str, Tool]]:
    """The plugin host (as ``Gateway.start`` builds it) and the enabled tools to serve.

    ``only`` narrows them to the names given; a name that is not an enabled
    tool is a :class:`McpServeError` naming the enabled ones.
    """
    from ..plugin_host import BUILTIN_PLUGINS, PluginHost, PluginLoadError

    try:
        host = PluginHost(config.tools, entrypoints=config.plugin_entrypoints,
                          builtins=(*BUILTIN_PLUGINS, *config.plugin_modules), plugins=plugins)
        every = host.tools(include_disabled=True)
    except PluginLoadError as exc:
        raise McpServeError(f"{config.source}: plugins: {_one_line(str(exc))}") from exc
    except ImportError as exc:
        raise McpServeError(f"{config.source}: plugins: cannot import a plugin module: {_one_line(str(exc))}") from exc
    enabled = {n: t for n, t in every.items() if t.enabled}
    if only is None:
        return host, enabled
    names = ", ".join(enabled) or "none"
    for name in only:
        if name in every and name not in enabled:
            raise McpServeError(f"--tools: the tool {name!r} is not enabled (it needs settings in the "
                                f"configuration's tools.{name}); enabled tools: {names}")
        if name not in enabled:
            raise McpServeError(f"--tools: unknown tool {name!r}; enabled tools: {names}")
    return host, {n: enabled[n] for n in dict.fromkeys(only)}


def _one_line(text: str) -> str:
    """A message on one line: its first and, when longer, its last line (a traceback's exception)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} {lines[-1]}"


async def start_runtime(host: Any, tools: Mapping[str, Tool]) -> Any:
    """A started :class:`~interlace.gateway.tools.runtime.ToolRuntime` for ``tools`` with the host's
    policy; a tool that cannot start is a :class:`McpServeError` (the runtime closed again)."""
    from ..tools.runtime import ToolRuntime

    runtime = ToolRuntime(dict(tools), policy=host.before_tool_execution)
    try:
        await runtime.start()  # closes what it started when it fails
    except Exception as exc:
        raise McpServeError(f"the tools could not start: {_one_line(f'{type(exc).__name__}: {exc}')}") from exc
    return runtime


# =========================================================================== HTTP


def http_callers(config: GatewayConfig) -> list[Caller]:
    """Everyone who can call over HTTP: one caller per API key, or the anonymous one when there are none."""
    from ..http_guard import permissions

    if config.api_keys:
        return [Caller(key.name, permissions(config, key)[0]) for key in config.api_keys]
    return [Caller(None, permissions(config, None)[0])]


def check_http_tools(config: GatewayConfig, tools: Iterable[str]) -> list[str]:
    """The tools somebody may use over HTTP; none is a :class:`McpServeError` (nothing to serve)."""
    names = list(tools)
    callers = http_callers(config)
    usable = [n for n in names if any(c.may_use(n) for c in callers)]
    if not usable:
        who = "API key" if config.api_keys else "caller (server.server_tools)"
        raise McpServeError(
            f"{config.source}: over HTTP no {who} may use any of the tools ({', '.join(names) or 'none'}); "
            f"configure server.api_keys with server_tools, e.g. "
            f"api_keys: [{{key: os.environ/MCP_KEY, name: agent, server_tools: [calculator]}}]")
    return usable


class BearerGuard:
    """ASGI middleware: authenticates every HTTP request as the gateway does (401 JSON with a
    ``WWW-Authenticate`` bearer challenge otherwise)
    and leaves the :class:`Caller` in the scope for the MCP handlers.

    With API keys, the key's name also becomes the SDK's session owner, so a
    Streamable HTTP session opened with one key answers 404 to every other.
    """

    def __init__(self, app: Any, config: GatewayConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        from ..http_guard import authenticate, permissions
        from ..errors import APIError

        try:
            key = authenticate(self.config, Request(scope))
        except APIError as err:
            await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)
            return
        scope[SCOPE_KEY] = Caller(key.name if key else None, permissions(self.config, key)[0])
        if key is not None:
            from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
            from mcp.server.auth.provider import AccessToken

            # token: the name, never the secret (it would be kept per session)
            scope["user"] = AuthenticatedUser(AccessToken(token=key.name, client_id=key.name, scopes=[]))
        await self.app(scope, receive, send)


def http_app(server: Server, config: GatewayConfig, *, host: str = DEFAULT_HOST, path: str = MCP_PATH) -> Any:
    """The ASGI app serving ``server`` over Streamable HTTP at ``path``, guarded as the gateway is:
    browser origins (``server.cors_origins`` and the server's own), then API keys (:class:`BearerGuard`),
    then the SDK's own checks (DNS-rebinding protection for a loopback ``host``, body size
    ``server.max_request_bytes``)."""
    from starlette.middleware.cors import CORSMiddleware

    from ..http_guard import OriginGuard, cors_middleware_args

    app: Any = server.streamable_http_app(streamable_http_path=path, host=host,
                                          max_request_body_size=config.max_request_bytes)
    app = BearerGuard(app, config)
    if config.cors_origins:
        app = CORSMiddleware(app, **{**cors_middleware_args(config), "allow_methods": ["GET", "POST", "DELETE"],
                                     "expose_headers": ["Mcp-Session-Id"]})
    return OriginGuard(app, allowed=config.cors_origins)


def _bind(host: str, port: int) -> socket.socket:
    """The listening address, bound now so that a taken port is one clear error before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise McpServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


async def serve_http(config: GatewayConfig, host: Any, tools: Mapping[str, Tool], *, listen: str = DEFAULT_HOST,
                     port: int = DEFAULT_PORT, path: str = MCP_PATH, log_level: str = "info") -> None:
    """Serve ``tools`` over Streamable HTTP until SIGINT/SIGTERM; the runtime is started first and
    closed last.  Raises :class:`McpServeError` when nobody may use any tool or a tool cannot start."""
    from ..http_guard import startup_warnings
    from ..server import uvicorn_config

    usable = check_http_tools(config, tools)
    unused = [n for n in tools if n not in usable]
    if unused:
        log.info("not served over HTTP (no caller may use them): %s", ", ".join(unused))
    shown = dataclasses.replace(config, host=listen, port=port, replay=False)  # replay is not served here
    for warning in startup_warnings(shown):
        log.warning(warning)
    sock = _bind(listen, port)
    try:
        runtime = await start_runtime(host, {n: tools[n] for n in usable})
        try:
            app = http_app(build_server(runtime, identify=_http_caller), config, host=listen, path=path)
            # the gateway's connection cap and read timeouts (server.connections), JSON protocol errors
            server = _uvicorn_server(uvicorn_config(app, config.connections, log_level=log_level,
                                                    timeout_graceful_shutdown=5))
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, server.handle_exit, sig, None)
            log.info("MCP server on http://%s:%d%s serving %s", listen, port, path, ", ".join(usable))
            try:
                await server.serve(sockets=[sock])
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
        finally:
            await runtime.close()
    finally:
        sock.close()


def _uvicorn_server(config: Any) -> Any:
    import uvicorn

    class Uvicorn(uvicorn.Server):
        """uvicorn without its own signal handling: ours (loop handlers) stops it, and nothing is
        re-raised after the shutdown, so the tool runtime is closed before the process exits."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

    return Uvicorn(config)


# =========================================================================== stdio


class _WireReader:
    """The client's lines, read from ``fd`` by a daemon thread.

    The SDK's stdio transport reads in an AnyIO worker thread that cannot be
    abandoned: a SIGTERM while the client keeps stdin open would wait for its
    next line.  This reader's thread never holds shutdown up.
    """

    def __init__(self, fd: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._lines: asyncio.Queue[Optional[str]] = asyncio.Queue()
        self._file = os.fdopen(fd, "rb", closefd=False)
        threading.Thread(target=self._pump, name="interlace-mcp-stdin", daemon=True).start()

    def _pump(self) -> None:
        try:
            for raw in self._file:
                self._loop.call_soon_threadsafe(self._lines.put_nowait, raw.decode("utf-8", "replace"))
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._loop.call_soon_threadsafe(self._lines.put_nowait, None)

    def __aiter__(self) -> "_WireReader":
        return self

    async def __anext__(self) -> str:
        line = await self._lines.get()
        if line is None:
            raise StopAsyncIteration
        return line


@contextlib.contextmanager
def divert_stdio():
    """Take the MCP wire off fds 0 and 1 for as long as the server runs, and yield it.

    fd 1 becomes a copy of stderr and fd 0 the null device, so nothing else --
    a plugin's ``print``, a tool worker (they inherit fd 1), a library's
    warning -- can write into the protocol stream or read the client's
    messages.  Yields ``(read_fd, write_fd)`` of the wire; fds 0 and 1 are
    restored afterwards and the wire's own fds closed.
    """
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        wire_in, wire_out = os.dup(0), os.dup(1)
    except OSError as exc:
        raise McpServeError(f"the stdio transport needs an open stdin and stdout: {exc.strerror or exc}") from exc
    saved_in, saved_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
        os.dup2(2, 1)
        yield wire_in, wire_out
    finally:
        os.close(null)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        for fd in (saved_in, saved_out, wire_in, wire_out):
            os.close(fd)


async def serve_stdio(host: Any, tools: Mapping[str, Tool], wire: tuple[int, int]) -> None:
    """Serve ``tools`` over stdio until the client closes its end, SIGINT or SIGTERM; ``wire`` is
    the read and write fds from :func:`divert_stdio`.  Every tool is served: the caller is the
    local user who started the process."""
    import anyio
    from mcp.server.stdio import stdio_server

    read_fd, write_fd = wire
    runtime = await start_runtime(host, tools)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    log.info("MCP server on stdio serving %s", ", ".join(tools) or "no tools")
    out = io.TextIOWrapper(os.fdopen(write_fd, "wb", closefd=False), encoding="utf-8")
    try:
        server = build_server(runtime)
        wire_in: Any = _WireReader(read_fd)  # what the SDK needs of stdin: ``async for line in it``
        async with stdio_server(stdin=wire_in, stdout=anyio.wrap_file(out)) as (read, write):
            await server.run(read, write, server.create_initialization_options())
    except asyncio.CancelledError:
        log.info("MCP server stopping (signal)")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runtime.close()
        with contextlib.suppress(OSError, ValueError):
            out.close()
