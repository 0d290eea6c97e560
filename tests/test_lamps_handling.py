"""LAMPS' handling term and Algorithm 1's handling at the call, and the
simulator's product conditions: online predictions by default, C_other as
the running requests' KV, and the per-iteration prefill cap on every token."""

from dataclasses import dataclass, field

import pytest

from helpers.profiles import small_profile
from interlace.engine_ext.policies import (LAMPS, Discard, Handling, MinWaste, ObjectiveRanking, Preserve,
                                           RankState, SchedInfo, make_interception, make_ranking, unit_profile)
from interlace.engine_ext.sim.simulator import Simulator, simulate
from interlace.engine_ext.sim.traces import Segment, Trace, TraceRequest, generate_infercept, scale_trace, \
    with_poisson_arrivals
from interlace.gateway.config import ConfigError, parse_config


@dataclass
class Req:
    """A request as an engine hands it to a ranking (``arrival`` and ``sched``)."""
    name: str
    arrival: float
    sched: SchedInfo = field(default_factory=SchedInfo)


def two_requests():
    # r1: short segment, then a 5 s call; r2: a longer segment that ends the request
    r1 = Req("r1", 0.0, SchedInfo(context_len=100, expected_output=10, expected_tool="t", expected_tool_s=5.0))
    r2 = Req("r2", 1.0, SchedInfo(context_len=200, expected_output=100))
    return r1, r2


def test_handling_awareness_changes_the_lamps_order():
    """Preserving r1 through its 5 s call holds 110 tokens for 5 s (550
    token-s, 27500 iterations-worth at 20 ms): more than r2's whole memory
    area (25050); min-waste swaps or discards it for far less, so r1 goes
    first.  A LAMPS that charges every call as preserve orders them the
    other way round."""
    prof = small_profile()
    state = RankState(iteration=1, iteration_s=0.02, batch_context_tokens=1000)
    aware = LAMPS(prof, MinWaste(prof), horizon="segment")
    r1, r2 = two_requests()
    assert [r.name for r in aware.order([r2, r1], state)] == ["r1", "r2"]
    assert r1.sched.predicted_handling is not Handling.PRESERVE
    blind = LAMPS(prof, Preserve(prof), horizon="segment")
    r1, r2 = two_requests()
    assert [r.name for r in blind.order([r2, r1], state)] == ["r2", "r1"]
    assert r1.sched.predicted_handling is Handling.PRESERVE


def test_handling_aware_lamps_finishes_sooner_in_the_simulator():
    """One slot, unit model: r1 (2 tokens, then a 20 s call) and r2 (8
    tokens, no call).  Min-waste swaps r1 out for its call, so its memory
    over time is small and it runs first, its call overlapping r2: 23 and
    10, mean 16.5.  Charged as preserve, r1 looks costlier than r2 and
    waits: 31 and 8, mean 19.5 -- with the same runtime handling (swap)."""
    prof = unit_profile(kv_capacity_tokens=100)
    tr = Trace([TraceRequest("r1", [Segment(2, 2, 20.0, 0), Segment(0, 1)], 0.0, "a"),
                TraceRequest("r2", [Segment(5, 8)], 0.0, "b")])
    got = {}
    for kind in ("aware", "preserve"):
        ic = make_interception("infercept", prof)
        rk = LAMPS(prof, ic if kind == "aware" else Preserve(prof), horizon="segment")
        res = simulate(tr, prof, ic, rk, oracle=True, max_batch_requests=1)
        got[kind] = {r.id: r.finish for r in res.records}
        assert res.stats["handling"]["swap"] == 1
    assert got == {"aware": {"r1": 23.0, "r2": 10.0}, "preserve": {"r1": 31.0, "r2": 8.0}}


def test_c_other_is_the_given_batch_and_a_full_cache_only_when_unknown():
    prof = small_profile()
    rk = LAMPS(prof, Discard(prof), horizon="segment")
    r1, _ = two_requests()
    small = rk.score(r1, RankState(iteration_s=0.02, batch_context_tokens=0))
    big = rk.score(r1, RankState(iteration_s=0.02, batch_context_tokens=10_000))
    unknown = rk.score(r1, RankState(iteration_s=0.02, batch_context_tokens=None))
    full = rk.score(r1, RankState(iteration_s=0.02, batch_context_tokens=prof.kv_capacity_tokens - 110))
    assert small < full == unknown < big


