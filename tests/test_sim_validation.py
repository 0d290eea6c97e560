"""The simulator predicts the native engine: a profile of the embedded model
measured on this machine (``profiler.measure_profile``), a small trace of
tool-calling requests run on the real engine (forced decoding, real waits)
and in the simulator under the same policies; the simulator's mean
normalized latency must be within 20% of the engine's (6-12% on a quiet
machine; the bound leaves room for a loaded one).

Why it can hold on a noisy 2-core VM: both sides run the same scheduler
rules, so they take the same number of iterations (checked: a structural
check, not a timed one); what is left is the time per iteration, which the
profile measures on this machine minutes (not hours) before.  The engine
runs on one torch thread for the test (profile and trace alike): with two
threads, one busy neighbour on the other core stalls every OpenMP barrier
and steps take 10x longer at random, which no profile can predict.
"""

import random

import pytest
import torch

from interlace.bench import trace as bench_trace
from interlace.engine_ext.sim.traces import Segment, Trace, TraceRequest, with_poisson_arrivals

KV_TOKENS = 4096
STEP_TOKENS = 512


def validation_trace(n: int = 8, seed: int = 3, rate: float = 2.0) -> Trace:
    """``n`` requests with one tool call each: prompts of 32-96 tokens, 8-16
    decoded tokens per segment, 0.2-0.8 s calls returning 8-24 tokens;
    Poisson arrivals at ``rate`` (about 8 s of wall time in all)."""
    rng = random.Random(seed)
    reqs = [TraceRequest(str(i), [Segment(rng.randint(32, 96), rng.randint(8, 16), round(rng.uniform(0.2, 0.8), 2),
                                          rng.randint(8, 24)),
                                  Segment(0, rng.randint(8, 16))], 0.0, "tool") for i in range(n)]
    return with_poisson_arrivals(Trace(reqs), rate, seed)


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def measure_once(model, tok):
    """Profile the engine, run the trace on it and in the simulator.
    Returns (native metrics, simulated metrics, profile)."""
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.native.profiler import measure_profile

    eng = NativeEngine(model, tok, kv_cache_tokens=KV_TOKENS, max_batched_tokens=STEP_TOKENS)
    try:
        profile = measure_profile(eng, quick=True)
    finally:
        eng.close()
    assert profile.kv_capacity_tokens == KV_TOKENS and profile.max_batched_tokens == STEP_TOKENS
    trace = validation_trace()
    variant = bench_trace.Variant("preserve", "fcfs", True)
    native = bench_trace.run_native_variant(model, tok, trace, variant, profile, kv_cache_tokens=KV_TOKENS,
                                            max_batched_tokens=STEP_TOKENS, time_scale=1.0, seed=0)
    sim = bench_trace.run_sim_variant(trace, profile, variant)
    assert native["completed"] == sim["completed"] == len(trace)
    assert native["leaked_blocks"] == 0
    return native, sim, profile


