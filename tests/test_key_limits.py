"""Limits per API key (gateway/key_limits.py): sessions, pending semantic calls, chat completions in flight.

Against a real gateway (embedded model, loopback) with two keys: beyond a limit a key gets 429
``rate_limit_exceeded`` naming the limit, nothing of the refused request is kept (no session, no
call, no engine context), the other key is not affected, and /metrics shows what each key holds by
its name (never its secret).  The defaults give each key a share of the server's limits.
"""

from __future__ import annotations

import time

import httpx
import pytest

from interlace.gateway.config import ConfigError, parse_config

from helpers.gateway_server import LiveGateway, wait_idle

KEY_A, KEY_B = "limits-secret-a", "limits-secret-b"
MODEL = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}


@pytest.fixture(scope="module")
def live():
    cfg = {"server": {"api_keys": [{"key": KEY_A, "name": "alice", "limits": {"max_concurrent_requests": 1}},
                                   {"key": KEY_B, "name": "bob"}],
                      "per_key": {"max_sessions": 2, "max_pending_calls": 3}},
           "models": {"smollm2": MODEL}}
    with LiveGateway(cfg) as gw:
        yield gw


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.url, timeout=120) as c:
        yield c
    for s in list(live.gateway.sessions.sessions.values()):  # each test starts with no session
        with httpx.Client(base_url=live.url) as c:
            c.delete(f"/v1/sessions/{s.id}", headers={"Authorization": f"Bearer {s.token}"})


def refused(r: httpx.Response, limit: str) -> None:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and limit in err["message"], err


def session(http, headers, **body):
    r = http.post("/v1/sessions", headers=headers, json=body)
    assert r.status_code == 201, r.text
    return r.json()


def after(i: int) -> dict:
    """A call of a batch reading the output of the batch's call ``i``."""
    return {"model": "smollm2", "template": "{{input:x}} {{output:out}}", "inputs": {"x": {"call": i, "output": "a"}},
            "outputs": {"out": {"sampling": {"max_tokens": 2}}}}


FIRST = {"model": "smollm2", "template": "Say hi. {{output:a}}", "outputs": {"a": {"sampling": {"max_tokens": 2}}}}


def pending_calls(http, s) -> dict:
    return http.get(f"/v1/sessions/{s['id']}", headers={"Authorization": f"Bearer {s['token']}"}).json()["calls"]


# ------------------------------------------------------------------ config
def test_defaults_share_the_servers_limits_between_keys_and_a_keys_own_override_them():
    base = {"models": {"m": {"path": "x"}}}
    none = parse_config(base).per_key
    assert (none.max_sessions, none.max_pending_calls, none.max_concurrent_requests) == (256, 1024, 256)
    four = parse_config({**base, "server": {"api_keys": ["k1", "k2", "k3", {"key": "k4", "name": "big",
                                                                           "limits": {"max_sessions": 100}}]}})
    assert [k.limits.max_sessions for k in four.api_keys] == [64, 64, 64, 100]  # a quarter of 256 each
    assert four.api_keys[0].limits.max_concurrent_requests == 64
    over = parse_config({**base, "server": {"api_keys": ["k1", "k2"], "per_key": {"max_pending_calls": 5},
                                            "sessions": {"max_sessions": 10}}})
    assert (over.api_keys[1].limits.max_sessions, over.api_keys[1].limits.max_pending_calls) == (5, 5)
    for bad in ({"per_key": {"max_sessions": 0}}, {"per_key": {"sessions": 3}},
                {"api_keys": [{"key": "k", "limits": {"max_calls": 1}}]}):
        with pytest.raises(ConfigError):
            parse_config({**base, "server": bad})


# ---------------------------------------------------------------- sessions
def test_a_key_holds_at_most_its_sessions_and_the_other_key_is_not_affected(live, http):
    first = [session(http, A) for _ in range(2)]
    before = set(live.gateway.sessions.sessions)
    refused(http.post("/v1/sessions", headers=A, json={}), "max_sessions")
    refused(http.post("/v1/sessions", headers=A, json={"calls": [FIRST, after(0)]}), "max_sessions")
    assert set(live.gateway.sessions.sessions) == before  # nothing kept
    session(http, B)  # bob's own share
    http.delete(f"/v1/sessions/{first[0]['id']}", headers={"Authorization": f"Bearer {first[0]['token']}"})
    session(http, A)  # a freed slot is the key's again


