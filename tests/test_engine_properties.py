"""Property tests: several workers drive the engine at once, each with a
random program of fill / fork / generate / pause-resume / park / free on
its own contexts (forks read anyone's), under each interception handling:
preserve, discard (chunked recomputation), swap through the host pool with
a one-block-per-step budget, and InferCept's min-waste choice among them
(the hints' expected tool times make it choose each).  Parking is the
client-side retention: the next operation on a parked context, or a fork
from it, must find it as it was.  Every result is checked: lengths and token
lists against each worker's own model of its contexts, logits after a fill
and every greedily generated token against the transformers reference, the
block invariants after every operation, and nothing leaked at the end.

Errors are accepted only where the worker's model predicts them (or, for
facts another worker controls -- a fork's parent, children of a context --
where the state afterwards shows nothing was changed).  ``KVCacheExhausted``
is never legitimate here: every context fits in the cache alone
(``max_model_len`` 60 <= 16 blocks of 4) and idle and paused contexts can
always be dropped, so it is not caught.
"""

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from interlace.engine_ext import errors as E
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.policies import Profile, make_interception
from interlace.engine_ext.protocol import PauseHint, SamplingParams

LIMIT = 60
WORKERS = 3
OWN = 2  # contexts per worker: worker w owns c{2w}, c{2w+1}
TOK = st.lists(st.integers(0, 319), min_size=1, max_size=14)
WAITS = [0.0, 0.02]                  # seconds a tool (or client) takes: 0.02 lets a few steps plan it
EXPECTED = [None, 0.001, 2.0, 8.0, 100.0]  # expected tool s: unknown, short (preserve), no time to swap, long
OP = st.one_of(
    st.tuples(st.just("fill"), st.integers(0, OWN - 1), TOK),
    st.tuples(st.just("fork"), st.integers(0, WORKERS * OWN - 1), st.integers(0, OWN - 1),
              st.lists(st.integers(0, 319), max_size=6)),
    st.tuples(st.just("generate"), st.integers(0, OWN - 1), st.integers(1, 10)),
    st.tuples(st.just("intercept"), st.integers(0, OWN - 1), TOK, st.integers(1, 3), TOK, st.sampled_from(WAITS),
              st.sampled_from(EXPECTED)),
    st.tuples(st.just("park"), st.integers(0, OWN - 1), st.sampled_from(WAITS), st.sampled_from(EXPECTED)),
    st.tuples(st.just("free"), st.integers(0, OWN - 1)),
)

# one forward pass "takes" 1 s and moving one block 1 s: swaps go one block per step
SLOW_LINK = Profile(model="tiny", device="test", source="derived (test)", block_size=4, kv_bytes_per_token=1,
                    kv_capacity_tokens=64, max_batched_tokens=16, fwd_tokens=(1, 1000), fwd_seconds=(1.0, 1.0),
                    fwd_s_per_context_token=0.0, swap_s_per_block=1.0, saturation_tokens=8)


@pytest.fixture(scope="module", params=["preserve", "discard-chunked", "swap", "infercept"])
def engine(request, tiny_dirs):
    policy = make_interception(request.param, SLOW_LINK)
    # a small cache so preemption and prefix-cache eviction happen too; a host pool of 4 blocks, often full
    e = NativeEngine.load(tiny_dirs["llama"][0], block_size=4, num_blocks=16, max_model_len=LIMIT,
                          interception=policy, max_batched_tokens=16, host_pool_tokens=16)
    yield e
    e.close()


@pytest.fixture(scope="module")
def ref_model(tiny_dirs):
    return tiny_dirs["llama"][1]