def test_simulator_within_20_percent_of_native_engine(one_thread):
    """Within 20%, measured twice at most: a neighbour's burst on a shared
    2-core machine can slow one run's steps against the profile measured
    seconds before it (the profile and the run are then re-measured
    together); a systematic error fails both.  Measured 2026-11-23:
    sim/native 0.88-0.94 in 7 runs (docs/benchmarks.md)."""
    model, tok, _ = bench_trace.load_native_model(None)
    misses = []
    for _ in range(2):
        native, sim, profile = measure_once(model, tok)
        n, s = native["norm_latency_mean"], sim["norm_latency_mean"]
        steps = native["engine_stats"]["steps"]
        print(f"sim/native mean normalized latency {s:.4f}/{n:.4f} = {s / n:.3f}; steps {steps} / {sim['iterations']}")
        # the step count too is a measurement of a timed trace (a slow step lets more arrivals join
        # the next one): a miss retried, as the latency is (seen once in a full-suite run: 41 vs 47).
        # Bounds that hold on a loaded machine (a clean-clone run beside a simulator sweep: -16.9% with
        # 50/49 steps, then -2.6% with 50/43): within 20% and 15% of the steps; quiet, it is 6-12%.
        if abs(s - n) <= 0.20 * n and abs(sim["iterations"] - steps) <= max(3, (15 * steps) // 100):
            return
        misses.append(f"simulated mean normalized latency {s:.4f} s/token vs native {n:.4f} "
                      f"({100 * (s / n - 1):+.1f}%); native {steps} steps, "
                      f"{native['engine_stats'].get('forward_s', 0):.2f} s forward; simulated {sim['iterations']} "
                      f"iterations, profile {profile.fwd_tokens} -> {profile.fwd_seconds}")
    pytest.fail("; then ".join(misses))


PRESSURE_KV = 256        # tokens: the trace's contexts add up to ~3.5x that (evictions, swaps, discards, re-ranking)
PRESSURE_VARIANTS = ("vllm", "infercept", "lamps")


def pressure_trace():
    """8 requests of the mixed trace scaled to 128-token contexts, call times
    x0.05, Poisson at 2 req/s: a KV cache of ``PRESSURE_KV`` tokens holds
    about two of them."""
    from interlace.engine_ext.sim import traces

    base = traces.scale_trace(traces.generate("mixed", 8, 0), max_context=128, max_calls=2, time_scale=0.05)
    return traces.with_poisson_arrivals(base, 2.0, 0)


def test_simulator_follows_the_engine_under_memory_pressure(one_thread):
    """The same trace on the native engine and in the simulator with a KV
    cache far under the peak demand, per variant: both complete it without
    leaks, the mechanisms really run on both (vLLM discards and recomputes;
    InferCept and LAMPS swap or discard), and they take about the same
    number of iterations (within 20%) and recompute about as many tokens
    (within 2x; structural checks: the same scheduling rules).
    The timing ratio and the order of the variants are printed, not asserted:
    they move with a shared machine's load (docs/benchmarks.md has the runs
    on a quiet machine, where sim/native is within 0.75-1.33 for these;
    measured 2026-11-27 at load 3.6: 1.11 / 0.97 / 1.23, iterations and
    recomputed tokens within 7% and 25%)."""
    model, tok, _ = bench_trace.load_native_model(None)
    profile = bench_trace.measure_native_profile(model, tok, PRESSURE_KV, STEP_TOKENS)
    trace = pressure_trace()
    final_contexts = sum(s.prompt_tokens + s.completion_tokens + s.api_token_length
                         for r in trace.requests for s in r.segments)
    assert final_contexts > 3 * PRESSURE_KV
    got = {}
    for name in PRESSURE_VARIANTS:
        v = bench_trace.VARIANTS[name]
        sim = bench_trace.run_sim_variant(trace, profile, v)
        native = bench_trace.run_native_variant(model, tok, trace, v, profile, kv_cache_tokens=PRESSURE_KV,
                                                max_batched_tokens=STEP_TOKENS, time_scale=1.0, seed=0)
        got[name] = native, sim
        assert native["completed"] == sim["completed"] == len(trace), name
        assert native["leaked_blocks"] == 0, name
        steps = native["engine_stats"]["steps"]
        print(f"{name}: sim/native mean e2e {sim['e2e_mean']:.2f}/{native['e2e_mean']:.2f} = "
              f"{sim['e2e_mean'] / native['e2e_mean']:.2f}; iterations {sim['iterations']} / {steps}; "
              f"handlings sim {sim['handling']} native {native['handling']}; recomputed tokens "
              f"{sim['recomputed_tokens']} / {native['recomputed_tokens']}; swapped blocks "
              f"{sim['swap_out_blocks']} / {native['swap_out_blocks']}")
        for side, m in (("native", native), ("sim", sim)):
            h = m["handling"]
            if name == "vllm":
                assert h["discard"] > 0 and m["recomputed_tokens"] > 0, (side, name, m)
            else:
                assert h["swap"] + h["discard"] > 0, (side, name, h)
            # (the engine may give a swap-in up to recomputation when nothing else runs: fewer come back)
            assert m["swap_in_blocks"] <= m["swap_out_blocks"], (side, name, m)
        assert abs(sim["iterations"] - steps) <= 0.2 * steps, (name, sim["iterations"], steps)
        # the same admission and preemption rules: about the same recomputation (when the engine let
        # a newcomer preempt running prefills it recomputed ~3x the simulator's tokens: 874 vs 270)
        # A discard decided differently (the handling weighs the tool's measured wall-clock time, which a
        # loaded machine stretches) recomputes that context: a clean-clone run on a busy machine discarded
        # once where the simulator did not, 799 recomputed tokens against 322 (221 when run alone).  Only
        # then is the bound 3x: with the same discards the engine must stay within 2x.
        rec = sorted((sim["recomputed_tokens"], native["recomputed_tokens"]))
        slack = 2 if native["handling"]["discard"] == sim["handling"]["discard"] else 3
        assert rec[1] <= slack * rec[0] + 64, (name, "recomputed tokens sim / native", sim["recomputed_tokens"],
                                               native["recomputed_tokens"], native["handling"], sim["handling"])
    key = "e2e_mean"
    tau = bench_trace.kendall_tau([got[n][0][key] for n in PRESSURE_VARIANTS],
                                  [got[n][1][key] for n in PRESSURE_VARIANTS])
    print(f"Kendall tau (mean e2e, native vs sim): {tau:+.2f}")
