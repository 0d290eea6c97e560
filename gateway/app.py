"""The Starlette application: OpenAI-compatible endpoints over Interlace engines.

    GET  /health               liveness
    GET  /v1/models            the configured models
    POST /v1/chat/completions  chat, tools, structured output, streaming
    GET  /v1/plugins           installed plugins, their tools and versions
    GET  /metrics              Prometheus metrics
    GET  /openapi.json         the OpenAPI document of every endpoint
    /v1/sessions/...           Semantic Variables (gateway/semantic/routes.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterable, List, Optional, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine_ext.errors import ContextTooLong, EngineClosed, EngineError, EngineUnavailable
from ..engine_ext.native.setup import ZOO_PREFIX, engine_profile  # noqa: F401  (engine_profile: moved there)
from ..engine_ext.variant_engine import VariantEngine
from . import http_guard as guard_
from .openai import wire as api
from .openai.completions import CallArgs, CallStart, CompletionPlan, Content, Finish, ServerToolResult, TokenLogprob, run_completion
from .config import ConfigError, GatewayConfig, ModelSpec, engine_dict
from .http_guard import ClientGone
from ..engine_ext.policies import OutputLengths, ToolDurations
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .openapi import openapi_document
from .openai.plan import build_plan
from .config import may_use_tool
from .openai.retention import RetentionStore
from .semantic.graph import Services
from .semantic.routes import build_routes as semantic_routes
from .semantic.sessions import SessionStore

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class ModelServer:
    """One served model: its engine, tokenizer, parser and prompt format."""

    name: str
    spec: ModelSpec
    engine: Any
    parser_factory: Callable[[], Any]
    created: int = field(default_factory=lambda: int(time.time()))
    _grammar: Any = None
    #: tool call durations, shared with the engine's interception policy (the engine observes them)
    durations: Any = field(default_factory=ToolDurations)
    #: tokens a segment (to the next tool call or the end) produces, per application (LAMPS' predictor)
    lengths: Any = field(default_factory=OutputLengths)
    #: finished chat contexts kept across client-side tool calls (None: retention is off)
    retention: Optional[RetentionStore] = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def tool_format(self) -> Any:
        """The tool-call format its parser owns (``format``, checked when the parser was registered)."""
        return self.parser_factory.format

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def new_parser(self) -> Any:
        return self.parser_factory()

    def grammar(self) -> Any:
        if self._grammar is None:
            from ..engine_ext.constraints.grammar import GrammarCompiler

            self._grammar = GrammarCompiler(self.tokenizer, vocab_size=self.engine.vocab_size)
        return self._grammar


class Gateway:
    """Everything the routes share; built from a config by :func:`create_app`."""

    def __init__(self, config: GatewayConfig, engine_factory: Optional[Callable[[ModelSpec], Any]] = None,
                 plugins: Iterable[object] = ()):
        self.config = config
        self.engine_factory = engine_factory or load_engine
        self.extra_plugins = tuple(plugins)
        self.metrics = Metrics()
        self.models: Dict[str, ModelServer] = {}
        self.engines: List[Any] = []  # each started engine once (models may share one)
        self.host: Any = None
        self.runtime: Any = None
        self.parsers: Any = None
        self.services: Any = None  # what semantic calls run on (gateway/semantic/graph.py)
        self.sessions: Any = None  # Semantic Variables sessions (gateway/semantic/sessions.py)
        self.mcp: Any = None  # the MCP servers whose tools are served (gateway/mcp/client.py)

    async def start(self, app: Starlette) -> None:
        from ..parsers.base import ParserRegistry
        from .plugin_host import BUILTIN_PLUGINS, PluginHost
        from .tools.runtime import ToolRuntime

        cfg = self.config
        try:
            if cfg.mcp_servers:  # first: their tools are registered with the others
                from .mcp.client import McpHub

                self.mcp = McpHub(cfg.mcp_servers)
                await self.mcp.start()
            self.host = PluginHost(cfg.tools, entrypoints=cfg.plugin_entrypoints,
                                   builtins=(*BUILTIN_PLUGINS, *cfg.plugin_modules),
                                   plugins=(*self.extra_plugins, *(self.mcp.plugins() if self.mcp else ())))
            self.parsers = ParserRegistry()
            for name, factory in self.host.parsers().items():
                self.parsers.register(name, factory)
            cfg.check_parsers(self.parsers.names())
            if any(r["kind"] == "native" for spec in cfg.models.values() for r in spec.replicas):
                from ..engine_ext.native.setup import set_engine_threads

                threads, why = set_engine_threads(cfg.threads)
                log.info("native engine threads: %d (%s)", threads, why)
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
                self.models[spec.name] = ModelServer(spec.name, spec, engine, self.parsers.get(spec.parser),
                                                     durations=durations, retention=store)
                self.metrics.watch_engine(spec.name, engine)
            self.runtime = ToolRuntime(self.host.tools(), policy=self.host.before_tool_execution)
            await self.runtime.start()
            if self.mcp is not None:  # servers that start (or restart with other tools) from now on
                self.mcp.on_change = lambda server, tools, removed: self._mcp_tools(server)
                for server in self.mcp.servers.values():  # and those that came up while the rest started
                    self._mcp_tools(server)
            self.services = Services(self.models, self.runtime, cfg.default_max_tokens,
                                     may_use_tool=lambda caller, tool: may_use_tool(
                                         guard_.permissions(cfg, caller)[0], tool), metrics=self.metrics)
            self.sessions = SessionStore(self.services, cfg.sessions)
            self.metrics.sessions.set_function(lambda s=self.sessions: len(s.sessions))
            await self.sessions.start()
            self.host.startup(app)
        except BaseException:
            await self.stop()
            raise

    def _mcp_tools(self, server: Any) -> None:
        """Serve ``server``'s current tools in place of those it had (the host and the runtime)."""
        owner = f"mcp.{server.name}"
        old = self.host.tool_names(owner)
        kept = self.host.replace_tools(owner, server.tools.values())
        self.runtime.update_tools(add=kept, remove=old)
        if {t.name for t in kept} != set(old):
            log.info("MCP server %r: now serving %s", server.name, ", ".join(t.name for t in kept) or "no tools")

    async def stop(self) -> None:
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


