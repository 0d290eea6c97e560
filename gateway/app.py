"""The Starlette application: OpenAI-compatible endpoints over Interlace engines.

    GET  /health               liveness
    GET  /v1/models            the configured models
    POST /v1/chat/completions  chat, tools, structured output, streaming
    GET  /v1/plugins           installed plugins, their tools and versions
    GET  /metrics              Prometheus metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine_ext.errors import ContextTooLong, EngineError, InvalidSampling
from ..engine_ext.forced import ForcedOutput
from ..engine_ext.protocol import SamplingParams
from . import openai_api as api
from .chat import render_messages, tool_format
from .completions import (CallArgs, CallStart, CompletionPlan, Content, Finish, FirstRoundOnly, ServerToolResult,
                          TokenLogprob, run_completion)
from .config import GatewayConfig, ModelSpec
from .metrics import CONTENT_TYPE_LATEST, Metrics

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

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def tool_format(self):
        return tool_format(self.spec.parser)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def new_parser(self) -> Any:
        return self.parser_factory()

    def grammar(self) -> Any:
        if self._grammar is None:
            from .constrained import GrammarCompiler

            self._grammar = GrammarCompiler(self.tokenizer, vocab_size=self.engine.vocab_size)
        return self._grammar


class Gateway:
    """Everything the routes share; built from a config by :func:`create_app`."""

    def __init__(self, config: GatewayConfig, engine_factory: Optional[Callable[[ModelSpec], Any]] = None):
        self.config = config
        self.engine_factory = engine_factory or load_engine
        self.metrics = Metrics()
        self.models: Dict[str, ModelServer] = {}
        self.host: Any = None
        self.runtime: Any = None
        self.parsers: Any = None

    async def start(self, app: Starlette) -> None:
        from ..parsers.base import ParserRegistry
        from .plugin_host import BUILTIN_PLUGINS, PluginHost
        from .tool_runtime import ToolRuntime

        cfg = self.config
        self.host = PluginHost(cfg.tools, entrypoints=cfg.plugin_entrypoints,
                               builtins=(*BUILTIN_PLUGINS, *cfg.plugin_modules))
        self.parsers = ParserRegistry()
        for name, factory in self.host.parsers().items():
            self.parsers.register(name, factory)
        for spec in cfg.models.values():
            if spec.parser not in self.parsers:
                raise api.APIError(500, f"model {spec.name!r}: unknown parser {spec.parser!r} "
                                        f"(installed: {', '.join(self.parsers.names())})")
        try:
            engines: Dict[str, Any] = {}  # models that differ only in name/parser share one engine
            for spec in cfg.models.values():
                key = json.dumps([spec.engine, spec.path, spec.engine_args], sort_keys=True)
                if key not in engines:
                    engines[key] = await asyncio.to_thread(self.engine_factory, spec)
                engine = engines[key]
                self.models[spec.name] = ModelServer(spec.name, spec, engine, self.parsers.get(spec.parser))
                self.metrics.watch_engine(spec.name, lambda e=engine: e.blocks.num_used, engine.blocks.num_blocks)
            self.runtime = ToolRuntime(self.host.tools(), policy=self.host.before_tool_execution)
            await self.runtime.start()
            self.host.startup(app)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self.runtime is not None:
            await self.runtime.close()
            self.runtime = None
        for engine in {id(m.engine): m.engine for m in self.models.values()}.values():
            await asyncio.to_thread(engine.close)
        self.models.clear()


def load_engine(spec: ModelSpec) -> Any:
    from ..engine_ext.embedded import embedded_model_dir
    from ..engine_ext.native.engine import NativeEngine

    path = embedded_model_dir() if spec.path == "embedded" else spec.path
    return NativeEngine.load(path, **spec.engine_args)


# ===================================================================== routes
def create_app(config: GatewayConfig, engine_factory: Optional[Callable[[ModelSpec], Any]] = None) -> Starlette:
    gw = Gateway(config, engine_factory)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start(app)
        try:
            yield
        finally:
            await gw.stop()

    def error(e: api.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    def authorized(request: Request) -> bool:
        keys = config.api_keys
        if not keys:
            return True
        auth = request.headers.get("authorization", "")
        return auth.startswith("Bearer ") and auth[7:] in keys

    def guard(fn):
        async def wrapped(request: Request) -> Response:
            if not authorized(request):
                return error(api.APIError(401, "invalid or missing API key", "invalid_request_error",
                                          code="invalid_api_key"))
            try:
                return await fn(request)
            except api.APIError as e:
                gw.metrics.request(request.url.path, "", e.status)
                return error(e)
        return wrapped

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": list(gw.models)})

    @guard
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": "interlace",
             "max_model_len": m.max_model_len} for m in gw.models.values()]})

    @guard
    async def plugins(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": gw.host.list_plugins()})

    async def metrics(request: Request) -> Response:
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @guard
    async def chat_completions(request: Request) -> Response:
        raw = await request.body()
        if len(raw) > config.max_request_bytes:
            raise api.APIError(413, f"request body over {config.max_request_bytes} bytes", code="request_too_large")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise api.APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json")
        body = api.validate_chat_request(body)
        model = gw.models.get(body["model"])
        if model is None:
            raise api.APIError(404, f"the model {body['model']!r} does not exist (available: "
                                    f"{', '.join(gw.models)})", param="model", code="model_not_found")
        plan = build_plan(gw, model, body)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream_chunks(gw, model, plan, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await collect(gw, model, plan))

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/plugins", plugins),
        Route("/metrics", metrics),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gw
    return app


# ============================================================ request -> plan
def build_plan(gw: Gateway, model: ModelServer, body: Dict[str, Any]) -> CompletionPlan:
    ext = body.get("interlace") or {}
    tools: List[Dict[str, Any]] = list(body.get("tools") or [])
    server: Dict[str, Any] = {}
    wanted = ext.get("server_tools")
    if wanted:
        available = gw.runtime.tools if gw.runtime else {}
        names = [n for n, t in available.items() if t.enabled] if wanted is True else wanted
        for n in names:
            tool = available.get(n)
            if tool is None or not tool.enabled:
                raise api.APIError(400, f"unknown server tool {n!r} (enabled: "
                                        f"{', '.join(k for k, t in available.items() if t.enabled)})",
                                   param="interlace.server_tools", code="unknown_tool")
            server[n] = tool
            if not any(t["function"]["name"] == n for t in tools):
                tools.append({"type": "function", "function": {"name": n, "description": tool.description,
                                                               "parameters": tool.parameters}})
    choice = body.get("tool_choice") or ("auto" if tools else "none")
    shown_tools = tools if choice != "none" else []
    try:
        text = render_messages(model.tokenizer, body["messages"], shown_tools, model.tool_format)
    except ValueError as e:
        raise api.APIError(400, f"messages could not be rendered for this model: {e}", param="messages",
                           code="invalid_value")
    prompt = model.tokenizer.encode(text)
    room = model.max_model_len - len(prompt)
    if room < 1:
        raise api.APIError(400, f"this model's maximum context length is {model.max_model_len} tokens; the "
                                f"messages take {len(prompt)} tokens", param="messages",
                           code="context_length_exceeded")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and max_tokens > room:
        raise api.APIError(400, f"this model's maximum context length is {model.max_model_len} tokens; the "
                                f"messages take {len(prompt)} and max_tokens asks for {max_tokens} more",
                           param="max_tokens", code="context_length_exceeded")
    stop = body.get("stop")
    processors = constraint(model, body, tools, choice)
    if server and processors:  # tool_choice / format constrain the first round, not the final answer
        processors = tuple(FirstRoundOnly(p) for p in processors)
    if ext.get("replay") is not None:
        pieces = [ext["replay"]] if isinstance(ext["replay"], str) else ext["replay"]
        eos = min(model.tokenizer.eos_token_ids) if model.tokenizer.eos_token_ids else None
        processors = (ForcedOutput([model.tokenizer.encode(p) for p in pieces], eos),)
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens or room,
            temperature=1.0 if body.get("temperature") is None else float(body["temperature"]),
            top_p=1.0 if body.get("top_p") is None else float(body["top_p"]),
            top_k=body.get("top_k") or 0, seed=body.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            logprobs=bool(body.get("logprobs")), logits_processors=processors)
    except InvalidSampling as e:
        raise api.APIError(400, str(e), code="invalid_value")
    return CompletionPlan(prompt_ids=prompt, sampling=sampling, parse_tools=choice != "none" and bool(tools),
                          server_tools=server, partial_execution=ext.get("partial_execution", True),
                          max_tool_rounds=ext.get("max_tool_rounds", gw.config.max_tool_rounds),
                          parallel_tool_calls=body.get("parallel_tool_calls") is not False,
                          request_info={"model": model.name, "user": body.get("user")})


def constraint(model: ModelServer, body: Dict[str, Any], tools: List[Dict[str, Any]], choice: Any) -> tuple:
    """Logits processors enforcing tool_choice / response_format (constrained decoding)."""
    rf = body.get("response_format") or {}
    forced = choice["function"]["name"] if isinstance(choice, dict) else None
    if forced is None and choice != "required" and rf.get("type") not in ("json_object", "json_schema"):
        return ()
    from .constrained import GrammarError

    g = model.grammar()
    try:
        if forced is not None or choice == "required":
            # A named function means one call to it; "required" allows several calls only when asked
            # explicitly (a grammar cannot make a small model stop, so it would repeat calls).
            grammar = g.tool_calls(tools, force=forced, fmt=model.tool_format.name,
                                   parallel=forced is None and body.get("parallel_tool_calls") is True)
        elif rf["type"] == "json_schema":
            grammar = g.json_schema(rf["json_schema"]["schema"])
        else:
            grammar = g.json_object()
    except GrammarError as e:
        raise api.APIError(400, str(e), param="response_format" if not tools else "tools", code="invalid_value")
    return (g.processor(grammar),)


# ================================================================= responses
async def collect(gw: Gateway, model: ModelServer, plan: CompletionPlan) -> Dict[str, Any]:
    content: List[str] = []
    calls: Dict[int, Dict[str, Any]] = {}
    server_calls = set()
    results: List[Dict[str, Any]] = []
    logprobs: List[Dict[str, Any]] = []
    finish: Optional[Finish] = None
    try:
        async with contextlib.aclosing(run_completion(model, plan, gw.runtime, gw.metrics)) as events:
            async for ev in events:
                if isinstance(ev, Content):
                    content.append(ev.text)
                elif isinstance(ev, TokenLogprob):
                    logprobs.append(_logprob_entry(ev))
                elif isinstance(ev, CallStart):
                    if ev.server:
                        server_calls.add(ev.index)
                    else:
                        calls[ev.index] = {"id": ev.id, "type": "function",
                                           "function": {"name": ev.name, "arguments": ""}}
                elif isinstance(ev, CallArgs) and ev.index in calls:
                    calls[ev.index]["function"]["arguments"] += ev.fragment
                elif isinstance(ev, ServerToolResult):
                    results.append(ev.to_dict())
                elif isinstance(ev, Finish):
                    finish = ev
    except ContextTooLong as e:
        raise api.APIError(400, str(e), code="context_length_exceeded")
    except EngineError as e:
        raise api.APIError(500, f"engine error: {e}", "server_error")
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


async def stream_chunks(gw: Gateway, model: ModelServer, plan: CompletionPlan,
                        include_usage: bool) -> AsyncIterator[bytes]:
    cid, created, name = api.completion_id(), api.now(), model.name
    t0 = time.perf_counter()
    first = True
    server_calls = set()
    pending_logprobs: List[Dict[str, Any]] = []
    yield api.sse(api.chunk(cid, name, created, {"role": "assistant", "content": ""}))
    try:
        async with contextlib.aclosing(run_completion(model, plan, gw.runtime, gw.metrics)) as events:
            async for ev in events:
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
                        server_calls.add(ev.index)
                        yield api.sse(api.chunk(cid, name, created, {}, interlace={
                            "tool_call_start": {"index": ev.index, "id": ev.id, "name": ev.name}}))
                    else:
                        yield api.sse(api.chunk(cid, name, created, {"tool_calls": [{
                            "index": ev.index, "id": ev.id, "type": "function",
                            "function": {"name": ev.name, "arguments": ""}}]}))
                elif isinstance(ev, CallArgs):
                    if ev.index in server_calls:
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
    except EngineError as e:
        status = 400 if isinstance(e, ContextTooLong) else 500
        gw.metrics.request("/v1/chat/completions", name, status)
        yield api.sse(api.APIError(status, str(e), "invalid_request_error" if status == 400 else "server_error")
                      .body())
    yield b"data: [DONE]\n\n"
