"""``to_semantic``: LCEL chains run as one Semantic Variable DAG
(sdk/langchain/semantic_chain.py).

First what a chain becomes (the planned calls, no server), and the clear
error every unsupported runnable gets; then round trips against a live
gateway: greedy results equal the unconverted chain's, run step by step with
ChatInterlace.
"""

from __future__ import annotations

import asyncio
import json
from operator import itemgetter
from typing import Any

import pytest
from langchain_core.language_models import FakeListChatModel
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser, StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import (RunnableBranch, RunnableGenerator, RunnableLambda, RunnableParallel,
                                      RunnablePassthrough)
from pydantic import BaseModel

from helpers.gateway_server import LiveGateway, engine_state
from interlace.sdk.langchain import ChatInterlace, ConversionError, to_semantic

KEY = "lc-semantic-key"


def model(url: str = "http://127.0.0.1:9/v1", **kw: Any) -> ChatInterlace:
    return ChatInterlace(**{"base_url": url, "api_key": KEY, "model": "smollm2", "temperature": 0,
                            "max_tokens": 12, **kw})


# ---------------------------------------------------------------- what a chain becomes
def test_a_chain_becomes_calls_with_the_prompt_langchain_renders():
    llm = model()
    first = PromptTemplate.from_template("Name a {kind} of animal.") | llm | StrOutputParser()
    second = ChatPromptTemplate.from_messages([("system", "You are terse."),
                                               ("human", "Describe {{{animal}}} in {{n}} words.")],
                                              template_format="mustache")
    chain = RunnablePassthrough.assign(animal=first) | second | llm.bind(max_tokens=5) | StrOutputParser()
    plan = to_semantic(chain).plan({"kind": "big", "n": "three"})
    assert [c.messages for c in plan.calls] == [
        [{"role": "user", "content": "Name a big of animal."}, {"role": "assistant", "content": "{{output:out}}"}],
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Describe {{input:v0}} in three words."},
         {"role": "assistant", "content": "{{output:out}}"}]]
    assert plan.calls[1].inputs == {"v0": plan.calls[0].output}
    assert [c.name for c in plan.calls] == ["animal", "call_1"]  # named by the assign key, else by position
    assert plan.calls[0].sampling == {"temperature": 0.0, "max_tokens": 12}
    assert plan.calls[1].sampling == {"temperature": 0.0, "max_tokens": 5}  # .bind() wins, as in LangChain
    # the chat endpoint samples at temperature 1 when none is set: so does the converted call
    free = to_semantic(PromptTemplate.from_template("{x}") | ChatInterlace(base_url="http://h/v1"))
    assert free.plan({"x": "hi"}).calls[0].sampling == {"temperature": 1.0}


def test_constant_text_that_looks_like_a_placeholder_stays_text():
    chain = PromptTemplate.from_template("Say {{{{output:x}}}} and {a}") | model() | StrOutputParser()
    plan = to_semantic(chain).plan({"a": "b"})
    msg = plan.calls[0].messages[0]["content"]
    assert "{{output:x}}" not in msg and list(plan.calls[0].inputs.values()) == ["Say {{output:x}} and b"]


def test_reshaping_lambdas_run_on_placeholders_and_text_lambdas_at_the_end():
    from interlace.sdk.langchain.semantic_chain import _Later, _materialize

    llm = model()
    gen = PromptTemplate.from_template("{q}") | llm | StrOutputParser()
    both = RunnableParallel(a=gen, b=gen) | RunnableLambda(lambda d: {"x": d["a"], "y": d["b"]})
    # joining moves values without reading them: done on the placeholders
    plan = to_semantic(both | RunnableLambda(lambda d: d["x"] + " / " + d["y"])).plan({"q": "hi"})
    assert len(plan.calls) == 2 and not isinstance(plan.result, _Later)
    assert _materialize(plan.result, {0: "A", 1: "B"}) == "A / B"
    # reading the text (upper) or changing it without a read (strip) runs at the end, on the values
    for fn in (lambda d: d["x"].upper(), lambda d: (d["x"] + " ").strip(), lambda d: len(d["x"] + d["y"])):
        plan = to_semantic(both | RunnableLambda(fn)).plan({"q": "hi"})
        assert isinstance(plan.result, _Later)
        assert _materialize(plan.result, {0: " a ", 1: "b"}) == fn({"x": " a ", "y": "b"})


def _branch():
    return RunnableBranch((lambda x: True, PromptTemplate.from_template("{x}")), PromptTemplate.from_template("{x}"))


@pytest.mark.parametrize("build, named, why", [
    (lambda m: PromptTemplate.from_template("{x}") | FakeListChatModel(responses=["a"]), "FakeListChatModel",
     "only ChatInterlace"),
    (lambda m: _branch() | m, "RunnableBranch", "not converted"),
    (lambda m: RunnableGenerator(_gen) | m, "RunnableGenerator", "not converted"),
    (lambda m: afunc_only | m, "RunnableLambda", "async-only"),
    (lambda m: RunnablePassthrough(lambda x: None) | m, "RunnablePassthrough", "side-effect"),
])
def test_unknown_runnables_are_refused_at_conversion(build, named, why):
    with pytest.raises(ConversionError, match=why) as info:
        to_semantic(build(model()))
    assert named in info.value.runnable and named in str(info.value)


