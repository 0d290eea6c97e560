"""The completion loop's pure pieces: which decoded calls are well formed,
how tool results are cut to fit the context, and what the loop asks a format
about calls that use earlier results (the end-to-end behaviour is in
test_formats_e2e.py)."""

from __future__ import annotations

import ast
import inspect

import pytest

from interlace.engine_ext.tokenizer import Tokenizer
from interlace.gateway.openai import completions
from interlace.gateway.prompt import tool_results_turn
from interlace.gateway.openai.completions import fit_results, malformed
from interlace.parsers import PlanParser, ToolCallEnd
from interlace.parsers.builtin import BUILTIN_PARSERS
from interlace.parsers.formats import HERMES, PLAN

OFFERED = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.mark.parametrize("name,args,word", [
    ("get_weather", "Paris", "JSON object"),               # arguments that are not an object
    ("get_weather", ["Paris"], "JSON object"),
    ("get_weather", None, "JSON object"),
    ("get_weather", {"t": float("nan")}, "not valid JSON"),  # clients reject NaN / Infinity
    ("get_weather", {"t": [float("inf")]}, "not valid JSON"),
    ("rm_rf", {"path": "/"}, "get_weather"),               # a tool that was not offered: the error names the offered
])
def test_malformed_calls(name, args, word):
    problem = malformed(name, args, OFFERED)
    assert problem and word in problem


def test_well_formed_call():
    assert malformed("get_weather", {"city": "Paris", "n": [1, 2.5, None]}, OFFERED) is None


@pytest.fixture(scope="module")
def tok(smol_dir) -> Tokenizer:
    return Tokenizer(smol_dir)


@pytest.mark.parametrize("fmt", [HERMES, PLAN])
def test_results_fit_as_they_are(tok, fmt):
    ids, cuts = fit_results(tok, fmt, ["42", "ok"], room=10_000)
    assert ids == tool_results_turn(tok, fmt, ["42", "ok"]) and cuts == [None, None]


def test_huge_result_is_cut_with_a_marker(tok):
    huge, small = "x" * 50_000, "small result"
    ids, (cut_huge, cut_small) = fit_results(tok, HERMES, [huge, small], room=300)
    assert ids is not None and 250 < len(ids) <= 300  # uses the room, never more
    assert cut_small is None  # the short result is whole
    assert cut_huge["total_chars"] == 50_000 and 0 < cut_huge["shown_chars"] < 50_000
    text = tok.decode(ids)
    assert "truncated by the gateway" in text and "small result" in text
    assert f"{50_000 - cut_huge['shown_chars']} of 50000 characters omitted" in text


def test_no_room_at_all(tok):
    ids, cuts = fit_results(tok, HERMES, ["x" * 1000], room=5)
    assert ids is None and cuts == [{"shown_chars": 0, "total_chars": 1000}]


# ------------------------------------------------ calls that use earlier results: the format answers
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}
CALC = {"type": "object", "properties": {"expression": {"type": "string"}}}


def test_the_plan_format_answers_for_its_steps():
    """The plan's syntax lives in PlanFormat: join() ends the calls, $N refers to step N, positional
    arguments are named by the tool's schema, a result reads back as `$N = ...`."""
    text = '$1 = search("GPU makers", limit=3)\n$2 = calculator("$1 / 2")\n$3 = search($1, $9)\n4. join()\n'
    steps = [e.arguments for e in PlanParser().parse(text) if isinstance(e, ToolCallEnd)]
    first, second, third, end = steps
    assert PLAN.ends_calls("join") and not PLAN.ends_calls("search")
    assert [PLAN.step(s) for s in steps] == [1, 2, 3, 4]
    assert [list(PLAN.depends_on(s)) for s in steps] == [[], [1], [1, 9], []]
    assert PLAN.tool_arguments(first, SEARCH, {}) == {"query": "GPU makers", "limit": 3}
    assert PLAN.tool_arguments(second, CALC, {1: "84"}) == {"expression": "84 / 2"}
    # a whole-argument reference becomes the result itself; one without a result stays as written
    assert PLAN.tool_arguments(third, SEARCH, {1: "nvidia"}) == {"query": "nvidia", "limit": "$9"}
    assert PLAN.tool_arguments(second, None, {}) == {}  # no schema: positional arguments have no names
    assert PLAN.named_result(second, "42") == "$2 = 42" and PLAN.reference(7) == "$7"


@pytest.mark.parametrize("name", sorted(set(BUILTIN_PARSERS) - {"plan"}))
def test_other_formats_have_no_references(name):
    """The defaults: no call ends the calls, none waits for another, arguments reach the tool as
    decoded (even ones that look like a plan step), results read back as they are."""
    fmt = BUILTIN_PARSERS[name].format
    looks_like_a_step = {"step": 2, "args": ["x"], "kwargs": {}, "depends_on": [1]}
    assert not fmt.ends_calls("join") and fmt.step(looks_like_a_step) is None
    assert not fmt.depends_on(looks_like_a_step)
    assert fmt.tool_arguments(looks_like_a_step, SEARCH, {1: "r"}) is looks_like_a_step
    assert fmt.named_result(looks_like_a_step, "42") == "42"


def test_the_loop_knows_no_format_by_name():
    """completions.py asks the format; it never compares with a format's name or the plan's syntax."""
    tree = ast.parse(inspect.getsource(completions))
    names = {*BUILTIN_PARSERS, "join"}
    assert not [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "name"
                and isinstance(n.value, ast.Attribute) and n.value.attr == "fmt"]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "re"]  # no $N pattern
