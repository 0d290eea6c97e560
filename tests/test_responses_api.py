"""The OpenAI Responses API (gateway/responses/), read by the official ``openai`` client where it can be:
plain text, function tools with a ``function_call_output`` follow-up by ``previous_response_id`` that
adopts the kept engine context (``cached_tokens``), ``text.format``, the typed stream events (order,
``sequence_number``, the client's stream helper), the stored responses (retrieve, delete,
input_items, other keys, a failing store), background runs and cancel, server-side tools as
``{"type": "mcp", "server_label": "interlace"}``, bad input, and a client gone mid-stream.
Exact outputs come from ``interlace.replay``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import httpx
import openai
import pytest

from helpers.gateway_server import LiveGateway, engine_state, wait_idle
from interlace.gateway.responses.store import SQLiteResponseStore

KEYS = [{"key": "alice-key", "name": "alice", "server_tools": ["calculator", "t.*"]}, {"key": "bob-key", "name": "bob"},
        {"key": "carol-key", "name": "carol", "limits": {"max_concurrent_requests": 1}}]
#: a configured MCP server (stdio): its tools are t.echo, t.forecast ... in the gateway
MCP_SERVER = str(Path(__file__).parent / "helpers" / "mcp_test_server.py")
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = "What is the weather like in Paris today?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
LONG = " ".join(["word"] * 1500)  # longer than wait_idle waits for, decoded on CPU


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    m = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}
    path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    cfg = {"server": {"api_keys": KEYS, "replay": True, "responses": {"path": str(path)}},
           "models": {"smollm2": m}, "mcp_servers": {"t": {"command": sys.executable, "args": [MCP_SERVER]}},
           # preserve: the kept KV stays, so the follow-up's cached tokens are known to come from it
           "engine": {"profile": "h100-llama-3-8b", "interception": "preserve"}, "plugins": {"entrypoints": False}}
    with LiveGateway(cfg) as gw:
        yield gw


def client(live, key: str = "alice-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=120)


def post(live, body: Dict[str, Any], key: str = "alice-key") -> httpx.Response:
    return httpx.post(live.url + "/v1/responses", json={"model": "smollm2", **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)


def sse_events(live, body: Dict[str, Any], key: str = "alice-key") -> List[Tuple[str, Dict[str, Any]]]:
    """(event name, data) of a streamed response, read raw."""
    out = []
    with httpx.stream("POST", live.url + "/v1/responses", json={"model": "smollm2", "stream": True, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
    return out


def retention_saved(live) -> float:
    """Prompt tokens a follow-up did not prefill because it adopted a kept context (the metric)."""
    for line in httpx.get(live.url + "/metrics").text.splitlines():
        if line.startswith("interlace_prefill_tokens_saved_total{") and 'mechanism="retention"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def replay(text: Any) -> Dict[str, Any]:
    return {"interlace": {"replay": text}}


def test_plain_text_parses_in_the_client(live):
    r = client(live).responses.create(model="smollm2", input="Say hello.", instructions="Be brief.",
                                      temperature=0, max_output_tokens=30, extra_body=replay("Hello there!"),
                                      metadata={"run": "1"})
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello there!"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.metadata == {"run": "1"} and r.max_output_tokens == 30
    assert r.store is True and r.error is None and r.temperature == 0


def test_function_call_then_output_follow_up_adopts_the_kept_context(live):
    c = client(live)
    r1 = c.responses.create(model="smollm2", input=ASK, tools=[WEATHER], temperature=0, max_output_tokens=60,
                            extra_body=replay(CALL))
    assert r1.status == "completed"
    (fc,) = r1.output
    assert fc.type == "function_call" and fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    assert fc.id.startswith("fc_") and fc.call_id and fc.status == "completed"
    r2 = c.responses.create(model="smollm2", previous_response_id=r1.id, tools=[WEATHER], temperature=0,
                            max_output_tokens=30, extra_body=replay("It is sunny in Paris."),
                            input=[{"type": "function_call_output", "call_id": fc.call_id,
                                    "output": '{"temperature": 21, "sky": "sunny"}'}])
    assert r2.output_text == "It is sunny in Paris." and r2.previous_response_id == r1.id
    # the follow-up continued the kept context: at least the first request's prompt was not prefilled again
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    # a third turn continues the second (a chain of previous_response_id), also from its kept context:
    # the second ended by itself ("stop"), and its stored response kept the context anyway
    saved = retention_saved(live)
    r3 = c.responses.create(model="smollm2", previous_response_id=r2.id, input="Thanks!", tools=[WEATHER],
                            temperature=0, max_output_tokens=20, extra_body=replay("You are welcome."))
    assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens
    assert r3.output_text == "You are welcome."
    assert retention_saved(live) - saved >= r2.usage.input_tokens  # adopted, not the prefix cache's blocks


def test_the_same_history_sent_whole_renders_the_same_prompt(live):
    """Without previous_response_id the client sends the output items back as input: the prompt is the
    same as the stored conversation's (the translation of items equals the stored messages)."""
    c = client(live)
    r1 = c.responses.create(model="smollm2", input=ASK, tools=[WEATHER], temperature=0, max_output_tokens=60,
                            extra_body=replay(CALL))
    out = [{"type": "function_call_output", "call_id": r1.output[0].call_id, "output": "sunny"}]
    chained = c.responses.create(model="smollm2", previous_response_id=r1.id, input=out, tools=[WEATHER],
                                 max_output_tokens=5, extra_body=replay("ok"), store=False)
    whole = c.responses.create(model="smollm2", tools=[WEATHER], max_output_tokens=5, extra_body=replay("ok"),
                               store=False, input=[{"role": "user", "content": ASK},
                                                   r1.output[0].model_dump(exclude_none=True), *out])
    assert whole.usage.input_tokens == chained.usage.input_tokens


