"""Client tool calls stream their arguments, and a call that fails after it was passed on is
withdrawn (issue 34; the decision is gateway/openai/completions.py's module docstring).

First the loop's mapping of parser events on its own (``_Turn``, fed by every registered tool-call
parser, split every which way): a call is passed on at its name, its arguments go out member by
member, what a client holds is always a JSON object once ``}`` is appended, and the fragments join to
exactly the arguments the call gets.  Then over HTTP on the three APIs (replayed outputs): fragments
arrive in several chunks before the call closes; a call broken after one good member, and a call cut
by ``max_tokens``, come back withdrawn (valid JSON, never ``tool_calls`` / ``tool_use``, the
withdrawn index named), streamed or not the same answer; ``parallel_tool_calls: false`` still stops
after the first call.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from helpers.gateway_server import LiveGateway
from interlace.gateway.openai.completions import CallArgs, CallStart, CompletionPlan, Content, _Turn
from interlace.parsers import FieldComplete, ParserError, ToolCallEnd
from interlace.parsers.builtin import BUILTIN_PARSERS

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "units": {"type": "object"}}},
    "get_time": {"type": "object", "properties": {"timezone": {"type": "string"}}},
    "python": {"type": "object", "properties": {"code": {"type": "string"}}},
}
CALLS = [("get_weather", {"city": "Paris", "days": 3, "units": {"temp": "C", "wind": ["km/h", 1.5]}}),
         ("get_time", {"timezone": "Europe/Paris"})]


def written(name: str) -> str:
    """Two calls as the format ``name`` writes them (its own rendering, for every registered format;
    the code tool and the plan's steps take their own arguments)."""
    fmt = BUILTIN_PARSERS[name].format
    if name == "markdown":
        return fmt.render_calls([("python", {"code": "x = 6 * 7\nfor i in range(2):\n    print(x)\n"}),
                                 ("python", {"code": "print('done')\n"})])
    if name == "plan":
        return fmt.render_calls([(n, {"step": i, "args": list(a.values()), "kwargs": {}})
                                 for i, (n, a) in enumerate(CALLS, 1)])
    return fmt.render_calls(CALLS)


def turn_for(name: str, **plan: Any) -> _Turn:
    model = SimpleNamespace(tool_format=BUILTIN_PARSERS[name].format)
    plan = {"parse_tools": True, **plan}
    return _Turn(model, CompletionPlan(prompt_ids=[], sampling=None,  # type: ignore[arg-type]
                                       offered_tools=dict(SCHEMAS), **plan), None)


def run(name: str, text: str, cuts: List[int] = (), **plan: Any) -> Tuple[List[Any], List[Any], _Turn]:
    """(the parser's events, the loop's events, the turn) of ``text`` fed in the pieces ``cuts`` makes."""
    parser = BUILTIN_PARSERS[name](tools=SCHEMAS)
    turn = turn_for(name, **plan)
    events: List[Any] = []
    out: List[Any] = []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        for pe in parser.feed(text[a:b]):
            events.append(pe)
            out += turn.handle(pe)
    if not turn.cut:
        for pe in parser.finish():
            events.append(pe)
            out += turn.handle(pe)
        out += turn.end_of_output()
    return events, out, turn


def client_calls(out: List[Any]) -> Dict[int, Dict[str, Any]]:
    """The client calls of the loop's events, with their argument fragments, checking on the way that
    what a client holds is a JSON object once ``}`` is appended (or is one, at the end)."""
    calls: Dict[int, Dict[str, Any]] = {}
    for ev in out:
        if isinstance(ev, CallStart) and not ev.server:
            assert ev.index not in calls
            calls[ev.index] = {"name": ev.name, "fragments": []}
        elif isinstance(ev, CallArgs) and not ev.server:
            frags = calls[ev.index]["fragments"]
            frags.append(ev.fragment)
            held = "".join(frags)
            try:
                value = json.loads(held)
            except ValueError:
                value = json.loads(held + "}")
            assert isinstance(value, dict), held
    return calls


NAMES = sorted(BUILTIN_PARSERS)


# ====================================================================== the loop's mapping
@pytest.mark.parametrize("name", NAMES)
def test_fragments_join_to_the_arguments_for_every_format(name):
    """Every registered format: each call is passed on at its name; its fragments join to JSON of
    the arguments the call gets (the format's ``tool_arguments``: a plan step's are named by the
    schema), the same string however the output is split; a call with several top-level members
    (FieldComplete) gets several fragments, the first before the call closes."""
    text = written(name)
    events, out, turn = run(name, text)
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert ends, (name, text, events)
    calls = client_calls(out)
    assert [c["name"] for c in calls.values()] == [e.name for e in ends]
    fmt = BUILTIN_PARSERS[name].format
    for i, end in enumerate(ends):
        joined = "".join(calls[i]["fragments"])
        assert json.loads(joined) == fmt.tool_arguments(end.arguments, SCHEMAS.get(end.name), {}), (name, joined)
        fields = [e for e in events if isinstance(e, FieldComplete) and e.index == i]
        if len(fields) > 1:
            assert len(calls[i]["fragments"]) > 1, (name, calls[i])
    assert not turn.withdrawn
    rng = random.Random(name)
    for _ in range(20):  # the same string, split anywhere
        cuts = rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))
        again = client_calls(run(name, text, cuts)[1])
        assert {i: "".join(c["fragments"]) for i, c in again.items()} == \
               {i: "".join(c["fragments"]) for i, c in calls.items()}, (name, cuts)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_what_a_client_holds_is_always_an_object_prefix(name, data):
    """Split into one piece per character or any other way, every fragment leaves the client with a
    JSON object once ``}`` is appended (checked in :func:`client_calls`)."""
    text = written(name)
    cuts = data.draw(st.lists(st.integers(1, len(text) - 1), max_size=30, unique=True))
    client_calls(run(name, text, cuts)[1])


