"""A real gateway on loopback (uvicorn in a thread), for API tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from interlace.gateway.app import create_app
from interlace.gateway.config import parse_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveGateway:
    def __init__(self, config: dict):
        self.config = parse_config(config, "<test>")
        self.app = create_app(self.config)
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
