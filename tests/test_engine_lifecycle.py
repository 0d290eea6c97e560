"""Cancellation, close and step failures: a caller who gives up, an engine
that shuts down, or a failed step never leaves a stream hanging, a context
decoding for nobody, or a fill applied behind its cancelled caller's back."""

import asyncio
import threading
import time

import pytest

from interlace.engine_ext import errors as E
from interlace.engine_ext.native import output as output_mod
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.protocol import SamplingParams

PROMPT = [5, 17, 33, 200, 7, 8, 9]


@pytest.fixture
def eng(tiny_dirs):
    # chunks of 4 tokens: a long fill takes many steps, so it can be cancelled half-done
    e = NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=1024, max_batched_tokens=4)
    yield e
    e.close()


async def tokens_of(eng, cid, n):
    return [ev.token_id async for ev in eng.generate(cid, SamplingParams(max_tokens=n, ignore_eos=True))]


def test_generate_cancelled_before_its_first_token_stops_decoding(eng):
    async def go():
        await eng.fill("g", PROMPT)
        task = asyncio.create_task(tokens_of(eng, "g", 480))
        await asyncio.sleep(0)  # the task is now waiting for the generate command
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3000):  # wait until the context is idle (an empty fill is refused while it generates)
            try:
                await eng.fill("g", [])
                break
            except E.ContextBusy:
                await asyncio.sleep(0.01)
        n = await eng.context_length("g")
        # stopped within a few steps, not decoded to max_tokens for nobody
        assert n - len(PROMPT) < 240, f"{n - len(PROMPT)} tokens decoded for a cancelled stream"
        await eng.free_context("g")
        assert (await eng.check_invariants())["used_blocks"] == 0

    asyncio.run(go())


@pytest.mark.parametrize("created", [False, True], ids=["extend", "create"])
def test_cancelled_fill_is_not_applied_and_can_be_retried(eng, created):
    long = [(3 * i) % 300 + 1 for i in range(200)]  # 50 steps of 4 tokens

    async def go():
        if not created:
            await eng.fill("f", PROMPT)
        base = 0 if created else len(PROMPT)
        task = asyncio.create_task(eng.fill("f", long))
        await asyncio.sleep(0.02)  # part of it computed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        if created:
            with pytest.raises(E.ContextNotFound):
                await eng.context_length("f")
        else:
            assert await eng.context_length("f") == base
        assert await eng.fill("f", long) == base + len(long)  # the retry adds the tokens once
        logits = await eng.last_logits("f")
        await eng.fill("ref", ([] if created else PROMPT) + long)  # the same tokens, never cancelled
        ref = await eng.last_logits("ref")
        assert (logits - ref).abs().max() < 1e-4
        for c in ("f", "ref"):
            await eng.free_context(c)
        assert (await eng.check_invariants())["used_blocks"] == 0

    asyncio.run(go())


def test_fill_completed_while_its_caller_was_cancelled_is_undone(eng):
    """The engine finished the fill, but the caller's cancellation came first
    on the event loop: the caller sees CancelledError, so the fill must not
    stay applied."""
    async def go():
        await eng.fill("f", PROMPT)
        task = asyncio.create_task(eng.fill("f", [1, 2, 3]))
        await asyncio.sleep(0)  # waiting for the engine
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (eng.contexts["f"].fill_waiters or
                                               eng.contexts["f"].num_uncomputed):
            time.sleep(0.01)  # the loop is blocked: the engine completes the fill meanwhile
        assert not eng.contexts["f"].fill_waiters
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await eng.context_length("f") == len(PROMPT)
        assert await eng.fill("f", [1, 2, 3]) == len(PROMPT) + 3

    asyncio.run(go())


