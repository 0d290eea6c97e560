"""The Anthropic Messages API (gateway/anthropic/) against the official
``anthropic`` client: create with tools and a ``tool_result`` follow-up that
adopts the retained context, streaming (text and ``tool_use``), count_tokens,
both auth headers, errors in Anthropic's shape naming the field, stop reasons,
and a client that goes away mid-stream."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from helpers.gateway_server import LiveGateway, engine_state, wait_idle

KEYS = [{"key": "alice-key", "name": "alice"}, {"key": "bob-key", "name": "bob"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def live():
    m = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}
    cfg = {"server": {"api_keys": KEYS, "replay": True}, "models": {"smollm2": m},
           # preserve: the retained KV stays, so the follow-up's cache reads are known exactly
           "engine": {"profile": "h100-llama-3-8b", "interception": "preserve"}, "plugins": {"entrypoints": False}}
    with LiveGateway(cfg) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(live):
    return anthropic.Anthropic(base_url=live.url, api_key="alice-key", max_retries=0, timeout=120)


def replay(text, **extra):
    return {"interlace": {"replay": text}, "temperature": 0, **extra}


def post(live, body, path="/v1/messages", **headers):
    return httpx.post(live.url + path, json=body, headers={"x-api-key": "alice-key", **headers}, timeout=120)


def sse_events(text):
    """``(event name, data)`` of a raw Anthropic event stream."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_forced_tool_use_then_tool_result_follow_up_adopts_the_context(live, client):
    r = client.messages.create(model="smollm2", max_tokens=60, messages=USER, tools=[WEATHER],
                               tool_choice={"type": "any"}, extra_body=replay(CALL))
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.stop_reason == "tool_use" and r.stop_sequence is None
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert r.usage.cache_creation_input_tokens == 0 and r.usage.output_tokens > 0
    prompt = r.usage.input_tokens + r.usage.cache_read_input_tokens
    follow = USER + [r.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": '{"temperature": 21, "sky": "sunny"}'}]}]
    f = client.messages.create(model="smollm2", max_tokens=8, messages=follow, tools=[WEATHER],
                               extra_body={"temperature": 0})
    # the retained context held the prompt and the reply (all but its last token): adopted, not refilled
    held = prompt + r.usage.output_tokens - 1
    assert f.usage.cache_read_input_tokens >= held
    assert f.usage.input_tokens > 0  # the tool result's tokens were new
    assert f.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_tool_result_for_an_unknown_tool_use_id_is_refused(live, client):
    follow = USER + [{"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_2", "content": "x"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="smollm2", max_tokens=8, messages=follow, tools=[WEATHER])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "call_2" in e.value.body["error"]["message"]
    assert e.value.body["error"]["message"].startswith("messages[2]")


def test_stream_text_events_in_order_and_the_clients_final_message(live, client):
    text = "Paris is sunny today, as it often is in June."
    with client.messages.stream(model="smollm2", max_tokens=60, messages=USER, extra_body=replay(text)) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0
    raw = post(live, {"model": "smollm2", "max_tokens": 60, "messages": USER, "stream": True, **replay(text)})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    names = [n for n, _ in sse_events(raw.text)]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    events = sse_events(raw.text)
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["stop_reason"] is None
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_stream_tool_use_with_input_json_delta(live, client):
    with client.messages.stream(model="smollm2", max_tokens=60, messages=USER, tools=[WEATHER],
                                extra_body=replay(CALL)) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.delta.type == "input_json_delta" for d in deltas)
    assert json.loads("".join(d.delta.partial_json for d in deltas)) == {"city": "Paris"}
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(b.content_block.type, b.content_block.name) for b in starts] == [("tool_use", "get_weather")]
    assert final.stop_reason == "tool_use"
    assert final.content[0].input == {"city": "Paris"} and final.content[0].id == starts[0].content_block.id


