"""The official clients of the APIs agents speak, against a live ``interlace serve`` subprocess
(issue 33, "Validated with the real clients"): OpenAI's ``openai`` client on the Responses API,
the OpenAI Agents SDK with its default Responses model and with ``OpenAIChatCompletionsModel``,
and Anthropic's ``anthropic`` client on the Messages API.

Each test goes through the client's public API only and asserts three things: the wire format
(what the client's own models and stream helpers parse: they raise on a lifecycle out of order,
an item that changes identity, a missing ``response.completed`` or ``message_start``), the kept
context (a follow-up's ``cached_tokens`` / ``cache_read_input_tokens`` covers at least the whole
earlier prompt: the retained engine context was adopted, not only some prefix-cache blocks), and
the parsed objects the agent code reads.

What the clients send (captured against a scratch echo server while the routes were written): the
Agents SDK's default model re-sends the whole input each turn (its function
call item with our ``id`` and ``status``, then the ``function_call_output``), with ``include: []``
and no ``store``; with ``auto_previous_response_id`` it sends ``previous_response_id`` and only the
output.  It fails a run whose response is ``incomplete`` (cut by ``max_output_tokens``), so its
free follow-ups here get room to end by themselves.  ``anthropic`` 2.14 sends its key as a bearer
token and has no ``temperature`` argument (it goes through ``extra_body``); Claude Code sends
``x-api-key``, tested here with the same client.

The model is the embedded 135M one: where a test needs an exact output (a tool call, a text to
compare with the streamed deltas) it is replayed (``interlace.replay``, allowed for both keys).
One subprocess for the module; about 30 short model requests (40 s on the shared 2-core machine).
"""

from __future__ import annotations

import json
from typing import List, Literal

import anthropic
import openai
import pydantic
import pytest

from helpers.gateway_server import serve_subprocess

KEY, OTHER = "official-a", "official-b"
MODEL = "smollm2"
WEATHER_Q = "What is the weather like in Paris today?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
                  "parameters": WEATHER_PARAMS}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Get the current weather for a city.",
                  "input_schema": WEATHER_PARAMS}
SUNNY = "It is sunny and 22 degrees in Paris."


def replay(output) -> dict:
    return {"interlace": {"replay": output}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("official_clients")
    cfg = {"server": {"api_keys": [KEY, OTHER], "replay": True,
                      "responses": {"path": str(root / "responses.sqlite3")}},
           # float32 pinned: greedy outputs must not depend on the CPU's bfloat16 support
           "models": {MODEL: {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}}}
    with serve_subprocess(cfg, root) as u:
        yield u


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai_other(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=OTHER, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


# ====================================================================== openai: Responses
def test_responses_create_text(oai):
    r = oai.responses.create(model=MODEL, input="Say hello.", max_output_tokens=20, extra_body=replay("Hello there!"))
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.error is None and r.incomplete_details is None
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed" and msg.id
    assert [(p.type, p.text) for p in msg.content] == [("output_text", "Hello there!")]
    assert r.output_text == "Hello there!"
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0


def test_responses_function_call_and_output_by_previous_response_id(oai):
    r1 = oai.responses.create(model=MODEL, input=WEATHER_Q, tools=[RESPONSES_TOOL], tool_choice="required",
                              max_output_tokens=60, extra_body=replay(CALL))
    assert r1.status == "completed" and r1.output_text == ""
    (call,) = r1.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.id
    assert json.loads(call.arguments) == {"city": "Paris"}
    # the follow-up carries only the output: the stored response has the rest (tools are not carried over)
    r2 = oai.responses.create(model=MODEL, previous_response_id=r1.id, tools=[RESPONSES_TOOL], temperature=0,
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": SUNNY}],
                              max_output_tokens=12)
    assert r2.previous_response_id == r1.id and r2.id != r1.id
    assert r2.output and r2.output[-1].type == "message" and r2.output_text.strip()
    # the kept context: the first prompt and the call (all but the last token, never fed) were adopted,
    # not refilled; the prefix cache alone would give whole blocks of the prompt
    kept = r1.usage.input_tokens + r1.usage.output_tokens - 1
    assert r2.usage.input_tokens_details.cached_tokens >= kept, (r1.usage, r2.usage)
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    # an output for a call the stored response never made contradicts it
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, previous_response_id=r1.id, tools=[RESPONSES_TOOL], max_output_tokens=4,
                             input=[{"type": "function_call_output", "call_id": "call_unknown", "output": "x"}])
    assert "call_unknown" in str(e.value)


def test_responses_stream_text_through_the_stream_helper(oai):
    text = "Paris is the capital of France."
    with oai.responses.stream(model=MODEL, input="What is the capital of France?", max_output_tokens=20,
                              extra_body=replay(text)) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    assert "response.output_item.added" in types and "response.output_item.done" in types
    assert "response.failed" not in types and "error" not in types
    seq = [e.sequence_number for e in events]
    assert seq == list(range(seq[0], seq[0] + len(seq))), seq
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == text
    assert final.status == "completed" and final.usage.output_tokens > 0
    assert final.id == events[0].response.id


def test_responses_stream_function_call_arguments(oai):
    with oai.responses.stream(model=MODEL, input=WEATHER_Q, tools=[RESPONSES_TOOL], tool_choice="required",
                              max_output_tokens=60, extra_body=replay(CALL)) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas and "".join(deltas) == done.arguments == call.arguments
    assert "response.output_text.delta" not in [e.type for e in events]


class Capital(pydantic.BaseModel):
    city: Literal["Paris", "Lyon", "Marseille"]
    is_capital: bool


def test_responses_text_format_json_schema(oai):
    """``text.format`` json_schema through the same constrained decoding as chat's
    response_format: the client's own parse (``responses.parse``) reads the model's free output."""
    r = oai.responses.parse(model=MODEL, input="Which French city is the capital of France?", text_format=Capital,
                            max_output_tokens=40, temperature=0)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Capital), r.output_text
    assert Capital.model_validate_json(r.output_text) == r.output_parsed
    # the plain create with the same format: the text is the JSON, nothing around it
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = oai.responses.create(model=MODEL, input="Is Paris in France?", max_output_tokens=20, temperature=0,
                             text={"format": {"type": "json_schema", "name": "yes_no", "schema": schema,
                                              "strict": True}})
    assert json.loads(r.output_text)["answer"] in ("yes", "no")


