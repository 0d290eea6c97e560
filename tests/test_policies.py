"""The torch-free policies: InferCept's waste equations and min-waste choice,
LAMPS' ranking and starvation prevention, the predictors and the cost model."""

import json
import sys
from dataclasses import dataclass

import pytest

from interlace.engine_ext.policies import (
    BUILTIN_PROFILES, FCFS, LAMPS, SJF, BatchState, Fixed, Handling, InterceptedContext, MinWaste, OutputLengths,
    Profile, ProfileError, RankState, SchedInfo, SJFTotal, ToolDurations, make_interception, make_ranking,
    roofline, unit_profile)
from interlace.engine_ext.policies.costmodel import SHAPES, fit_piecewise
from interlace.engine_ext.policies.interception import (
    recompute_chunks, swap_iterations, waste_chunked_discard, waste_discard, waste_preserve, waste_swap)


def linear_profile(**kw):
    """t_fwd(n) = 0.01 s up to 100 tokens, then +0.0001 s per token; a block
    (4 tokens) swaps in 1 ms one way; S = 100."""
    base = dict(model="toy", device="toy", source="derived (test)", block_size=4, kv_bytes_per_token=1000,
                kv_capacity_tokens=4000, max_batched_tokens=1000, fwd_tokens=(1, 100, 1000),
                fwd_seconds=(0.01, 0.01, 0.1), fwd_s_per_context_token=0.0, swap_s_per_block=0.001,
                saturation_tokens=100)
    base.update(kw)
    return Profile(**base)


# ------------------------------------------------------------------ cost model
def test_profile_interpolates_and_extrapolates():
    p = linear_profile(fwd_s_per_context_token=1e-5)
    assert p.t_fwd(1) == pytest.approx(0.01)
    assert p.t_fwd(550) == pytest.approx(0.055)       # between 100 and 1000
    assert p.t_fwd(2000) == pytest.approx(0.2)        # past the last point: the last slope
    assert p.t_fwd(1, context_tokens=1000) == pytest.approx(0.02)
    assert p.t_swap(5) == pytest.approx(0.002)        # two blocks
    assert p.swap_limit_tokens(0.0105) == 40          # 10 whole blocks hide behind 10.5 ms
    assert p.recompute_chunk(30) == 70                # S minus the decodes


def test_profile_round_trip_and_errors(tmp_path):
    p = linear_profile()
    f = tmp_path / "p.json"
    p.save(f)
    assert Profile.load(f) == p
    bad = p.to_dict()
    bad["fwd_tokens"] = [10, 5, 20]
    f.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match="ascending"):
        Profile.load(f)
    f.write_text(json.dumps({**p.to_dict(), "warp": 9}))
    with pytest.raises(ProfileError, match="unknown fields.*warp"):
        Profile.load(f)
    d = p.to_dict()
    del d["swap_s_per_block"]
    f.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="missing fields.*swap_s_per_block"):
        Profile.load(f)
    f.write_text("{not json")
    with pytest.raises(ProfileError, match=str(f.name)):
        Profile.load(f)
    with pytest.raises(ProfileError, match="no such file"):
        Profile.load(tmp_path / "absent.json")


def test_roofline_profiles_are_labelled_derived_and_consistent():
    for name, build in BUILTIN_PROFILES.items():
        p = build()
        if not name.startswith("h100-"):
            continue  # measured ones: the next test
        assert p.source.startswith("derived"), name
        # below S an iteration is memory bound (flat), past it compute bound (linear)
        assert p.t_fwd(1) == pytest.approx(p.t_fwd(p.saturation_tokens), rel=0.01)
        assert p.t_fwd(4 * p.saturation_tokens) > 3 * (p.t_fwd(p.saturation_tokens) - 0.002)
    gptj = roofline(SHAPES["gpt-j-6b"])
    assert gptj.kv_bytes_per_token == 2 * 28 * 16 * 256 * 2     # K and V, 28 layers, 16 heads of 256, bf16
    assert 150 < gptj.saturation_tokens < 400                    # ~ FLOP/s / byte/s of an H100
    llama = roofline(SHAPES["llama-3-8b"])
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2     # GQA: 8 KV heads
    assert llama.kv_capacity_tokens > gptj.kv_capacity_tokens


