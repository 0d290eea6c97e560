"""MCP servers as tool providers (gateway/mcp/client.py), against the small MCP
server in tests/helpers/mcp_test_server.py run over stdio and over streamable HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from helpers.gateway_server import LiveGateway, free_port

from interlace.gateway.config import ConfigError, McpServerSpec, may_use_tool, parse_config
from interlace.gateway.mcp.client import McpHub
from interlace.gateway.tools.runtime import ToolRuntime
from interlace.gateway.tools.base import InvalidToolArguments, ToolCrashed, ToolError, ToolUnavailable

SERVER = str(Path(__file__).parent / "helpers" / "mcp_test_server.py")
MODEL = {"m": {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32"}}


def stdio_spec(name: str = "t", **kw) -> McpServerSpec:
    return McpServerSpec(name, command=sys.executable, args=(SERVER,), **kw)


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def wait_gone(pids: set[int], timeout: float = 10.0) -> list[int]:
    """Those of ``pids`` still running after ``timeout`` (zombies count as gone)."""
    deadline = time.time() + timeout
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize("servers, message", [
    ({"a.b": {"command": "x"}}, "no dots"),
    ({"a": {}}, "either command"),
    ({"a": {"command": "x", "url": "http://h/mcp"}}, "not both"),
    ({"a": {"url": "http://h/mcp", "env": {"K": "v"}}}, "a.env: not a setting of a streamable HTTP server"),
    ({"a": {"command": "x", "headers": {"K": "v"}}}, "a.headers: not a setting of a stdio server"),
    ({"a": {"url": "ftp://h"}}, "does not match"),
    ({"a": {"command": "x", "colour": 1}}, "'colour' was unexpected"),
    ({"a": {"command": "x", "cwd": "/no/such/dir"}}, "is not a directory"),
    ({"a": {"command": "x", "env": {"K": "os.environ/INTERLACE_TEST_UNSET_VAR"}}}, "INTERLACE_TEST_UNSET_VAR"),
    ({"a": {"command": "x", "timeout_s": 0}}, "timeout_s"),
])
def test_config_errors_name_the_server_and_key(servers, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")) as info:
        parse_config({"models": MODEL, "mcp_servers": servers}, "gw.yaml")
    assert "mcp_servers.a" in str(info.value)


def test_config_secrets_come_from_the_environment_and_stay_out_of_repr(monkeypatch):
    monkeypatch.setenv("INTERLACE_TEST_TOKEN", "s3cret")
    cfg = parse_config({"models": MODEL, "mcp_servers": {
        "web": {"url": "https://example.org/mcp", "headers": {"Authorization": "os.environ/INTERLACE_TEST_TOKEN"}},
        "local": {"command": "srv", "args": ["--x"], "env": {"TOKEN": "os.environ/INTERLACE_TEST_TOKEN"}}}})
    web, local = cfg.mcp_servers["web"], cfg.mcp_servers["local"]
    assert web.transport == "http" and web.headers == {"Authorization": "s3cret"} and web.timeout_s == 60.0
    assert local.transport == "stdio" and local.env == {"TOKEN": "s3cret"} and local.args == ("--x",)
    assert "s3cret" not in repr(web) + repr(local) + repr(cfg.mcp_servers)


def test_a_server_wildcard_grants_its_tools_only():
    assert may_use_tool(["t.*"], "t.echo") and may_use_tool(["t.*", "calculator"], "calculator")
    assert not may_use_tool(["t.*"], "tx.echo") and not may_use_tool(["t.*"], "t")
    assert not may_use_tool(["t.echo"], "t.fail") and not may_use_tool(False, "t.echo")


def test_interlace_plugins_lists_mcp_tools_and_server_state(tmp_path, capsys):
    from interlace.cli import main

    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({"models": MODEL, "mcp_servers": {
        "t": {"command": sys.executable, "args": [SERVER]},
        "gone": {"command": "/no/such/mcp-server", "startup_timeout_s": 2}}}))
    assert main(["plugins", "--config", str(cfg), "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    t, gone = plugins["mcp.t"], plugins["mcp.gone"]
    assert {"t.echo", "t.forecast"} <= {tool["name"] for tool in t["tools"]}
    assert t["status"]["state"] == "ready" and gone["status"]["state"] == "unavailable"
    assert "No such file" in gone["status"]["last_error"]
    assert main(["plugins", "--config", str(cfg)]) == 0
    text = capsys.readouterr().out
    assert "mcp.gone\n  stdio server, unavailable: cannot start '/no/such/mcp-server'" in text
    assert "  tool    t.forecast" in text


def test_tools_interlace_cannot_serve_are_skipped_not_fatal(caplog):
    from types import SimpleNamespace

    from interlace.gateway.mcp.client import McpServer

    def remote(name, schema):
        return SimpleNamespace(name=name, description="d", title=None, input_schema=schema)

    server = McpServer(stdio_spec("s"), McpHub({}))
    good = {"type": "object", "properties": {"q": {"type": "string"}}}
    server._set_tools([remote("ok", good), remote("has space", good), remote("x" * 70, good),
                       remote("badschema", {"type": "object", "properties": {"q": {"type": 12}}}),
                       remote("noschema", {})])
    assert set(server.tools) == {"s.ok", "s.noschema"}
    assert server.tools["s.noschema"].parameters == {"type": "object", "properties": {}}
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 3 and any("has space" in m for m in skipped)


# ------------------------------------------------------------------ the hub, over stdio


async def test_stdio_listing_calls_errors_and_environment(monkeypatch, caplog):
    monkeypatch.setenv("INTERLACE_GATEWAY_SECRET", "must-not-leak")
    async with McpHub({"t": stdio_spec(env={"MCP_TEST_MARKER": "hello"})}) as hub:
        tools = hub.tools()
        assert {"t.echo", "t.slow", "t.fail", "t.forecast", "t.die", "t.calls", "t.env"} <= set(tools)
        forecast = tools["t.forecast"]
        assert forecast.parameters["properties"]["days"]["maximum"] == 7
        assert forecast.parameters["required"] == ["city", "days"]
        assert await tools["t.echo"].call({"text": "hi"}, None) == "hi"
        assert json.loads(await forecast.call({"city": "Paris", "days": 2}, None))["forecast"] == ["sunny"] * 2
        seen = await tools["t.env"].call({}, None)
        seen = json.loads(seen) if isinstance(seen, str) else seen
        assert seen["marker"] == "hello"  # the configured env reaches the server ...
        assert "INTERLACE_GATEWAY_SECRET" not in seen["names"]  # ... the gateway's own does not
        with pytest.raises(ToolError, match="boom") as info:
            await tools["t.fail"].call({"message": "boom"}, None)
        assert info.value.error_type == "McpToolError"
        caplog.set_level("INFO", logger="interlace.gateway.mcp.client.t")
        assert await tools["t.shout"].call({"text": "hello from the server"}, None) == "said"
        await _until(lambda: any(r.name == "interlace.gateway.mcp.client.t" and r.getMessage() == "hello from the server"
                                 for r in caplog.records), 5)  # its stderr, in the gateway's log


async def test_death_mid_call_marks_unavailable_then_restarts():
    async with McpHub({"t": stdio_spec()}) as hub:
        tools, server = hub.tools(), hub.servers["t"]
        await tools["t.echo"].call({"text": "x"}, None)
        assert await tools["t.calls"].call({}, None) == "1"
        first_pid = _server_pid(server)
        t0 = time.monotonic()
        with pytest.raises(ToolCrashed, match="closed the connection"):
            await tools["t.die"].call({}, None)
        assert time.monotonic() - t0 < 5  # the call ended with the server, it did not wait for a timeout
        assert tools["t.echo"].info()["available"] is False
        with pytest.raises(ToolUnavailable, match="unavailable"):  # fails fast while it restarts
            await tools["t.echo"].call({"text": "x"}, None)
        await _until(lambda: server.state == "ready", 20)
        assert server.restarts == 1 and tools["t.echo"].unavailable() is None
        assert await tools["t.calls"].call({}, None) == "0"  # a fresh process
        assert _server_pid(server) != first_pid


async def test_a_server_that_stops_answering_is_found_by_the_probe_and_replaced(monkeypatch):
    from interlace.gateway.mcp import client as mcp_client

    monkeypatch.setattr(mcp_client, "PROBE_INTERVAL_S", 0.3)
    monkeypatch.setattr(mcp_client, "PROBE_TIMEOUT_S", 0.5)
    async with McpHub({"t": stdio_spec()}) as hub:
        server = hub.servers["t"]
        hung = psutil.Process(_server_pid(server))
        hung.suspend()  # alive, but answers nothing
        try:
            await _until(lambda: server.state != "ready", 10)
            assert "liveness probe" in server.last_error
            await _until(lambda: server.state == "ready", 30)
            assert _server_pid(server) != hung.pid
            assert await hub.tools()["t.echo"].call({"text": "new"}, None) == "new"
            assert not wait_gone({hung.pid}), "the hung server was not stopped"
        finally:
            if hung.is_running():
                hung.kill()


async def test_a_server_that_does_not_start_is_retried_with_backoff_and_leaves_nothing():
    before = children()
    spec = McpServerSpec("dead", command=sys.executable, args=("-c", "import time; time.sleep(60)"),
                         startup_timeout_s=0.5)
    missing = McpServerSpec("missing", command="/no/such/mcp-server")
    t0 = time.monotonic()
    hub = McpHub({"dead": spec, "missing": missing})
    await hub.start()
    assert time.monotonic() - t0 < 5  # start-up waits for one attempt each, not forever
    dead, gone = hub.servers["dead"], hub.servers["missing"]
    assert dead.state == "unavailable" and "within 0.5s" in dead.last_error
    assert gone.state == "unavailable" and "/no/such/mcp-server" in gone.last_error
    assert "restarting in" in (gone.unavailable() or "")
    await _until(lambda: gone.restarts >= 2, 10)  # 0.5 s, then 1 s
    await hub.close()
    assert not wait_gone(children() - before), "a server that never answered was left running"


async def test_through_the_runtime_early_abort_timeout_and_policy():
    vetoed = []

    def policy(name, arguments, request):
        if arguments.get("text") == "forbidden":
            vetoed.append(name)
            return "not that text"
        return None

    async with McpHub({"t": stdio_spec(timeout_s=0.5)}) as hub:
        runtime = ToolRuntime(hub.tools(), policy=policy)
        await runtime.start()
        try:
            assert not runtime.worker_pids()  # MCP tools run in the event loop: no worker processes
            call = await runtime.begin("t.forecast", "c1")
            await call.field("city", "Paris")
            with pytest.raises(InvalidToolArguments, match="days"):  # the server's schema, checked here
                await call.field("days", 9)
            result = await call.finish()
            assert not result.ok and result.field == "days"
            assert await hub.tools()["t.calls"].call({}, None) == "0"  # nothing reached the server

            result = await runtime.run("t.slow", {"seconds": 5})
            assert not result.ok and result.error_type == "ToolTimeout"
            assert result.finished_at - result.finish_called_at < 3
            assert (await runtime.run("t.echo", {"text": "still there"})).content == "still there"

            result = await runtime.run("t.echo", {"text": "forbidden"})
            assert not result.ok and result.error_type == "ToolVetoed" and vetoed == ["t.echo"]
            result = await runtime.run("t.forecast", {"city": "Paris", "days": 1})
            assert result.ok and json.loads(result.to_text())["days"] == 1
        finally:
            await runtime.close()


async def test_a_restart_with_other_tools_replaces_them(tmp_path):
    """The server's tool list is read again on reconnect; the hub reports the change."""
    flag = tmp_path / "extra"
    script = tmp_path / "srv.py"
    script.write_text(
        "import os, sys\n"
        "from mcp.server.mcpserver import MCPServer\n"
        "s = MCPServer('v', log_level='WARNING')\n"
        "@s.tool()\n"
        "def one() -> str:\n    return '1'\n"
        f"if os.path.exists({str(flag)!r}):\n"
        "    @s.tool()\n"
        "    def two() -> str:\n        return '2'\n"
        "@s.tool()\n"
        "def quit() -> str:\n    os._exit(0)\n"
        "s.run('stdio')\n")
    changes = []
    async with McpHub({"v": McpServerSpec("v", command=sys.executable, args=(str(script),))}) as hub:
        hub.on_change = lambda server, tools, removed: changes.append(([t.name for t in tools], removed))
        assert set(hub.tools()) == {"v.one", "v.quit"}
        flag.write_text("")
        with pytest.raises(ToolCrashed):
            await hub.tools()["v.quit"].call({}, None)
        await _until(lambda: hub.servers["v"].state == "ready", 20)
        assert set(hub.tools()) == {"v.one", "v.two", "v.quit"}
        assert changes == [(["v.one", "v.two", "v.quit"], ["v.one", "v.quit"])]
        assert await hub.tools()["v.two"].call({}, None) == "2"


