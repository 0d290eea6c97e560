"""Scheduling: running decodes come before prefill chunks, and preemption
only drops KV whose release frees blocks."""

import asyncio

from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.protocol import SamplingParams


def test_long_resume_does_not_stall_decoding(tiny_dirs):
    """An old agent context (the earliest arrival) resumed with a long tool
    result must not take the whole step budget: every step still advances
    every decoding context by one token."""
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=2048, max_batched_tokens=8) as eng:
        steps = {f"d{i}": [] for i in range(3)}  # engine step count at each of their samplings

        def recorder(cid):
            def record(generated, logits):
                steps[cid].append(eng.stats["steps"])
                return logits
            return record

        async def decoder(cid, started):
            await eng.fill(cid, [3, 4, 5, 6 + len(steps)])
            sp = SamplingParams(max_tokens=40, ignore_eos=True, logits_processors=[recorder(cid)])
            n = 0
            async for _ in eng.generate(cid, sp):
                n += 1
                if n == 2:
                    started.set()
            return n

        async def go():
            await eng.fill("old", [1, 2, 3])  # created first: FCFS would rank it first
            old = eng.generate("old", SamplingParams(max_tokens=5, ignore_eos=True))
            await old.__anext__()
            await eng.pause("old")
            async for ev in old:
                if ev.paused:
                    break
            started = [asyncio.Event() for _ in steps]
            tasks = [asyncio.create_task(decoder(c, s)) for c, s in zip(steps, started)]
            for s in started:
                await s.wait()
            resumed_at = eng.stats["steps"]
            await eng.resume("old", [(7 * i) % 300 + 1 for i in range(120)])  # 120 tokens: >= 15 steps
            rest = [ev async for ev in old]
            done_at = eng.stats["steps"]
            counts = await asyncio.gather(*tasks)
            return resumed_at, done_at, rest, counts

        resumed_at, done_at, rest, counts = asyncio.run(go())
    assert rest[-1].finish_reason == "length"
    assert counts == [40, 40, 40]
    assert done_at - resumed_at >= 120 // 8
    for cid, seen in steps.items():
        gaps = [b - a for a, b in zip(seen, seen[1:])]
        assert all(g == 1 for g in gaps), f"{cid} skipped steps while the resume was prefilled: {gaps}"


def test_preemption_skips_contexts_whose_blocks_are_all_shared(tiny_dirs):
    """Dropping a fork that shares all its blocks with a context that stays
    frees nothing: the scheduler must drop a context that does free blocks."""
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, num_blocks=8) as eng:
        async def go():
            await eng.fill("parent", list(range(1, 21)))                   # 5 full blocks
            await eng.fill("twin", [], parent_context_id="parent")        # shares all 5, least recently used
            await eng.fill("other", [7] * 6)                              # 2 blocks of its own; 1 block free
            await eng.fill("child", [9] * 8, parent_context_id="parent")  # needs 2 more blocks
            stats = await eng.check_invariants()
            tokens = [ev.token_id async for ev in eng.generate("twin", SamplingParams(max_tokens=2,
                                                                                     ignore_eos=True))]
            return stats, tokens

        stats, _ = asyncio.run(go())
    assert stats["preemptions"] == 1  # "other" only; dropping "twin" would have freed nothing


def test_contexts_sharing_blocks_are_dropped_together_when_that_frees_them(tiny_dirs):
    """A parent and a fork that hold the same blocks, both idle: dropping
    both does free them, so a new context is served, not refused."""
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, num_blocks=8) as eng:
        async def go():
            await eng.fill("parent", list(range(1, 21)))             # 5 blocks
            await eng.fill("twin", [], parent_context_id="parent")  # the same 5; 3 free
            await eng.fill("new", [5] * 16)                         # needs 5 (one left uncached)
            return await eng.check_invariants()

        stats = asyncio.run(go())
    assert stats["preemptions"] == 2 and stats["contexts"] == 3