def test_handling_at_call_option_and_delegation():
    prof = small_profile()
    r1, _ = two_requests()
    off = LAMPS(prof, Discard(prof))
    assert off.handling_at_call(r1) is None  # decide afresh
    on = ObjectiveRanking(make_ranking("lamps", prof, Discard(prof), handling_at_call=True))
    assert on.handling_at_call(r1) is Handling.DISCARD  # predicted now: the segment was never scored
    r_nocall = Req("x", 0.0, SchedInfo(context_len=10, expected_output=3))
    assert on.handling_at_call(r_nocall) is None  # no call predicted
    assert make_ranking("fcfs").handling_at_call(r1) is None
    with pytest.raises(ValueError, match="horizon"):
        make_ranking("lamps", prof, horizon="all")
    with pytest.raises(ValueError, match="handling_at_call"):
        make_ranking("fcfs", handling_at_call="yes")


def test_config_keys_reach_the_policy_spec():
    cfg = parse_config({"engine": {"horizon": "segment"},
                        "models": {"a": {"path": "x"}, "b": {"path": "x", "handling_at_call": True}}})
    a, b = cfg.models["a"].policy, cfg.models["b"].policy
    assert (a.horizon, a.handling_at_call, b.horizon, b.handling_at_call) == ("segment", False, "segment", True)
    assert parse_config({"models": {"m": {"path": "x"}}}).models["m"].policy.horizon == "job"
    for bad, where in [({"horizon": "all"}, "horizon"), ({"handling_at_call": "yes"}, "handling_at_call")]:
        with pytest.raises(ConfigError, match=where):
            parse_config({"engine": bad, "models": {"m": {"path": "x"}}}, "gw.yaml")


def one_call(call=50.0):
    return Trace([TraceRequest("a", [Segment(10, 5, call, 0), Segment(0, 1)], 0.0, "t")])


def test_handling_at_call_applies_the_predicted_handling_in_the_simulator():
    prof = unit_profile(kv_capacity_tokens=100)
    # the runtime policy would preserve; LAMPS' prediction (its own policy) says discard
    for at_call, want in ((True, "discard"), (False, "preserve")):
        rk = LAMPS(prof, Discard(prof), handling_at_call=at_call)
        res = simulate(one_call(), prof, Preserve(prof), rk, oracle=True)
        assert {k for k, v in res.stats["handling"].items() if v} == {want}
    # a call LAMPS predicted as preserve stays preserved while it runs (Algorithm 1's queues), where
    # min-waste deciding afresh swaps or discards a 50 s call as it ages
    got = {}
    for at_call in (True, False):
        rk = LAMPS(prof, Preserve(prof), handling_at_call=at_call)
        res = simulate(one_call(), prof, MinWaste(prof), rk, oracle=True)
        got[at_call] = {k for k, v in res.stats["handling"].items() if v}, sum(res.stats["replanned"].values())
    assert got[True] == ({"preserve"}, 0)
    assert got[False][0] != {"preserve"}


class Recording(LAMPS):
    """LAMPS that notes what each segment's SchedInfo carried when first ranked."""

    def __init__(self, prof):
        super().__init__(prof, Preserve(prof))
        self.seen = {}

    def order(self, items, state=RankState()):
        for it in items:
            s = it.sched
            self.seen.setdefault((it.id, it.seg), (s.expected_output, s.expected_tool_s, s.future))
        return super().order(items, state)


def sequential(n=4):
    # one app, three segments (two 1 s calls); each request arrives after the previous one finished
    return Trace([TraceRequest(f"q{i}", [Segment(8, 4, 1.0, 2), Segment(0, 4, 1.0, 2), Segment(0, 4)],
                               10.0 * i, "app") for i in range(n)])


