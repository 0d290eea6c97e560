"""Every client mistake is a 400 in OpenAI's error shape, every server failure a JSON
500 (or, mid-stream, an error event and ``[DONE]``); nothing leaves a context behind."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time

import httpx
import pytest

from helpers.gateway_server import LiveGateway, engine_state, wait_idle
from interlace.gateway.models import load_engine

USER = [{"role": "user", "content": "Say hello."}]
FAIL_SEED = 424242  # requests with this seed meet an engine failure after a few tokens


class BreaksMidGeneration:
    """The real engine, except that a generation with ``seed == FAIL_SEED`` raises an
    unexpected error after three tokens (an engine bug, as the gateway would meet it)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, context_id, sampling=None, *args, **kw):
        n = 0
        async with contextlib.aclosing(self._engine.generate(context_id, sampling, *args, **kw)) as events:
            async for ev in events:
                yield ev
                n += 1
                if sampling is not None and sampling.seed == FAIL_SEED and n == 3:
                    raise RuntimeError("simulated engine failure")


@pytest.fixture(scope="module")
def live():
    cfg = {"server": {"replay": True},  # the disconnect test replays a long text
           "models": {"smollm2": {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}},
           "plugins": {"entrypoints": False}}
    with LiveGateway(cfg, engine_factory=lambda spec: BreaksMidGeneration(load_engine(spec))) as gw:
        yield gw


def post_raw(live, raw: bytes) -> httpx.Response:
    return httpx.post(live.url + "/v1/chat/completions", content=raw, timeout=60,
                      headers={"Content-Type": "application/json"})