def zoo_engine_specs(cfg: GatewayConfig) -> Dict[str, ModelSpec]:
    """For each zoo model (``path: zoo/NAME``), the spec of the engine it
    shares: the zoo models of one base with the same engine settings and
    policy are served by one engine (or one set of replicas) holding all of
    them, each replica the ``variants`` it lists (default: all).  Unknown
    variants, and variants no replica holds, are a :class:`ConfigError`."""
    zoo_models = [s for s in cfg.models.values() if s.path.startswith(ZOO_PREFIX)]
    if not zoo_models:
        return {}
    from ..engine_ext.zoo import Zoo, ZooError

    try:
        z = Zoo(cfg.zoo)
        bases = {s.name: z.info(s.path[len(ZOO_PREFIX):]).base for s in zoo_models}
    except ZooError as e:
        raise ConfigError(f"{cfg.source}: models: {e}") from e
    groups: Dict[str, List[ModelSpec]] = {}
    for s in zoo_models:
        key = json.dumps([bases[s.name], s.engine, s.engine_args, s.replicas, dataclasses.asdict(s.policy)],
                         sort_keys=True, default=str)
        groups.setdefault(key, []).append(s)
    out: Dict[str, ModelSpec] = {}
    for specs in groups.values():
        first = specs[0]
        names = sorted({s.path[len(ZOO_PREFIX):] for s in specs})
        held: set = set()
        replicas = []
        for i, r in enumerate(first.replicas):
            mine = list(r.get("variants") or names)
            try:
                for n in mine:
                    if z.info(n).base != bases[first.name]:
                        raise ConfigError(f"{cfg.source}: models.{first.name}.replicas[{i}].variants: {n!r} is not "
                                          f"a variant of {bases[first.name]!r}")
            except ZooError as e:
                raise ConfigError(f"{cfg.source}: models.{first.name}.replicas[{i}].variants: {e}") from e
            held.update(mine)
            replicas.append({**r, "variants": mine, **({"zoo": cfg.zoo} if cfg.zoo else {})})
        missing = sorted(set(names) - held)
        if missing:
            raise ConfigError(f"{cfg.source}: models.{first.name}.replicas: no replica holds the variant(s) "
                              f"{', '.join(missing)}")
        group = dataclasses.replace(first, name=f"zoo/{bases[first.name]}", path=ZOO_PREFIX + bases[first.name],
                                    engine_args={**first.engine_args, "variants": names,
                                                 **({"zoo": cfg.zoo} if cfg.zoo else {})},
                                    replicas=replicas)
        for s in specs:
            out[s.name] = group
        log.info("zoo/%s: one engine for the variants %s", bases[first.name], ", ".join(names))
    return out