def test_online_predictions_are_the_default_and_learn():
    prof = unit_profile(kv_capacity_tokens=1000)
    rk = Recording(prof)
    simulate(sequential(), prof, make_interception("preserve", prof), rk)
    assert rk.seen[("q0", 0)] == (None, None, ())  # nothing known yet: not the trace's values
    out, call_s, future = rk.seen[("q2", 0)]
    assert out == 4 and call_s == pytest.approx(1.0)
    assert len(future) == 2 and future[0][1] == pytest.approx(1.0) and future[-1][1] is None
    # the oracle (the upper bound) knows the trace from the first request
    rk = Recording(prof)
    simulate(sequential(), prof, make_interception("preserve", prof), rk, oracle=True)
    assert rk.seen[("q0", 0)][:2] == (4, 1.0)


def test_prefill_cap_applies_to_new_tokens_too():
    prof = small_profile()  # S = 16, token budget 64
    tr = with_poisson_arrivals(scale_trace(generate_infercept("mixed", 24, seed=0), max_context=90, time_scale=0.01,
                                           max_calls=3), 20.0, 0)
    chunked = simulate(tr, prof, make_interception("discard-chunked", prof), make_ranking("fcfs"), timeline=True)
    S, bs = prof.saturation_tokens, prof.block_size
    assert all(t.batched_tokens <= max(S, t.decode_tokens + bs) for t in chunked.timeline)
    assert any(t.batched_tokens - t.decode_tokens >= S // 2 for t in chunked.timeline)  # prompts do get prefilled
    # without chunked recomputation an iteration takes up to the token budget
    whole = simulate(tr, prof, make_interception("discard", prof), make_ranking("fcfs"), timeline=True)
    assert max(t.batched_tokens for t in whole.timeline) > S


def test_rankings_see_the_running_requests_kv():
    prof = small_profile()
    seen = []

    class Spy(LAMPS):
        def order(self, items, state=RankState()):
            seen.append(state.batch_context_tokens)
            return super().order(items, state)

    tr = with_poisson_arrivals(scale_trace(generate_infercept("mixed", 24, seed=0), max_context=90, time_scale=0.01,
                                           max_calls=3), 20.0, 0)
    pol = make_interception("infercept", prof)
    sim = Simulator(tr, prof, pol, Spy(prof, pol))
    sim.run()
    assert None not in seen and max(seen) > 0 and max(seen) <= prof.kv_capacity_tokens


def test_the_job_horizon_counts_downstream_calls_without_a_tool_call():
    """A Semantic Variables call ends without a tool call, but the calls that
    wait for its output are known (the DAG): under the job horizon a call
    heading a long chain ranks behind a standalone one of the same size;
    the segment horizon (the paper's) sees them as equal."""
    prof = small_profile()

    def pair():
        return (Req("head", 0.0, SchedInfo(context_len=100, expected_output=10,
                                           future=((50, None, 30), (50, None, 30)))),
                Req("alone", 1.0, SchedInfo(context_len=100, expected_output=10)))
    job = LAMPS(prof, MinWaste(prof), horizon="job")
    assert [r.name for r in job.order(pair(), RankState(iteration_s=0.02))] == ["alone", "head"]
    seg = LAMPS(prof, MinWaste(prof), horizon="segment")
    assert [r.name for r in seg.order(pair(), RankState(iteration_s=0.02))] == ["head", "alone"]


def test_the_vllm_schedulers_ranking_gets_the_lamps_options():
    """engine: {kind: vllm} builds its ranking inside vLLM's engine core from
    additional_config: the two LAMPS options travel there too."""
    pytest.importorskip("vllm")
    from interlace.engine_ext.vllm.scheduler import build_ranking, interlace_config

    prof = small_profile()
    rk = build_ranking(interlace_config("lamps", prof, "infercept", horizon="segment", handling_at_call=True))
    assert rk.inner.horizon == "segment" and rk.inner.apply_at_call is True
    rk = build_ranking(interlace_config("lamps", prof, "infercept"))
    assert rk.inner.horizon == "job" and rk.inner.apply_at_call is False
