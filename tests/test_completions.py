"""The completion loop's pure pieces: which decoded calls are well formed, and
how tool results are cut to fit the context (the end-to-end behaviour is in
test_formats_e2e.py)."""

from __future__ import annotations

import pytest

from interlace.engine_ext.tokenizer import Tokenizer
from interlace.gateway.prompt import tool_results_turn
from interlace.gateway.openai.completions import fit_results, malformed
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
