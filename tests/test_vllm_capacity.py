"""Parrot's capacity cap inside vLLM's scheduler (issue 35): while a
latency-critical request has work, the requests run beside it stay within
the latency cap; the others are *held* -- kept out of vLLM's steps without
being preempted (their KV and their place stay) -- and run again once the
latency request is done (engine_ext/vllm/scheduler.py).

First on ``InterlaceScheduler`` itself, driven step by step with the
outputs a model runner would return (fast, exact about who is scheduled
when); then through the real vLLM CPU engine, where a throughput task group
that would exceed the cap gets no tokens while a latency-critical request
decodes, and does with regulation off."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh --test (the CPU build here)")

from interlace.engine_ext.policies import PolicySpec  # noqa: E402
from interlace.engine_ext.policies.capacity import NO_CAPACITY, CapacityPolicy  # noqa: E402
from interlace.engine_ext.protocol import RequestHint, SamplingParams  # noqa: E402

BLOCK = 16
LAT = {"objective": "latency"}
GROUP = {"objective": "throughput", "task_group": "g"}


# ------------------------------------------------------------------ the scheduler alone
@pytest.fixture(scope="module")
def vllm_config(smol_dir):
    """A vLLM configuration of the embedded model (no engine: the scheduler is driven by hand)."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=str(smol_dir), dtype="float32", max_model_len=1024, seed=0)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                         is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    cc.num_gpu_blocks = 400
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)


def _scheduler(vllm_config, capacity, cls="InterlaceScheduler", blocks=400):
    import copy

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from interlace.engine_ext.vllm import scheduler as S

    vc = copy.copy(vllm_config)
    vc.additional_config = {"interlace": S.interlace_config(capacity=capacity)}
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    return getattr(S, cls)(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
                           block_size=BLOCK, log_stats=False)


def _request(rid, n, hint, max_tokens=50, arrival=0.0):
    from vllm import SamplingParams as VSP
    from vllm.v1.request import Request

    return Request(rid, list(range(1, n + 1)), VSP(max_tokens=max_tokens, ignore_eos=True,
                                                   extra_args={"interlace": dict(hint)}),
                   None, arrival_time=arrival)


