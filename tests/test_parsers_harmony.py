"""The harmony parser and format (gpt-oss): reasoning, preambles, calls and the answer as messages.

What is checked: split invariance (any split of an output gives the same events, reasoning
included), the outputs vLLM's and SGLang's own tests accept (and, with the reason, the few we
read differently), reasoning never reaching ``Text``, the streamed ``ArgumentsDelta`` being the
model's own bytes, ``render_calls`` read back by the parser (and the grammar that forces calls),
plain-text answers, malformed and unterminated messages, and the format's prompt pieces
(instructions, results named after their call, kept reasoning).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_parsers import _NAMES, _VALUES, calls, check_invariants, registry, text_of

from interlace.parsers import (
    ArgumentsDelta,
    FieldComplete,
    HarmonyParser,
    ParserError,
    Text,
    ToolCallEnd,
    ToolCallStart,
    counting_ids,
)
from interlace.parsers.events import Event, Reasoning
from interlace.parsers.formats import CannotForce
from interlace.parsers.harmony import HARMONY

from test_parsers import normalise  # one merge rule for every parser's split-invariance

FMT = HARMONY


def run(text: str, cuts: Sequence[int] = (), tools: dict | None = None) -> list[Event]:
    """Feed ``text`` split at ``cuts``; all events, finish() included."""
    p = HarmonyParser(id_factory=counting_ids(), tools=tools)
    events: list[Event] = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += p.feed(text[prev:c])
        prev = c
    return events + p.finish()


def reasoning_of(events: Sequence[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Reasoning))


def errors(events: Sequence[Event]) -> list[ParserError]:
    return [e for e in events if isinstance(e, ParserError)]


S, E, M, C, K, R, CALL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"


def msg(channel: str, body: str, to: str | None = None, end: str = E, first: bool = False) -> str:
    """One assistant message as gpt-oss writes it (the first of the output has no ``<|start|>assistant``)."""
    head = "" if first else S + "assistant"
    if to is not None:
        return f"{head}{C}{channel} to={to} {K}json{M}{body}{CALL if end == E else end}"
    return f"{head}{C}{channel}{M}{body}{end}"


FULL = (msg("analysis", 'User asks for "weather" in Paris; call get_weather <ok>.', first=True)
        + msg("commentary", "Checking the weather now.")
        + msg("commentary", '{"city": "Paris, FR", "days": 3, "flags": {"hourly": true}, "note": "a <|call|> b"}',
              to="functions.get_weather")
        + msg("final", "It is sunny in Paris.", end=R))

SAMPLES = [
    FULL,
    msg("analysis", "Two plus two.", first=True) + msg("final", "4", end=R),
    msg("final", "Just the answer.", end=R, first=True),
    "A model that answers in plain text, with a < and a <| but no marker.",
    "   leading whitespace, then text",
    msg("commentary", '{"q": "x"}', to="functions.search", first=True) + msg("commentary", "{}", to="functions.ping"),
    msg("analysis", "built-in", to="browser.search", first=True) + msg("final", "done", end=R),
    f"{S}assistant to=functions.f{C}commentary json{M}{{\"a\": [1, {{\"b\": null}}]}}{CALL}",
    # malformed and unterminated
    msg("commentary", '{"a": tru}', to="functions.f", first=True) + msg("final", "after", end=R),
    msg("commentary", "not json", to="functions.f", first=True) + msg("final", "after", end=R),
    msg("commentary", '{"a": 1} trailing', to="functions.f", first=True),
    msg("commentary", '{"a": [1, 2', to="functions.f", first=True)[:-len(CALL)],
    f"{C}commentary to=functions.f {K}json",
    f"{C}commentary to=functions.f {K}json{CALL}{S}assistant{C}final{M}x{R}",
    msg("analysis", "cut off while thinking", first=True)[:-len(E)],
    f"{C}analysis{M}a{E}\n\n{S}assistant{C}final{M}b{R}\n",
    f"{S}functions.f to=assistant{C}commentary{M}{{\"made\": \"up\"}}{E}{S}assistant{C}final{M}ok{R}",
    f"text before{S}assistant{C}final{M}and after{R} trailing",
]


# ------------------------------------------------------------------ split invariance ----

@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_split_gives_same_events(data: st.DataObject) -> None:
    text = data.draw(st.sampled_from(SAMPLES))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    whole = normalise(run(text))
    check_invariants(whole)
    assert normalise(run(text, cuts)) == whole


@pytest.mark.parametrize("text", SAMPLES)
def test_char_by_char_gives_same_events(text: str) -> None:
    split = run(text, range(1, len(text)))
    check_invariants(split)
    assert normalise(split) == normalise(run(text))


GARBAGE = [S, E, M, C, K, R, CALL, "assistant", "analysis", "commentary", "final", " to=functions.f", " to=python",
           " json", "{", "}", '"a"', ":", "1", ",", "[", "]", " ", "\n", "x", "<|", "|>", "<|sta", "to="]


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(GARBAGE), max_size=30).map("".join),
       cuts=st.lists(st.integers(0, 200), max_size=12))
def test_garbage_never_raises_and_is_split_invariant(text: str, cuts: list[int]) -> None:
    cuts = [c for c in cuts if c <= len(text)]
    whole = run(text)
    check_invariants(whole)
    assert normalise(run(text, cuts)) == normalise(whole)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_outputs_are_split_invariant(data: st.DataObject) -> None:
    """Near-valid outputs (a slice deleted, a character inserted) hit the error paths."""
    text = data.draw(st.sampled_from(SAMPLES))
    a = data.draw(st.integers(0, len(text)))
    b = data.draw(st.integers(a, min(len(text), a + 10)))
    ins = data.draw(st.sampled_from(["", "}", '"', ",", "\n", "<", "|", "<|end|>", "<|start|>", "x"]))
    text = text[:a] + ins + text[b:]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    whole = run(text)
    check_invariants(whole)
    assert normalise(run(text, cuts)) == normalise(whole)


# A whole turn built from parts: reasoning, preambles, calls, final answers in any order. The reasoning
# holds a word nothing else holds, so any leak of it into Text shows.
_BODY = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=20)
_PART = st.one_of(
    st.builds(lambda b: ("analysis", "THOUGHT " + b), _BODY),
    st.builds(lambda b: ("preamble", b.replace("THOUGHT", "")), _BODY),
    st.builds(lambda b: ("final", b.replace("THOUGHT", "")), _BODY),
    st.tuples(st.just("call"), st.tuples(_NAMES, st.dictionaries(st.text(max_size=6), _VALUES, max_size=3))),
)


def _write(parts: list) -> tuple[str, list, str, str]:
    """(text, calls, content, reasoning) of a turn made of ``parts``."""
    out, cs, content, thought = [], [], "", []
    for i, (kind, v) in enumerate(parts):
        first = i == 0
        if kind == "analysis":
            out.append(msg("analysis", v, first=first))
            thought.append(v)
        elif kind == "preamble":
            out.append(msg("commentary", v, first=first))
            content += v
        elif kind == "final":
            out.append(msg("final", v, end=R if i == len(parts) - 1 else E, first=first))
            content += v
        else:
            name, args = v
            text = FMT.render_call(name, args)
            out.append(text if first else S + "assistant" + text)
            cs.append((name, args))
    return "".join(out), cs, content, "\n".join(thought)


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(_PART, min_size=1, max_size=6), data=st.data())
def test_reasoning_calls_and_answer_combined(parts: list, data: st.DataObject) -> None:
    text, cs, content, thought = _write(parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=25))
    events = run(text, cuts)
    check_invariants(events)
    assert normalise(events) == normalise(run(text))
    assert calls(events) == cs
    assert not errors(events)
    assert reasoning_of(events) == thought
    assert "THOUGHT" not in text_of(events)  # reasoning never reaches the answer
    # the answer, less the whitespace-only stretches that border a call (the layout rule)
    assert text_of(events).strip() == content.strip() or not content.strip()


# ------------------------------------------------- arguments: the model's bytes, field by field ----

def test_arguments_stream_as_the_models_bytes_and_fields_complete_early() -> None:
    body = '{\n  "path": "a.txt",\n  "body": "' + "x" * 300 + '",\n  "n": 2\n}'
    text = msg("commentary", body, to="functions.write", first=True)
    events = run(text, range(0, len(text), 7))
    frags = "".join(e.fragment for e in events if isinstance(e, ArgumentsDelta))
    assert frags == body  # the model's own bytes, layout included
    fields = [i for i, e in enumerate(events) if isinstance(e, FieldComplete)]
    end = next(i for i, e in enumerate(events) if isinstance(e, ToolCallEnd))
    assert [events[i].key for i in fields] == ["path", "body", "n"] and fields[0] < end
    assert sum(isinstance(e, ArgumentsDelta) for e in events) > 10  # streamed, not sent at the end


def test_in_call_only_inside_a_call_message() -> None:
    p = HarmonyParser()
    p.feed(msg("analysis", "think", first=True) + S + "assistant" + C + "commentary to=functions.f " + K + "json")
    assert not p.in_call  # a header is not a call yet
    p.feed(M)
    assert p.in_call  # the call's message has begun, its arguments not yet
    p.feed('{"a": "x <|call|>')
    assert p.in_call  # <|call|> inside a string: a spurious pause
    p.feed('"}' + CALL)
    assert not p.in_call


# ---------------------------------------------------- outputs vLLM's and SGLang's tests accept ----

WEATHER_ARGS = '{"location": "Tokyo"}'
COMPAT = [
    # vLLM tests/tool_parsers/test_openai_tool_parser.py: no tools, only a final answer
    (msg("final", "This is a test", first=True), "", [], "This is a test"),
    # vLLM ... single_tool, both argument layouts, after an analysis message
    (msg("analysis", 'User asks: "What is the weather in Tokyo?" We need to use get_current_weather tool.',
         first=True) + msg("commentary", WEATHER_ARGS, to="functions.get_current_weather"),
     'User asks: "What is the weather in Tokyo?" We need to use get_current_weather tool.',
     [("get_current_weather", {"location": "Tokyo"})], ""),
    (msg("commentary", '{\n"location": "Tokyo"\n}', to="functions.get_current_weather", first=True), "",
     [("get_current_weather", {"location": "Tokyo"})], ""),
    # vLLM ... multiple_tools: calls chained with <|start|>assistant, one without a content type, empty arguments
    (msg("analysis", "Need location and weather.", first=True)
     + msg("commentary", WEATHER_ARGS, to="functions.get_current_weather")
     + msg("commentary", WEATHER_ARGS, to="functions.get_user_location")
     + f"{S}assistant{C}commentary to=functions.no_content_type{M}{WEATHER_ARGS}{CALL}"
     + msg("commentary", "{}", to="functions.empty_args")
     + msg("commentary", "", to="functions.no_args"),
     "Need location and weather.",
     [("get_current_weather", {"location": "Tokyo"}), ("get_user_location", {"location": "Tokyo"}),
      ("no_content_type", {"location": "Tokyo"}), ("empty_args", {}), ("no_args", {})], ""),
    # vLLM ... with_content: a final answer after the call is content
    (msg("analysis", "Weather first.", first=True) + msg("commentary", WEATHER_ARGS, to="functions.get_current_weather")
     + msg("final", "This tool call will get the weather.", end=R),
     "Weather first.", [("get_current_weather", {"location": "Tokyo"})], "This tool call will get the weather."),
    # vLLM tests/reasoning/test_gptoss_reasoning_parser.py: a final header with a content type
    (msg("analysis", "This is reasoning", first=True) + f"{S}assistant{C}final{K} JSON {M}This is the rest",
     "This is reasoning", [], "This is the rest"),
    (msg("analysis", "This is reasoning", first=True) + f"{S}assistant{C}final{K}ReplyAction {M}This is the rest",
     "This is reasoning", [], "This is the rest"),
    # openai-harmony docs: the recipient in the role part of the header, a bare content type
    (f"{S}assistant to=functions.get_weather{C}commentary json{M}{WEATHER_ARGS}{CALL}", "",
     [("get_weather", {"location": "Tokyo"})], ""),
    # SGLang test_gpt_oss_detector: <|start|>assistant before the first call, no space before <|constrain|>
    (f'{S}assistant{C}commentary to=functions.get_weather{K}json{M}{{"city":"Beijing"}}{CALL}', "",
     [("get_weather", {"city": "Beijing"})], ""),
    # ... prose before the call; two calls
    (f'Let me check.{S}assistant{C}commentary to=functions.get_weather{K}json{M}{{"city":"Beijing"}}{CALL}', "",
     [("get_weather", {"city": "Beijing"})], "Let me check."),
    (f'{S}assistant{C}commentary to=functions.get_weather{K}json{M}{{"city":"Beijing"}}{CALL}'
     f'{S}assistant{C}commentary to=functions.search{K}json{M}{{"query":"restaurants"}}{CALL}', "",
     [("get_weather", {"city": "Beijing"}), ("search", {"query": "restaurants"})], ""),
    (f'I\'ll look that up. {S}assistant{C}commentary to=functions.get_weather{K}json{M}'
     f'{{"city":"Beijing", "unit":"celsius"}}{CALL}', "",
     [("get_weather", {"city": "Beijing", "unit": "celsius"})], "I'll look that up. "),
    # SGLang test_gpt_oss_abbreviated_header: no <|start|>assistant, a doubled <|call|>
    (f'{C}commentary to=functions.get_weather{K}json{M}{{"city":"Paris"}}{CALL}{CALL}', "",
     [("get_weather", {"city": "Paris"})], ""),
    # ... plain text and unrelated headers are not calls
    ("ordinary commentary to=functions.get_weather", "", [], "ordinary commentary to=functions.get_weather"),
    ('{"city":"Paris"}', "", [], '{"city":"Paris"}'),
    (msg("final", "The weather is sunny.", end=R, first=True), "", [], "The weather is sunny."),
    (msg("analysis", "Think about weather.", first=True), "Think about weather.", [], ""),
    (msg("commentary", "Checking the weather.", first=True), "", [], "Checking the weather."),
    # SGLang test_harmony_parser: a call without <|constrain|>; analysis then a call; a preamble before a call
    (f'{C}commentary to=functions.get_weather{M}{{"location": "SF"}}{CALL}', "",
     [("get_weather", {"location": "SF"})], ""),
    (msg("analysis", "Need to use function get_weather.", first=True)
     + f'{S}assistant{C}commentary to=functions.get_weather{M}{{"location":"San Francisco"}}{CALL}',
     "Need to use function get_weather.", [("get_weather", {"location": "San Francisco"})], ""),
    (msg("analysis", "Long chain of thought", first=True)
     + msg("commentary", "**Action plan**: 1. Generate file 2. Start server")
     + f'{S}assistant{C}commentary to=functions.generate_file{M}{{"template": "basic_html"}}{CALL}',
     "Long chain of thought", [("generate_file", {"template": "basic_html"})],
     "**Action plan**: 1. Generate file 2. Start server"),
    # ... prose between and after messages is text, verbatim
    ("Some text " + msg("analysis", "reasoning", first=True) + " more text "
     + msg("final", "answer", end=R) + " trailing text",
     "reasoning", [], "Some text  more text answer trailing text"),
    # ... an unfinished analysis message streams as reasoning; whitespace kept; empty bodies; a cut-off marker
    (f"{C}analysis{M}partial content", "partial content", [], ""),
    (f"{C}analysis{M}  content with spaces  {E}", "  content with spaces  ", [], ""),
    (f"{C}analysis{M}{E}", "", [], ""),
    ("complete text <|ret", "", [], "complete text <|ret"),
    ("text <|weird|> more text " + msg("analysis", "content"), "content", [], "text <|weird|> more text "),
    # ... two analysis messages in a row (no <|start|> between): one reasoning, a line apart
    (f"{C}analysis{M}first reasoning{E}{C}analysis{M}second reasoning{E}", "first reasoning\nsecond reasoning", [],
     ""),
    # SGLang test_gpt_oss_detector (truncate_normal): a call with pretty-printed arguments, after reasoning
    (msg("analysis", "Reasoning...", first=True)
     + f'{S}assistant{C}commentary to=functions.read_file {K}json{M}{{\n  "files": []\n}}{CALL}',
     "Reasoning...", [("read_file", {"files": []})], ""),
    # ... and its fast-path case: empty arguments
    (f"{S}assistant{C}commentary to=functions.read_file {K}json{M}{{}}{CALL}", "", [("read_file", {})], ""),
    # vLLM's streaming extraction: a call on the analysis channel is a call too
    (f'{C}analysis to=functions.lookup{M}{{"id": 7}}{CALL}', "", [("lookup", {"id": 7})], ""),
    # SGLang: upper-case channel names
    (f"{C}ANALYSIS{M}loud thinking{E}{S}assistant{C}final{M}quiet answer{R}", "loud thinking", [], "quiet answer"),
]


@pytest.mark.parametrize(("text", "reasoning", "expected", "content"), COMPAT)
def test_accepts_what_vllm_and_sglang_accept(text: str, reasoning: str, expected: list, content: str) -> None:
    for cuts in ((), range(len(text))):
        events = run(text, cuts)
        check_invariants(events)
        assert calls(events) == expected
        assert text_of(events) == content
        assert reasoning_of(events) == reasoning
        assert not errors(events)


def test_bare_recipient_naming_an_offered_tool_is_a_call() -> None:
    """SGLang's detector reads ``to=get_weather`` (no ``functions.`` namespace) as a call when the tool is
    offered; a bare recipient that names no offered tool is a built-in's message: reasoning."""
    text = f'{C}commentary to=get_weather{K}json{M}{{"city":"Oslo"}}{CALL}'
    assert calls(run(text, tools={"get_weather": {}})) == [("get_weather", {"city": "Oslo"})]
    events = run(text)
    assert calls(events) == [] and reasoning_of(events) == '{"city":"Oslo"}' and not text_of(events)


