"""Tests for interlace.parsers: formats, split invariance, early fields, errors."""

from __future__ import annotations

import json
import keyword
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlace import PluginHost, hookimpl
from interlace.parsers import (
    ArgumentsDelta,
    DuplicateParserError,
    FieldComplete,
    HermesParser,
    LineComplete,
    Llama3JsonParser,
    MarkdownCodeParser,
    MistralParser,
    ParserError,
    ParserRegistry,
    PlanParser,
    PythonicParser,
    PythonStatementSplitter,
    StreamingParser,
    Text,
    ToolCallEnd,
    ToolCallStart,
    UnknownParserError,
    counting_ids,
)
from interlace.parsers.builtin import BUILTIN_PARSERS
from interlace.parsers.events import Event, Reasoning
from interlace.parsers.formats import FormatError, ToolFormat, check_format

PARSERS: dict[str, type[StreamingParser]] = {
    "hermes": HermesParser,
    "mistral": MistralParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "markdown": MarkdownCodeParser,
    "plan": PlanParser,
}


def registry(*plugins: object) -> ParserRegistry:
    """The parsers as the gateway has them: the plugin host's ``register_parsers`` hooks (the
    built-ins and ``plugins``) filling a registry."""
    reg = ParserRegistry()
    for name, factory in PluginHost(entrypoints=False, plugins=plugins).parsers().items():
        reg.register(name, factory)
    return reg


def make(fmt: str) -> StreamingParser:
    return PARSERS[fmt](id_factory=counting_ids())


def run(fmt: str, text: str, cuts: Sequence[int] = ()) -> list[Event]:
    """Feed ``text`` split at ``cuts``; return all events including finish()."""
    p = make(fmt)
    events: list[Event] = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += p.feed(text[prev:c])
        prev = c
    return events + p.finish()


def normalise(events: Sequence[Event]) -> list[Event]:
    """Merge adjacent Text events, adjacent Reasoning events and adjacent same-index ArgumentsDelta events.

    Everything else (which events, their order, their payloads) must not depend
    on how the output was split into deltas.
    """
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Text) and isinstance(last, Text):
            out[-1] = Text(last.text + e.text)
        elif isinstance(e, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + e.text)
        elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
            out[-1] = ArgumentsDelta(e.index, last.fragment + e.fragment)
        else:
            out.append(e)
    return out


def calls(events: Sequence[Event]) -> list[tuple[str, dict]]:
    return [(e.name, e.arguments) for e in events if isinstance(e, ToolCallEnd)]


def text_of(events: Sequence[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Text))


def check_invariants(events: Sequence[Event]) -> None:
    """Per-call ordering and the ArgumentsDelta == JSON(arguments) contract."""
    started: dict[int, str] = {}
    ended: set[int] = set()
    frags: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, Text):
            assert e.text, "empty Text event"
        elif isinstance(e, ToolCallStart):
            assert e.index == len(started), "indices are dense and in order"
            started[e.index] = e.name
            assert e.id.startswith("call_")
        elif isinstance(e, (ArgumentsDelta, FieldComplete, LineComplete)):
            assert e.index in started and e.index not in ended
            if isinstance(e, ArgumentsDelta):
                frags.setdefault(e.index, []).append(e.fragment)
        elif isinstance(e, ToolCallEnd):
            assert e.index in started and e.index not in ended
            assert started[e.index] == e.name
            ended.add(e.index)
            assert json.loads("".join(frags.get(e.index, []))) == e.arguments
        elif isinstance(e, ParserError):
            if e.index is not None:
                assert e.index in started and e.index not in ended
                ended.add(e.index)
    assert ended == set(started), "every started call ends or fails"


# ---------------------------------------------------------------- samples ----