def body(**fields) -> dict:
    return {"model": "smollm2", "messages": USER, "max_tokens": 2, **fields}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD_BODIES = [  # (id, raw JSON text, param or None)
    ("part-string", json.dumps(body(messages=[{"role": "user", "content": ["hi"]}])), "messages[0].content[0]"),
    ("part-numbers", json.dumps(body(messages=[{"role": "user", "content": [1, 2]}])), "messages[0].content[0]"),
    ("part-text-number", json.dumps(body(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}])),
     "messages[0].content[0].text"),
    ("part-image", json.dumps(body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])), "messages[0].content[0].type"),
    ("seed-huge", json.dumps(body(seed=2 ** 70)), "seed"),
    ("seed-float", json.dumps(body(seed=3.0)), "seed"),
    ("max_tokens-float", json.dumps(body(max_tokens=3.0)), "max_tokens"),
    ("top_k-float", json.dumps(body(top_k=2.0)), "top_k"),
    ("n-float", json.dumps(body(n=2.0)), "n"),
    ("stream-not-bool", json.dumps(body(stream="yes")), "stream"),
    ("temperature-string", json.dumps(body(temperature="0.5")), "temperature"),
    ("lone-surrogate-content", json.dumps(body(messages=[{"role": "user", "content": "\ud800"}])), None),
    ("lone-surrogate-key", '{"model": "smollm2", "messages": [], "\\udfff": 1}', None),
    ("nested-10000-in-field", json.dumps(body(user="x")).replace('"x"', nested(10000)), None),
    ("nested-10000-top", nested(10000), None),
    ("tool-parameters-300", json.dumps(body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": deep_schema(300)}}])), None),
    ("inf-literal", json.dumps(body(temperature=0.5)).replace("0.5", "1e999"), None),
    ("nan", json.dumps(body(temperature=0.5)).replace("0.5", "NaN"), None),
    ("infinity", json.dumps(body(seed=1)).replace(": 1", ": -Infinity"), None),
    ("inf-in-tool-result", json.dumps(body(messages=USER + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": 12345}]}]))
     .replace("12345", "1e999"), None),
    ("inf-in-call-arguments", json.dumps(body(messages=USER + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": '{"x": 1e999}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}])), "messages[1].tool_calls[0].function.arguments"),
    ("deep-call-arguments", json.dumps(body(messages=USER + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": nested(5000)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}])), "messages[1].tool_calls[0].function.arguments"),
    ("not-utf8", '{"model": "smollm2", "messages": [{"role": "user", "content": "\udcff"}]}', None),
]


@pytest.mark.parametrize("raw,param", [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES])
def test_bad_input_is_400_with_a_clear_message(live, raw, param):
    data = raw.encode("utf-8", "surrogateescape" if "\udcff" in raw else "surrogatepass")
    r = post_raw(live, data)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["code"]
    if param is not None:
        assert err["param"] == param, err
    assert engine_state(live)["contexts"] == 0


UNSUPPORTED = [
    ("n", 2), ("frequency_penalty", 0.5), ("presence_penalty", -1), ("logit_bias", {"42": 5}),
    ("top_logprobs", 3), ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("functions", [{"name": "f"}]),
    ("function_call", "auto"), ("reasoning_effort", "high"), ("some_new_knob", 1),
]


@pytest.mark.parametrize("field,value", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_parameters_are_refused_naming_the_field(live, field, value):
    r = httpx.post(live.url + "/v1/chat/completions", json=body(**{field: value}), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert err["code"] in ("unsupported_parameter", "unknown_parameter")


def test_neutral_values_and_harmless_fields_are_accepted(live):
    r = httpx.post(live.url + "/v1/chat/completions", timeout=60, json=body(
        n=1, frequency_penalty=0, presence_penalty=0.0, logit_bias={}, top_logprobs=0, logprobs=False,
        modalities=["text"], audio=None, prediction=None, functions=None, function_call=None,
        metadata={"trace": "t1"}, store=False, service_tier="auto", user="u1",
        stream_options=None, seed=2 ** 63 - 1, temperature=0.7))
    assert r.status_code == 200, r.text


def test_keep_alive_connection_survives_a_rejected_body(live):
    """A tool result holding 1e999 used to break the next request on the same connection."""
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    bad = next(raw for name, raw, _ in BAD_BODIES if name == "inf-in-tool-result").encode()
    conn.request("POST", "/v1/chat/completions", body=bad, headers={"Content-Type": "application/json"})
    r1 = conn.getresponse()
    assert r1.status == 400 and json.loads(r1.read())["error"]["code"] == "invalid_json"
    sock = conn.sock
    assert sock is not None, "the server closed the connection"
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body()).encode(),
                 headers={"Content-Type": "application/json"})
    r2 = conn.getresponse()
    assert r2.status == 200, r2.read()
    assert json.loads(r2.read())["choices"][0]["message"]["content"]
    assert conn.sock is sock  # the same connection served both
    conn.close()


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/nope", 404, "not_found"), ("POST", "/v1/embeddings", 404, "not_found"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
])
def test_unknown_paths_and_methods_answer_json(live, method, path, status, code):
    r = httpx.request(method, live.url + path, timeout=30)
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["code"] == code and path in err["message"]


def test_streaming_bad_seed_is_400_before_the_stream_starts(live):
    r = httpx.post(live.url + "/v1/chat/completions", json=body(seed=2 ** 70, stream=True, temperature=1), timeout=60)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["param"] == "seed"


def test_context_too_long_when_streaming_is_a_400_response(live):
    r = httpx.post(live.url + "/v1/chat/completions", timeout=60, json=body(
        stream=True, messages=[{"role": "user", "content": "word " * 5000}]))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def sse_events(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_failure_mid_stream_sends_error_event_then_done(live):
    r = httpx.post(live.url + "/v1/chat/completions", timeout=60,
                   json=body(stream=True, seed=FAIL_SEED, temperature=1, max_tokens=50))
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c.get("choices") and c["choices"][0]["delta"].get("content") for c in chunks[:-1])  # it had started
    err = chunks[-1]["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error" and "RuntimeError" in err["message"]
    st = wait_idle(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0


def test_unexpected_exception_is_a_json_500(live):
    r = httpx.post(live.url + "/v1/chat/completions", json=body(seed=FAIL_SEED, temperature=1, max_tokens=50),
                   timeout=60)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["type"] == "server_error"
    st = wait_idle(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0
    # and the gateway goes on serving
    assert httpx.post(live.url + "/v1/chat/completions", json=body(), timeout=60).status_code == 200


def test_non_streaming_client_disconnect_frees_context(live):
    """A client that gives up on a long non-streaming request: decoding stops at once."""
    req = json.dumps({"model": "smollm2", "messages": USER, "max_tokens": 2000,
                      "interlace": {"replay": "word " * 1500}}).encode()
    s = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(req), req))
    deadline = time.time() + 30
    while engine_state(live)["contexts"] == 0:  # wait until it decodes
        assert time.time() < deadline, "generation never started"
        time.sleep(0.05)
    time.sleep(0.3)
    s.close()  # the client goes away
    st = wait_idle(live, timeout=5.0)
    assert st["contexts"] == 0 and st["used_blocks"] == 0, st


def test_no_leaked_contexts_or_blocks(live):
    st = wait_idle(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0


# ------------------------------------------------------------ one error shape
def test_every_error_class_is_answered_by_the_handlers_registered_once():
    """Routes raise and never wrap themselves: the handlers create_app registers answer
    each error class in OpenAI's shape (engine errors mapped once, for every wing) and
    count the refusals by path."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from interlace.engine_ext.errors import ContextTooLong, EngineClosed, EngineError
    from interlace.gateway.app import create_app
    from interlace.gateway.config import parse_config
    from interlace.gateway.errors import (APIError, ClientGone, DependencyFailed, GatewayError, InvalidInput,
                                          engine_error, exception_handlers)
    from interlace.gateway.metrics import Metrics

    gateway = create_app(parse_config({"models": {"m": {"path": "embedded"}}}))
    assert {APIError, GatewayError, ClientGone} <= set(gateway.exception_handlers)

    raised = {"/invalid": InvalidInput("bad x", param="x", code="invalid_value"),
              "/dependency": DependencyFailed("tool 't' failed", code="tool_failed"),
              "/gone": ClientGone(),
              "/closed": engine_error(EngineClosed("closed")),
              "/long": engine_error(ContextTooLong("too long")),
              "/engine": engine_error(EngineError("out of blocks"))}

    async def route(request):
        raise raised[request.url.path]

    metrics = Metrics()
    client = TestClient(Starlette(routes=[Route(p, route) for p in raised],
                                  exception_handlers=exception_handlers(metrics)))

    def error(path):
        r = client.get(path)
        return r.status_code, r.json()["error"], r.headers

    assert error("/invalid")[:2] == (400, {"message": "bad x", "type": "invalid_request_error", "param": "x",
                                           "code": "invalid_value"})
    assert error("/dependency")[:2] == (424, {"message": "tool 't' failed", "type": "invalid_request_error",
                                              "param": None, "code": "tool_failed"})
    status, err, headers = error("/closed")
    assert (status, err["type"], err["code"], headers["retry-after"]) == (503, "server_error", "engine_unavailable", "1")
    assert error("/long")[:2] == (400, {"message": "too long", "type": "invalid_request_error", "param": None,
                                        "code": "context_length_exceeded"})
    assert error("/engine")[:2] == (500, {"message": "engine error: out of blocks", "type": "server_error",
                                          "param": None, "code": "engine_error"})
    gone = client.get("/gone")
    assert gone.status_code == 499 and gone.content == b""
    assert error("/nowhere")[:2] == (404, {"message": "no such endpoint: /nowhere", "type": "invalid_request_error",
                                           "param": None, "code": "not_found"})

    def counted(path, status):
        return metrics.registry.get_sample_value("interlace_requests_total",
                                                 {"endpoint": path, "model": "", "status": str(status)})

    assert [counted(p, s) for p, s in (("/invalid", 400), ("/dependency", 424), ("/gone", 499),
                                       ("/closed", 503))] == [1.0] * 4
    assert counted("/nowhere", 404) is None  # unknown endpoints are not counted (as before)


@pytest.mark.parametrize("cls,status,type_", [
    ("InvalidInput", 400, "invalid_request_error"), ("NotAllowed", 403, "permission_error"),
    ("NotFound", 404, "invalid_request_error"), ("Conflict", 409, "invalid_request_error"),
    ("TooLarge", 413, "invalid_request_error"), ("LimitReached", 429, "invalid_request_error"),
    ("DependencyFailed", 424, "invalid_request_error")])
def test_each_domain_error_has_its_status_and_type(cls, status, type_):
    """The semantic wing raises HTTP-neutral errors; one table gives each its status and error type."""
    from interlace.gateway import errors

    err = errors.api_error(getattr(errors, cls)("m", param="p", code="c"))
    assert (err.status, err.body()) == (status, {"error": {"message": "m", "type": type_, "param": "p", "code": "c"}})
