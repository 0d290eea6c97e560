"""``interlace mcp``: the Model Context Protocol commands (``interlace mcp serve``).

``interlace mcp serve`` serves Interlace's tools -- the built-ins and every
plugin's, with the configuration's tool settings and policy plugins -- to MCP
clients, over stdio (the default: for a client that starts the server itself)
or Streamable HTTP.  Who may use what: gateway/mcp_server.py and
docs/security.md ("The HTTP surface").
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from typing import List, Optional

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def build_parser() -> argparse.ArgumentParser:
    from .mcp_server import DEFAULT_HOST, DEFAULT_PORT, MCP_PATH

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
    s.set_defaults(fn=cmd_serve)
    return p


def _tool_names(value: Optional[str]) -> Optional[List[str]]:
    from .cli import UserError

    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise UserError("--tools: give at least one tool name (comma-separated)")
    return names


def cmd_serve(args: argparse.Namespace) -> int:
    from .cli import UserError, _config
    from .mcp_server import (DEFAULT_HOST, DEFAULT_PORT, McpServeError, divert_stdio, load_tools, serve_http,
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


def main(argv: List[str]) -> int:
    """``interlace mcp ...``; returns the exit status (2 for a mistake the user can fix, with one line)."""
    from .cli import UserError, fail

    try:
        importlib.import_module("mcp.server.lowlevel")  # the official MCP SDK, v2
    except ImportError as e:
        return fail(f"interlace mcp needs the MCP Python SDK 2.x (pip install 'mcp>=2.3,<3'): {e}")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        return fail(str(e))
