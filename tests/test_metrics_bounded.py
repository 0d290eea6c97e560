"""``/metrics`` stays bounded and shows no client's ids (gateway/metrics.py), and can be put behind a key.

Labelled by raw path, 11,000 unauthenticated 404s on ``/v1/sessions/<random>`` grew
the page to 354 MB and put other clients' session and variable ids in it."""

from __future__ import annotations

import asyncio
import secrets

import httpx
import pytest
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from helpers.gateway_server import LiveGateway
from interlace.gateway.app import create_app
from interlace.gateway.config import ConfigError, parse_config
from interlace.gateway.metrics import UNMATCHED, RouteLabels

MODEL = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}


def series(text: str) -> list:
    """The sample lines (one per labelled series) of a Prometheus text page."""
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#")]


@pytest.fixture(scope="module")
def gw():
    """The shipped defaults (no keys, /metrics open on loopback) with the tiny model."""
    with LiveGateway({"server": {"default_max_tokens": 2}, "models": {"smollm2": MODEL},
                      "plugins": {"entrypoints": False}}) as live:
        yield live


def _random_requests(client: httpx.Client, n: int) -> list:
    """``n`` requests on paths with fresh random ids, with and without a token: 401s and 404s."""
    ids = []
    for i in range(n):
        a, b = secrets.token_hex(8), secrets.token_hex(8)
        ids += [a, b]
        path = [f"/v1/sessions/{a}", f"/v1/sessions/{a}/variables/{b}", f"/v1/sessions/{a}/calls/{b}",
                f"/v1/sessions/{a}/nothing/{b}", f"/{a}"][i % 5]
        method = ["GET", "DELETE", "PUT", "POST"][i % 4]
        headers = {"Authorization": f"Bearer sst_{b}"} if i % 3 else {}
        r = client.request(method, path, headers=headers, content=b"{}")
        assert r.status_code in (401, 404, 405), (path, r.status_code, r.text)
    return ids


def test_random_paths_leave_the_series_count_unchanged(gw):
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        _random_requests(client, 40)  # every (route template, status) these requests can reach
        before = series(client.get("/metrics").text)
        ids = _random_requests(client, 2000)
        page = client.get("/metrics").text
    after = series(page)
    assert len(after) == len(before), sorted(set(after) - set(before))[:10]
    assert not [i for i in ids if i in page]
    counted = [ln for ln in after if ln.startswith("interlace_requests_total{")]
    assert any('endpoint="/v1/sessions/{sid}"' in ln and 'status="401"' in ln for ln in counted), counted
    assert any('endpoint="/v1/sessions/{sid}/variables/{vid}"' in ln for ln in counted), counted


def test_a_real_sessions_ids_reach_no_unauthenticated_endpoint(gw):
    """Its session, variable and call ids and its token: not in /metrics, /health, /openapi.json,
    nor /v1/plugins or /v1/models (open without keys), after refusals that name them in their paths."""
    with httpx.Client(base_url=gw.url, timeout=120) as client:
        s = client.post("/v1/sessions", json={}).json()
        tok = {"Authorization": f"Bearer {s['token']}"}
        base = f"/v1/sessions/{s['id']}"
        var = client.post(base + "/variables", headers=tok, json={"name": "x", "value": "v"}).json()
        call = client.post(base + "/calls", headers=tok, json={
            "model": "smollm2", "template": "Hi {{output:y}}", "outputs": {"y": {"sampling": {"max_tokens": 1}}}})
        assert call.status_code == 201, call.text
        out = call.json()["outputs"]["y"]
        assert client.get(f"{base}/variables/{out}", headers=tok).status_code == 200
        # refusals on its own paths: a variable set twice (409), another token (403), none (401)
        assert client.put(f"{base}/variables/{var['id']}", headers=tok, json={"value": "w"}).status_code == 409
        assert client.get(base, headers={"Authorization": "Bearer sst_wrong"}).status_code == 403
        assert client.get(f"{base}/calls/{call.json()['id']}").status_code == 401
        secrets_of_client = [s["id"], s["token"], var["id"], out, call.json()["id"]]
        for path in ("/metrics", "/health", "/openapi.json", "/v1/plugins", "/v1/models"):
            r = client.get(path)
            assert r.status_code == 200, (path, r.text)
            assert not [x for x in secrets_of_client if x in r.text], path
        assert client.delete(base, headers=tok).status_code == 200