def test_later_fill_on_a_cancelled_fill_fails_typed(eng):
    long = [(5 * i) % 300 + 1 for i in range(120)]  # 30 steps of 4 tokens

    async def go():
        await eng.fill("f", PROMPT)
        run = eng.runner.run

        def slow_run(batch):  # >= 0.6 s for the long fill: the cancel below lands half-way even on a busy machine
            time.sleep(0.02)
            return run(batch)
        eng.runner.run = slow_run
        first = asyncio.create_task(eng.fill("f", long))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(eng.fill("f", [1, 2]))  # builds on the first
        await asyncio.sleep(0.01)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(E.FillCancelled):
            await second
        assert await eng.context_tokens("f") == PROMPT

    asyncio.run(go())


class _CloseInTheWindow:
    """Wraps the engine's command queue so that the first command a caller
    queues lands just after another thread has closed the engine: the race
    between a caller's "is it closed?" check and its put, made certain."""

    def __init__(self, eng):
        self.eng, self.q, self.fired = eng, eng._cmds, False

    def put(self, item):
        if item is not None and not self.fired:
            self.fired = True
            closer = threading.Thread(target=self.eng.close)
            closer.start()
            closer.join()
        self.q.put(item)

    def __getattr__(self, name):
        return getattr(self.q, name)


def test_command_queued_after_close_raises(tiny_dirs):
    eng = NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=64)
    eng._cmds = _CloseInTheWindow(eng)

    async def go():
        with pytest.raises(E.EngineClosed):
            await asyncio.wait_for(eng.fill("x", [1, 2]), 10)
        with pytest.raises(E.EngineClosed):
            await eng.fill("x", [1, 2])  # and every later call

    asyncio.run(go())


def test_close_ends_waiting_streams_and_fills(tiny_dirs):
    eng = NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=1024, max_batched_tokens=4)

    async def go():
        await eng.fill("g", PROMPT)
        events = []

        async def consume():
            async for ev in eng.generate("g", SamplingParams(max_tokens=400, ignore_eos=True)):
                events.append(ev)

        stream = asyncio.create_task(consume())
        fill = asyncio.create_task(eng.fill("f", [i % 300 + 1 for i in range(499)]))  # 125 steps of 4
        while not events:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(eng.close)
        await asyncio.wait_for(stream, 10)
        assert events[-1].finish_reason == "abort"
        with pytest.raises(E.EngineClosed):
            await asyncio.wait_for(fill, 10)

    asyncio.run(go())


def test_step_error_reaches_every_stream(eng, monkeypatch):
    """A step that fails while sampling contexts taken off the ready list
    (a generate right after a fill) must fail their streams, not drop them."""
    real_sample = output_mod.sample
    target = SamplingParams(max_tokens=5, ignore_eos=True)
    calls = []

    def failing_sample(logits, gens):
        if any(g.sampling is target for g in gens) and not calls:
            calls.append(1)
            raise RuntimeError("injected step failure")
        return real_sample(logits, gens)

    async def go():
        await eng.fill("a", PROMPT)
        await eng.fill("b", PROMPT[:4])
        b_events = []

        async def run_b():
            async for ev in eng.generate("b", SamplingParams(max_tokens=400, ignore_eos=True)):
                b_events.append(ev)

        b = asyncio.create_task(run_b())
        while not b_events:
            await asyncio.sleep(0.001)
        monkeypatch.setattr(output_mod, "sample", failing_sample)
        with pytest.raises(E.EngineError, match="injected"):
            await asyncio.wait_for(tokens_of_params(eng, "a", target), 10)
        with pytest.raises(E.EngineError, match="injected"):  # b was running in the failed step too
            await asyncio.wait_for(b, 10)
        monkeypatch.setattr(output_mod, "sample", real_sample)
        assert len(await tokens_of(eng, "a", 3)) == 3  # the engine still serves
        for c in ("a", "b"):
            await eng.free_context(c)
        assert (await eng.check_invariants())["used_blocks"] == 0

    asyncio.run(go())


async def tokens_of_params(eng, cid, sp):
    return [ev.token_id async for ev in eng.generate(cid, sp)]
