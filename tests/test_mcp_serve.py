"""``interlace mcp serve``: Interlace's tools as an MCP server (gateway/mcp/server.py, docs/mcp.md).

Each test starts the real command as a subprocess and talks to it with the
official MCP SDK's client (stdio, and Streamable HTTP in both of the SDK's
connection modes: the ``initialize`` handshake and the 2026 per-request one),
or with plain httpx where the HTTP layer itself is checked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import httpx2
import psutil
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from interlace.plugins.calculator import CalculatorTool

SERVE = [sys.executable, "-m", "interlace.cli", "mcp", "serve"]
LIMITED, FULL = "limited-secret-1", "full-secret-2"

#: A plugin for these tests, written next to each test's config: a tool in a
#: reusable worker that writes to fd 1 (it must not reach the MCP wire), and a
#: policy that vetoes one word and says which request it saw.
PLUGIN = textwrap.dedent('''
    import os
    from interlace import Tool, Veto, hookimpl

    class Loud(Tool):
        name = "loud"
        description = "Upper-cases a word (and writes junk to its stdout)."
        parameters = {"type": "object", "properties": {"word": {"type": "string"}},
                      "required": ["word"], "additionalProperties": False}

        def on_finish(self, arguments):
            os.write(1, b"LOUD-ON-STDOUT\\n")
            return arguments["word"].upper()

    @hookimpl
    def register_tools(register):
        register(Loud())

    @hookimpl
    def before_tool_execution(tool_name, arguments, request):
        if arguments.get("word") == "forbidden":
            return Veto(f"vetoed: key={request['key']!r} via={request['via']!r} model={request['model']!r}")
''')


BROKEN = textwrap.dedent('''
    from interlace import Tool, hookimpl

    class Broken(Tool):
        name = "broken"
        settings_schema = {"type": "object", "properties": {"stage": {"enum": ["setup", "worker_init"]}},
                           "additionalProperties": False}

        def configure(self, settings):
            self.stage = settings.get("stage", "setup")

        def setup(self):
            if self.stage == "setup":
                raise RuntimeError("broken in setup")

        def worker_init(self):
            raise ValueError("broken in worker_init")

        def on_finish(self, arguments):
            return None

    @hookimpl
    def register_tools(register):
        register(Broken())
''')


def write_config(tmp_path: Path, server: dict) -> Path:
    (tmp_path / "mcp_test_plugin.py").write_text(PLUGIN)
    cfg = {"server": server, "models": {"smollm2": {"path": "embedded"}},
           "plugins": {"modules": ["mcp_test_plugin"]}}
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def env_with(tmp_path: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}


def text(result) -> str:
    assert len(result.content) == 1 and result.content[0].type == "text", result
    return result.content[0].text


def server_process(marker: str) -> psutil.Process:
    """Our child running ``mcp serve`` (``marker`` is in its command line)."""
    found = []
    for p in psutil.Process().children():
        try:
            if marker in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue  # another child exiting at this moment (not yet reaped): not the live server
    assert len(found) == 1, found
    return found[0]


def assert_all_gone(procs: list, timeout: float = 10.0) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def scratch_dirs(workers: list) -> list[str]:
    """The workers' private scratch directories (their working directories), removed by a clean close.

    bubblewrap's own processes (a sandboxed tool's, gateway/tools/sandbox.py) sit at the sandbox's ``/``
    whatever the worker's directory: the worker itself is the python process under them.
    """
    dirs = [w.cwd() for w in workers if w.name() != "bwrap"]
    assert dirs and all(Path(d).is_dir() and "interlace-" in d for d in dirs), dirs
    return dirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# =========================================================================== stdio
async def test_stdio_lists_and_calls_every_tool_and_exits_with_the_client(tmp_path):
    config = write_config(tmp_path, {})  # no keys, no server_tools: stdio serves every tool anyway
    params = StdioServerParameters(command=SERVE[0], args=[*SERVE[1:], "--config", str(config)],
                                   env=env_with(tmp_path), cwd=str(tmp_path))
    errlog = (tmp_path / "stderr.txt").open("w")
    async with Client(stdio_client(params, errlog=errlog)) as client:
        server = server_process(str(config))
        workers = server.children(recursive=True)
        assert workers, "the tool runtime starts its workers before serving"
        scratch = scratch_dirs(workers)

        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert {"python", "calculator", "format", "loud"} <= set(tools), sorted(tools)
        assert tools["calculator"].input_schema == CalculatorTool.parameters
        assert tools["calculator"].description == CalculatorTool.description

        r = await client.call_tool("calculator", {"expression": "6*7"})
        assert not r.is_error, r
        assert r.structured_content == {"expression": "6*7", "result": 42}
        assert json.loads(text(r)) == {"expression": "6*7", "result": 42}

        r = await client.call_tool("calculator", {"expression": 7})  # the schema wants a string
        assert r.is_error
        assert text(r).startswith("InvalidToolArguments: invalid argument 'expression'"), text(r)
        r = await client.call_tool("calculator", {})
        assert r.is_error and "'expression' is a required property" in text(r), text(r)

        r = await client.call_tool("no_such_tool", {"x": 1})
        assert r.is_error and text(r) == "UnknownTool: unknown tool 'no_such_tool'"

        r = await client.call_tool("loud", {"word": "hey"})  # writes to its fd 1: must miss the wire
        assert not r.is_error and text(r) == "HEY" and r.structured_content is None, r
        r = await client.call_tool("loud", {"word": "forbidden"})
        assert r.is_error and text(r) == "ToolVetoed: vetoed: key=None via='mcp' model=None", text(r)

        r = await client.call_tool("calculator", {"expression": "2**10"})  # the session survived all that
        assert json.loads(text(r))["result"] == 1024
    errlog.close()
    assert_all_gone([server, *workers])
    assert server.pid not in {p.pid for p in psutil.Process().children()}
    assert not [d for d in scratch if Path(d).exists()], "the runtime was not closed"
    log = (tmp_path / "stderr.txt").read_text()
    assert "LOUD-ON-STDOUT" in log  # diverted to stderr, not the wire
    assert "stopping (signal)" not in log, log  # it ended with its stdin, before the client's SIGTERM


async def test_stdio_tools_option_narrows_what_is_served(tmp_path):
    params = StdioServerParameters(command=SERVE[0], args=[*SERVE[1:], "--tools", "calculator"])
    async with Client(params, mode="legacy") as client:
        assert [t.name for t in (await client.list_tools()).tools] == ["calculator"]
        r = await client.call_tool("python", {"code": "1"})
        assert r.is_error and text(r) == "UnknownTool: unknown tool 'python'"


# =========================================================================== errors at start-up
def run_serve(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interlace: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("config", [None, "configs/default.yaml"])
def test_http_with_the_default_config_refuses_to_start(config):
    root = Path(__file__).resolve().parent.parent
    args = ["--transport", "http", "--port", str(free_port())] + (["--config", config] if config else [])
    assert_one_line_error(run_serve(*args, cwd=root), "configure server.api_keys with server_tools")


def test_start_up_errors_are_one_line(tmp_path):
    assert_one_line_error(run_serve("--tools", "calculator,nope"), "unknown tool 'nope'", "calculator, format")
    assert_one_line_error(run_serve("--tools", "sqlite"), "'sqlite' is not enabled")
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"models": {"m": {"path": "embedded"}}, "plugins": {"modules": ["no_such_mod_x"]}}))
    assert_one_line_error(run_serve("--config", str(bad)), "cannot import a plugin module", "no_such_mod_x")
    bad.write_text(json.dumps({"models": {"m": {"path": "embedded"}}, "tools": {"calculator": {"colour": 1}}}))
    assert_one_line_error(run_serve("--config", str(bad)), "unknown setting 'colour'")



@pytest.mark.parametrize("stage", ["setup", "worker_init"])
def test_a_tool_that_cannot_start_is_one_line(tmp_path, stage):
    (tmp_path / "mcp_broken_plugin.py").write_text(BROKEN)
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"models": {"m": {"path": "embedded"}}, "plugins": {"modules": ["mcp_broken_plugin"]},
                               "tools": {"broken": {"stage": stage}}}))
    proc = run_serve("--config", str(bad), "--tools", "broken,calculator", env=env_with(tmp_path))
    assert_one_line_error(proc, "the tools could not start", f"broken in {stage}")


# =========================================================================== HTTP
class HttpServer:
    """``interlace mcp serve --transport http`` in its own process group."""

    def __init__(self, tmp_path: Path, server: dict, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.stderr = (tmp_path / "server-stderr.txt").open("w+")
        config = write_config(tmp_path, server)
        self.proc = subprocess.Popen(
            [*SERVE, "--config", str(config), "--transport", "http", "--port", str(self.port), *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr, env=env_with(tmp_path),
            cwd=str(tmp_path), start_new_session=True)
        deadline = time.time() + 30
        while True:
            assert self.proc.poll() is None, f"mcp serve exited ({self.proc.returncode}): {self.log()}"
            assert time.time() < deadline, f"mcp serve did not listen: {self.log()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)

    def log(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()

    def client(self, key: str | None, mode: str = "auto") -> tuple[Client, httpx2.AsyncClient]:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
        return Client(streamable_http_client(self.url, http_client=http), mode=mode), http

    def stop(self) -> None:
        """SIGTERM to the process group: a clean shutdown that stops every worker."""
        if self.proc.poll() is None:
            server = psutil.Process(self.proc.pid)
            workers = server.children(recursive=True)
            scratch = scratch_dirs(workers)
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                assert self.proc.wait(timeout=20) == 0, self.log()
            finally:
                if self.proc.poll() is None:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            assert_all_gone(workers)
            assert not [d for d in scratch if Path(d).exists()], "the runtime was not closed"
        self.stderr.close()


async def call(server: HttpServer, key: str, mode: str, tool: str, arguments: dict):
    client, http = server.client(key, mode)
    async with http, client:
        return await client.call_tool(tool, arguments)


async def tool_names(server: HttpServer, key: str, mode: str) -> list[str]:
    client, http = server.client(key, mode)
    async with http, client:
        return [t.name for t in (await client.list_tools()).tools]


def mcp_post(server: HttpServer, body: dict, key: str | None = None, **headers) -> httpx.Response:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json", **headers}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.url, content=json.dumps(body), headers=headers, timeout=30)


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                         "clientInfo": {"name": "test", "version": "0"}}}
LIST = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}


@pytest.fixture
def keyed_server(tmp_path):
    server = HttpServer(tmp_path, {"max_request_bytes": 65536, "api_keys": [
        {"key": LIMITED, "name": "limited", "server_tools": ["calculator"]},
        {"key": FULL, "name": "full", "server_tools": True},
    ]})
    try:
        yield server
    finally:
        server.stop()


async def test_http_keys_decide_what_each_caller_sees_and_runs(keyed_server):
    server = keyed_server
    # no key, a wrong key: 401 in the gateway's JSON shape, before the MCP layer
    # no key, a wrong key: 401 in the gateway's JSON shape, before the MCP layer, with an RFC 6750
    # bearer challenge (without one the MCP Inspector assumes OAuth); no resource_metadata: no OAuth here
    for key in (None, "not-a-key", LIMITED + "x"):
        r = mcp_post(server, INITIALIZE, key)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        challenge = 'Bearer realm="interlace"' + (', error="invalid_token"' if key else "")
        assert r.headers["www-authenticate"] == challenge
    r = httpx.get(server.url, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == 'Bearer realm="interlace"'

    for mode in ("legacy", "auto"):  # the handshake era and the 2026 per-request era reach the handlers differently
        assert await tool_names(server, LIMITED, mode) == ["calculator"]
        assert {"calculator", "python", "format", "loud"} <= set(await tool_names(server, FULL, mode))

        r = await call(server, LIMITED, mode, "calculator", {"expression": "6*7"})
        assert not r.is_error and r.structured_content["result"] == 42, r
        for tool, args in (("python", {"code": "print(1)"}), ("loud", {"word": "x"})):
            r = await call(server, LIMITED, mode, tool, args)
            assert r.is_error, r
            assert text(r) == (f"PermissionDenied: the API key 'limited' may not use the tool {tool!r} "
                               "(allowed: calculator)")
        r = await call(server, LIMITED, mode, "no_such_tool", {})
        assert r.is_error and text(r) == "UnknownTool: unknown tool 'no_such_tool'"

        r = await call(server, FULL, mode, "calculator", {"expression": "2**10"})
        assert not r.is_error and json.loads(text(r))["result"] == 1024
        r = await call(server, FULL, mode, "python", {"code": "print(6*7)"})
        assert not r.is_error and r.structured_content["stdout"] == "42\n", r
        r = await call(server, FULL, mode, "loud", {"word": "forbidden"})  # the policy sees the key's name
        assert r.is_error and text(r) == "ToolVetoed: vetoed: key='full' via='mcp' model=None", text(r)
        r = await call(server, FULL, mode, "calculator", {"expression": [1]})
        assert r.is_error and text(r).startswith("InvalidToolArguments: "), text(r)


def test_http_sessions_belong_to_their_key_and_browser_requests_are_refused(keyed_server):
    server = keyed_server
    r = mcp_post(server, INITIALIZE, LIMITED)
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    headers = {"Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-06-18"}
    assert mcp_post(server, LIST, FULL, **headers).status_code == 404  # another key's session: not found
    r = mcp_post(server, LIST, LIMITED, **headers)
    assert r.status_code == 200 and '"calculator"' in r.text and '"python"' not in r.text, r.text

    r = mcp_post(server, INITIALIZE, FULL, Origin="http://evil.example")
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
    r = mcp_post(server, INITIALIZE, FULL, Origin=f"http://localhost:{server.port + 1}")  # even a local page
    assert r.status_code == 403, r.text
    r = mcp_post(server, INITIALIZE, FULL, Host="evil.example")  # DNS rebinding: the SDK's own check
    assert r.status_code == 421, r.text
    # DNS rebinding as the conformance suite sends it: same-origin under the attacker's name
    evil = f"evil.example:{server.port}"
    r = mcp_post(server, INITIALIZE, FULL, Host=evil, Origin=f"http://{evil}")
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
    for own in (f"127.0.0.1:{server.port}", f"localhost:{server.port}"):  # the server's own origin
        r = mcp_post(server, INITIALIZE, FULL, Host=own, Origin=f"http://{own}")
        assert r.status_code == 200 and r.headers["mcp-session-id"], r.text
    r = mcp_post(server, INITIALIZE, FULL, **{"Content-Type": "text/plain"})  # a form a page could post
    assert r.status_code == 400, r.text
    big = {**INITIALIZE, "params": {**INITIALIZE["params"], "pad": "x" * 70000}}
    assert mcp_post(server, big, FULL).status_code == 413  # server.max_request_bytes


async def test_http_without_keys_serves_the_server_level_tools_with_a_warning(tmp_path):
    server = HttpServer(tmp_path, {"server_tools": ["calculator"]})
    try:
        assert await tool_names(server, None, "legacy") == ["calculator"]
        # the conformance suite's DNS-rebinding check (servers without authentication): the own
        # origin is served, the attacker's name is refused
        own = f"127.0.0.1:{server.port}"
        r = mcp_post(server, INITIALIZE, Host=own, Origin=f"http://{own}")
        assert r.status_code == 200 and '"serverInfo"' in r.text, r.text
        evil = f"evil.example:{server.port}"
        assert mcp_post(server, INITIALIZE, Host=evil, Origin=f"http://{evil}").status_code == 403
        # a tool nobody may use is not served at all: no workers, unknown to every caller
        assert len(psutil.Process(server.proc.pid).children()) == CalculatorTool.workers
        r = await call(server, None, "auto", "format", {"template": "x"})
        assert r.is_error and text(r) == "UnknownTool: unknown tool 'format'", text(r)
        r = await call(server, None, "auto", "calculator", {"expression": "1+1"})
        assert not r.is_error and r.structured_content["result"] == 2
    finally:
        server.stop()
    log = (tmp_path / "server-stderr.txt").read_text()
    assert "SECURITY: server-side tools are enabled" in log, log
    assert f"127.0.0.1:{server.port}" in log
