"""The composition root: the Starlette application that serves Interlace engines.

    GET  /health               liveness
    GET  /v1/models[/{id}]     the configured models          (gateway/openai/routes.py)
    POST /v1/chat/completions  chat, tools, structured output, streaming (gateway/openai/routes.py)
    POST /v1/completions       text completions               (gateway/openai/text_completions.py)
    /v1/responses[/...]        OpenAI's Responses API, stored responses (gateway/responses/)
    POST /v1/messages[/count_tokens]  Anthropic's Messages API    (gateway/anthropic/)
    GET  /v1/plugins           installed plugins, their tools and versions
    GET  /metrics              Prometheus metrics
    GET  /openapi.json         the OpenAPI document of every endpoint
    /v1/sessions/...           Semantic Variables (gateway/semantic/routes.py)

:class:`Gateway` starts and stops what the routes share (plugins, engines,
tool runtime, sessions); :func:`create_app` binds each wing's routes to it
and registers the error handlers once (gateway/errors.py).  Everything else
lives in its wing or below: the served models and their engines in
``models.py``, the checks at the door in ``http_guard.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from typing import Any, AsyncIterator, Callable, Dict, Iterable, List, Optional

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine_ext.native.setup import ZOO_PREFIX
from ..engine_ext.policies import ToolDurations
from ..engine_ext.variant_engine import VariantEngine
from . import http_guard as guard_
from .config import GatewayConfig, ModelSpec, may_use_tool
from .drain import Drain, DrainMiddleware
from .errors import exception_handlers
from .key_limits import ConcurrencyGuard, KeyLimits
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .models import ModelServer, load_engine, zoo_engine_specs
from .retention import RetentionStore
from .anthropic.routes import build_routes as messages_routes
from .openai.routes import build_routes as openai_routes
from .openapi import openapi_document
from .responses.routes import build_routes as responses_routes
from .semantic.graph import Services
from .semantic.routes import build_routes as semantic_routes
from .semantic.sessions import SessionStore

log = logging.getLogger(__name__)


class Gateway:
    """Everything the routes share; built from a config by :func:`create_app`."""

    def __init__(self, config: GatewayConfig, engine_factory: Optional[Callable[[ModelSpec], Any]] = None,
                 plugins: Iterable[object] = ()):
        self.config = config
        self.engine_factory = engine_factory or load_engine
        self.extra_plugins = tuple(plugins)
        self.metrics = Metrics()
        self.key_limits = KeyLimits(config)  # per API key: sessions, pending calls, chats in flight
        self.metrics.registry.register(self.key_limits)
        self.models: Dict[str, ModelServer] = {}
        self.engines: List[Any] = []  # each started engine once (models may share one)
        self.host: Any = None
        self.runtime: Any = None
        self.parsers: Any = None
        self.services: Any = None  # what semantic calls run on (gateway/semantic/graph.py)
        self.sessions: Any = None  # Semantic Variables sessions (gateway/semantic/sessions.py)
        self.mcp: Any = None  # the MCP servers whose tools are served (gateway/mcp/client.py)
        self.responses: Any = None  # the Responses API's stored responses (gateway/responses/store.py)
        self._sweeper: Optional[asyncio.Task] = None  # deletes expired stored responses
        self.response_runs: Any = None  # background responses running (gateway/responses/routes.py sets it)

    async def start(self, app: Starlette) -> None:
        from ..parsers.base import ParserRegistry
        from .plugin_host import BUILTIN_PLUGINS, PluginHost
        from .tools.runtime import ToolRuntime

        cfg = self.config
        try:
            from .responses.store import open_store

            # first: a store that cannot be opened (corrupt, locked, unwritable) stops start-up with its name
            self.responses = await asyncio.to_thread(open_store, cfg.responses)
            if self.responses is not None:
                self._sweeper = asyncio.ensure_future(self._expire_responses(min(cfg.responses.ttl_s, 3600.0)))
            if cfg.mcp_servers:  # first: their tools are registered with the others
                from .mcp.client import McpHub

                self.mcp = McpHub(cfg.mcp_servers)
                await self.mcp.start()
            self.host = PluginHost(cfg.tools, entrypoints=cfg.plugin_entrypoints,
                                   builtins=(*BUILTIN_PLUGINS, *cfg.plugin_modules),
                                   plugins=(*self.extra_plugins, *(self.mcp.plugins() if self.mcp else ())))
            self.parsers = ParserRegistry()
            for name, factory in (*self.host.parsers().items(), *self.host.reasoning_parsers().items()):
                self.parsers.register(name, factory)
            cfg.check_parsers(self.parsers.names(), self.parsers.reasoning_names())
            if any(r["kind"] == "native" for spec in cfg.models.values() for r in spec.replicas):
                from ..engine_ext.native.setup import set_engine_threads

                threads, why = set_engine_threads(cfg.threads)
                log.info("native engine threads: at most %d (%s), as many as are free while it runs "
                         "(adapt_threads)", threads, why)
            engines: Dict[str, Any] = {}  # models that differ only in name/parser share one engine
            zoo_specs = await asyncio.to_thread(zoo_engine_specs, cfg)
            for spec in cfg.models.values():
                espec = zoo_specs.get(spec.name, spec)  # zoo variants of one base: one engine for all
                key = json.dumps([espec.engine, espec.path, espec.engine_args, espec.replicas,
                                  dataclasses.asdict(espec.policy)], sort_keys=True)
                if key not in engines:
                    engines[key] = await asyncio.to_thread(self.engine_factory, espec)
                    self.engines.append(engines[key])
                engine = engines[key]
                if spec.name in zoo_specs:
                    engine = VariantEngine(engine, spec.path[len(ZOO_PREFIX):])
                interception = getattr(engine, "interception", None)
                durations = getattr(interception, "durations", None) or ToolDurations()
                retention = spec.retention
                store = (RetentionStore(engine, spec.name, retention, self.metrics, gaps=durations) if retention.enabled
                         and retention.max_contexts > 0 and retention.max_tokens > 0 else None)
                self.models[spec.name] = ModelServer(
                    spec.name, spec, engine, self.parsers.get(spec.parser), durations=durations, retention=store,
                    reasoning_factory=(self.parsers.get_reasoning(spec.reasoning_parser)
                                       if spec.reasoning_parser else None))
                self.metrics.watch_engine(spec.name, engine)
            tools = self.host.tools()
            grants = [cfg.server_tools, *(k.server_tools for k in cfg.api_keys)]  # every caller's, as permissions()
            # a tool granted to nobody is left out where its sandbox cannot be built, not a failed start-up
            self.runtime = ToolRuntime(tools, policy=self.host.before_tool_execution,
                                       ungranted=[n for n in tools if not any(may_use_tool(g, n) for g in grants)])
            await self.runtime.start()
            if self.mcp is not None:  # servers that start (or restart with other tools) from now on
                self.mcp.on_change = lambda server, tools, removed: self._mcp_tools(server)
                for server in self.mcp.servers.values():  # and those that came up while the rest started
                    self._mcp_tools(server)
            self.services = Services(self.models, self.runtime, cfg.default_max_tokens,
                                     may_use_tool=lambda caller, tool: may_use_tool(
                                         guard_.permissions(cfg, caller)[0], tool), metrics=self.metrics)
            self.sessions = SessionStore(self.services, cfg.sessions, self.key_limits)
            self.metrics.sessions.set_function(lambda s=self.sessions: len(s.sessions))
            await self.sessions.start()
            self.host.startup(app)
        except BaseException:
            await self.stop()
            raise

    async def _expire_responses(self, every_s: float) -> None:
        """Delete expired stored responses from the file now and every ``every_s`` seconds (they are
        already invisible to every query; this gives the space back and zeroes their text)."""
        from .responses.store import StoreError

        while True:
            try:
                n = await self.responses.expire()
                if n:
                    log.info("deleted %d expired stored response(s)", n)
            except StoreError as e:  # a locked file: the next round tries again
                log.warning("could not delete expired stored responses: %s", e)
            await asyncio.sleep(every_s)

    def _mcp_tools(self, server: Any) -> None:
        """Serve ``server``'s current tools in place of those it had (the host and the runtime)."""
        owner = f"mcp.{server.name}"
        old = self.host.tool_names(owner)
        kept = self.host.replace_tools(owner, server.tools.values())
        self.runtime.update_tools(add=kept, remove=old)
        if {t.name for t in kept} != set(old):
            log.info("MCP server %r: now serving %s", server.name, ", ".join(t.name for t in kept) or "no tools")

    async def stop(self) -> None:
        if self.response_runs is not None:  # first: each run stores how it ended ("cancelled")
            await self.response_runs.close()
        if self.sessions is not None:  # their calls use the engines and tools: first
            await self.sessions.close()
            self.sessions = None
        if self.services is not None:
            self.services.close()
            self.services = None
        if self.runtime is not None:
            await self.runtime.close()
            self.runtime = None
        if self.mcp is not None:
            await self.mcp.close()
            self.mcp = None
        for m in self.models.values():
            if m.retention is not None:
                await m.retention.close()
        for engine in self.engines:
            await asyncio.to_thread(engine.close)
        self.engines.clear()
        self.models.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self.responses is not None:  # last: requests still finishing above may store their response
            await self.responses.close()
            self.responses = None


