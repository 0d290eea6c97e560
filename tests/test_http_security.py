"""The HTTP surface's defences (docs/security.md, "The HTTP surface"): safe defaults,
per-key permissions, the caller's identity in the tool policy hook, JSON-only
bodies, browser origins, and a body size limit enforced while reading."""

from __future__ import annotations

import logging
import socket

import httpx
import pytest

from helpers.gateway_server import LiveGateway
from interlace import hookimpl
from interlace.gateway.app import create_app
from interlace.gateway.config import load_config, parse_config

USER = [{"role": "user", "content": "What is 6 times 7?"}]
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
MODEL = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}


def post(gw, body, key=None, **headers):
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def read_response(sock) -> bytes:
    """One HTTP response (head and Content-Length body) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
            data.lower().partition(b"content-length: ")[2].split(b"\r\n")[0] or 0):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def assert_error(r, status, code, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# ----------------------------------------------------------- default config
@pytest.fixture(scope="module")
def default_gw():
    """configs/default.yaml exactly as shipped (only the port is the test's own)."""
    with LiveGateway(load_config("configs/default.yaml")) as gw:
        yield gw


@pytest.mark.parametrize("ext,param", [
    ({"server_tools": True}, "interlace.server_tools"),
    ({"server_tools": ["python"]}, "interlace.server_tools"),
    ({"replay": "anything"}, "interlace.replay"),
])
def test_default_config_refuses_server_tools_and_replay(default_gw, ext, param):
    r = post(default_gw, {"model": "smollm2", "messages": USER, "max_tokens": 1, "interlace": ext})
    err = assert_error(r, 403, "permission_denied", param)
    assert param in err["message"] and "unauthenticated" in err["message"]


def test_default_config_serves_plain_chat(default_gw):
    r = post(default_gw, {"model": "smollm2", "messages": USER, "max_tokens": 1},
             **{"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None,
                                   "application/json; charset=latin-1"])
def test_non_json_content_type_is_415(default_gw, ctype):
    """A web page can POST text/plain to 127.0.0.1 without a CORS preflight; it must not run."""
    body = b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    headers = {"Content-Type": ctype} if ctype else {}
    r = httpx.post(default_gw.url + "/v1/chat/completions", content=body, headers=headers, timeout=60)
    assert_error(r, 415, "unsupported_media_type")


@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                         ("GET", "/health"), ("OPTIONS", "/v1/chat/completions")])
def test_foreign_origin_is_403(default_gw, method, path):
    headers = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.request(method, default_gw.url + path, headers=headers, timeout=60,
                      json={"model": "smollm2", "messages": USER, "max_tokens": 1} if method == "POST" else None)
    assert_error(r, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_the_gateways_own_origin_is_allowed(default_gw, host):
    """A page the gateway's own address served (Origin == scheme://Host, Host an address or
    localhost) is same-origin; the MCP conformance suite's DNS-rebinding check expects 2xx."""
    own = f"{host}:{default_gw.port}"
    r = post(default_gw, {"model": "smollm2", "messages": USER, "max_tokens": 1}, Host=own, Origin=f"http://{own}")
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host,origin", [
    ("evil.example:{port}", "http://evil.example:{port}"),  # DNS rebinding: same-origin under the attacker's name
    ("127.0.0.1:{port}", "http://localhost:{port}"),  # another origin of the same machine
    ("127.0.0.1:{port}", "http://127.0.0.1:{other}"),  # a local page on another port
    ("127.0.0.1:{port}", "https://127.0.0.1:{port}"),  # another scheme
    ("127.0.0.1:{port}", "null"),  # an opaque origin (sandboxed iframe, file://)
])
def test_other_origins_than_the_own_are_still_403(default_gw, host, origin):
    fill = {"port": default_gw.port, "other": default_gw.port + 1}
    r = post(default_gw, {"model": "smollm2", "messages": USER, "max_tokens": 1},
             Host=host.format(**fill), Origin=origin.format(**fill))
    assert_error(r, 403, "origin_not_allowed")


