"""Preserve on vLLM (issue 37): a paused context keeps its KV inside vLLM
(engine_ext/vllm/pins.py, sessions.py), the policy bounds the pins, and
nothing is left behind.  The pin budget's rule itself is tested without
vLLM first."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from interlace.engine_ext.policies.pin_budget import DROPPED, EXPIRED, Pin, keep_waste, pins_to_release


# --------------------------------------------------------------- the budget rule (no vLLM)
def test_expired_pins_go_first_and_free_their_blocks():
    pins = [Pin("old", 4, 400, since=0.0, ttl_s=10.0), Pin("new", 4, 400, since=9.0, ttl_s=10.0)]
    assert pins_to_release(pins, now=10.5, budget_blocks=100, free_blocks=0, need_blocks=4) == [("old", EXPIRED)]


def test_over_budget_the_most_wasteful_to_keep_is_dropped_first():
    # same size; "long" waits 30 s more, "short" is back in 1 s: keeping "long" wastes more
    pins = [Pin("short", 4, 400, since=0.0, ttl_s=100, expected_s=1.0),
            Pin("long", 4, 400, since=0.0, ttl_s=100, expected_s=30.0),
            Pin("big", 8, 50, since=0.0, ttl_s=100, expected_s=2.0)]
    assert keep_waste(pins[1], 0.0) > keep_waste(pins[0], 0.0)
    out = pins_to_release(pins, now=0.0, budget_blocks=12, free_blocks=100, need_blocks=0)
    assert out == [("long", DROPPED)]  # 16 blocks -> 12: one drop of 4 suffices


def test_running_requests_need_wins_over_pins_within_the_budget():
    pins = [Pin("a", 4, 400, since=0.0, ttl_s=100, expected_s=5.0),
            Pin("b", 4, 100, since=0.0, ttl_s=100, expected_s=5.0)]
    # within budget, but the running requests need 3 blocks and 0 are free: drop the bigger waste (a) only
    assert pins_to_release(pins, now=1.0, budget_blocks=100, free_blocks=0, need_blocks=3) == [("a", DROPPED)]
    assert pins_to_release(pins, now=1.0, budget_blocks=100, free_blocks=3, need_blocks=3) == []


def test_a_call_that_outlived_its_estimate_counts_the_time_already_waited():
    p = Pin("p", 1, 100, since=0.0, ttl_s=100, expected_s=2.0)
    assert keep_waste(p, 1.0) == pytest.approx(100)   # 1 s left
    assert keep_waste(p, 10.0) == pytest.approx(1000)  # outlived: 10 s waited (InferCept 4.4)


# --------------------------------------------------------------------------- on vLLM
vllm = pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh --test (the CPU build here)")

from interlace.engine_ext import errors as E  # noqa: E402
from interlace.engine_ext.constraints.forced import ForcedOutput  # noqa: E402
from interlace.engine_ext.policies import PolicySpec  # noqa: E402
from interlace.engine_ext.protocol import SamplingParams  # noqa: E402

BLOCK = 128  # vLLM's CPU build
ENGINE = {"kind": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_space_gb": 1, "max_model_len": 1024}


def _engine(smol_dir, interception="preserve", **over):
    from interlace.engine_ext.vllm import load_vllm_engine

    return load_vllm_engine({**ENGINE, **over}, str(smol_dir), PolicySpec(ranking="fcfs", interception=interception))


@pytest.fixture(scope="module")
def keep(smol_dir):
    eng = _engine(smol_dir, pin_ttl_s=30)
    yield eng
    eng.close()


def _forced(tok):
    pieces = [tok.encode(" The weather tool says"), tok.encode(" sunny and warm today.")]
    return pieces, ForcedOutput(pieces, end_token_id=min(tok.eos_token_ids))


async def _paused(eng, cid, prompt_words=60):
    """A context paused at its tool call (the stream's iterator, waiting), its length at the pause."""
    tok = eng.tokenizer
    pieces, forced = _forced(tok)
    await eng.fill(cid, tok.encode("Question: the weather? " * (prompt_words // 4)))
    stream = eng.generate(cid, SamplingParams(max_tokens=40, pause_on=["says"], logits_processors=[forced]))
    async for ev in stream:
        if ev.paused:
            forced.on_resume()
            return stream, await eng.context_length(cid)
    raise AssertionError("no pause")


async def _resume_to_end(eng, cid, stream, tool_tokens):
    await eng.resume(cid, tool_tokens)
    texts = []
    async for ev in stream:
        texts.append(ev.text)
        last = ev
    return "".join(texts), last.finish_reason


def _stats(eng):
    return asyncio.run(eng.fetch_pin_stats())


def test_a_paused_context_resumes_on_its_kept_kv_without_recomputation(keep, smol_dir):
    tool = keep.tokenizer.encode(" [tool result: 21 C]")
    before = dict(keep.resume_counts)

    async def go(eng):
        stream, n = await _paused(eng, "p")
        held = (await eng.fetch_pin_stats())["pinned_blocks"]
        text, reason = await _resume_to_end(eng, "p", stream, tool)
        ctx = await eng.context_tokens("p")
        await eng.free_context("p")
        return n, held, text, reason, ctx

    n, held, text, reason, ctx = asyncio.run(go(keep))
    assert held == -(-(n - 1) // BLOCK)  # the paused context's computed tokens, whole and partial blocks
    after = keep.resume_counts
    assert after["resumes"] == before["resumes"] + 1
    assert after["recomputed_after_resume"] == before["recomputed_after_resume"]  # nothing computed again
    stats = _stats(keep)
    assert stats["hits"] >= 1 and stats["pinned_blocks"] == 0 and stats["sessions"] == 0
    # the same stream as today's path (discard with prefix reuse) gives
    with _engine(smol_dir, interception="discard") as plain:
        n2, _, text2, reason2, ctx2 = asyncio.run(go_plain(plain, tool))
    assert (text, reason, ctx) == (text2, reason2, ctx2)
    assert plain.resume_counts["recomputed_after_resume"] == n2 - 1  # under one block: nothing cached


async def go_plain(eng, tool):
    stream, n = await _paused(eng, "p")
    text, reason = await _resume_to_end(eng, "p", stream, tool)
    ctx = await eng.context_tokens("p")
    await eng.free_context("p")
    return n, 0, text, reason, ctx


def test_a_released_pin_frees_its_blocks_and_the_resume_still_continues(keep):
    tool = keep.tokenizer.encode(" [tool result]")

    async def go():
        stream, _ = await _paused(keep, "r")
        assert await keep.release_kv("r")
        mid = await keep.fetch_pin_stats()
        text, reason = await _resume_to_end(keep, "r", stream, tool)
        await keep.free_context("r")
        return mid, text, reason

    base = _stats(keep)
    mid, text, reason = asyncio.run(go())
    assert mid["pinned_blocks"] == 0 and mid["dropped"] == base["dropped"] + 1
    assert reason == "stop" and "sunny and warm today." in text
    assert _stats(keep)["sessions"] == 0


@pytest.fixture(scope="module")
def small(smol_dir):
    """24 blocks of 128 tokens; pins may hold a quarter of them (5 blocks); 8 request slots, so at
    most 4 sessions."""
    eng = _engine(smol_dir, pin_budget=0.25, max_num_seqs=8, args={"num_gpu_blocks_override": 24})
    yield eng
    eng.close()


def test_an_expired_pin_is_released_at_the_next_step(small):
    eng = small

    async def go():
        stream, _ = await _paused(eng, "t")
        base = await eng.fetch_pin_stats()
        assert base["pinned"] == 1
        assert await eng.pin_hint("t", ttl_s=0.2)
        await asyncio.sleep(0.5)
        await eng.fill("other", eng.tokenizer.encode("Anything at all"))  # a step: the TTL is checked
        mid = await eng.fetch_pin_stats()
        text, reason = await _resume_to_end(eng, "t", stream, eng.tokenizer.encode(" ok"))
        for c in ("t", "other"):
            await eng.free_context(c)
        return base, mid, reason

    recomputed = eng.resume_counts["recomputed_after_resume"]
    base, mid, reason = asyncio.run(go())
    assert mid["expired"] == base["expired"] + 1 and reason == "stop"
    assert eng.resume_counts["recomputed_after_resume"] > recomputed  # released: computed again (under a block)
    assert (asyncio.run(eng.fetch_pin_stats()))["pinned_blocks"] == 0


def test_a_client_that_leaves_or_a_freed_context_leaves_no_session_behind(keep):
    async def go():
        stream, _ = await _paused(keep, "d")
        await stream.aclose()  # the consumer left while paused
        mid = await keep.fetch_pin_stats()
        await keep.free_context("d")
        return mid
    mid = asyncio.run(go())
    assert mid["sessions"] == 1  # the context still exists: its KV is kept for a follow-up
    stats = _stats(keep)
    assert stats["sessions"] == 0 and stats["pinned_blocks"] == 0


def test_the_pin_budget_holds_under_a_burst_of_pauses(small):
    eng = small  # each paused context holds 3 blocks: one pin fits the budget of 5

    async def go():
        streams = await asyncio.gather(*(_paused(eng, f"b{i}", prompt_words=200) for i in range(5)))
        await eng.fill("tick", eng.tokenizer.encode("One more step"))  # a step: the budget is applied
        mid = await eng.fetch_pin_stats()
        for i, (stream, _) in enumerate(streams):
            await _resume_to_end(eng, f"b{i}", stream, eng.tokenizer.encode(" ok"))
            await eng.free_context(f"b{i}")
        await eng.free_context("tick")
        return mid

    dropped = asyncio.run(eng.fetch_pin_stats())["dropped"]
    mid = asyncio.run(go())
    assert mid["pinned_blocks"] <= int(0.25 * 23)
    assert mid["dropped"] >= dropped + 2 and mid["pinned"] >= 1
    assert asyncio.run(eng.fetch_pin_stats())["sessions"] == 0


def test_sessions_leave_half_of_vllms_request_slots_to_new_work(small):
    """A waiting session keeps its vLLM request slot: six paused contexts on an engine of 8 slots
    hold at most 4 sessions (the rest decode as plain requests), and all of them finish."""
    eng = small
    assert eng.max_sessions == 4

    async def go():
        streams = await asyncio.gather(*(_paused(eng, f"s{i}", prompt_words=20) for i in range(6)))
        mid = await eng.fetch_pin_stats()
        reasons = []
        for i, (stream, _) in enumerate(streams):
            reasons.append((await _resume_to_end(eng, f"s{i}", stream, eng.tokenizer.encode(" ok")))[1])
            await eng.free_context(f"s{i}")
        return mid, reasons

    mid, reasons = asyncio.run(go())
    assert mid["sessions"] <= 4 and reasons == ["stop"] * 6
    assert asyncio.run(eng.fetch_pin_stats())["sessions"] == 0


def test_a_killed_engine_core_leaves_no_pin_accounting_behind(smol_dir):
    eng = _engine(smol_dir)
    try:
        async def pause():
            return await _paused(eng, "k")
        stream, _ = asyncio.run(pause())
        assert asyncio.run(eng.fetch_pin_stats())["pinned"] == 1
        me = psutil.Process()
        cores = [p for p in me.children(recursive=True) if "EngineCore" in " ".join(p.cmdline() + [p.name()])]
        assert cores
        for p in cores:
            os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while eng.alive and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not eng.alive
        stats = eng.pin_stats()
        assert stats["pinned"] == 0 and stats["pinned_blocks"] == 0 and stats["sessions"] == 0
        with pytest.raises(E.EngineError):
            asyncio.run(eng.fetch_pin_stats())
    finally:
        eng.close()


def test_offloading_connector_is_refused_with_kept_kv_before_vllm_starts(smol_dir):
    """Its per-request offload keys only grow: a kept context continued with other tokens would be
    looked up under its old content (engine_ext/vllm/__init__.py, "Swap")."""
    bad = {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}}
    with pytest.raises(ValueError, match="OffloadingConnector cannot serve kept"):
        _engine(smol_dir, args=bad)
    with pytest.raises(ValueError, match="SimpleCPUOffloadConnector"):
        _engine(smol_dir, args={"kv_offloading_size": 4})