def load_engine(spec: ModelSpec) -> Any:
    """The model's engine: one engine per replica (``spec.replicas``), each
    built by its kind with the model's policies; several are put behind one
    :class:`~interlace.engine_ext.replicas.ReplicaSet`.  If one fails to
    start, those already started are closed and the error raised."""
    replicas = spec.replicas or [engine_dict(spec.engine, spec.path, spec.engine_args)]
    engines: List[Any] = []
    try:
        for i, r in enumerate(replicas):
            where = f"models.{spec.name}." + (f"replicas[{i}]" if len(replicas) > 1 else "engine")
            engines.append(load_replica(spec, r, where, f"{spec.name}-{i}"))
    except BaseException:
        for e in reversed(engines):
            try:
                e.close()
            except Exception:  # noqa: BLE001  (the start-up error is the one to report)
                log.exception("closing a replica of %s after a failed start failed", spec.name)
        raise
    if len(engines) == 1:
        return engines[0]
    from ..engine_ext.replicas import ReplicaSet

    log.info("%s: %d replicas (%s)", spec.name, len(engines), ", ".join(r["kind"] for r in replicas))
    return ReplicaSet(engines)


#: The settings of a native engine object that are :meth:`NativeEngine.load` keyword arguments.
NATIVE_LOAD_KEYS = ("dtype", "weights", "device", "block_size", "kv_cache_tokens", "max_batched_tokens", "max_seqs",
                    "max_model_len", "attention")


def load_replica(spec: ModelSpec, r: Dict[str, Any], where: str = "", label: str = "worker") -> Any:
    """One replica's engine, by its kind (``r``: a normalized engine dict of
    ``spec.replicas``).  The optional engines are imported here, so a missing
    dependency fails only the model that uses it, with a message naming it."""
    kind = r["kind"]
    if kind == "native":
        kwargs = {k: r[k] for k in (*NATIVE_LOAD_KEYS, "variants", "zoo") if k in r}
        if r.get("worker", "thread") == "thread":
            return load_native(spec.path, kwargs, spec.policy)
        process_engine = _optional(where, kind, "..engine_ext.worker", "ProcessEngine")
        kwargs["threads"] = r.get("threads") or _process_threads(spec)
        return process_engine.start({"path": spec.path, **kwargs}, spec.policy, name=label)
    from ..engine_ext.embedded import embedded_model_dir

    path = str(embedded_model_dir()) if spec.path == "embedded" else spec.path
    if kind == "vllm":
        load_vllm_engine = _optional(where, kind, "..engine_ext.vllm", "load_vllm_engine")
        model = r.get("model", spec.path)
        model = str(embedded_model_dir()) if model == "embedded" else model
        return load_vllm_engine({**r, "model": model}, model, spec.policy, name=label)
    if kind == "openai":
        load_openai_engine = _optional(where, kind, "..engine_ext.openai_http", "load_openai_engine")
        return load_openai_engine(dict(r), path, spec.policy, name=label)
    raise ConfigError(f"{where}.kind: unknown engine kind {kind!r}")


