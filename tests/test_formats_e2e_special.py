"""The ``deepseek_v31`` and ``kimi_k2`` tool-call formats end to end, over HTTP with the openai client.

One gateway serves the embedded model under both parser names (the models
differ only in name and parser).  For each format: auto with replayed calls
(parallel, text before them), streamed deltas reassembling, ``tool_choice``
required and named (real grammar-constrained decoding: the embedded model has
no such special tokens, so the markers are forced as text), and a server-side
tool whose result is fed back.  The replayed texts are written here by hand,
independently of the formats' own rendering.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Tuple

import jsonschema
import openai
import pytest

from helpers.chat import assemble, calls_of
from helpers.gateway_server import LiveGateway

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather like in Paris, and what time is it there?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]

Call = Tuple[str, Dict[str, Any]]


def _deepseek(cs: List[Call]) -> str:
    return ("<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in cs)
        + "<｜tool▁calls▁end｜>")


def _kimi(cs: List[Call]) -> str:
    return ("<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(cs)) + "<|tool_calls_section_end|>")


WRITE: Dict[str, Callable[[List[Call]], str]] = {"deepseek_v31": _deepseek, "kimi_k2": _kimi}
NAMES = list(WRITE)


def expected_ids(name: str, ids: List[str]) -> bool:
    """DeepSeek writes no call id (generated ones); Kimi's own ids are kept."""
    if name == "kimi_k2":
        return ids == [f"functions.{n}:{i}" for i, (n, _) in enumerate(CALLS)][: len(ids)]
    return all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)


@pytest.fixture(scope="module")
def live():
    m = {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32", "max_model_len": 2048}
    cfg = {"server": {"server_tools": True, "replay": True},
           "models": {name: {**m, "parser": name} for name in NAMES}}
    with LiveGateway(cfg) as gw:
        yield gw


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=600)




@pytest.mark.parametrize("name", NAMES)
def test_auto_parallel_calls_after_text(client, name):
    text = "Let me check both." + WRITE[name](CALLS)
    r = client.chat.completions.create(model=name, messages=USER, tools=TOOLS, max_tokens=300,
                                       extra_body={"interlace": {"replay": text}})
    ch = r.choices[0]
    assert calls_of(ch.message) == CALLS, ch.message
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check both."
    assert expected_ids(name, [tc.id for tc in ch.message.tool_calls])


@pytest.mark.parametrize("name", NAMES)
def test_streaming_deltas_reassemble(client, name):
    chunks = list(client.chat.completions.create(model=name, messages=USER, tools=TOOLS, max_tokens=300, stream=True,
                                                 extra_body={"interlace": {"replay": WRITE[name](CALLS)}}))
    got = assemble(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == CALLS
    assert expected_ids(name, [c["id"] for c in got])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("name", NAMES)
def test_required_and_named_are_forced_in_the_format(client, name):
    """Real decoding under the format's grammar: whatever the small model writes, the format's parser reads
    tool calls that fit the schemas."""
    r = client.chat.completions.create(model=name, messages=USER, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=0)
    ch = r.choices[0]
    ((fn, args),) = calls_of(ch.message)
    jsonschema.validate(args, SCHEMAS[fn])
    assert ch.finish_reason == "tool_calls" and not (ch.message.content or "").strip()
    r = client.chat.completions.create(model=name, messages=USER, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False, max_tokens=200,
        temperature=0)
    ((fn, args),) = calls_of(r.choices[0].message)
    assert fn == "get_time"
    jsonschema.validate(args, SCHEMAS["get_time"])


@pytest.mark.parametrize("name", NAMES)
def test_server_side_tool_result_fed_back(client, name):
    body = dict(model=name, messages=[{"role": "user", "content": "What is 6 times 7?"}], max_tokens=300,
                extra_body={"interlace": {"server_tools": ["calculator"],
                                          "replay": [WRITE[name]([("calculator", {"expression": "6*7"})]),
                                                     "It is 42."]}})
    r = client.chat.completions.create(**body)
    ch = r.choices[0]
    assert ch.message.content.endswith("It is 42.") and ch.finish_reason == "stop", ch.message
    assert ch.message.tool_calls is None
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["name"] == "calculator" and res["ok"] and res["index"] == 0, res
    assert "42" in json.dumps(res["content"])


NAMELESS = {  # a call that names no function (DeepSeek: an empty name; Kimi: an id without its :IDX)
    "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜>'
                    '{"city": "Paris"}<｜tool▁call▁end｜>',
    "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather<|tool_call_argument_begin|>'
               '{"city": "Paris"}<|tool_call_end|>',
}


@pytest.mark.parametrize("name", NAMES)
def test_broken_call_is_content_and_its_sibling_a_call(client, name):
    """A call that breaks before it is passed on (the loop withdraws a passed-on call and stops there)
    comes back as content, its valid sibling after it as a call."""
    text = NAMELESS[name] + WRITE[name](CALLS[1:])
    r = client.chat.completions.create(model=name, messages=USER, tools=TOOLS, max_tokens=300,
                                       extra_body={"interlace": {"replay": text}})
    m = r.choices[0].message
    assert calls_of(m) == CALLS[1:]
    assert m.content and "Paris" in m.content, m.content