HERMES_OK = (
    "I'll check the weather in both cities.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris, FR", "unit": "celsius", "days": 3, '
    '"flags": {"hourly": true, "alerts": [1, 2.5e-3, null]}, "note": "say \\"hi\\" \\u00e9 \\\\ done"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"arguments": {"q": "brace } and ] in string"}, "name": "search"}\n'
    "</tool_call>"
)
MISTRAL_OK = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
    '{"name": "search", "arguments": {"q": "mistral [TOOL_CALLS] docs", "k": -10}}]'
)
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]ping[ARGS]{}'
LLAMA_OK = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Menlo Park", "days": 1}}; '
    '{"name": "search", "parameters": {"q": "llama; semicolons"}}'
)
LLAMA_BARE = '{"type": "function", "name": "calc", "parameters": {"expr": "2+2"}}'
PYTHONIC_OK = (
    '[get_weather(city="San Francisco", unit=\'fahrenheit\', days=[1, 2, {"a": (3, 4)}]), '
    'search(query="""multi\nline, with ) paren""", k=5, exact=False), ping()]'
)
MARKDOWN_OK = (
    "Let me compute that.\n"
    "```python\n"
    "import math\n"
    "\n"
    "def area(r):\n"
    '    """Area of a circle, with ``` inside."""\n'
    "    return math.pi * r ** 2\n"
    "\n"
    "for r in (1, 2):\n"
    "    print(r, area(r))\n"
    "else:\n"
    "    print('done')\n"
    "total = sum(\n"
    "    area(r) for r in range(3)\n"
    ")\n"
    'print(f"{total:.2f} \\u00e9")\n'
    "```\n"
    "The results are above."
)
PLAN_OK = (
    "Thought: I need both market caps, then their ratio.\n"
    '$1 = search("Nvidia market cap")\n'
    "$2 = search('AMD market cap')\n"
    '$3 = calculator("$1 / $2", precision=2)\n'
    "$4 = summarize($3, style=\"short\")\n"
    "5. join()\n"
)

SAMPLES: dict[str, list[str]] = {
    "hermes": [
        HERMES_OK,
        "Just text, with <b>tags</b> and a lone < and <tool_cal but no call.",
        '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call> after',
        '<tool_call>{"name": "f", "arguments": {"a": 1}',
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        "<tool_call>not json</tool_call>tail",
        '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "}"}], "c": 2}}',  # no closing tag
    ],
    "mistral": [
        MISTRAL_OK,
        MISTRAL_V11,
        "No tools needed; [TOOL brackets] are fine.",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1,}}]',
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "argu',
        '[TOOL_CALLS] {"name": "solo", "arguments": {"x": "y"}}',
    ],
    "llama3_json": [
        LLAMA_OK,
        LLAMA_BARE,
        '{"answer": 42, "why": "a JSON reply, not a call"}',
        '\n  {"name": "not closed", "parameters": {"a": [1, 2',
        "Plain answer with {braces} later and <|python_ta",
        '<|python_tag|>{"name": "f", "parameters": {"a": }}',
        "<|python_tag|>brave_search.call(query=\"x\")",
    ],
    "pythonic": [
        PYTHONIC_OK,
        "[1] See the docs (page 2).",
        "The answer is [f(x=1)] maybe.",
        "[f(1, b=2)]",
        '[f(a="unterminated)]',
        "<|python_start|>[g(x='it''s')]<|python_end|>",
    ],
    "markdown": [
        MARKDOWN_OK,
        "Run this:\n```bash\nls -la\n```\nand then\n```py\nx = 1\n```\n",
        "Text only, with `inline` and ``double`` ticks.",
        "```python\nwhile True:\n    pass\n",  # unterminated
    ],
    "plan": [
        PLAN_OK,
        "1. First, we think.\n2. Then we act.\nNo $ signs here.",
        "$1 = search(\n$2 = lookup(\"x\")",
        "$1 = not a call\n",
    ],
}
ALL = [(fmt, s) for fmt, outs in SAMPLES.items() for s in outs]


# ------------------------------------------------------------ formats ----


def test_hermes_calls_and_text() -> None:
    ev = run("hermes", HERMES_OK)
    check_invariants(ev)
    # the "\n" between the two calls is layout, not text (parsers/base.py)
    assert text_of(ev) == "I'll check the weather in both cities.\n"
    assert calls(ev) == [
        (
            "get_weather",
            {
                "city": "Paris, FR",
                "unit": "celsius",
                "days": 3,
                "flags": {"hourly": True, "alerts": [1, 2.5e-3, None]},
                "note": 'say "hi" \u00e9 \\ done',
            },
        ),
        ("search", {"q": "brace } and ] in string"}),
    ]
    fields = [(e.key, e.value) for e in ev if isinstance(e, FieldComplete) and e.index == 0]
    assert [k for k, _ in fields] == ["city", "unit", "days", "flags", "note"]
    starts = [e for e in ev if isinstance(e, ToolCallStart)]
    assert [(s.index, s.id, s.name) for s in starts] == [(0, "call_0", "get_weather"), (1, "call_1", "search")]