def test_the_measured_h200_profile_is_labelled_measured_and_loads_from_the_package():
    p = BUILTIN_PROFILES["h200-llama-3-8b"]()
    assert p.source == "measured" and p.device == "NVIDIA H200"
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2          # the Llama-3-8B shape in bfloat16
    # decode steps replay graphs: a step of 1-16 rows reads the 16 GB of weights once (~4.7 ms at ~3.4 TB/s)
    assert 0.004 < p.t_fwd(1) < 0.006 and p.t_fwd(16) < 1.1 * p.t_fwd(1)
    assert p.t_fwd(2048) > 5 * p.t_fwd(1)


def test_fit_piecewise_takes_medians_and_is_monotone():
    xs, ys = fit_piecewise([(1, 1.0), (1, 3.0), (1, 2.0), (8, 1.5), (4, 2.5)])
    assert xs == (1, 4, 8) and ys == (2.0, 2.5, 2.5)


# ------------------------------------------------------------------ equations
def test_waste_equations_hand_computed():
    p = linear_profile()
    # eq. 2: 3 s call, 200 tokens
    assert waste_preserve(200, 3.0) == 600.0
    # eq. 1: T_fwd(200) = 0.01 + 100 * 0.0001 = 0.02 s; (200 + 1000) * 0.02
    assert waste_discard(200, 1000, p) == pytest.approx(24.0)
    # eq. 4: chunks of S - decodes = 100 - 20 = 80 tokens -> n = 3 chunks of 67 tokens; each chunk's *added*
    # iteration time beside the 20 decodes is T(87) - T(20) = 0 (flat below S): only the first term is left
    assert recompute_chunks(200, p, decode_tokens=20) == 3
    assert waste_chunked_discard(200, 1000, p, decode_tokens=20) == pytest.approx(0.02 * 200 / 2)
    # past S a chunk adds time: 380 tokens beside 20 decodes cost T(400) - T(20) = 0.04 - 0.01 s
    big = linear_profile(saturation_tokens=400)
    assert recompute_chunks(200, big, decode_tokens=20) == 1
    assert waste_chunked_discard(200, 1000, big, decode_tokens=20) == pytest.approx(
        0.02 * 200 / 2 + 1 * (big.t_fwd(220) - big.t_fwd(20)) * 1000)
    # eq. 3: 200 tokens = 50 blocks = 50 ms each way, the whole batch of 1200 tokens waits twice
    assert waste_swap(200, 1200, p) == pytest.approx(2 * 0.05 * 1200)
    # a budgeted swap of 200 tokens behind 10 ms iterations: 40 tokens per iteration -> 5 iterations
    assert swap_iterations(200, p, 0.01) == 5
    assert swap_iterations(200, p, 0.01, backlog_tokens=40) == 6


def test_min_waste_choice_follows_equation_5():
    p = linear_profile()
    pol = MinWaste(p, swap=False)
    batch = BatchState(context_tokens=1000, decode_tokens=20, batched_tokens=20)
    # discard costs 2 token-seconds for 200 tokens (eq. 4: chunks under S add no time); preserve 200 * T
    assert pol.decide(InterceptedContext(200, expected_duration_s=0.005, id="a"), batch) is Handling.PRESERVE
    assert pol.decide(InterceptedContext(200, expected_duration_s=0.02, id="b"), batch) is Handling.DISCARD
    # unchunked recomputation (eq. 1, 24 token-seconds) moves the break-even to 0.12 s
    unchunked = MinWaste(p, swap=False)
    unchunked.chunked_recompute = False
    assert unchunked.decide(InterceptedContext(200, expected_duration_s=0.1, id="a"), batch) is Handling.PRESERVE
    assert unchunked.decide(InterceptedContext(200, expected_duration_s=0.2, id="b"), batch) is Handling.DISCARD
    # no hint, no history: InferCept's dynamic estimate t_now - t_call
    ctx = InterceptedContext(200, tool="search", id="c", call_time=100.0)
    assert pol.decide(ctx, batch, now=100.005) is Handling.PRESERVE
    assert pol.decide(ctx, batch, now=101.0) is Handling.DISCARD
    # learned durations replace the missing hint; outliving them raises the estimate
    pol.durations.observe("search", 0.05)
    assert pol.expected_duration(ctx, now=100.01) == pytest.approx(0.05)
    assert pol.expected_duration(ctx, now=102.0) == pytest.approx(2.0)