# Outputs peers read differently, and why we do not follow them:
REFUSED = [
    # SGLang (test_gpt_oss_detector: truncate_normal, fast_path_fix) drops a final answer or prose after a
    # call; vLLM's test_extract_tool_calls_with_content keeps it as content, and so do we: model text is
    # never silently lost.
    (msg("commentary", "{}", to="functions.read_file", first=True)
     + msg("final", "This text should be truncated."), [("read_file", {})], "This text should be truncated.", ""),
    (msg("commentary", "{}", to="functions.read_file", first=True) + "This is normal text that should be ignored.",
     [("read_file", {})], "This is normal text that should be ignored.", ""),
    # SGLang (test_parse_tool_response_message / test_tool_response_handling) returns a tool's message in the
    # output as normal text; vLLM drops messages of other roles: a tool result the model made up is not the
    # answer, so it is dropped.
    (f'{S}functions.get_weather to=assistant{M}{{"sunny": true}}{E}', [], "", ""),
    (f'{S}functions.get_weather to=assistant{C}commentary{M}{{"sunny": true, "temperature": 20}}{E}', [], "", ""),
    # SGLang's harmony parser reports built-in tool messages (to=browser.search on the analysis channel) as
    # tool calls (its detector then keeps only offered functions): the gateway offers functions only, and
    # vLLM's Responses path makes them reasoning, as we do.
    (f'{C}analysis to=browser.search{M}{{"query": "SGLang"}}{CALL}', [], "", '{"query": "SGLang"}'),
    (f"{C}commentary to=python{M}print(1){CALL}", [], "", "print(1)"),
    # SGLang's text fallback ("analysis...assistantfinal...", decoded with the special tokens stripped): this
    # format's markers are always decoded for the parser (special_tokens), and "analysis" is an English word,
    # so such text is an answer in plain text.
    ("analysis I need to think about this. assistantfinal The answer is 42.", [],
     "analysis I need to think about this. assistantfinal The answer is 42.", ""),
    # SGLang holds a message on an unknown channel forever (no event); vLLM's chat path ignores it. Harmony
    # has three channels; the words of a message on another one are not thrown away: they are text.
    (f"{C}unknown{M}content{E}", [], "content", ""),
]