def test_hermes_arguments_before_name_are_buffered() -> None:
    ev = normalise(run("hermes", '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>'))
    assert ev == [
        ToolCallStart(0, "call_0", "search"),
        ArgumentsDelta(0, '{"q": "x"'),
        FieldComplete(0, "q", "x"),
        ArgumentsDelta(0, "}"),
        ToolCallEnd(0, "search", {"q": "x"}),
    ]


def test_hermes_string_encoded_arguments() -> None:
    ev = run("hermes", SAMPLES["hermes"][4])
    check_invariants(ev)
    assert calls(ev) == [("f", {"a": 1})]
    assert FieldComplete(0, "a", 1) in ev


def test_hermes_holds_back_partial_marker() -> None:
    p = HermesParser(id_factory=counting_ids())
    assert p.feed("Hello <tool_") == [Text("Hello ")]
    assert p.feed("x> there") == [Text("<tool_x> there")]
    assert p.feed(" <") == [Text(" ")]
    assert p.finish() == [Text("<")]


def test_mistral_list_and_v11() -> None:
    ev = run("mistral", MISTRAL_OK)
    check_invariants(ev)
    assert calls(ev) == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("search", {"q": "mistral [TOOL_CALLS] docs", "k": -10}),
    ]
    ev = run("mistral", MISTRAL_V11)
    check_invariants(ev)
    assert calls(ev) == [("get_weather", {"city": "Paris", "days": 2}), ("ping", {})]
    assert FieldComplete(0, "city", "Paris") in ev
    assert calls(run("mistral", SAMPLES["mistral"][5])) == [("solo", {"x": "y"})]


def test_llama3_json() -> None:
    ev = run("llama3_json", LLAMA_OK)
    check_invariants(ev)
    assert calls(ev) == [
        ("get_weather", {"city": "Menlo Park", "days": 1}),
        ("search", {"q": "llama; semicolons"}),
    ]
    assert calls(run("llama3_json", LLAMA_BARE)) == [("calc", {"expr": "2+2"})]
    # A bare JSON answer is not a call: it comes back as text, untouched.
    answer = SAMPLES["llama3_json"][2]
    assert normalise(run("llama3_json", answer)) == [Text(answer)]
    ev = run("llama3_json", "\n " + answer)
    assert normalise(ev) == [Text("\n " + answer)]
    builtin_tool = SAMPLES["llama3_json"][6]
    assert normalise(run("llama3_json", builtin_tool)) == [Text(builtin_tool)]


def test_pythonic() -> None:
    ev = run("pythonic", PYTHONIC_OK)
    check_invariants(ev)
    assert calls(ev) == [
        ("get_weather", {"city": "San Francisco", "unit": "fahrenheit", "days": [1, 2, {"a": [3, 4]}]}),
        ("search", {"query": "multi\nline, with ) paren", "k": 5, "exact": False}),
        ("ping", {}),
    ]
    assert [e.key for e in ev if isinstance(e, FieldComplete)] == ["city", "unit", "days", "query", "k", "exact"]
    s = SAMPLES["pythonic"][1]  # "[1] See ...": not a call list, text
    assert normalise(run("pythonic", s)) == [Text(s)]
    ev = run("pythonic", SAMPLES["pythonic"][2])  # a list after prose is a call (as SGLang reads it)
    assert calls(ev) == [("f", {"x": 1})] and text_of(ev) == "The answer is  maybe."
    assert calls(run("pythonic", SAMPLES["pythonic"][5])) == [("g", {"x": "its"})]


def test_markdown_code_statements() -> None:
    ev = run("markdown", MARKDOWN_OK)
    check_invariants(ev)
    lines = [e.line for e in ev if isinstance(e, LineComplete)]
    assert lines == [
        "import math",
        'def area(r):\n    """Area of a circle, with ``` inside."""\n    return math.pi * r ** 2',
        "for r in (1, 2):\n    print(r, area(r))\nelse:\n    print('done')",
        "total = sum(\n    area(r) for r in range(3)\n)",
        'print(f"{total:.2f} \\u00e9")',
    ]
    ((name, args),) = calls(ev)
    assert name == "python"
    code = MARKDOWN_OK.split("```python\n")[1].split("```\n")[0]
    assert args == {"code": code}
    assert text_of(ev) == "Let me compute that.\nThe results are above."


def test_markdown_other_languages_pass_through() -> None:
    s = SAMPLES["markdown"][1]
    ev = run("markdown", s)
    assert calls(ev) == [("python", {"code": "x = 1\n"})]
    assert text_of(ev) == "Run this:\n```bash\nls -la\n```\nand then\n"
    custom = MarkdownCodeParser(tool_name="shell", languages=["bash"], python_statements=False)
    ev = custom.parse(s)
    assert calls(ev) == [("shell", {"code": "ls -la\n"})]
    assert [e.line for e in ev if isinstance(e, LineComplete)] == ["ls -la"]