# ------------------------------------------------------------------ streamable HTTP


@pytest.fixture
def http_server():
    port = free_port()
    procs = []

    def start():
        proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        procs.append(proc)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
                return proc
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("the HTTP MCP test server did not start")

    start.url = f"http://127.0.0.1:{port}/mcp"
    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


async def test_http_server_listing_calls_and_restart(http_server):
    proc = await asyncio.to_thread(http_server)
    spec = McpServerSpec("h", url=http_server.url, headers={"X-Test": "1"}, timeout_s=5)
    async with McpHub({"h": spec}) as hub:
        tools = hub.tools()
        assert hub.servers["h"].state == "ready" and "h.forecast" in tools
        assert await tools["h.echo"].call({"text": "over http"}, None) == "over http"
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises((ToolCrashed, ToolUnavailable, ToolError)):
            await tools["h.slow"].call({"seconds": 0.1}, None)
        assert time.monotonic() - t0 < 10  # an error, not a hang
        await _until(lambda: hub.servers["h"].state == "unavailable", 15)
        await asyncio.to_thread(http_server)  # the server is back on the same port
        await _until(lambda: hub.servers["h"].state == "ready", 40)
        assert await hub.tools()["h.echo"].call({"text": "again"}, None) == "again"


# ------------------------------------------------------------------ through the gateway


