"""``interlace bench trace`` in the simulator: a tiny run prints a table with
every variant and the issue's comparisons; bad input exits 2 naming the
option.  (The native runner is exercised by tests/test_sim_validation.py.)
Smoke tests: the numbers are recorded in docs/benchmarks.md, not asserted."""

import json

import pytest

from interlace.bench import trace as bench_trace

TINY = ["--trace", "mixed", "--num-requests", "6", "--sim", "h100-gpt-j-6b", "--time-scale", "0.1"]


def test_sim_table_has_every_variant(capsys, tmp_path):
    out = tmp_path / "r.json"
    png = tmp_path / "p.png"
    assert bench_trace.main(TINY + ["--rates", "1,2", "--json", str(out), "--out-png", str(png)]) == 0
    text = capsys.readouterr().out
    for name in bench_trace.VARIANTS:
        assert f"| {name}" in text, name
    lamps = bench_trace.VARIANTS["lamps"].label
    assert f"| interlace (= lamps) | {lamps} |" in text  # the same configuration, said so
    assert "| vllm-old | vllm, fcfs, off |" in text
    assert "| lamps-segment | infercept, lamps (segment" in text
    assert "rate 1 req/s (online predictions)" in text and "rate 2 req/s" in text and "machine: " in text
    assert "[oracle" not in text  # online only, unless asked
    assert "interlace sustains" in text and "mean e2e lamps" in text
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"1.0", "2.0"}
    assert res["results"]["1.0"]["vllm-old"]["completed"] == 6
    assert res["same_as"]["interlace"] == "lamps"
    assert res["predictions"] == "online" and set(res["per_seed"]) == {"online"}
    assert png.stat().st_size > 0


