"""Forcing a server-side tool (issue 30, item 2): ``tool_choice`` "required" or a named function
over the tools ``interlace.server_tools`` offers, with or without client ``tools``.

Before, both were refused (400 "needs at least one tool", 400 "not in tools"), and an answer in
which no call ran had no ``interlace`` key, so README's ``r.model_extra["interlace"]["tool_calls"]``
raised.  Now the grammar covers the client's tools and the requested server tools, the forced call
runs here and decoding goes on, free, after its result (forcing covers the first round only:
gateway/openai/plan.py says why); the answer always carries ``interlace.tool_calls`` when server
tools were asked for, and a stream's finish chunk carries the same list.  The last test runs
README's example as written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List

import httpx
import openai
import pytest

from helpers.gateway_server import LiveGateway

CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Use the calculator: 6*7"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def live():
    cfg = {"server": {"server_tools": ["calculator"], "replay": True},
           "models": {"smollm2": {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32",
                                  "max_model_len": 2048, "parser": "hermes"}}}
    with LiveGateway(cfg) as gw:
        yield gw


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=600)


def post(live, body: Dict[str, Any]) -> httpx.Response:
    return httpx.post(live.url + "/v1/chat/completions", json={"model": "smollm2", **body}, timeout=600)


def stream(live, body: Dict[str, Any]) -> List[Dict[str, Any]]:
    with httpx.stream("POST", live.url + "/v1/chat/completions", json={"model": "smollm2", "stream": True, **body},
                      timeout=600) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_required_forces_a_server_tool_decoded_freely(live):
    """Real decoding: the 135M model, which never calls a tool when free, is forced to; the call
    runs here, and the answer goes on after its result (more prompt tokens: the result went in)."""
    r = post(live, {"messages": ASK, "tool_choice": "required", "max_tokens": 60, "temperature": 0,
                    "interlace": {"server_tools": ["calculator"]}})
    assert r.status_code == 200, r.text
    out = r.json()
    (res,) = out["interlace"]["tool_calls"]
    assert res["name"] == "calculator" and res["ok"], res
    assert res["content"]["result"] == 42, res
    ch = out["choices"][0]
    assert "tool_calls" not in ch["message"] and ch["finish_reason"] in ("stop", "length"), ch


def test_named_server_tool_is_forced_then_the_answer_is_free(client):
    """A named server tool: exactly that call, run here, then the second piece (the answer) decodes
    unconstrained; the forced round leaves no content of its own."""
    r = client.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=80, tool_choice={"type": "function", "function": {"name": "calculator"}},
        extra_body={"interlace": {"server_tools": ["calculator"], "replay": [CALC, "It is 42."]}})
    ch = r.choices[0]
    assert ch.message.content == "It is 42." and ch.finish_reason == "stop" and ch.message.tool_calls is None, ch
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["name"] == "calculator" and res["ok"] and res["content"]["result"] == 42, res


def test_forced_grammar_is_the_union_of_client_and_server_tools(live):
    """``required`` with a client tool and a server tool allows either; naming the server tool
    allows only it (a replayed client call is refused by the grammar)."""
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 80, "interlace": {"server_tools": ["calculator"]}}
    r = post(live, {**body, "tool_choice": "required", "interlace": {**body["interlace"], "replay": weather}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert out["interlace"] == {"tool_calls": []}  # asked for, none ran: still there
    r = post(live, {**body, "tool_choice": {"type": "function", "function": {"name": "calculator"}},
                    "interlace": {**body["interlace"], "replay": weather}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "interlace.replay", r.text


def test_stream_carries_the_result_and_the_list_on_the_finish_chunk(live):
    chunks = stream(live, {"messages": ASK, "tool_choice": "required", "max_tokens": 80,
                           "interlace": {"server_tools": ["calculator"], "replay": [CALC, "It is 42."]}})
    results = [c["interlace"]["tool_result"] for c in chunks if "tool_result" in c.get("interlace", {})]
    assert [r["content"]["result"] for r in results] == [42]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"
    assert finish[0]["interlace"] == {"tool_calls": results}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "It is 42."
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"])


def test_interlace_is_there_when_no_call_ran(live):
    body = {"messages": ASK, "max_tokens": 20, "interlace": {"server_tools": ["calculator"], "replay": "Hello."}}
    r = post(live, body)
    assert r.status_code == 200, r.text
    assert r.json()["interlace"] == {"tool_calls": []}
    (finish,) = [c for c in stream(live, body) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish["interlace"] == {"tool_calls": []}
    r = post(live, {"messages": ASK, "max_tokens": 20, "interlace": {"replay": "Hello."}})
    assert "interlace" not in r.json()  # not asked for: the answer is OpenAI's own


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "interlace": {"server_tools": ["calculator"]}},
     "not in tools or interlace.server_tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "interlace": {"server_tools": True}},
     "not in tools or interlace.server_tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "calculator"}}}, "not in tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "calculator"}}, "tools": [WEATHER]}, "not in tools"),
    ({"tool_choice": "required"}, "needs at least one tool"),
])
def test_a_forced_tool_nobody_offers_is_a_400_naming_tool_choice(live, body, message):
    r = post(live, {"messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and message in err["message"], err


def test_readme_server_tools_example_runs_as_written(client):
    """README's server-tools example, run as it is written there (its ``client`` is README's first
    example's, pointed at this gateway), shows the forced calculator call and its result."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Server-side tools", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: Dict[str, Any] = {"client": client}
    exec(compile(code, "README.md (server-side tools)", "exec"), scope)
    (res,) = scope["r"].model_extra["interlace"]["tool_calls"]
    assert res["name"] == "calculator" and res["ok"] and res["content"]["result"] == 42, res