# ------------------------------------------------------------ pending calls
def test_pending_calls_are_counted_over_all_of_a_keys_sessions(live, http):
    s1 = session(http, A)
    h1 = {"Authorization": f"Bearer {s1['token']}"}
    var = http.post(f"/v1/sessions/{s1['id']}/variables", headers=h1, json={"name": "never"}).json()["id"]
    call = {"model": "smollm2", "template": "{{input:x}} {{output:out}}", "inputs": {"x": var},
            "outputs": {"out": {"sampling": {"max_tokens": 2}}}}
    r = http.post(f"/v1/sessions/{s1['id']}/calls", headers=h1, json={"calls": [call, call]})
    assert r.status_code == 201, r.text
    s2 = session(http, A)
    h2 = {"Authorization": f"Bearer {s2['token']}"}
    v2 = http.post(f"/v1/sessions/{s2['id']}/variables", headers=h2, json={"name": "never"}).json()["id"]
    call2 = {**call, "inputs": {"x": v2}}
    refused(http.post(f"/v1/sessions/{s2['id']}/calls", headers=h2, json={"calls": [call2, call2]}),
            "max_pending_calls")  # 2 + 2 > 3
    assert pending_calls(http, s2) == {"pending": 0, "running": 0, "done": 0, "failed": 0}  # nothing kept
    assert http.get(f"/v1/sessions/{s2['id']}", headers=h2).json()["variables"] == 1
    assert http.post(f"/v1/sessions/{s2['id']}/calls", headers=h2, json=call2).status_code == 201  # 3 fit
    # bob's sessions are his own
    sb = session(http, B)
    hb = {"Authorization": f"Bearer {sb['token']}"}
    vb = http.post(f"/v1/sessions/{sb['id']}/variables", headers=hb, json={"name": "never"}).json()["id"]
    r = http.post(f"/v1/sessions/{sb['id']}/calls", headers=hb, json={"calls": [{**call, "inputs": {"x": vb}}] * 3})
    assert r.status_code == 201, r.text


def test_a_first_batch_over_the_keys_pending_calls_leaves_no_session(live, http):
    s1 = session(http, A)
    h1 = {"Authorization": f"Bearer {s1['token']}"}
    var = http.post(f"/v1/sessions/{s1['id']}/variables", headers=h1, json={"name": "never"}).json()["id"]
    call = {"model": "smollm2", "template": "{{input:x}} {{output:out}}", "inputs": {"x": var},
            "outputs": {"out": {"sampling": {"max_tokens": 2}}}}
    assert http.post(f"/v1/sessions/{s1['id']}/calls", headers=h1, json={"calls": [call, call]}).status_code == 201
    before = set(live.gateway.sessions.sessions)
    refused(http.post("/v1/sessions", headers=A, json={"calls": [FIRST, after(0)]}), "max_pending_calls")
    assert set(live.gateway.sessions.sessions) == before


# ----------------------------------------------------- concurrent requests
def test_a_key_has_at_most_its_chat_completions_in_flight(live, http):
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with httpx.Client(base_url=live.url, timeout=120) as other:
        with other.stream("POST", "/v1/chat/completions", headers=A,
                          json={**chat, "stream": True, "max_tokens": 200}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # alice's first completion is in flight
            r = http.post("/v1/chat/completions", headers=A, json={**chat, "max_tokens": 2})
            refused(r, "max_concurrent_requests")
            assert r.headers["Retry-After"] == "1"
            assert http.post("/v1/chat/completions", headers=B, json={**chat, "max_tokens": 2}).status_code == 200
            metrics = http.get("/metrics").text
            assert 'interlace_key_requests_in_flight{key="alice"} 1.0' in metrics
        # the stream is closed: her slot is free again
        deadline = time.time() + 30
        while live.gateway.key_limits.in_flight.get("alice"):
            assert time.time() < deadline
            time.sleep(0.02)
        assert http.post("/v1/chat/completions", headers=A, json={**chat, "max_tokens": 2}).status_code == 200
    assert wait_idle(live)["contexts"] == 0  # the refused request left nothing in the engine


def test_a_wrong_key_is_still_401_not_a_limit(http):
    r = http.post("/v1/chat/completions", headers={"Authorization": "Bearer nope"},
                  json={"model": "smollm2", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401


# ----------------------------------------------------------------- metrics
def test_metrics_show_what_each_key_holds_by_name_never_by_secret(live, http):
    session(http, A)
    s = session(http, B)
    h = {"Authorization": f"Bearer {s['token']}"}
    var = http.post(f"/v1/sessions/{s['id']}/variables", headers=h, json={"name": "never"}).json()["id"]
    call = {"model": "smollm2", "template": "{{input:x}} {{output:out}}", "inputs": {"x": var},
            "outputs": {"out": {"sampling": {"max_tokens": 2}}}}
    assert http.post(f"/v1/sessions/{s['id']}/calls", headers=h, json=call).status_code == 201
    text = http.get("/metrics").text
    assert 'interlace_key_sessions{key="alice"} 1.0' in text
    assert 'interlace_key_sessions{key="bob"} 1.0' in text
    assert 'interlace_key_pending_calls{key="bob"} 1.0' in text
    assert 'interlace_key_limit_refusals_total{key="alice",limit="max_sessions"}' in text  # earlier tests
    assert KEY_A not in text and KEY_B not in text
