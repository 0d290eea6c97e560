"""The ``interlace`` command line."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from typing import List, Optional


class UserError(Exception):
    """A mistake the user can fix (a path, a config): printed as one line, no traceback."""


def fail(message: str, code: int = 2) -> int:
    print(f"interlace: error: {message}", file=sys.stderr)
    return code


def _load_engine(args: argparse.Namespace):
    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.errors import EngineError
    from interlace.engine_ext.native.setup import build_native_engine

    try:  # a model directory, a .gguf file, or zoo/NAME (a block-zoo variant: its base's blocks and its own)
        engine_args = {"dtype": args.dtype, "device": args.device}
        if getattr(args, "weights", None):
            engine_args["weights"] = args.weights
        return build_native_engine(args.model or ("embedded" if engine_args.get("weights") else embedded_model_dir()),
                                   engine_args)
    except (OSError, ValueError, EngineError) as e:  # missing path, unsupported model, bad dtype/device
        raise UserError(f"cannot load the model {args.model or '(embedded)'}: {e}") from e


def cmd_generate(args: argparse.Namespace) -> int:
    from interlace.engine_ext.errors import EngineError
    from interlace.engine_ext.protocol import SamplingParams

    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    except EngineError as e:
        return fail(str(e))
    engine = _load_engine(args)
    tok = engine.tokenizer
    if args.raw or tok is None or not tok.chat_template:
        ids = tok.encode(args.prompt) if tok else [int(t) for t in args.prompt.split()]
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = tok.encode_chat(messages + [{"role": "user", "content": args.prompt}])

    async def run() -> None:
        await engine.fill("cli", ids, variant=args.model[4:] if (args.model or "").startswith("zoo/") else None)
        async for ev in engine.generate("cli", sampling):
            sys.stdout.write(ev.text if tok else f"{ev.token_id} ")
            sys.stdout.flush()
        sys.stdout.write("\n")

    try:
        asyncio.run(run())
    except EngineError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    return 0


def _config(args: argparse.Namespace, require_secrets: bool = True):
    from interlace.gateway.config import ConfigError, load_config, parse_config

    try:
        if args.config:
            return load_config(args.config, require_secrets=require_secrets)
        return parse_config({"models": {"smollm2": {"path": "embedded", "weights": "as-shipped"}}},
                            "<built-in default>")
    except ConfigError as e:
        raise UserError(str(e)) from e


def check_serve_config(cfg) -> None:
    """What can be checked before the server starts, so that a mistake is one clear line
    instead of a start-up traceback: plugins load and accept their settings, every
    model's parser exists, the response store opens, every model path exists, vLLM takes every
    vLLM engine's arguments."""
    from pathlib import Path

    from interlace.gateway.config import ConfigError
    from interlace.gateway.plugin_host import BUILTIN_PLUGINS, PluginHost, PluginLoadError

    try:
        host = PluginHost(cfg.tools, entrypoints=cfg.plugin_entrypoints,
                          builtins=(*BUILTIN_PLUGINS, *cfg.plugin_modules))
        host.tools()
        parsers = host.parsers()
        reasoning = host.reasoning_parsers()
    except (PluginLoadError, ImportError) as e:
        raise UserError(f"{cfg.source}: plugins: {_plugin_error(e)}") from e
    try:
        cfg.check_parsers(parsers, reasoning)
    except ConfigError as e:
        raise UserError(str(e)) from e
    if any(spec.path.startswith("zoo/") for spec in cfg.models.values()):
        from interlace.gateway.models import zoo_engine_specs

        try:  # every zoo variant known, of one base per engine, held by some replica
            zoo_engine_specs(cfg)
        except ConfigError as e:
            raise UserError(str(e)) from e
    from interlace.gateway.responses.store import StoreError, open_store

    try:  # the response store opens (a corrupt, foreign, locked or unwritable file: its one line)
        store = open_store(cfg.responses)
        if store is not None:
            asyncio.run(store.close())
    except StoreError as e:
        raise UserError(f"{cfg.source}: server.responses.path: {e}") from e
    for spec in cfg.models.values():
        if spec.path != "embedded" and not spec.path.startswith("zoo/") and not Path(spec.path).exists():
            raise UserError(f"{cfg.source}: models.{spec.name}.path: {spec.path!r} does not exist")
        for i, r in enumerate(spec.replicas or []):
            where = f"{cfg.source}: models.{spec.name}." + (f"replicas[{i}]" if len(spec.replicas) > 1 else "engine")
            if r.get("kind") == "native" and r.get("weights") == "as-shipped" and spec.path != "embedded":
                from interlace.engine_ext.native.quant import QuantError, gguf_file

                try:  # a GGUF to run as shipped: checked now, not as a start-up traceback
                    gguf_file(spec.path)
                except (QuantError, OSError) as e:
                    raise UserError(f"{where}.weights: {e}") from e
            if r.get("kind") != "vllm":
                continue
            try:  # vLLM's own argument and model checks, without starting it
                from interlace.engine_ext.vllm.engine import engine_args, engine_config
            except ImportError as e:
                raise UserError(f"{where}: the vllm engine needs vLLM (pip install 'interlace[vllm]'): {e}") from e
            try:
                engine_config(engine_args(r, spec.path, spec.policy))
            except ValueError as e:
                raise UserError(f"{where}: {e}") from e


