"""The OpenAPI document (``GET /openapi.json``) against the server that serves it.

schemathesis (its CLI, in a subprocess: the gateway keeps this process's
cores) generates requests from the document for every operation and checks
each answer: no 5xx, a documented status, a body of the documented schema,
the documented content type, a 405 with the right ``Allow`` for a method the
path does not serve, and no answer without the key an operation needs.  It
is bounded (3 examples an operation, deterministic generation, no
shrinking) and the model answers 4 tokens at most, so a run is some seconds.
Session operations get a real session (its id, its token), so they are
tested past the 404 of an unknown one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from helpers.gateway_server import LiveGateway

KEY = "conformance-key-0123456789"
MODEL = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}
#: On: not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
#: response_headers_conformance, allow_header_conformance, unsupported_method, ignored_auth,
#: missing_required_header.  Off: the schema gives a body's shape, the server checks more (a tool
#: name, a template's placeholders, OpenAI's unimplemented fields at their neutral value), so "valid
#: data accepted / invalid refused" would test the generator; and the checks that need the stateful phase.
CHECKS_OFF = ("positive_data_acceptance", "negative_data_rejection", "use_after_free", "ensure_resource_availability",
              "object_level_authorization")


@pytest.fixture(scope="module")
def gw():
    cfg = {"server": {"api_keys": [KEY], "default_max_tokens": 4},
           "models": {"smollm2": MODEL}, "plugins": {"entrypoints": False}}
    with LiveGateway(cfg) as live:
        yield live


def _session(gw) -> dict:
    """A session with a variable (set) and a finished call: what the {sid}/{vid}/{cid} operations get."""
    auth = {"Authorization": f"Bearer {KEY}"}
    s = httpx.post(gw.url + "/v1/sessions", headers=auth, json={}, timeout=60).json()
    tok = {"Authorization": f"Bearer {s['token']}"}
    base = f"{gw.url}/v1/sessions/{s['id']}"
    var = httpx.post(base + "/variables", headers=tok, json={"name": "x", "value": "hello"}, timeout=60).json()
    call = httpx.post(base + "/calls", headers=tok, timeout=120, json={
        "model": "smollm2", "template": "Say hi: {{output:y}}", "outputs": {"y": {"sampling": {"max_tokens": 2}}}})
    assert call.status_code == 201, call.text
    out = call.json()["outputs"]["y"]
    assert httpx.get(f"{base}/variables/{out}", headers=tok, timeout=120).status_code == 200
    return {"sid": s["id"], "token": s["token"], "vid": var["id"], "cid": call.json()["id"]}


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string


def test_schemathesis_finds_no_disagreement(gw, tmp_path):
    kept, deleted = _session(gw), _session(gw)  # DELETE gets its own, so the others keep theirs
    sessions = "^/v1/sessions/\\{sid\\}"
    config = tmp_path / "schemathesis.toml"
    config.write_text("\n".join([
        f"headers = {{ Authorization = {_toml('Bearer ' + KEY)} }}",
        "request-timeout = 60",
        *(f"checks.{name}.enabled = false" for name in CHECKS_OFF),
        "[[operations]]",
        f"include-path-regex = {_toml(sessions)}",
        'exclude-method = "DELETE"',
        f"headers = {{ Authorization = {_toml('Bearer ' + kept['token'])} }}",
        f"parameters = {{ sid = {_toml(kept['sid'])}, vid = {_toml(kept['vid'])}, cid = {_toml(kept['cid'])} }}",
        "[[operations]]",
        f"include-path-regex = {_toml(sessions + '$')}",
        'include-method = "DELETE"',
        f"headers = {{ Authorization = {_toml('Bearer ' + deleted['token'])} }}",
        f"parameters = {{ sid = {_toml(deleted['sid'])} }}",
        # once a case deleted it, the session is unknown to any token (404, as documented): the
        # "wrong token is 401/403" check needs a live session, which the other operations have
        "checks.ignored_auth.enabled = false",
    ]) + "\n")
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", gw.url + "/openapi.json",
           "--phases", "examples,coverage,fuzzing", "--max-examples", "3",
           "--generation-deterministic", "--no-shrink", "--workers", "1", "--no-color"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-12000:]
    assert "22 selected / 22 total" in out, out[-3000:]  # every operation of the document was tested


def test_options_allows_exactly_the_documented_methods(gw):
    """A method a path does not serve (OPTIONS among them) is a 405 whose Allow lists the
    document's operations of that path (HEAD with GET); ``OPTIONS /v1/sessions/x`` allowed
    no DELETE when GET and DELETE were two routes."""
    doc = httpx.get(gw.url + "/openapi.json").json()
    assert doc["paths"], doc
    for template, ops in doc["paths"].items():
        path = template.replace("{sid}", "x").replace("{vid}", "y").replace("{cid}", "z")
        r = httpx.options(gw.url + path)
        assert r.status_code == 405, (path, r.status_code, r.text)
        if path.startswith("/v1/messages"):  # Anthropic's error shape: no code, the message says it
            assert r.json()["type"] == "error" and "not allowed" in r.json()["error"]["message"], r.text
        else:
            assert r.json()["error"]["code"] == "method_not_allowed"
        allowed = {m.strip().lower() for m in r.headers["allow"].split(",")}
        documented = set(ops)
        assert allowed == documented | ({"head"} if "get" in documented else set()), (template, allowed, documented)


def test_document_follows_the_configured_keys(gw):
    """With API keys the key operations need one and /metrics (no metrics_key) is open; without keys
    nothing but the session token is required."""
    from interlace.gateway.openapi import openapi_document

    doc = httpx.get(gw.url + "/openapi.json").json()
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]
    assert doc["paths"]["/metrics"]["get"]["security"] == []
    assert doc["paths"]["/v1/sessions/{sid}"]["delete"]["security"] == [{"sessionToken": []}]
    routes = gw.app.routes
    open_doc = openapi_document(routes, api_keys=False, metrics_key=True)
    assert open_doc["paths"]["/v1/chat/completions"]["post"]["security"] == []
    assert open_doc["paths"]["/metrics"]["get"]["security"] == [{"metricsKey": []}]
    assert open_doc["paths"]["/v1/sessions/{sid}"]["get"]["security"] == [{"sessionToken": []}]