def test_json_schema_format_is_enforced_and_parses(live):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}}
    r = client(live).responses.create(model="smollm2", input="Where?", text=fmt, max_output_tokens=30,
                                      extra_body=replay('{"city": "Paris"}'))
    assert json.loads(r.output_text) == {"city": "Paris"}
    assert r.text.format.type == "json_schema" and r.text.format.name == "place"
    # the constraint holds: a replay it does not allow is refused, naming this API's field
    bad = post(live, {"input": "Where?", "text": fmt, "max_output_tokens": 30, **replay("Paris")})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "interlace.replay"
    bad = post(live, {"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": 5}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema", bad.text


def test_stream_events_in_order_with_sequence_numbers(live):
    events = sse_events(live, {"input": ASK, "tools": [WEATHER], "max_output_tokens": 80,
                               **replay("Let me check. " + CALL)})
    names = [n for n, _ in events]
    assert [d["type"] for _, d in events] == names
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    text = [n for n in names if n.startswith("response.output_text") or n.startswith("response.content_part")
            or n.startswith("response.output_item") or n.startswith("response.function_call")]
    deltas = names.count("response.output_text.delta")
    args = names.count("response.function_call_arguments.delta")  # member by member, then the closing brace
    assert deltas >= 1 and args >= 2
    assert text == (["response.output_item.added", "response.content_part.added"]
                    + ["response.output_text.delta"] * deltas
                    + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                       "response.output_item.added"] + ["response.function_call_arguments.delta"] * args
                    + ["response.function_call_arguments.done", "response.output_item.done"])
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "".join(
        d["delta"] for n, d in events if n == "response.output_text.delta")
    assert events[0][1]["response"]["id"] == final["id"]


