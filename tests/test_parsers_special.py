"""The special-token section formats: ``deepseek_v31`` (parsers/deepseek.py) and ``kimi_k2`` (parsers/kimi_k2.py).

Split invariance (hypothesis), the model outputs vLLM's and SGLang's own tests accept (each case says which
peer test it comes from), streamed arguments that are the model's bytes, malformed and unterminated calls
(a broken call's valid siblings are still read), the formats' rendering read back by their parsers, and
their grammars accepting exactly that text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlace import PluginHost
from interlace.parsers import (
    ArgumentsDelta,
    DeepSeekV31Parser,
    FieldComplete,
    KimiK2Parser,
    ParserError,
    StreamingParser,
    Text,
    ToolCallEnd,
    ToolCallStart,
    counting_ids,
)
from interlace.parsers.deepseek import CALL_BEGIN as CB
from interlace.parsers.deepseek import CALL_END as CE
from interlace.parsers.deepseek import CALLS_BEGIN as SB
from interlace.parsers.deepseek import CALLS_END as SE
from interlace.parsers.deepseek import DEEPSEEK_V31
from interlace.parsers.deepseek import SEP
from interlace.parsers.events import Event
from interlace.parsers.formats import CannotForce, check_format
from interlace.parsers.kimi_k2 import ARGS_BEGIN as KA
from interlace.parsers.kimi_k2 import CALL_BEGIN as KB
from interlace.parsers.kimi_k2 import CALL_END as KE
from interlace.parsers.kimi_k2 import KIMI_K2
from interlace.parsers.kimi_k2 import SECTION_BEGIN as KSB
from interlace.parsers.kimi_k2 import SECTION_BEGIN_1 as KSB1
from interlace.parsers.kimi_k2 import SECTION_END as KSE
from interlace.parsers.kimi_k2 import SECTION_END_1 as KSE1
from test_parsers import calls, check_invariants, normalise, text_of

PARSERS: dict[str, type[StreamingParser]] = {"deepseek_v31": DeepSeekV31Parser, "kimi_k2": KimiK2Parser}
FORMATS = {"deepseek_v31": DEEPSEEK_V31, "kimi_k2": KIMI_K2}


def make(fmt: str, tools: Mapping[str, Any] | None = None) -> StreamingParser:
    return PARSERS[fmt](id_factory=counting_ids(), tools=tools)


def run(fmt: str, text: str, cuts: Sequence[int] = (), tools: Mapping[str, Any] | None = None) -> list[Event]:
    """Feed ``text`` split at ``cuts``; all events, finish() included."""
    p = make(fmt, tools)
    events: list[Event] = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += p.feed(text[prev:c])
        prev = c
    return events + p.finish()


def check(events: Sequence[Event]) -> None:
    """test_parsers' per-call invariants (order, deltas == JSON of the arguments), with ids unique per
    output instead of ``call_``-prefixed (kimi_k2 keeps the model's ids)."""
    ids = [e.id for e in events if isinstance(e, ToolCallStart)]
    assert len(set(ids)) == len(ids) and all(ids), ids
    check_invariants([dataclasses.replace(e, id=f"call_{e.index}") if isinstance(e, ToolCallStart) else e
                      for e in events])


def errors(events: Sequence[Event]) -> list[ParserError]:
    return [e for e in events if isinstance(e, ParserError)]


def ids(events: Sequence[Event]) -> list[str]:
    return [e.id for e in events if isinstance(e, ToolCallStart)]


def ds(name: str, args: str) -> str:
    """One DeepSeek-V3.1 call (inside a section)."""
    return f"{CB}{name}{SEP}{args}{CE}"


def ds3(name: str, args: str) -> str:
    """One DeepSeek-V3 / R1-0528 call: type, separator, name line, fenced arguments."""
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


def km(ident: str, args: str) -> str:
    """One Kimi-K2 call with call id ``ident``."""
    return f"{KB}{ident}{KA}{args}{KE}"


# ---------------------------------------------------------------- samples ----

DS_OK = ("Let me check both." + SB
         + ds("get_weather", '{"city": "Paris", "days": [1, 2.5e-3, null], "opts": {"u": "c", "x": [true]}, '
                             '"note": "a } and <｜ and \\"q\\" \\u00e9"}')
         + ds("get_time", '{"timezone": "Europe/Paris"}') + SE)
DS_V3 = ("Checking." + SB + ds3("get_weather", '{"city": "Tokyo", "unit": "celsius"}') + "\n"
         + ds3("search_hotels", '{"location": "Tokyo", "check_in": "2025-01-15"}') + SE)
KIMI_OK = ("I'll look. " + KSB + km("functions.get_weather:0", '{"city": "Paris", "nested": {"a": [1, {"b": "}"}]}}')
           + km("functions.get_time:1", '{"timezone": "Europe/Paris"}') + KSE)

SAMPLES: dict[str, list[str]] = {
    "deepseek_v31": [
        DS_OK,
        DS_V3,
        "No tools; a lone <｜ and <｜tool▁ and text.",
        SB + ds("f", '{"a": tru}') + ds("g", '{"b": 1}') + SE + " after",
        SB + ds("f", '{"a": 1') + ds("g", "{}") + SE,                      # unterminated before the call end
        SB + ds("f", '{"a": [1, {"b": "x"}], "c": 2}'),                  # no call end, no section end
        SB + "noise" + ds("g", "{}") + SE,
        CB + "solo" + SEP + '{"k": "v"}' + CE + " then text",            # a lone call, no section
        "text" + CE + " stray" + SE + " markers",
        SB + CB + "cut",
        SB + ds3("v3", '{"a": 1'),
    ],
    "kimi_k2": [
        KIMI_OK,
        "No tools here <| or <|tool_ and text.",
        KSB + " " + km("functions.f:0", '{"a": tru}') + " " + km("functions.g:1", '{"b": 1}') + " " + KSE,
        KSB + km("weird@id", '{"x": 1}') + km("functions.ok:0", "{}") + KSE,
        KSB1 + km("get_weather:3", '{"city": "A"}') + KSE1 + " done",
        KSB + km("functions.f:0", '{"a": 1') + km("functions.g:1", "{}") + KSE,
        KSB + KB + "functions.f:0" + KA + '{"a": "b"',
        KSB + " noise " + km("functions.g:0", "{}") + KSE,
        km("functions.lone:7", '{"k": 1}') + " text after",
    ],
}
ALL = [(fmt, s) for fmt, outs in SAMPLES.items() for s in outs]


# --------------------------------------------------- split invariance ----


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_split_gives_same_events(data: st.DataObject) -> None:
    fmt, text = data.draw(st.sampled_from(ALL))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    whole = normalise(run(fmt, text))
    assert normalise(run(fmt, text, cuts)) == whole
    check(whole)


@pytest.mark.parametrize(("fmt", "text"), ALL)
def test_char_by_char_gives_same_events(fmt: str, text: str) -> None:
    split = run(fmt, text, range(1, len(text)))
    check(split)
    assert normalise(split) == normalise(run(fmt, text))


GARBAGE = {
    "deepseek_v31": [SB, SE, CB, CE, SEP, "<｜", "function", "\n```json\n", "\n```", "get_weather"],
    "kimi_k2": [KSB, KSE, KSB1, KSE1, KB, KA, KE, "<|", "functions.f:0", "functions.", ":1", "7"],
}
COMMON = list("ab {}[]:,\"\\\n<|") + ['"k"', "1", "true", "   "]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_garbage_never_raises_and_is_split_invariant(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(sorted(PARSERS)))
    text = "".join(data.draw(st.lists(st.sampled_from(GARBAGE[fmt] + COMMON), max_size=30)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    whole = run(fmt, text)
    check(whole)
    assert normalise(run(fmt, text, cuts)) == normalise(whole)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_outputs_are_split_invariant(data: st.DataObject) -> None:
    """Near-valid outputs (a slice deleted, a character or marker inserted) hit the error paths."""
    fmt, text = data.draw(st.sampled_from(ALL))
    a = data.draw(st.integers(0, len(text)))
    b = data.draw(st.integers(a, min(len(text), a + 8)))
    ins = data.draw(st.sampled_from(["", "}", "{", '"', ",", "\n", "\\", "x", "`", *GARBAGE[fmt][:7]]))
    text = text[:a] + ins + text[b:]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    whole = run(fmt, text)
    check(whole)
    assert normalise(run(fmt, text, cuts)) == normalise(whole)


# ------------------------------------------------------ the samples read ----


def test_deepseek_calls_text_and_exact_argument_bytes() -> None:
    ev = run("deepseek_v31", DS_OK)
    check(ev)
    assert text_of(ev) == "Let me check both."
    assert [n for n, _ in calls(ev)] == ["get_weather", "get_time"]
    assert calls(ev)[0][1]["note"] == 'a } and <｜ and "q" é'
    first = DS_OK.index(SEP) + len(SEP)
    raw = DS_OK[first : DS_OK.index(CE)]
    assert "".join(e.fragment for e in ev if isinstance(e, ArgumentsDelta) and e.index == 0) == raw
    assert ids(ev) == ["call_0", "call_1"]  # DeepSeek writes no id: generated ones


def test_deepseek_v3_form() -> None:
    ev = run("deepseek_v31", DS_V3)
    check(ev)
    assert text_of(ev) == "Checking."
    assert calls(ev) == [("get_weather", {"city": "Tokyo", "unit": "celsius"}),
                         ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"})]
    assert not errors(ev)


def test_kimi_calls_ids_and_text() -> None:
    ev = run("kimi_k2", KIMI_OK)
    check(ev)
    assert text_of(ev) == "I'll look. "
    assert calls(ev) == [("get_weather", {"city": "Paris", "nested": {"a": [1, {"b": "}"}]}}),
                         ("get_time", {"timezone": "Europe/Paris"})]
    assert ids(ev) == ["functions.get_weather:0", "functions.get_time:1"]  # the model's ids, kept


def test_arguments_delta_is_the_models_bytes_with_odd_spacing() -> None:
    args = '{ "a" :1 ,"b":[ 1,2 ] , "c": {"d" : "e"}\n}'
    for fmt, text in (("deepseek_v31", SB + ds("f", "  " + args + " \n") + SE),
                      ("kimi_k2", KSB + km("functions.f:0", " " + args + "  ") + KSE)):
        for cuts in ((), range(len(text))):
            ev = run(fmt, text, cuts)
            check(ev)
            assert "".join(e.fragment for e in ev if isinstance(e, ArgumentsDelta)) == args
            assert calls(ev) == [("f", {"a": 1, "b": [1, 2], "c": {"d": "e"}})]


@pytest.mark.parametrize(("fmt", "text"), [
    ("deepseek_v31", SB + ds("write", '{"path": "a.txt", "body": "' + "x" * 500 + '"}') + SE),
    ("deepseek_v31", SB + ds3("write", '{"path": "a.txt", "body": "' + "x" * 500 + '"}') + SE),
    ("kimi_k2", KSB + km("functions.write:0", '{"path": "a.txt", "body": "' + "x" * 500 + '"}') + KSE),
])
def test_field_arrives_before_call_ends(fmt: str, text: str) -> None:
    p = make(fmt)
    seen_at = None
    events: list[Event] = []
    for i in range(0, len(text), 4):
        new = p.feed(text[i : i + 4])
        events += new
        if seen_at is None and FieldComplete(0, "path", "a.txt") in new:
            seen_at = i + 4
    events += p.finish()
    assert seen_at is not None and seen_at < len(text) // 4, "path field must arrive early"
    kinds = [type(e) for e in events]
    assert kinds.index(FieldComplete) < kinds.index(ToolCallEnd)
    assert FieldComplete(0, "body", "x" * 500) in events


# ------------------------------------- outputs from vLLM's and SGLang's tests ----
# vLLM: tests/tool_parsers/test_deepseekv31_tool_parser.py, test_deepseekv3_tool_parser.py (its common_tests
# config), test_kimi_k2_tool_parser.py.  SGLang: test/registered/function_call/test_deepseekv31_detector.py,
# test_kimik2_detector.py, the DeepSeekV3 detector tests.  Each case: (format, output, content, calls, ids).

COMPAT: list[tuple[str, str, str, list, list | None]] = [
    # vLLM v31 test_extract_tool_calls_with_tool
    ("deepseek_v31", "normal text" + SB + ds("foo", '{"x":1}') + SE, "normal text", [("foo", {"x": 1})], None),
    # vLLM v31 test_extract_tool_calls_with_multiple_tools: vLLM's content drops the text after the section;
    # here it is content (SGLang surfaces text between sections too: nothing the model writes is lost)
    ("deepseek_v31", "some prefix text" + SB + ds("foo", '{"x":1}') + ds("bar", '{"y":2}') + SE
     + " some suffix text", "some prefix text some suffix text", [("foo", {"x": 1}), ("bar", {"y": 2})], None),
    # SGLang test_deepseekv31_detector: one delta spanning two calls / a whole call in one delta / one-shot parse
    ("deepseek_v31", SB + ds("get_weather", '{"city": "Tokyo"}') + ds("get_weather", '{"city": "Paris"}') + SE,
     "", [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Paris"})], None),
    # SGLang DeepSeekV31Detector strips the name (its regex group is .strip()ped)
    ("deepseek_v31", SB + ds(" get_weather\n", '{"city": "Tokyo"}') + SE, "", [("get_weather", {"city": "Tokyo"})],
     None),
    # vLLM deepseek_v3 common_tests: single, parallel (chained, and newline-separated as R1-0528 writes them),
    # various data types, empty arguments, surrounding text, escaped strings
    ("deepseek_v31", SB + ds3("get_weather", '{"city": "Tokyo", "unit": "celsius"}') + SE, "",
     [("get_weather", {"city": "Tokyo", "unit": "celsius"})], None),
    ("deepseek_v31", SB + ds3("get_weather", '{"city": "Tokyo", "unit": "celsius"}')
     + ds3("search_hotels", '{"location": "Tokyo", "check_in": "2025-01-15"}') + SE, "",
     [("get_weather", {"city": "Tokyo", "unit": "celsius"}),
      ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"})], None),
    ("deepseek_v31", SB + ds3("test_function", '{"string_field": "hello", "int_field": 42, "float_field": 3.14, '
                                               '"bool_field": true, "null_field": null, "array_field": ["a", "b", '
                                               '"c"], "object_field": {"nested": "value"}, "empty_array": [], '
                                               '"empty_object": {}}') + SE, "",
     [("test_function", {"string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": True,
                         "null_field": None, "array_field": ["a", "b", "c"], "object_field": {"nested": "value"},
                         "empty_array": [], "empty_object": {}})], None),
    ("deepseek_v31", SB + ds3("get_current_time", "{}") + SE, "", [("get_current_time", {})], None),
    ("deepseek_v31", "Let me check the weather for you." + SB + ds3("get_weather", '{"city": "Paris"}') + SE,
     "Let me check the weather for you.", [("get_weather", {"city": "Paris"})], None),
    ("deepseek_v31", SB + ds3("send_message", '{"text": "He said \\"hello\\"", "path": "C:\\\\Users\\\\file", '
                                              '"newline": "line1\\nline2"}') + SE, "",
     [("send_message", {"text": 'He said "hello"', "path": "C:\\Users\\file", "newline": "line1\nline2"})], None),
    # SGLang DeepSeekV3Detector: leading text, streamed in chunks
    ("deepseek_v31", "Sure, let me check. " + SB + ds3("get_weather", '{"city": "Tokyo"}') + SE,
     "Sure, let me check. ", [("get_weather", {"city": "Tokyo"})], None),
    # vLLM kimi_k2 test_extract_tool_calls: content before, with spaces and newlines around every marker
    ("kimi_k2", "I'll help you check the weather. " + KSB + " " + KB + "\nfunctions.get_weather:0 " + KA
     + ' {"city": "Beijing"} ' + KE + " " + KSE, "I'll help you check the weather. ",
     [("get_weather", {"city": "Beijing"})], ["functions.get_weather:0"]),
    ("kimi_k2", "I'll help you check the weather. " + KSB + " " + KB + "\nfunctions.get_weather:0 " + KA
     + ' {"city": "Beijing"} ' + KE + " " + KB + "\nfunctions.get_weather:1 " + KA + ' {"city": "Shanghai"} ' + KE
     + " " + KSE, "I'll help you check the weather. ",
     [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})],
     ["functions.get_weather:0", "functions.get_weather:1"]),
    # ... concatenated calls, three calls, mixed spacing, angle brackets in JSON, formatted JSON
    ("kimi_k2", "First the weather, then the news. " + KSB
     + km("functions.get_weather:0", '{"latitude": 34.0522, "longitude": -118.2437}')
     + km("functions.get_news:1", '{"content": "Los Angeles today"}') + KSE, "First the weather, then the news. ",
     [("get_weather", {"latitude": 34.0522, "longitude": -118.2437}), ("get_news", {"content": "Los Angeles today"})],
     ["functions.get_weather:0", "functions.get_news:1"]),
    ("kimi_k2", KSB + km("functions.get_weather:0", '{"city": "New York"}') + km("functions.get_news:1",
     '{"topic": "technology"}') + km("functions.send_email:2", '{"to": "user@example.com", "subject": "Daily"}')
     + KSE, "", [("get_weather", {"city": "New York"}), ("get_news", {"topic": "technology"}),
                 ("send_email", {"to": "user@example.com", "subject": "Daily"})], None),
    ("kimi_k2", "Mixed spacing test. " + KSB + " " + KB + " functions.test:0 " + KA + " {} " + KE
     + km("functions.test2:1", "{}") + " " + KSE, "Mixed spacing test. ", [("test", {}), ("test2", {})],
     ["functions.test:0", "functions.test2:1"]),
    ("kimi_k2", "I need to process HTML content. " + KSB + km("functions.process_html:0",
     '{"html": "<div>content</div>", "text": "normal text"}') + KSE, "I need to process HTML content. ",
     [("process_html", {"html": "<div>content</div>", "text": "normal text"})], None),
    ("kimi_k2", KSB + km("functions.process_data:0", '{\n  "name": "test",\n  "value": 123,\n  "nested": {\n'
                                                      '    "key": "value"\n  }\n}') + KSE, "",
     [("process_data", {"name": "test", "value": 123, "nested": {"key": "value"}})], None),
    # vLLM test_marker_variants (the singular section spelling); test_reentry_to_reasoning_after_tool_section /
    # test_same_chunk_begin_and_end_markers (an empty section, then text); test_tool_call_end_and_section_end_same_
    # chunk (an id without the functions. prefix)
    ("kimi_k2", "Reasoning " + KSB1 + km("functions.f:0", "{}") + KSE1, "Reasoning ", [("f", {})], None),
    ("kimi_k2", "Some reasoning " + KSB + KSE + " More reasoning", "Some reasoning  More reasoning", [], None),
    ("kimi_k2", "Reasoning " + KSB + "   " + KSE + " Done", "Reasoning  Done", [], None),
    ("kimi_k2", "Let me help. " + KSB + KB + "get_weather:0 " + KA + ' {"city": "Paris"} ' + KE + KSE + " Done",
     "Let me help.  Done", [("get_weather", {"city": "Paris"})], ["get_weather:0"]),
    # SGLang test_kimik2_detector: the model's conversation counter (:5, :6) is the id, indices stay 0, 1
    ("kimi_k2", KSB + km("functions.ReadFile:5", '{"path": "/a.py"}') + km("functions.get_weather:6",
     '{"city": "Tokyo"}') + KSE, "", [("ReadFile", {"path": "/a.py"}), ("get_weather", {"city": "Tokyo"})],
     ["functions.ReadFile:5", "functions.get_weather:6"]),
    # ... hyphenated MCP names, with and without the functions. prefix
    ("kimi_k2", KSB + km("functions.mcp__portal__search-documents:0", '{"path": "/docs"}') + KSE, "",
     [("mcp__portal__search-documents", {"path": "/docs"})], None),
    ("kimi_k2", KSB + km("mcp__portal__search-docs:2", '{"q": "x"}') + KSE, "",
     [("mcp__portal__search-docs", {"q": "x"})], ["mcp__portal__search-docs:2"]),
    # ... braces and fences inside a string are not the end of the arguments
    ("kimi_k2", KSB + km("functions.write_to_file:0", json.dumps(
        {"path": "x.md", "content": "# T\n```py\nd={'k': 1}\n```\ndone } { more"})) + KSE, "",
     [("write_to_file", {"path": "x.md", "content": "# T\n```py\nd={'k': 1}\n```\ndone } { more"})], None),
    # ... whitespace inside the section is not content; whitespace around the arguments is not arguments
    ("kimi_k2", "Checking.\n" + KSB + "\n" + km("functions.read_file:0", '{"path": "/a"}') + "\n"
     + km("functions.get_weather:1", ' {"city": "A"} \n') + "\n" + KSE + "\n", "Checking.\n",
     [("read_file", {"path": "/a"}), ("get_weather", {"city": "A"})], None),
    # ... back-to-back sections, and text between two sections, with dense indices
    ("kimi_k2", "This is a content:" + KSB + km("functions.get_weather:0", '{"city": "London"}') + KSE + KSB
     + km("functions.get_weather:1", '{"city": "Delhi"}') + KSE, "This is a content:",
     [("get_weather", {"city": "London"}), ("get_weather", {"city": "Delhi"})], None),
    ("kimi_k2", "Prefix text:" + KSB + km("functions.get_weather:0", '{"city": "London"}') + KSE
     + " Now calling next: " + KSB + km("functions.get_weather:1", '{"city": "Delhi"}') + KSE,
     "Prefix text: Now calling next: ", [("get_weather", {"city": "London"}), ("get_weather", {"city": "Delhi"})],
     None),
    # ... stray control tokens are stripped from text; a trailing '<' is not held back at the end
    ("kimi_k2", "normal text" + KSE, "normal text", [], None),
    ("kimi_k2", "text" + KA + "more", "textmore", [], None),
    ("kimi_k2", "a < b <", "a < b <", [], None),
    ("deepseek_v31", "normal text <", "normal text <", [], None),
]


@pytest.mark.parametrize(("fmt", "text", "content", "expected", "want_ids"), COMPAT)
def test_accepts_what_vllm_and_sglang_accept(fmt: str, text: str, content: str, expected: list,
                                             want_ids: list | None) -> None:
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts)
        check(events)
        assert calls(events) == expected
        assert text_of(events) == content
        assert not errors(events)
        if want_ids is not None:
            assert ids(events) == want_ids
        assert [e.index for e in events if isinstance(e, ToolCallStart)] == list(range(len(expected)))


def test_kimi_bare_counter_names_the_only_function() -> None:
    """SGLang test_kimik2_detector (bare counter, single tool): ``<|tool_call_begin|>3<|...argument_begin|>``."""
    text = KSB + km("3", '{"q": "x"}') + KSE
    ev = run("kimi_k2", text, tools={"search": {"type": "object"}})
    check(ev)
    assert calls(ev) == [("search", {"q": "x"})] and ids(ev) == ["3"]


# What the peers accept that is refused here, and why:
# * SGLang infers the function of a bare-counter id among several tools from the argument names: a guess that
#   runs a tool the model never named (and needs the whole arguments before the call can start).
# * SGLang passes a call with malformed JSON arguments (``fasle``) through as a call, and vLLM returns an
#   unterminated object's raw text as arguments: here a malformed call is a ParserError (parsers/base.py's
#   error policy), its valid siblings still read.
# * vLLM silently drops text between a section's begin and its first call ("header noise"): here it is a
#   ParserError carrying that text (nothing the model writes disappears unreported).
REFUSED = [
    ("kimi_k2", KSB + km("0", '{"city": "Tokyo"}') + KSE,
     {"ReadFile": {"type": "object"}, "get_weather": {"type": "object", "properties": {"city": {}}}}, []),
    ("kimi_k2", KSB + km("functions.get_weather:0", '{"city": "London"}') + KSE + KSB
     + km("functions.get_weather:1", '{"city": "Bad", "valid": fasle') + KSE + KSB
     + km("functions.get_weather:2", '{"city": "Delhi"}') + KSE, None,
     [("get_weather", {"city": "London"}), ("get_weather", {"city": "Delhi"})]),
    ("kimi_k2", "I'll help. " + KSB + " spurious text " + km("functions.f:0", "{}") + KSE, None, [("f", {})]),
]


@pytest.mark.parametrize(("fmt", "text", "tools", "expected"), REFUSED)
def test_refused_peer_cases_are_parser_errors(fmt: str, text: str, tools: Any, expected: list) -> None:
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts, tools=tools)
        check(events)
        assert calls(events) == expected
        assert len(errors(events)) == 1


# Broken outputs: the peers extract no call from them, or only the valid siblings (vLLM test_extract_tool_
# calls_unparsable_block, test_extract_tool_calls_invalid_json / _invalid_funcall, deepseek_v3 malformed_input_
# outputs; SGLang test_malformed_call_does_not_discard_valid_call, test_unparsable_id_does_not_wedge_stream,
# test_orphan_tool_call_begin_is_discarded, test_stream_ends_without_section_end_marker).
MALFORMED = [
    ("deepseek_v31", "Let me look that up." + SB + "get_weather", [], [None], "Let me look that up."),
    ("deepseek_v31", SB + "foo" + SEP + '{"x":1}' + SE, [], [None], ""),
    ("deepseek_v31", SB + CB + "function" + SEP + 'get_weather\n```json\n{"city": "Tokyo"\n```' + CE + SE, [],
     [0], ""),
    ("deepseek_v31", SB + "function" + SEP + 'get_weather\n```json\n{"city": "Tokyo"}\n```' + SE, [], [None], ""),
    ("deepseek_v31", "Sure. " + SB + ds3("get_weather", '{"city": "Boston"}') + ds3("search", "{bad json") + SE,
     [("get_weather", {"city": "Boston"})], [1], "Sure. "),
    ("deepseek_v31", "Sure. " + SB + ds("get_weather", '{"city": "Boston"}') + ds("search", "{bad json") + SE,
     [("get_weather", {"city": "Boston"})], [1], "Sure. "),
    ("deepseek_v31", SB + ds("a", '{"x": "unterminated string') + ds("b", '{"y": 2}') + SE, [("b", {"y": 2})],
     [0], ""),
    ("deepseek_v31", SB + ds("", "{}") + ds("b", "{}") + SE, [("b", {})], [None], ""),
    ("kimi_k2", "I'll help. " + KSB + " " + KB + "\nfunctions.invalid_get_weather:0 " + KA + ' {"city": "Beijing" '
     + KE + " " + KB + "\nfunctions.valid_get_weather:1 " + KA + ' {"city": "Shanghai"} ' + KE + " " + KSE,
     [("valid_get_weather", {"city": "Shanghai"})], [0], "I'll help. "),
    ("kimi_k2", KSB + " " + KB + "\nfunctions.invalid_get_weather.0 " + KA + ' {"city": "Beijing"} ' + KE + " "
     + KB + "\nfunctions.valid_get_weather:1 " + KA + ' {"city": "Shanghai"} ' + KE + " " + KSE,
     [("valid_get_weather", {"city": "Shanghai"})], [None], ""),
    ("kimi_k2", "normal text before" + KSB + km("weird@id", '{"city": "London"}') + KSE + KSB
     + km("functions.get_weather:0", '{"city": "Delhi"}') + KSE, [("get_weather", {"city": "Delhi"})], [None],
     "normal text before"),
    ("kimi_k2", KSB + KB + "functions.read_file:0" + km("functions.get_weather:1", '{"city": "Oslo"}') + KSE,
     [("get_weather", {"city": "Oslo"})], [None], ""),
    ("kimi_k2", KSB + " partial content", [], [None], ""),
    ("kimi_k2", KSB + km("functions.f:0", '{"a": 1}') + km("functions.g:1", '{"b": '), [("f", {"a": 1})], [1], ""),
]


@pytest.mark.parametrize(("fmt", "text", "expected", "error_indices", "content"), MALFORMED)
def test_broken_calls_fail_and_valid_siblings_are_read(fmt: str, text: str, expected: list,
                                                       error_indices: list, content: str) -> None:
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts)
        check(events)
        assert calls(events) == expected
        assert [e.index for e in errors(events)] == error_indices
        assert text_of(events) == content
        for e in events:  # no fragment of a control token reaches a client
            if isinstance(e, (Text, ArgumentsDelta)):
                assert "tool▁call" not in getattr(e, "text", getattr(e, "fragment", ""))


def test_unterminated_call_reports_its_text() -> None:
    ev = run("deepseek_v31", SB + ds("f", '{"a": [1, 2') [: -len(CE)])
    check(ev)
    (err,) = errors(ev)
    assert err.index == 0 and "unterminated" in err.message and err.raw == '{"a": [1, 2'
    ev = run("kimi_k2", KSB + KB + " functions.f:0")
    (err,) = errors(ev)
    assert err.index is None and err.raw == KB + " functions.f:0"


def test_missing_section_end_is_not_an_error() -> None:
    """A model that stops after its last call (EOS instead of the section end): the calls stand."""
    for fmt, text in (("deepseek_v31", SB + ds("f", "{}") + "\n"), ("kimi_k2", KSB + km("functions.f:0", "{}")),
                      ("kimi_k2", KSB + km("functions.f:0", "{}") + KSE[:8]),  # max_tokens cut the end
                      ("deepseek_v31", SB + ds("f", "{}")[: -3]),
                      ("deepseek_v31", SB + ds3("f", "{}")[: -len(CE) - 1])):
        ev = run(fmt, text)
        check(ev)
        assert calls(ev) == [("f", {})] and not errors(ev) and not text_of(ev)


def test_kimi_repeated_id_gets_a_generated_one() -> None:
    ev = run("kimi_k2", KSB + km("functions.f:0", "{}") + km("functions.f:0", '{"a": 1}') + KSE)
    check(ev)
    assert ids(ev) == ["functions.f:0", "call_0"]


def test_kimi_bare_counter_with_several_tools_names_nothing() -> None:
    ev = run("kimi_k2", KSB + km("2", "{}") + km("functions.g:3", "{}") + KSE, tools={"f": {}, "g": {}})
    assert calls(ev) == [("g", {})] and [e.index for e in errors(ev)] == [None]


def test_in_call_spans_the_section() -> None:
    """A pause inside a section (a marker inside arguments) is spurious; after the section end it is not."""
    for fmt, text, marker in (("deepseek_v31", DS_OK, SE), ("kimi_k2", KIMI_OK, KSE)):
        p = make(fmt)
        start = text.index(SB if fmt == "deepseek_v31" else KSB)
        p.feed(text[: start + 3])
        assert not p.in_call
        ev = p.feed(text[start + 3 : len(text) - len(marker)])  # every call complete, between calls
        assert p.in_call and len([e for e in ev if isinstance(e, ToolCallEnd)]) == 2
        p.feed(marker[:-1])
        assert p.in_call
        p.feed(marker[-1])
        assert not p.in_call


# ----------------------------------------- formats read back by their parsers ----

_KEYS = st.text(max_size=8)
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                     st.floats(allow_nan=False, allow_infinity=False, width=64),
                     st.text(st.characters(blacklist_categories=("Cs",)), max_size=12))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(_KEYS, inner, max_size=3)), max_leaves=8)
