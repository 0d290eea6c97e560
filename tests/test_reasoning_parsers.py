"""Reasoning parsers (parsers/reasoning.py): thinking apart from the answer and the calls.

Split invariance over reasoning + calls combined, where the output starts (read off the
prompt), calls written inside the reasoning, the registry's second namespace and the plugin
hook, the prompt renderer writing earlier turns' reasoning back, and the model's parser
composition (``ModelServer.new_parser``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlace import PluginHost, hookimpl
from interlace.parsers import HermesParser, ParserRegistry, Text, ToolCallEnd, ToolCallStart, counting_ids
from interlace.parsers.events import Event, Reasoning
from interlace.parsers.formats import FormatError
from interlace.parsers.reasoning import REASONING_PARSERS, ReasoningFormat, ReasoningParser

from test_parsers import check_invariants, normalise

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


def parse(text: str, cuts: Sequence[int] = (), *, family: str = "qwen3", inside: bool = False,
          tools: bool = True) -> list[Event]:
    p = REASONING_PARSERS[family](inner=HermesParser(id_factory=counting_ids()) if tools else None,
                                  starts_inside=inside, call_markers=("<tool_call>",) if tools else ())
    out: list[Event] = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        out += p.feed(text[prev:c])
        prev = c
    return out + p.finish()


def reasoning_of(events: Sequence[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Reasoning))


def text_of(events: Sequence[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Text))


SAMPLES = [
    ("<think>\nThe user wants the weather.\n</think>\n\nIt is sunny.", False),
    ("<think>Check the weather first.</think>\n" + CALL, False),
    ("<think>\nplan: call it\n</think>\n\nLet me check.\n" + CALL + "\n" + CALL, False),
    ("Reasoning in the prompt's open block.\n</think>\n\n" + CALL, True),
    ("I forget to close my thinking " + CALL, False),
    ("<think>I forget to close my thinking " + CALL, False),
    ("no reasoning at all, just an answer", False),
    ("<think>cut short by max_tokens, never closed", False),
    ("<think></think>empty reasoning", False),
    ("  <think> spaced </think>  answer  ", False),
    ("<thin", False),
    ("<think>a </thi", False),
]


@pytest.mark.parametrize("text,inside", SAMPLES)
def test_every_split_gives_the_same_events(text: str, inside: bool) -> None:
    whole = normalise(parse(text, inside=inside))
    check_invariants([e for e in whole if not isinstance(e, Reasoning)])
    for i in range(len(text) + 1):
        assert normalise(parse(text, [i], inside=inside)) == whole, i
    assert normalise(parse(text, range(len(text)), inside=inside)) == whole


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_split_gives_the_same_events(data: st.DataObject) -> None:
    text, inside = data.draw(st.sampled_from(SAMPLES))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert normalise(parse(text, cuts, inside=inside)) == normalise(parse(text, inside=inside))


@settings(max_examples=200, deadline=None)
@given(reasoning=st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
       answer=st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
       cuts=st.lists(st.integers(0, 200), max_size=10))
def test_reasoning_never_reaches_the_answer(reasoning: str, answer: str, cuts: list[int]) -> None:
    """Whatever the model thinks (markers aside), none of it is Text, and the answer is all there."""
    reasoning = reasoning.replace("</think>", "").replace("<tool_call>", "")
    answer = answer.replace("<tool_call>", "")
    text = f"<think>{reasoning}</think>{answer}"
    events = parse(text, [c for c in cuts if c <= len(text)])
    assert reasoning_of(events) == reasoning.strip(" \t\r\n")
    assert text_of(events) == answer.lstrip(" \t\r\n") or (not answer.strip() and text_of(events) == "")
    if reasoning.strip():
        assert reasoning.strip() not in text_of(events) or reasoning.strip() in answer


def test_reasoning_then_answer() -> None:
    ev = parse("<think>\nThe user wants the weather.\n</think>\n\nIt is sunny.")
    assert ev == [Reasoning("The user wants the weather."), Text("It is sunny.")]


def test_calls_after_reasoning_are_calls_with_their_fields() -> None:
    ev = normalise(parse(SAMPLES[2][0]))
    assert reasoning_of(ev) == "plan: call it"
    assert text_of(ev) == "Let me check.\n"  # text with a word keeps its whitespace (base.py)
    assert [(e.name, e.arguments) for e in ev if isinstance(e, ToolCallEnd)] == [
        ("get_weather", {"city": "Paris", "days": 3})] * 2
    check_invariants([e for e in ev if not isinstance(e, Reasoning)])


def test_a_call_inside_the_reasoning_is_made_not_lost() -> None:
    """vllm#39056: the model opens a call before closing its thinking; the call is parsed."""
    for text in (SAMPLES[4][0], SAMPLES[5][0]):
        ev = parse(text, inside=text.startswith("I forget"))
        assert [e.name for e in ev if isinstance(e, ToolCallStart)] == ["get_weather"], ev
        assert reasoning_of(ev) == "I forget to close my thinking"
        assert "tool_call" not in reasoning_of(ev) and not text_of(ev)


