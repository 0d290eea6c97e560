"""A machine that cannot build the python tool's sandbox: the gateway still starts while no caller may use it.

The shipped configuration registers the python tool with ``server_tools``
off: nobody may run it.  On a laptop without bubblewrap (or, as root,
without a writable cgroup) the gateway must still start, leave the tool out
and say why; as soon as any caller may use it (``server_tools``, an API
key's grant, ``interlace mcp serve``), start-up fails as before, naming what
is missing.  The machine is made one without bubblewrap for real: ``PATH``
holds no ``bwrap`` (nor ``setpriv``), so the sandbox's own probe finds none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.gateway_server import LiveGateway

from interlace.gateway.app import Gateway
from interlace.gateway.config import parse_config
from interlace.gateway.mcp.server import McpServeError, load_tools, start_runtime
from interlace.gateway.tools.sandbox import SandboxUnavailable

PYTHON = {"warm_imports": [], "workers": 1}
MODEL = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}
KEY = "sk-test-0123456789abcdef"


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A PATH without bubblewrap: the sandbox cannot be built here."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return empty


def python_entry(plugins: list[dict[str, Any]]) -> dict[str, Any]:
    return next(t for p in plugins for t in p["tools"] if t["name"] == "python")


def test_gateway_starts_without_the_sandbox_while_no_caller_may_use_python(no_bwrap: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    cfg = {"models": {"m": MODEL}, "tools": {"python": PYTHON}}  # server_tools: false, no keys (the default)
    with LiveGateway(cfg) as live:
        runtime = live.gateway.runtime
        assert "python" not in runtime.tools and "python" in runtime.left_out
        assert "calculator" in runtime.tools  # the other tools are served
        plugins = httpx.get(f"{live.url}/v1/plugins").json()["data"]
        entry = python_entry(plugins)
        assert entry["available"] is False and "bubblewrap" in entry["unavailable_because"]
        assert "apt-get install bubblewrap" in entry["unavailable_because"]
        assert entry["info"]["sandbox"] == "unavailable"
        assert entry["info"]["unavailable_because"] == entry["unavailable_because"]
        # a request naming it gets what any tool that is not served gets
        r = httpx.post(f"{live.url}/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "interlace": {"server_tools": ["python"]}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "unknown_tool" and err["param"] == "interlace.server_tools"
        unknown = httpx.post(f"{live.url}/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "interlace": {"server_tools": ["no_such_tool"]}})
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_tool"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "'python'" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "NOT available" in warnings[0] and "bubblewrap" in warnings[0] and "apt-get install" in warnings[0]


def test_interlace_plugins_shows_python_unavailable(no_bwrap: Path, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"models": {"m": MODEL}, "tools": {"python": PYTHON}}))
    out = subprocess.run([sys.executable, "-m", "interlace.cli", "plugins", "--config", str(config), "--json"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ), check=False)
    assert out.returncode == 0, out.stderr
    entry = python_entry(json.loads(out.stdout))
    assert entry["available"] is False and "bubblewrap" in entry["unavailable_because"]
    text = subprocess.run([sys.executable, "-m", "interlace.cli", "plugins", "--config", str(config)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ), check=False).stdout
    assert "sandbox: unavailable" in text and "bubblewrap (`bwrap`) is not installed" in text


class _EngineNotUsed:
    """Stands in for the model's engine: these start-ups fail at the tool runtime, after the engines
    load, before any request; loading the real one costs ~20 s a case and is not what is tested."""

    def close(self) -> None:
        pass


@pytest.mark.parametrize("server", [
    {"server_tools": ["python"]},
    {"server_tools": True},
    {"api_keys": [{"key": KEY, "name": "alice", "server_tools": ["calculator"]},
                  {"key": KEY + "x", "name": "bob", "server_tools": ["python"]}]},
], ids=["server_tools-list", "server_tools-true", "one-api-key"])
def test_start_fails_when_some_caller_may_use_python(no_bwrap: Path, server: dict[str, Any]) -> None:
    cfg = parse_config({"server": server, "models": {"m": MODEL}, "tools": {"python": PYTHON}}, "<test>")
    gateway = Gateway(cfg, engine_factory=lambda spec: _EngineNotUsed())
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap \(`bwrap`\) is not installed.*apt-get install"):
        asyncio.run(gateway.start(None))
    assert gateway.runtime is None  # stopped again


def test_mcp_serve_of_python_fails_without_the_sandbox(no_bwrap: Path) -> None:
    cfg = parse_config({"models": {"m": MODEL}, "tools": {"python": PYTHON}}, "<test>")
    host, tools = load_tools(cfg, ["python"])
    with pytest.raises(McpServeError, match="bubblewrap"):
        asyncio.run(start_runtime(host, tools))