def test_count_tokens_is_the_prompt_create_renders(live, client):
    system = "You answer in one word."
    n = client.messages.count_tokens(model="smollm2", messages=USER, tools=[WEATHER], system=system)
    for _ in range(2):  # the second time the prefix cache serves most of the prompt
        r = client.messages.create(model="smollm2", max_tokens=4, messages=USER, tools=[WEATHER], system=system,
                                   extra_body=replay("Sunny"))
        # Anthropic's input_tokens leaves the cache reads out
        assert n.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert 0 < r.usage.cache_read_input_tokens < n.input_tokens
    without_tools = client.messages.count_tokens(model="smollm2", messages=USER, system=system)
    assert without_tools.input_tokens < n.input_tokens  # the tools are part of the prompt
    bad = post(live, {"model": "smollm2", "messages": USER, "max_tokens": 5}, "/v1/messages/count_tokens")
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("max_tokens")


def test_x_api_key_and_bearer_auth(live):
    body = {"model": "smollm2", "max_tokens": 4, "messages": USER, **replay("Sunny")}
    assert post(live, body).status_code == 200  # x-api-key
    bearer = anthropic.Anthropic(base_url=live.url, auth_token="bob-key", max_retries=0, timeout=120)
    assert bearer.messages.create(model="smollm2", max_tokens=4, messages=USER,
                                  extra_body=replay("Sunny")).content[0].text == "Sunny"
    for headers in ({}, {"x-api-key": "wrong"}):
        r = httpx.post(live.url + "/v1/messages", json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(live.url + "/v1/messages/count_tokens", json={"model": "smollm2", "messages": USER}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


BASE = {"model": "smollm2", "max_tokens": 8, "messages": USER}


@pytest.mark.parametrize("body, field", [
    ({k: v for k, v in BASE.items() if k != "max_tokens"}, "max_tokens"),
    ({**BASE, "messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({**BASE, "frequency_penalty": 1}, "frequency_penalty"),
    ({**BASE, "temperature": 1.5}, "temperature"),
    ({**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({**BASE, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({**BASE, "thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({**BASE, "messages": USER + [{"role": "assistant", "content": "The answer is"}]}, "messages[1]"),
    ({**BASE, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({**BASE, "interlace": {"server_tools": True}}, "interlace.server_tools"),
    ({**BASE, "stop_sequences": [""]}, "stop_sequences[0]"),
    # unhashable where a name is looked up (schemathesis found the 500s)
    ({**BASE, "messages": [{"role": {}, "content": "hi"}]}, "messages[0].role"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": {}, "text": "hi"}]}]}, "messages[0].content[0].type"),
    # the chat checks' refusal (response_format.json_schema.schema), named in this API's field
    ({**BASE, "output_config": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}},
     "output_config.format.schema"),
])
def test_bad_requests_are_400_in_anthropics_shape_naming_the_field(live, body, field):
    r = post(live, body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(field), err


def test_output_config_format_constrains_the_output(live, client):
    fmt = {"type": "json_schema", "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                             "required": ["city"], "additionalProperties": False}}
    r = client.messages.create(model="smollm2", max_tokens=30, messages=USER, output_config={"format": fmt},
                               extra_body=replay('{"city": "Paris"}'))
    assert json.loads(r.content[0].text) == {"city": "Paris"}
    bad = post(live, {**BASE, "output_config": {"format": fmt}, **replay("Paris, sunny")})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("interlace.replay")


def test_unknown_model_is_404_in_anthropics_shape(live):
    r = post(live, {**BASE, "model": "claude-opus-4"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_stop_sequence_and_max_tokens_stop_reasons(live, client):
    r = client.messages.create(model="smollm2", max_tokens=40, messages=USER, stop_sequences=["cloudy"],
                               extra_body=replay("It is cloudy and cool in Paris."))
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "cloudy"
    assert r.content[0].text == "It is "
    r = client.messages.create(model="smollm2", max_tokens=3, messages=USER,
                               extra_body=replay("It is cloudy and cool in Paris today."))
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.usage.output_tokens == 3
    with client.messages.stream(model="smollm2", max_tokens=40, messages=USER, stop_sequences=["cloudy"],
                                extra_body=replay("It is cloudy and cool in Paris.")) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "cloudy"
    # more than the context leaves (Claude Code asks for 32,000): the output may run to the window
    r = client.messages.create(model="smollm2", max_tokens=10 ** 6, messages=USER, extra_body=replay("Sunny."))
    assert r.stop_reason == "end_turn" and r.content[0].text == "Sunny."


def test_client_disconnect_mid_stream_frees_its_context(live):
    body = {**BASE, "max_tokens": 2000, "stream": True, **replay("word " * 1500)}
    with httpx.stream("POST", live.url + "/v1/messages", json=body, headers={"x-api-key": "alice-key"},
                      timeout=60) as r:
        lines = r.iter_lines()
        for i, _ in enumerate(lines):
            if i == 12:
                assert engine_state(live)["contexts"] == 1  # generating, client still reading
                break
        lines.close()  # the client goes away mid-stream
    st = wait_idle(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0


# ------------------------------------------------------------------ the translation, without a gateway
def test_translation_merges_turns_and_maps_tool_choice_and_errors():
    from interlace.gateway.anthropic.wire import validate_request

    body = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."},
                                                      {"type": "text", "text": "Use tools.", "cache_control":
                                                       {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Weather?"}, {"role": "user", "content": "In Paris."},
                         {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                           {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                            "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                                       "content": [{"type": "text", "text": "timeout"}]}]}],
            "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True},
            "stop_sequences": ["END"], "metadata": {"user_id": "u1"}}
    chat = validate_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather?\n\nIn Paris."},  # consecutive user turns: one turn
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: timeout"}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False and chat["stop"] == ["END"] and chat["user"] == "u1"
    assert chat["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]


def test_whitespace_before_a_call_is_no_block_but_a_whitespace_answer_is_kept():
    from interlace.gateway.anthropic.wire import Blocks, fold
    from interlace.gateway.openai.completions import CallArgs, CallStart, Content, Finish

    usage = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}

    def run(events, finish):
        b = Blocks()
        out = [e for ev in events for e in b.feed(ev)] + b.finish(finish)
        return fold({"content": []}, out)

    m = run([Content(" \n"), CallStart(0, "c1", "get_weather"), CallArgs(0, '{"city": "Paris"}')],
            Finish("tool_calls", usage))
    assert m["content"] == [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}]
    assert m["stop_reason"] == "tool_use"
    assert m["usage"] == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4,
                          "cache_creation_input_tokens": 0}
    m = run([Content("  "), Content(" ok")], Finish("stop", usage, stop_sequence="END"))
    assert m["content"] == [{"type": "text", "text": "   ok"}]
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "END")
    assert run([Content(" ")], Finish("length", usage))["content"] == [{"type": "text", "text": " "}]
    # a length stop at the context's end, max_tokens having asked for more than it left
    b = Blocks(window=3)
    assert b.finish(Finish("length", usage))[-2]["delta"]["stop_reason"] == "model_context_window_exceeded"
    assert Blocks(window=4).finish(Finish("length", usage))[-2]["delta"]["stop_reason"] == "max_tokens"


def test_claude_codes_request_shape_is_taken_and_its_billing_block_not_rendered():
    """What Claude Code sends beside the basics: a changing billing block first in ``system`` (dropped:
    it would change every prompt from its first token on), a system turn inside ``messages``, thinking
    with a budget (no thinking blocks come back: the budget is a bound), cache_control, metadata."""
    from interlace.gateway.anthropic.wire import validate_request

    def body(cch):
        return {"model": "m", "max_tokens": 32000, "stream": True, "metadata": {"user_id": "user_abc"},
                "thinking": {"type": "enabled", "budget_tokens": 31999},
                "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={cch};"},
                           {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
                "messages": [{"role": "user", "content": "Fix the bug."},
                             {"role": "system", "content": "The user switched to plan mode."},
                             {"role": "user", "content": [{"type": "text", "text": "Go on.",
                                                           "cache_control": {"type": "ephemeral"}}]}]}

    first, second = validate_request(body("1a2b")), validate_request(body("9f8e"))
    assert first["messages"] == second["messages"] == [
        {"role": "system", "content": "You are Claude Code."}, {"role": "user", "content": "Fix the bug."},
        {"role": "system", "content": "The user switched to plan mode."}, {"role": "user", "content": "Go on."}]
    assert validate_request({**body("x"), "thinking": {"type": "adaptive"}})["messages"] == first["messages"]
