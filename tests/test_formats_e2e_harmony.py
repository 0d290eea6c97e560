"""The harmony format (gpt-oss) end to end through the HTTP API, with the openai client.

One gateway serves the embedded model with parser ``harmony``.  Replayed outputs stand in for a
gpt-oss model where its skill would matter: a reasoning (``analysis``) message and a call come
back as ``tool_calls`` with the reasoning kept out of ``content`` (and in ``reasoning_content``
where the gateway gives that field), streamed deltas reassemble, ``tool_choice`` required and
named force the call message by grammar (real decoding; the arguments fit the schema), and a
server-side tool's result goes back into the context as a ``functions.NAME`` tool message.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

import jsonschema
import openai
import pytest

from helpers.gateway_server import LiveGateway

MODEL = "harmony"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
                   "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USER = [{"role": "user", "content": "What is the weather like in Paris?"}]

THOUGHT = "The user wants the weather in Paris; call get_weather."


def call_text(name: str, args: Dict[str, Any]) -> str:
    """A harmony call message as gpt-oss writes it (by hand, not through the format)."""
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(args)}<|call|>"


# what the model "writes": its reasoning, then a call in a new assistant message
REPLAY = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
          + call_text("get_weather", {"city": "Paris"}))


@pytest.fixture(scope="module")
def live():
    model = {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32", "max_model_len": 2048,
             "parser": MODEL}
    with LiveGateway({"server": {"server_tools": True, "replay": True}, "models": {MODEL: model}}) as gw:
        yield gw


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=600)


def calls_of(message) -> List[tuple]:
    return [(tc.function.name, json.loads(tc.function.arguments)) for tc in message.tool_calls or []]


def test_reasoning_and_call_come_back_apart(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME], max_tokens=150,
                                       extra_body={"interlace": {"replay": REPLAY}})
    ch = r.choices[0]
    assert calls_of(ch.message) == [("get_weather", {"city": "Paris"})], ch.message
    assert ch.finish_reason == "tool_calls"
    assert not (ch.message.content or "").strip()  # neither the reasoning nor any marker is content
    extra = ch.message.model_extra or {}
    if "reasoning_content" in extra:  # where the gateway gives the reasoning its own field
        assert extra["reasoning_content"] == THOUGHT


def test_streaming_deltas_reassemble(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME], max_tokens=150,
                                                 stream=True, extra_body={"interlace": {"replay": REPLAY}}))
    calls: Dict[int, Dict[str, Any]] = {}
    content, reasoning = "", ""
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            e["id"] = tc.id or e["id"]
            if tc.function is not None:
                e["name"] = tc.function.name or e["name"]
                e["arguments"] += tc.function.arguments or ""
    got = [calls[i] for i in sorted(calls)]
    assert [(g["name"], json.loads(g["arguments"])) for g in got] == [("get_weather", {"city": "Paris"})]
    assert got[0]["id"].startswith("call_")
    assert not content.strip() and "Paris;" not in content and "<|" not in content
    assert reasoning in ("", THOUGHT)  # the field, where the gateway streams it, holds the reasoning whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_required_and_named_are_forced_as_harmony_calls(client):
    """Real decoding under the format's grammar: the small model writes a harmony call message, and
    the parser reads a call that fits the schema."""
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0)
    ch = r.choices[0]
    ((fn, args),) = calls_of(ch.message)
    jsonschema.validate(args, SCHEMAS[fn])
    assert ch.finish_reason == "tool_calls" and not (ch.message.content or "").strip()
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME], max_tokens=80,
                                       temperature=0, tool_choice=named)
    got = calls_of(r.choices[0].message)
    assert got and all(fn == "get_time" for fn, _ in got), got
    for _, args in got:
        jsonschema.validate(args, SCHEMAS["get_time"])


def test_server_side_tool_result_is_fed_back(client, live, monkeypatch):
    """A call to the server's calculator (after some reasoning) runs; its result goes into the context as
    the harmony tool message of ``functions.calculator``, and the model's final answer is the content."""
    from interlace.gateway.openai import completions
    from interlace.gateway.openai.plan import build_plan

    appended: List[str] = []  # the results turns the gateway appends, as text
    real = completions.tool_results_turn

    def spy(tokenizer, fmt, results, names=None):
        ids = real(tokenizer, fmt, results, names)
        appended.append(tokenizer.decode(ids))
        return ids

    monkeypatch.setattr(completions, "tool_results_turn", spy)

    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    first = "<|channel|>analysis<|message|>Use the calculator.<|end|><|start|>assistant" + call_text(
        "calculator", {"expression": "6*7"})
    answer = "<|channel|>final<|message|>It is 42.<|return|>"
    extra = {"interlace": {"server_tools": ["calculator"], "replay": [first, answer]}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=150, extra_body=extra)
    gw = live.gateway
    plan = build_plan(gw.models[MODEL], {"model": MODEL, "messages": messages, **extra},
                      available_tools=gw.runtime.tools, default_max_tokens=gw.config.default_max_tokens,
                      max_tool_rounds=gw.config.max_tool_rounds)
    assert r.usage.prompt_tokens > len(plan.prompt_ids) + 5  # a resumed round: the result is in the context
    ch = r.choices[0]
    assert ch.message.content == "It is 42." and ch.finish_reason == "stop", ch.message
    assert ch.message.tool_calls is None
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["name"] == "calculator" and res["ok"] and "42" in json.dumps(res["content"]), res
    # the results turn the gateway appended names the call, as harmony writes a tool's message
    assert appended and all("<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>" in t
                            for t in appended), appended