def _gen(it: Any) -> Any:
    yield from it


async def _afunc(x: Any) -> Any:
    return x


afunc_only = RunnableLambda(_afunc)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _two_step(second: Any, parser: Any = None) -> Any:
    first = PromptTemplate.from_template("Name a {kind}.") | model() | (parser or StrOutputParser())
    return {"thing": first} | second | model() | StrOutputParser()


@pytest.mark.parametrize("chain, named, why", [
    (_two_step(PromptTemplate.from_template("Describe {thing!r}.")), "PromptTemplate", "transforms a value"),
    (_two_step(PromptTemplate.from_template("Describe {thing:>40}.")), "PromptTemplate", "transforms a value"),
    (_two_step(PromptTemplate.from_template("Describe {{thing}}.", template_format="mustache")),
     "PromptTemplate", "HTML-escapes"),
    (_two_step(PromptTemplate.from_template("Describe {{ thing | upper }}.", template_format="jinja2")),
     "PromptTemplate", "jinja2"),
    (_two_step(PromptTemplate.from_template("Describe {thing}."), JsonOutputParser()), "PromptTemplate",
     "JsonOutputParser"),
    ({"thing": PromptTemplate.from_template("Name a {kind}.") | model() | StrOutputParser()
      | RunnableLambda(lambda s: s.upper())} | PromptTemplate.from_template("{thing}") | model(),
     "PromptTemplate", "client round trip"),
    (PromptTemplate.from_template("{kind}") | model() | model(), "ChatInterlace", "StrOutputParser"),
    (PromptTemplate.from_template("{kind}") | model().bind_tools([add]), "ChatInterlace", "tools"),
    (PromptTemplate.from_template("{kind}") | model() | StrOutputParser()
     | RunnableLambda(lambda s: s.split(",")) | model().map(), "RunnableEach", "produced on the server"),
    (PromptTemplate.from_template("{kind}") | ChatInterlace(base_url="http://elsewhere:1/v1") | StrOutputParser()
     | PromptTemplate.from_template("{x}") | model(), "ChatInterlace", "same Interlace server"),
    (PromptTemplate.from_template("{kind}"), "PromptTemplate", "calls no model"),
])
def test_what_needs_a_round_trip_is_refused_at_invoke_naming_the_runnable(chain, named, why):
    with pytest.raises(ConversionError, match=why) as info:
        to_semantic(chain).plan({"kind": "cat"})
    assert named in str(info.value)


def test_inputs_holding_the_marker_characters_are_refused():
    chain = PromptTemplate.from_template("{x}") | model() | StrOutputParser()
    with pytest.raises(ConversionError, match="private-use"):
        to_semantic(chain).plan({"x": "a \ue000 b"})


def test_structured_output_is_refused():
    class Joke(BaseModel):
        setup: str

    chain = PromptTemplate.from_template("{kind}") | model().with_structured_output(Joke)
    with pytest.raises(ConversionError, match="response_format|structured|tools"):
        to_semantic(chain).plan({"kind": "cat"})