def test_headline_names_vllm_with_prefix_cache_and_vllm_old_as_history(capsys):
    assert bench_trace.main(TINY + ["--rates", "1,2", "--variants", "vllm-old,vllm,interlace"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "interlace sustains" in ln]
    assert len(lines) == 6  # 2x, 4x, 10x the lowest p50; each against vllm, then vllm-old
    head = [ln for ln in lines if not ln.startswith("historical")]
    hist = [ln for ln in lines if ln.startswith("historical, not the headline: ")]
    assert len(head) == len(hist) == 3
    assert all("vllm (prefix cache: today's vLLM)" in ln and "vllm-old" not in ln for ln in head)
    assert all("vllm-old (no prefix cache" in ln for ln in hist)


def grid(rates, **p50s):
    """One seed's grid {rate: {variant: {"norm_latency_p50": ...}}} from per-variant curves."""
    return {r: {n: {"norm_latency_p50": ys[i]} for n, ys in p50s.items()} for i, r in enumerate(rates)}


def test_summary_lines_medians_and_spread_over_seeds():
    """Three seeds with known sustainable rates at 4x the lowest p50 (0.4 s/token):
    interlace 3.0, 3.333, 3.6; vllm 2.0, 2.4, 2.0 (ratios 1.5, 1.389, 1.8);
    vllm-old 1.333 each (ratios 2.25, 2.5, 2.7)."""
    rates = [1, 2, 4]
    old = [0.2, 0.8, 1.6]
    grids = [grid(rates, interlace=[0.1, 0.2, 0.6], vllm=[0.1, 0.4, 0.8], **{"vllm-old": old}),
             grid(rates, interlace=[0.1, 0.2, 0.5], vllm=[0.1, 0.3, 0.8], **{"vllm-old": old}),
             grid(rates, interlace=[0.1, 0.2, 0.45], vllm=[0.1, 0.4, 0.9], **{"vllm-old": old})]
    lines = bench_trace.summary_lines(rates, grids, ["vllm-old", "vllm", "interlace"])
    four = [ln for ln in lines if "<= 0.4 s/token (4x the lowest p50)" in ln]
    assert four[0] == ("p50 normalized latency <= 0.4 s/token (4x the lowest p50): interlace sustains "
                       "3.333 (3.000 to 3.600) req/s, vllm (prefix cache: today's vLLM) 2.000 (2.000 to 2.400) "
                       "req/s: 1.50x (1.39x to 1.80x); target >= 2x: missed")
    assert four[1].startswith("historical, not the headline: ") and "vllm-old" in four[1]
    assert four[1].endswith("1.333 (1.333 to 1.333) req/s: 2.50x (2.25x to 2.70x)")
    # lamps vs infercept+fcfs: cuts 20, 10, 30% (median 20), p99 ratios 1.2, 1.6, 1.4 (median 1.4): met
    e2e = [{5: {"lamps": {"e2e_mean": a, "e2e_p99": p}, "infercept": {"e2e_mean": 100.0, "e2e_p99": 100.0}}}
           for a, p in ((80.0, 120.0), (90.0, 160.0), (70.0, 140.0))]
    (line,) = bench_trace.summary_lines([5], e2e, ["infercept", "lamps"], label="upper bound (oracle): ")
    assert line == ("upper bound (oracle): rate 5: mean e2e lamps 80.00 s (70.00 s to 90.00 s) vs infercept+fcfs "
                    "100.00 s (100.00 s to 100.00 s): 20.0% (10.0% to 30.0%) lower; p99 e2e 1.40x (1.20x to 1.60x) "
                    "infercept's; target (>= 20% lower, p99 <= 1.5x): met")


def test_median_over_seeds():
    runs = [{"e2e_mean": 5.0, "handling": {"swap": 1, "discard": 4}, "notes": ["a"], "ttft_mean": None, "x": "s"},
            {"e2e_mean": 1.0, "handling": {"swap": 3, "discard": 0}, "notes": ["b", "a"], "ttft_mean": 2.0, "x": "s"},
            {"e2e_mean": 2.0, "handling": {"swap": 2, "discard": 1}, "notes": [], "ttft_mean": None, "x": "s"}]
    m = bench_trace.median_over_seeds(runs)
    assert m["e2e_mean"] == 2.0 and m["spread"]["e2e_mean"] == (1.0, 5.0) and m["seeds"] == 3
    assert m["handling"] == {"swap": 2, "discard": 1}
    assert m["notes"] == ["a", "b"] and m["x"] == "s"
    assert m["ttft_mean"] == 2.0  # the seeds that have one
    assert bench_trace.cell(m, "e2e_mean", 2) == "2.00 (1.00-5.00)"
    assert bench_trace.cell(bench_trace.median_over_seeds(runs[:1]), "e2e_mean", 2) == "5.00"


def test_seeds_each_run_and_the_median_reported(capsys):
    assert bench_trace.main(TINY + ["--rates", "2", "--variants", "infercept,lamps", "--seeds", "0,1,2",
                                    "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["seeds"] == [0, 1, 2]
    per = [res["per_seed"]["online"][s]["2.0"]["lamps"]["e2e_mean"] for s in ("0", "1", "2")]
    assert len(set(per)) == 3  # each seed draws its own trace and arrivals
    med = res["results"]["2.0"]["lamps"]
    assert med["e2e_mean"] == sorted(per)[1] and med["spread"]["e2e_mean"] == [min(per), max(per)]
    assert med["seeds"] == 3


def test_oracle_flags_reach_the_simulator(capsys, monkeypatch):
    """Online by default (the product's condition); --oracle the upper bound;
    --oracle-too both, the oracle rows printed beside the online ones."""
    from interlace.engine_ext.sim import simulator

    seen = []
    real = simulator.simulate

    def spy(*a, **kw):
        seen.append(kw["oracle"])
        return real(*a, **kw)
    monkeypatch.setattr(simulator, "simulate", spy)
    args = TINY + ["--rates", "1", "--variants", "infercept,lamps"]
    assert bench_trace.main(args) == 0
    assert seen == [False, False]
    assert bench_trace.main(args + ["--oracle"]) == 0
    assert seen[2:] == [True, True]
    capsys.readouterr()
    assert bench_trace.main(args + ["--oracle-too"]) == 0
    assert sorted(seen[4:]) == [False, False, True, True]
    text = capsys.readouterr().out
    assert "| lamps [oracle: upper bound] |" in text and "| lamps | " in text
    assert any(ln.startswith("rate 1: mean e2e lamps") for ln in text.splitlines())  # the headline: online
    assert any(ln.startswith("upper bound (oracle): rate 1: mean e2e lamps") for ln in text.splitlines())
    with pytest.raises(SystemExit):
        bench_trace.main(args + ["--oracle", "--oracle-too"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_ablation_prints_each_step_with_its_mechanism_over_seeds(capsys):
    assert bench_trace.main(TINY + ["--rates", "2", "--ablation", "--seeds", "0,1", "--json"]) == 0
    captured = capsys.readouterr()
    text, res = captured.err, json.loads(captured.out)
    assert "median over 2 seeds" in text
    assert ("| preserve / discard / swap | recomputed tokens | preemptions | swap blocks out / in |" in text)
    rows = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ")}
    for step, _ in bench_trace.ABLATION:
        assert step in rows
    # the counters are the runs' own (medians over seeds): vllm discards at every call, the heuristic never
    vllm, heur = res["results"]["2.0"]["vllm"], res["results"]["2.0"]["+ heuristic preserve"]
    assert vllm["handling"]["discard"] > 0 and vllm["handling"]["preserve"] == vllm["handling"]["swap"] == 0
    assert heur["handling"]["discard"] == 0 and heur["recomputed_tokens"] == 0 < vllm["recomputed_tokens"]
    d = vllm["handling"]
    assert f" | {d['preserve']:.0f} / {d['discard']:.0f} / {d['swap']:.0f} | {vllm['recomputed_tokens']:.0f} " \
        in rows["vllm"]
    assert set(res["per_seed"]["online"]) == {"0", "1"}


def test_json_to_stdout(capsys):
    assert bench_trace.main(TINY + ["--rates", "1", "--variants", "vllm,lamps", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["results"]["1.0"]) == {"vllm", "lamps"}


def test_unknown_variant_exits_2(capsys):
    assert bench_trace.main(TINY + ["--rates", "1", "--variants", "vllm,fastest"]) == 2
    err = capsys.readouterr().err
    assert "--variants: unknown variant 'fastest'" in err and "vllm-old" in err


def test_unknown_trace_and_bad_rates_exit_2(capsys, tmp_path):
    assert bench_trace.main(["--trace", "nosuch", "--rates", "1", "--sim", "h100-gpt-j-6b"]) == 2
    assert "--trace 'nosuch': no such file, and not a generator" in capsys.readouterr().err
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"r1": [{"prompt_tokens": 3, "completion_tokens": "x", "api_time": 0,
                                       "api_token_length": 0}]}))
    assert bench_trace.main(["--trace", str(bad), "--rates", "1", "--sim", "h100-gpt-j-6b"]) == 2
    err = capsys.readouterr().err
    assert "'r1'" in err and "completion_tokens" in err
    assert bench_trace.main(TINY + ["--rates", "1,-2"]) == 2
    assert "--rates" in capsys.readouterr().err
    assert bench_trace.main(TINY + ["--rates", "1", "--sim", "no-such-profile"]) == 2
    assert "--sim" in capsys.readouterr().err
    for bad_seeds in ("0,x", "1,1"):
        assert bench_trace.main(TINY + ["--rates", "1", "--seeds", bad_seeds]) == 2
        assert "--seeds" in capsys.readouterr().err


def test_sustainable_rate_interpolates():
    sr = bench_trace.sustainable_rate
    assert sr([1, 2, 4], [0.1, 0.2, 0.6], 0.4) == 3.0  # halfway between 0.2 at 2 and 0.6 at 4
    assert sr([1, 2, 4], [0.1, 0.2, 0.3], 0.4) == 4    # never crossed: the top rate (a lower bound)
    assert sr([1, 2, 4], [0.5, 0.6, 0.7], 0.4) is None  # missed even at the lowest rate


def test_kendall_tau_and_order_lines():
    kt = bench_trace.kendall_tau
    assert kt([1, 2, 3], [10, 20, 30]) == 1.0
    assert kt([1, 2, 3], [30, 20, 10]) == -1.0
    assert kt([1, 2, 3], [10, 30, 20]) == 1 / 3  # one of three pairs swapped
    native = {1.0: {"a": {"norm_latency_p50": 0.2, "e2e_mean": 5.0}, "b": {"norm_latency_p50": 0.1, "e2e_mean": 4.0}}}
    sim = {1.0: {"a": {"norm_latency_p50": 0.3, "e2e_mean": 3.0}, "b": {"norm_latency_p50": 0.15, "e2e_mean": 6.0}}}
    lines = bench_trace.order_lines([1.0], native, sim)
    p50 = next(ln for ln in lines if "p50" in ln)
    e2e = next(ln for ln in lines if "mean e2e" in ln)
    assert "native b < a | sim b < a; Kendall tau +1.00; sim/native a 1.50, b 1.50" in p50
    assert "native b < a | sim a < b; Kendall tau -1.00" in e2e