def test_a_three_member_call_is_released_member_by_member():
    """hermes: the model's bytes, up to the end of each member, then the rest at the end."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": {"t": "C"}}}\n</tool_call>'
    _, out, _ = run("hermes", text, list(range(1, len(text))))
    (call,) = client_calls(out).values()
    assert call["fragments"] == ['{"city": "Paris"', ', "days": 3', ', "units": {"t": "C"}', "}"]


def test_arguments_written_as_a_json_string_are_released_at_the_end():
    """``"arguments": "{...}"`` (a JSON-encoded string): the parser streams the decoded object whole
    before its members' FieldComplete, so nothing is a prefix to release early: all at the end."""
    inner = json.dumps({"city": "Paris", "days": 3})
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(inner) + "}\n</tool_call>"
    _, out, turn = run("hermes", text, list(range(1, len(text))))
    (call,) = client_calls(out).values()
    assert call["fragments"] == [inner] and not turn.withdrawn


BROKEN = {  # one good member, then a bad value
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": x}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": x}}]',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": x}}',
    "pythonic": '[get_weather(city="Paris", days=x)]',
}
SIBLING = {"hermes": '\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>',
           "mistral": "", "llama3_json": '; {"name": "get_time", "parameters": {"timezone": "UTC"}}',
           "pythonic": ""}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_call_broken_after_a_good_member_is_withdrawn(name):
    """The good member went out; the break withdraws the call: ``}`` closes what was sent, the turn
    stops (a good sibling after it is not passed on), nothing becomes content."""
    _, out, turn = run(name, BROKEN[name] + SIBLING[name], list(range(1, len(BROKEN[name]))))
    calls = client_calls(out)
    assert list(calls) == [0] and "".join(calls[0]["fragments"]) == '{"city": "Paris"}', calls
    assert calls[0]["fragments"][-1] == "}" and turn.withdrawn == [0] and turn.cut
    assert not [e for e in out if isinstance(e, Content)] and not turn.client_calls()