@pytest.mark.parametrize(("text", "expected", "content", "reasoning"), REFUSED)
def test_what_we_read_differently_from_a_peer(text: str, expected: list, content: str, reasoning: str) -> None:
    for cuts in ((), range(len(text))):
        events = run(text, cuts)
        check_invariants(events)
        assert (calls(events), text_of(events), reasoning_of(events)) == (expected, content, reasoning)


def test_not_a_json_object_is_a_parser_error() -> None:
    """vLLM passes a non-JSON body on as raw arguments ("foo"); no OpenAI client can use that, so it is a
    ParserError here (with the message's text), and the calls around it are kept."""
    text = (msg("commentary", '{"a": 1}', to="functions.good1", first=True)
            + msg("commentary", "foo", to="functions.not_json") + msg("commentary", "[1, 2]", to="functions.list")
            + msg("commentary", '{"b": 2}', to="functions.good2"))
    for cuts in ((), range(len(text))):
        events = run(text, cuts)
        check_invariants(events)
        assert calls(events) == [("good1", {"a": 1}), ("good2", {"b": 2})]
        errs = errors(events)
        assert [e.index for e in errs] == [None, None] and "foo" in errs[0].raw and "[1, 2]" in errs[1].raw
        assert not text_of(events)


# ------------------------------------------------------------- plain text, malformed, unterminated ----