def test_markdown_statement_released_before_fence_closes() -> None:
    p = make("markdown")
    ev = p.feed("```python\nx = 1\ndef f():\n    return 2\n")
    assert [e.line for e in ev if isinstance(e, LineComplete)] == ["x = 1"]
    ev = p.feed("y = f()\n")  # the next top-level line completes the def
    assert [e.line for e in ev if isinstance(e, LineComplete)] == ["def f():\n    return 2", "y = f()"]


def test_statement_splitter_decorators_and_continuations() -> None:
    sp = PythonStatementSplitter()
    out: list[str] = []
    src = "@dec\nclass A:\n    x = 1\n\ntry:\n    f()\nexcept E:\n    pass\nfinally:\n    g()\n# c\ns = '''a\nb'''\n"
    for line in src.splitlines():
        out += sp.push(line)
    out += sp.flush()
    assert out == [
        "@dec\nclass A:\n    x = 1",
        "try:\n    f()\nexcept E:\n    pass\nfinally:\n    g()\n# c",
        "s = '''a\nb'''",
    ]


@pytest.mark.parametrize(
    ("src", "expected"),
    [
        ("x = [\n1,\n]\ny = 2", ["x = [\n1,\n]", "y = 2"]),
        ("s = 'a # (not a comment'\nt = 1", ["s = 'a # (not a comment'", "t = 1"]),
        ("total = 1 + \\\n    2\nprint(total)", ["total = 1 + \\\n    2", "print(total)"]),
        ("if a:\n    b = '''\nx\n'''\nc = 3", ["if a:\n    b = '''\nx\n'''", "c = 3"]),
        ("async def f():\n    await g()\n\n\nclass B: pass\nf()", ["async def f():\n    await g()", "class B: pass", "f()"]),
        ("x = 1  # note (\n# only comment\n\ny = (2)", ["x = 1  # note (", "y = (2)"]),
    ],
)
def test_statement_splitter_lexing(src: str, expected: list[str]) -> None:
    sp = PythonStatementSplitter()
    out = [stmt for line in src.split("\n") for stmt in sp.push(line)] + sp.flush()
    assert out == expected


def test_plan() -> None:
    ev = run("plan", PLAN_OK)
    check_invariants(ev)
    assert calls(ev) == [
        ("search", {"step": 1, "args": ["Nvidia market cap"], "kwargs": {}, "depends_on": []}),
        ("search", {"step": 2, "args": ["AMD market cap"], "kwargs": {}, "depends_on": []}),
        ("calculator", {"step": 3, "args": ["$1 / $2"], "kwargs": {"precision": 2}, "depends_on": [1, 2]}),
        ("summarize", {"step": 4, "args": ["$3"], "kwargs": {"style": "short"}, "depends_on": [3]}),
        ("join", {"step": 5, "args": [], "kwargs": {}, "depends_on": []}),
    ]
    assert text_of(ev) == "Thought: I need both market caps, then their ratio.\n"


def test_plan_call_emitted_at_line_end() -> None:
    p = make("plan")
    assert p.feed('$1 = search("a")') == []
    ev = p.feed("\n$2 = ")
    assert calls(ev) == [("search", {"step": 1, "args": ["a"], "kwargs": {}, "depends_on": []})]


# --------------------------------------------------- split invariance ----


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_any_split_gives_same_events(data: st.DataObject) -> None:
    fmt, text = data.draw(st.sampled_from(ALL))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    whole = normalise(run(fmt, text))
    assert normalise(run(fmt, text, cuts)) == whole
    check_invariants(whole)


@pytest.mark.parametrize(("fmt", "text"), ALL)
def test_char_by_char_gives_same_events(fmt: str, text: str) -> None:
    split = run(fmt, text, range(1, len(text)))
    check_invariants(split)
    assert normalise(split) == normalise(run(fmt, text))


GARBAGE = list("ab {}[]():;,=\"'\\$1\n`<>_|") + [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "```python\n", "```\n",
    '"name"', '"arguments"', '"parameters"', "f(", "$1 = ", "<|python_start|>", "true", "    ",
]