def test_a_call_broken_before_any_member_closes_with_an_empty_object():
    _, out, turn = run("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}')
    assert ["".join(c["fragments"]) for c in client_calls(out).values()] == ["{}"] and turn.withdrawn == [0]


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3_json", "pythonic", "markdown"])
def test_a_call_open_when_the_output_ends_is_withdrawn(name):
    """max_tokens (or EOS) inside a call: the end of the output withdraws it, valid JSON kept."""
    text = written(name)
    first_end = next(i for i in range(len(text) + 1)
                     if any(isinstance(e, ToolCallEnd) for e in BUILTIN_PARSERS[name](tools=SCHEMAS).parse(text[:i])))
    cut = text[:first_end - 3]  # three characters short of the first call's end
    _, out, turn = run(name, cut)
    calls = client_calls(out)
    assert list(calls) == [0] and turn.withdrawn == [0], (name, cut, out)
    assert isinstance(json.loads("".join(calls[0]["fragments"])), dict)


def test_a_tool_that_was_not_offered_is_content_and_the_next_call_comes_through():
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>\n' + \
           '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    _, out, turn = run("hermes", text, list(range(1, len(text))))
    calls = client_calls(out)
    assert [(c["name"], "".join(c["fragments"])) for c in calls.values()] == [("get_time", '{"timezone": "UTC"}')]
    assert "rm_rf" in "".join(e.text for e in out if isinstance(e, Content)) and not turn.withdrawn


def test_a_forced_call_cut_before_its_name_is_dropped_not_content():
    _, out, turn = run("hermes", '<tool_call>\n{"name": "get_wea', forced_calls=True)
    assert out == [] and not turn.withdrawn


def test_calls_a_parser_reads_when_none_are_parsed_are_content():
    """``parse_tools`` False (tool_choice none) and a parser that reads calls anyway (a format that
    carries reasoning, harmony, is run for it): nothing is passed on, the call is content."""
    text = written("hermes")
    _, out, turn = run("hermes", text, parse_tools=False)
    assert not client_calls(out) and "get_weather" in "".join(e.text for e in out if isinstance(e, Content))


def test_parallel_false_stops_after_the_first_call():
    text = written("hermes")
    _, out, turn = run("hermes", text, list(range(1, len(text))), parallel_tool_calls=False)
    assert list(client_calls(out)) == [0] and turn.stop_now and not turn.withdrawn


def test_non_finite_numbers_withdraw_the_call():
    """``NaN`` is not JSON (clients parse arguments strictly): the member is never sent, the call is
    withdrawn with what was."""
    _, out, turn = run("pythonic", '[get_weather(city="Paris", days=float("nan"))]')
    assert ["".join(c["fragments"]) for c in client_calls(out).values()] == ['{"city": "Paris"}']
    assert turn.withdrawn == [0]
    assert [e for e in run("pythonic", '[get_weather(city="Paris", days=1e999)]')[0]
            if isinstance(e, ParserError)]


# ====================================================================== over HTTP
LONG = "x" * 80
ARGS3 = {"city": "Paris", "note": LONG, "days": 3}
CALL3 = '<tool_call>\n' + json.dumps({"name": "get_weather", "arguments": ARGS3}) + '\n</tool_call>'
BROKEN_CALL = BROKEN["hermes"] + SIBLING["hermes"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS["get_weather"]}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": SCHEMAS["get_time"]}}
USER = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def live():
    m = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32", "max_model_len": 2048, "parser": "hermes"}
    with LiveGateway({"server": {"replay": True}, "models": {"hermes": m},
                      "plugins": {"entrypoints": False}}) as gw:
        yield gw


@pytest.fixture(scope="module")
def cut_tokens(live) -> int:
    """max_tokens that ends the replayed CALL3 inside its long second member."""
    tok = live.gateway.models["hermes"].tokenizer
    return len(tok.encode(CALL3[:CALL3.index(LONG)])) + 5


def chat(live, body: Dict[str, Any]) -> Dict[str, Any]:
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(live, body: Dict[str, Any]) -> List[Dict[str, Any]]:
    with httpx.stream("POST", live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=600) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def sse(live, path: str, body: Dict[str, Any]) -> List[Dict[str, Any]]:
    with httpx.stream("POST", live.url + path, json={**body, "stream": True}, timeout=600) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def streamed_calls(chunks: List[Dict[str, Any]]) -> Tuple[List[Tuple[str, str]], Dict[int, int]]:
    """(name, arguments) of each streamed call, and how many chunks carried its argument fragments."""
    calls: Dict[int, List[str]] = {}
    pieces: Dict[int, int] = {}
    for c in chunks:
        for tc in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            entry = calls.setdefault(tc["index"], [None, ""])
            fn = tc.get("function") or {}
            entry[0] = fn.get("name") or entry[0]
            if fn.get("arguments"):
                entry[1] += fn["arguments"]
                pieces[tc["index"]] = pieces.get(tc["index"], 0) + 1
    return [tuple(calls[i]) for i in sorted(calls)], pieces


def body_(replay: str, **extra: Any) -> Dict[str, Any]:
    return {"model": "hermes", "messages": USER, "tools": [WEATHER, TIME], "max_tokens": 400,
            "interlace": {"replay": replay}, **extra}


def test_chat_arguments_arrive_in_several_chunks_and_match_the_answer(live):
    chunks = chat_stream(live, body_(CALL3))
    calls, pieces = streamed_calls(chunks)
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", ARGS3)]
    assert pieces[0] >= 3, pieces  # one per member, then the closing brace
    first_args = next(i for i, c in enumerate(chunks) if c["choices"] and any(
        (tc.get("function") or {}).get("arguments") for tc in c["choices"][0]["delta"].get("tool_calls") or []))
    assert first_args < len(chunks) - 3  # long before the finish chunk
    answer = chat(live, body_(CALL3))["choices"][0]
    assert answer["finish_reason"] == "tool_calls" and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in answer["message"]["tool_calls"]] == calls
    assert calls[0][1] == json.dumps(ARGS3)  # the model's bytes


