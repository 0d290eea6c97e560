"""A real gateway on loopback (uvicorn in a thread), for API tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import httpx
import uvicorn

from interlace.gateway.app import create_app
from interlace.gateway.config import GatewayConfig, parse_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveGateway:
    """``config``: a config dict (as the YAML file would hold) or a loaded :class:`GatewayConfig`.
    ``engine_factory`` and ``plugins`` go to :func:`create_app`."""

    def __init__(self, config: Union[dict, GatewayConfig], engine_factory: Optional[Callable[[Any], Any]] = None,
                 plugins: Iterable[object] = ()):
        self.config = config if isinstance(config, GatewayConfig) else parse_config(config, "<test>")
        self.app = create_app(self.config, engine_factory, plugins)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def gateway(self):
        return self.app.state.gateway

    def __enter__(self) -> "LiveGateway":
        self.thread.start()
        deadline = time.time() + 300
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def engine_state(live: LiveGateway, model: str = "smollm2") -> dict:
    """The served model's engine invariants (contexts, used blocks, ...), checked now.
    Contexts kept on purpose for the follow-ups of client-side tool calls are
    freed first (their own tests, test_retention.py, count them)."""
    for m in live.gateway.models.values():
        if m.retention is not None:
            m.retention.clear()
    return asyncio.run(live.gateway.models[model].engine.check_invariants())


def wait_idle(live: LiveGateway, timeout: float = 10.0, model: str = "smollm2") -> dict:
    """:func:`engine_state` once no context is left, or at ``timeout`` (the caller asserts)."""
    deadline = time.time() + timeout
    while True:
        st = engine_state(live, model)
        if st["contexts"] == 0 or time.time() > deadline:
            return st
        time.sleep(0.05)


@contextlib.contextmanager
def serve_subprocess(config: dict, root: Path) -> Iterator[str]:
    """``interlace serve`` with ``config`` (written to ``root``) in a subprocess, as a user
    starts it; yields its root URL once ``/health`` answers.  Terminated (then killed) at the
    end, whatever happened; a server that dies or never answers raises with its log."""
    cfg = root / "config.yaml"
    cfg.write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "interlace.cli", "serve", "--config", str(cfg),
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"interlace serve exited with {proc.returncode}:\n"
                                       + log_path.read_text()[-3000:])
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError("interlace serve did not answer /health:\n" + log_path.read_text()[-3000:])
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