@settings(max_examples=150, deadline=None)
@given(
    fmt=st.sampled_from(sorted(SAMPLES)),
    text=st.lists(st.sampled_from(GARBAGE), max_size=30).map("".join),
    cuts=st.lists(st.integers(0, 80), max_size=10),
)
def test_garbage_never_raises_and_is_split_invariant(fmt: str, text: str, cuts: list[int]) -> None:
    cuts = [c for c in cuts if c <= len(text)]
    whole = run(fmt, text)
    check_invariants(whole)
    assert normalise(run(fmt, text, cuts)) == normalise(whole)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_outputs_are_split_invariant(data: st.DataObject) -> None:
    """Near-valid outputs (a slice deleted, a character inserted) hit the error paths."""
    fmt, text = data.draw(st.sampled_from(ALL))
    a = data.draw(st.integers(0, len(text)))
    b = data.draw(st.integers(a, min(len(text), a + 8)))
    ins = data.draw(st.sampled_from(["", "}", "]", '"', ",", "\n", "\\", ")", "'", "`", "x"]))
    text = text[:a] + ins + text[b:]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    whole = run(fmt, text)
    check_invariants(whole)
    assert normalise(run(fmt, text, cuts)) == normalise(whole)


# ----------------------------------------------- early field delivery ----


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>{"name": "write", "arguments": {"path": "a.txt", "body": "' + "x" * 500 + '"}}</tool_call>'),
        ("mistral", '[TOOL_CALLS][{"name": "write", "arguments": {"path": "a.txt", "body": "' + "x" * 500 + '"}}]'),
        ("llama3_json", '{"name": "write", "parameters": {"path": "a.txt", "body": "' + "x" * 500 + '"}}'),
        ("pythonic", '[write(path="a.txt", body="' + "x" * 500 + '")]'),
    ],
)
def test_field_arrives_before_call_ends(fmt: str, text: str) -> None:
    p = make(fmt)
    fed = 0
    seen_at = None
    events: list[Event] = []
    for i in range(0, len(text), 4):
        new = p.feed(text[i : i + 4])
        fed = i + len(text[i : i + 4])
        events += new
        if seen_at is None and FieldComplete(0, "path", "a.txt") in new:
            seen_at = fed
    events += p.finish()
    assert seen_at is not None and seen_at < len(text) // 4, "path field must arrive early"
    kinds = [type(e) for e in events]
    assert kinds.index(FieldComplete) < kinds.index(ToolCallEnd)
    assert FieldComplete(0, "body", "x" * 500) in events


# --------------------------------------------------------------- errors ----


def test_invalid_json_inside_call() -> None:
    ev = run("hermes", SAMPLES["hermes"][2])
    check_invariants(ev)
    errs = [e for e in ev if isinstance(e, ParserError)]
    assert len(errs) == 1 and errs[0].index == 0 and "tru" in errs[0].raw
    assert not calls(ev)
    assert text_of(ev) == " after"  # recovery at </tool_call>
    ev = run("mistral", SAMPLES["mistral"][3])
    assert [type(e) for e in ev if not isinstance(e, ArgumentsDelta)] == [ToolCallStart, FieldComplete, ParserError]
    ev = run("hermes", SAMPLES["hermes"][5])
    assert [e for e in ev if isinstance(e, ParserError)][0].index is None
    assert text_of(ev) == "tail"


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", SAMPLES["hermes"][3]),
        ("mistral", SAMPLES["mistral"][4]),
        ("pythonic", SAMPLES["pythonic"][4]),
        ("markdown", SAMPLES["markdown"][3]),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1'),
    ],
)
def test_unterminated_call_is_parser_error(fmt: str, text: str) -> None:
    ev = run(fmt, text)
    check_invariants(ev)
    assert isinstance(ev[-1], ParserError)
    assert "unterminated" in ev[-1].message


def test_hermes_missing_close_tag_still_completes() -> None:
    ev = run("hermes", SAMPLES["hermes"][6])
    assert calls(ev) == [("f", {"a": [1, {"b": "}"}], "c": 2})]


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_text_only_output(fmt: str) -> None:
    s = "The capital of France is Paris. Nothing to call here\n(really) - ok? 3 < 4."
    assert normalise(run(fmt, s)) == [Text(s)]


def test_plan_errors() -> None:
    ev = run("plan", SAMPLES["plan"][2])
    assert [type(e) for e in ev] == [ParserError, ToolCallStart, ArgumentsDelta, ToolCallEnd]
    assert calls(ev) == [("lookup", {"step": 2, "args": ["x"], "kwargs": {}, "depends_on": []})]


