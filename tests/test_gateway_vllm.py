"""The gateway unchanged on the vLLM engine: a model configured with
``engine: {kind: vllm}`` answers chat, tools (client- and server-side, with
partial execution), constrained decoding and streaming as the native engine
does -- and its greedy text equals the native engine's for the same request."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh --test (the CPU build here)")

import openai  # noqa: E402

from helpers.gateway_server import LiveGateway  # noqa: E402

KEY = "sk-vllm-test"
VLLM = {"kind": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_space_gb": 1, "max_model_len": 2048}
NATIVE = {"path": "embedded", "dtype": "float32", "kv_cache_tokens": 4096}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "What is the capital of France? One word."}]


@pytest.fixture(scope="module")
def live():
    cfg = {"server": {"api_keys": [KEY], "server_tools": True, "replay": True},
           "models": {"vllm": {"path": "embedded", "engine": VLLM},
                      "vllm-code": {"path": "embedded", "engine": VLLM, "parser": "markdown"},
                      "native": NATIVE},
           # FCFS: LAMPS on vLLM would measure a profile first (cached; a minute on this CPU)
           "engine": {"ranking": "fcfs"}}
    with LiveGateway(cfg) as gw:
        yield gw


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=180)


def test_one_vllm_engine_serves_both_parsers(live):
    models = live.gateway.models
    assert type(models["vllm"].engine).__name__ == "VLLMEngine"
    assert models["vllm"].engine is models["vllm-code"].engine


def test_greedy_chat_equals_the_native_engine(client):
    kw = dict(messages=USER, max_tokens=24, temperature=0)
    v = client.chat.completions.create(model="vllm", **kw)
    n = client.chat.completions.create(model="native", **kw)
    assert v.choices[0].message.content == n.choices[0].message.content
    assert v.usage.prompt_tokens == n.usage.prompt_tokens
    assert v.usage.completion_tokens == n.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="vllm", stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == v.choices[0].message.content


def test_client_side_tool_call_is_parsed(client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = client.chat.completions.create(model="vllm", messages=USER, tools=[WEATHER], max_tokens=60,
                                       extra_body={"interlace": {"replay": call}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    (tc,) = ch.message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}


def test_server_side_tool_with_partial_execution_pauses_and_resumes(client):
    code = ("```python\nimport math\nvalues = [math.sqrt(i) for i in range(10)]\ntotal = round(sum(values), 3)\n"
            "print(total)\n```\n")
    r = client.chat.completions.create(model="vllm-code", messages=[{"role": "user", "content": "sum sqrt"}],
                                       max_tokens=200, extra_body={"interlace": {
                                           "server_tools": ["python"], "replay": [code, "The total is 19.306."]}})
    assert r.choices[0].message.content == "The total is 19.306."
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["ok"] and res["content"]["stdout"].strip() == "19.306"
    assert res["content"]["statements_run_early"] >= 3  # ran while vLLM was still decoding


def test_tool_choice_required_is_a_grammar_vllm_enforces(client):
    r = client.chat.completions.create(model="vllm", messages=[{"role": "user", "content": "Weather in Rome?"}],
                                       tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0)
    (tc,) = r.choices[0].message.tool_calls[:1]
    assert tc.function.name == "get_weather"
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER["function"]["parameters"])


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    r = client.chat.completions.create(model="vllm", messages=USER, max_tokens=40, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_semantic_variables_dag_equals_the_native_engines(live):
    """Parrot's DAG (a shared prefix, two branches, a join) runs server-side
    on vLLM -- forks, fills and frees through the protocol -- with the native
    engine's greedy values."""
    import httpx

    def run(model):
        with httpx.Client(base_url=live.url, timeout=180) as http:
            r = http.post("/v1/sessions", json={}, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 201, r.text
            sid, h = r.json()["id"], {"Authorization": f"Bearer {r.json()['token']}"}

            def llm(template, inputs):
                out = {"out": {"sampling": {"max_tokens": 6, "temperature": 0}}}
                r = http.post(f"/v1/sessions/{sid}/calls", headers=h,
                              json={"model": model, "template": template, "inputs": inputs, "outputs": out})
                assert r.status_code == 201, r.text
                return r.json()["outputs"]["out"]

            r = http.post(f"/v1/sessions/{sid}/variables", json={"value": "green tea"}, headers=h)
            topic = r.json()["id"]
            a = llm("Topic: {{input:t}}. One word about it: {{output:out}}", {"t": topic})
            b = llm("Topic: {{input:t}}. Another word: {{output:out}}", {"t": topic})
            d = llm("Words: {{input:a}} and {{input:b}}. Joined: {{output:out}}", {"a": a, "b": b})
            values = [http.get(f"/v1/sessions/{sid}/variables/{v}", headers=h).json()["value"] for v in (a, b, d)]
            assert http.delete(f"/v1/sessions/{sid}", headers=h).status_code == 200
            return values

    values = run("vllm")
    assert all(isinstance(v, str) and v for v in values), values
    assert values == run("native")


def test_a_client_side_tool_calls_follow_up_resumes_on_the_kept_kv(live, client):
    """Issue 37: the context of a reply that ends with a client-side tool call
    stays pinned inside vLLM (the retention store parks it); the follow-up with
    the tool's result decodes on it, so its cached tokens go past the whole
    blocks a prefix cache could give, and /metrics counts the pin's hit."""
    import httpx

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    msgs = [{"role": "user", "content": "I am planning a walk along the Seine this afternoon. " * 8
             + "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="vllm", messages=msgs, tools=[WEATHER], max_tokens=60,
                                       extra_body={"interlace": {"replay": call}})
    (tc,) = r.choices[0].message.tool_calls
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": tc.id, "type": "function", "function": {"name": tc.function.name,
                                                        "arguments": tc.function.arguments}}]},
        {"role": "tool", "tool_call_id": tc.id, "content": "21 C and sunny"}]
    r2 = client.chat.completions.create(model="vllm", messages=follow, tools=[WEATHER], max_tokens=8, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r.usage.prompt_tokens, (cached, r.usage, r2.usage)
    assert cached > (r2.usage.prompt_tokens - 1) // 128 * 128  # more than the prefix cache's whole blocks
    text = httpx.get(live.url + "/metrics").text
    text = httpx.get(live.url + "/metrics").text  # one scrape behind: the first read asks for fresh counts
    hits = [ln for ln in text.splitlines() if ln.startswith('interlace_pins_total{model="vllm",outcome="hit"}')]
    assert hits and float(hits[0].split()[-1]) >= 1, hits
