"""Smoke test of ``interlace bench tools`` (partial tool execution, Conveyor's six workloads).

``--quick``: short recorded outputs, one run per mode, no warm-up.  Checks that
every workload runs in both modes through the gateway, that the numbers are
sane (partial execution really started tools while the model was decoding,
the invalid call was aborted early), and that nothing leaks: no tool worker
processes, no temporary files.
"""

import json
import tempfile
import time

import psutil
import pytest

from interlace.bench import tools as bench_tools


def _spawned_children():
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:  # tool workers (not mp's tracker)
            out.add(p.pid)
    return out


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Route every tempfile made by the benchmark (and the tools it starts) to an empty folder."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def test_bench_tools_quick(private_tmp, tmp_path, capsys):
    before = _spawned_children()
    out_json, png = tmp_path / "r.json", tmp_path / "p.png"
    t0 = time.time()
    assert bench_tools.main(["--quick", "--plot", str(png), "--json", str(out_json)]) == 0
    elapsed = time.time() - t0
    printed = capsys.readouterr().out
    assert "| workload |" in printed and "CodeGen" in printed

    data = json.loads(out_json.read_text())
    rows = {r["workload"]: r for r in data["workloads"]}
    assert set(rows) == {"CodeGen", "Search", "Planning", "Validation", "Database", "Calculator"}
    for name, r in rows.items():
        assert 0 < r["on_s"] < 60 and 0 < r["off_s"] < 60, name
        assert len(r["g_s"]) == r["rounds"] >= 1 and all(g > 0 for g in r["g_s"]), name
        if not r["validation"]:
            assert r["all_ok"], name                     # every tool call succeeded, in both modes
            assert r["g_final_s"] > 0 and r["tokens_on"] == r["tokens_off"], name  # same replay both ways
            assert r["l_best_s"] <= r["l_old_s"] and r["theoretical"] >= 0, name
    # OFF runs measured real tool time
    assert rows["Search"]["t_s"][0] >= 0.15                 # the emulated 0.2 s network delay
    assert rows["Planning"]["t_s"][0] >= 0.15
    # ON: the python tool ran statements while the code was still being decoded
    assert rows["CodeGen"]["statements_run_early"] >= 3
    # ON: search results were there before the round's decoding ended
    assert rows["Search"]["results_ready_before_round_end"] >= 1
    assert rows["Planning"]["results_ready_before_round_end"] >= 1
    # Validation: the bad 'location' aborts decoding of the call with partial execution only
    v = rows["Validation"]
    assert v["aborted_early"] and v["errors_off"]
    assert v["tokens_on"] < v["tokens_off"] and v["on_s"] < v["off_s"]
    # plot written; per-run records kept
    assert png.stat().st_size > 10_000
    assert {(r["workload"], r["partial"]) for r in data["runs"]} == {(w, m) for w in rows for m in (False, True)}
    assert elapsed < 120

    # no leaks: tool workers are gone, temporary files (corpus, sqlite db, search index, python scratch) removed
    deadline = time.time() + 5
    while _spawned_children() - before and time.time() < deadline:
        time.sleep(0.1)
    assert not (_spawned_children() - before)
    # (torch's own compile cache, torchinductor_<user>, is not ours)
    assert [p.name for p in private_tmp.iterdir() if not p.name.startswith("torchinductor")] == []
