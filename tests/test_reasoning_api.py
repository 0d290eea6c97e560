"""A reasoning model's reasoning in the three APIs' answers (issue 34).

One gateway serves the embedded model with the hermes tool parser and the qwen3 reasoning parser
(``<think>...</think>``); replayed outputs stand for a reasoning model.  Checked for chat completions
(``reasoning_content`` on the message and on deltas, as vLLM and DeepSeek answer), the Responses API
(a ``reasoning`` output item and its stream events, the official client's stream accumulator) and
Messages (a ``thinking`` block, ``thinking_delta`` / ``signature_delta``, the anthropic client's
accumulator): the reasoning never reaches the content, streamed pieces join to the answer's, calls
after the reasoning still come through, and a follow-up that carries the previous reasoning back
(``reasoning_content`` / ``reasoning``, a ``reasoning`` input item, a ``thinking`` block) is accepted
and reaches the prompt (qwen3 keeps the reasoning of the current tool-calling chain).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

import anthropic
import httpx
import openai
import pytest

from helpers.gateway_server import LiveGateway

THOUGHT = "I should look it up."
ANSWER = "The answer."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PLAIN = f"<think>{THOUGHT}</think>{ANSWER}"
CALLING = f"<think>{THOUGHT}</think>\n{CALL}"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
USER = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def live():
    m = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32", "max_model_len": 2048,
         "parser": "hermes", "reasoning_parser": "qwen3"}
    with LiveGateway({"server": {"replay": True}, "models": {"think": m},
                      "plugins": {"entrypoints": False}}) as gw:
        yield gw


def post(live, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
    r = httpx.post(live.url + path, json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def sse(live, path: str, body: Dict[str, Any]) -> List[Dict[str, Any]]:
    with httpx.stream("POST", live.url + path, json={**body, "stream": True}, timeout=600) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def chat_body(replay: str, **extra: Any) -> Dict[str, Any]:
    return {"model": "think", "messages": USER, "tools": [WEATHER], "max_tokens": 100,
            "interlace": {"replay": replay}, **extra}


# ====================================================================== chat completions
@pytest.mark.parametrize("replay", [PLAIN, CALLING])
def test_chat_reasoning_content_apart_from_the_answer(live, replay):
    ch = post(live, "/v1/chat/completions", chat_body(replay))["choices"][0]
    m = ch["message"]
    assert m["reasoning_content"] == THOUGHT
    if replay == PLAIN:
        assert m["content"] == ANSWER and "tool_calls" not in m and ch["finish_reason"] == "stop"
    else:
        assert m["content"] is None and ch["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]] == \
               [("get_weather", {"city": "Paris"})]
    chunks = sse(live, "/v1/chat/completions", chat_body(replay))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == (m["content"] or "")
    assert not any("think" in (d.get("content") or "") for d in deltas)
    first = next(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    assert all(not d.get("content") and not d.get("tool_calls") for d in deltas[:first])  # reasoning comes first


def test_chat_without_reasoning_has_no_reasoning_content(live):
    m = post(live, "/v1/chat/completions", chat_body(ANSWER))["choices"][0]["message"]
    assert m["content"] == ANSWER and "reasoning_content" not in m


def test_chat_reasoning_without_tools(live):
    """No tool is offered (no call is parsed): the reasoning is still told apart."""
    body = {"model": "think", "messages": USER, "max_tokens": 60, "interlace": {"replay": PLAIN}}
    m = post(live, "/v1/chat/completions", body)["choices"][0]["message"]
    assert (m["content"], m["reasoning_content"]) == (ANSWER, THOUGHT)
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model="think", messages=USER, max_tokens=60, extra_body={"interlace": {"replay": PLAIN}})
    assert r.choices[0].message.content == ANSWER and r.choices[0].message.model_extra["reasoning_content"] == THOUGHT


def chain(reasoning: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A tool-calling chain whose assistant turn carries ``reasoning`` (its fields)."""
    return USER + [{"role": "assistant", "content": None, **reasoning, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_chat_follow_up_carries_the_reasoning_back(live, field):
    """An assistant turn's reasoning (vLLM's and DeepSeek's ``reasoning_content``, vLLM's newer
    ``reasoning``) is accepted and rendered: qwen3 keeps the current chain's reasoning."""
    body = {"model": "think", "tools": [WEATHER], "max_tokens": 5, "interlace": {"replay": ANSWER}}
    bare = post(live, "/v1/chat/completions", {**body, "messages": chain({})})
    kept = post(live, "/v1/chat/completions", {**body, "messages": chain({field: THOUGHT})})
    assert kept["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"]
    bad = httpx.post(live.url + "/v1/chat/completions", json={**body, "messages": chain({field: 3})}, timeout=600)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == f"messages[1].{field}", bad.text


# ====================================================================== Responses
def responses_body(replay: str, **extra: Any) -> Dict[str, Any]:
    return {"model": "think", "input": USER[0]["content"], "max_output_tokens": 100,
            "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
            "interlace": {"replay": replay}, **extra}


@pytest.mark.parametrize("replay", [PLAIN, CALLING])
def test_responses_reasoning_item_first(live, replay):
    resp = post(live, "/v1/responses", responses_body(replay, store=False))
    kinds = [o["type"] for o in resp["output"]]
    assert kinds == ["reasoning", "message" if replay == PLAIN else "function_call"], resp["output"]
    item = resp["output"][0]
    assert item["id"].startswith("rs_") and item["summary"] == [] and item["status"] == "completed"
    assert item["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    if replay == PLAIN:
        assert resp["output"][1]["content"][0]["text"] == ANSWER
    events = sse(live, "/v1/responses", responses_body(replay, store=False))
    names = [e["type"] for e in events]
    deltas = names.count("response.reasoning_text.delta")
    assert deltas >= 1
    at = names.index("response.output_item.added")
    assert names[at:at + 2 + deltas + 3] == (
        ["response.output_item.added", "response.content_part.added"] + ["response.reasoning_text.delta"] * deltas
        + ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"])
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THOUGHT
    (done,) = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert done["text"] == THOUGHT and done["output_index"] == 0 and done["content_index"] == 0
    assert [o["type"] for o in events[-1]["response"]["output"]] == kinds


def test_responses_stream_in_the_official_client(live):
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
    with c.responses.stream(model="think", input=USER[0]["content"], max_output_tokens=60, store=False,
                            extra_body={"interlace": {"replay": PLAIN}}) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER


def test_responses_follow_ups_carry_the_reasoning_back(live):
    """The reasoning item sent back as input (the whole-input way) reaches the prompt (qwen3 keeps
    the chain's reasoning: more input tokens than without it); a stored response keeps it for
    previous_response_id."""
    first = post(live, "/v1/responses", responses_body(CALLING, store=False))
    reasoning, call = first["output"]
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    ask = [{"role": "user", "content": USER[0]["content"]}]
    body = responses_body(ANSWER, store=False, max_output_tokens=5)
    with_it = post(live, "/v1/responses", {**body, "input": ask + [reasoning, call, result]})
    without = post(live, "/v1/responses", {**body, "input": ask + [call, result]})
    assert with_it["usage"]["input_tokens"] > without["usage"]["input_tokens"]
    stored = post(live, "/v1/responses", responses_body(CALLING))
    result = dict(result, call_id=stored["output"][1]["call_id"])
    follow = post(live, "/v1/responses", {**body, "input": [result], "previous_response_id": stored["id"]})
    whole = post(live, "/v1/responses", {**body, "input": ask + stored["output"] + [result]})
    assert follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"] > without["usage"]["input_tokens"]
    bad = httpx.post(live.url + "/v1/responses", json={**body, "input": ask + [dict(reasoning, content=[
        {"type": "summary_text", "text": "x"}])]}, timeout=600)
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("input[1].content"), bad.text


# ====================================================================== Messages
def messages_body(replay: str, **extra: Any) -> Dict[str, Any]:
    return {"model": "think", "max_tokens": 100, "messages": USER, "interlace": {"replay": replay},
            "tools": [{"name": "get_weather", "input_schema": PARAMS}], **extra}


@pytest.mark.parametrize("replay", [PLAIN, CALLING])
def test_messages_thinking_block_first(live, replay):
    msg = post(live, "/v1/messages", messages_body(replay))
    assert msg["content"][0] == {"type": "thinking", "thinking": THOUGHT, "signature": ""}
    if replay == PLAIN:
        assert msg["content"][1:] == [{"type": "text", "text": ANSWER}] and msg["stop_reason"] == "end_turn"
    else:
        (use,) = msg["content"][1:]
        assert use["type"] == "tool_use" and use["input"] == {"city": "Paris"} and msg["stop_reason"] == "tool_use"
    events = sse(live, "/v1/messages", messages_body(replay))
    blocks = [e for e in events if e["type"].startswith("content_block")]
    assert blocks[0] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
    thinking = [e["delta"] for e in blocks if e["index"] == 0 and e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in thinking if d["type"] == "thinking_delta") == THOUGHT
    assert thinking[-1] == {"type": "signature_delta", "signature": ""}
    stop0 = blocks.index({"type": "content_block_stop", "index": 0})
    assert all(e["index"] == 0 for e in blocks[:stop0 + 1]) and blocks[stop0 + 1]["index"] == 1


def test_messages_stream_in_the_anthropic_client(live):
    c = anthropic.Anthropic(base_url=live.url, api_key="none", max_retries=0)
    with c.messages.stream(model="think", max_tokens=60, messages=USER,
                           extra_body={"interlace": {"replay": PLAIN}}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == THOUGHT and final.content[1].text == ANSWER


def test_messages_follow_up_carries_the_thinking_back(live):
    """An assistant ``thinking`` block comes back as the turn's reasoning (rendered: more input
    tokens than without it); ``redacted_thinking`` is accepted and dropped."""
    use = {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]}

    def follow(blocks: List[Dict[str, Any]]) -> Dict[str, Any]:
        return post(live, "/v1/messages", messages_body(ANSWER, max_tokens=5, messages=USER + [
            {"role": "assistant", "content": blocks + [use]}, result]))

    def prompt(m: Dict[str, Any]) -> int:  # Anthropic's input_tokens leave the cache reads out
        return m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"]

    bare = follow([])
    kept = follow([{"type": "thinking", "thinking": THOUGHT, "signature": ""}])
    redacted = follow([{"type": "redacted_thinking", "data": "opaque"}])
    assert prompt(kept) > prompt(bare) == prompt(redacted)
    r = httpx.post(live.url + "/v1/messages", json=messages_body(ANSWER, messages=[
        {"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]), timeout=600)
    assert r.status_code == 400 and "thinking" in r.json()["error"]["message"], r.text