@pytest.mark.parametrize("text", [
    "Hello! How can I help?",
    "  indented answer\nwith lines",
    "assistant is a word too",
    "to be or not",
    "   ",
    "",
])
def test_plain_text_output_is_text(text: str) -> None:
    events = run(text, range(len(text)))
    assert normalise(events) == ([Text(text)] if text else [])


def test_whitespace_between_messages_is_layout() -> None:
    text = f"\n{C}analysis{M}think{E}\n\n{S}assistant{C}final{M} answer \n{R}\n\n"
    events = normalise(run(text))
    assert events == [Reasoning("think"), Text(" answer \n")]


def test_malformed_arguments_fail_at_the_first_bad_character() -> None:
    text = msg("commentary", '{"a": 1, "b": tru}', to="functions.f", first=True) + msg("final", "after", end=R)
    events = run(text)
    check_invariants(events)
    (err,) = errors(events)
    assert err.index == 0 and err.raw.startswith('{"a": 1, "b": tr')
    assert [type(e) for e in events[:3]] == [ToolCallStart, ArgumentsDelta, FieldComplete]  # "a" arrived first
    assert text_of(events) == "after"


@pytest.mark.parametrize(("text", "index"), [
    (f'{C}commentary to=functions.f {K}json{M}{{"a": [1, 2', 0),                # arguments cut off
    (f"{C}commentary to=functions.f {K}json{M}", None),                        # no arguments at all
    (f"{C}commentary to=functions.f {K}json", None),                           # header cut off
    (f"{C}commentary to=functions.f {K}json{CALL}", None),                     # header closed without <|message|>
    (f"{C}commentary to=functions.{M}{{}}{CALL}", None),                       # no function name
    (msg("commentary", '{"a": 1} trailing', to="functions.f", first=True), None),  # text after the arguments
])
def test_malformed_or_unterminated_call_is_a_parser_error(text: str, index: int | None) -> None:
    for cuts in ((), range(len(text))):
        events = run(text, cuts)
        check_invariants(events)
        assert [e.index for e in errors(events)] == [index], events
        assert not text_of(events)


