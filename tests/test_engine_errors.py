"""Every typed engine error, each leaving the engine unchanged and serving."""

import pytest

from helpers import run
from interlace.engine_ext import errors as E
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.protocol import PauseHint, SamplingParams


@pytest.fixture(scope="module")
def eng(tiny_dirs):
    e = NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=64, max_model_len=48)
    yield e
    e.close()


async def snapshot(eng):
    st = await eng.check_invariants()
    return {k: st[k] for k in ("contexts", "used_blocks", "cached_blocks")}


async def still_serves(eng):
    await eng.fill("ok", [1, 2, 3])
    toks = [e.token_id async for e in eng.generate("ok", SamplingParams(max_tokens=3, ignore_eos=True))]
    await eng.free_context("ok")
    assert len(toks) == 3


CASES = [
    ("unknown context generate", lambda e: _gen(e, "nope"), E.ContextNotFound),
    ("unknown parent", lambda e: e.fill("c", [1], parent_context_id="nope"), E.ContextNotFound),
    ("free unknown", lambda e: e.free_context("nope"), E.ContextNotFound),
    ("pause unknown", lambda e: e.pause("nope", PauseHint()), E.ContextNotFound),
    ("resume unknown", lambda e: e.resume("nope", [1]), E.ContextNotFound),
    ("token above vocab", lambda e: e.fill("c", [1, 320]), E.InvalidTokens),
    ("negative token", lambda e: e.fill("c", [-1]), E.InvalidTokens),
    ("non-int token", lambda e: e.fill("c", [1, "2"]), E.InvalidTokens),
    ("empty prompt", lambda e: e.fill("c", []), E.InvalidTokens),
    ("prompt over limit", lambda e: e.fill("c", [1] * 49), E.ContextTooLong),
]


async def _gen(eng, cid, **kw):
    async for _ in eng.generate(cid, SamplingParams(max_tokens=2, **kw)):
        pass


@pytest.mark.parametrize("name,call,exc", CASES, ids=[c[0] for c in CASES])
def test_typed_error_leaves_state_unchanged(eng, name, call, exc):
    async def go():
        await eng.fill("base", [4, 5, 6, 7, 8])
        before = await snapshot(eng)
        with pytest.raises(exc):
            await call(eng)
        assert await snapshot(eng) == before
        await eng.free_context("base")
        await still_serves(eng)
        assert (await eng.check_invariants())["used_blocks"] == 0

    run(go())


def test_state_errors(eng):
    async def go():
        await eng.fill("p", [1, 2, 3, 4, 5])
        await eng.fill("kid", [6], parent_context_id="p")
        with pytest.raises(E.ContextHasChildren):
            await eng.free_context("p")
        with pytest.raises(E.ContextExists):
            await eng.fill("kid", [6], parent_context_id="p")
        with pytest.raises(E.InvalidContextState):
            await eng.resume("p", [1])  # not paused
        with pytest.raises(E.InvalidContextState):
            await eng.pause("p")  # not generating
        with pytest.raises(E.ContextTooLong):
            await eng.fill("p", [1] * 44)  # extension over the limit
        # extend a context whose generation is running: refused while busy
        agen = eng.generate("p", SamplingParams(max_tokens=30, ignore_eos=True))
        await agen.__anext__()
        with pytest.raises(E.ContextBusy):
            await eng.fill("p", [9])
        with pytest.raises(E.ContextBusy):
            await _gen(eng, "p")
        await agen.aclose()  # consumer leaves: generation aborted
        await eng.free_context("kid")
        await eng.free_context("p")
        assert (await eng.check_invariants())["used_blocks"] == 0
        await still_serves(eng)

    run(go())


def test_invalid_sampling():
    for kw in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"stop": [""]}):
        with pytest.raises(E.InvalidSampling):
            SamplingParams(**kw)


def test_stop_strings_need_tokenizer(eng):
    async def go():
        await eng.fill("t", [1, 2])
        with pytest.raises(E.InvalidSampling):
            await _gen(eng, "t", stop=["x"])
        await eng.free_context("t")

    run(go())


def test_idle_context_kv_is_dropped_and_recomputed(tiny_dirs):
    """An idle context's KV gives way to new work and is recomputed when used."""
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, num_blocks=8) as e:
        async def go():
            await e.fill("hog", [1] * 27)  # 7 of 8 blocks, then idle
            ref = await e.last_logits("hog")
            await e.fill("new", [2] * 10)  # needs 3 blocks: hog's KV is dropped
            st = await e.check_invariants()
            assert st["contexts"] == 2 and st["preemptions"] == 1
            await e.free_context("new")
            toks = [ev.token_id async for ev in e.generate("hog", SamplingParams(max_tokens=1, ignore_eos=True))]
            assert toks == [int(ref.argmax())]  # recomputed, same result
            await e.free_context("hog")
            assert (await e.check_invariants())["used_blocks"] == 0

        run(go())


def test_closed_engine(tiny_dirs):
    e = NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=64)
    e.close()
    with pytest.raises(E.EngineClosed):
        run(e.fill("x", [1]))
