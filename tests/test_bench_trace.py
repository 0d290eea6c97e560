"""``interlace bench trace`` in the simulator: a tiny run prints a table with
every variant and the issue's comparisons; bad input exits 2 naming the
option.  (The native runner is exercised by tests/test_sim_validation.py.)
Smoke tests: the numbers are recorded in docs/benchmarks.md, not asserted."""

import json

from interlace.bench import trace as bench_trace

TINY = ["--trace", "mixed", "--num-requests", "6", "--sim", "h100-gpt-j-6b", "--time-scale", "0.1"]


def test_sim_table_has_every_variant(capsys, tmp_path):
    out = tmp_path / "r.json"
    png = tmp_path / "p.png"
    assert bench_trace.main(TINY + ["--rates", "1,2", "--json", str(out), "--out-png", str(png)]) == 0
    text = capsys.readouterr().out
    for name in bench_trace.VARIANTS:
        assert f"| {name}" in text, name
    assert "| interlace (= lamps) | infercept, lamps, on |" in text  # the same triple, said so
    assert "| vllm-old | vllm, fcfs, off |" in text
    assert "rate 1 req/s" in text and "rate 2 req/s" in text and "machine: " in text
    assert "interlace sustains" in text and "mean e2e lamps" in text
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"1.0", "2.0"}
    assert res["results"]["1.0"]["vllm-old"]["completed"] == 6
    assert res["same_as"] == {"interlace": "lamps"}
    assert png.stat().st_size > 0


def test_ablation_prints_each_step(capsys):
    assert bench_trace.main(TINY + ["--rates", "2", "--ablation"]) == 0
    text = capsys.readouterr().out
    for step, _ in bench_trace.ABLATION:
        assert f"| {step} |" in text


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