class Worker:
    def __init__(self, eng, hf, w):
        self.eng, self.hf = eng, hf
        self.ids = [f"c{w * OWN + i}" for i in range(OWN)]
        self.known = {c: None for c in self.ids}  # this worker's view: the tokens, or None if absent

    def ref(self, tokens):
        with torch.no_grad():
            return self.hf(torch.tensor([tokens])).logits[0].float()

    def check_greedy(self, tokens, positions):
        """Each generated token is the reference's argmax (up to float noise)."""
        if not positions:
            return
        ref = self.ref(tokens)
        for p in positions:
            row = ref[p - 1]
            assert row[tokens[p]] >= row.max() - 1e-3, f"position {p}: {tokens[p]} vs {int(row.argmax())}"

    async def absent(self, cid):
        with pytest.raises(E.ContextNotFound):
            await self.eng.context_length(cid)

    async def run(self, ops):
        for op in ops:
            await getattr(self, op[0])(*op[1:])
            await self.eng.check_invariants()

    async def fill(self, i, tokens):
        cid, have = self.ids[i], self.known[self.ids[i]]
        if len(have or []) + len(tokens) > LIMIT:
            with pytest.raises(E.ContextTooLong):
                await self.eng.fill(cid, tokens)
            if have is None:
                await self.absent(cid)
            else:
                assert await self.eng.context_tokens(cid) == have
            return
        n = await self.eng.fill(cid, tokens)
        self.known[cid] = (have or []) + tokens
        assert n == len(self.known[cid])
        logits = await self.eng.last_logits(cid)  # None if preempted meanwhile
        if logits is not None:
            torch.testing.assert_close(logits, self.ref(self.known[cid])[-1], atol=1e-3, rtol=1e-3)

    async def fork(self, parent, i, tokens):
        pid, cid = f"c{parent}", self.ids[i]
        if self.known[cid] is not None:
            with pytest.raises(E.ContextExists):
                await self.eng.fill(cid, tokens, parent_context_id=pid)
            return
        try:
            await self.eng.fill(cid, tokens, parent_context_id=pid)
        except (E.ContextNotFound, E.ContextTooLong) as e:
            own = self.known.get(pid, "other")
            if own != "other":  # our own parent: the error must be predictable
                assert (own is None) == isinstance(e, E.ContextNotFound)
                assert isinstance(e, E.ContextNotFound) or len(own) + len(tokens) > LIMIT
            await self.absent(cid)
            return
        self.known[cid] = await self.eng.context_tokens(cid)
        assert len(self.known[cid]) <= LIMIT
        assert self.known[cid][len(self.known[cid]) - len(tokens):] == tokens
        if pid in self.known:
            assert self.known[cid] == self.known[pid] + tokens

    async def generate(self, i, n):
        cid, have = self.ids[i], self.known[self.ids[i]]
        sp = SamplingParams(max_tokens=n, ignore_eos=True)
        if have is None or len(have) >= LIMIT:
            with pytest.raises(E.ContextNotFound if have is None else E.ContextTooLong):
                async for _ in self.eng.generate(cid, sp):
                    pass
            return
        evs = [ev async for ev in self.eng.generate(cid, sp)]
        assert [e.finish_reason for e in evs] == [None] * (len(evs) - 1) + ["length"]
        assert len(evs) == min(n, LIMIT - len(have))
        seq = have + [e.token_id for e in evs]
        assert await self.eng.context_tokens(cid) == seq
        self.known[cid] = seq
        self.check_greedy(seq, range(len(have), len(seq)))

    async def intercept(self, i, prompt, n, tool, wait, expected):
        """Fill ``prompt``, generate, pause after ``n`` tokens, resume with
        a tool result after ``wait`` s, finish."""
        await self.fill(i, prompt)
        cid, have = self.ids[i], self.known[self.ids[i]]
        if have is None or len(have) >= LIMIT:
            return await self.generate(i, n)
        seq, gen_pos, pause_refused, resumed = list(have), [], False, False
        stream = self.eng.generate(cid, SamplingParams(max_tokens=n + 3, ignore_eos=True))
        try:
            async for ev in stream:
                if ev.token_id is not None:
                    seq.append(ev.token_id)
                    gen_pos.append(len(seq) - 1)
                if ev.paused:
                    assert not pause_refused
                    await asyncio.sleep(wait)
                    if len(seq) + len(tool) + 1 > LIMIT:
                        with pytest.raises(E.ContextTooLong):
                            await self.eng.resume(cid, tool)
                        break  # leaving the stream aborts the paused generation
                    await self.eng.resume(cid, tool)
                    seq += tool
                    resumed = True
                elif ev.finish_reason is None and len(gen_pos) == n and not resumed:
                    try:
                        await self.eng.pause(cid, PauseHint(tool="t", expected_duration_s=expected))
                    except E.InvalidContextState:  # finished (length) before the pause arrived
                        pause_refused = True
        finally:
            await stream.aclose()
        assert await self.eng.context_tokens(cid) == seq
        self.known[cid] = seq
        self.check_greedy(seq, gen_pos)

    async def park(self, i, wait, expected):
        """Leave an idle context as a client-side tool call leaves it."""
        cid, have = self.ids[i], self.known[self.ids[i]]
        if have is None:
            with pytest.raises(E.ContextNotFound):
                await self.eng.park(cid)
            return
        await self.eng.park(cid, PauseHint(tool="client", expected_duration_s=expected))
        await asyncio.sleep(wait)
        assert await self.eng.context_tokens(cid) == have
        assert await self.eng.computed_tokens(cid) <= len(have)

    async def free(self, i):
        cid = self.ids[i]
        if self.known[cid] is None:
            with pytest.raises(E.ContextNotFound):
                await self.eng.free_context(cid)
            return
        try:
            await self.eng.free_context(cid)
            self.known[cid] = None
        except E.ContextHasChildren:  # a fork by any worker
            assert await self.eng.context_tokens(cid) == self.known[cid]


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(programs=st.lists(st.lists(OP, max_size=8), min_size=WORKERS, max_size=WORKERS))
def test_concurrent_random_operations(engine, ref_model, programs):
    async def go():
        workers = [Worker(engine, ref_model, w) for w in range(WORKERS)]
        await asyncio.gather(*(wk.run(p) for wk, p in zip(workers, programs)))
        # free everything, children before parents
        live = {c for wk in workers for c, t in wk.known.items() if t is not None}
        while live:
            for cid in sorted(live):
                try:
                    await engine.free_context(cid)
                    live.discard(cid)
                except E.ContextHasChildren:
                    pass
        st_ = await engine.check_invariants()
        assert st_["contexts"] == 0 and st_["intercepted"] == 0
        assert st_["used_blocks"] == 0 and st_["host_used_blocks"] == 0  # zero leaked blocks

    asyncio.run(go())


WANTED = {"preserve": {"preserve"}, "discard-chunked": {"discard"}, "swap": {"swap"},
          "infercept": {"preserve", "swap", "discard"}}


def test_the_programs_exercised_each_handling(engine, request):
    """The random programs above really intercepted under this policy (runs
    after them on the same engine)."""
    name = request.node.callspec.params["engine"]
    done = {h for h, n in engine.stats["handlings"].items() if n}
    assert WANTED[name] <= done, f"{name}: handlings seen {done}"
