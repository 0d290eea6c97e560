"""Token delivery in batches (issue 36): the events of one engine step reach
a consumer loop with one ``call_soon_threadsafe`` (one self-pipe write, one
wake-up), not one per token per stream; every stream's events still arrive
complete and in order, errors and aborts included, and none waits for a
later step.  Also across the process boundary (ProcessEngine)."""

import asyncio
import threading
import time

import pytest

from interlace.engine_ext import channel
from interlace.engine_ext import errors as E
from interlace.engine_ext.channel import Channel, Outbox
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.protocol import SamplingParams
from interlace.engine_ext.worker import ProcessEngine

N, T = 16, 8


class Broken:
    """A logits processor that fails on its ``fail_at``-th call (picklable: it crosses to a worker)."""

    def __init__(self, fail_at=3):
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, ids, logits):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("broken processor")
        return logits


def prompt(i, n=6):
    return [(7 * i + 3 * j) % 300 + 1 for j in range(n)]


def is_delivery(fn):
    """A callback that hands events to a consumer's queue: the outbox's, or
    the one-per-event ``queue.put_nowait`` it replaced."""
    return fn is channel._put_all or getattr(fn, "__name__", "") == "put_nowait"


class Wakeups:
    """Counts the loop's ``call_soon_threadsafe`` calls that deliver events,
    from other threads (the engine's, or a worker's reader), and the items each carried."""

    def __init__(self, loop):
        self.sizes = []
        orig = loop.call_soon_threadsafe

        def counting(fn, *args, **kw):
            if threading.current_thread() is not threading.main_thread() and is_delivery(fn):
                self.sizes.append(len(args[0]) if fn is channel._put_all else 1)
            return orig(fn, *args, **kw)
        loop.call_soon_threadsafe = counting


@pytest.fixture
def eng(tiny_dirs):
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=2048, max_batched_tokens=64) as e:
        yield e


async def collect(stream, timeout=60):
    async def go():
        return [ev async for ev in stream]
    return await asyncio.wait_for(go(), timeout)


def test_outbox_one_call_per_loop_in_order_and_closed_loops_skipped():
    other = asyncio.new_event_loop()
    th = threading.Thread(target=other.run_forever, daemon=True)
    th.start()
    gone = asyncio.new_event_loop()
    gone.close()

    async def go():
        loop = asyncio.get_running_loop()
        w = Wakeups(loop)
        here = [Channel() for _ in range(5)]
        async def make():
            return Channel()
        there = [asyncio.run_coroutine_threadsafe(make(), other).result() for _ in range(3)]
        assert there[0].loop is other
        dead = type("Dead", (), {"loop": gone, "queue": None})()
        ob = Outbox()

        def engine_thread():
            with ob.holding():
                with ob.holding():  # nested: nothing goes before the outermost block ends
                    for k in range(4):
                        for ch in here + [dead] + there:
                            ob.put(ch, k)
                assert w.sizes == []
            ob.put(here[0], "now")  # outside holding: at once, as Channel.emit
        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()
        assert w.sizes == [20, 1]  # this loop's 20 events in one call; "now" alone
        await asyncio.sleep(0)
        assert [[ch.queue.get_nowait() for _ in range(ch.queue.qsize())] for ch in here] == \
            [[0, 1, 2, 3, "now"]] + [[0, 1, 2, 3]] * 4

        async def read_there():
            return [[ch.queue.get_nowait() for _ in range(ch.queue.qsize())] for ch in there]
        assert asyncio.run_coroutine_threadsafe(read_there(), other).result() == [[0, 1, 2, 3]] * 3

    asyncio.run(go())
    other.call_soon_threadsafe(other.stop)
    th.join()
    other.close()


def test_a_decode_step_wakes_the_consumer_loop_once_not_once_per_stream(eng):
    async def go():
        for i in range(N):
            await eng.fill(i, prompt(i))
        w = Wakeups(asyncio.get_running_loop())
        s0 = eng.stats["steps"]
        sp = SamplingParams(max_tokens=T, ignore_eos=True, logprobs=True)
        runs = await asyncio.gather(*(collect(eng.generate(i, sp)) for i in range(N)))
        steps = eng.stats["steps"] - s0
        for i, evs in enumerate(runs):  # every stream: all its events, in order
            assert [e.finish_reason for e in evs] == [None] * (T - 1) + ["length"]
            assert [e.token_id for e in evs] == (await eng.context_tokens(i))[len(prompt(i)):]
        assert sum(w.sizes) == N * T
        # one wake-up per step that emitted (the first tokens may come from a step without a forward)
        assert len(w.sizes) <= steps + 1 < N * T // 4, (len(w.sizes), steps)
        assert max(w.sizes) >= N  # a full decode step: every stream's token in one call
    asyncio.run(go())