def test_the_clients_stream_helpers_read_the_stream(live):
    c = client(live)
    with c.responses.stream(model="smollm2", input="Say hi.", max_output_tokens=20,
                            extra_body=replay("Hi, friend.")) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert final.output_text == "Hi, friend." and final.status == "completed"
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [e.delta for e in c.responses.create(model="smollm2", input="Say hi.", max_output_tokens=20,
                                                  stream=True, extra_body=replay("Hi, friend."))
              if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hi, friend."
    # a function call through the helper: the final response holds it
    with c.responses.stream(model="smollm2", input=ASK, tools=[WEATHER], max_output_tokens=60,
                            extra_body=replay(CALL)) as s:
        final = s.get_final_response()
    assert final.output[0].type == "function_call" and final.output[0].name == "get_weather"


def test_retrieve_input_items_delete_and_other_keys(live):
    alice, bob = client(live), client(live, "bob-key")
    r = alice.responses.create(model="smollm2", max_output_tokens=10, extra_body=replay("Fine."),
                               input=[{"role": "user", "content": "One."},
                                      {"type": "message", "role": "user",
                                       "content": [{"type": "input_text", "text": "Two."}]}])
    got = alice.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "Fine."
    items = alice.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["One.", "Two."]
    assert all(i.id.startswith("msg_") and i.type == "message" for i in items.data)
    page = httpx.get(f"{live.url}/v1/responses/{r.id}/input_items?limit=1",
                     headers={"Authorization": "Bearer alice-key"}).json()
    assert page["has_more"] is True and page["data"][0]["content"][0]["text"] == "Two."  # desc by default
    # another key: 404 everywhere, as an unknown id
    for call in (lambda: bob.responses.retrieve(r.id), lambda: bob.responses.delete(r.id),
                 lambda: bob.responses.input_items.list(r.id),
                 lambda: bob.responses.create(model="smollm2", input="Go on.", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    follow = post(live, {"input": "Go on.", "previous_response_id": r.id}, key="bob-key")
    assert follow.json()["error"]["param"] == "previous_response_id"
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    # store: false keeps nothing
    r = alice.responses.create(model="smollm2", input="x", store=False, max_output_tokens=5, extra_body=replay("y"))
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)


def test_bad_input_is_refused_naming_the_field(live):
    r1 = client(live).responses.create(model="smollm2", input=ASK, tools=[WEATHER], max_output_tokens=60,
                                       extra_body=replay(CALL))
    cases = [
        ({"input": "x", "frobnicate": 1}, 400, "frobnicate"),
        ({"input": "x", "truncation": "auto"}, 400, "truncation"),
        ({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include[0]"),
        ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         400, "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
        ({"input": [{"role": "user", "content": "x", "colour": "red"}]}, 400, "input[0].colour"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, 400,
         "input[0].call_id"),
        ({"previous_response_id": r1.id, "input": [{"type": "function_call_output", "call_id": "call_nope",
                                                    "output": "1"}]}, 400, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "mcp", "server_label": "x", "server_url": "http://e"}]}, 400,
         "tools[0].server_url"),
        ({"input": "x", "tools": [{"type": "mcp", "server_label": "nowhere"}]}, 400, "tools[0].server_label"),
        ({"input": "x", "tools": [{"type": "mcp", "server_label": "interlace", "require_approval": "always"}]},
         400, "tools[0].require_approval"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, 400,
         "tool_choice"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 100000}, 400, "max_output_tokens"),
        ({"input": "x", "background": True, "stream": True}, 400, "background"),
        ({"input": "x", "background": True, "store": False}, 400, "background"),
        ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, 400,
         "input[0].arguments"),
    ]
    for body, status, param in cases:
        r = post(live, body)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    assert post(live, {"input": "x", "include": ["reasoning.encrypted_content"], "max_output_tokens": 3,
                       **replay("ok")}).status_code == 200
    assert httpx.post(live.url + "/v1/responses", json={"model": "smollm2", "input": "x"}).status_code == 401


def test_a_key_keeps_at_most_max_per_key_responses(live):
    cfg, bob = live.gateway.config, client(live, "bob-key")
    bob.responses.create(model="smollm2", input="x", max_output_tokens=2, extra_body=replay("ok"))
    held = asyncio.run(live.gateway.responses.count("bob"))
    kept = cfg.responses
    cfg.responses = dataclasses.replace(kept, max_per_key=held)
    try:
        with pytest.raises(openai.RateLimitError, match="server.responses.max_per_key"):
            bob.responses.create(model="smollm2", input="x", max_output_tokens=2, extra_body=replay("ok"))
        assert asyncio.run(live.gateway.responses.count("bob")) == held  # nothing kept of the refused one
        # not stored, not limited
        assert bob.responses.create(model="smollm2", input="x", max_output_tokens=2, store=False,
                                    extra_body=replay("ok")).status == "completed"
    finally:
        cfg.responses = kept


def test_max_output_tokens_makes_an_incomplete_response(live):
    r = client(live).responses.create(model="smollm2", input="Count.", max_output_tokens=4,
                                      extra_body=replay("one two three four five six seven"))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[0].status == "incomplete"
    events = sse_events(live, {"input": "Count.", "max_output_tokens": 4,
                               **replay("one two three four five six seven")})
    assert events[-1][0] == "response.incomplete"


