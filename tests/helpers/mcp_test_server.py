"""A small MCP server for the tests, written with the official SDK's ``MCPServer``.

Run as ``python tests/helpers/mcp_test_server.py [stdio | http PORT]``.  Its tools:

* ``echo(text)`` -- returns the text;
* ``slow(seconds)`` -- sleeps, then says how long (a tool worth starting early);
* ``fail(message)`` -- raises: the server answers an error result;
* ``forecast(city, days, units)`` -- a tool with a real schema (enum, bounds,
  required keys), for early abort on a schema violation;
* ``die()`` -- the server process exits in the middle of the call;
* ``shout(text)`` -- writes the text to the server's stderr;
* ``calls()`` -- how many tool calls this process has served (tells a restart);
* ``cancelled()`` -- how many ``slow`` calls the client cancelled.

``MCP_TEST_MARKER`` in the environment, when set, is echoed by ``env`` (the
gateway passes a server's configured ``env``); the gateway's own variables
must not reach it.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Annotated, Literal

from pydantic import Field

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("interlace-test", log_level="WARNING")
_calls = 0
_cancelled = 0


def _count() -> None:
    global _calls
    _calls += 1


@server.tool(description="Return the text unchanged.")
def echo(text: str) -> str:
    _count()
    return text


@server.tool(description="Sleep for `seconds`, then say so.")
async def slow(seconds: float) -> str:
    global _cancelled
    _count()
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:  # the client cancelled the request (notifications/cancelled)
        _cancelled += 1
        raise
    return f"slept {seconds:g}s"


@server.tool(description="How many `slow` calls the client cancelled.")
def cancelled() -> int:
    return _cancelled


@server.tool(description="Always fails with the given message.")
def fail(message: str) -> str:
    _count()
    raise ToolError(message)


@server.tool(description="Weather forecast for a city.")
def forecast(
    city: Annotated[str, Field(min_length=1)],
    days: Annotated[int, Field(ge=1, le=7)],
    units: Literal["metric", "imperial"] = "metric",
) -> dict:
    _count()
    return {"city": city, "days": days, "units": units, "forecast": ["sunny"] * days}


@server.tool(description="The server process exits in the middle of this call.")
async def die() -> str:
    _count()
    await asyncio.sleep(0.05)
    os._exit(3)


@server.tool(description="Write the text to the server's stderr.")
def shout(text: str) -> str:
    _count()
    print(text, file=sys.stderr, flush=True)
    return "said"


@server.tool(description="How many calls this server process has served.")
def calls() -> int:
    return _calls


@server.tool(description="Environment variables the server was started with (names and MCP_TEST_MARKER).")
def env() -> dict:
    _count()
    return {"marker": os.environ.get("MCP_TEST_MARKER"), "names": sorted(os.environ)}


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "stdio"
    if mode == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