def test_content_length_over_limit_is_refused_before_reading(default_gw):
    """The declared size alone is enough: nothing of the body is sent."""
    with socket.create_connection(("127.0.0.1", default_gw.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999999999\r\n\r\n")
        head = read_response(s)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert b'"request_too_large"' in head


# ------------------------------------------------------------- keys, origins
class KeyRecorder:
    """A plugin that records which caller each server-side tool call comes from."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def before_tool_execution(self, tool_name, arguments, request):
        self.seen.append((tool_name, request.get("key")))
        return None  # allow


@pytest.fixture(scope="module")
def recorder():
    return KeyRecorder()


@pytest.fixture(scope="module")
def keyed_gw(recorder):
    cfg = {"server": {"api_keys": [
               {"key": "k-reader", "name": "reader"},
               {"key": "k-agent", "name": "agent", "server_tools": ["calculator"]},
               {"key": "k-bench", "name": "bench", "server_tools": True, "replay": True}],
           "cors_origins": ["https://app.example"], "max_request_bytes": 4096},
           "models": {"smollm2": MODEL}, "plugins": {"entrypoints": False}}
    with LiveGateway(cfg, plugins=[recorder]) as gw:
        yield gw


def test_missing_or_wrong_key_is_401_with_a_bearer_challenge(keyed_gw):
    """RFC 6750: the 401 names the scheme (no OAuth, so no resource_metadata); an error code
    only when a token was sent."""
    r = post(keyed_gw, {"model": "smollm2", "messages": USER})
    assert_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == 'Bearer realm="interlace"'
    r = post(keyed_gw, {"model": "smollm2", "messages": USER}, key="k-wrong")
    assert_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == 'Bearer realm="interlace", error="invalid_token"'
    r = httpx.get(keyed_gw.url + "/v1/models", timeout=60)
    assert r.status_code == 401 and r.headers["www-authenticate"] == 'Bearer realm="interlace"', r.text


@pytest.mark.parametrize("key,ext,param,needle", [
    ("k-reader", {"server_tools": ["calculator"]}, "interlace.server_tools", "'reader'"),
    ("k-reader", {"server_tools": True}, "interlace.server_tools", "'reader'"),
    ("k-agent", {"server_tools": ["python"]}, "interlace.server_tools", "'python'"),
    ("k-agent", {"server_tools": ["calculator"], "replay": CALC}, "interlace.replay", "'agent'"),
])
def test_key_without_permission_is_403(keyed_gw, key, ext, param, needle):
    r = post(keyed_gw, {"model": "smollm2", "messages": USER, "max_tokens": 1, "interlace": ext}, key=key)
    err = assert_error(r, 403, "permission_denied", param)
    assert needle in err["message"]


def test_unknown_tool_is_still_400_for_a_permitted_key(keyed_gw):
    r = post(keyed_gw, {"model": "smollm2", "messages": USER, "interlace": {"server_tools": ["nope"]}}, key="k-agent")
    assert_error(r, 400, "unknown_tool", "interlace.server_tools")


@pytest.mark.parametrize("ext", [{"server_tools": ["calculator"]}, {"server_tools": True}])
def test_key_with_permission_may_use_its_tools(keyed_gw, ext):
    r = post(keyed_gw, {"model": "smollm2", "messages": USER, "max_tokens": 2, "interlace": ext}, key="k-agent")
    assert r.status_code == 200, r.text


def test_caller_key_name_reaches_before_tool_execution(keyed_gw, recorder):
    recorder.seen.clear()
    r = post(keyed_gw, {"model": "smollm2", "messages": USER, "max_tokens": 80, "interlace": {
        "server_tools": ["calculator"], "replay": [CALC, "42."]}}, key="k-bench")
    assert r.status_code == 200, r.text
    (res,) = r.json()["interlace"]["tool_calls"]
    assert res["name"] == "calculator" and res["ok"], res
    assert recorder.seen and set(recorder.seen) == {("calculator", "bench")}


def test_configured_origin_gets_cors_headers_and_preflight(keyed_gw):
    origin = "https://app.example"
    pre = httpx.options(keyed_gw.url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == origin
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = post(keyed_gw, {"model": "smollm2", "messages": USER, "max_tokens": 1}, key="k-reader", Origin=origin)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    r = post(keyed_gw, {"model": "smollm2", "messages": USER, "max_tokens": 1}, key="k-reader",
             Origin="https://app.example.evil.example")
    assert_error(r, 403, "origin_not_allowed")


def test_body_limit_is_enforced_while_reading(keyed_gw):
    """A chunked body with no Content-Length is refused as soon as it passes the limit:
    the gateway answers 413 while the client has not finished sending."""
    with socket.create_connection(("127.0.0.1", keyed_gw.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k-reader\r\n"
                  b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b'{"model": "smollm2", "messages": [{"role": "user", "content": "' + b"x" * 5000
        s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))  # over the 4096-byte limit; the body never ends
        head = read_response(s)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert b'"request_too_large"' in head


def test_body_just_under_the_limit_is_read(keyed_gw):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "x" * 3000}], "max_tokens": 1}
    assert post(keyed_gw, body, key="k-reader").status_code == 200


# ------------------------------------------------------------------ start-up
@pytest.mark.parametrize("server,warned", [
    ({"server_tools": True}, "server-side tools are enabled"),
    ({"replay": True}, "interlace.replay is enabled"),
    ({"server_tools": True, "api_keys": ["k"]}, None),
    ({}, None),
])
def test_startup_warns_when_anyone_may_run_tools(caplog, server, warned):
    cfg = parse_config({"server": server, "models": {"m": {"path": "embedded"}}})
    with caplog.at_level(logging.WARNING, logger="interlace.gateway.app"):
        create_app(cfg)
    security = [r.getMessage() for r in caplog.records if "SECURITY" in r.getMessage()]
    if warned:
        assert len(security) == 1 and warned in security[0] and "any client" in security[0].lower(), security
    else:
        assert security == []