def test_the_last_event_of_a_step_does_not_wait_for_another_step(eng):
    """After its final token the engine has nothing to do and waits for a
    command: the step's events must have gone out already."""
    async def go():
        await eng.fill("a", prompt(1))
        await eng.fill("b", prompt(2))
        evs = await collect(eng.generate("a", SamplingParams(max_tokens=3, ignore_eos=True)), timeout=20)
        assert [e.finish_reason for e in evs] == [None, None, "length"]
        steps = eng.stats["steps"]
        await asyncio.sleep(0.2)
        assert eng.stats["steps"] == steps  # idle: nothing else was going to flush it
        # a shorter and a longer stream in one batch: the short one's finish comes with its step
        short = asyncio.create_task(collect(eng.generate("a", SamplingParams(max_tokens=2, ignore_eos=True))))
        gen_b = eng.generate("b", SamplingParams(max_tokens=200, ignore_eos=True))
        first_b = await asyncio.wait_for(gen_b.__anext__(), 20)
        assert [e.finish_reason for e in await asyncio.wait_for(short, 20)] == [None, "length"]
        assert first_b.finish_reason is None
        await gen_b.aclose()  # abort b
    asyncio.run(go())


def test_errors_and_aborts_mid_stream_arrive_in_order(eng):
    """A broken logits processor fails its stream alone; a failed step fails
    the rest, with one wake-up; an abandoned stream stops; every token
    emitted before the error arrives before it."""
    async def go():
        for i in range(6):
            await eng.fill(i, prompt(i))
        run, calls = eng.runner.run, [0]

        def failing_run(batch):
            calls[0] += 1
            if calls[0] == 6:
                raise RuntimeError("device fault")
            return run(batch)
        eng.runner.run = failing_run
        w = Wakeups(asyncio.get_running_loop())
        long = SamplingParams(max_tokens=50, ignore_eos=True)

        async def until_error(i, sp):
            evs = []
            with pytest.raises(E.EngineError) as ei:
                async for ev in eng.generate(i, sp):
                    evs.append(ev)
            return evs, ei.value

        async def leaves_early(i):
            async for ev in eng.generate(i, long):
                return ev

        broken = asyncio.wait_for(until_error(0, SamplingParams(max_tokens=50, ignore_eos=True,
                                                                 logits_processors=[Broken()])), 30)
        others = [asyncio.wait_for(until_error(i, long), 30) for i in range(1, 5)]
        (evs0, err0), *rest = await asyncio.gather(broken, *others)
        sizes = list(w.sizes)
        early = await asyncio.wait_for(leaves_early(5), 30)
        assert len(evs0) == 2 and "logits processor failed" in str(err0)
        for i, (evs, err) in zip(range(1, 5), rest):
            assert "engine step failed" in str(err) and evs
            assert all(e.finish_reason is None for e in evs)
            assert [e.token_id for e in evs] == (await eng.context_tokens(i))[len(prompt(i)):]
        assert sum(sizes) == 2 + 1 + sum(len(evs) + 1 for evs, _ in rest)
        assert sizes[-1] == 4  # the four failures of the failed step went out together
        assert early.finish_reason is None
        eng.runner.run = run
        await asyncio.sleep(0.1)
        assert (await eng.check_invariants())["contexts"] == 6
    asyncio.run(go())


def test_close_mid_stream_ends_every_stream_with_abort_in_one_delivery(tiny_dirs):
    eng = NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=2048)
    run = eng.runner.run

    def slow_run(batch):  # >= 4 s for the 400 tokens: close lands mid-stream
        time.sleep(0.01)
        return run(batch)
    eng.runner.run = slow_run

    async def go():
        for i in range(N):
            await eng.fill(i, prompt(i))
        w = Wakeups(asyncio.get_running_loop())
        sp = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [eng.generate(i, sp) for i in range(N)]
        firsts = [await asyncio.wait_for(s.__anext__(), 20) for s in streams]
        await asyncio.to_thread(eng.close)
        rests = [await collect(s, timeout=20) for s in streams]
        for first, rest in zip(firsts, rests):
            assert first.finish_reason is None
            assert [e.finish_reason for e in rest] == [None] * (len(rest) - 1) + ["abort"]
        assert w.sizes[-1] == N  # the aborts of close: one call
        assert sum(w.sizes) == N + sum(len(r) for r in rests)
    asyncio.run(go())


