"""Every built-in tool-call format end to end through the HTTP API.

One gateway serves the embedded model under one name per format (the models
differ only in name and parser, so they share one engine).  For each format:
auto (replayed call text -> tool_calls), parallel calls, streaming deltas,
``tool_choice`` required / named (grammar-forced, real decoding), and
server-side tools (the gateway runs the tool, feeds the result back, the model
answers).  Replay is used wherever the small model's skill would matter.

Then the completion loop's rules, on the hermes model: malformed calls, calls
to tools that were not offered, ``max_tool_rounds``, call numbering, tool
results larger than the context, ``replay`` with constraints, the default
``max_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import httpx
import jsonschema
import openai
import pytest

from helpers.chat import assemble, calls_of, post
from helpers.gateway_server import LiveGateway

MAX_MODEL_LEN = 2048

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
                   "additionalProperties": False}}}
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Run Python code",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME, PYTHON)}
USER = [{"role": "user", "content": "What is the weather like in Paris, and what time is it there?"}]

Call = Tuple[str, Dict[str, Any]]


def _kwargs(a: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items())


@dataclass
class Fmt:
    """How one format writes calls, for replays (written by hand, independently of the parsers)."""

    tools: List[Dict[str, Any]]
    calls: List[Call]                       # two calls, for the parallel case
    write: Callable[[List[Call]], str]      # calls -> the model's text
    server_call: Call                       # a call to a server tool that returns 42
    forceable: bool = True                  # tool_choice required / named can be enforced


FORMATS: Dict[str, Fmt] = {
    "hermes": Fmt(
        [WEATHER, TIME], [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
        lambda cs: "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>'
                             for n, a in cs),
        ("calculator", {"expression": "6*7"})),
    "mistral": Fmt(
        [WEATHER, TIME], [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
        lambda cs: "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in cs]),
        ("calculator", {"expression": "6*7"})),
    "llama3_json": Fmt(
        [WEATHER, TIME], [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
        lambda cs: "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in cs),
        ("calculator", {"expression": "6*7"})),
    "pythonic": Fmt(
        [WEATHER, TIME], [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
        lambda cs: "[" + ", ".join(f"{n}({_kwargs(a)})" for n, a in cs) + "]",
        ("calculator", {"expression": "6*7"})),
    "markdown": Fmt(
        [PYTHON], [("python", {"code": "x = 6 * 7\n"}), ("python", {"code": "print(x)\n"})],
        lambda cs: "".join(f"```python\n{a['code']}```\n" for _, a in cs),
        ("python", {"code": "print(6 * 7)\n"})),
    "plan": Fmt(
        [WEATHER, TIME], [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
        lambda cs: "".join(f"${i} = {n}({', '.join(json.dumps(v) for v in a.values())})\n"
                           for i, (n, a) in enumerate(cs, 1)) + f"{len(cs) + 1}. join()",
        ("calculator", {"expression": "6*7"}), forceable=False),
}
NAMES = list(FORMATS)


@pytest.fixture(scope="module")
def live():
    m = {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32", "max_model_len": MAX_MODEL_LEN}
    cfg = {"server": {"server_tools": True, "replay": True},
           "models": {name: {**m, "parser": name} for name in NAMES}}
    with LiveGateway(cfg) as gw:
        yield gw


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=600)





# ======================================================== every format, end to end
@pytest.mark.parametrize("name", NAMES)
def test_auto_parallel_calls(client, name):
    f = FORMATS[name]
    r = client.chat.completions.create(model=name, messages=USER, tools=f.tools, max_tokens=100,
                                       extra_body={"interlace": {"replay": f.write(f.calls)}})
    ch = r.choices[0]
    assert calls_of(ch.message) == f.calls, ch.message
    assert ch.finish_reason == "tool_calls" and not (ch.message.content or "").strip()
    assert all(tc.id.startswith("call_") for tc in ch.message.tool_calls)


@pytest.mark.parametrize("name", NAMES)
def test_streaming_deltas_reassemble(client, name):
    f = FORMATS[name]
    chunks = list(client.chat.completions.create(model=name, messages=USER, tools=f.tools, max_tokens=100,
                                                 stream=True, extra_body={"interlace": {"replay": f.write(f.calls)}}))
    got = assemble(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == f.calls
    assert all(c["id"].startswith("call_") for c in got)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("name", NAMES)
def test_required_and_named_are_forced_in_the_format(client, live, name):
    """Real decoding under the format's grammar: whatever the small model
    writes, the format's parser reads tool calls that fit the schemas."""
    f = FORMATS[name]
    if not f.forceable:
        r = post(live, {"model": name, "messages": USER, "tools": f.tools, "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        return
    # markdown: the small model's forced code block does not close within a short max_tokens, so its
    # grammar is checked on a replayed block (the replay must satisfy the grammar, else 400)
    replay = {"interlace": {"replay": "```python\nprint(6 * 7)\n```"}} if name == "markdown" else None
    r = client.chat.completions.create(model=name, messages=USER, tools=f.tools, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0, extra_body=replay)
    ch = r.choices[0]
    ((fn, args),) = calls_of(ch.message)
    jsonschema.validate(args, SCHEMAS[fn])
    assert ch.finish_reason == "tool_calls" and not (ch.message.content or "").strip()
    named = f.calls[-1][0]  # get_time; the code tool for markdown (its only callable tool)
    r = client.chat.completions.create(model=name, messages=USER, tools=f.tools, max_tokens=80, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": named}},
                                       extra_body=replay)
    ((fn, args),) = calls_of(r.choices[0].message)
    assert fn == named
    jsonschema.validate(args, SCHEMAS[named])


def plan_of(gw, model, body):
    """The plan the chat route makes of ``body``, with the gateway's tools and limits."""
    from interlace.gateway.openai.plan import build_plan

    return build_plan(model, body, available_tools=gw.runtime.tools, default_max_tokens=gw.config.default_max_tokens,
                      max_tool_rounds=gw.config.max_tool_rounds)


@pytest.mark.parametrize("name", NAMES)
def test_server_side_tool_result_fed_back(client, live, name):
    f = FORMATS[name]
    tool = f.server_call[0]
    body = dict(model=name, messages=[{"role": "user", "content": "What is 6 times 7?"}], max_tokens=150,
                extra_body={"interlace": {"server_tools": [tool], "replay": [f.write([f.server_call]), "It is 42."]}})
    r = client.chat.completions.create(**body)
    prompt = plan_of(live.gateway, live.gateway.models[name],
                     {"model": name, "messages": body["messages"], **body["extra_body"]}).prompt_ids
    assert r.usage.prompt_tokens > len(prompt) + 5  # the result went into the context (a resumed round)
    ch = r.choices[0]
    assert ch.message.content.endswith("It is 42.") and ch.finish_reason == "stop", ch.message
    assert ch.message.tool_calls is None
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["name"] == tool and res["ok"] and res["index"] == 0, res
    assert "42" in json.dumps(res["content"])


def test_plan_step_waits_for_the_step_it_refers_to(client):
    """A plan step that refers to an earlier step (``$1``) runs with that step's result in place of the
    reference, its positional argument named by the tool's schema; ``join()`` runs nothing."""
    plan = '$1 = calculator("6*7")\n$2 = calculator("$1 + 1")\n3. join()'
    r = client.chat.completions.create(
        model="plan", messages=[{"role": "user", "content": "What is 6 times 7, plus one?"}], max_tokens=150,
        extra_body={"interlace": {"server_tools": ["calculator"], "replay": [plan, "It is 43."]}})
    ch = r.choices[0]
    assert ch.message.content.endswith("It is 43.") and ch.finish_reason == "stop", ch.message
    first, second = r.model_extra["interlace"]["tool_calls"]  # join() is not a call
    assert first["ok"] and second["ok"], (first, second)
    assert "42" in json.dumps(first["content"]) and "43" in json.dumps(second["content"]), second


# ============================================================ the loop's rules
BAD_CALLS = {
    "broken JSON": '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
    "arguments not an object": '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
    "tool not offered": '<tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>',
}


def test_call_to_a_tool_not_offered_is_content_not_a_tool_call(client):
    """A call to a tool the request did not offer is never passed on: it comes back as content, and
    the good sibling after it still comes through, as index 0."""
    good = FORMATS["hermes"].write(FORMATS["hermes"].calls[:1])
    text = BAD_CALLS["tool not offered"] + "\n" + good
    body = dict(model="hermes", messages=USER, tools=[WEATHER, TIME], max_tokens=150,
                extra_body={"interlace": {"replay": text}})
    r = client.chat.completions.create(**body)
    m = r.choices[0].message
    assert calls_of(m) == FORMATS["hermes"].calls[:1] and r.choices[0].finish_reason == "tool_calls"
    assert m.content and "rm_rf" in m.content, m.content
    chunks = list(client.chat.completions.create(**body, stream=True))
    got = assemble(chunks)  # no fragment of the bad call ever reached the client
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == FORMATS["hermes"].calls[:1]


@pytest.mark.parametrize("what", ["broken JSON", "arguments not an object"])
def test_malformed_client_call_is_withdrawn(client, what):
    """A call to an offered tool is passed on at its name; when it then turns out malformed it is
    withdrawn (completions.py): its arguments are closed to a valid JSON object, decoding stops (the
    good sibling after it is never decoded), ``finish_reason`` is "stop", never "tool_calls", and
    ``interlace.withdrawn_tool_calls`` names it -- streamed or not, the same answer."""
    good = FORMATS["hermes"].write(FORMATS["hermes"].calls[:1])
    text = BAD_CALLS[what] + "\n" + good
    body = dict(model="hermes", messages=USER, tools=[WEATHER, TIME], max_tokens=150,
                extra_body={"interlace": {"replay": text}})
    r = client.chat.completions.create(**body)
    ch = r.choices[0]
    assert calls_of(ch.message) == [("get_weather", {})] and ch.message.content is None, ch.message
    assert ch.finish_reason == "stop" and r.model_extra["interlace"]["withdrawn_tool_calls"] == [0]
    chunks = list(client.chat.completions.create(**body, stream=True))
    got = assemble(chunks)
    assert [(c["name"], c["arguments"]) for c in got] == [(tc.function.name, tc.function.arguments)
                                                          for tc in ch.message.tool_calls]
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "stop" and last.model_extra["interlace"]["withdrawn_tool_calls"] == [0]


def test_unknown_tool_in_server_loop_is_an_error_result(client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = client.chat.completions.create(
        model="hermes", messages=USER, max_tokens=150,
        extra_body={"interlace": {"server_tools": ["calculator"], "replay": [call, "I cannot check."]}})
    ch = r.choices[0]
    assert ch.message.content == "I cannot check." and ch.message.tool_calls is None
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert not res["ok"] and "get_weather" in res["error"] and "calculator" in res["error"], res


def test_max_tool_rounds_reached_is_not_tool_calls(client):
    calc = FORMATS["hermes"].write([("calculator", {"expression": "1+1"})])
    r = client.chat.completions.create(
        model="hermes", messages=[{"role": "user", "content": "add"}], max_tokens=200,
        extra_body={"interlace": {"server_tools": ["calculator"], "max_tool_rounds": 1,
                                  "replay": [calc, calc, "Done."]}})
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.tool_calls is None
    first, second = r.model_extra["interlace"]["tool_calls"]
    assert first["ok"] and first["index"] == 0
    assert not second["ok"] and "max_tool_rounds" in second["error"] and second["index"] == 1


def test_client_calls_numbered_from_zero_after_server_calls(client):
    calc = FORMATS["hermes"].write([("calculator", {"expression": "1+1"})])
    weather = FORMATS["hermes"].write([("get_weather", {"city": "Paris"})])
    body = dict(model="hermes", messages=USER, tools=[WEATHER], max_tokens=200,
                extra_body={"interlace": {"server_tools": ["calculator"], "replay": [calc, weather]}})
    r = client.chat.completions.create(**body)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and calls_of(ch.message) == [("get_weather", {"city": "Paris"})]
    assert r.model_extra["interlace"]["tool_calls"][0]["index"] == 0
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and {d.index for d in deltas} == {0}
    assert [(c["name"], json.loads(c["arguments"])) for c in assemble(chunks)] == [("get_weather", {"city": "Paris"})]


def test_required_allows_parallel_calls_unless_disabled(live):
    """The forced replay must satisfy the grammar: two calls pass under
    ``required`` (parallel by default), and are refused with
    ``parallel_tool_calls: false``."""
    two = FORMATS["hermes"].write(FORMATS["hermes"].calls)
    body = {"model": "hermes", "messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
            "max_tokens": 100, "interlace": {"replay": two}}
    r = post(live, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 2
    r = post(live, {**body, "parallel_tool_calls": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "interlace.replay", r.text


def test_replay_keeps_response_format(live):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    body = {"model": "hermes", "messages": USER, "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    ok = post(live, {**body, "interlace": {"replay": '{"n": 4}'}})
    assert ok.status_code == 200 and json.loads(ok.json()["choices"][0]["message"]["content"]) == {"n": 4}
    for bad in ('{"n": "four"}', "four", '{"n": 4'):
        r = post(live, {**body, "interlace": {"replay": bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "interlace.replay", (bad, r.text)


def test_huge_tool_result_is_truncated_not_a_client_error(client):
    template = "{0:x>1000}" * 12  # 12 000 characters, about 3000 tokens: more than the 2048-token context
    call = FORMATS["hermes"].write([("format", {"template": template, "values": ["x"]})])
    r = client.chat.completions.create(
        model="hermes", messages=[{"role": "user", "content": "pad"}], max_tokens=300,
        extra_body={"interlace": {"server_tools": ["format"], "replay": [call, "Padded."]}})
    ch = r.choices[0]
    assert ch.message.content == "Padded." and ch.finish_reason == "stop"
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["ok"] and len(res["content"]) == 12000
    cut = res["truncated"]
    assert cut["total_chars"] == 12000 and 0 < cut["shown_chars"] < 12000
    assert r.usage.total_tokens <= MAX_MODEL_LEN


def test_default_max_tokens_is_bounded(live):
    gw = live.gateway
    plan = plan_of(gw, gw.models["hermes"], {"model": "hermes", "messages": USER})
    assert plan.sampling.max_tokens == min(gw.config.default_max_tokens, MAX_MODEL_LEN - len(plan.prompt_ids))
    assert plan.sampling.max_tokens < MAX_MODEL_LEN - len(plan.prompt_ids)


def test_no_leaked_contexts(live):
    import asyncio
    import time

    eng = live.gateway.models["hermes"].engine
    for m in live.gateway.models.values():  # contexts kept on purpose for client tool-call follow-ups
        if m.retention is not None:
            m.retention.clear()
    deadline = time.time() + 10
    while (st := asyncio.run(eng.check_invariants()))["contexts"] and time.time() < deadline:
        time.sleep(0.1)
    assert st["contexts"] == 0 and st["used_blocks"] == 0


def test_special_tokens_are_decoded_when_the_format_needs_them(live):
    gw = live.gateway
    for name in NAMES:
        model = gw.models[name]
        with_tools = plan_of(gw, model, {"model": name, "messages": USER, "tools": [WEATHER]}).sampling
        assert with_tools.skip_special_tokens is not bool(model.tool_format.special_tokens), name
        for body in ({}, {"tools": [WEATHER], "tool_choice": "none"}):  # nothing parsed: plain decoding
            plain = plan_of(gw, model, {"model": name, "messages": USER, **body}).sampling
            assert plain.skip_special_tokens is True, (name, body)
    assert gw.models["mistral"].tool_format.special_tokens  # [TOOL_CALLS]: the case that matters