# ---------------------------------------------------------------- round trips on a live gateway
@pytest.fixture(scope="module")
def live():
    cfg = {"server": {"api_keys": [KEY], "default_max_tokens": 32},
           "models": {"smollm2": {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32"}}}
    with LiveGateway(cfg) as gw:
        yield gw
    assert not gw.gateway.sessions  # every converted run deleted its session


def _same(chain: Any, inputs: Any, live: Any) -> Any:
    """The unconverted and the converted chain give the same result (or the same error)."""
    try:
        want: Any = chain.invoke(inputs)
    except Exception as e:  # noqa: BLE001  (compared below)
        want = e
    if isinstance(want, Exception):
        with pytest.raises(type(want)):
            to_semantic(chain).invoke(inputs)
        return want
    got = to_semantic(chain).invoke(inputs)
    # StrOutputParser returns a str subclass (TextAccessor); a str is what it promises
    assert isinstance(got, str) if isinstance(want, str) else type(got) is type(want)
    if hasattr(want, "content"):
        assert got.content == want.content
    else:
        assert got == want
    assert engine_state(live)["contexts"] == 0
    return got


def test_prompt_model_parser_round_trip(live):
    llm = model(live.url + "/v1")
    chain = PromptTemplate.from_template("Tell me a joke about {topic}.") | llm | StrOutputParser()
    assert _same(chain, {"topic": "cats"}, live)
    _same(PromptTemplate.from_template("Tell me a joke about {topic}.") | llm, {"topic": "dogs"}, live)
    _same(PromptTemplate.from_template("Tell me a joke about {topic}.") | llm | StrOutputParser(), "owls", live)


def test_chained_calls_and_chat_prompts_round_trip(live):
    llm = model(live.url + "/v1")
    name = ChatPromptTemplate.from_messages([("system", "You name things. Answer with one word."),
                                             ("human", "Name a {kind}.")]) | llm | StrOutputParser()
    describe = ChatPromptTemplate.from_messages([("human", "Describe {{{thing}}} for a {{reader}}.")],
                                                template_format="mustache")
    chain = RunnablePassthrough.assign(thing=name) | describe | llm.bind(max_tokens=8) | StrOutputParser()
    _same(chain, {"kind": "fruit", "reader": "child"}, live)
    j2 = PromptTemplate.from_template("In one line: what is {{ thing }}?", template_format="jinja2")
    _same({"thing": name} | j2 | llm | StrOutputParser(), {"kind": "colour"}, live)


def test_map_reduce_with_parallel_branches_and_lambdas_round_trip(live):
    llm = model(live.url + "/v1")
    summarize = PromptTemplate.from_template("Summarize in a few words: {part}") | llm | StrOutputParser()
    parts = ["The harbour was rebuilt in stone after the storm.",
             "Fishermen moved their boats to the new quay.", "The old lighthouse became a museum."]
    mapper = RunnableParallel({f"s{i}": itemgetter("parts") | RunnableLambda(lambda ps, i=i: {"part": ps[i]})
                               | summarize for i in range(len(parts))})
    # the join runs on placeholders: the reduce prompt is filled on the server, no round trip
    reduce = (RunnableLambda(lambda d: {"notes": "\n".join(f"- {v}" for v in d.values())})
              | PromptTemplate.from_template("Combine these notes into one sentence:\n{notes}") | llm
              | StrOutputParser())
    plan = to_semantic(mapper | reduce).plan({"parts": parts})
    assert len(plan.calls) == 4 and set(plan.calls[3].inputs) == {"v0", "v1", "v2"}
    assert [c.name for c in plan.calls] == ["s0", "s1", "s2", "call_3"]
    _same(mapper | reduce, {"parts": parts}, live)
    # .map() over a list known on the client
    items = RunnableLambda(lambda x: [{"part": p} for p in x["parts"]]) | summarize.map()
    _same(items | RunnableLambda(lambda xs: " | ".join(xs)), {"parts": parts}, live)
    # client code that reads the text runs at the end...
    _same(mapper | RunnableLambda(lambda d: sorted(v.upper() for v in d.values())), {"parts": parts}, live)
    # ...and may not feed a prompt
    shouting = mapper | RunnableLambda(lambda d: {"notes": d["s0"].upper()}) | reduce.steps[1] | llm
    with pytest.raises(ConversionError, match="client round trip"):
        to_semantic(shouting).plan({"parts": parts})


def test_json_and_pydantic_parsers_at_the_end_round_trip(live):
    llm = model(live.url + "/v1", max_tokens=24)

    class Fact(BaseModel):
        fact: str

    prompt = PromptTemplate.from_template('Reply with JSON only, like {{"fact": "..."}}. A fact about {x}.')
    _same(prompt | llm | JsonOutputParser(), {"x": "the moon"}, live)
    _same(prompt | llm | PydanticOutputParser(pydantic_object=Fact), {"x": "the sun"}, live)


def test_ainvoke_and_batch_round_trip(live):
    llm = model(live.url + "/v1")
    chain = PromptTemplate.from_template("Give a name for a {kind}.") | llm | StrOutputParser()
    conv = to_semantic(chain)
    inputs = [{"kind": "dog"}, {"kind": "ship"}]
    assert conv.batch(inputs) == chain.batch(inputs)
    assert asyncio.run(conv.ainvoke(inputs[0])) == chain.invoke(inputs[0])
    assert engine_state(live)["contexts"] == 0


def test_a_server_error_is_typed_and_leaves_nothing(live):
    from interlace.sdk import BadRequestError

    chain = PromptTemplate.from_template("{x}") | model(live.url + "/v1", max_tokens=-1) | StrOutputParser()
    with pytest.raises(BadRequestError, match="max_tokens"):
        to_semantic(chain).invoke({"x": "hi"})
    assert not live.gateway.sessions.sessions
    assert json.dumps(engine_state(live))  # still answers


def test_jinja2_is_converted_only_where_langchain_renders_it_sandboxed(monkeypatch):
    import jinja2
    import langchain_core.prompts.string as lc_string

    from interlace.sdk.langchain import semantic_chain

    chain = _two_step(PromptTemplate.from_template("Describe {{ thing }}.", template_format="jinja2"))
    monkeypatch.setattr(semantic_chain, "_SANDBOXED", None)
    assert len(to_semantic(chain).plan({"kind": "cat"}).calls) == 2  # langchain-core renders in a sandbox
    monkeypatch.setattr(semantic_chain, "_SANDBOXED", None)
    monkeypatch.setattr(lc_string, "jinja2_formatter",
                        lambda template, **kw: jinja2.Environment().from_string(template).render(**kw))
    with pytest.raises(ConversionError, match="sandboxed"):
        to_semantic(chain).plan({"kind": "cat"})