def test_deepseek_leaves_a_call_inside_its_reasoning_as_its_reference_parsers_do() -> None:
    ev = parse("<think>maybe " + CALL + "</think>done", family="deepseek_r1")
    assert not [e for e in ev if isinstance(e, ToolCallStart)]
    assert "get_weather" in reasoning_of(ev) and text_of(ev) == "done"


def test_a_family_may_keep_calls_inside_its_reasoning() -> None:
    class Kept(ThinkNoCalls):
        pass

    p = _parser(Kept)(inner=HermesParser(id_factory=counting_ids()), call_markers=("<tool_call>",))
    ev = p.feed("<think>maybe " + CALL + "</think>done") + p.finish()
    assert not [e for e in ev if isinstance(e, ToolCallStart)]
    assert "get_weather" in reasoning_of(ev) and text_of(ev) == "done"


class ThinkNoCalls(ReasoningFormat):
    name = "nocalls"
    calls_end_reasoning = False


def _parser(fmt_cls: type) -> type[ReasoningParser]:
    return type("P", (ReasoningParser,), {"reasoning": fmt_cls()})


def test_where_the_output_starts_is_read_off_the_prompt() -> None:
    fmt = REASONING_PARSERS["deepseek_r1"].reasoning
    assert fmt.starts_inside("<｜Assistant｜><think>\n")
    assert not fmt.starts_inside("<|im_start|>assistant\n")
    assert not fmt.starts_inside("<think>\n\n</think>\n\n")  # thinking switched off by the template
    # opened in the prompt: everything up to </think> is reasoning, even without <think> in the output
    assert parse("thinking\n</think>\n\nanswer", inside=True) == [Reasoning("thinking"), Text("answer")]
    # not opened: an output without <think> is all answer (a thinking model with thinking off)
    assert parse("thinking\n</think>\n\nanswer") == [Text("thinking\n</think>\n\nanswer")]


def test_unclosed_reasoning_stays_reasoning() -> None:
    assert parse("<think>cut short", family="deepseek_r1") == [Reasoning("cut short")]
    assert normalise(parse("partial marker <", inside=True)) == [Reasoning("partial marker <")]


def test_without_tool_parsing_the_rest_is_text() -> None:
    ev = parse("<think>hm</think>" + CALL, tools=False)
    assert ev == [Reasoning("hm"), Text(CALL)]


def test_magistral_markers() -> None:
    ev = parse("[THINK]short[/THINK]Answer.", family="mistral")
    assert ev == [Reasoning("short"), Text("Answer.")]


# ------------------------------------------------------------------ the registry
def test_two_namespaces_through_the_same_hook() -> None:
    host = PluginHost(entrypoints=False)
    tools, thinking = host.parsers(), host.reasoning_parsers()
    assert "hermes" in tools and "qwen3" in thinking and "qwen3" not in tools
    reg = ParserRegistry()
    for name, factory in (*tools.items(), *thinking.items()):
        reg.register(name, factory)
    assert set(REASONING_PARSERS) <= set(reg.reasoning_names())
    assert reg.get_reasoning("deepseek_r1").reasoning.keep == "none"


def test_a_plugin_adds_a_reasoning_family() -> None:
    class SeedFormat(ReasoningFormat):
        name = "seed"
        start, end = "<seed:think>", "</seed:think>"

    class SeedParser(ReasoningParser):
        reasoning = SeedFormat()

    class Plugin:
        @hookimpl
        def register_parsers(self, register):  # type: ignore[no-untyped-def]
            register("seed", SeedParser)

    host = PluginHost(entrypoints=False, plugins=[Plugin()])
    assert host.reasoning_parsers()["seed"] is SeedParser
    listed = {p["name"]: p for p in host.list_plugins()}
    assert any("seed" in p.get("reasoning_parsers", []) for p in listed.values())
    p = SeedParser()
    assert p.feed("<seed:think>x</seed:think>y") + p.finish() == [Reasoning("x"), Text("y")]


