"""``interlace serve`` in a subprocess, with its process at hand (signals, descriptors, children):
for the tests of connections and the SIGTERM drain.  helpers.gateway_server.serve_subprocess
yields only the URL and always terminates the server itself."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import httpx

from helpers.gateway_server import free_port

#: The embedded SmolLM2 (the test model of the gateway tests), small and quick to load.
MODEL = {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32"}


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def connect(self, timeout: float = 60.0) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        s.settimeout(timeout)
        return s


@contextlib.contextmanager
def serve(server: dict, root: Path, models: Optional[dict] = None) -> Iterator[Served]:
    """``interlace serve`` with ``server`` as its ``server:`` section; yields once ``/health``
    answers.  Killed at the end if it is still running (a test that stops it waits itself)."""
    cfg = root / "config.yaml"
    cfg.write_text(json.dumps({"server": server, "models": models or {"smollm2": MODEL}}))  # JSON is YAML
    port = free_port()
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "interlace.cli", "serve", "--config", str(cfg),
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    served = Served(proc, port, log_path)
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"interlace serve exited with {proc.returncode}:\n{served.log()[-3000:]}")
            try:
                if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise RuntimeError("interlace serve did not answer /health:\n" + served.log()[-3000:])
            time.sleep(0.2)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (``socket.timeout`` if it never does)."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def json_body(response: bytes) -> dict:
    """The JSON body of one raw HTTP response (Content-Length framed)."""
    return json.loads(response.partition(b"\r\n\r\n")[2])