def test_responses_retrieve_input_items_delete_and_other_keys(oai, oai_other):
    r = oai.responses.create(model=MODEL, input="Remember this.", max_output_tokens=8,
                             extra_body=replay("Noted."), metadata={"case": "retrieve"})
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.status == "completed" and got.output_text == "Noted."
    assert got.metadata == {"case": "retrieve"}
    items = oai.responses.input_items.list(r.id).data
    assert [(i.type, i.role, [c.text for c in i.content]) for i in items] == [("message", "user", ["Remember this."])]
    # another key: as if it did not exist (404, never 403: the id's existence does not leak)
    with pytest.raises(openai.NotFoundError):
        oai_other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oai_other.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        oai_other.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai_other.responses.create(model=MODEL, previous_response_id=r.id, input="And then?", max_output_tokens=2)
    assert oai.responses.retrieve(r.id).id == r.id  # the other key's delete did nothing
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(r.id)
    # store=false: answered, not kept
    r = oai.responses.create(model=MODEL, input="Forget this.", max_output_tokens=8, store=False,
                             extra_body=replay("Gone."))
    assert r.output_text == "Gone."
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


# ================================================================ openai-agents (Agents SDK)
class Weather:
    """The client-side tool: records each call the agent made."""

    def __init__(self) -> None:
        self.cities: List[str] = []

    def __call__(self, city: str) -> str:
        self.cities.append(city)
        return f"It is sunny and 22 degrees in {city}."