@pytest.mark.parametrize("how", ["broken", "cut"])
def test_chat_withdrawn_call(live, cut_tokens, how):
    body = body_(BROKEN_CALL) if how == "broken" else body_(CALL3, max_tokens=cut_tokens)
    answer = chat(live, body)
    ch = answer["choices"][0]
    assert ch["finish_reason"] == ("stop" if how == "broken" else "length"), ch
    assert answer["interlace"]["withdrawn_tool_calls"] == [0] and ch["message"]["content"] is None
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"]["tool_calls"]]
    assert [(n, json.loads(a)) for n, a in got] == [("get_weather", {"city": "Paris"})]
    chunks = chat_stream(live, body)
    assert streamed_calls(chunks)[0] == got
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == ch["finish_reason"]
    assert last["interlace"]["withdrawn_tool_calls"] == [0]


def test_chat_parallel_false_stops_after_the_first_call(live):
    two = CALL3 + SIBLING["hermes"]
    body = body_(two, parallel_tool_calls=False)
    ch = chat(live, body)["choices"][0]
    assert [c["function"]["name"] for c in ch["message"]["tool_calls"]] == ["get_weather"]
    assert ch["finish_reason"] == "tool_calls"
    chunks = chat_stream(live, body)
    assert [n for n, _ in streamed_calls(chunks)[0]] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    full = chat(live, body_(two))["choices"][0]
    assert [c["function"]["name"] for c in full["message"]["tool_calls"]] == ["get_weather", "get_time"]


def responses_body(replay: str, **extra: Any) -> Dict[str, Any]:
    return {"model": "hermes", "input": USER[0]["content"], "store": False, "max_output_tokens": 400,
            "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMAS["get_weather"]}],
            "interlace": {"replay": replay}, **extra}


def test_responses_arguments_stream_in_several_deltas(live):
    events = sse(live, "/v1/responses", responses_body(CALL3))
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) >= 3 and json.loads("".join(deltas)) == ARGS3
    (done,) = [e for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert done["item"]["status"] == "completed" and done["item"]["arguments"] == "".join(deltas)


@pytest.mark.parametrize("how", ["broken", "cut"])
def test_responses_withdrawn_call_is_an_incomplete_item(live, cut_tokens, how):
    """The function_call item is done with status "incomplete" (a client must not run it); the response
    is incomplete (max_output_tokens) when the limit cut it, else completed."""
    body = responses_body(BROKEN_CALL) if how == "broken" else responses_body(CALL3, max_output_tokens=cut_tokens)
    r = httpx.post(live.url + "/v1/responses", json=body, timeout=600)
    assert r.status_code == 200, r.text
    resp = r.json()
    (item,) = [o for o in resp["output"] if o["type"] == "function_call"]
    assert item["status"] == "incomplete" and json.loads(item["arguments"]) == {"city": "Paris"}
    if how == "cut":
        assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert resp["status"] == "completed" and resp["incomplete_details"] is None
    events = sse(live, "/v1/responses", body)
    (done,) = [e for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert done["item"]["status"] == "incomplete" and done["item"]["arguments"] == item["arguments"]
    assert events[-1]["type"] == f"response.{resp['status']}"
    assert [o["type"] for o in events[-1]["response"]["output"]] == [o["type"] for o in resp["output"]]


def messages_body(replay: str, **extra: Any) -> Dict[str, Any]:
    return {"model": "hermes", "max_tokens": 400, "messages": USER, "interlace": {"replay": replay},
            "tools": [{"name": "get_weather", "input_schema": SCHEMAS["get_weather"]}], **extra}


def test_messages_input_json_streams_in_several_deltas(live):
    events = sse(live, "/v1/messages", messages_body(CALL3))
    parts = [e["delta"]["partial_json"] for e in events
             if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert len(parts) >= 3 and json.loads("".join(parts)) == ARGS3
    assert [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("how", ["broken", "cut"])
def test_messages_withdrawn_call_is_never_tool_use(live, cut_tokens, how):
    body = messages_body(BROKEN_CALL) if how == "broken" else messages_body(CALL3, max_tokens=cut_tokens)
    r = httpx.post(live.url + "/v1/messages", json=body, timeout=600)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["stop_reason"] == ("end_turn" if how == "broken" else "max_tokens"), msg
    (use,) = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert use["input"] == {"city": "Paris"}
    events = sse(live, "/v1/messages", body)
    parts = [e["delta"]["partial_json"] for e in events
             if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(parts)) == {"city": "Paris"}
    assert [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] == msg["stop_reason"]
