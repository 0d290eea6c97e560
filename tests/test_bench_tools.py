"""``interlace bench tools``: the per-pair comparison against Conveyor's bound
(on synthetic timings with known answers), the OFF-parallelism check, the
in-process HTTP client, and a smoke run of every workload (``--quick``)
through the real gateway's HTTP API, checking that what it records is
consistent and that nothing leaks.
"""

import asyncio
import json
import re
import tempfile
import time

import psutil
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from interlace.bench import tools as bench_tools
from interlace.bench.asgi import HTTPStatusError, post_sse
from interlace.bench.pairs import Timing, concurrency, pair, summarize_pairs

# ----------------------------------------------------------------------- the bound, per pair

# OFF: two rounds (g 4 s + t 1 s, g 2 s + t 3 s), final round 1.5 s, and 0.2 s
# that is neither (request handling): L_off = 11.7 s.  The most partial
# execution can hide is min(4, 1) + min(2, 3) = 3 s, so L_best = 8.7 s.
OFF = Timing(latency_s=11.7, g=[4.0, 2.0], t=[1.0, 3.0], g_final=1.5)


def _on(latency_s, g=(4.0, 2.0), g_final=1.5):
    return Timing(latency_s=latency_s, g=list(g), t=[0.0, 1.0], g_final=g_final)


def test_pair_known_values():
    p = pair(OFF, _on(9.2))
    assert p.parts_s == pytest.approx(11.5) and p.other_s == pytest.approx(0.2)
    assert p.l_old_s == pytest.approx(11.7) and p.l_best_s == pytest.approx(8.7)
    assert p.max_saving_s == pytest.approx(3.0) and p.saved_s == pytest.approx(2.5)
    assert p.efficiency == pytest.approx(2.5 / 3.0)
    assert not p.below_bound
    assert p.improvement == pytest.approx(11.7 / 9.2 - 1)
    assert p.theoretical == pytest.approx(11.7 / 8.7 - 1)
    assert p.decode_ratio == pytest.approx(1.0)


def test_pair_below_the_bound_is_flagged_not_reported_above_100_percent():
    p = pair(OFF, _on(8.5, g=(3.5, 1.8)))  # faster than the bound allows: ON decoded faster
    assert p.below_bound and p.efficiency is None
    assert p.decode_ratio == pytest.approx((3.5 + 1.8 + 1.5) / 7.5)
    exactly = pair(OFF, _on(8.7))          # at the bound: 100%, not flagged
    assert not exactly.below_bound and exactly.efficiency == pytest.approx(1.0)


def test_pair_where_on_is_slower_reports_a_negative_efficiency():
    p = pair(OFF, _on(12.3))
    assert p.efficiency == pytest.approx(-0.6 / 3.0) and not p.below_bound


def test_nothing_to_hide_gives_no_efficiency():
    off = Timing(latency_s=4.0, g=[2.0], t=[0.001], g_final=1.99)  # a 1 ms calculator call
    p = pair(off, Timing(4.01, [2.0], [0.0], 2.0))
    assert p.efficiency is None and not p.below_bound and not p.hideable
    assert pair(OFF, _on(9.2)).hideable
    assert pair(off, Timing(3.95, [1.95], [0.0], 2.0)).below_bound  # noise below the bound is still flagged


def test_pair_rejects_mismatched_rounds():
    with pytest.raises(ValueError):
        pair(Timing(5.0, [1.0, 2.0], [1.0], 1.0), _on(4.0))


def test_summary_is_the_median_over_pairs_not_a_ratio_of_medians():
    # Three pairs on a machine whose speed drifts: each pair is compared with its own bound.
    offs = [Timing(10.0, [6.0], [3.0], 1.0), Timing(20.0, [12.0], [6.0], 2.0), Timing(14.0, [8.0], [5.0], 1.0)]
    ons = [Timing(8.0, [6.0], [1.0], 1.0), Timing(17.0, [12.0], [3.0], 2.0), Timing(8.5, [6.0], [1.0], 1.0)]
    pairs = [pair(a, b) for a, b in zip(offs, ons)]
    assert [p.efficiency for p in pairs[:2]] == pytest.approx([2 / 3, 0.5])
    assert pairs[2].below_bound and pairs[2].l_best_s == pytest.approx(9.0)  # 8.5 s < 14 - 5 s
    s = summarize_pairs(pairs)
    assert s["pairs"] == 3 and s["below_bound"] == 1
    assert s["efficiency"]["median"] == pytest.approx(((2 / 3) + 0.5) / 2)  # median of the two valid pairs
    assert s["efficiency"]["lo"] == pytest.approx(0.5) and s["efficiency"]["hi"] == pytest.approx(2 / 3)
    # the ratio of medians, what the old method reported, would say otherwise
    med = lambda xs: sorted(xs)[1]  # noqa: E731
    ratio_of_medians = (med([10.0, 20.0, 14.0]) - med([8.0, 17.0, 8.5])) / med([3.0, 6.0, 5.0])
    assert ratio_of_medians == pytest.approx(1.1) and s["efficiency"]["hi"] <= 1.0