def test_background_runs_completes_and_cancels(live):
    c = client(live)
    r = c.responses.create(model="smollm2", input="Hi.", background=True, max_output_tokens=10,
                           extra_body=replay("Hello."))
    assert r.status == "queued" and r.background is True
    deadline = time.time() + 60
    while (got := c.responses.retrieve(r.id)).status in ("queued", "in_progress") and time.time() < deadline:
        time.sleep(0.1)
    assert got.status == "completed" and got.output_text == "Hello."
    with pytest.raises(openai.ConflictError):  # finished: nothing to cancel
        c.responses.cancel(r.id)
    with pytest.raises(openai.BadRequestError):  # not a background response
        c.responses.cancel(c.responses.create(model="smollm2", input="x", max_output_tokens=2,
                                              extra_body=replay("ok")).id)
    slow = c.responses.create(model="smollm2", input="Talk.", background=True, max_output_tokens=600,
                              extra_body=replay(LONG))
    cancelled = c.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    assert c.responses.retrieve(slow.id).status == "cancelled"
    assert not live.gateway.response_runs.tasks
    assert live.gateway.key_limits.in_flight.get("alice", 0) == 0
    assert wait_idle(live)["contexts"] == 0


def test_a_background_run_takes_over_its_requests_slot(live):
    """A key allowed one request in flight may run one response in the background (the run takes
    over the slot of the request that started it); a second one while it runs is a 429."""
    c = client(live, "carol-key")
    slow = c.responses.create(model="smollm2", input="Talk.", background=True, max_output_tokens=600,
                              extra_body=replay(LONG))
    assert slow.status == "queued"
    with pytest.raises(openai.RateLimitError):
        c.responses.create(model="smollm2", input="More.", background=True, max_output_tokens=5,
                           extra_body=replay("ok"))
    assert c.responses.cancel(slow.id).status == "cancelled"
    assert live.gateway.key_limits.in_flight.get("carol", 0) == 0
    quick = c.responses.create(model="smollm2", input="Hi.", background=True, max_output_tokens=5,
                               extra_body=replay("Hello."))
    deadline = time.time() + 60
    while (got := c.responses.retrieve(quick.id)).status in ("queued", "in_progress") and time.time() < deadline:
        time.sleep(0.1)
    assert got.status == "completed" and live.gateway.key_limits.in_flight.get("carol", 0) == 0


def test_a_failing_store_is_an_error_never_a_claimed_success(live, tmp_path):
    """A store that cannot write (closed: every call raises StoreError) answers 503, and a stream ends
    with an error event and response.failed instead of response.completed."""
    gw = live.gateway
    kept, broken = gw.responses, SQLiteResponseStore(str(tmp_path / "broken.sqlite3"), ttl_s=60)
    asyncio.run(broken.close())
    gw.responses = broken
    try:
        r = post(live, {"input": "x", "max_output_tokens": 5, **replay("ok")})
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
        # the count before the run fails first; with a store that fails only on put, the run's answer
        # is withheld too: counted as empty here, broken on write
        broken.count = _zero  # type: ignore[method-assign]
        r = post(live, {"input": "x", "max_output_tokens": 5, **replay("ok")})
        assert r.status_code == 503, r.text
        events = sse_events(live, {"input": "x", "max_output_tokens": 5, **replay("ok")})
        names = [n for n, _ in events]
        assert "response.completed" not in names and names[-2:] == ["error", "response.failed"]
        assert events[-1][1]["response"]["status"] == "failed"
        # store: false needs no store
        assert post(live, {"input": "x", "store": False, "max_output_tokens": 5, **replay("ok")}).status_code == 200
    finally:
        gw.responses = kept


async def _zero(owner):
    return 0