def test_route_labels_are_the_route_table():
    labels = RouteLabels([Route("/health", lambda r: None),
                          Mount("/v1/sessions", routes=[Route("/{sid}", lambda r: None),
                                                        Route("/{sid}/variables/{vid}", lambda r: None)])])
    assert labels.label("/health") == "/health"
    assert labels.label("/v1/sessions/ses_1") == "/v1/sessions/{sid}"
    assert labels.label("/v1/sessions/ses_1/variables/sv_2") == "/v1/sessions/{sid}/variables/{vid}"
    assert labels.label("/v1/sessions/ses_1/other") == UNMATCHED
    assert labels.label("/" + "x" * 5000) == UNMATCHED


METRICS_KEY = "metrics-key-0123456789abcdef"


def test_metrics_key_is_required_when_configured(monkeypatch):
    monkeypatch.setenv("INTERLACE_TEST_METRICS_KEY", METRICS_KEY)
    cfg = parse_config({"server": {"api_keys": ["api-key-0123456789"],
                                   "metrics_key": "os.environ/INTERLACE_TEST_METRICS_KEY"},
                        "models": {"m": {"path": "embedded"}}})
    assert cfg.metrics_key == METRICS_KEY and METRICS_KEY not in repr(cfg)
    client = TestClient(create_app(cfg))  # no lifespan: /metrics needs no engine
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer api-key-0123456789"}):
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
        assert "param" in err
    r = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "interlace_requests_total" in r.text
    # the document says so; without the setting /metrics is open (the shipped loopback default)
    assert client.get("/openapi.json").json()["paths"]["/metrics"]["get"]["security"] == [{"metricsKey": []}]
    open_client = TestClient(create_app(parse_config({"models": {"m": {"path": "embedded"}}})))
    assert open_client.get("/metrics").status_code == 200


def test_metrics_key_too_short_is_a_config_error():
    with pytest.raises(ConfigError, match="metrics_key"):
        parse_config({"server": {"metrics_key": "short"}, "models": {"m": {"path": "embedded"}}})


def _ttft(page: str) -> tuple:
    """(count, sum) of ``interlace_time_to_first_token_seconds`` for the served model."""
    values = {}
    for ln in series(page):
        for part in ("_count", "_sum"):
            if ln.startswith(f"interlace_time_to_first_token_seconds{part}{{") and 'model="smollm2"' in ln:
                values[part] = float(ln.rsplit(" ", 1)[1])
    return values.get("_count", 0.0), values.get("_sum", 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_time_to_first_token_counts_from_the_requests_arrival(gw, stream):
    """The first token of a request whose prefill is held up DELAY seconds (the engine's fill,
    delayed here) is recorded at DELAY or more, streamed or not: the clock starts when the request
    arrives, not when the stream's first event already exists (0.17 ms recorded for a first token
    that reached the client at 1.9 s); a non-streamed request is observed too."""
    delay = 0.6
    engine = gw.gateway.models["smollm2"].engine
    real_fill = engine.fill

    async def slow_fill(*args, **kw):
        await asyncio.sleep(delay)
        return await real_fill(*args, **kw)

    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": stream}
    with httpx.Client(base_url=gw.url, timeout=120) as client:
        count, total = _ttft(client.get("/metrics").text)
        engine.fill = slow_fill
        try:
            r = client.post("/v1/chat/completions", json=body)
        finally:
            del engine.fill  # the class's own again
        assert r.status_code == 200, r.text
        after_count, after_total = _ttft(client.get("/metrics").text)
    assert after_count == count + 1
    assert after_total - total >= delay