KEY, LIMITED = "mcp-key", "calc-key"
FORECAST = '<tool_call>\n{"name": "t.forecast", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def live():
    before = children()
    cfg = {"server": {"api_keys": [{"key": KEY, "name": "agent", "server_tools": ["t.*"], "replay": True},
                                   {"key": LIMITED, "name": "calc", "server_tools": ["calculator"], "replay": True}]},
           "models": MODEL,
           "mcp_servers": {"t": {"command": sys.executable, "args": [SERVER], "timeout_s": 10},
                           "gone": {"command": "/no/such/mcp-server"}}}
    with LiveGateway(cfg) as gw:
        yield gw
    left = wait_gone(children() - before)
    assert not left, f"processes left after shutdown: {[psutil.Process(p).cmdline() for p in left]}"


def ask(live, replay, key=KEY, **ext):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=60)
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "weather?"}], max_tokens=200,
        extra_body={"interlace": {"server_tools": True, "replay": replay, **ext}})


def test_gateway_lists_mcp_tools_and_server_state(live):
    plugins = httpx.get(live.url + "/v1/plugins", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    by_name = {p["name"]: p for p in plugins}
    t, gone = by_name["mcp.t"], by_name["mcp.gone"]
    assert t["status"]["state"] == "ready" and t["status"]["transport"] == "stdio"
    assert {"t.echo", "t.forecast", "t.slow"} <= {tool["name"] for tool in t["tools"]}
    assert gone["status"]["state"] == "unavailable" and gone["tools"] == []
    assert "/no/such" not in json.dumps(t)  # the command line is not shown to clients
    assert "calculator" in {tool["name"] for p in plugins for tool in p["tools"]}


def test_gateway_runs_an_mcp_tool_in_its_loop(live):
    r = ask(live, [FORECAST, "Sunny for two days."])
    assert r.choices[0].message.content == "Sunny for two days."
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["name"] == "t.forecast" and res["ok"], res
    assert json.loads(res["content"])["forecast"] == ["sunny", "sunny"]


def test_gateway_aborts_decoding_on_a_schema_violation(live):
    tail = ", ".join(f'"p{i}": {i}' for i in range(40))
    call = '<tool_call>\n{"name": "t.forecast", "arguments": {"city": "Paris", "days": 9, ' + tail + '}}\n</tool_call>'
    r = ask(live, [call, "Sorry."], max_tool_rounds=1)
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert not res["ok"] and res["aborted_early"] and "days" in res["error"]
    assert r.usage.completion_tokens < 60  # the long tail was never decoded


def test_gateway_learns_mcp_tool_durations(live):
    """The interception policy learns how long a call keeps its request paused: the
    tool's time left once the model has finished writing the call (partial execution
    starts it earlier), so a 5 s tool pauses the request for most of 5 s (less the
    few tokens decoded after the arguments closed)."""
    durations = live.gateway.models["m"].durations
    assert durations.estimate("t.slow") is None
    call = '<tool_call>\n{"name": "t.slow", "arguments": {"seconds": 5}}\n</tool_call>'
    r = ask(live, [call, "Done."])
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["ok"] and res["content"] == "slept 5s"
    estimate = durations.estimate("t.slow")
    assert estimate is not None and 1.0 <= estimate < 5.5, estimate


def test_gateway_permissions_apply_to_mcp_tools(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=LIMITED, max_retries=0, timeout=60)
    with pytest.raises(openai.PermissionDeniedError, match="t.echo"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       extra_body={"interlace": {"server_tools": ["t.echo"]}})
    # "every tool I may use" for the limited key does not include the MCP server's
    echo = '<tool_call>\n{"name": "t.echo", "arguments": {"text": "hi"}}\n</tool_call>'
    r = ask(live, [echo, "ok"], key=LIMITED)
    assert not any(c["name"] == "t.echo" and c["ok"] for c in r.model_extra["interlace"].get("tool_calls") or [])


def test_gateway_server_death_mid_call_is_an_error_result_then_it_comes_back(live):
    die = '<tool_call>\n{"name": "t.die", "arguments": {}}\n</tool_call>'
    t0 = time.monotonic()
    r = ask(live, [die, "It broke."])
    assert time.monotonic() - t0 < 30
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert not res["ok"] and "closed the connection" in res["error"]
    assert r.choices[0].message.content == "It broke."
    server = live.gateway.mcp.servers["t"]
    deadline = time.time() + 20
    while server.state != "ready" and time.time() < deadline:
        time.sleep(0.1)
    echo = '<tool_call>\n{"name": "t.echo", "arguments": {"text": "back"}}\n</tool_call>'
    (res,) = ask(live, [echo, "ok"]).model_extra["interlace"]["tool_calls"]
    assert res["ok"] and res["content"] == "back"


def test_gateway_client_gone_mid_call_frees_the_request(live):
    """A streaming client that disconnects while an MCP call runs: the call is
    cancelled on the server too, the engine context freed, and the next request
    is served at once."""
    from helpers.gateway_server import wait_idle

    slow = '<tool_call>\n{"name": "t.slow", "arguments": {"seconds": 30}}\n</tool_call>'
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "stream": True,
            "interlace": {"server_tools": ["t.slow"], "replay": [slow, "done"]}}
    server = live.gateway.mcp.servers["t"]
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", live.port)) as sock:  # a client that never reads
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.time() + 120
        while server.in_flight == 0:  # the arguments are complete and the server has the call
            assert time.time() < deadline, "the call never reached the server"
            time.sleep(0.02)
    # hung up while the tool sleeps
    t0 = time.monotonic()
    state = wait_idle(live, timeout=20, model="m")
    assert state["contexts"] == 0, state
    assert time.monotonic() - t0 < 20 and server.in_flight == 0
    echo = '<tool_call>\n{"name": "t.echo", "arguments": {"text": "next"}}\n</tool_call>'
    (res,) = ask(live, [echo, "ok"]).model_extra["interlace"]["tool_calls"]
    assert res["ok"] and res["content"] == "next"
    count = '<tool_call>\n{"name": "t.cancelled", "arguments": {}}\n</tool_call>'
    (res,) = ask(live, [count, "ok"]).model_extra["interlace"]["tool_calls"]
    assert res["ok"] and res["content"] == "1"  # the MCP server saw its call cancelled


# ------------------------------------------------------------------ helpers


async def _until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def _server_pid(server) -> int:
    """The pid of the stdio server process (a child of this one running the test server)."""
    for p in psutil.Process().children(recursive=True):
        try:
            if SERVER in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError("no server process")
