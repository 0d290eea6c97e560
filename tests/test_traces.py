"""Traces: the InferCept format, validation errors, generators (Table 1 /
LAMPS Table 2 statistics), Poisson arrivals, scaling, metrics."""

import json
import math

import pytest

from interlace.engine_ext.sim.metrics import RequestRecord, percentile, summarize
from interlace.engine_ext.sim.traces import (AUGMENTS, TOOLBENCH, Segment, Trace, TraceError, TraceRequest,
                                             generate_infercept, generate_toolbench, load_trace, save_trace,
                                             scale_trace, trace_stats, with_poisson_arrivals)


def seg(p=10, c=5, t=0.5, r=3):
    return {"prompt_tokens": p, "completion_tokens": c, "api_time": t, "api_token_length": r}


def test_load_infercept_format_and_round_trip(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"7": [seg(), seg(0, 4, 0.0, 0)], "8": [seg(3, 1, 0, 0)]}))
    tr = load_trace(path)
    assert [r.id for r in tr] == ["7", "8"]
    r = tr.requests[0]
    assert r.segments[0] == Segment(10, 5, 0.5, 3) and r.num_calls == 1
    assert r.output_tokens == 9 and r.tool_s == 0.5
    assert r.call_contexts() == [15] and r.peak_context == 10 + 5 + 3 + 4
    out = tmp_path / "o.json"
    tr = with_poisson_arrivals(tr, 2.0, seed=1)
    save_trace(tr, out)
    back = load_trace(out)
    assert [(q.id, q.arrival, q.segments) for q in back] == [(q.id, q.arrival, q.segments) for q in tr]


@pytest.mark.parametrize("obj, words", [
    ({"r1": [seg(), {"prompt_tokens": 1, "completion_tokens": 2, "api_time": 0}]}, ["'r1'", "api_token_length"]),
    ({"r2": [seg(p=-1)]}, ["'r2'", "prompt_tokens", ">= 0"]),
    ({"r3": [seg(t=float("nan"))]}, ["'r3'", "api_time", "finite"]),
    ({"r4": [seg(c="5")]}, ["'r4'", "completion_tokens", "number"]),
    ({"r5": [seg(c=2.5)]}, ["'r5'", "completion_tokens", "integer"]),
    ({"r6": []}, ["'r6'", "segments", "empty"]),
    ({"r7": "nope"}, ["'r7'", "segments"]),
    ({"r8": [[1, 2]]}, ["'r8'", "segment 0", "object"]),
    ({"r9": [seg(c=0)]}, ["'r9'", "completion_tokens"]),
    ({"r10": [seg(t=True)]}, ["'r10'", "api_time", "number"]),
    ({"requests": [{"id": "a", "arrival": -1, "segments": [seg()]}]}, ["'a'", "arrival"]),
    ({"requests": [{"segments": [seg()]}]}, ["#0", "'id'"]),
    ({"requests": [{"id": "d", "segments": [seg()]}, {"id": "d", "segments": [seg()]}]}, ["'d'", "duplicated"]),
])
def test_malformed_traces_name_request_and_field(tmp_path, obj, words):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(TraceError) as e:
        load_trace(path)
    for w in words:
        assert w in str(e.value)


def test_non_object_and_missing_file(tmp_path):
    (tmp_path / "a.json").write_text("[1, 2]")
    with pytest.raises(TraceError, match="JSON object"):
        load_trace(tmp_path / "a.json")
    (tmp_path / "b.json").write_text("{nope")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(tmp_path / "b.json")
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "missing.json")