def _output(sched, out):
    """What a model runner returns for ``out``: a token for each request whose prompt is done."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    reqs = [sched.requests.get(r) for r in ids]  # None: finished meanwhile (its output is dropped)
    toks = [[7] if r is not None and r.num_computed_tokens >= r.num_prompt_tokens else [] for r in reqs]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=toks)


def _step(sched):
    """One synchronous step; returns the ids scheduled."""
    out = sched.schedule()
    sched.update_from_output(out, _output(sched, out))
    return set(out.num_scheduled_tokens)


def _group(sched, n=3, prompt=120):
    for i in range(n):
        sched.add_request(_request(f"t{i}", prompt, GROUP, max_tokens=200, arrival=float(i)))
    assert _step(sched) == {f"t{i}" for i in range(n)}  # no latency work: no cap, all admitted


def test_a_latency_request_runs_while_the_group_over_the_cap_is_held_not_preempted(vllm_config):
    """Cap 256: the latency request (50 tokens) and one member (121+) fit, two do not.  Those two get no
    step while it decodes, keep their KV and their place in ``running``, and run again after it."""
    sched = _scheduler(vllm_config, CapacityPolicy(latency_tokens=256))
    _group(sched)
    blocks = {r.request_id: sched.kv_cache_manager.get_block_ids(r.request_id) for r in sched.running}
    sched.add_request(_request("lat", 50, LAT, max_tokens=5, arrival=10.0))
    steps = [_step(sched) for _ in range(5)]
    assert steps == [{"lat", "t0"}] * 5
    assert "lat" not in sched.requests  # done and freed
    assert [r.request_id for r in sched.running] == ["t0", "t1", "t2"]  # not preempted, same order
    for rid in ("t1", "t2"):
        r = sched.requests[rid]
        assert r.num_preemptions == 0 and r.num_output_tokens == 1  # its first token only, before the hold
        assert sched.kv_cache_manager.get_block_ids(rid) == blocks[rid]  # its KV kept
    assert sched.capacity_held == 2 and sched.capacity_held_steps == 5 and sched.capacity_limit == 256
    assert _step(sched) == {"t0", "t1", "t2"}  # the latency request done: no cap
    assert sched.capacity_held == 0 and sched.capacity_limit is None


def test_with_regulation_off_they_run_together(vllm_config):
    sched = _scheduler(vllm_config, NO_CAPACITY)
    _group(sched)
    sched.add_request(_request("lat", 50, LAT, max_tokens=5, arrival=10.0))
    assert [_step(sched) for _ in range(5)] == [{"lat", "t0", "t1", "t2"}] * 5
    assert sched.capacity_held_steps == 0


def test_waiting_requests_over_the_cap_are_not_admitted_and_keep_their_place(vllm_config):
    """Members arriving while the latency request runs wait in the queue (in their order) until it is done."""
    sched = _scheduler(vllm_config, CapacityPolicy(latency_tokens=256))
    sched.add_request(_request("lat", 50, LAT, max_tokens=4, arrival=0.0))
    for i in range(3):
        sched.add_request(_request(f"t{i}", 120, GROUP, max_tokens=20, arrival=1.0 + i))
    assert _step(sched) == {"lat", "t0"}
    assert [r.request_id for r in sched.waiting] == ["t1", "t2"]
    assert sched.capacity_held == 2
    for _ in range(3):
        assert _step(sched) == {"lat", "t0"}
        assert [r.request_id for r in sched.waiting] == ["t1", "t2"]
    assert _step(sched) == {"t0", "t1", "t2"}
    assert not sched.waiting


def test_held_requests_that_are_aborted_leave_nothing_behind(vllm_config):
    from vllm.v1.request import RequestStatus

    sched = _scheduler(vllm_config, CapacityPolicy(latency_tokens=256))
    _group(sched)
    sched.add_request(_request("lat", 50, LAT, max_tokens=50, arrival=10.0))
    sched.add_request(_request("t9", 120, GROUP, max_tokens=20, arrival=11.0))
    assert _step(sched) == {"lat", "t0"}
    assert {"t1", "t2", "t9"} <= sched._held
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.finish_requests(["t1", "t9"], RequestStatus.FINISHED_ABORTED)  # a held running and a held waiting one
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() > free  # t1's blocks went back
    assert _step(sched) == {"lat", "t0"}
    sched.finish_requests(["lat", "t0", "t2"], RequestStatus.FINISHED_ABORTED)
    assert not sched.running and not sched.waiting and not sched.requests
    assert not sched._items and not sched._held
    assert sched.capacity_stats()["capacity_held"] == 0  # no work left: nothing is held


def test_a_step_that_holds_and_schedules_nothing_lets_the_held_ones_run_next(vllm_config):
    """The latency request waits for memory the held group keeps: the held ones run (and may finish or be
    preempted) rather than the engine standing still."""
    sched = _scheduler(vllm_config, CapacityPolicy(latency_tokens=256), blocks=30)  # 29 usable blocks of 16
    for i in range(3):
        sched.add_request(_request(f"t{i}", 140, GROUP, max_tokens=4, arrival=float(i)))  # 9 blocks each
    assert _step(sched) == {"t0", "t1", "t2"}
    # 200 tokens: 13 blocks, 2 free; beside it no member fits the cap, so all three are held
    sched.add_request(_request("lat", 200, LAT, max_tokens=3, arrival=10.0))
    seen = [_step(sched) for _ in range(16)]
    assert "lat" not in sched.requests and not sched.running and not sched.waiting, seen  # all done
    assert set() in seen and {"t0", "t1", "t2"} in seen[seen.index(set()):], seen  # held, then ran


def test_async_a_held_request_resumes_only_once_its_output_in_flight_is_back(vllm_config):
    """vLLM's asynchronous scheduler schedules a step before the last one's tokens are back.  A request
    held with a token in flight stays held until that token is delivered (vLLM's model runner rebuilds a
    request that missed a step from the scheduler's token ids, which do not have it yet)."""
    from vllm.v1.request import RequestStatus

    sched = _scheduler(vllm_config, CapacityPolicy(latency_tokens=256), cls="InterlaceAsyncScheduler")
    for i in range(3):
        sched.add_request(_request(f"t{i}", 120, GROUP, max_tokens=50, arrival=float(i)))
    o1 = sched.schedule()
    sched.update_from_output(o1, _output(sched, o1))
    o2 = sched.schedule()  # all three decode; their tokens are in flight
    assert set(o2.num_scheduled_tokens) == {"t0", "t1", "t2"}
    sched.add_request(_request("lat", 50, LAT, max_tokens=20, arrival=10.0))
    o3 = sched.schedule()  # t1, t2 held with a token in flight (o2's)
    assert set(o3.num_scheduled_tokens) == {"lat", "t0"}
    assert sched.requests["t1"].num_output_placeholders == 1
    sched.finish_requests("lat", RequestStatus.FINISHED_ABORTED)  # no cap any more
    o4 = sched.schedule()  # o2's tokens still not back (a deeper pipeline): t1, t2 stay out
    assert set(o4.num_scheduled_tokens) == {"t0"}
    for o in (o2, o3, o4):
        sched.update_from_output(o, _output(sched, o))
    assert sched.requests["t1"].num_output_placeholders == 0
    o5 = sched.schedule()
    assert set(o5.num_scheduled_tokens) == {"t0", "t1", "t2"}
    sched.update_from_output(o5, _output(sched, o5))


def test_the_engine_args_carry_the_policys_caps(smol_dir):
    from interlace.engine_ext.vllm import engine_args

    eng = {"kind": "vllm", "dtype": "float32", "max_model_len": 1024}
    conf = engine_args(eng, str(smol_dir), PolicySpec(latency_capacity_tokens=300,
                                                      throughput_capacity_tokens=9000)).additional_config
    assert conf["interlace"]["capacity"] == {"latency_tokens": 300, "throughput_tokens": 9000}
    off = engine_args(eng, str(smol_dir), PolicySpec(latency_capacity_tokens=None)).additional_config
    assert off["interlace"]["capacity"] is None
    assert engine_args(eng, str(smol_dir)).additional_config["interlace"]["capacity"] is None  # library default


# ------------------------------------------------------------------------ the real engine
ENGINE = {"kind": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_space_gb": 1, "max_model_len": 1024}
CAP = 512
PROMPT = 300  # a member's prompt: the latency request and one member fit the cap, two members do not


async def _mixed(eng):
    """Three members of a throughput task group (300-token prompts) decode; then a latency-critical
    request (13 tokens, 16 more generated) runs.  Cap 512: it and one member fit, two do not.
    Returns each member's tokens received while the latency request decoded (from its second token to
    its last) and the load stats read meanwhile."""
    tok = eng.tokenizer
    counts = {f"t{i}": 0 for i in range(3)}
    started = {cid: asyncio.Event() for cid in counts}
    stop = asyncio.Event()

    async def member(cid):
        await eng.fill(cid, tok.encode(f"Story {cid}: " + "the quick brown fox jumps over the lazy dog " * 40)[:PROMPT])
        assert await eng.context_length(cid) == PROMPT
        hint = RequestHint(objective="throughput", task_group="g")
        async for ev in eng.generate(cid, SamplingParams(max_tokens=400, ignore_eos=True), hint=hint):
            counts[cid] += 1
            started[cid].set()
            if stop.is_set():
                break
        await eng.free_context(cid)

    tasks = [asyncio.create_task(member(cid)) for cid in counts]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 300)
    await eng.fill("lat", tok.encode("Quick question: what is two plus two? Answer briefly please."))
    seen, marks, stats = 0, {}, None
    async for ev in eng.generate("lat", SamplingParams(max_tokens=16, ignore_eos=True),
                                 hint=RequestHint(objective="latency")):
        seen += 1
        if seen == 2:
            marks["from"] = dict(counts)
            stats = eng.load_stats()
        if ev.finish_reason:
            marks["to"] = dict(counts)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 300)
    await eng.free_context("lat")
    core = await eng.fetch_capacity_stats()
    return {cid: marks["to"][cid] - marks["from"][cid] for cid in counts}, stats, core


def _engine(smol_dir, cap):
    from interlace.engine_ext.vllm import load_vllm_engine

    return load_vllm_engine(ENGINE, str(smol_dir), PolicySpec(ranking="fcfs", interception="discard",
                                                               latency_capacity_tokens=cap))


def test_vllm_holds_a_task_group_over_the_cap_while_a_latency_request_decodes(smol_dir):
    with _engine(smol_dir, CAP) as eng:
        during, stats, core = asyncio.run(_mixed(eng))
    # the first member fits beside the latency request and keeps decoding; the other two get nothing
    assert sorted(during.values())[:2] == [0, 0] and max(during.values()) > 0, during
    assert stats["capacity_tokens"] == CAP and stats["latency_running"] == 1, stats
    assert stats["active_tokens"] >= 3 * PROMPT and stats["capacity_latency_tokens"] == CAP, stats
    assert core["capacity_held_steps"] >= 14, core


def test_vllm_without_regulation_runs_the_group_beside_the_latency_request(smol_dir):
    with _engine(smol_dir, None) as eng:
        during, stats, core = asyncio.run(_mixed(eng))
    assert min(during.values()) >= 10, during
    assert stats["capacity_tokens"] == 0 and core["capacity_held_steps"] == 0, (stats, core)
