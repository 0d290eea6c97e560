"""Agent frameworks nobody here wrote, against one live gateway: each one's basic agent path.

The OpenAI Agents SDK (``openai-agents``), LangGraph's ReAct agent
(``create_react_agent``) with ``ChatInterlace`` and with ``langchain-openai``'s
``ChatOpenAI``, and pydantic-ai each run, through their own public API and
their own HTTP client: a plain chat reply, one client-side tool round trip (the
framework executes the tool and sends its result back; the model answers the
follow-up), and the same round trip streamed.
The official MCP client is tested against ``interlace mcp serve`` in
tests/test_mcp_serve.py.

Why these are in the suite: into the project's venv each adds two to five
small packages (19-25 s with pip's cache; 38-60 s and 110-142 MB in a fresh
venv, docs/clients.md has the table).  litellm (381 MB, boto3 included) and the
MCP Inspector (Node.js) are documented there instead.  The module makes about
20 model requests of at most 40 tokens each: well under a minute on a quiet
machine; on the shared 2-core one at load 9 it took six.

The embedded 135M model never calls a tool when free, so each framework's own
way of forcing the first call is used (``tool_choice: "required"`` on the first
step only: the Agents SDK resets it after a tool ran, LangGraph takes a model
chosen per step, pydantic-ai a capability's per-step settings); the follow-up
is ``auto`` and the model answers in prose.  What must hold beside a forced
call: no text at all (OpenAI sends ``content: null``), so no framework turns it
into an extra message item or a message with stray content.
"""

from __future__ import annotations

from typing import Any, List

import openai
import pytest

from helpers.gateway_server import LiveGateway

KEY = "clients-key"
MODEL = "smollm2"
CAPITAL = "What is the capital of France?"
WEATHER_Q = "What is the weather like in Paris today?"
#: the forced call ends where its grammar does (about 25 tokens); the free follow-up runs to the cap
FORCED = {"max_tokens": 40, "temperature": 0}