def test_a_start_marker_ends_a_body_without_end_marker() -> None:
    """Servers that strip ``<|end|>`` (llama.cpp's server) leave ``...thinking<|start|>assistant<|channel|>final``:
    the next message opens there, and its header does not leak into the reasoning."""
    text = f"{C}analysis{M}User wrote test.{S}assistant{C}final{M}Hello! How can I help?"
    for cuts in ((), range(len(text))):
        assert normalise(run(text, cuts)) == [Reasoning("User wrote test."), Text("Hello! How can I help?")]


def test_cut_off_non_call_messages_are_not_errors() -> None:
    assert normalise(run(f"{C}final{M}half an ans")) == [Text("half an ans")]
    assert run(f"{C}analysis{M}x{E}{S}assistant{C}fin") == [Reasoning("x")]  # a header cut off: nothing


# --------------------------------------------------------------- the format ----

_ARGS = st.dictionaries(st.text(max_size=8), _VALUES, max_size=4)


@settings(max_examples=80, deadline=None)
@given(cs=st.lists(st.tuples(_NAMES, _ARGS), min_size=1, max_size=3), thought=_BODY, data=st.data())
def test_rendered_calls_read_back(cs: list, thought: str, data: st.DataObject) -> None:
    """render_call / render_calls (after a kept reasoning) parse back to the same calls; at every
    <|call|> where the parser is not inside a call, every started call has ended (the pause marker)."""
    name, args = cs[0]
    assert calls(run(FMT.render_call(name, args))) == [(name, args)]
    text = FMT.render_reasoning(thought) + FMT.render_calls(cs)
    events = run(text, data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    check_invariants(events)
    assert calls(events) == cs and not errors(events) and not text_of(events)
    assert reasoning_of(events) == thought
    ends = [i + len(CALL) for i in range(len(text)) if text.startswith(CALL, i)]
    for end in ends:
        p = HarmonyParser(id_factory=counting_ids())
        ev = p.feed(text[:end])
        started = {e.index for e in ev if isinstance(e, ToolCallStart)}
        ended = {e.index for e in ev if isinstance(e, ToolCallEnd)}
        if not p.in_call:
            assert started == ended
    p = HarmonyParser()
    ev = p.feed(text[:max(ends)])
    assert not p.in_call and sum(isinstance(e, ToolCallEnd) for e in ev) == len(cs)


def test_registered_and_consistent() -> None:
    assert registry().get("harmony") is HarmonyParser
    assert HarmonyParser.format is FMT and FMT.name == "harmony"
    assert FMT.call_end == (CALL,)
    assert set(FMT.special_tokens) == {S, E, M, C, K, R, CALL}
    rendered = FMT.render_call("f", {"a": 1})
    assert all(rendered.startswith(m) for m in FMT.call_start)
    assert FMT.reasoning_keep == "last"


def test_instructions_describe_the_functions_namespace() -> None:
    text = FMT.instructions([
        {"name": "get_weather", "description": "Get the weather\nfor a city",
         "parameters": {"type": "object", "required": ["city"], "properties": {
             "city": {"type": "string", "description": "City name"},
             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
             "days": {"type": "array", "items": {"type": "integer"}},
             "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}}}}},
        {"name": "ping", "description": "No arguments", "parameters": {"type": "object", "properties": {}}},
    ])
    assert "namespace functions {" in text and "} // namespace functions" in text
    # a description is written whole (the prompt passes it as untrusted text, kept byte for byte)
    assert "// Get the weather\nfor a city\ntype get_weather = (_: {" in text
    assert "  // City name\n  city: string," in text
    assert '  unit?: "celsius" | "fahrenheit", // default: "celsius"' in text
    assert "  days?: number[]," in text and "hourly?: boolean," in text
    assert "// No arguments\ntype ping = () => any;" in text
    assert "commentary channel" in text and "to=functions.NAME" in text


def test_results_name_their_call() -> None:
    assert FMT.render_results(["42", "sunny"], ["calculator", "get_weather"]) == (
        f"{S}functions.calculator to=assistant{C}commentary{M}42{E}"
        f"{S}functions.get_weather to=assistant{C}commentary{M}sunny{E}")
    assert FMT.render_result("x") == f"{S}functions to=assistant{C}commentary{M}x{E}"  # name unknown
    assert FMT.results_named
    # a result in the output (a model making one up) is never read as an answer or a call
    assert run(FMT.render_results(["42"], ["calculator"])) == []


def test_results_in_a_prompt_are_named_after_their_call(smol_dir) -> None:
    """gateway/prompt.py passes each tool message's call name (by its tool_call_id) to the format."""
    from interlace.engine_ext.tokenizer import Tokenizer
    from interlace.gateway.prompt import render_text, tool_results_turn

    tok = Tokenizer(smol_dir)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = render_text(tok, msgs, [], FMT)
    assert (f"{S}functions.get_time to=assistant{C}commentary{M}noon{E}"
            f"{S}functions.get_weather to=assistant{C}commentary{M}sunny{E}") in text
    assert FMT.render_calls([("get_weather", {"city": "Oslo"}), ("get_time", {})]) in text
    ids = tool_results_turn(tok, FMT, ["42"], ["calculator"])
    assert f"{S}functions.calculator to=assistant" in tok.decode(ids)
    # the instructions keep every client string whole, so the prompt is exactly the rendered text
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather\nin a city", "parameters": {"type": "object", "properties": {
            "unit": {"type": "string", "description": "Unit\nof measure", "enum": ["c", "f"], "default": "c"}}}}}]
    pieces = tok.untrusted_pieces(lambda mark: render_text(tok, msgs, tools, FMT, mark))
    assert "".join(p for p, _ in pieces) == render_text(tok, msgs, tools, FMT)


