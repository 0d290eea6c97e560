"""``interlace bench apps`` with and without capacity regulation, and its
mixed run (bench/apps.py ``--capacity``, bench/mixed.py ``--mixed``).

The options reach the gateway's config (parsed by the gateway itself, so a
key the engine does not read would fail here), ``--capacity both`` gives
one row per setting of every variant, and the mixed run's smoke run (two
fresh gateways) reports chat p99 per setting.  The end-to-end runs use the
dense float32 weights: the as-shipped default takes several times longer to
load, and what is checked here is the harness, not the speed."""

from __future__ import annotations

import json
import random

import pytest

from interlace.bench import apps, mixed
from interlace.gateway.config import parse_config


def test_capacity_options_parse_and_reach_the_engine_policy():
    off, on = apps.capacity_settings("both", 512, None)
    assert (off.label, off.latency_tokens, on.label, on.latency_tokens) == ("off", None, "on", 512)
    assert [c.label for c in apps.capacity_settings("on")] == ["on"]
    assert apps.capacity_settings("on")[0].latency_tokens == apps.DEFAULT_LATENCY_CAP
    for bad in (("sometimes", None, None), ("on", 0, None), ("on", 2048, 1024)):
        with pytest.raises(apps.BenchError):
            apps.capacity_settings(*bad)
    with pytest.raises(apps.BenchError):
        apps.parse_weights("fp64")
    with pytest.raises(apps.BenchError):
        apps.parse_variants("b,c")
    assert apps.parse_variants("b, a-par") == ["b", "a-par"]

    def policy(capacity, **kw):
        cfg = apps.gateway_config(True, 4096, 256, capacity=capacity, **kw)
        return parse_config(cfg, "<test>").models[apps.MODEL]

    m = policy(off, weights="as-shipped", threads=1)
    assert m.policy.latency_capacity_tokens is None and m.policy.throughput_capacity_tokens is None
    assert m.engine_args["weights"] == "as-shipped"
    assert parse_config(apps.gateway_config(True, 4096, 256, threads=1), "<test>").threads == 1
    m = policy(apps.Capacity("on", 512, 4096))
    assert (m.policy.latency_capacity_tokens, m.policy.throughput_capacity_tokens) == (512, 4096)
    # the default run is the fastest configuration: as shipped, the gateway's threads, both settings
    args = apps.build_parser().parse_args([])
    assert (args.weights, args.threads, args.capacity) == ("as-shipped", 0, "both")
    margs = mixed.build_parser().parse_args([])
    assert (margs.weights, margs.capacity, margs.latency_cap) == ("as-shipped", "both", mixed.MIXED_LATENCY_CAP)


def test_bad_options_are_typed_errors(capsys):
    assert apps.main(["--latency-cap", "0", "--apps", "chain"]) == 2
    assert "--latency-cap" in capsys.readouterr().err
    assert apps.main(["--mixed", "--chats", "0"]) == 2  # dispatched to the mixed run, refused there
    assert "--chats" in capsys.readouterr().err
    assert apps.main(["--mixed", "--weights", "fp64"]) == 2
    with pytest.raises(SystemExit):
        apps.main(["--capacity", "sometimes"])


def test_run_order_alternates_the_settings():
    settings = apps.capacity_settings("both", 256)
    r0 = [(v, c.label) for v, c in apps.run_order(["a-seq", "b"], settings, 0)]
    r1 = [(v, c.label) for v, c in apps.run_order(["a-seq", "b"], settings, 1)]
    assert r0 == [("a-seq", "off"), ("a-seq", "on"), ("b", "off"), ("b", "on")]
    assert r1 == [("b", "on"), ("b", "off"), ("a-seq", "on"), ("a-seq", "off")]


def test_mixed_arrivals_and_percentiles():
    a = mixed.arrivals(200, 2.0, random.Random("x"))
    assert a == mixed.arrivals(200, 2.0, random.Random("x"))  # seeded: the same in every setting
    assert all(x < y for x, y in zip(a, a[1:]))
    assert 70 < a[-1] < 130  # 200 arrivals at 2/s: ~100 s
    assert mixed.percentile([], 99) is None
    assert mixed.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert mixed.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert mixed.percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_capacity_both_gives_a_row_per_setting(tmp_path, capsys):
    out = tmp_path / "apps.json"
    rc = apps.main(["--quick", "--apps", "mapreduce", "--variants", "b", "--capacity", "both", "--latency-cap", "64",
                    "--weights", "float32", "--chunks", "2", "--chunk-tokens", "32", "--output-tokens", "3",
                    "--delay-ms", "0", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    summ = res["summaries"]["mapreduce"]
    assert set(summ) == {"off", "on"}
    for label in ("off", "on"):
        assert set(summ[label]) == {"b"}
        s = summ[label]["b"]
        assert s["runs"] == 1 and not s["errors"] and s["e2e_s"] > 0 and s["prefill_tokens"] > 0, s
    assert {(r["variant"], r["capacity"]) for r in res["runs"]} == {("b", "off"), ("b", "on")}
    assert res["capacity"] == {"off": {"latency_tokens": None, "throughput_tokens": None},
                               "on": {"latency_tokens": 64, "throughput_tokens": None}}
    assert "; capacity off" in text and "; capacity on" in text
    assert "| " + " | ".join(apps.CAPACITY_COLUMNS) + " |" in text
    cmp = [ln for ln in text.splitlines() if ln.startswith("| b |") and ln.count("|") == len(apps.CAPACITY_COLUMNS) + 1]
    assert len(cmp) == 1, text
    assert "capacity off: target mapreduce" in text and "capacity on: target mapreduce" in text


def test_mixed_quick_reports_p99_per_setting(tmp_path, capsys):
    out = tmp_path / "mixed.json"
    rc = apps.main(["--mixed", "--quick", "--weights", "float32", "--latency-cap", "64", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    summ = res["summaries"]
    assert set(summ) == {"off", "on"}
    for label, s in summ.items():
        assert s["runs"] == 1 and not s["errors"], s
        assert s["chats"] == mixed.QUICK.chats
        assert 0 < s["p50_s"] <= s["p99_s"] <= s["max_s"]
        assert s["job_s"] > 0
        # the map calls are one task group (throughput), each chat latency-critical
        assert len(s["map_objective"]) == 1 and s["map_objective"][0].startswith("throughput/")
        assert s["chat_objective"] == ["latency"]
    assert summ["off"]["caps_seen"] == [0]
    assert 64 in summ["on"]["caps_seen"]  # the latency cap was in force while a chat ran
    rows = [ln for ln in text.splitlines() if ln.startswith("| off |") or ln.startswith("| on |")]
    assert len(rows) == 2 and all(ln.count("|") == len(mixed.COLUMNS) + 1 for ln in rows), text
    assert "regulation on vs off: chat p99" in text
