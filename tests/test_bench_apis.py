"""``interlace bench apis`` (bench/api_jobs.py): a tiny run of every variant's client
through real gateways (the native engine with the embedded model, in process) --
the forced replies streamed back on each API, the same prompt tokens as the chat
path's plan, the follow-ups' cached tokens where a context is kept and not where
none is -- and the report's fields, ratios and table on known records."""

from __future__ import annotations

import asyncio
import copy

import pytest

from interlace.bench import agent_jobs as aj
from interlace.bench import api_jobs as bench
from interlace.engine_ext.embedded import embedded_model_dir
from interlace.engine_ext.tokenizer import Tokenizer
from interlace.parsers.formats import HERMES

from helpers.gateway_server import LiveGateway

SMALL = aj.Workload(jobs=2, turns=(3, 3), tool_s=1.0, tool_sigma=0.5, result_tokens=(10, 20), arrival_s=0.2)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_model_dir(str(embedded_model_dir()), needed_by="tests")


@pytest.fixture(scope="module")
def kept():
    with LiveGateway(bench.gateway_config("chat", 8192, "fcfs", {})) as gw:
        yield gw


@pytest.fixture(scope="module")
def not_kept():
    with LiveGateway(bench.gateway_config(bench.BASELINE, 8192, "fcfs", {})) as gw:
        yield gw


def _run(variant, gw, jobs):
    return asyncio.run(bench.run_variant(variant, gw.url, jobs, time_scale=0.01))


@pytest.mark.parametrize("variant", ["chat", "responses-prev", "responses-full", "messages"])
def test_each_api_replays_the_plan_and_its_follow_ups_adopt_the_kept_context(variant, kept, tok):
    jobs = aj.build_jobs(tok, HERMES, SMALL, seed=11 + bench.VARIANTS.index(variant))  # texts of its own
    records, wall = _run(variant, kept, jobs)  # run_jobs checks each turn's prompt/completion tokens
    by = {(r.job, r.turn): r for r in records}
    for j in jobs:
        for k in range(1, 3):
            prev = j.turns[k - 1]
            # the kept context served the follow-up: at least the previous prompt and reply were not prefilled
            assert by[j.index, k].cached_tokens >= len(prev.prompt_ids) + len(prev.out_ids) - 1, (variant, j.index, k)
    run = bench.summarize_run(records, jobs, 0.01, wall)
    assert run["turns"] == 6 and run["prompt_tokens"] == sum(len(t.prompt_ids) for j in jobs for t in j.turns)
    assert run["prefilled_mean"] < 0.2 * (run["prefilled_mean"] + run["cached_mean"])


def test_without_retention_a_follow_up_prefills_its_tail(not_kept, tok):
    jobs = aj.build_jobs(tok, HERMES, SMALL, seed=21)
    records, wall = _run(bench.BASELINE, not_kept, jobs)
    run = bench.summarize_run(records, jobs, 0.01, wall)
    # the prefix cache keeps whole blocks of the earlier prompt at most: the reply and the result are prefilled
    by = {(r.job, r.turn): r for r in records}
    for j in jobs:
        for k in range(1, 3):
            r, prev = by[j.index, k], j.turns[k - 1]
            assert r.cached_tokens < len(prev.prompt_ids) + len(prev.out_ids) - 1
    assert run["prefilled_mean"] > 0


@pytest.mark.parametrize("variant", ["responses-prev", "responses-full", "messages"])
def test_a_reply_other_than_the_forced_one_fails_the_run(variant, kept, tok):
    jobs = aj.build_jobs(tok, HERMES, aj.Workload(1, (2, 2), 1.0, 0.0, (10, 10), 0.0), seed=31)
    wrong = copy.deepcopy(jobs)
    wrong[0].turns[0].call["arguments"] = {"path": "not/what/was/forced.py"}
    with pytest.raises(aj.Mismatch, match="not the forced reply"):
        _run(variant, kept, wrong)


def _rec(job, turn, ttft, prompt, cached, tool=0.0):
    return aj.TurnRecord(job, turn, float(turn), ttft, 0.5, prompt, 10, cached, tool)


def test_report_fields_ratios_and_table_on_known_records():
    jobs = [aj.Job(0, 0.0, []), aj.Job(1, 0.0, [])]
    for j in jobs:
        j.turns = [None, None, None]
    records = [_rec(j, k, 0.1 * (k + 1) + j, 100 * (k + 1), 0 if k == 0 else 90 * k) for j in (0, 1) for k in range(3)]
    run = bench.summarize_run(records, jobs, 1.0, 10.0)
    # follow-ups: TTFT 0.2, 0.3, 1.2, 1.3; prompt 200, 300 (twice); cached 90, 180 (twice)
    assert run["ttft_median_s"] == pytest.approx(0.75)
    assert run["prefilled_mean"] == pytest.approx((110 + 120) / 2) and run["cached_mean"] == pytest.approx(135)
    with pytest.raises(aj.Mismatch, match="no cached tokens"):
        bench.summarize_run([_rec(0, 1, 0.2, 200, None)] + [r for r in records if (r.job, r.turn) != (0, 1)],
                            jobs, 1.0, 10.0)
    base = bench.summarize_repeats([{**run, "prefilled_mean": x} for x in (230.0, 200.0, 260.0)])
    assert base["prefilled_mean"] == {"median": 230.0, "min": 200.0, "max": 260.0, "n": 3}
    ours = bench.summarize_repeats([run])
    r = bench.ratios(ours, base)
    assert r["prefilled_mean"] == pytest.approx(115 / 230) and r["ttft_median_s"] == pytest.approx(1.0)
    lines = bench.table(["messages", bench.BASELINE], {"messages": ours, bench.BASELINE: base})
    assert lines[2].startswith("| messages | 0.750 | ") and lines[2].endswith("| 1.00x, 0.50x, 1.00x |")
    assert lines[3].startswith(f"| {bench.BASELINE} |") and "230 [200-260]" in lines[3]


@pytest.mark.parametrize("argv, option", [(["--variants", "chat,grpc"], "--variants"), (["--jobs", "0"], "--jobs"),
                                          (["--turns", "3-1"], "--turns"), (["--policy", "[1]"], "--policy"),
                                          (["--tool-s", "nan"], "--tool-s")])
def test_bad_flags_are_one_line_naming_the_option(argv, option, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err


def test_the_baseline_keeps_no_context_and_the_others_do():
    from interlace.gateway.config import parse_config

    base = parse_config(bench.gateway_config(bench.BASELINE, 8192, "fcfs", {}), "<test>").models[bench.MODEL_NAME]
    chat = parse_config(bench.gateway_config("chat", 8192, "fcfs", {"interception": "preserve"}), "<test>")
    assert base.retention.enabled is False and chat.models[bench.MODEL_NAME].retention.enabled is True
    assert chat.models[bench.MODEL_NAME].policy.interception == "preserve" and chat.responses.path == ":memory:"
