"""A server-side tool that does not exist (or is not enabled) is a 400 ``unknown_tool`` whoever
asks; an existing tool the caller may not use is a 403 (docs/security.md, "Who can reach
what").  The adversarial trial got 403 for an unknown name from a caller without tools."""

from __future__ import annotations

import httpx
import pytest

from helpers.gateway_server import LiveGateway
from interlace.gateway.config import parse_config
from interlace.gateway.errors import APIError
from interlace.gateway.http_guard import authorize

USER = [{"role": "user", "content": "hi"}]
ENABLED = ["python", "calculator"]


@pytest.fixture(scope="module")
def gw():
    """No keys, server tools off: the shipped defaults."""
    with LiveGateway({"models": {"smollm2": {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}},
                      "plugins": {"entrypoints": False}}) as live:
        yield live


@pytest.mark.parametrize("names,status,code", [
    (["nope"], 400, "unknown_tool"),
    (["calculator"], 403, "permission_denied"),
    (["nope", "calculator"], 400, "unknown_tool"),
    (["calculator", "nope"], 400, "unknown_tool"),
])
def test_without_a_key(gw, names, status, code):
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": USER, "max_tokens": 1, "interlace": {"server_tools": names}})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, "interlace.server_tools"), err


CONFIG = parse_config({"server": {"api_keys": [{"key": "k-reader", "name": "reader"},
                                               {"key": "k-agent", "name": "agent", "server_tools": ["calculator"]}]},
                       "models": {"m": {"path": "embedded"}}})
READER, AGENT = CONFIG.api_keys


@pytest.mark.parametrize("caller,names,status", [
    (READER, ["nope"], 400), (READER, ["calculator"], 403),
    (READER, ["nope", "calculator"], 400), (READER, ["calculator", "nope"], 400),
    (AGENT, ["nope"], 400), (AGENT, ["python"], 403), (AGENT, ["calculator"], None),
    (AGENT, ["python", "nope"], 400), (AGENT, ["nope", "python"], 400),
])
def test_with_a_key(caller, names, status):
    body = {"interlace": {"server_tools": names}}
    if status is None:
        authorize(CONFIG, caller, body, ENABLED)
        return
    with pytest.raises(APIError) as e:
        authorize(CONFIG, caller, body, ENABLED)
    assert e.value.status == status
    assert e.value.code == ("unknown_tool" if status == 400 else "permission_denied")
    assert e.value.param == "interlace.server_tools"