def weather_agent(url: str, weather: Weather, responses: bool):
    """An agent with one function tool on the SDK's default Responses model (``responses``) or on
    ``OpenAIChatCompletionsModel``.  The call is forced on the first turn (the 135M model never calls
    a tool when free; the SDK resets tool_choice once a tool ran); the free answer gets room to end
    by itself: the SDK fails a run whose response is ``incomplete``."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return weather(city)

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = (OpenAIResponsesModel if responses else OpenAIChatCompletionsModel)(model=MODEL, openai_client=client)
    return Agent(name="weather", instructions="Answer in one short sentence.", model=model, tools=[get_weather],
                 model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                                temperature=0))


def assert_agent_round_trip(result, weather: Weather) -> None:
    """The call, its output, the answer; and the answer's request adopted the call's kept context
    (the SDK re-sends the whole input: adopted by its tokens; or by ``previous_response_id``)."""
    from agents import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == [ToolCallItem.__name__, ToolCallOutputItem.__name__, MessageOutputItem.__name__], kinds
    assert len(weather.cities) == 1 and weather.cities[0], weather.cities
    assert result.new_items[1].output == f"It is sunny and 22 degrees in {weather.cities[0]}."
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
    # at least the whole first prompt (the prefix cache alone gives whole 16-token blocks of it); not
    # always all of the call: a grammar-forced call may be tokenized unlike its re-rendered text
    first, second = result.raw_responses
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, (first.usage, second.usage)


MODELS = {"responses": True, "chat_completions": False}


@pytest.mark.parametrize("responses", MODELS.values(), ids=MODELS.keys())
async def test_agents_run(url, responses):
    from agents import RunConfig, Runner

    weather = Weather()
    result = await Runner.run(weather_agent(url, weather, responses), WEATHER_Q, max_turns=3,
                              run_config=RunConfig(tracing_disabled=True))
    assert_agent_round_trip(result, weather)
    if responses:
        assert all(r.response_id and r.response_id.startswith("resp_") for r in result.raw_responses)


@pytest.mark.parametrize("responses", MODELS.values(), ids=MODELS.keys())
async def test_agents_run_streamed(url, responses):
    from agents import RunConfig, Runner
    from openai.types.responses import ResponseTextDeltaEvent

    weather = Weather()
    result = Runner.run_streamed(weather_agent(url, weather, responses), WEATHER_Q, max_turns=3,
                                 run_config=RunConfig(tracing_disabled=True))
    deltas = [event.data.delta async for event in result.stream_events()
              if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)]
    assert_agent_round_trip(result, weather)
    assert "".join(deltas) == result.final_output  # every word of the answer was streamed, and nothing else


async def test_agents_auto_previous_response_id(url):
    """The SDK's server-side conversation: the second turn sends ``previous_response_id`` and only
    the ``function_call_output``; the stored response supplies the rest and its kept context."""
    from agents import RunConfig, Runner

    weather = Weather()
    result = await Runner.run(weather_agent(url, weather, True), WEATHER_Q, max_turns=3,
                              run_config=RunConfig(tracing_disabled=True), auto_previous_response_id=True)
    assert_agent_round_trip(result, weather)
    assert result.last_response_id == result.raw_responses[-1].response_id


# ====================================================================== anthropic: Messages
def test_messages_tool_use_and_tool_result_follow_up(claude):
    question = [{"role": "user", "content": WEATHER_Q}]
    m = claude.messages.create(model=MODEL, max_tokens=60, system="You are a weather assistant.", messages=question,
                               tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"}, extra_body=replay(CALL))
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    follow = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": SUNNY}]}]
    m2 = claude.messages.create(model=MODEL, max_tokens=12, system="You are a weather assistant.", messages=follow,
                                tools=[ANTHROPIC_TOOL], extra_body={"temperature": 0})
    assert m2.stop_reason in ("end_turn", "max_tokens")
    assert m2.content and m2.content[0].type == "text" and m2.content[0].text.strip()
    # the kept context: the first prompt and the call (all but the last token, never fed), where the
    # prefix cache alone gives whole blocks of the prompt; Anthropic's input_tokens excludes cache reads
    first_prompt = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert m2.usage.cache_read_input_tokens >= first_prompt + m.usage.output_tokens - 1, (m.usage, m2.usage)
    # a tool_result for a tool_use the turn before never made: Anthropic's error shape, naming the block
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=question + [
            {"role": "assistant", "content": "Let me check."},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages" in e.value.body["error"]["message"]


def test_messages_stream(claude):
    text = "Paris is the capital of France."
    with claude.messages.stream(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "Capital?"}],
                                extra_body=replay(text)) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == text
    assert [(b.type, b.text) for b in final.content] == [("text", text)]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0 and final.usage.input_tokens > 0


def test_messages_stream_tool_use(claude):
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": WEATHER_Q}],
                                tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"}, extra_body=replay(CALL)) as s:
        events = list(s)
        final = s.get_final_message()
    assert [e.type for e in events][0] == "message_start"
    assert final.stop_reason == "tool_use"
    (use,) = final.content
    assert use.type == "tool_use" and use.input == {"city": "Paris"}
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}


def test_messages_count_tokens_matches_the_prompt(claude):
    kw = dict(model=MODEL, system="You are a weather assistant.", tools=[ANTHROPIC_TOOL],
              messages=[{"role": "user", "content": "Is it raining in Lyon?"}])
    counted = claude.messages.count_tokens(**kw).input_tokens
    m = claude.messages.create(max_tokens=1, **kw)
    assert counted == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 50  # the tools are counted
    assert claude.messages.count_tokens(model=MODEL, messages=kw["messages"]).input_tokens < counted


def test_messages_x_api_key_and_errors(url):
    """Claude Code's header (``x-api-key``) as well as the client's bearer token; a wrong key is
    Anthropic's authentication_error."""
    c = anthropic.Anthropic(base_url=url, api_key=None, auth_token=None, default_headers={"x-api-key": KEY},
                            max_retries=0, timeout=120)
    m = c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                          extra_body=replay("Hello."))
    assert m.content[0].text == "Hello."
    bad = anthropic.Anthropic(base_url=url, api_key=None, default_headers={"x-api-key": "wrong"}, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