def test_feed_after_finish_raises() -> None:
    p = make("hermes")
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


# ------------------------------------------------------------- registry ----


def test_registry() -> None:
    reg = registry()
    assert reg.names() == sorted(BUILTIN_PARSERS) and set(PARSERS) <= set(BUILTIN_PARSERS)
    assert reg.create("plan") is not reg.create("plan")
    with pytest.raises(UnknownParserError) as exc:
        reg.create("nope")
    assert "hermes" in str(exc.value)
    with pytest.raises(DuplicateParserError):
        reg.register("hermes", HermesParser)
    for name in reg.names():  # each name maps to the parser whose format carries that name
        parser = reg.create(name)
        assert type(parser) is BUILTIN_PARSERS[name] and parser.format.name == name
        assert check_format(reg.get(name).format, name) is parser.format


class _NoFormat(StreamingParser):
    name = "noformat"


class _BadFormat(StreamingParser):
    format = type("F", (), {"name": "bad", "call_end": "</x>", "special_tokens": ()})()


class _Custom(PlanParser):
    """A third-party parser: reuses the plan parser, writes its own format."""

    class _Fmt(ToolFormat):
        name = "mine"
        call_end = ("join()",)

        def instructions(self, functions):  # type: ignore[no-untyped-def]
            return "tools: " + ", ".join(f["name"] for f in functions)

        def render_call(self, name, arguments):  # type: ignore[no-untyped-def]
            return PlanParser.format.render_call(name, arguments)

        def render_result(self, content):  # type: ignore[no-untyped-def]
            return content

    format = _Fmt()


def test_registry_through_plugin_manager() -> None:
    class ThirdParty:
        @hookimpl
        def register_parsers(self, register: Callable) -> None:
            register("mine", _Custom)

    reg = registry(ThirdParty())
    assert reg.names() == sorted([*BUILTIN_PARSERS, "mine"])
    assert reg.get("mine").format.instructions([{"name": "f"}, {"name": "g"}]) == "tools: f, g"
    p = reg.create("mine")
    assert calls(p.parse(p.format.render_calls([("f", {"step": 1, "args": ["x"], "kwargs": {}, "depends_on": []})])))


@pytest.mark.parametrize("factory,match", [
    (_NoFormat, "has no `format`"),
    (lambda: PlanParser(), "has no `format`"),  # a bare lambda cannot tell the gateway its format
    (_BadFormat, "call_end.*tuple"),
])
def test_parser_without_a_format_is_refused(factory: Callable, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        ParserRegistry().register("x", factory)


# ---------------------------------------------- formats round-trip through their parsers ----

# argument names the Python-call formats (pythonic, plan) can write: identifiers, not keywords (`as=`, `if=` are
# syntax errors there; a hypothesis run in a clean-clone CI drew `as`)
_KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda k: k not in ("true", "false", "null") and not keyword.iskeyword(k))
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                     st.floats(allow_nan=False, allow_infinity=False, width=64),
                     st.text(st.characters(blacklist_categories=("Cs",)), max_size=12))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(_KEYS, inner, max_size=3)), max_leaves=8)
_NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,12}(\.[a-z_][a-z0-9_]{0,6})?", fullmatch=True)


def _call_strategy(fmt: str) -> st.SearchStrategy:
    if fmt == "markdown":
        code = st.lists(st.from_regex(r"[a-z_]{1,6} = [0-9]{1,4}|print\([a-z0-9 +]{0,10}\)|# [a-z `]{0,10}",
                                      fullmatch=True), max_size=4).map(lambda ls: "".join(line + "\n" for line in ls))
        return st.tuples(st.just("python"), st.fixed_dictionaries({"code": code}))
    if fmt == "plan":
        args = st.lists(_VALUES.filter(lambda v: "$" not in json.dumps(v)), max_size=3)
        kwargs = st.dictionaries(_KEYS, _VALUES.filter(lambda v: "$" not in json.dumps(v)), max_size=2)
        return st.tuples(_NAMES, st.builds(lambda a, k: {"step": 1, "args": a, "kwargs": k, "depends_on": []},
                                           args, kwargs))
    keys = _KEYS if fmt == "pythonic" else st.text(max_size=8)
    return st.tuples(_NAMES, st.dictionaries(keys, _VALUES, max_size=4))


def _numbered(fmt: str, cs: list) -> list:
    if fmt != "plan":
        return cs
    return [(n, {**a, "step": i + 1}) for i, (n, a) in enumerate(cs)]


