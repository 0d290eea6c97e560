"""Interception in the native engine: every handling (preserve, discard,
chunked discard, swap by budget, synchronous swap, InferCept's min-waste
choice) gives exactly the tokens of an uninterrupted run under a tiny KV
cache; the swap budget holds per step; arrival kept or reset; tool durations
learned from pause to resume; client-side retention (park) and its
follow-ups; nothing leaked on the device or in the host pool."""

import asyncio

import pytest

from helpers import run
from interlace.engine_ext import errors as E
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.policies import (FCFS, BatchState, Fixed, Handling, Preserve, Profile, RankState,
                                          make_interception, make_ranking)
from interlace.engine_ext.protocol import PauseHint, RequestHint, SamplingParams

BS = 4


def slow_link(saturation: int = 8) -> Profile:
    """Every iteration takes 1 s, one block takes 1 s to move: the swap
    budget is one block per step; S = ``saturation`` tokens."""
    return Profile(model="tiny", device="test", source="derived (test)", block_size=BS, kv_bytes_per_token=1,
                   kv_capacity_tokens=96, max_batched_tokens=16, fwd_tokens=(1, 1000), fwd_seconds=(1.0, 1.0),
                   fwd_s_per_context_token=0.0, swap_s_per_block=1.0, saturation_tokens=saturation)


def engine(tiny_dirs, policy, **kw):
    kw.setdefault("num_blocks", 24)
    kw.setdefault("max_batched_tokens", 16)
    return NativeEngine.load(tiny_dirs["llama"][0], block_size=BS, max_model_len=64, interception=policy, **kw)


SP = dict(ignore_eos=True)
PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "b": [20, 21, 22, 23, 24, 25, 26]}
TOOL = {"a": [40, 41, 42, 43, 44], "b": [50, 51, 52]}


async def agent(eng, cid, n=14, after=4, hint=None, gap=0.05, on_paused=None):
    """fill, generate; pause after ``after`` tokens; resume with the tool's
    tokens after ``gap`` s.  Returns (tokens before the pause, after it)."""
    await eng.fill(cid, PROMPTS[cid])
    out, split = [], None
    async for ev in eng.generate(cid, SamplingParams(max_tokens=n, **SP)):
        if ev.token_id is not None:
            out.append(ev.token_id)
        if ev.paused:
            split = len(out)
            if on_paused is not None:
                await on_paused(cid)
            await asyncio.sleep(gap)
            await eng.resume(cid, TOOL[cid])
        elif split is None and len(out) == after and ev.finish_reason is None:
            await eng.pause(cid, hint or PauseHint(tool="t", expected_duration_s=100.0))
    return out[:split], out[split:]


async def background(eng, n=16):
    await eng.fill("bg", [30, 31, 32, 33, 34, 35])
    return [ev.token_id async for ev in eng.generate("bg", SamplingParams(max_tokens=n, **SP))]


def reference(tiny_dirs, results):
    """The same requests run one by one without interception, in a big cache."""
    async def go():
        with NativeEngine.load(tiny_dirs["llama"][0], block_size=BS, kv_cache_tokens=1024) as ref:
            out = {}
            for cid, (first, second) in results.items():
                await ref.fill(cid, PROMPTS[cid])
                a = [ev.token_id async for ev in ref.generate(cid, SamplingParams(max_tokens=len(first), **SP))]
                await ref.fill(cid, TOOL[cid])
                b = [ev.token_id async for ev in ref.generate(cid, SamplingParams(max_tokens=len(second), **SP))]
                out[cid] = (a, b)
            return out
    return run(go())


async def drained(eng):
    """Free everything; nothing may be left on the device or in the host pool."""
    for cid in list(eng.contexts):
        await eng.free_context(cid)
    st = await eng.check_invariants()
    assert st["contexts"] == 0 and st["used_blocks"] == 0 and st["host_used_blocks"] == 0, st
    assert st["intercepted"] == 0
    return st