@pytest.fixture(scope="module")
def live():
    cfg = {"server": {"api_keys": [KEY]},
           # float32 pinned: greedy outputs must not depend on the CPU's bfloat16 support
           "models": {MODEL: {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32"}}}
    with LiveGateway(cfg) as gw:
        yield gw


class Weather:
    """The client-side tool: records each call the framework made."""

    def __init__(self) -> None:
        self.cities: List[str] = []

    def __call__(self, city: str) -> str:
        self.cities.append(city)
        return self.answer(city)

    @staticmethod
    def answer(city: str) -> str:
        return f"It is sunny and 22 degrees in {city}."

    def only_answer(self) -> str:
        """What the tool returned, after checking the framework called it exactly once, with a city."""
        assert len(self.cities) == 1 and isinstance(self.cities[0], str) and self.cities[0], self.cities
        return self.answer(self.cities[0])


# ============================================================== OpenAI Agents SDK
def agents_model(live):
    from agents import OpenAIChatCompletionsModel

    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    return OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


def agents_weather_agent(live, weather: Weather):
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return weather(city)

    # required on the first turn; the SDK resets tool_choice once a tool ran (reset_tool_choice)
    return Agent(name="weather", model=agents_model(live), tools=[get_weather],
                 model_settings=ModelSettings(tool_choice="required", **FORCED))


def assert_agents_round_trip(result, weather: Weather) -> None:
    """Exactly: the call, its output, the answer.  A stray ``content`` beside the forced call
    would be an extra message item before the call (issue 30, item 3)."""
    from agents import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == [ToolCallItem.__name__, ToolCallOutputItem.__name__, MessageOutputItem.__name__], kinds
    assert result.new_items[1].output == weather.only_answer()
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output


async def test_agents_sdk_plain_reply(live):
    from agents import Agent, ModelSettings, RunConfig, Runner

    agent = Agent(name="plain", model=agents_model(live), model_settings=ModelSettings(max_tokens=12, temperature=0))
    result = await Runner.run(agent, CAPITAL, run_config=RunConfig(tracing_disabled=True))
    assert "Paris" in result.final_output


async def test_agents_sdk_tool_round_trip(live):
    from agents import RunConfig, Runner

    weather = Weather()
    result = await Runner.run(agents_weather_agent(live, weather), WEATHER_Q,
                              run_config=RunConfig(tracing_disabled=True), max_turns=3)
    assert_agents_round_trip(result, weather)


async def test_agents_sdk_streamed_tool_round_trip(live):
    from agents import RunConfig, Runner
    from openai.types.responses import ResponseTextDeltaEvent

    weather = Weather()
    result = Runner.run_streamed(agents_weather_agent(live, weather), WEATHER_Q,
                                 run_config=RunConfig(tracing_disabled=True), max_turns=3)
    deltas = [event.data.delta async for event in result.stream_events()
              if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)]
    assert_agents_round_trip(result, weather)
    assert "".join(deltas) == result.final_output  # every word of the answer was streamed, and nothing else


# ============================================================ LangGraph ReAct agent
# synchronous: langchain-openai keeps one async HTTP client per process, bound to the first test's event loop
def chat_interlace(live, **kw):
    from interlace.sdk.langchain import ChatInterlace

    return ChatInterlace(model=MODEL, base_url=live.url + "/v1", api_key=KEY, max_retries=0, **kw)


def chat_openai(live, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=live.url + "/v1", api_key=KEY, max_retries=0, **kw)


LANGCHAIN_MODELS = {"ChatInterlace": chat_interlace, "ChatOpenAI": chat_openai}


def react_agent(llm, weather: Weather, force: bool = True):
    """LangGraph's prebuilt ReAct agent with the model chosen per step: with ``force``, the call
    is forced while no tool has answered, free afterwards (a forced follow-up would call forever)."""
    import warnings

    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return weather(city)

    def pick(state, runtime):
        answered = any(isinstance(m, ToolMessage) for m in state["messages"])
        return llm.bind_tools([get_weather], **({"tool_choice": "required"} if force and not answered else {}))

    with warnings.catch_warnings():  # create_react_agent is deprecated for langchain's create_agent; still LangGraph's
        warnings.simplefilter("ignore", DeprecationWarning)
        from langgraph.prebuilt import create_react_agent

        return create_react_agent(pick, [get_weather])


def assert_react_round_trip(messages, weather: Weather) -> None:
    """Human, the forced call (no content beside it: issue 30, item 3), the tool's answer, the reply."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    assert [type(m) for m in messages] == [HumanMessage, AIMessage, ToolMessage, AIMessage], messages
    call, answer, reply = messages[1:]
    assert len(call.tool_calls) == 1 and call.tool_calls[0]["name"] == "get_weather", call
    assert call.content == "", repr(call.content)
    assert answer.tool_call_id == call.tool_calls[0]["id"] and answer.content == weather.only_answer()
    assert not reply.tool_calls and isinstance(reply.content, str) and reply.content.strip(), reply


@pytest.mark.parametrize("make", LANGCHAIN_MODELS.values(), ids=LANGCHAIN_MODELS.keys())
def test_langgraph_plain_reply(live, make):
    """The agent with its tool offered and nothing forced: the model answers in prose, no tool runs."""
    from langchain_core.messages import AIMessage, HumanMessage

    weather = Weather()
    state = react_agent(make(live, temperature=0, max_tokens=12), weather, force=False).invoke(
        {"messages": [("user", CAPITAL)]})
    assert [type(m) for m in state["messages"]] == [HumanMessage, AIMessage], state["messages"]
    assert "Paris" in state["messages"][-1].content and weather.cities == []


@pytest.mark.parametrize("make", LANGCHAIN_MODELS.values(), ids=LANGCHAIN_MODELS.keys())
def test_langgraph_react_agent_tool_round_trip(live, make):
    weather = Weather()
    state = react_agent(make(live, **FORCED), weather).invoke({"messages": [("user", WEATHER_Q)]})
    assert_react_round_trip(state["messages"], weather)


@pytest.mark.parametrize("make", LANGCHAIN_MODELS.values(), ids=LANGCHAIN_MODELS.keys())
def test_langgraph_react_agent_streams_tokens(live, make):
    from langchain_core.messages import AIMessageChunk

    weather = Weather()
    graph = react_agent(make(live, streaming=True, **FORCED), weather)
    pieces: List[Any] = []
    final = None
    for mode, data in graph.stream({"messages": [("user", WEATHER_Q)]}, stream_mode=["messages", "values"]):
        if mode == "messages":
            chunk, meta = data
            if isinstance(chunk, AIMessageChunk) and meta["langgraph_node"] == "agent":
                pieces.append(chunk)
        else:
            final = data
    assert_react_round_trip(final["messages"], weather)
    streamed = "".join(c.content for c in pieces if isinstance(c.content, str))
    assert len(pieces) > 2 and streamed == final["messages"][-1].content, (streamed, final["messages"][-1])


# ====================================================================== pydantic-ai
def pydantic_agent(live, tools=(), **kw):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
    return Agent(model, tools=list(tools), **kw)


def pydantic_weather_agent(live, weather: Weather):
    """The call forced on the first step only: pydantic-ai refuses a static ``required`` (it would
    never let the run finish) and takes per-step settings from a capability."""
    from dataclasses import dataclass

    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.settings import ModelSettings

    @dataclass
    class FirstStepCallsATool(AbstractCapability):
        def get_model_settings(self):
            return lambda ctx: ModelSettings(tool_choice="required") if ctx.run_step <= 1 else ModelSettings()

    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return weather(city)

    return pydantic_agent(live, [get_weather], capabilities=[FirstStepCallsATool()],
                          model_settings={"max_tokens": FORCED["max_tokens"], "temperature": 0})


def assert_pydantic_round_trip(messages, output, weather: Weather) -> None:
    """request, the forced call (a response with no text part: issue 30, item 3), the tool's
    return, the answer."""
    from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart

    assert [type(m) for m in messages] == [ModelRequest, ModelResponse, ModelRequest, ModelResponse], messages
    call = messages[1]
    assert [type(p) for p in call.parts] == [ToolCallPart], call.parts
    (ret,) = [p for p in messages[2].parts if isinstance(p, ToolReturnPart)]
    assert ret.tool_call_id == call.parts[0].tool_call_id and ret.content == weather.only_answer()
    assert [type(p) for p in messages[3].parts] == [TextPart] and output == messages[3].parts[0].content
    assert isinstance(output, str) and output.strip(), output


async def test_pydantic_ai_plain_reply(live):
    result = await pydantic_agent(live, model_settings={"max_tokens": 12, "temperature": 0}).run(CAPITAL)
    assert "Paris" in result.output


async def test_pydantic_ai_tool_round_trip(live):
    weather = Weather()
    result = await pydantic_weather_agent(live, weather).run(WEATHER_Q)
    assert_pydantic_round_trip(result.all_messages(), result.output, weather)


async def test_pydantic_ai_streamed_tool_round_trip(live):
    weather = Weather()
    async with pydantic_weather_agent(live, weather).run_stream(WEATHER_Q) as run:
        pieces = [piece async for piece in run.stream_text(delta=True)]
        output = await run.get_output()
        messages = run.all_messages()
    assert_pydantic_round_trip(messages, output, weather)
    assert len(pieces) > 1 and "".join(pieces) == output

