"""Nothing a client sends runs unbounded on the event loop (issue 29): each case of the
adversarial trial that froze every client, or answered 500 for the client's own input.

The freeze cases are checked by their behaviour, not by how fast this machine is: the
request is refused before the expensive work (with the status and ``param`` the API
promises), or the work runs while a concurrent ``GET /health`` keeps answering within a
generous 5 s -- where each case held the loop far longer before (seconds to minutes).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers.gateway_server import LiveGateway
from interlace.engine_ext.constraints.grammar import GrammarCompiler, GrammarError
from interlace.gateway.errors import TooLarge
from interlace.gateway.semantic.prompt import prompt_pieces
from interlace.gateway.semantic.transforms import Transform, TransformFailed, TransformSpecError
from interlace.parsers.formats import HERMES

MODEL = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}
USER = [{"role": "user", "content": "hi"}]
#: a concurrent /health must answer within this while a hostile request is processed
HEALTH_S = 5.0
#: the lexer builds this regex lazily and gives up mid-decoding ("too many expressions")
TOO_COMPLEX = "^(a{1000}){1000}$"


@pytest.fixture(scope="module")
def gw():
    with LiveGateway({"models": {"smollm2": MODEL}}) as live:
        yield live


@pytest.fixture
def http(gw):
    with httpx.Client(base_url=gw.url, timeout=300) as c:
        yield c


@contextlib.contextmanager
def health_probe(gw):
    """Polls /health while the block runs; yields the list of latencies (seconds)."""
    stop, latencies = threading.Event(), []

    def poll():
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                t = time.perf_counter()
                assert c.get(gw.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.02)

    th = threading.Thread(target=poll)
    th.start()
    try:
        time.sleep(0.1)
        yield latencies
    finally:
        time.sleep(0.1)
        stop.set()
        th.join()
    assert latencies


def assert_error(r, status, param, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def session(http):
    r = http.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    s = r.json()
    return f"/v1/sessions/{s['id']}", {"Authorization": f"Bearer {s['token']}"}


# ------------------------------------------------------------------ transforms
def test_regex_transforms_match_in_linear_time():
    """Python's re took 1.3 s for 20 repetitions here, doubling with each one (24: ~20 s, holding
    the GIL); RE2 answers at once, whatever the count."""
    t = Transform.parse({"regex": "(.?){24}.{24}\u0000"}, "outputs.o.transform")
    start = time.perf_counter()
    with pytest.raises(TransformFailed, match="does not match"):
        t.apply("a" * 200)
    assert time.perf_counter() - start < HEALTH_S


@pytest.mark.parametrize("pattern,why", [(r"(a)\1", "backreferences"), (r"a(?=b)", "lookaround"),
                                         (r"(?<=a)b", "lookaround"), (r"\p{L}{100}", "too complex")])
def test_regexes_re2_cannot_run_are_refused_naming_the_field(pattern, why):
    with pytest.raises(TransformSpecError, match=why) as e:
        Transform.parse({"regex": pattern}, "outputs.o.transform")
    assert e.value.param == "outputs.o.transform.regex"


def test_regex_refusal_over_http_names_transform_regex(http):
    base, h = session(http)
    r = http.post(base + "/calls", headers=h, json={"model": "smollm2", "template": "Say {{output:o}}",
                                                    "outputs": {"o": {"transform": {"regex": r"(\w)\1"}}}})
    assert_error(r, 400, "outputs.o.transform.regex")


def test_json_field_on_deeply_nested_output_is_the_producers_failure():
    """json.loads raised RecursionError (an internal error of the call); now a clean transform failure."""
    t = Transform.parse({"json_field": "a"}, "t")
    for text in ("[" * 5000 + "]" * 5000, '{"a": ' + "[" * 100_000):
        with pytest.raises(TransformFailed, match="nested"):
            t.apply(text)
    assert t.apply('{"a": ' + "[" * 200 + "]" * 200 + "}") == "[" * 200 + "]" * 200  # deep, but readable


# ------------------------------------------------------- placeholder amplification
def test_repeated_placeholders_are_counted_at_submit(gw, http):
    """100 x {{input:x}} over a 100 KB variable: a 1 KB request that rendered 10 MB (9.9 s frozen)."""
    base, h = session(http)
    var = http.post(base + "/variables", headers=h, json={"value": "x" * 100_000}).json()["id"]
    with health_probe(gw) as latencies:
        r = http.post(base + "/calls", headers=h, json={
            "model": "smollm2", "template": "{{input:x}} " * 100 + "{{output:o}}", "inputs": {"x": var}})
    assert_error(r, 413, "inputs.x", "context_length_exceeded")
    assert max(latencies) < HEALTH_S
    # a constant input counts the same way; one occurrence of a fitting value is fine
    r = http.post(base + "/calls", headers=h, json={
        "model": "smollm2", "template": "{{input:x}}" * 50 + "{{output:o}}", "inputs": {"x": {"value": "y" * 20_000}}})
    assert_error(r, 413, "inputs.x", "context_length_exceeded")
    r = http.post(base + "/calls", headers=h, json={
        "model": "smollm2", "template": "Say {{input:x}} {{output:o}}", "inputs": {"x": {"value": "hi"}},
        "outputs": {"o": {"sampling": {"max_tokens": 1}}}})
    assert r.status_code == 201, r.text


def test_values_known_only_at_render_are_counted_before_joining(smol_dir):
    from interlace.engine_ext.tokenizer import Tokenizer

    tok = Tokenizer(smol_dir)
    value = ("x" * 100_000, True)
    with pytest.raises(TooLarge, match="bytes of text"):
        prompt_pieces(tok, HERMES, [("Say: ", False)] + [value] * 100, max_bytes=1_000_000)
    with pytest.raises(TooLarge):
        prompt_pieces(tok, HERMES, messages=[("user", [value] * 100)], max_bytes=1_000_000)
    assert prompt_pieces(tok, HERMES, [("Say: ", False), ("hi", True)], max_bytes=1_000_000)


def test_values_set_after_submit_are_counted_before_the_prompt_is_built(gw, http):
    """The value is unknown at submit (a declared variable): the dispatch counts it before joining 10 MB."""
    base, h = session(http)
    var = http.post(base + "/variables", headers=h, json={"name": "x"}).json()["id"]
    r = http.post(base + "/calls", headers=h, json={
        "model": "smollm2", "template": "{{input:x}} " * 100 + "{{output:o}}", "inputs": {"x": var}})
    assert r.status_code == 201, r.text
    out = r.json()["outputs"]["o"]
    with health_probe(gw) as latencies:
        assert http.put(f"{base}/variables/{var}", headers=h, json={"value": "x" * 100_000}).status_code == 200
        r = http.get(f"{base}/variables/{out}", headers=h, params={"timeout_s": 60})
    assert r.status_code == 424, r.text
    error = r.json()["error"]
    assert error["producer_code"] == "prepare_failed" and "bytes of text" in error["message"], error
    assert max(latencies) < HEALTH_S


# --------------------------------------------------------------- large bodies
def test_a_batch_over_the_pending_limit_is_refused_before_it_is_read(gw, http):
    """50,000 calls were read and checked one by one (4.5 s) before their 429."""
    base, h = session(http)
    calls = [{"model": "smollm2", "template": "hi {{output:o}}"}] * 50_000
    with health_probe(gw) as latencies:
        r = http.post(base + "/calls", headers=h, json={"calls": calls})
        r2 = http.post("/v1/sessions", json={"calls": calls})
    assert_error(r, 429, "calls", "session_limit")
    assert_error(r2, 429, "calls", "session_limit")
    assert max(latencies) < HEALTH_S


def test_prompts_that_cannot_fit_are_refused_before_tokenizing(gw):
    """3.5 MB prompts: each froze every client while it was tokenized (15 s in the trial)."""
    body = {"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "hello " * 600_000}]}
    with health_probe(gw) as latencies, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=300),
                                range(4)))
    for r in answers:
        err = assert_error(r, 400, "messages", "context_length_exceeded")
        assert "bytes" in err["message"]
    assert max(latencies) < HEALTH_S


def test_legal_large_bodies_are_processed_off_the_event_loop(gw):
    """20,000 messages: legal JSON within the body limit, whose validation alone takes seconds
    (then the prompt is refused as too long); three at once held the event loop for all of it."""
    body = {"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}] * 20_000}
    with health_probe(gw) as latencies, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=300),
                                range(3)))
    for r in answers:
        assert_error(r, 400, "messages", "context_length_exceeded")
    assert max(latencies) < HEALTH_S


def test_tools_count_toward_the_prompt_bound(http):
    """A 3 MB tool description: tokenizing it held the GIL for seconds (offsets of 750k tokens)."""
    tool = {"type": "function", "function": {"name": "f", "description": "lorem ipsum " * 250_000,
                                             "parameters": {"type": "object", "properties": {}}}}
    r = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 1, "messages": USER,
                                                "tools": [tool]})
    err = assert_error(r, 400, "messages", "context_length_exceeded")
    assert "bytes" in err["message"]


@pytest.mark.parametrize("metadata,param", [({f"k{i}": "v" for i in range(17)}, "metadata"),
                                            ({f"k{i}": "v" for i in range(200_000)}, "metadata"),
                                            ({"k" * 65: "v"}, "metadata"),
                                            ({"k": "v" * 513}, "metadata.k")])
def test_metadata_is_bounded_as_openai_bounds_it(http, metadata, param):
    r = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 1, "messages": USER,
                                                "metadata": metadata})
    assert_error(r, 400, param)


def test_metadata_within_the_limits_is_accepted(http):
    r = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 1, "messages": USER,
                                                "metadata": {f"k{i}": "v" * 512 for i in range(16)}})
    assert r.status_code == 200, r.text


def _schema(n):
    props = {f"p{i}": {"type": "integer"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_oversized_schemas_are_refused_before_compiling(gw, http):
    """5,000 required properties: 3.1 s of the event loop checking and compiling the grammar."""
    with health_probe(gw) as latencies:
        r = http.post("/v1/chat/completions", json={
            "model": "smollm2", "max_tokens": 1, "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema(5000)}}})
    assert_error(r, 400, "response_format.json_schema.schema", "schema_too_large")
    assert max(latencies) < HEALTH_S
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": _schema(1500)}} for i in range(3)]
    r = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 1, "messages": USER,
                                                "tools": tools})
    assert_error(r, 400, "tools[2].function.parameters", "schema_too_large")


# ------------------------------------------------------------ grammar compilation
def test_a_pattern_too_complex_for_the_lexer_is_a_grammar_error(smol_engine):
    gc = GrammarCompiler(smol_engine.tokenizer, vocab_size=smol_engine.vocab_size)
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": TOO_COMPLEX}}}
    with pytest.raises(GrammarError, match="too complex") as e:
        gc.json_schema(schema)
    assert e.value.param == "response_format.json_schema.schema.properties.a.pattern"
    with pytest.raises(GrammarError) as e:
        gc.functions([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "patternProperties": {TOO_COMPLEX: {"type": "string"}}}}}])
    assert e.value.param == "tools[0].function.parameters.patternProperties"
    gc.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+@[a-z]+$"}}})


@pytest.mark.parametrize("stream", [False, True])
def test_a_pattern_too_complex_is_400_not_500(http, stream):
    """It compiled, then failed at the first token inside the string: 500 engine_error, which
    clients retry."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": TOO_COMPLEX}}, "required": ["a"]}
    r = http.post("/v1/chat/completions", json={
        "model": "smollm2", "max_tokens": 5, "messages": USER, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert_error(r, 400, "response_format.json_schema.schema.properties.a.pattern", "invalid_value")
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    r = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 5, "messages": USER,
                                                "tools": [tool], "tool_choice": "required"})
    assert_error(r, 400, "tools[0].function.parameters.properties.a.pattern", "invalid_value")