def test_plugin_tools_through_the_interlace_mcp_label(live):
    tools = [{"type": "mcp", "server_label": "interlace", "allowed_tools": ["calculator"],
              "require_approval": "never"}]
    r = client(live).responses.create(model="smollm2", input="Use the calculator: 6*7", tools=tools,
                                      max_output_tokens=60, extra_body=replay([CALC, "It is 42."]))
    kinds = [o.type for o in r.output]
    assert kinds == ["mcp_call", "message"], r.output
    call = r.output[0]
    assert call.server_label == "interlace" and call.name == "calculator" and call.status == "completed"
    assert json.loads(call.arguments) == {"expression": "6*7"} and "42" in call.output
    assert r.output_text == "It is 42."
    events = sse_events(live, {"input": "Use the calculator: 6*7", "tools": tools, "max_output_tokens": 60,
                               **replay([CALC, "It is 42."])})
    names = [n for n, _ in events]
    for a, b in zip(["response.output_item.added", "response.mcp_call.in_progress",
                     "response.mcp_call_arguments.done", "response.mcp_call.completed", "response.output_item.done"],
                    ["response.mcp_call.in_progress", "response.mcp_call_arguments.done",
                     "response.mcp_call.completed", "response.output_item.done", "response.output_text.delta"]):
        assert names.index(a) < names.index(b), names
    # bob's key is granted no server-side tools
    r = post(live, {"input": "x", "tools": tools}, key="bob-key")
    assert r.status_code == 403 and r.json()["error"]["param"] == "tools", r.text


def test_a_configured_mcp_servers_tools_by_its_label(live):
    """``{"type": "mcp", "server_label": "t"}`` names the configured server t: its tool runs in the
    loop and comes back as an mcp_call of server t; unknown labels and remote servers are refused."""
    echo = '<tool_call>\n{"name": "t.echo", "arguments": {"text": "bonjour"}}\n</tool_call>'
    tools = [{"type": "mcp", "server_label": "t", "allowed_tools": ["echo"]}]
    r = client(live).responses.create(model="smollm2", input="Echo bonjour.", tools=tools, max_output_tokens=40,
                                      extra_body=replay([echo, "Done."]))
    assert [o.type for o in r.output] == ["mcp_call", "message"], r.output
    call = r.output[0]
    assert (call.server_label, call.name, call.output) == ("t", "echo", "bonjour"), call
    for bad, field in (([{"type": "mcp", "server_label": "nope"}], "tools[0].server_label"),
                       ([{"type": "mcp", "server_label": "t", "server_url": "https://example.com/mcp"}],
                        "tools[0].server_url")):
        r = post(live, {"input": "x", "tools": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = post(live, {"input": "x", "tools": tools}, key="bob-key")  # bob may use no server-side tool
    assert r.status_code == 403, r.text


def test_a_client_gone_mid_stream_frees_its_context(live):
    before = engine_state(live)["contexts"]
    with httpx.stream("POST", live.url + "/v1/responses", headers={"Authorization": "Bearer alice-key"},
                      json={"model": "smollm2", "stream": True, "input": "Talk.", "max_output_tokens": 1600,
                            **replay(LONG)}, timeout=120) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("event: response.output_text.delta")
            if seen >= 3:
                break
    assert wait_idle(live)["contexts"] == before


def test_a_restart_keeps_stored_responses_as_text_and_cancels_background_runs(tmp_path):
    """Shutdown cancels a background run, which stores "cancelled"; a new gateway on the same file
    answers the stored responses, and a follow-up by previous_response_id refills from their text
    (the KV went with the old process) and answers."""
    path = tmp_path / "responses.sqlite3"
    cfg = {"server": {"api_keys": KEYS, "replay": True, "responses": {"path": str(path)}},
           "models": {"smollm2": {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}},
           "plugins": {"entrypoints": False}}
    with LiveGateway(cfg) as first:
        done = client(first).responses.create(model="smollm2", input=ASK, tools=[WEATHER], tool_choice="required",
                                              extra_body={"interlace": {"replay": CALL}})
        running = client(first).responses.create(model="smollm2", input="Count to a thousand.", background=True,
                                                 max_output_tokens=3000, temperature=1.0)
        assert running.status in ("queued", "in_progress")
    with LiveGateway(cfg) as second:
        c = client(second)
        assert c.responses.retrieve(running.id).status == "cancelled"
        again = c.responses.retrieve(done.id)
        assert again.output[0].type == "function_call" and again.output[0].call_id == done.output[0].call_id
        follow = c.responses.create(model="smollm2", previous_response_id=done.id, max_output_tokens=8,
                                    temperature=0, tools=[WEATHER], input=[{"type": "function_call_output",
                                                           "call_id": done.output[0].call_id,
                                                           "output": '{"temperature": 21}'}])
        # the whole stored conversation was rendered again: the first prompt, the call, the result
        assert follow.status in ("completed", "incomplete")
        assert follow.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens
        assert follow.previous_response_id == done.id