CASES = {
    "preserve": (lambda: make_interception("preserve"), {"preserve"}),
    "discard": (lambda: make_interception("discard", slow_link()), {"discard"}),
    "discard-chunked": (lambda: make_interception("discard-chunked", slow_link(saturation=5)), {"discard"}),
    "vllm": (lambda: make_interception("vllm"), {"discard"}),
    "swap": (lambda: make_interception("swap", slow_link()), {"swap"}),
    "swap-sync": (lambda: make_interception("swap-sync"), {"swap"}),
    "infercept": (lambda: make_interception("infercept", slow_link()), {"swap"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_handling_gives_the_uninterrupted_tokens(tiny_dirs, name):
    make, expected = CASES[name]
    policy = make()
    with engine(tiny_dirs, policy, num_blocks=14) as eng:  # 56 tokens: the three do not fit together
        eng.swap_trace = []

        async def go():
            res = await asyncio.gather(agent(eng, "a"), agent(eng, "b", after=3), background(eng))
            st = await eng.check_invariants()
            stats = dict(eng.stats)
            await drained(eng)
            return res, st, stats

        (ra, rb, bg), st, stats = run(go())
    ref = reference(tiny_dirs, {"a": ra, "b": rb})
    assert (ra, rb) == (ref["a"], ref["b"])
    assert len(bg) == 16
    used = {h for h, n in stats["handlings"].items() if n}
    assert used <= expected | {"discard"} and used & expected, stats["handlings"]  # a full host pool discards
    if "swap" in expected:
        assert stats["swap_out_blocks"] > 0 and stats["swap_in_blocks"] > 0
    if name in ("swap", "infercept"):
        assert eng.swap_trace and all(o + i <= lim for _, o, i, lim in eng.swap_trace), eng.swap_trace
    if "discard" in expected:
        assert stats["recomputed_tokens"] > 0


def test_swap_budget_is_respected_per_step(tiny_dirs):
    """One block per step each way (1 s per block behind a 1 s iteration),
    while a decoder keeps the steps coming."""
    with engine(tiny_dirs, make_interception("swap", slow_link()), num_blocks=40) as eng:
        eng.swap_trace = []

        async def go():
            async def hold(cid):
                await asyncio.sleep(0.3)  # the swap-out takes a step per block

            res = await asyncio.gather(agent(eng, "a", on_paused=hold), background(eng, n=40))
            return res, await drained(eng)

        (ra, _), _ = run(go())
    trace = eng.swap_trace
    assert trace and all(lim == 1 and o + i <= 1 for _, o, i, lim in trace), trace
    outs = sum(o for _, o, _, _ in trace)
    assert outs >= 3  # every block of "a" (at least 10 + 4 tokens), one a step
    assert sum(i for _, _, i, _ in trace) == outs
    assert reference(tiny_dirs, {"a": ra})["a"] == ra


def test_swap_sync_moves_the_whole_context_in_one_step(tiny_dirs):
    with engine(tiny_dirs, make_interception("swap-sync", slow_link())) as eng:
        eng.swap_trace = []

        async def go():
            async def wait_out(cid):
                while not eng.stats["swap_out_blocks"]:
                    await asyncio.sleep(0.01)

            res = await agent(eng, "a", on_paused=wait_out)
            await drained(eng)
            return res

        res = run(go())
    outs = [o for _, o, _, _ in eng.swap_trace if o]
    assert len(outs) == 1 and outs[0] >= 3
    assert reference(tiny_dirs, {"a": res})["a"] == res


@pytest.mark.parametrize("name,kept", [("discard", True), ("vllm", False)])
def test_arrival_kept_or_reset_on_resume(tiny_dirs, name, kept):
    with engine(tiny_dirs, make_interception(name)) as eng:
        seen = {}

        async def go():
            async def note(cid):
                seen["before"] = eng.contexts[cid].arrival

            await agent(eng, "a", on_paused=note, gap=0.05)
            seen["after"] = eng.contexts["a"].arrival
            await drained(eng)

        run(go())
    assert (seen["after"] == seen["before"]) is kept
    if not kept:
        assert seen["after"] >= seen["before"] + 0.05


def test_tool_duration_learned_from_pause_to_resume(tiny_dirs):
    policy = make_interception("preserve")
    with engine(tiny_dirs, policy) as eng:
        async def go():
            await agent(eng, "a", hint=PauseHint(tool="search"), gap=0.2)
            await drained(eng)

        run(go())
    est = policy.durations.estimate("search")
    assert est is not None and 0.2 <= est < 5.0


def test_hint_given_after_the_pause_names_the_call(tiny_dirs):
    """The engine may pause (pause_on) before the gateway has parsed the
    call: a hint set while paused still names the tool learned at resume."""
    policy = make_interception("preserve")
    with engine(tiny_dirs, policy) as eng:
        async def late(cid):
            eng.set_pause_hint(cid, PauseHint(tool="late", expected_duration_s=3.0))
            await asyncio.sleep(0.05)
            assert eng.contexts[cid].intercept.hint.tool == "late"

        async def go():
            await agent(eng, "a", hint=PauseHint(tool="early"), gap=0.1, on_paused=late)
            await drained(eng)

        run(go())
    assert policy.durations.estimate("early") is None
    assert 0.1 <= policy.durations.estimate("late") < 5.0


def test_a_new_request_waits_rather_than_drop_a_preserved_context(tiny_dirs):
    """Preserve means preserve: while another request decodes, a newcomer
    that does not fit waits for memory instead of dropping the paused
    context's KV (which would turn preserve into discard behind the
    policy's back); it gets in once the decode is done.  (Its prompt is one
    chunk here: admission checks the first chunk, as the simulator's.)"""
    with engine(tiny_dirs, make_interception("preserve"), num_blocks=16, max_batched_tokens=64) as eng:  # 64 tokens
        async def go():
            await eng.fill("p", list(range(5, 29)))  # 24 tokens
            paused = asyncio.Event()
            resume = asyncio.Event()

            async def tool_user():
                asked = False
                async for ev in eng.generate("p", SamplingParams(max_tokens=20, **SP)):
                    if ev.paused:
                        paused.set()
                        await resume.wait()
                        await eng.resume("p", [40, 41])
                    elif not asked and ev.finish_reason is None:
                        asked = True
                        await eng.pause("p", PauseHint(tool="t", expected_duration_s=100.0))

            user = asyncio.create_task(tool_user())
            await paused.wait()
            held = await eng.computed_tokens("p")
            await eng.fill("r", list(range(50, 58)))
            first = asyncio.Event()
            order = []

            async def decoder():
                async for ev in eng.generate("r", SamplingParams(max_tokens=16, **SP)):
                    first.set()
                order.append("r done")

            dec = asyncio.create_task(decoder())
            await first.wait()
            await eng.fill("n", list(range(60, 88)))  # 28 tokens: fits only once r's KV can go
            order.append("n filled")
            assert await eng.computed_tokens("p") == held and held >= 25
            await dec
            resume.set()
            await user
            return order

        order = run(go())
    assert order == ["r done", "n filled"]
    assert eng.stats["recomputed_tokens"] == 0


def test_host_pool_too_small_falls_back_to_discard(tiny_dirs):
    with engine(tiny_dirs, make_interception("swap"), host_pool_tokens=BS) as eng:  # one host block
        async def go():
            async def wait_planned(cid):
                while not any(eng.stats["handlings"].values()):
                    await asyncio.sleep(0.01)

            res = await agent(eng, "a", on_paused=wait_planned)
            stats = dict(eng.stats)
            await drained(eng)
            return res, stats

        res, stats = run(go())
    assert stats["handlings"]["discard"] == 1 and stats["swap_out_blocks"] == 0
    assert reference(tiny_dirs, {"a": res})["a"] == res


def test_swap_leaves_blocks_shared_with_a_fork_on_the_device(tiny_dirs):
    """A fork shares the parent's full blocks: swapping the parent out moves
    only what it alone holds, and the fork's generation is unaffected."""
    with engine(tiny_dirs, make_interception("swap-sync")) as eng:
        async def go():
            await eng.fill("p", list(range(1, 13)))               # 3 full blocks
            await eng.fill("kid", [7, 8], parent_context_id="p")  # shares them
            kid_first = [ev.token_id async for ev in eng.generate("kid", SamplingParams(max_tokens=5, **SP))]
            await eng.free_context("kid")
            await eng.fill("kid", [7, 8], parent_context_id="p")
            out, split = [], None
            async for ev in eng.generate("p", SamplingParams(max_tokens=6, **SP)):
                if ev.token_id is not None:
                    out.append(ev.token_id)
                if ev.paused:
                    split = len(out)
                    while not eng.stats["swap_out_blocks"]:
                        await asyncio.sleep(0.01)
                    st = await eng.check_invariants()
                    kid = [e.token_id async for e in eng.generate("kid", SamplingParams(max_tokens=5, **SP))]
                    await eng.resume("p", [3])
                elif split is None and len(out) == 1:
                    await eng.pause("p", PauseHint(tool="t"))
            await eng.free_context("kid")
            await drained(eng)
            return kid_first, kid, st, eng.stats["swap_out_blocks"]

        kid_first, kid, st, swapped = run(go())
    assert kid == kid_first
    assert swapped == 1  # only the partial block the parent wrote alone; the 3 shared stay
    assert st["host_used_blocks"] == 1


def test_infercept_preserves_short_calls_and_swaps_long_ones(tiny_dirs):
    policy = make_interception("infercept", slow_link())
    with engine(tiny_dirs, policy) as eng:
        async def go():
            short = await agent(eng, "a", hint=PauseHint(tool="quick", expected_duration_s=1e-6))
            long = await agent(eng, "b", hint=PauseHint(tool="slow", expected_duration_s=1e3))
            stats = dict(eng.stats)
            await drained(eng)
            return short, long, stats

        short, long, stats = run(go())
    assert stats["handlings"]["preserve"] >= 1 and stats["handlings"]["swap"] == 1
    assert reference(tiny_dirs, {"a": short, "b": long}) == {"a": short, "b": long}


def test_chunked_recomputation_is_bounded_by_s(tiny_dirs):
    """A discarded context comes back in chunks of at most S - decodes."""
    prof = slow_link(saturation=6)
    # no prefix cache: the whole context is recomputed
    with engine(tiny_dirs, make_interception("discard-chunked", prof), num_blocks=40, prefix_caching=False) as eng:
        chunks = []
        real = eng.runner.run

        def spy(batch):
            decodes = sum(1 for ch in batch.chunks if ch.num == 1 and ch.start > 0)
            chunks.extend((ch.ctx.id, ch.start, ch.num, decodes) for ch in batch.chunks)
            return real(batch)

        eng.runner.run = spy

        async def go():
            async def wait_discarded(cid):
                while not eng.stats["handlings"]["discard"]:
                    await asyncio.sleep(0.01)
                chunks.clear()

            res = await asyncio.gather(agent(eng, "a", on_paused=wait_discarded), background(eng, n=30))
            stats = dict(eng.stats)
            await drained(eng)
            return res, stats

        (ra, _), stats = run(go())
    recompute = [(s, n, d) for cid, s, n, d in chunks if cid == "a" and n > 1]
    assert recompute and all(n <= max(BS, 6 - d) for s, n, d in recompute), recompute
    assert stats["recomputed_tokens"] >= len(PROMPTS["a"])
    assert reference(tiny_dirs, {"a": ra})["a"] == ra


def test_prefix_caching_off_never_matches(tiny_dirs):
    with engine(tiny_dirs, make_interception("discard"), prefix_caching=False) as eng:
        async def go():
            await eng.fill("x", list(range(1, 17)))
            await eng.fill("y", list(range(1, 17)))
            res = await agent(eng, "a")
            st = await drained(eng)
            return res, st

        res, st = run(go())
    assert st["prefix_hit_blocks"] == 0 and st["cached_blocks"] == 0
    assert reference(tiny_dirs, {"a": res})["a"] == res


# ------------------------------------------------------------- park (client-side retention)
@pytest.mark.parametrize("name", ["preserve", "discard", "swap-sync", "swap"])
def test_park_and_follow_up_is_token_exact(tiny_dirs, name):
    policy = make_interception(name, slow_link())
    with engine(tiny_dirs, policy) as eng:
        async def go():
            await eng.fill("c", PROMPTS["a"])
            first = [ev.token_id async for ev in eng.generate("c", SamplingParams(max_tokens=5, **SP))]
            await eng.park("c", PauseHint(tool="client", expected_duration_s=50.0))
            for _ in range(200):  # until the policy has handled it (and a swap is done)
                if any(eng.stats["handlings"].values()) and not eng.swap.busy:
                    break
                await asyncio.sleep(0.01)
            st = await eng.check_invariants()
            held = await eng.computed_tokens("c")
            await eng.fill("c", TOOL["a"])
            second = [ev.token_id async for ev in eng.generate("c", SamplingParams(max_tokens=6, **SP))]
            stats = dict(eng.stats)
            await drained(eng)
            return (first, second), st, held, stats

        res, st, held, stats = run(go())
    assert reference(tiny_dirs, {"a": res})["a"] == res
    assert st["intercepted"] == 1
    if name == "discard":
        assert held == 0 and stats["recomputed_tokens"] > 0
    else:
        assert held == len(PROMPTS["a"]) + 4  # the last generated token is not computed yet
    if name.startswith("swap"):
        assert st["host_used_blocks"] > 0 and stats["swap_in_blocks"] == stats["swap_out_blocks"] > 0
    assert policy.durations.estimate("client") is not None


def test_park_fork_and_free_unpark(tiny_dirs):
    with engine(tiny_dirs, make_interception("swap-sync")) as eng:
        async def go():
            await eng.fill("c", list(range(1, 11)))
            ref = await eng.last_logits("c")
            await eng.park("c", PauseHint(tool="x"))
            while not eng.stats["swap_out_blocks"]:
                await asyncio.sleep(0.01)
            await eng.fill("k", [4], parent_context_id="c")  # fork from a swapped-out context
            kid = [ev.token_id async for ev in eng.generate("k", SamplingParams(max_tokens=3, **SP))]
            await eng.free_context("k")
            await eng.fill("k2", [4], parent_context_id="c")
            kid2 = [ev.token_id async for ev in eng.generate("k2", SamplingParams(max_tokens=3, **SP))]
            await eng.free_context("k2")
            await eng.park("c", PauseHint(tool="x"))
            await eng.free_context("c")  # parked: freed with whatever it holds
            st = await drained(eng)
            return ref, kid, kid2, st

        ref, kid, kid2, st = run(go())
    assert ref is not None and kid == kid2


def test_truncate_keeps_whole_blocks_and_stays_token_exact(tiny_dirs):
    """A retained context cut back inside its reply: the KV of the whole
    blocks before the cut is kept (not recomputed), the rest is filled, and
    greedy decoding continues exactly as on a fresh context of the same
    tokens; a parked context is un-parked; busy contexts and bad lengths
    are refused; nothing leaks."""
    with engine(tiny_dirs, make_interception("preserve")) as eng:
        async def go():
            prompt = PROMPTS["a"] + [15, 16, 17, 18, 19]            # 15 tokens
            await eng.fill("t", prompt)
            await eng.park("t", PauseHint(tool="client"))
            kept = await eng.truncate("t", 11)                       # inside the third block
            assert kept == 8 and await eng.computed_tokens("t") == 8
            assert await eng.context_tokens("t") == prompt[:11] and not eng.intercepted
            await eng.fill("t", [60, 61, 62])
            out = [ev.token_id async for ev in eng.generate("t", SamplingParams(max_tokens=6, **SP))]
            await eng.fill("f", prompt[:11] + [60, 61, 62])
            ref = [ev.token_id async for ev in eng.generate("f", SamplingParams(max_tokens=6, **SP))]
            with pytest.raises(ValueError):
                await eng.truncate("t", 999)
            with pytest.raises(ValueError):
                await eng.truncate("t", -1)
            stream = eng.generate("t", SamplingParams(max_tokens=30, **SP))
            await stream.__anext__()
            with pytest.raises(E.ContextBusy):
                await eng.truncate("t", 3)
            await stream.aclose()
            await drained(eng)
            return out, ref

        out, ref = run(go())
    assert out == ref


def test_park_validates(tiny_dirs):
    with engine(tiny_dirs, make_interception("preserve")) as eng:
        async def go():
            with pytest.raises(E.ContextNotFound):
                await eng.park("nope")
            await eng.fill("c", [1, 2, 3])
            stream = eng.generate("c", SamplingParams(max_tokens=30, **SP))
            await stream.__anext__()
            with pytest.raises(E.ContextBusy):
                await eng.park("c")
            await stream.aclose()
            await drained(eng)

        run(go())


def test_request_hint_seeds_the_ranking(tiny_dirs):
    prof = slow_link()
    policy = make_interception("infercept", prof)
    with engine(tiny_dirs, policy, ranking=make_ranking("lamps", prof, policy)) as eng:
        async def go():
            with pytest.raises(E.InvalidSampling, match="expected_output"):
                async for _ in eng.generate("x", SamplingParams(), hint=RequestHint(expected_output=-1)):
                    pass
            with pytest.raises(E.InvalidSampling, match="expected_tool_s"):
                async for _ in eng.generate("x", SamplingParams(), hint=RequestHint(expected_tool_s=float("nan"))):
                    pass
            await eng.fill("c", [1, 2, 3])
            hint = RequestHint(app="t", expected_output=4, expected_tool="calc", expected_tool_s=2.0)
            toks = [ev.token_id async for ev in eng.generate("c", SamplingParams(max_tokens=4, **SP), hint=hint)]
            s = eng.contexts["c"].sched
            seen = (s.expected_output, s.expected_tool, s.expected_tool_s, s.segment_generated)
            await drained(eng)
            return toks, seen

        toks, seen = run(go())
    assert len(toks) == 4 and seen == (4, "calc", 2.0, 4)


def test_fixed_policy_by_tool(tiny_dirs):
    policy = Fixed(by_tool={"slow": Handling.SWAP, "fast": Handling.PRESERVE})
    with engine(tiny_dirs, policy) as eng:
        async def go():
            a = await agent(eng, "a", hint=PauseHint(tool="slow"))
            b = await agent(eng, "b", hint=PauseHint(tool="fast"))
            stats = dict(eng.stats)
            await drained(eng)
            return a, b, stats

        a, b, stats = run(go())
    assert stats["handlings"] == {"preserve": 1, "discard": 0, "swap": 1}
    assert reference(tiny_dirs, {"a": a, "b": b}) == {"a": a, "b": b}


def test_a_swap_in_with_no_free_block_waits_while_other_work_runs():
    """The host copy is kept and the swap-in waits for a device block while
    other work runs (it will free blocks); only with nothing else running
    is the context given up to recomputation, so the engine never stalls."""
    import torch

    from interlace.engine_ext.native.block_manager import BlockManager
    from interlace.engine_ext.native.sequence import Context
    from interlace.engine_ext.native.swap import Swapper

    blocks = BlockManager(num_blocks=2, block_size=BS)
    kv = torch.zeros(1, 2, 1, 2, BS, 1)
    sw = Swapper(blocks, kv, host_blocks=2)
    ctx = Context("a", list(range(8)))
    ctx.table.blocks = [blocks.allocate(), blocks.allocate()]
    ctx.num_computed = 8
    assert sw.swap_out(ctx)
    sw.issue(None)
    sw.land()
    assert ctx.table.blocks == [-1, -1] and blocks.num_free == 2
    others = [blocks.allocate(), blocks.allocate()]  # another context took the device meanwhile
    sw.swap_in(ctx)
    n_out, n_in, failed = sw.issue(None, make_room=lambda: False, can_wait=True)
    assert (n_in, failed) == (0, []) and len(sw.queue_in) == 2 and len(ctx.host) == 2  # waits, host copy kept
    blocks.decref(others[0])                         # the other work freed a block
    n_out, n_in, failed = sw.issue(None, make_room=lambda: False, can_wait=True)
    assert (n_in, failed) == (1, []) and len(sw.queue_in) == 1
    n_out, n_in, failed = sw.issue(None, make_room=lambda: False, can_wait=False)
    assert failed == [ctx]                           # nothing else runs: recompute rather than stall


class SeeingPreserve(Preserve):
    """Preserve, keeping what each plan saw: C_other, and the running contexts then (read on the engine thread)."""

    def __init__(self):
        super().__init__()
        self.eng = None
        self.seen = []

    def plan(self, paused, batch=BatchState(), now=0.0):
        running = [(c.id, c.num_computed, len(c.token_ids)) for c in self.eng.scheduler.active]
        self.seen.append((batch.context_tokens, running))
        return super().plan(paused, batch, now)


class SeeingFCFS(FCFS):
    """FCFS, keeping the RankState.batch_context_tokens of each order() and the running contexts then."""

    def __init__(self):
        self.eng = None
        self.seen = []

    def order(self, items, state=RankState()):
        running = [(c.id, c.num_computed, len(c.token_ids)) for c in self.eng.scheduler.active]
        self.seen.append((state.batch_context_tokens, running))
        return super().order(items, state)


def test_policies_see_c_other_as_the_running_contexts_device_kv(tiny_dirs):
    """C_other has one meaning (the simulator's too): the device KV of the
    contexts running at the decision, without the deciding (paused) one --
    not their token counts (a decoding context's newest token has no KV
    yet).  The interception policy and the ranking get the same number."""
    policy, ranking = SeeingPreserve(), SeeingFCFS()
    with engine(tiny_dirs, policy, ranking=ranking) as eng:
        policy.eng = ranking.eng = eng

        async def go():
            await asyncio.gather(agent(eng, "a", gap=0.3), background(eng, n=40))
            await drained(eng)

        run(go())
    for seen in (policy.seen, ranking.seen):
        alone = [(c_other, running[0]) for c_other, running in seen if [r[0] for r in running] == ["bg"]]
        decoding = [(c_other, kv) for c_other, (_, kv, toks) in alone if toks == kv + 1 and kv]
        assert decoding, seen
        assert all(c_other == kv for c_other, kv in decoding), decoding


class PredictingFCFS(FCFS):
    """FCFS whose predicted handling for the call is ``handling`` (as LAMPS' handling_at_call): the
    prediction of the segment that reached the call, gone once ``on_interception`` starts the next."""

    def __init__(self, handling):
        self.handling = handling
        self.asked = 0
        self.next_segment = False

    def handling_at_call(self, item):
        self.asked += 1
        return None if self.next_segment else self.handling

    def on_interception(self, item):
        self.next_segment = True


@pytest.mark.parametrize("predicted,policy,host,expected", [
    (Handling.PRESERVE, "discard", None, "preserve"),   # kept: the policy would discard it at every step
    (Handling.DISCARD, "preserve", None, "discard"),
    (Handling.SWAP, "preserve", None, "swap"),
    (Handling.SWAP, "preserve", BS, "discard"),         # the host pool cannot take it
    (None, "discard", None, "discard"),                 # no prediction: the policy decides
])
def test_the_rankings_handling_is_applied_at_the_call(tiny_dirs, predicted, policy, host, expected):
    """LAMPS' Algorithm 1 (lines 35-42): a ranking that predicts the call's
    handling has it applied at the call, instead of the interception
    policy's, and kept while the call runs (not planned afresh)."""
    ranking = PredictingFCFS(predicted)
    with engine(tiny_dirs, make_interception(policy, slow_link()), ranking=ranking, host_pool_tokens=host) as eng:
        async def go():
            res = await asyncio.gather(agent(eng, "a", gap=0.3), background(eng, n=30))
            stats = dict(eng.stats)
            await drained(eng)
            return res, stats

        ((ra, _), stats) = run(go())
    assert ranking.asked == 1
    assert {k for k, v in stats["handlings"].items() if v} == {expected}, stats["handlings"]
    assert stats["handlings"][expected] == 1
    assert (stats["recomputed_tokens"] > 0) is (expected == "discard")
    assert reference(tiny_dirs, {"a": ra})["a"] == ra


def test_swap_outs_go_first_then_swap_ins_by_original_arrival():
    """One rule with the simulator (InferCept 4.3): each step's swap budget
    goes to swap-outs first (they free device memory), then to swap-ins in
    the order the contexts first arrived, whatever the order of the resumes."""
    import torch

    from interlace.engine_ext.native.block_manager import BlockManager
    from interlace.engine_ext.native.sequence import Context, Interception
    from interlace.engine_ext.native.swap import SWAPPED, Swapper

    blocks = BlockManager(num_blocks=6, block_size=BS)
    sw = Swapper(blocks, torch.zeros(1, 2, 1, 6, BS, 1), host_blocks=6)

    def held(cid, arrival):
        ctx = Context(cid, list(range(8)), arrival=arrival)
        ctx.table.blocks = [blocks.allocate(), blocks.allocate()]
        ctx.num_computed = 8
        ctx.intercept = Interception(PauseHint(), 0.0)  # paused: what lands on the host stays there
        return ctx

    a, b = held("a", 1.0), held("b", 2.0)
    for ctx in (a, b):
        assert sw.swap_out(ctx)
    sw.issue(None)
    sw.land()
    c = held("c", 3.0)
    assert sw.swap_out(c)
    a.intercept = b.intercept = None
    sw.swap_in(b)   # b's call returned first
    sw.swap_in(a)
    n_out, n_in, failed = sw.issue(3)
    assert (n_out, n_in, failed) == (2, 1, [])
    assert a.table.blocks[0] != SWAPPED and b.table.blocks == [SWAPPED, SWAPPED]
    sw.land()
    n_out, n_in, _ = sw.issue(None)
    assert (n_out, n_in) == (0, 3)
    assert sw.land() == {a, b} and len(c.host) == 2
    sw.check([a, b, c])


@pytest.mark.parametrize("name", ["discard-chunked", "discard"])
def test_chunked_policy_caps_all_waiting_work_at_s(tiny_dirs, name):
    """Under chunked recomputation a step's waiting work -- a new prompt as
    much as a recomputation -- fills the step only up to S minus the
    decodes (InferCept 4.3; the simulator's rule); without it the token
    budget is the cap (a 10-token prompt is one chunk)."""
    s = 6
    with engine(tiny_dirs, make_interception(name, slow_link(saturation=s)), num_blocks=40) as eng:
        steps = []
        real = eng.runner.run

        def spy(batch):
            decodes = sum(1 for ch in batch.chunks if ch.num == 1 and ch.start > 0)
            steps.append((decodes, [(ch.ctx.id, ch.num) for ch in batch.chunks if not (ch.num == 1 and ch.start > 0)]))
            return real(batch)

        eng.runner.run = spy

        async def go():
            bg = asyncio.create_task(background(eng, n=30))
            while not eng.stats["decode_tokens"]:
                await asyncio.sleep(0.01)
            await eng.fill("a", PROMPTS["a"])  # 10 tokens while "bg" decodes
            await bg
            await drained(eng)

        run(go())
    chunks_a = [n for d, pre in steps for cid, n in pre if cid == "a"]
    assert sum(chunks_a) == len(PROMPTS["a"])
    if name == "discard-chunked":
        assert all(sum(n for _, n in pre) <= max(BS, s - d) for d, pre in steps if d), steps
        assert len(chunks_a) >= 2, steps
    else:
        assert chunks_a == [len(PROMPTS["a"])], steps


def test_a_waiting_context_never_preempts_a_running_prefill():
    """Admission as in vLLM (and the simulator): a context with nothing
    computed -- here a discarded one that keeps its early arrival, so FCFS
    ranks it first -- is admitted only into free memory; it does not
    preempt a running context part-way through its prefill (that made
    contexts thrash: preempted at 122 of 125 tokens, recomputed, preempted
    again).  It waits holding nothing, not even its prefix-cache match, and
    the running prefill ranked below it still gets its chunk."""
    from interlace.engine_ext.native.block_manager import BlockManager
    from interlace.engine_ext.native.scheduler import Scheduler
    from interlace.engine_ext.native.sequence import Context

    blocks = BlockManager(num_blocks=4, block_size=BS, hash_key=b"k")
    sched = Scheduler(blocks, FCFS(), max_batched_tokens=64)
    cached = Context("old", list(range(100, 104)))  # one full block left in the prefix cache
    cached.table.blocks = [blocks.allocate()]
    blocks.seal_full_blocks(cached.table, cached.token_ids, 4)
    blocks.release(cached.table)
    running = Context("running", list(range(8)) + list(range(200, 208)), arrival=2.0)
    running.table.blocks = [blocks.allocate(), blocks.allocate()]
    running.num_computed = 8                          # half-way through its prefill
    waiting = Context("waiting", list(range(100, 112)), arrival=1.0)  # 3 blocks, the first one cached
    for c in (waiting, running):
        sched.add(c)
    batch = sched.schedule()
    assert [(ch.ctx.id, ch.start, ch.num) for ch in batch.chunks] == [("running", 8, 8)]
    assert sched.num_preemptions == 0 and running.num_computed == 8
    assert waiting.table.blocks == [] and waiting.num_computed == 0 and not batch.failed


def test_kv_dropped_for_memory_is_counted_by_what_the_context_was_doing():
    """The simulator's counters, like for like: ``running_preemptions``
    (a running context preempted for memory: the simulator's
    ``preemptions``), ``paused_dropped`` (a preserved paused context's KV
    taken), ``idle_dropped``; a discard is a handling, not counted here."""
    from interlace.engine_ext.native.block_manager import BlockManager
    from interlace.engine_ext.native.scheduler import Scheduler
    from interlace.engine_ext.native.sequence import Context, Generation, Interception

    blocks = BlockManager(num_blocks=4, block_size=BS, hash_key=b"k")
    paused = Context("paused", list(range(50, 54)), num_computed=4)
    paused.gen = Generation(SamplingParams(), lambda ev: None, paused=True)
    paused.intercept = Interception(PauseHint(), 0.0)
    sched = Scheduler(blocks, FCFS(), max_batched_tokens=64, inactive=lambda: [paused])
    first = Context("first", list(range(16)), num_computed=8, arrival=1.0)   # needs 2 more blocks
    low = Context("low", list(range(20, 28)), num_computed=4, arrival=2.0)   # ranked below it
    for c, n in ((paused, 1), (first, 2), (low, 1)):
        c.table.blocks = [blocks.allocate() for _ in range(n)]
    sched.add(first)
    sched.add(low)
    batch = sched.schedule()
    assert [ch.ctx.id for ch in batch.chunks] == ["first"]
    assert sched.stats == {"running_preemptions": 1, "paused_dropped": 1, "idle_dropped": 0}
    assert sched.num_preemptions == 2