def test_swap_budget_goes_to_the_most_wasteful_first():
    p = linear_profile()
    pol = MinWaste(p)
    batch = BatchState(context_tokens=1000, decode_tokens=20, batched_tokens=20)   # 10 ms iterations, 40 tok/it
    big = InterceptedContext(400, expected_duration_s=0.25, id="big")     # out + in: 10 + 10 its = 0.2 s <= 0.25
    small = InterceptedContext(40, expected_duration_s=0.1, id="small")   # behind big's 400: 11 + 1 its > 0.1 s
    plan = pol.plan([small, big], batch)
    assert plan == {"big": Handling.SWAP, "small": Handling.DISCARD}   # eq. 5: discard 0.2 < preserve 4 token-s
    # alone, the small one fits the budget
    assert pol.plan([small], batch) == {"small": Handling.SWAP}
    # a short call never swaps: it could not be back in time
    # (eq. 5 then: preserve 400 * 0.01 = 4 < chunked discard T(400) * 400 / 2 = 8 token-seconds)
    assert pol.decide(InterceptedContext(400, expected_duration_s=0.01, id="x"), batch) is Handling.PRESERVE


def test_interception_names_and_errors():
    p = linear_profile()
    assert make_interception("vllm", p).keeps_arrival is False
    assert make_interception("discard", p).keeps_arrival is True
    assert make_interception("discard", p).chunked_recompute is False
    assert make_interception("discard-chunked", p).chunked_recompute is True
    assert make_interception("swap-sync", p).budgeted_swap is False
    assert make_interception("infercept", p).name == "infercept"
    with pytest.raises(ValueError, match="unknown interception policy 'keep'.*infercept"):
        make_interception("keep", p)
    with pytest.raises(ValueError, match="needs a profile"):
        make_interception("infercept", None)
    assert Fixed({"r1": Handling.SWAP}).decide(InterceptedContext(5, id="r1")) is Handling.SWAP


# -------------------------------------------------------------------- ranking
@dataclass(eq=False)
class Req:
    arrival: float
    sched: SchedInfo


def lamps_example():
    """LAMPS Table 1: outputs 6/2/3 tokens, calls after 5/1/2 tokens lasting 2/7/1 iterations."""
    return [Req(0.0, SchedInfo(0, 0, 5, "r1", 2.0, Handling.PRESERVE)),
            Req(0.1, SchedInfo(0, 0, 1, "r2", 7.0, Handling.DISCARD)),
            Req(0.2, SchedInfo(0, 0, 2, "r3", 1.0, Handling.SWAP))]


def names(order, reqs):
    return [reqs.index(r) + 1 for r in order]


def test_rankings_order_the_lamps_example_as_the_paper():
    reqs = lamps_example()
    u = unit_profile(kv_capacity_tokens=6)
    assert names(FCFS().order(reqs), reqs) == [1, 2, 3]
    assert names(SJF().order(reqs), reqs) == [2, 3, 1]
    assert names(SJFTotal().order(reqs, RankState(iteration_s=1.0)), reqs) == [3, 1, 2]
    assert names(LAMPS(u).order(reqs, RankState()), reqs) == [3, 2, 1]