def test_efficiency_cell_never_shows_more_than_100_percent():
    pairs = [pair(OFF, _on(x)) for x in (9.2, 8.1, 8.0, 9.0)]
    s = summarize_pairs(pairs)
    cell = bench_tools.efficiency_cell(s)
    assert s["below_bound"] == 2 and "2 of 4 pairs below L_best!" in cell
    assert all(int(v) <= 100 for v in re.findall(r"(\d+)%", cell))
    all_bad = bench_tools.efficiency_cell(summarize_pairs([pair(OFF, _on(7.0))]))
    assert all_bad == "n/a (all pairs below L_best!)"
    nothing = summarize_pairs([pair(Timing(4.0, [2.0], [0.001], 1.99), Timing(3.9, [1.9], [0.0], 2.0))])
    assert nothing["below_bound"] == 1 and bench_tools.efficiency_cell(nothing) == "n/a (nothing to hide)"


# ----------------------------------------------------------------------- rounds from the engine's marks


def test_rounds_from_marks():
    marks = [("token", 100.2, None), ("pause", 101.0, True), ("resume_call", 101.5, 5), ("resume", 101.6, 5),
             ("token", 101.8, None), ("finish", 102.0, True)]
    results = [{"finished_at": 101.3, "received_at": 101.4}, {"finished_at": 100.9, "received_at": 101.4}]
    g, t, g_final, round_tokens, round_ends = bench_tools.rounds(marks, results, 100.0)
    assert g == pytest.approx([1.0]) and t == pytest.approx([0.3]) and g_final == pytest.approx(0.4)
    assert round_tokens == [2, 2] and round_ends == pytest.approx([1.0])


# ----------------------------------------------------------------------- OFF runs tools in parallel


def _res(name, start, end, depends_on=None, started_at=0.0):
    args = {"step": 1, "depends_on": depends_on or []}
    return {"name": name, "started_at": started_at, "tool_started_at": start, "finished_at": end, "arguments": args}


def test_concurrency_of_independent_calls():
    pause = [5.0]
    parallel = [_res("search", 5.00, 5.71), _res("search", 5.001, 5.72), _res("calculator", 5.72, 5.73, [1, 2])]
    (c,) = concurrency(parallel, pause)
    assert c["tool"] == "search" and c["calls"] == 2 and c["concurrent"] and c["round"] == 0
    # one worker: both were asked for at once, the second waited for the first
    queued = [_res("search", 5.00, 5.71), _res("search", 5.001, 6.42)]
    (c,) = concurrency(queued, pause)
    assert c["intervals_overlap"] and not c["concurrent"]
    assert concurrency([_res("search", 5.0, 5.7), _res("search", 5.0, 5.7, [1])], pause) == []  # dependent step
    # calls of different rounds are not compared
    assert concurrency([_res("search", 1.0, 1.7, started_at=0.5), _res("search", 6.0, 6.7, started_at=5.5)],
                       pause) == []


# ----------------------------------------------------------------------- the in-process HTTP client


async def _events(request):
    async def gen():
        yield b'data: {"n": 1}\n\n'
        yield b'data: {"n": 2}\n\ndata: [DONE]\n\n'
    return StreamingResponse(gen(), media_type="text/event-stream")


async def _forbidden(request):
    return JSONResponse({"error": {"message": "no server tools for you"}}, status_code=403)


def test_post_sse_streams_events_and_raises_on_errors():
    app = Starlette(routes=[Route("/ok", _events, methods=["POST"]), Route("/no", _forbidden, methods=["POST"])])

    async def collect(path):
        return [ev async for _, ev in post_sse(app, path, {"x": 1})]

    assert asyncio.run(collect("/ok")) == [{"n": 1}, {"n": 2}, "[DONE]"]
    with pytest.raises(HTTPStatusError) as err:
        asyncio.run(collect("/no"))
    assert err.value.status == 403 and "no server tools" in str(err.value)


