"""Property tests: random sequences of fill / generate / fork / free / pause /
resume keep the block invariants and leak nothing."""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from interlace.engine_ext import errors as E
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.policies import AlwaysDiscard, AlwaysPreserve
from interlace.engine_ext.protocol import SamplingParams

TOK = st.lists(st.integers(0, 319), min_size=1, max_size=14)
OP = st.one_of(
    st.tuples(st.just("fill"), st.integers(0, 5), TOK),
    st.tuples(st.just("fork"), st.integers(0, 5), st.integers(0, 5), st.lists(st.integers(0, 319), max_size=6)),
    st.tuples(st.just("generate"), st.integers(0, 5), st.integers(1, 10)),
    st.tuples(st.just("intercept"), st.integers(0, 5), st.integers(1, 3), TOK),
    st.tuples(st.just("free"), st.integers(0, 5)),
)


@pytest.fixture(scope="module", params=["preserve", "discard"])
def engine(request, tiny_dirs):
    policy = AlwaysPreserve() if request.param == "preserve" else AlwaysDiscard()
    # a small cache so preemption and prefix-cache eviction happen too
    e = NativeEngine.load(tiny_dirs["llama"][0], block_size=4, num_blocks=16, max_model_len=60,
                          interception=policy, max_batched_tokens=16)
    yield e
    e.close()


async def apply(eng, op, live):
    kind, a = op[0], f"c{op[1]}"
    try:
        if kind == "fill":
            await eng.fill(a, op[2])
            live.add(a)
        elif kind == "fork":
            child = f"c{op[2]}"
            await eng.fill(child, op[3], parent_context_id=a)
            live.add(child)
        elif kind == "generate":
            async for _ in eng.generate(a, SamplingParams(max_tokens=op[2], ignore_eos=True)):
                pass
        elif kind == "intercept":  # generate, pause mid-way, resume with a "tool result", finish
            n = 0
            async for ev in eng.generate(a, SamplingParams(max_tokens=op[2] + 3, ignore_eos=True)):
                if ev.paused:
                    await eng.resume(a, op[3])
                    continue
                n += 1
                if n == op[2]:
                    await eng.pause(a)
        elif kind == "free":
            await eng.free_context(a)
            live.discard(a)
    except (E.ContextNotFound, E.ContextExists, E.ContextHasChildren, E.ContextTooLong,
            E.InvalidTokens, E.InvalidContextState, E.KVCacheExhausted):
        pass  # refused cleanly; the invariants below must still hold
    await eng.check_invariants()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OP, min_size=1, max_size=14))
def test_random_operations_keep_invariants(engine, ops):
    async def go():
        live = set()
        for op in ops:
            await apply(engine, op, live)
        # free everything, children before parents
        while live:
            for cid in sorted(live):
                try:
                    await engine.free_context(cid)
                    live.discard(cid)
                except E.ContextHasChildren:
                    pass
                except E.ContextNotFound:
                    live.discard(cid)
        st_ = await engine.check_invariants()
        assert st_["contexts"] == 0
        assert st_["used_blocks"] == 0  # zero leaked blocks

    asyncio.run(go())