def cmd_serve(args: argparse.Namespace) -> int:
    from interlace.gateway.app import create_app
    from interlace.gateway.server import serve

    cfg = _config(args)
    check_serve_config(cfg)
    # Interlace's own start-up lines (tool containment, MCP servers, engine threads) at the chosen level
    logging.getLogger("interlace").setLevel("DEBUG" if args.log_level == "trace" else args.log_level.upper())
    host, port = args.host or cfg.host, args.port if args.port is not None else cfg.port
    cfg.host, cfg.port = host, port  # so the start-up warnings name the real address
    app = create_app(cfg)
    # connection cap and read timeouts (server.connections); SIGTERM drains for server.drain_s, then exits 0
    serve(app, cfg.connections, cfg.drain_s, host=host, port=port, log_level=args.log_level)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    import json

    from interlace.gateway.plugin_host import BUILTIN_PLUGINS, PluginLoadError, list_plugins

    cfg = _config(args, require_secrets=False)  # listing needs no API key: unset os.environ/NAME stay as written

    async def listing():
        hub = None
        if cfg.mcp_servers:  # connect to them: their tools are what they list now
            from interlace.gateway.mcp.client import McpHub

            hub = McpHub(cfg.mcp_servers)
            await hub.start()
        try:
            return list_plugins(cfg.tools, entrypoints=cfg.plugin_entrypoints,
                                builtins=(*BUILTIN_PLUGINS, *cfg.plugin_modules),
                                plugins=hub.plugins() if hub else ())
        finally:
            if hub is not None:
                await hub.close()

    try:
        plugins = asyncio.run(listing())
    except (PluginLoadError, ImportError) as e:
        raise UserError(f"plugins: {_plugin_error(e)}") from e
    if args.json:
        print(json.dumps(plugins, indent=2))
        return 0
    for p in plugins:
        print(f"{p['name']} {p.get('version') or ''}".rstrip())
        if p.get("status"):
            st = p["status"]
            why = f": {st['last_error']}" if st.get("last_error") else ""
            print(f"  {st.get('transport', '')} server, {st.get('state')}{why}")
        for t in p.get("tools", []):
            state = "" if t.get("enabled", True) else "  (disabled: needs settings)"
            print(f"  tool    {t['name']}{state}")
            for key, value in (t.get("info") or {}).items():
                print(f"            {key}: {_info_value(value)}")
        for name in p.get("parsers", []):
            print(f"  parser  {name}")
    return 0


def _plugin_error(e: Exception) -> str:
    return f"cannot import a plugin module: {e}" if isinstance(e, ImportError) else str(e)


def _info_value(value) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


#: ``interlace bench NAME``: the module of interlace.bench whose ``main`` runs it
BENCHMARKS = {"engine": "engine", "tools": "tools", "trace": "trace", "apps": "apps", "langchain": "langchain_apps",
              "zoo": "zoo", "jobs": "agent_jobs", "apis": "api_jobs"}


def cmd_bench(args: argparse.Namespace) -> int:
    return importlib.import_module(f"interlace.bench.{BENCHMARKS[args.what]}").main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="interlace", description="Interlace agent gateway and engine")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply with the native engine (chat-templated, greedy by default)")
    g.add_argument("prompt")
    g.add_argument("--model", help="HF model directory, .gguf file or zoo/NAME (a block-zoo variant; "
                                   "default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--system", help="system message")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 where the CPU/GPU computes it natively, else float32")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--weights", choices=["as-shipped", "float32", "bfloat16", "int8"],
                   help="how the weight matmuls are stored (default: dense in --dtype): as-shipped = the .gguf's "
                        "quantized tensors (the embedded model: Q4_1), int8 = per-channel int8; "
                        "see docs/quantization.md")
    g.set_defaults(fn=cmd_generate)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible gateway")
    s.add_argument("--config", help="YAML config (default: the embedded model with built-in plugins)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--log-level", default="info", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    s.set_defaults(fn=cmd_serve)

    pl = sub.add_parser("plugins", help="list installed plugins, their tools and parsers")
    pl.add_argument("--config", help="YAML config whose tool settings to apply")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plugins)

    b = sub.add_parser("bench", help=f"run a benchmark ({', '.join(BENCHMARKS)})")
    b.add_argument("what", choices=list(BENCHMARKS))
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)

    from interlace.engine_ext.sim.cli import add_sim_arguments, run_sim  # torch-free: cheap to import

    sm = sub.add_parser("sim", help="simulate a trace under interception and ranking policies (no torch)")
    add_sim_arguments(sm)
    sm.set_defaults(fn=run_sim)

    pr = sub.add_parser("profile", help="measure forward, swap and saturation times of a model here (JSON)",
                        add_help=False)  # its own parser (imported lazily: torch) reads the rest, --help too
    pr.set_defaults(fn=cmd_profile)

    zo = sub.add_parser("zoo", help="BlockLLM block zoo: add, list, analyze, remove variants; make-variants",
                        add_help=False)  # its own parser (imported lazily: torch) reads the rest, --help too
    zo.set_defaults(fn=cmd_zoo)

    mc = sub.add_parser("mcp", help="Model Context Protocol: serve Interlace's tools to MCP clients (mcp serve)",
                        add_help=False)  # its own parser reads the rest, --help too
    mc.set_defaults(fn=cmd_mcp)
    return p


