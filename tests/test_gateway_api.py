"""The official openai client against a real gateway on loopback."""

from __future__ import annotations

import json
import sqlite3
import time

import httpx
import openai
import psutil
import pytest

from helpers.gateway_server import LiveGateway, engine_state, wait_idle

KEY = "test-key"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
                   "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = tmp_path_factory.mktemp("gw")
    db = d / "shop.sqlite"
    con = sqlite3.connect(db)
    con.execute("create table items(name text, price real)")
    con.executemany("insert into items values (?, ?)", [("apple", 0.5), ("pear", 0.75)])
    con.commit()
    con.close()
    # float32 pinned: the default ("auto") is bfloat16 on CPUs that have it, and the
    # greedy outputs these tests read must not depend on the CI machine's CPU.
    m = {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32"}
    # replay and server tools are off by default: this gateway's one key may use both
    cfg = {"server": {"api_keys": [KEY], "server_tools": True, "replay": True},
           "models": {"smollm2": m, "smollm2-code": {**m, "parser": "markdown"}},
           "tools": {"sqlite": {"database": str(db)}}}
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    with LiveGateway(cfg) as gw:
        yield gw
    # after shutdown: no tool workers left behind
    time.sleep(0.5)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before
            and "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's own singleton
    assert not left, f"leaked processes: {[p.cmdline() for p in left]}"


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models_health_plugins_metrics(live, client):
    assert [m.id for m in client.models.list().data] == ["smollm2", "smollm2-code"]
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    plugins = httpx.get(live.url + "/v1/plugins", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    tools = {t["name"]: t for p in plugins for t in p["tools"]}
    assert {"python", "calculator", "sqlite", "search", "format"} <= set(tools)
    assert tools["search"]["enabled"] is False  # no corpus configured
    parsers = {n for p in plugins for n in p["parsers"]}
    assert {"hermes", "mistral", "llama3_json", "pythonic", "markdown", "plan"} <= parsers
    client.chat.completions.create(model="smollm2", messages=USER, max_tokens=2)
    text = httpx.get(live.url + "/metrics").text
    assert "interlace_requests_total" in text and "interlace_kv_blocks_in_use" in text
    assert 'interlace_tokens_total{kind="completion",model="smollm2"}' in text


def test_plain_chat(live, client):
    r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=12,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert wait_idle(live)["contexts"] == 0


def test_streaming_with_usage(live, client):
    stream = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_tool_choice_none_and_auto(live, client):
    """The same replayed call text: content with tool_choice "none" (the tools
    are still in the prompt, as with OpenAI), a tool call with "auto"."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    replay = {"interlace": {"replay": call}}
    bare = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=60, extra_body=replay)
    none = client.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER, TIME], tool_choice="none",
                                          max_tokens=60, extra_body=replay)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content == call
    # auto, with the model's output replayed so the test does not depend on the small model's skill
    r = client.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER, TIME], tool_choice="auto",
                                       max_tokens=60, extra_body=replay)
    assert none.usage.prompt_tokens == r.usage.prompt_tokens > bare.usage.prompt_tokens + 50  # tools shown
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    (tc,) = ch.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather" and tc.id.startswith("call_")
    assert json.loads(tc.function.arguments) == {"city": "Paris", "unit": "celsius"}
    # the client runs the tool and sends the history back
    r2 = client.chat.completions.create(model="smollm2", max_tokens=20, temperature=0, tools=[WEATHER], messages=USER + [
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21, "sky": "sunny"}'}])
    assert r2.choices[0].message.content


def test_streaming_tool_call_deltas(live, client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    chunks = list(client.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER], stream=True,
                                                 max_tokens=60, extra_body={"interlace": {"replay": call}}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert rest and all(d.id is None and d.function.name is None for d in rest)
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_server_side_tools_with_partial_execution(live, client):
    code = ("```python\nimport math\nvalues = [math.sqrt(i) for i in range(10)]\ntotal = round(sum(values), 3)\n"
            "print(total)\n```\n")
    r = client.chat.completions.create(model="smollm2-code", messages=[{"role": "user", "content": "sum sqrt"}],
                                       max_tokens=200, extra_body={"interlace": {
                                           "server_tools": ["python"], "replay": [code, "The total is 19.306."]}})
    assert r.choices[0].message.content == "The total is 19.306."
    assert r.choices[0].finish_reason == "stop"
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["name"] == "python" and res["ok"] and res["partial_execution"]
    assert res["content"]["stdout"].strip() == "19.306"
    assert res["content"]["statements_run_early"] >= 3  # ran while the model was still decoding
    # the same with partial execution off: same result, nothing run early
    r = client.chat.completions.create(model="smollm2-code", messages=[{"role": "user", "content": "sum sqrt"}],
                                       max_tokens=200, extra_body={"interlace": {
                                           "server_tools": ["python"], "partial_execution": False,
                                           "replay": [code, "The total is 19.306."]}})
    (off,) = r.model_extra["interlace"]["tool_calls"]
    assert off["content"]["stdout"].strip() == "19.306" and not off["partial_execution"]


def test_server_side_sqlite_streaming_events(live, client):
    call = ('<tool_call>\n{"name": "sqlite", "arguments": {"query": "select name from items where price < 0.6"}}'
            '\n</tool_call>')
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "cheap items?"}], stream=True, max_tokens=120,
        extra_body={"interlace": {"server_tools": ["sqlite"], "replay": [call, "Apples are cheap."]}}))
    ext = [c.model_extra.get("interlace") for c in chunks if c.model_extra.get("interlace")]
    assert ext[0]["tool_call_start"]["name"] == "sqlite"
    result = next(e["tool_result"] for e in ext if "tool_result" in e)
    assert result["ok"] and "apple" in json.dumps(result["content"])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Apples are cheap."
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)  # server calls are not client calls


def test_invalid_argument_aborts_decoding_early(live, client):
    # "query" must be a string: the call is aborted at that field, before the rest is decoded
    long_tail = ", ".join(f'"p{i}": {i}' for i in range(40))
    call = '<tool_call>\n{"name": "sqlite", "arguments": {"query": 42, ' + long_tail + '}}\n</tool_call>'
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "q"}], max_tokens=400,
                                       extra_body={"interlace": {"server_tools": ["sqlite"], "max_tool_rounds": 1,
                                                                 "replay": [call, "Sorry."]}})
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert not res["ok"] and res["aborted_early"] and "query" in res["error"]
    assert r.usage.completion_tokens < 60, r.choices[0].message.content  # the long tail was never decoded


ERRORS = [
    ({"model": "nope", "messages": USER}, 404, "model_not_found"),
    ({"model": "smollm2", "messages": []}, 400, "invalid_value"),
    ({"model": "smollm2", "messages": USER, "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "unknown_tool"),
    ({"model": "smollm2", "messages": USER, "interlace": {"server_tools": ["nope"]}}, 400, "unknown_tool"),
    ({"model": "smollm2", "messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]},
     400, "invalid_value"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "word " * 9000}]}, 400,
     "context_length_exceeded"),
    ({"model": "smollm2", "messages": USER, "max_tokens": 10 ** 6}, 400, "context_length_exceeded"),
    ({"model": "smollm2", "messages": USER, "temperature": 5}, 400, "invalid_value"),
    ({"model": "smollm2", "messages": USER, "tools": [{"type": "function", "function": {
        "name": "bad", "parameters": {"type": "not-a-type"}}}]}, 400, "invalid_value"),
]


@pytest.mark.parametrize("body,status,code", ERRORS, ids=[e[2] + str(i) for i, e in enumerate(ERRORS)])
def test_error_paths(live, body, status, code):
    r = httpx.post(live.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and "type" in err and "param" in err
    st = engine_state(live)
    assert st["contexts"] == 0


def test_error_paths_through_openai_client(live, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 9000}])
    assert e.value.code == "context_length_exceeded"
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="smollm2", messages=USER)


def test_malformed_json(live):
    r = httpx.post(live.url + "/v1/chat/completions", content=b'{"model": "smollm2", "messages": [',
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_client_disconnect_frees_context(live):
    body = {"model": "smollm2", "messages": USER, "max_tokens": 2000, "stream": True, "temperature": 0,
            "interlace": {"replay": "word " * 1500}}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        for i, _ in enumerate(lines):
            if i == 6:
                assert engine_state(live)["contexts"] == 1  # generating, client still reading
                break
        lines.close()  # the client goes away mid-stream (closes the connection)
    st = wait_idle(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0


def test_no_leaked_contexts_or_blocks(live):
    st = wait_idle(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0


def test_tool_choice_required_and_named_are_enforced(live, client):
    import jsonschema

    r = client.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=200, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    for tc in ch.message.tool_calls:
        schema = {"get_weather": WEATHER, "get_time": TIME}[tc.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(tc.function.arguments), schema)
    r = client.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER, TIME], max_tokens=200,
                                       temperature=0, tool_choice={"type": "function",
                                                                   "function": {"name": "get_time"}})
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "get_time"
    jsonschema.validate(json.loads(tc.function.arguments), TIME["function"]["parameters"])


def test_response_format_json_schema_and_object(live, client):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                               "size": {"enum": ["small", "medium", "large"]}},
              "required": ["city", "population", "size"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smollm2", max_tokens=80, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model="smollm2", max_tokens=60, temperature=0,
                                       messages=[{"role": "user", "content": "Give me a JSON object."}],
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=USER, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "x"}}})


def test_logprobs_and_single_tool_call(live, client):
    r = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=5, temperature=0, logprobs=True)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(t.logprob <= 0 for t in lp)
    assert "".join(t.token for t in lp) == r.choices[0].message.content
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    both = client.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER], max_tokens=80,
                                          extra_body={"interlace": {"replay": two}})
    assert [json.loads(t.function.arguments)["city"] for t in both.choices[0].message.tool_calls] == ["Paris", "Rome"]
    one = client.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER], max_tokens=80,
                                         parallel_tool_calls=False, extra_body={"interlace": {"replay": two}})
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"
    assert one.usage.completion_tokens < both.usage.completion_tokens  # decoding stopped after the first call