def _process_threads(spec: ModelSpec) -> int:
    """A process replica's torch threads when its config does not say: the
    gateway's (engine.threads, else the usable cores) shared out among the
    model's process replicas, so together they do not oversubscribe the cores."""
    import torch

    workers = sum(1 for r in spec.replicas if r["kind"] == "native" and r.get("worker") == "process")
    return max(1, torch.get_num_threads() // max(1, workers))


def _optional(where: str, kind: str, module: str, name: str) -> Any:
    import importlib

    try:
        return getattr(importlib.import_module(module, __package__), name)
    except ImportError as e:
        raise ConfigError(f"{where}: the {kind} engine cannot be loaded ({e}); is its optional dependency "
                          f"installed?") from e


def load_native(path: str, engine_args: Dict[str, Any], policy: Any) -> Any:
    """A native engine in this process with its configured policies
    (:func:`~interlace.engine_ext.native.setup.build_native_engine`, which
    worker processes use too)."""
    from ..engine_ext.native.setup import build_native_engine

    return build_native_engine(path, engine_args, policy)


# ===================================================================== routes
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

    def error(e: api.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def guard(fn):
        """Authentication, and APIError -> its JSON answer.  The request's key is
        passed on as ``request.state.caller``."""
        async def wrapped(request: Request) -> Response:
            try:
                request.state.caller = guard_.authenticate(config, request)
                return await fn(request)
            except api.APIError as e:
                gw.metrics.request(request.url.path, "", e.status)
                return error(e)
            except ClientGone:  # nobody to answer; 499 is what the access log and metrics show
                gw.metrics.request(request.url.path, "", 499)
                return Response(status_code=499)
        return wrapped

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": list(gw.models)})

    @guard
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": "interlace",
             "max_model_len": m.max_model_len,
             # a zoo variant (vLLM's LoRA convention): its zoo path and the base it shares blocks with
             **({"root": m.spec.path, "parent": ZOO_PREFIX + m.engine.inner.name}
                if isinstance(m.engine, VariantEngine) else {})} for m in gw.models.values()]})

    @guard
    async def plugins_route(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": gw.host.list_plugins()})

    async def metrics(request: Request) -> Response:
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @guard
    async def chat_completions(request: Request) -> Response:
        guard_.require_json(request)
        body = api.parse_json(await guard_.read_body(request, config.max_request_bytes))
        body = api.validate_chat_request(body)
        model = gw.models.get(body["model"])
        if model is None:
            raise api.APIError(404, f"the model {body['model']!r} does not exist (available: "
                                    f"{', '.join(gw.models)})", param="model", code="model_not_found")
        enabled = [n for n, t in (gw.runtime.tools if gw.runtime else {}).items() if t.enabled]
        caller = request.state.caller
        guard_.authorize(config, caller, body, enabled)
        plan = build_plan(gw, model, body, caller=caller.name if caller else None)
        events = run_completion(model, plan, gw.runtime, gw.metrics)
        if not body.get("stream"):
            return JSONResponse(await until_disconnected(request, collect(gw, model, plan, events)))
        # Start generating before the response does: an error up to the first event (a context
        # too long, an engine that refuses the sampling) is still an HTTP error, not a broken stream.
        try:
            first = await until_disconnected(request, _first_event(events))
        except BaseException:
            await events.aclose()
            raise
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return ClosingStreamingResponse(stream_chunks(gw, model, events, first, include_usage),
                                        on_close=events.aclose, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = {404: f"no such endpoint: {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return JSONResponse(api.APIError(exc.status_code, message, code=code).body(), status_code=exc.status_code,
                            headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        # Starlette logs the traceback (the exception is re-raised after this answer).
        return JSONResponse(api.APIError(500, f"internal server error ({type(exc).__name__}); the gateway's log "
                                              "has the details", "server_error", code="internal_error").body(),
                            status_code=500)

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document(routes))

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/plugins", plugins_route),
        Route("/metrics", metrics),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/openapi.json", openapi),
        *semantic_routes(gw, config, lambda request, status: gw.metrics.request(request.url.path, "", status)),
    ]
    middleware = [Middleware(guard_.OriginGuard, allowed=config.cors_origins)]
    if config.cors_origins:
        middleware.append(Middleware(CORSMiddleware, **guard_.cors_middleware_args(config)))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.gateway = gw
    return app


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` until it finishes or the client disconnects, whichever comes first;
    on a disconnect ``work`` is cancelled (its generation aborted, its context freed)
    and :class:`ClientGone` raised.  The body has been read, so the next ASGI message
    can only be ``http.disconnect``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            log.warning("request failed while its client disconnected: %r", task.exception())
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():  # we were cancelled ourselves
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first_event(events: AsyncIterator[Any]) -> Any:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except EngineError as e:
        raise engine_error(e) from e


#: Seconds a client is asked to wait before retrying a request no engine (replica) could serve.
RETRY_AFTER_S = 1


def engine_error(e: EngineError) -> api.APIError:
    """A context too long for the model is the client's mistake; an engine (replica)
    that is gone is a 503 to retry; other engine errors are ours."""
    if isinstance(e, ContextTooLong):
        return api.APIError(400, str(e), code="context_length_exceeded")
    if isinstance(e, (EngineUnavailable, EngineClosed)):
        return api.APIError(503, f"engine unavailable: {e}", "server_error", code="engine_unavailable",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
    return api.APIError(500, f"engine error: {e}", "server_error", code="engine_error")


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes the completion it streams however it ends --
    even when the client is gone before the body iterator ever ran (which would
    otherwise leave the context to the garbage collector)."""

    def __init__(self, content: Any, on_close: Callable[[], Awaitable[None]], **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


# ================================================================= responses
async def collect(gw: Gateway, model: ModelServer, plan: CompletionPlan, events: Any) -> Dict[str, Any]:
    """The whole completion as one ``chat.completion`` object."""
    content: List[str] = []
    calls: Dict[int, Dict[str, Any]] = {}
    results: List[Dict[str, Any]] = []
    logprobs: List[Dict[str, Any]] = []
    finish: Optional[Finish] = None
    try:
        async with contextlib.aclosing(events):
            async for ev in events:
                if isinstance(ev, Content):
                    content.append(ev.text)
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
        raise api.APIError(500, "the completion ended without a finish event", "server_error",
                           code="internal_error")
    gw.metrics.request("/v1/chat/completions", model.name, 200)
    gw.metrics.usage(model.name, finish.usage)
    message: Dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    out = {"id": api.completion_id(), "object": "chat.completion", "created": api.now(), "model": model.name,
           "choices": [{"index": 0, "message": message, "finish_reason": finish.reason,
                        "logprobs": {"content": logprobs, "refusal": None} if plan.sampling.logprobs else None}],
           "usage": finish.usage}
    if results:
        out["interlace"] = {"tool_calls": results}
    return out


def _logprob_entry(ev: TokenLogprob) -> Dict[str, Any]:
    return {"token": ev.text, "logprob": ev.logprob, "bytes": list(ev.text.encode()), "top_logprobs": []}


async def _chain(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
        async for ev in events:
            yield ev


async def stream_chunks(gw: Gateway, model: ModelServer, events: Any, first_event: Any,
                        include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events of one completion whose first event is already known.
    Whatever goes wrong after the first byte, the client gets an error event in
    OpenAI's shape and then ``[DONE]`` -- never a connection that just stops."""
    cid, created, name = api.completion_id(), api.now(), model.name
    t0 = time.perf_counter()
    first = True
    pending_logprobs: List[Dict[str, Any]] = []
    yield api.sse(api.chunk(cid, name, created, {"role": "assistant", "content": ""}))
    try:
        async with contextlib.aclosing(events):
            async for ev in _chain(first_event, events):
                if first and isinstance(ev, (Content, CallStart)):
                    gw.metrics.ttft.labels(name).observe(time.perf_counter() - t0)
                    first = False
                if isinstance(ev, TokenLogprob):
                    pending_logprobs.append(_logprob_entry(ev))
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
                    yield api.sse(api.chunk(cid, name, created, {}, interlace={"tool_result": ev.to_dict()}))
                elif isinstance(ev, Finish):
                    gw.metrics.request("/v1/chat/completions", name, 200)
                    gw.metrics.usage(name, ev.usage)
                    yield api.sse(api.chunk(cid, name, created, {}, ev.reason))
                    if include_usage:
                        yield api.sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                                       "model": name, "choices": [], "usage": ev.usage})
    except Exception as e:  # noqa: BLE001  (reported to the client, logged with its traceback)
        err = engine_error(e) if isinstance(e, EngineError) else api.APIError(
            500, f"internal server error ({type(e).__name__}) while streaming; the gateway's log has the details",
            "server_error", code="internal_error")
        if err.status >= 500:
            log.exception("streaming completion failed")
        gw.metrics.request("/v1/chat/completions", name, err.status)
        yield api.sse(err.body())
    yield b"data: [DONE]\n\n"