# ----------------------------------------------------------------------- smoke run through the gateway


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
    assert bench_tools.main(["--quick", "--plot", str(png), "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "| workload |" in printed and "CodeGen" in printed and "machine: " in printed

    data = json.loads(out_json.read_text())
    cpu = data["machine"]["cpu"]
    assert cpu["model_name"] and cpu["cpus"] >= 1 and (cpu["isa"] or cpu["isa_absent"])  # flags recorded
    assert "avx2" in printed or "no avx2" in printed or "flags unknown" in printed
    rows = {r["workload"]: r for r in data["workloads"]}
    assert set(rows) == {"CodeGen", "Search", "Planning", "Validation", "Database", "Calculator"}
    for name, r in rows.items():
        assert 0 < r["on_s"] < 300 and 0 < r["off_s"] < 300, name  # a hang detector (the VM is shared)
        assert len(r["g_s"]) == r["rounds"] >= 1 and all(g > 0 for g in r["g_s"]), name
        if r["validation"]:
            continue
        assert r["all_ok"], name                     # every tool call succeeded, in both modes
        assert r["g_final_s"] > 0 and r["tokens_on"] == r["tokens_off"], name  # same replay both ways
        (p,) = r["pairs"]
        # the pair's numbers hold together: the bound comes from the OFF run's own parts
        assert p["l_old_s"] == pytest.approx(p["off_s"]) and p["other_s"] >= 0, name
        assert p["l_old_s"] - p["l_best_s"] == pytest.approx(p["max_saving_s"]), name
        assert p["max_saving_s"] == pytest.approx(sum(min(g, t) for g, t in zip(r["g_s"], r["t_s"]))), name
        assert p["saved_s"] == pytest.approx(p["off_s"] - p["on_s"]), name
        assert p["below_bound"] == (p["on_s"] < p["l_best_s"]), name
        assert p["efficiency"] is None or (not p["below_bound"] and p["efficiency"] <= 1.0), name
        assert r["summary"]["below_bound"] == int(p["below_bound"]), name
    # OFF runs measured real tool time
    assert rows["Search"]["t_s"][0] >= 0.15                 # the emulated 0.2 s network delay
    assert rows["Planning"]["t_s"][0] >= 0.15
    # OFF ran Planning's two independent searches in parallel (as an ordinary executor would)
    par = rows["Planning"]["off_parallel"]
    assert par == {**par, "groups": 1, "concurrent": 1, "calls": 2, "tool": "search"}
    off_planning = next(r for r in data["runs"] if r["workload"] == "Planning" and not r["partial"])
    searches = [x for x in off_planning["results"] if x["name"] == "search"]
    assert abs(searches[0]["tool_started_at"] - searches[1]["tool_started_at"]) < 0.05
    assert max(x["tool_started_at"] for x in searches) < min(x["finished_at"] for x in searches)
    for run in data["runs"]:
        for x in run["results"]:
            assert x["started_at"] <= (x["tool_started_at"] or x["started_at"]) <= x["finished_at"] <= \
                x["received_at"], run["workload"]
            assert x["partial_execution"] == run["partial"] or not x["ok"], run["workload"]
            if not run["partial"] and x["ok"]:  # OFF: nothing starts before the arguments are complete
                assert x["tool_started_at"] >= x["arguments_done_at"] - 1e-3, run["workload"]
    # ON: the python tool ran statements while the code was still being decoded
    assert rows["CodeGen"]["statements_run_early"] >= 3
    # ON: search results were there before the round's decoding ended
    assert rows["Search"]["results_ready_before_round_end"] >= 1
    assert rows["Planning"]["results_ready_before_round_end"] >= 1
    # Validation: the bad 'location' aborts decoding of the call with partial execution only
    v = rows["Validation"]
    assert v["aborted_early"] and v["errors_off"]
    assert v["tokens_on"] < v["tokens_off"] and v["on_s"] < v["off_s"]
    # the printed table never claims more than 100% of the bound
    assert all(int(x) <= 100 for x in re.findall(r"(-?\d+)%", printed))
    # plot written; per-run records kept, paired
    assert png.stat().st_size > 10_000
    assert {(r["workload"], r["partial"], r["pair"]) for r in data["runs"]} == {
        (w, m, 0) for w in rows for m in (False, True)}

    # no leaks: tool workers are gone, temporary files (corpus, sqlite db, search index, python scratch) removed
    deadline = time.time() + 5
    while _spawned_children() - before and time.time() < deadline:
        time.sleep(0.1)
    assert not (_spawned_children() - before)
    # (torch's own compile cache, torchinductor_<user>, is not ours)
    assert [p.name for p in private_tmp.iterdir() if not p.name.startswith("torchinductor")] == []