_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,12}(\.[a-z_][a-z0-9_]{0,6})?(:[a-z]{1,3})?", fullmatch=True)


@pytest.mark.parametrize("fmt", sorted(PARSERS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_format_renders_what_its_parser_reads(fmt: str, data: st.DataObject) -> None:
    """render_call / render_calls read back by the parser give the same calls; the call-end markers agree with
    ``in_call`` (test_parsers' contract for every format)."""
    form = FORMATS[fmt]
    cs = data.draw(st.lists(st.tuples(_NAMES, st.dictionaries(_KEYS, _VALUES, max_size=4)), min_size=1, max_size=3))
    assert calls(make(fmt).parse(form.render_call(*cs[0]))) == cs[:1]
    text = form.render_calls(cs)
    events = run(fmt, text, data.draw(st.lists(st.integers(0, len(text)), max_size=4)))
    check(events)
    assert calls(events) == cs, text
    assert not errors(events) and not text_of(events)
    ends = [i + len(m) for m in form.call_end for i in range(len(text)) if text.startswith(m, i)]
    assert ends
    for end in sorted(set(ends)):
        p = make(fmt)
        ev = p.feed(text[:end])
        started = {e.index for e in ev if isinstance(e, ToolCallStart)}
        ended = {e.index for e in ev if isinstance(e, ToolCallEnd)}
        if not p.in_call:
            assert started == ended
        if end == max(ends):
            assert not p.in_call and len(ended) == len(cs)


def test_rendering_follows_the_templates() -> None:
    assert DEEPSEEK_V31.render_calls([("a", {"x": 1}), ("b", {})]) == (
        SB + CB + 'a' + SEP + '{"x": 1}' + CE + CB + "b" + SEP + "{}" + CE + SE)
    assert DEEPSEEK_V31.render_results(["1", "2"]) == (
        "<｜tool▁output▁begin｜>1<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>2<｜tool▁output▁end｜>")
    assert KIMI_K2.render_calls([("a", {"x": 1}), ("b", {})]) == (
        KSB + KB + "functions.a:0" + KA + '{"x": 1}' + KE + KB + "functions.b:1" + KA + "{}" + KE + KSE)
    assert KIMI_K2.results_named  # the prompt renderer passes the names of the calls answered
    assert KIMI_K2.render_results(["1", "2"], ["a", "b"]) == (
        "## Return of functions.a:0\n1\n## Return of functions.b:1\n2")
    assert KIMI_K2.render_results(["1", "2"]) == "## Return of call 0\n1\n## Return of call 1\n2"
    fns = [{"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}]
    ds_text = DEEPSEEK_V31.instructions(fns)
    assert ds_text.startswith("## Tools\nYou have access to the following tools:\n\n### get_weather\n"
                              "Description: Weather\n\nParameters: {\"type\": \"object\"}\n")
    assert SB + CB + "tool_call_name" + SEP in ds_text
    km_text = KIMI_K2.instructions(fns)
    assert '"name": "get_weather"' in km_text and KSB in km_text and KA in km_text and KSE in km_text


def test_registered_under_their_names() -> None:
    parsers = PluginHost(entrypoints=False).parsers()
    for fmt, cls in PARSERS.items():
        assert parsers[fmt] is cls and cls.format.name == fmt
        assert check_format(cls.format, fmt) is FORMATS[fmt]
        assert cls.format.call_start and all(m in cls.format.special_tokens for m in cls.format.call_end)


# ----------------------------------------------------------------- grammars ----

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def compiler():
    from interlace.engine_ext.constraints.grammar import GrammarCompiler
    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(str(embedded_model_dir()), needed_by="tests")
    return GrammarCompiler(tok)


def _accepts(compiler, grammar, text: str) -> bool:
    m = grammar._matcher.deep_copy()
    return bool(m.consume_tokens(compiler.tokenizer.encode(text))) and m.is_accepting()


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammar_forces_the_text_the_parser_reads(compiler, fmt: str) -> None:
    """The forcing grammar (markers as text: the embedded model has no such tokens) accepts the format's own
    rendering of valid calls, which the parser reads back, and nothing outside tools, schemas or parallelism."""
    form = FORMATS[fmt]
    two = [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})]
    required = compiler.tool_calls(form, [WEATHER, TIME])
    assert _accepts(compiler, required, form.render_calls(two))
    assert calls(make(fmt).parse(form.render_calls(two))) == two
    single = compiler.tool_calls(form, [WEATHER, TIME], parallel=False)
    assert _accepts(compiler, single, form.render_calls(two[:1]))
    assert not _accepts(compiler, single, form.render_calls(two))
    named = compiler.tool_calls(form, [WEATHER, TIME], force="get_time", parallel=False)
    assert _accepts(compiler, named, form.render_calls(two[1:]))
    assert not _accepts(compiler, named, form.render_calls(two[:1]))
    assert not _accepts(compiler, required, form.render_calls([("get_weather", {"town": "Paris"})]))
    assert not _accepts(compiler, required, "Sure. " + form.render_calls(two[:1]))
    if fmt == "kimi_k2":  # the counter is the model's to choose
        assert _accepts(compiler, required, form.render_calls(two[:1]).replace(":0", ":17"))


def test_grammar_refuses_names_it_cannot_write(compiler) -> None:
    bad = {"type": "function", "function": {"name": " padded", "parameters": {"type": "object"}}}
    for form in FORMATS.values():
        with pytest.raises(CannotForce):
            compiler.tool_calls(form, [bad])