@pytest.mark.parametrize("kind", list(AUGMENTS))
def test_generators_match_table_1(kind):
    aug = AUGMENTS[kind]
    n = 1500 if kind != "ve" else 300
    tr = generate_infercept(kind, n, seed=3)
    st = trace_stats(tr)
    assert st["calls_mean"] == pytest.approx(aug.calls[0], rel=0.08)
    assert st["call_s_mean"] == pytest.approx(aug.call_s[0], rel=0.08)
    # contexts are pushed apart by at least a decoded step: VE's 28 calls
    # within a ~115-token spread shift its mean a little more
    assert st["context_mean"] == pytest.approx(aug.context[0], rel=0.08)
    for r in tr:
        assert r.app == kind and r.num_calls >= 1 and all(s.completion_tokens >= 1 for s in r.segments)
        ctxs = r.call_contexts()
        assert ctxs == sorted(ctxs)
    assert generate_infercept(kind, 20, seed=3).requests == generate_infercept(kind, 20, seed=3).requests


def test_mixed_and_toolbench():
    tr = generate_infercept("mixed", 1200, seed=0)
    apps = {r.app for r in tr}
    assert apps == set(AUGMENTS)
    counts = [sum(r.app == a for r in tr) for a in AUGMENTS]
    assert min(counts) > 1200 / 6 * 0.75
    tb = trace_stats(generate_toolbench(3000, seed=0))
    assert tb["calls_mean"] == pytest.approx(TOOLBENCH.calls[0], rel=0.1)
    assert tb["call_s_mean"] == pytest.approx(TOOLBENCH.call_s[0], rel=0.12)
    with pytest.raises(ValueError, match="unknown augment"):
        generate_infercept("nope", 3)


def test_poisson_arrivals_seeded_and_rate_correct():
    base = generate_infercept("qa", 4000, seed=0)
    a = with_poisson_arrivals(base, 5.0, seed=7)
    b = with_poisson_arrivals(base, 5.0, seed=7)
    c = with_poisson_arrivals(base, 5.0, seed=8)
    ta = [r.arrival for r in a]
    assert ta == [r.arrival for r in b] and ta != [r.arrival for r in c]
    assert ta == sorted(ta) and ta[0] == 0.0
    assert (len(ta) - 1) / ta[-1] == pytest.approx(5.0, rel=0.06)
    assert all(r.arrival == 0.0 for r in base)  # a copy
    with pytest.raises(ValueError, match="rate"):
        with_poisson_arrivals(base, 0.0)


def test_scale_trace_bounds_context_and_time():
    tr = generate_infercept("chatbot", 50, seed=1)
    small = scale_trace(tr, max_context=200, time_scale=0.01, max_calls=2)
    for r, s in zip(tr, small):
        assert s.peak_context <= 200 and s.num_calls <= 2
        assert all(x.completion_tokens >= 1 for x in s.segments)
        assert s.tool_s == pytest.approx(sum(x.api_time for x in r.segments[:s.num_calls]) * 0.01)


def test_percentile_and_summarize():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([1, 3], 100) == 3
    with pytest.raises(ValueError):
        percentile([], 50)
    recs = [RequestRecord("a", 0.0, 1.0, 11.0, 5.0, 3), RequestRecord("b", 1.0, 1.5, 5.0, 0.0, 4)]
    m = summarize(recs, 10.0, kv_waste_gb_s=2.5, extra={"x": 1})
    assert m["completed"] == 2 and m["rps"] == 0.2 and m["x"] == 1 and m["kv_waste_gb_s"] == 2.5
    assert m["norm_latency_p50"] == pytest.approx((2.0 + 1.0) / 2)
    assert m["e2e_mean"] == pytest.approx(7.5) and m["ttft_mean"] == pytest.approx(0.75)
    empty = summarize([], 0.0)
    assert empty["completed"] == 0 and empty["rps"] == 0.0 and empty["norm_latency_p50"] is None
    with pytest.raises(ValueError, match="wall_s"):
        summarize(recs, math.nan)


def test_trace_request_validation_in_code():
    from interlace.engine_ext.sim.traces import validate_request
    with pytest.raises(TraceError, match="'x'.*segments"):
        validate_request(TraceRequest("x", []))
    assert isinstance(Trace([]).requests, list)