def test_a_broken_reasoning_format_is_refused_at_registration() -> None:
    class Bad(ReasoningFormat):
        name = "bad"
        keep = "sometimes"
        end = ""

    reg = ParserRegistry()
    with pytest.raises(FormatError, match="keep.*end|end.*keep") as e:
        reg.register("bad", _parser(Bad))
    assert "'bad'" in str(e.value)


def test_config_names_an_unknown_reasoning_parser() -> None:
    from interlace.gateway.config import ConfigError, parse_config

    cfg = parse_config({"models": {"m": {"path": "embedded", "reasoning_parser": "nope"}}})
    with pytest.raises(ConfigError, match=r"models\.m\.reasoning_parser: unknown reasoning parser 'nope'"):
        cfg.check_parsers(["hermes"], ["qwen3"])
    cfg.check_parsers(["hermes"], ["nope"])


# ------------------------------------------------------- earlier turns' reasoning
class _Tok:
    """A tokenizer stand-in whose template has no tools section (so the format renders the transcript)."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):  # type: ignore[no-untyped-def]
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    def find_special(self, text):  # type: ignore[no-untyped-def]
        return None


CHAT = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "OLD thought"},
    {"role": "user", "content": "and tomorrow?"},
    {"role": "assistant", "content": None, "reasoning_content": "NEW thought",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
]


@pytest.mark.parametrize("family,kept", [("qwen3", ["NEW"]), ("deepseek_r1", []), ("all", ["OLD", "NEW"])])
def test_earlier_reasoning_is_written_back_as_the_family_keeps_it(family: str, kept: list[str]) -> None:
    from interlace.gateway.prompt import render_text
    from interlace.parsers.formats import HERMES

    if family == "all":
        class All(ReasoningFormat):
            name = "all"
            keep = "all"
        fmt = All()
    else:
        fmt = REASONING_PARSERS[family].reasoning
    text = render_text(_Tok(), CHAT, [], HERMES, reasoning=fmt)
    assert [w for w in ("OLD", "NEW") if f"<think>\n{w} thought\n</think>" in text] == kept, text
    assert "thought" not in render_text(_Tok(), CHAT, [], HERMES)  # no reasoning format: dropped


def test_reasoning_written_back_is_plain_text() -> None:
    """A client's reasoning_content is untrusted like any content: tokenized as text."""
    from interlace.gateway.prompt import render_text
    from interlace.parsers.formats import HERMES

    marked = render_text(_Tok(), CHAT, [], HERMES, mark=lambda s: f"[{s}]",
                         reasoning=REASONING_PARSERS["qwen3"].reasoning)
    assert "<think>\n[NEW thought]\n</think>" in marked


# --------------------------------------------------------- the model's composition
def test_model_parser_composition() -> None:
    from interlace.gateway.models import ModelServer

    class Eng:
        tokenizer = None

    m = ModelServer("m", None, Eng(), HermesParser, reasoning_factory=REASONING_PARSERS["qwen3"])  # type: ignore[arg-type]
    assert m.reasons and m.reasoning_format.name == "qwen3"
    assert set(m.special_tokens) >= {"<tool_call>", "<think>", "</think>"}
    p = m.new_parser({"get_weather": {}}, prompt_tail="<|im_start|>assistant\n<think>\n")
    ev = normalise(p.feed("why\n</think>\n" + CALL) + p.finish())
    assert ev[0] == Reasoning("why") and [e.name for e in ev if isinstance(e, ToolCallStart)] == ["get_weather"]
    plain = m.new_parser(calls=False)
    assert plain.feed("<think>a</think>" + CALL) + plain.finish() == [Reasoning("a"), Text(CALL)]
    bare = ModelServer("b", None, Eng(), HermesParser)  # type: ignore[arg-type]
    assert not bare.reasons and bare.reasoning_format is None
    with pytest.raises(ValueError):
        bare.new_parser(calls=False)
    assert isinstance(bare.new_parser({"f": {"type": "object"}}), HermesParser)
    assert bare.new_parser({"f": {"type": "object"}}).tools == {"f": {"type": "object"}}
    from interlace.parsers import MarkdownCodeParser

    code = ModelServer("c", None, Eng(), MarkdownCodeParser, reasoning_factory=REASONING_PARSERS["qwen3"])  # type: ignore[arg-type]
    p = code.new_parser({"python": {}})  # a code fence while thinking is thinking, not a call
    ev = normalise(p.feed("<think>try\n```python\nprint(1)\n```\n</think>ok") + p.finish())
    assert ev == [Reasoning("try\n```python\nprint(1)\n```"), Text("ok")]
