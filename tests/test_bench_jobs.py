"""``interlace bench jobs`` (bench/agent_jobs.py): the workload (every follow-up
extends the previous turn's tokens, so a kept context can serve it; jobs that
do not fit are refused), the accounting on records with known answers, and a
tiny run of the gateway client through a real gateway (the native engine:
quick to start; the vLLM systems are the benchmark's, run by hand), which
checks the forced replies, the token counts and the follow-ups' cached tokens."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest

from interlace.bench import agent_jobs as aj
from interlace.engine_ext.embedded import embedded_model_dir
from interlace.engine_ext.tokenizer import Tokenizer
from interlace.gateway.config import parse_config
from interlace.parsers.formats import HERMES

from helpers.gateway_server import LiveGateway

SMALL = aj.Workload(jobs=2, turns=(3, 3), tool_s=1.0, tool_sigma=0.5, result_tokens=(10, 20), arrival_s=0.5)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_model_dir(str(embedded_model_dir()), needed_by="tests")


def test_workload_is_seeded_and_every_follow_up_extends_the_turn_before(tok):
    jobs = aj.build_jobs(tok, HERMES, SMALL, seed=3)
    assert [len(j.turns) for j in jobs] == [3, 3]
    again = aj.build_jobs(tok, HERMES, SMALL, seed=3)
    assert [[t.prompt_ids + t.out_ids for t in j.turns] for j in jobs] == \
           [[t.prompt_ids + t.out_ids for t in j.turns] for j in again]
    other = aj.build_jobs(tok, HERMES, SMALL, seed=4)
    assert jobs[0].turns[0].prompt_ids != other[0].turns[0].prompt_ids  # each repeat its own texts
    eos = min(tok.eos_token_ids)
    for j in jobs:
        for a, b in zip(j.turns, j.turns[1:]):
            # the prompt, the forced reply and its EOS are the start of the follow-up's prompt, token for token
            assert b.prompt_ids[:len(a.prompt_ids) + len(a.out_ids)] == a.prompt_ids + a.out_ids
            assert a.out_ids[-1] == eos and a.call is not None and a.tool_s > 0
        assert j.turns[-1].call is None and j.turns[-1].tool_s == 0
    assert jobs[0].arrival_s == 0 < jobs[1].arrival_s


def test_a_job_longer_than_the_context_is_refused_naming_the_flags(tok):
    with pytest.raises(aj.BenchError, match="--turns or --result-tokens"):
        aj.build_jobs(tok, HERMES, aj.Workload(1, (60, 60), 1.0, 0.5, (10, 30), 0.0), seed=0)


@pytest.mark.parametrize("argv, option", [(["--turns", "5-2"], "--turns"), (["--result-tokens", "0"],
                                                                               "--result-tokens"),
                                          (["--variants", "vllm,interlace"], "--variants"),
                                          (["--kv-tokens", "2048"], "--kv-tokens"), (["--repeats", "0"], "--repeats"),
                                          (["--engine-extra", "[1]"], "--engine-extra")])
def test_bad_flags_are_one_line_naming_the_option(argv, option, capsys):
    assert aj.main(argv) == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err


def test_gateway_config_sets_the_kv_blocks_and_the_interception():
    pins = parse_config(aj.gateway_config("interlace", 48, "fcfs", {}), "<test>").models[aj.MODEL_NAME]
    discard = parse_config(aj.gateway_config("interlace-discard", 48, None, {}), "<test>").models[aj.MODEL_NAME]
    assert pins.replicas[0]["args"] == {"num_gpu_blocks_override": 48} and pins.replicas[0]["kind"] == "vllm"
    assert discard.policy.interception == "discard" and pins.policy.interception != "discard"
    assert pins.policy.ranking == "fcfs"


def _rec(job, turn, start, ttft, e2e, prompt, cached, tool=0.0):
    return aj.TurnRecord(job, turn, start, ttft, e2e, prompt, 10, cached, tool)


def test_accounting_on_known_records():
    jobs = [aj.Job(0, 0.0, []), aj.Job(1, 2.0, [])]  # arrival 2.0 at time scale 0.5: starts at 1.0 s
    for j in jobs:
        j.turns = [None, None]  # only their number counts here
    records = [_rec(0, 0, 0.0, 0.1, 0.5, 100, 0, tool=1.0), _rec(0, 1, 1.5, 0.2, 0.5, 200, 150),
               _rec(1, 0, 1.0, 0.3, 1.0, 100, 0, tool=2.0), _rec(1, 1, 4.0, 0.4, 2.0, 300, 50)]
    run = aj.summarize_run(records, jobs, time_scale=0.5, wall_s=6.0)
    # job 0 ends at 2.0 (arrived 0): 2.0 s, less 1.0 s of tool; job 1 ends at 6.0 (arrived 1.0): 5.0 s, less 2.0
    assert run["job_mean_s"] == pytest.approx(3.5) and run["model_mean_s"] == pytest.approx(2.0)
    assert run["job_p90_s"] == pytest.approx(2.0 + 0.9 * 3.0)
    assert run["ttft_mean_s"] == pytest.approx(0.3)  # follow-ups only: 0.2 and 0.4
    assert run["followup_cached_frac"] == pytest.approx(200 / 500)
    assert run["turns_per_s"] == pytest.approx(4 / 6.0) and run["prompt_tokens"] == 700
    with pytest.raises(ValueError, match="every turn"):
        aj.summarize_run(records[:3], jobs, 0.5, 6.0)
    unreported = [_rec(0, 1, 1.5, 0.2, 0.5, 200, None)] + [r for r in records if (r.job, r.turn) != (0, 1)]
    assert aj.summarize_run(unreported, jobs, 0.5, 6.0)["followup_cached_frac"] is None  # never a partial sum

    base = aj.summarize_repeats([{**run, "job_mean_s": x} for x in (4.0, 3.0, 5.0)])
    assert base["job_mean_s"] == {"median": 4.0, "min": 3.0, "max": 5.0, "n": 3}
    ours = aj.summarize_repeats([{**run, "job_mean_s": 2.0}])
    assert aj.ratios(ours, base)["job_mean_s"] == pytest.approx(0.5)
    lines = aj.table(["vllm-serve", "interlace"], {"vllm-serve": base, "interlace": ours})
    assert lines[2].startswith("| vllm-serve | 4.00 [3.00-5.00] |")
    assert "interlace vs vllm-serve (medians): job mean 0.50x" in lines[-1]


@pytest.fixture(scope="module")
def live():
    cfg = {"server": {"replay": True}, "plugins": {"entrypoints": False}, "engine": {"ranking": "fcfs"},
           "models": {aj.MODEL_NAME: {"path": "embedded", "dtype": "float32", "kv_cache_tokens": 8192}}}
    with LiveGateway(cfg) as gw:
        yield gw


async def _run(url, jobs):
    async with httpx.AsyncClient(timeout=120) as http:
        return await aj.run_jobs(aj.GatewayClient(http, url), jobs, time_scale=0.01)


def test_jobs_through_a_real_gateway_replay_exactly_and_reuse_the_context(live, tok):
    jobs = aj.build_jobs(tok, HERMES, SMALL, seed=0)
    records, wall = asyncio.run(_run(live.url, jobs))  # run_jobs checks every turn's usage against the plan
    assert sorted((r.job, r.turn) for r in records) == [(j, k) for j in range(2) for k in range(3)]
    by = {(r.job, r.turn): r for r in records}
    for j in jobs:
        for k, t in enumerate(j.turns):
            r = by[j.index, k]
            assert (r.prompt_tokens, r.completion_tokens) == (len(t.prompt_ids), len(t.out_ids))
            assert 0 < r.ttft_s <= r.e2e_s
            if k:  # the retained context served the follow-up: at least the previous prompt and reply
                prev = j.turns[k - 1]
                assert r.cached_tokens >= len(prev.prompt_ids) + len(prev.out_ids) - 1
        assert all(by[j.index, k].tool_s > 0 for k in range(2)) and by[j.index, 2].tool_s == 0
    run = aj.summarize_run(records, jobs, 0.01, wall)
    assert run["turns"] == 6 and run["followup_cached_frac"] > 0.8
    assert run["completion_tokens"] == sum(len(t.out_ids) for j in jobs for t in j.turns)


def test_a_reply_other_than_the_forced_one_fails_the_run(live, tok):
    jobs = aj.build_jobs(tok, HERMES, aj.Workload(1, (2, 2), 1.0, 0.0, (10, 10), 0.0), seed=9)
    wrong = copy.deepcopy(jobs)
    wrong[0].turns[0].call["arguments"] = {"path": "not/what/was/forced.py"}
    with pytest.raises(aj.Mismatch, match="not the forced reply"):
        asyncio.run(_run(live.url, wrong))