def test_lamps_predicts_the_handling_when_not_given():
    p = linear_profile()
    pol = MinWaste(p, swap=False)
    lamps = LAMPS(p, pol)
    short = Req(0.0, SchedInfo(100, 0, 10, "calc", 0.001))   # preserve is nearly free
    long_ = Req(0.0, SchedInfo(100, 0, 10, "human", 30.0))   # preserving would hold 110 tokens for 30 s
    state = RankState(iteration_s=0.01, batch_context_tokens=1000)
    assert lamps.predicted_handling(short, 110, 0.001, BatchState(1000)) is Handling.PRESERVE
    assert lamps.predicted_handling(long_, 110, 30.0, BatchState(1000)) is Handling.DISCARD
    # the long call is discarded, so it costs a recomputation, not 30 s of memory
    assert lamps.score(long_, state) < 110 * 30.0 / 0.01


def test_starvation_prevention_fires_at_the_threshold():
    u = unit_profile(kv_capacity_tokens=100)
    lamps = LAMPS(u, starvation_threshold=3)
    big = Req(0.0, SchedInfo(50, 0, 40))
    # a stream of short requests, one new each iteration, each served at once
    for it in range(3):
        small = Req(1.0 + it, SchedInfo(1, 0, 1))
        order = lamps.order([big, small], RankState(iteration=it))
        assert order[0] is small
        assert big.sched.starving is (it == 3)
        lamps.observe([small], [big])
    assert big.sched.starving                        # passed over 3 times
    small = Req(9.0, SchedInfo(1, 0, 1))
    assert lamps.order([big, small], RankState(iteration=3))[0] is big   # now at the head ...
    lamps.observe([small], [big])
    assert lamps.order([big, small], RankState(iteration=4))[0] is big   # ... until it completes
    # a request that is served restarts its count
    other = Req(9.0, SchedInfo(50, 0, 40))
    lamps.observe([], [other])
    lamps.observe([other], [])
    assert other.sched.starvation == 0
    with pytest.raises(ValueError, match="starvation_threshold"):
        LAMPS(u, starvation_threshold=0)


def test_selective_score_refresh():
    u = unit_profile(kv_capacity_tokens=100)
    lamps = LAMPS(u, refresh_interval=10)
    r = Req(0.0, SchedInfo(10, 0, 5))
    s0 = lamps.key(r, RankState(iteration=0))
    r.sched.context_len = 50
    assert lamps.key(r, RankState(iteration=5)) == s0      # cached
    assert lamps.key(r, RankState(iteration=10)) > s0      # refreshed
    r.sched.context_len = 10
    LAMPS.on_interception(r)                               # a new segment rescoring at once
    assert lamps.key(r, RankState(iteration=11)) == s0


def test_ranking_names_and_errors():
    u = unit_profile()
    assert isinstance(make_ranking("lamps", u), LAMPS)
    assert isinstance(make_ranking("sjf-total"), SJFTotal)
    with pytest.raises(ValueError, match="unknown ranking 'edf'.*lamps"):
        make_ranking("edf", u)
    with pytest.raises(ValueError, match="needs a profile"):
        make_ranking("lamps")


# ----------------------------------------------------------------- predictors
def test_tool_durations_learn_online_and_ignore_garbage():
    d = ToolDurations(window=4)
    assert d.estimate("search") is None
    for s in (1.0, 3.0):
        d.observe("search", s)
    assert d.estimate("search") == pytest.approx(2.0)
    d.observe("search", float("nan"))
    d.observe("search", -1.0)
    assert d.estimate("search") == pytest.approx(2.0)
    for _ in range(20):  # follows a drift within its window
        d.observe("search", 10.0)
    assert d.estimate("search") == pytest.approx(10.0, rel=0.01)


def test_output_lengths_by_app_and_bucket():
    o = OutputLengths()
    assert o.estimate("agent", 100) is None
    o.observe("agent", 100, 40)
    o.observe("agent", 1000, 400)
    assert o.estimate("agent", 120) == 40       # same power-of-two bucket as 100
    assert o.estimate("agent", 900) == 400
    assert o.estimate("agent", 5) == 220        # unseen bucket: the application's mean
    assert o.estimate("chat", 100) is None


def test_policies_do_not_import_torch():
    import subprocess
    code = ("import sys, interlace.engine_ext.policies; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
