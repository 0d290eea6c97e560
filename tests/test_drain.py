"""The graceful drain (gateway/drain.py, gateway/server.py): on SIGTERM the gateway stops
accepting, lets the requests in flight finish within ``server.drain_s``, ends the rest
properly -- 503 in the API's error shape, or an error event then ``[DONE]`` on a stream --
with their generations aborted, and exits 0 leaving no worker process behind.

The requests to be ended are long forced generations (``interlace.replay`` of 3,000 tokens of
the embedded model): many minutes of work on the 2-core development machine, never done before
the test ends them."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from typing import Dict, List

import httpx
import psutil
import pytest

from helpers.gateway_server import LiveGateway, wait_idle
from helpers.serve_process import MODEL, serve

LONG = "lorem ipsum dolor sit amet " * 700  # ~3,500 tokens
SHORT = 150  # tokens of a request that finishes within the grace: seconds to a few minutes on a loaded machine
SHUTTING_DOWN = {"message": "the server is shutting down; retry the request", "type": "server_error",
                 "param": None, "code": "shutting_down"}


def chat(max_tokens: int = 3000, text: str = LONG, **extra) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Say it."}], "max_tokens": max_tokens,
            "interlace": {"replay": text}, **extra}


def post_in_thread(url: str, body: dict, out: Dict[str, httpx.Response]) -> threading.Thread:
    def run() -> None:
        out["response"] = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def data_lines(lines) -> List[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def wait_gone(procs: List[psutil.Process], timeout: float = 30.0) -> List[psutil.Process]:
    """The processes of ``procs`` still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_sigterm_ends_what_outlasts_the_grace_properly_and_exits_0(tmp_path):
    with serve({"replay": True, "drain_s": 2}, tmp_path) as server:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert children  # the tool workers at least: they must go with it
        plain: Dict[str, httpx.Response] = {}
        thread = post_in_thread(server.url, chat(), plain)
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat(stream=True),
                          timeout=600) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = [next(lines) for _ in range(4)]  # generating: the other request is in the engine too
            time.sleep(1)
            server.proc.send_signal(signal.SIGTERM)
            seen += list(lines)
        thread.join(timeout=600)
        assert server.proc.wait(timeout=300) == 0, server.log()[-3000:]
        events = data_lines(seen)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]) == {"error": SHUTTING_DOWN}
        assert all("error" not in json.loads(e) for e in events[:-2])  # the content chunks before it
        response = plain["response"]
        assert response.status_code == 503 and response.json() == {"error": SHUTTING_DOWN}
        assert response.headers["retry-after"] == "1"
        assert wait_gone(children) == []


def test_sigterm_lets_a_request_finish_within_the_grace(tmp_path):
    with serve({"replay": True, "drain_s": 600}, tmp_path) as server:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat(SHORT, stream=True),
                          timeout=600) as r:
            lines = r.iter_lines()
            seen = [next(lines) for _ in range(4)]
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while True:  # no new connection is accepted while it drains
                try:
                    httpx.get(server.url + "/health", timeout=5)
                except httpx.ConnectError:
                    break
                assert time.monotonic() < deadline, "the gateway still accepts connections after SIGTERM"
                time.sleep(0.1)
            seen += list(lines)
        assert server.proc.wait(timeout=300) == 0, server.log()[-3000:]
        events = data_lines(seen)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all SHORT tokens
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert LONG.startswith(text) and len(text) > SHORT


@pytest.fixture(scope="module")
def live():
    with LiveGateway({"server": {"replay": True}, "models": {"smollm2": MODEL}}) as gw:
        yield gw


def test_the_drain_answers_503_while_draining_and_frees_the_engine(live):
    """In the process (no signal): while draining, /health says so and a new request gets 503;
    at the end of the grace the requests in flight are ended and their contexts freed."""
    loop = live.server.servers[0].get_loop()
    release = threading.Event()
    plain: Dict[str, httpx.Response] = {}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=chat(stream=True), timeout=600) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(4)]
        thread = post_in_thread(live.url, chat(), plain)
        deadline = time.monotonic() + 60
        while len(live.app.state.drain.flights) < 2:  # both in flight
            assert time.monotonic() < deadline
            time.sleep(0.05)
        drained = asyncio.run_coroutine_threadsafe(
            live.app.state.drain.drain(600, stop_waiting=release.is_set), loop)
        deadline = time.monotonic() + 60
        while (health := httpx.get(live.url + "/health", timeout=60)).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = httpx.post(live.url + "/v1/chat/completions", json=chat(4), timeout=60)
        assert refused.status_code == 503 and refused.json() == {"error": SHUTTING_DOWN}
        release.set()  # the grace is over
        seen += list(lines)
    thread.join(timeout=600)
    assert drained.result(timeout=60) == 2
    assert data_lines(seen)[-2:] == [json.dumps({"error": SHUTTING_DOWN}), "[DONE]"]
    assert plain["response"].status_code == 503 and plain["response"].json() == {"error": SHUTTING_DOWN}
    state = wait_idle(live, timeout=60)
    assert state["contexts"] == 0 and state["used_blocks"] == 0, state