def create_app(config: GatewayConfig, engine_factory: Optional[Callable[[ModelSpec], Any]] = None,
               plugins: Iterable[object] = ()) -> Starlette:
    """The ASGI app.  ``plugins`` registers extra plugin objects (tests, embedding)
    besides the configured modules and entry points."""
    gw = Gateway(config, engine_factory, plugins)
    for warning in guard_.startup_warnings(config):
        log.warning(warning)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start(app)
        try:
            yield
        finally:
            await gw.stop()

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": list(gw.models)})

    async def plugins_route(request: Request) -> Response:
        guard_.authenticate(config, request)
        return JSONResponse({"object": "list", "data": gw.host.list_plugins()})

    async def metrics(request: Request) -> Response:
        guard_.authenticate_metrics(config, request)
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document(routes, api_keys=bool(config.api_keys),
                                             metrics_key=config.metrics_key is not None))

    routes = [
        Route("/health", health),
        Route("/v1/plugins", plugins_route),
        Route("/metrics", metrics),
        *openai_routes(gw, config),
        *responses_routes(gw, config),
        *messages_routes(gw, config),
        Route("/openapi.json", openapi),
        *semantic_routes(gw, config),
    ]
    drain = Drain()  # outermost: every request is tracked, and ended properly by the SIGTERM drain
    middleware = [Middleware(DrainMiddleware, drain=drain), Middleware(guard_.OriginGuard, allowed=config.cors_origins)]
    if config.cors_origins:
        middleware.append(Middleware(CORSMiddleware, **guard_.cors_middleware_args(config)))
    middleware.append(Middleware(ConcurrencyGuard, limits=gw.key_limits))  # after the origin and CORS checks
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers=exception_handlers(gw.metrics))
    app.state.gateway = gw
    gw.metrics.bind_routes(routes)  # requests counted by route template, never by raw path
    app.state.drain = drain  # gateway/server.py drains it on SIGTERM
    return app