@pytest.fixture(scope="module")
def compiler(smol_dir):
    from interlace.engine_ext.constraints.grammar import GrammarCompiler
    from interlace.engine_ext.tokenizer import Tokenizer

    return GrammarCompiler(Tokenizer(smol_dir))


def _accepts(compiler, grammar, text: str) -> bool:
    """Whether ``text`` (as the model's tokens) is a complete sentence of ``grammar``."""
    m = grammar._matcher.deep_copy()
    ok = m.consume_tokens(compiler.tokenizer.encode(text))
    return bool(ok) and not m.is_error() and m.is_accepting()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]


def test_grammar_forces_the_call_message_the_parser_reads(compiler) -> None:
    one = [("get_weather", {"city": "Oslo"})]
    two = one + [("get_time", {"tz": "UTC"})]
    single = compiler.tool_calls(FMT, TOOLS, force=None, parallel=False)
    parallel = compiler.tool_calls(FMT, TOOLS, force=None, parallel=True)
    named = compiler.tool_calls(FMT, TOOLS, force="get_time", parallel=False)
    assert _accepts(compiler, single, FMT.render_calls(one))
    assert not _accepts(compiler, single, FMT.render_calls(two))
    assert _accepts(compiler, parallel, FMT.render_calls(two))
    assert _accepts(compiler, named, FMT.render_calls(two[1:]))
    assert not _accepts(compiler, named, FMT.render_calls(one))
    # a forced reply is the call itself: no analysis message first, no stray text
    assert not _accepts(compiler, single, FMT.render_reasoning("hm") + FMT.render_calls(one))
    assert not _accepts(compiler, single, FMT.render_calls([("get_weather", {"town": "Oslo"})]))
    bad = [{"type": "function", "function": {"name": "two words", "parameters": {"type": "object"}}}]
    with pytest.raises(CannotForce, match="harmony header"):
        FMT.grammar(compiler, bad, None, False)