def cmd_profile(args: argparse.Namespace) -> int:
    from interlace.engine_ext.native.profiler import add_profile_arguments, run_profile

    ap = argparse.ArgumentParser(prog="interlace profile")
    add_profile_arguments(ap)
    return run_profile(ap.parse_args(args.rest))


def cmd_zoo(args: argparse.Namespace) -> int:
    from interlace.engine_ext.zoo.cli import main as zoo_main

    return zoo_main(args.rest)


def cmd_mcp(args: argparse.Namespace) -> int:
    return mcp_main(args.rest)


# ---- ``interlace mcp``: the Model Context Protocol commands ---------------------------------------
# ``interlace mcp serve`` serves Interlace's tools -- the built-ins and every plugin's, with the
# configuration's tool settings and policy plugins -- to MCP clients, over stdio (the default: for a
# client that starts the server itself) or Streamable HTTP.  Who may use what: gateway/mcp/server.py
# and docs/security.md ("The HTTP surface").

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def mcp_parser() -> argparse.ArgumentParser:
    from .gateway.mcp.server import DEFAULT_HOST, DEFAULT_PORT, MCP_PATH

    p = argparse.ArgumentParser(prog="interlace mcp", description="Model Context Protocol: serve Interlace's tools")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve Interlace's tools to MCP clients (stdio or Streamable HTTP)",
                       description="Serve the enabled tools (built-in and plugins) as an MCP server. stdio trusts "
                                   "the local user who starts it with every tool; over HTTP each API key gets its "
                                   "server.api_keys[].server_tools (nothing without keys unless "
                                   "server.server_tools says so).")
    s.add_argument("--config", help="YAML config: tool settings, plugins, API keys "
                                    "(default: the built-in default, as `interlace serve`)")
    s.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                   help="stdio (default) or http (Streamable HTTP)")
    s.add_argument("--host", help=f"HTTP listening address (default {DEFAULT_HOST})")
    s.add_argument("--port", type=int, help=f"HTTP port (default {DEFAULT_PORT}); the endpoint is {MCP_PATH}")
    s.add_argument("--tools", help="serve only these tools (comma-separated names of enabled tools)")
    s.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                   help="log level; logs go to stderr (default info)")
    s.set_defaults(fn=cmd_mcp_serve)
    return p


def _tool_names(value: Optional[str]) -> Optional[List[str]]:
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise UserError("--tools: give at least one tool name (comma-separated)")
    return names


def cmd_mcp_serve(args: argparse.Namespace) -> int:
    from .gateway.mcp.server import (DEFAULT_HOST, DEFAULT_PORT, McpServeError, divert_stdio, load_tools, serve_http,
                             serve_stdio)

    if args.transport == "stdio" and (args.host is not None or args.port is not None):
        raise UserError("--host and --port are for --transport http")
    if args.port is not None and not 0 <= args.port <= 65535:
        raise UserError(f"--port: {args.port} is not a port number")
    only = _tool_names(args.tools)
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    try:
        if args.transport == "http":
            cfg = _config(args)
            host, tools = load_tools(cfg, only)
            asyncio.run(serve_http(cfg, host, tools, listen=args.host or DEFAULT_HOST,
                                   port=DEFAULT_PORT if args.port is None else args.port, log_level=args.log_level))
            return 0
        # stdio: from here on fd 1 is the MCP wire's alone (plugins load, workers start, after this)
        with divert_stdio() as wire:
            cfg = _config(args)
            host, tools = load_tools(cfg, only)
            asyncio.run(serve_stdio(host, tools, wire))
        return 0
    except McpServeError as e:
        raise UserError(str(e)) from e


def mcp_main(argv: List[str]) -> int:
    """``interlace mcp ...``; returns the exit status (2 for a mistake the user can fix, with one line)."""
    try:
        importlib.import_module("mcp.server.lowlevel")  # the official MCP SDK, v2
    except ImportError as e:
        return fail(f"interlace mcp needs the MCP Python SDK 2.x (pip install 'mcp>=2.3,<3'): {e}")
    args = mcp_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        return fail(str(e))


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["sim", "blocks"]:  # the cluster simulator: its own parser (no --trace)
        from interlace.engine_ext.sim.block_cli import main as sim_blocks_main

        return sim_blocks_main(argv[2:])
    if argv[:2] == ["sim", "apps"]:  # Parrot's applications on the simulator: its own parser (no --trace)
        from interlace.engine_ext.sim.app_cli import main as sim_apps_main

        return sim_apps_main(argv[2:])
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.fn in (cmd_profile, cmd_zoo, cmd_mcp):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.fn(args)
    except UserError as e:
        return fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