@pytest.mark.parametrize("fmt", sorted(PARSERS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_format_renders_what_its_parser_reads(fmt: str, data: st.DataObject) -> None:
    """Every registered format: render_call / render_calls parsed by the same parser give the same calls,
    and the call-end markers agree with the parser: once the text up to the last marker has been fed, every
    call has ended; at any marker where the parser says it is not inside a call, every started call has ended."""
    reg = registry()
    form = reg.get(fmt).format
    cs = _numbered(fmt, data.draw(st.lists(_call_strategy(fmt), min_size=1, max_size=3)))
    name, args = cs[0]
    assert calls(reg.create(fmt).parse(form.render_call(name, args))) == [(name, args)]
    text = form.render_calls(cs)
    events = run(fmt, text, data.draw(st.lists(st.integers(0, len(text)), max_size=4)))
    check_invariants(events)
    assert calls(events) == cs, text
    assert not [e for e in events if isinstance(e, ParserError)]
    ends = [i + len(m) for m in form.call_end for i in range(len(text)) if text.startswith(m, i)]
    assert ends, f"{fmt}: no call_end marker {form.call_end} in its own rendering {text!r}"
    for end in sorted(set(ends)):
        p = make(fmt)
        ev = p.feed(text[:end])
        started = {e.index for e in ev if isinstance(e, ToolCallStart)}
        ended = {e.index for e in ev if isinstance(e, ToolCallEnd)}
        if not p.in_call:
            assert started == ended, f"{fmt}: paused at {end} outside a call with calls still open: {text!r}"
        if end == max(ends):
            assert not p.in_call and len(ended) == len(cs), f"{fmt}: the last marker does not end the calls"


def test_random_ids() -> None:
    ids = {HermesParser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0].id for _ in range(20)}
    assert len(ids) == 20 and all(i.startswith("call_") and len(i) == 29 for i in ids)


# ------------------------------ outputs from vLLM's and SGLang's parser tests ----
# (tests/tool_parsers/test_mistral_tool_parser.py, test_llama3_json ..., sglang's
# function_call tests): what they accept, we accept, unless it is unsafe.

COMPAT = [
    # Mistral v11 as decoded with [ARGS] skipped (vLLM: "single_tool_add", "multiple_tool_calls", "complex")
    ("mistral", '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', "",
     [("add_this_and_that", {"a": 3.5, "b": 4})]),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', "",
     [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    ("mistral", 'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}', "hi{hi",
     [("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"})]),
    ("mistral", '[TOOL_CALLS]get_current_weather[ARGS]{"city": "San Francisco", "state": "CA", "unit": "celsius"}',
     "", [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]),
    # Mistral pre-v11 (vLLM: "argument_before_name", "content_before_tool", "multiple_tools")
    ("mistral", '[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, '
                '"name": "get_current_weather"}]', "",
     [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]),
    ("mistral", 'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', "Hello", [("add", {"a": 1, "b": 2})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
                '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]', "",
     [("add", {"a": 3.5, "b": 4}),
      ("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]),
    # Llama: prose before <|python_tag|> (SGLang test_llama_python_tag_format); newline- and ';'-separated calls
    ("llama3_json", 'Here are some results: <|python_tag|>{"name": "search", "parameters": {"query": "weather"}}',
     "Here are some results: ", [("search", {"query": "weather"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "SF"}}\n'
                    '{"name": "get_time", "parameters": {"tz": "PST"}}', "",
     [("get_weather", {"city": "SF"}), ("get_time", {"tz": "PST"})]),
    ("llama3_json", '<|python_tag|>{"name": "fn1", "arguments": {"a": 1}}; {"name": "fn2", "arguments": {"b": 2}}', "",
     [("fn1", {"a": 1}), ("fn2", {"b": 2})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "SF"}}\n{"answer": "not a call"}',
     '\n{"answer": "not a call"}', [("get_weather", {"city": "SF"})]),
    # pythonic (vLLM's pythonic tests), JSON literals as Llama 4 sometimes writes them
    ("pythonic", "[get_weather(city='San Francisco', metric='celsius'), do_something_cool()]", "",
     [("get_weather", {"city": "San Francisco", "metric": "celsius"}), ("do_something_cool", {})]),
    ("pythonic", '<|python_start|>[register_user(name="Doe", age=9, address={"city": "SF"}, flag=true, x=null)]'
                 "<|python_end|>", "",
     [("register_user", {"name": "Doe", "age": 9, "address": {"city": "SF"}, "flag": True, "x": None})]),
    # markdown: a closing fence at the very end of the stream, no newline after it
    ("markdown", "```python\nprint(1)\n```", "", [("python", {"code": "print(1)\n"})]),
]


@pytest.mark.parametrize(("fmt", "text", "content", "expected"), COMPAT)
def test_accepts_what_vllm_and_sglang_accept(fmt: str, text: str, content: str, expected: list) -> None:
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts)
        check_invariants(events)
        assert calls(events) == expected
        assert text_of(events) == content
        assert not [e for e in events if isinstance(e, ParserError)]


SALVAGE = [
    ("llama3_json", '{"name": "good1", "parameters": {"x": 1}}; {"name": "bad", "parameters": {"x": 1,, "y": '
                    '{"z": "}"}}}; {"name": "good2", "parameters": {"y": 2}}'),
    ("llama3_json", '<|python_tag|>{"name": "good1", "parameters": {"x": 1}}\n{"name": "bad", "parameters": '
                    '{"x": NaN}}\n{"name": "good2", "parameters": {"y": 2}}'),
    ("mistral", '[TOOL_CALLS][{"name": "good1", "arguments": {"x": 1}}, {"name": "bad", "arguments": {"x": [1,]}}, '
                '{"name": "good2", "arguments": {"y": 2}}]'),
    ("mistral", '[TOOL_CALLS]good1{"x": 1}[TOOL_CALLS]bad{"x": Infinity}[TOOL_CALLS]good2{"y": 2}'),
    ("pythonic", '[good1(x=1), bad(1, y=2), good2(y=2)]'),
    ("pythonic", '[good1(x=1), bad(x=1e999), good2(y=2)]'),
    ("hermes", '<tool_call>{"name": "good1", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "bad", '
               '"arguments": {"x": -Infinity}}</tool_call><tool_call>{"name": "good2", "arguments": {"y": 2}}</tool_call>'),
]


@pytest.mark.parametrize(("fmt", "text"), SALVAGE)
def test_valid_siblings_of_a_malformed_call_are_kept(fmt: str, text: str) -> None:
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts)
        check_invariants(events)
        assert calls(events) == [("good1", {"x": 1}), ("good2", {"y": 2})]
        errors = [e for e in events if isinstance(e, ParserError)]
        assert len(errors) == 1 and errors[0].index == 1 and "bad" not in text_of(events)


@pytest.mark.parametrize(("fmt", "text"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": [1, 1e999]}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": Infinity}"}</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": {"y": -Infinity}}}]'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": -1e400}'),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": NaN}}'),
    ("pythonic", "[f(x=1e999)]"),
    ("pythonic", "[f(x=[1, -1e999])]"),
    ("plan", "$1 = f(1e999)\n"),
    ("plan", "$1 = f(x={1, 2})\n"),  # a set: not JSON data either
])
def test_non_finite_numbers_make_a_call_malformed(fmt: str, text: str) -> None:
    events = run(fmt, text)
    check_invariants(events)
    assert calls(events) == [] and [e for e in events if isinstance(e, ParserError)]
    for e in events:  # nothing that reaches a client carries a non-JSON number
        if isinstance(e, ArgumentsDelta):
            assert "Infinity" not in e.fragment and "NaN" not in e.fragment


