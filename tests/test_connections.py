"""Connections (gateway/connections.py, gateway/server.py, gateway/log_limit.py), against
``interlace serve`` in a subprocess over real sockets: slow heads and bodies are closed after
their timeout with a 408, the connection cap keeps descriptors bounded while a prompt client
is still served, protocol errors are 400 in the API's error shape, and the log lines a client
causes are rate-limited."""

from __future__ import annotations

import logging
import os
import socket
import time

import httpx
import pytest

from helpers.serve_process import json_body, read_until_closed, serve
from interlace.gateway.config import ConfigError, parse_config
from interlace.gateway.log_limit import RateLimitFilter

MAX_CONNECTIONS = 40
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 3
SLOW = 250  # slow connections: far more than the cap


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve({"connections": {"max_connections": MAX_CONNECTIONS, "header_timeout_s": HEADER_TIMEOUT_S,
                                "body_timeout_s": BODY_TIMEOUT_S}},
               tmp_path_factory.mktemp("connections")) as served:
        yield served


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (what it sent before, a 408, is read and dropped)."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True
    finally:
        sock.setblocking(True)


def test_a_slow_request_head_gets_408_and_is_closed(server):
    socks = [server.connect() for _ in range(3)]
    t0 = time.monotonic()
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")  # and nothing more
    for s in socks:
        response = read_until_closed(s)  # socket.timeout (60 s) if the server keeps it open
        assert response.startswith(b"HTTP/1.1 408 "), response
        assert json_body(response)["error"]["code"] == "request_timeout"
        s.close()
    assert time.monotonic() - t0 >= HEADER_TIMEOUT_S * 0.9


def test_a_silent_connection_is_closed_after_the_header_timeout(server):
    s = server.connect()
    assert read_until_closed(s) == b""  # closed without an answer: it asked nothing
    s.close()


def test_a_slow_request_body_gets_408_and_is_closed(server):
    s = server.connect()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\": ")  # the rest of the body never comes
    response = read_until_closed(s)
    assert response.startswith(b"HTTP/1.1 408 "), response
    assert json_body(response)["error"]["code"] == "request_timeout"
    s.close()


def test_the_cap_bounds_descriptors_and_a_prompt_client_is_still_served(server):
    pid = server.proc.pid
    before = open_fds(pid)
    slow = []
    try:
        for _ in range(SLOW):
            s = server.connect()
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # a head that never ends
            slow.append(s)
        r = httpx.get(server.url + "/health", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        # the gateway holds at most the cap, whatever the clients keep open: the rest were closed at once
        assert open_fds(pid) <= before + MAX_CONNECTIONS + 5
        deadline = time.monotonic() + 10
        while sum(closed_by_peer(s) for s in slow) < SLOW - MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(closed_by_peer(s) for s in slow) >= SLOW - MAX_CONNECTIONS
        # and the survivors go at the header timeout
        deadline = time.monotonic() + 60
        while not all(closed_by_peer(s) for s in slow) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(closed_by_peer(s) for s in slow)
    finally:
        for s in slow:
            s.close()


BAD_REQUESTS = {
    "bad Content-Length": b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                          b"\r\nContent-Length: abc\r\n\r\n{}",
    "two Content-Lengths": b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n"
                           b"Content-Length: 3\r\n\r\n{}",
    "bad chunk size": b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "NUL in a header": b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Note: a\x00b\r\n\r\n",
    "bad request line": b"GET /health HTTP/1.1 extra\r\nHost: localhost\r\n\r\n",
}


@pytest.mark.parametrize("raw", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_protocol_errors_are_400_in_the_api_error_shape(server, raw):
    s = server.connect()
    s.sendall(raw)
    response = read_until_closed(s)
    s.close()
    head = response.partition(b"\r\n\r\n")[0].lower()
    assert response.startswith(b"HTTP/1.1 400 "), response
    assert b"content-type: application/json" in head
    assert json_body(response) == {"error": {
        "message": json_body(response)["error"]["message"], "type": "invalid_request_error", "param": None,
        "code": "bad_http_request"}}


def test_log_lines_a_client_causes_are_rate_limited(server):
    marker = "Invalid HTTP request received."
    before = server.log().count(marker)
    for _ in range(60):
        s = server.connect()
        s.sendall(BAD_REQUESTS["NUL in a header"])
        read_until_closed(s)
        s.close()
    time.sleep(0.5)  # the server's log is written by another process
    assert server.log().count(marker) - before < 30  # 60 without the limit (10 per 10 s with it)


def test_the_rate_limit_filter_passes_a_burst_then_reports_what_it_dropped():
    now = [0.0]
    flt = RateLimitFilter(burst=3, interval_s=10, clock=lambda: now[0])

    def record(msg="accept failed: %s"):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, ("EMFILE",), None)

    assert [flt.filter(record()) for _ in range(100)] == [True] * 3 + [False] * 97
    assert flt.filter(record("another kind"))  # kinds are limited apart
    now[0] = 10.5
    summary = record()
    assert flt.filter(summary)
    assert "97 log lines dropped" in summary.getMessage()


def test_connection_settings_are_validated():
    cfg = parse_config({"server": {"connections": {"max_connections": 8, "header_timeout_s": 1}, "drain_s": 4},
                        "models": {"m": {"path": "embedded"}}})
    assert cfg.connections.max_connections == 8 and cfg.connections.header_timeout_s == 1.0
    assert cfg.connections.body_timeout_s == 60.0 and cfg.drain_s == 4.0
    with pytest.raises(ConfigError, match="server.connections.header_timeout_s"):
        parse_config({"server": {"connections": {"header_timeout_s": 0}}, "models": {"m": {"path": "embedded"}}})
    with pytest.raises(ConfigError, match="server.connections"):
        parse_config({"server": {"connections": {"max": 8}}, "models": {"m": {"path": "embedded"}}})