def test_the_worker_sends_a_steps_events_together(tiny_dirs):
    eng = ProcessEngine.start({"path": str(tiny_dirs["llama"][0]), "threads": 1, "block_size": 4,
                               "kv_cache_tokens": 2048, "max_batched_tokens": 64}, name="delivery")
    try:
        async def go():
            for i in range(N):
                await eng.fill(i, prompt(i))
            w = Wakeups(asyncio.get_running_loop())
            sp = SamplingParams(max_tokens=T, ignore_eos=True)
            runs = await asyncio.gather(*(collect(eng.generate(i, sp)) for i in range(N)))
            for i, evs in enumerate(runs):
                assert [e.finish_reason for e in evs] == [None] * (T - 1) + ["length"]
                assert [e.token_id for e in evs] == (await eng.context_tokens(i))[len(prompt(i)):]
            sizes = list(w.sizes)
            # a stream's error mid-batch: its tokens, then the error, while the others finish
            await eng.fill("x", prompt(99))
            broken = eng.generate("x", SamplingParams(max_tokens=T, ignore_eos=True, logits_processors=[Broken()]))
            evs_x = []

            async def until_error():
                with pytest.raises(E.EngineError, match="broken processor"):
                    async for ev in broken:
                        evs_x.append(ev)
            more = SamplingParams(max_tokens=4, ignore_eos=True)
            again = await asyncio.gather(until_error(), *(collect(eng.generate(i, more)) for i in range(4)))
            assert len(evs_x) == 2 and [e.token_id for e in evs_x] == (await eng.context_tokens("x"))[-2:]
            assert all(len(r) == 4 and r[-1].finish_reason == "length" for r in again[1:])
            # N*T events (and up to N ends, dropped once a stream returned): a few calls per step, not one per event
            assert N * T <= sum(sizes) <= N * T + N
            assert len(sizes) < N * T // 4, sizes
            assert max(sizes) >= N // 2
        asyncio.run(go())
    finally:
        eng.close()


def test_an_unreadable_batch_fails_its_streams_not_the_worker():
    """The parent cannot unpickle a batch's payloads (say, a class only the
    child has): each of its calls gets an error of its own; the reader goes on."""
    import pickle

    fake = type("P", (), {"name": "tiny"})()
    ids = [("ev", 3), ("end", 4)]
    good = ProcessEngine._decode(fake, "evs", None, pickle.dumps((ids, pickle.dumps([1, None]))))
    assert good == [("ev", 3, 1), ("end", 4, None)]
    unreadable = b"cno_such_module_here\nMissing\n."  # a pickled reference to a class this process lacks
    out = ProcessEngine._decode(fake, "evs", None, pickle.dumps((ids, unreadable)))
    assert [(k, c) for k, c, _ in out] == [("err", 3), ("err", 4)]
    assert all(isinstance(p, E.EngineError) and "could not be read" in str(p) for _, _, p in out)
    assert out[0][2] is not out[1][2]


def test_the_child_sends_a_turns_stream_messages_in_order_errors_alone():
    """What a loop turn's streams send goes out in order: events and ends in
    one ``evs`` message, an error alone at its place, and a call's answer
    after everything emitted before it."""
    import pickle

    from interlace.engine_ext.protocol import TokenEvent
    from interlace.engine_ext.worker import _ChildServer, _pack_error

    sent = []
    srv = _ChildServer(None, None, lambda kind, call_id, payload: sent.append((kind, call_id, payload)))
    evs = [TokenEvent(i, str(i), None) for i in range(4)]
    msgs = [("ev", 1, evs[0]), ("ev", 2, evs[1]), ("err", 1, _pack_error(ValueError("boom"))),
            ("ev", 2, evs[2]), ("ev", 3, evs[3]), ("end", 2, None)]

    async def go():
        for m in msgs:
            srv.send_stream(*m)
        srv.send("ok", 9, 42)
        await asyncio.sleep(0)
    asyncio.run(go())
    assert [k for k, _, _ in sent] == ["evs", "err", "evs", "ok"]
    fake = type("P", (), {"name": "tiny"})()
    got = [d for k, c, p in sent for d in ProcessEngine._decode(fake, k, c, pickle.dumps(p))]
    assert [(k, c) for k, c, _ in got] == [(k, c) for k, c, _ in msgs] + [("ok", 9)]
    assert [p for k, _, p in got if k == "ev"] == evs
    assert isinstance(got[2][2], ValueError) and str(got[2][2]) == "boom"