@pytest.mark.parametrize(("text", "content", "expected"), [
    # SGLang's TestPythonicDetector outputs
    ("Here's a tool call: [get_weather(location='New York', unit='celsius')]", "Here's a tool call: ",
     [("get_weather", {"location": "New York", "unit": "celsius"})]),
    ("[get_weather(location='Berlin')] and [search(query='restaurants')]", " and ",
     [("get_weather", {"location": "Berlin"}), ("search", {"query": "restaurants"})]),
    ("[get_weather(location='Tokyo')] Here's the forecast:", " Here's the forecast:",
     [("get_weather", {"location": "Tokyo"})]),
    ("Here's a call: <|python_start|>[get_weather(location='Tokyo', data=[1, 2, 3])]<|python_end|>",
     "Here's a call: ", [("get_weather", {"location": "Tokyo", "data": [1, 2, 3]})]),
    ("See [1] and [the docs](http://x) or [a, b]; [f] (not a call", "See [1] and [the docs](http://x) or [a, b]; "
     "[f] (not a call", []),
])
def test_pythonic_after_prose(text: str, content: str, expected: list) -> None:
    for cuts in ((), range(len(text))):
        events = run("pythonic", text, cuts)
        check_invariants(events)
        assert calls(events) == expected and text_of(events) == content
