"""Engine protocol conformance: what every implementation of
``engine_ext.protocol.Engine`` must do, stated once and run against each
engine kind on the embedded SmolLM2-135M model (float32).

Engines (the module-scoped ``engine`` fixture, one per id, started once and
closed by the last test): ``native`` (NativeEngine), ``native-process``
(ProcessEngine: the native engine in a worker process), ``replicas``
(ReplicaSet over two native engines) and ``vllm`` (the vLLM-backed engine).

Run only this suite::

    .venv/bin/python -m pytest tests/test_engine_conformance.py
    .venv/bin/python -m pytest tests/test_engine_conformance.py -k native-process   # one engine

Each behaviour is its own test.  Greedy results are compared with the same
engine's own greedy run of the same tokens in a fresh context, never with
another engine's, so engines may differ in numerics but not in semantics.
Every wait is bounded (``T``): a hang fails the test instead of blocking.
All tests of the module share one event loop (engines may bind to the loop
they were started on).  Context ids are tuples, as the gateway's are.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import pytest
import pytest_asyncio

from interlace.engine_ext import errors as E
from interlace.engine_ext.tokenizer import Tokenizer
from interlace.engine_ext.protocol import Engine, RequestHint, SamplingParams, TokenEvent

pytestmark = pytest.mark.asyncio(loop_scope="module")

T = 60.0  # seconds any one wait may take


# ------------------------------------------------------------------ engines
def _native(smol_dir: Path):
    from interlace.engine_ext.native.engine import NativeEngine

    return NativeEngine.load(smol_dir, dtype="float32", kv_cache_tokens=4096)


def _native_process(smol_dir: Path):
    from interlace.engine_ext.worker import ProcessEngine

    return ProcessEngine.start({"path": str(smol_dir), "dtype": "float32", "kv_cache_tokens": 4096}, None)


def _replicas(smol_dir: Path):
    from interlace.engine_ext.replicas import ReplicaSet

    return ReplicaSet([_native(smol_dir), _native(smol_dir)])


def _vllm(smol_dir: Path):
    from interlace.engine_ext.vllm import load_vllm_engine

    return load_vllm_engine({"kind": "vllm", "model": str(smol_dir), "dtype": "float32", "enforce_eager": True,
                             "kv_cache_space_gb": 1, "max_model_len": 2048}, str(smol_dir), None)


def _vllm_keep(smol_dir: Path):
    """vLLM keeping each context's KV between segments (pins: engine_ext/vllm/pins.py)."""
    from interlace.engine_ext.policies import PolicySpec
    from interlace.engine_ext.vllm import load_vllm_engine

    return load_vllm_engine({"kind": "vllm", "model": str(smol_dir), "dtype": "float32", "enforce_eager": True,
                             "kv_cache_space_gb": 1, "max_model_len": 2048}, str(smol_dir),
                            PolicySpec(ranking="fcfs", interception="preserve"))


ENGINES = {"native": _native, "native-process": _native_process, "replicas": _replicas, "vllm": _vllm,
           "vllm-keep": _vllm_keep}


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


async def close_engine(engine: Any) -> None:
    await asyncio.wait_for(_maybe_await(engine.close()), T)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(ENGINES), ids=list(ENGINES))
async def engine(request, smol_dir):
    eng = await _maybe_await(ENGINES[request.param](smol_dir))
    try:
        yield eng
    finally:
        await close_engine(eng)  # the last test closed it already: close() must be idempotent


@pytest.fixture(scope="module")
def tok(smol_dir) -> Tokenizer:
    """The model's tokenizer, independent of any engine."""
    return Tokenizer(Path(smol_dir), json.loads((Path(smol_dir) / "config.json").read_text()))


@pytest.fixture(scope="module")
def vocab_size(smol_dir) -> int:
    return json.loads((Path(smol_dir) / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def prompts(tok) -> dict:
    return {
        # greedy: " Berlin. The capital of the United States is New York City.", no EOS within 16 tokens
        "plain": tok.encode("The capital of France is Paris. The capital of Germany is"),
        # greedy: "2 + 2 = 4" then EOS
        "eos": tok.encode_chat([{"role": "user", "content": "What is 2+2? Answer with a number only."}]),
        # 39 tokens: more than two KV blocks of 16
        "chat": tok.encode_chat([{"role": "user", "content": "Count from 1 to 20."}]),
    }


class Contexts:
    """Unique tuple context ids for one test; whatever the test leaves is
    freed afterwards (children before parents), so one failing test does not
    disturb the next or the leak check at the end."""

    def __init__(self, engine: Any, test: str):
        self.engine, self.test, self.made = engine, test, []

    def new(self, name: str) -> tuple:
        cid = ("conformance", self.test, name, len(self.made))
        self.made.append(cid)
        return cid

    async def cleanup(self) -> None:
        for cid in reversed(self.made):
            try:
                await asyncio.wait_for(self.engine.free_context(cid), T)
            except (E.ContextNotFound, E.EngineClosed):
                pass


@pytest_asyncio.fixture(loop_scope="module")
async def ctx(engine, request):
    c = Contexts(engine, request.node.originalname)
    yield c
    await c.cleanup()


# ------------------------------------------------------------------ helpers
async def w(aw: Any, t: float = T) -> Any:
    return await asyncio.wait_for(aw, t)


def sp(n: int, **kw: Any) -> SamplingParams:
    """Greedy, ``n`` tokens, EOS ignored unless said otherwise."""
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=n, **kw)


async def events(engine: Any, cid: Any, sampling: SamplingParams, **kw: Any) -> List[TokenEvent]:
    async def run() -> List[TokenEvent]:
        return [ev async for ev in engine.generate(cid, sampling, **kw)]

    return await w(run())


def ids(evs: Sequence[TokenEvent]) -> List[int]:
    return [e.token_id for e in evs if e.token_id is not None]


def text(evs: Sequence[TokenEvent]) -> str:
    return "".join(e.text for e in evs)


async def greedy(engine: Any, ctx: Contexts, tokens: Sequence[int], n: int) -> List[int]:
    """The engine's own greedy ``n`` tokens after ``tokens``, in a fresh context."""
    cid = ctx.new("reference")
    await w(engine.fill(cid, list(tokens)))
    out = ids(await events(engine, cid, sp(n)))
    await w(engine.free_context(cid))
    assert len(out) == n
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ref_plain(engine, prompts) -> List[int]:
    """Greedy 10 tokens after the plain prompt (the stop / pause tests pick their strings from it)."""
    cid = ("conformance", "ref_plain")
    await w(engine.fill(cid, prompts["plain"]))
    try:
        return ids(await events(engine, cid, sp(10)))
    finally:
        await w(engine.free_context(cid))


async def length(engine: Any, cid: Any) -> int:
    """The context's length, seen through the protocol only: extend it by one token."""
    return await w(engine.fill(cid, [198])) - 1


async def absent(engine: Any, cid: Any) -> bool:
    try:
        await w(engine.free_context(cid))
    except E.ContextNotFound:
        return True
    return False


async def still_serves(engine: Any, ctx: Contexts, prompts: dict) -> None:
    cid = ctx.new("still-serves")
    assert await w(engine.fill(cid, prompts["plain"])) == len(prompts["plain"])
    evs = await events(engine, cid, sp(3))
    assert len(ids(evs)) == 3 and evs[-1].finish_reason == "length"
    await w(engine.free_context(cid))


async def engine_stats(engine: Any) -> Optional[dict]:
    """The engine's load (kv_blocks_used, running, waiting): its ``load_stats()``."""
    return await _maybe_await(engine.load_stats())


async def settled_stats(engine: Any, timeout: float = 10.0, *, empty: bool = False) -> dict:
    """``stats()`` once nothing is running or waiting (an aborted stream may
    take a step to leave the batch) and, with ``empty``, no KV block is in
    use: a process engine's stats are a snapshot its child sends every
    ``STATS_INTERVAL_S``, so one read just after a free can still count the
    freed blocks.  Returns the last read if that does not happen in time."""
    st = await engine_stats(engine)
    assert isinstance(st, dict) and {"running", "waiting", "kv_blocks_used"} <= set(st), (
        f"engine.load_stats() must return a dict with kv_blocks_used, running, waiting; got {st!r}")
    deadline = time.monotonic() + timeout
    while (st["running"] or st["waiting"] or (empty and st["kv_blocks_used"])) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        st = await engine_stats(engine)
    return st


async def invariants(engine: Any) -> Optional[dict]:
    fn = getattr(engine, "check_invariants", None)
    return await w(_maybe_await(fn())) if callable(fn) else None


# ------------------------------------------------------------------ the protocol itself
async def test_is_an_engine(engine):
    assert isinstance(engine, Engine)
    for name in ("fill", "free_context", "pause", "resume", "park", "truncate", "computed_tokens"):
        assert inspect.iscoroutinefunction(getattr(engine, name)), f"{name} must be a coroutine function"
    assert callable(engine.close)


# ------------------------------------------------------------------ fill / fork / free
async def test_fill_returns_the_context_length_and_a_second_fill_extends_it(engine, ctx, prompts):
    a, p = ctx.new("a"), prompts["plain"]
    assert await w(engine.fill(a, p[:5])) == 5
    assert await w(engine.fill(a, p[5:])) == len(p)
    assert await w(engine.fill(a, [11, 12, 13])) == len(p) + 3


async def test_fork_fill_starts_from_the_parents_tokens(engine, ctx, prompts):
    p, c = ctx.new("parent"), ctx.new("child")
    n = len(prompts["plain"])
    await w(engine.fill(p, prompts["plain"]))
    assert await w(engine.fill(c, [11, 12], parent_context_id=p)) == n + 2
    assert await length(engine, p) == n  # the parent is not extended by its child's fill
    assert await length(engine, c) == n + 2


async def test_empty_fork_fill_copies_the_parent(engine, ctx, prompts):
    """The gateway forks with no new tokens when a call's whole prompt is a shared prefix."""
    p, c = ctx.new("parent"), ctx.new("child")
    await w(engine.fill(p, prompts["plain"]))
    assert await w(engine.fill(c, [], parent_context_id=p)) == len(prompts["plain"])
    assert ids(await events(engine, c, sp(6))) == await greedy(engine, ctx, prompts["plain"], 6)


async def test_fork_into_an_existing_id_raises_context_exists(engine, ctx, prompts):
    p, c = ctx.new("parent"), ctx.new("existing")
    await w(engine.fill(p, prompts["plain"]))
    await w(engine.fill(c, [5, 6, 7]))
    with pytest.raises(E.ContextExists):
        await w(engine.fill(c, [8], parent_context_id=p))
    with pytest.raises(E.ContextExists):
        await w(engine.fill(p, [8], parent_context_id=p))
    with pytest.raises(E.ContextExists):
        await events(engine, c, sp(2), parent_context_id=p)
    assert await length(engine, c) == 3  # unchanged
    await w(engine.free_context(p))  # and no child was left behind on the parent


async def test_free_of_a_parent_with_live_children_raises_context_has_children(engine, ctx, prompts):
    p, c = ctx.new("parent"), ctx.new("child")
    await w(engine.fill(p, prompts["plain"]))
    await w(engine.fill(c, [11], parent_context_id=p))
    with pytest.raises(E.ContextHasChildren):
        await w(engine.free_context(p))
    assert await length(engine, p) == len(prompts["plain"])  # still there, still usable
    await w(engine.free_context(c))
    await w(engine.free_context(p))  # no live children any more
    assert await absent(engine, p)


async def test_free_of_an_unknown_id_raises_context_not_found(engine, ctx):
    with pytest.raises(E.ContextNotFound):
        await w(engine.free_context(ctx.new("never-filled")))


async def test_calls_after_free_raise_context_not_found(engine, ctx, prompts):
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    await w(engine.free_context(a))
    calls = {
        "generate": lambda: events(engine, a, sp(2)),
        "free_context": lambda: engine.free_context(a),
        "fork from it": lambda: engine.fill(ctx.new("child"), [5], parent_context_id=a),
        "generate forking from it": lambda: events(engine, ctx.new("child"), sp(2), parent_context_id=a),
        "pause": lambda: engine.pause(a),
        "resume": lambda: engine.resume(a, [5]),
        "truncate": lambda: engine.truncate(a, 1),
        "computed_tokens": lambda: engine.computed_tokens(a),
    }
    for name, call in calls.items():
        with pytest.raises(E.ContextNotFound):
            await w(call())
            pytest.fail(f"{name} of a freed context did not raise ContextNotFound")
    # a fill (not a fork) of a freed id creates a new context: the old tokens are gone
    assert await w(engine.fill(a, [5, 6])) == 2


# ------------------------------------------------------------------ generate
async def test_greedy_output_equals_one_fill_of_the_same_tokens(engine, ctx, prompts, ref_plain):
    a, p = ctx.new("a"), prompts["plain"]
    await w(engine.fill(a, p[:4]))
    await w(engine.fill(a, p[4:9]))
    await w(engine.fill(a, p[9:]))
    assert ids(await events(engine, a, sp(8))) == ref_plain[:8]


async def test_generated_tokens_stay_in_the_context(engine, ctx, prompts):
    a, p = ctx.new("a"), prompts["plain"]
    more = [11, 12]
    await w(engine.fill(a, p))
    g = ids(await events(engine, a, sp(4)))
    assert await w(engine.fill(a, more)) == len(p) + 4 + len(more)
    assert ids(await events(engine, a, sp(6))) == await greedy(engine, ctx, p + g + more, 6)


async def test_greedy_output_of_a_fork_equals_a_fresh_context(engine, ctx, prompts, ref_plain):
    p, c = ctx.new("parent"), ctx.new("child")
    extra = [11, 12, 13]
    await w(engine.fill(p, prompts["plain"]))
    await w(engine.fill(c, extra, parent_context_id=p))
    assert ids(await events(engine, c, sp(6))) == await greedy(engine, ctx, prompts["plain"] + extra, 6)
    # the child's generation did not touch the parent (copy-on-write)
    assert ids(await events(engine, p, sp(6))) == ref_plain[:6]


async def test_generate_with_a_parent_forks_first(engine, ctx, prompts, ref_plain):
    p, c = ctx.new("parent"), ctx.new("child")
    n = len(prompts["plain"])
    await w(engine.fill(p, prompts["plain"]))
    assert ids(await events(engine, c, sp(6), parent_context_id=p)) == ref_plain[:6]
    assert await length(engine, c) == n + 6
    assert await length(engine, p) == n


async def test_max_tokens_ends_with_length_and_exactly_max_tokens_tokens(engine, ctx, prompts):
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    evs = await events(engine, a, sp(5, ignore_eos=False))
    assert len(evs) == 5 and all(e.token_id is not None for e in evs)
    assert [e.finish_reason for e in evs] == [None] * 4 + ["length"]


async def test_stop_string_ends_with_stop_and_is_not_in_the_text(engine, ctx, prompts, tok, ref_plain):
    """The stop string spans a token boundary, so its first part is held back
    and must not be emitted once the string completes."""
    full = tok.decode(ref_plain)
    for k in range(2, len(ref_plain)):
        b = len(tok.decode(ref_plain[:k - 1]))  # token k starts at b
        if len(tok.decode(ref_plain[:k])) >= b + 3 and b >= 1:
            stop = full[b - 1:b + 3]
            if full.find(stop) == b - 1:
                break
    else:
        pytest.fail(f"no usable stop string in {full!r}")
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    evs = await events(engine, a, sp(10, ignore_eos=False, stop=[stop]))
    assert evs[-1].finish_reason == "stop", (stop, evs[-1])
    assert text(evs) == full[:b - 1], stop
    assert stop not in text(evs)
    assert ids(evs) == ref_plain[:k]  # stopped at the token completing the string


async def test_stop_token_ids_end_with_stop_and_stay_in_the_context(engine, ctx, prompts, tok, ref_plain):
    k = next(i for i in range(2, len(ref_plain)) if ref_plain[i] not in ref_plain[:i])
    stop_id = ref_plain[k]
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    evs = await events(engine, a, sp(10, ignore_eos=False, stop_token_ids=[stop_id]))
    assert evs[-1].finish_reason == "stop"
    assert ids(evs) == ref_plain[:k + 1] and evs[-1].token_id == stop_id
    assert text(evs) == tok.decode(ref_plain[:k])  # the stop token's text is not part of it
    assert await length(engine, a) == len(prompts["plain"]) + k + 1  # but the token is in the context


async def test_eos_ends_with_stop_unless_ignore_eos(engine, ctx, prompts, tok):
    a, b = ctx.new("a"), ctx.new("b")
    await w(engine.fill(a, prompts["eos"]))
    evs = await events(engine, a, sp(16, ignore_eos=False))
    got = ids(evs)
    assert evs[-1].finish_reason == "stop" and got[-1] in tok.eos_token_ids, (
        f"expected EOS within 16 tokens: {tok.decode(got, skip_special_tokens=False)!r}")
    assert text(evs) == tok.decode(got[:-1]) and "<|im_end|>" not in text(evs)
    await w(engine.fill(b, prompts["eos"]))
    evs2 = await events(engine, b, sp(len(got) + 3, ignore_eos=True))
    assert evs2[-1].finish_reason == "length"
    assert ids(evs2)[:len(got)] == got and len(ids(evs2)) == len(got) + 3


async def test_seed_makes_sampling_reproducible(engine, ctx, prompts):
    """Temperature 1 with a seed: the same tokens run after run, alone or batched together."""
    s = sp(6, temperature=1.0, seed=1234)
    cids = [ctx.new(f"s{i}") for i in range(3)]
    for c in cids:
        await w(engine.fill(c, prompts["plain"]))
    first = ids(await events(engine, cids[0], s))
    together = await asyncio.gather(*(events(engine, c, sp(6, temperature=1.0, seed=1234)) for c in cids[1:]))
    assert [ids(e) for e in together] == [first, first]


async def test_event_texts_concatenate_to_the_decoded_tokens(engine, ctx, prompts, tok):
    a = ctx.new("a")
    await w(engine.fill(a, prompts["chat"]))  # "1. 1\n2. 2\n3. 3\n4": spaces and newlines
    evs = await events(engine, a, sp(16, skip_special_tokens=True))
    assert text(evs) == tok.decode(ids(evs), skip_special_tokens=True)


# ------------------------------------------------------------------ pause / resume
def _pause_string(tok: Tokenizer, ref: List[int]) -> tuple:
    """(k, s): ``s`` is the text of tokens k-2 and k-1, completed first by token k-1 (k tokens in all)."""
    for k in range(3, len(ref) - 3):
        start, end = tok.decode(ref[:k - 2]), tok.decode(ref[:k])
        s = end[len(start):]
        if len(s) >= 3 and s not in tok.decode(ref[:k - 1]):
            return k, s
    pytest.fail(f"no usable pause string in {tok.decode(ref)!r}")


async def _run_with_pause(engine, cid, sampling, on_paused: Callable) -> tuple:
    """(events before and including the first pause, events after it).  The
    first pause calls ``on_paused`` (which resumes); a later one (the model
    writes the pause string again) is resumed with no tokens, which must be
    transparent: the tokens after the first pause are one greedy run."""
    before: List[TokenEvent] = []
    after: List[TokenEvent] = []

    async def run():
        paused = False
        async for ev in engine.generate(cid, sampling):
            (after if paused else before).append(ev)
            if ev.paused:
                if paused:
                    await engine.resume(cid, [])
                else:
                    paused = True
                    await on_paused()

    await w(run())
    return before, after


async def test_pause_on_pauses_after_the_completing_token_and_resume_continues(engine, ctx, prompts, tok,
                                                                              ref_plain):
    k, s = _pause_string(tok, ref_plain)
    tool = tok.encode(" (tool: 42)")
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    before, after = await _run_with_pause(engine, a, sp(10, pause_on=[s]), lambda: engine.resume(a, tool))
    assert before and before[-1].paused and before[-1].finish_reason is None, before[-1:]
    assert text(before).endswith(s), (text(before), s)
    assert ids(before) == ref_plain[:k]  # no token decoded past the one completing s
    assert after and after[-1].finish_reason == "length"
    assert ids(after) == await greedy(engine, ctx, prompts["plain"] + ids(before) + tool, len(ids(after)))


async def test_max_tokens_counts_the_tokens_of_the_whole_stream_across_a_pause(engine, ctx, prompts, tok,
                                                                              ref_plain):
    k, s = _pause_string(tok, ref_plain)
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    before, after = await _run_with_pause(engine, a, sp(k + 3, pause_on=[s]), lambda: engine.resume(a, [11]))
    assert len(ids(before)) == k
    assert len(ids(after)) == 3 and after[-1].finish_reason == "length"


async def test_resume_takes_the_next_segments_hint_and_refuses_a_bad_one(engine, ctx, prompts, tok, ref_plain):
    """Issue 32: ``resume(hint=)`` on every engine.  A bad hint is refused
    (``InvalidSampling`` naming the field) leaving the context paused; a good
    one only informs the ranking: the stream goes on as without it."""
    k, s = _pause_string(tok, ref_plain)
    tool = [11, 12]
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))

    async def on_paused():
        with pytest.raises(E.InvalidSampling, match=r"hint\.future\[0\]"):
            await engine.resume(a, tool, hint=RequestHint(future=((1, None, -1),)))
        await engine.resume(a, tool, hint=RequestHint(expected_output=3, expected_tool="calc", expected_tool_s=0.5,
                                                      future=((4, None, 2),)))

    before, after = await _run_with_pause(engine, a, sp(k + 4, pause_on=[s]), on_paused)
    assert ids(before) == ref_plain[:k] and len(ids(after)) == 4
    assert ids(after) == await greedy(engine, ctx, prompts["plain"] + ids(before) + tool, 4)


async def test_explicit_pause_and_resume_continue_the_same_stream(engine, ctx, prompts):
    a = ctx.new("a")
    tool = [11, 12, 13]
    await w(engine.fill(a, prompts["plain"]))
    before: List[TokenEvent] = []
    after: List[TokenEvent] = []

    async def run():
        asked = paused = False
        async for ev in engine.generate(a, sp(10)):
            (after if paused else before).append(ev)
            if ev.paused:
                paused = True
                await engine.resume(a, tool)
            elif not asked:  # right after the first token: the rest of the stream is margin
                asked = True
                await engine.pause(a)

    await w(run())
    paused_at = [i for i, e in enumerate(before) if e.paused]
    assert paused_at == [len(before) - 1], "the stream must report the pause"
    assert before[-1].finish_reason is None
    assert 1 <= len(ids(before)) < 10, "the pause took effect before max_tokens"  # 10 tokens: pause() was ignored
    assert after, "the stream went on after resume"
    assert after[-1].finish_reason == "length"
    assert ids(after) == await greedy(engine, ctx, prompts["plain"] + ids(before) + tool, len(ids(after)))


async def test_resume_of_a_context_that_is_not_paused_raises_invalid_context_state(engine, ctx, prompts):
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    with pytest.raises(E.InvalidContextState):
        await w(engine.resume(a, [5]))  # idle
    agen = engine.generate(a, sp(12))
    try:
        await w(agen.__anext__())
        with pytest.raises(E.InvalidContextState):
            await w(engine.resume(a, [5]))  # generating
    finally:
        await w(agen.aclose())
    await still_serves(engine, ctx, prompts)


async def test_pause_of_a_context_that_is_not_generating_raises_invalid_context_state(engine, ctx, prompts):
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    with pytest.raises(E.InvalidContextState):
        await w(engine.pause(a))
    assert ids(await events(engine, a, sp(2))) != []  # still idle and usable


async def test_generate_or_fill_of_a_generating_context_raises_context_busy(engine, ctx, prompts, ref_plain):
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    agen = engine.generate(a, sp(8))
    try:
        first = await w(agen.__anext__())
        with pytest.raises(E.ContextBusy):
            await events(engine, a, sp(2))
        with pytest.raises(E.ContextBusy):
            await w(engine.fill(a, [5]))
        rest = [first] + [ev async for ev in agen]  # the running stream is not disturbed
    finally:
        await w(agen.aclose())
    assert ids(rest) == ref_plain[:8]


async def test_a_paused_context_is_busy(engine, ctx, prompts, tok, ref_plain):
    k, s = _pause_string(tok, ref_plain)
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))

    async def while_paused():
        with pytest.raises(E.ContextBusy):
            await events(engine, a, sp(2))
        with pytest.raises(E.ContextBusy):
            await w(engine.fill(a, [5]))
        await engine.resume(a, [11])

    before, after = await _run_with_pause(engine, a, sp(k + 2, pause_on=[s]), while_paused)
    assert ids(before) == ref_plain[:k] and after[-1].finish_reason == "length"


# ------------------------------------------------------------------ typed errors, nothing changed
async def test_token_ids_outside_the_vocabulary_raise_invalid_tokens(engine, ctx, prompts, vocab_size):
    new, old = ctx.new("new"), ctx.new("old")
    for bad in ([1, vocab_size], [-1], [5, vocab_size + 1000]):
        with pytest.raises(E.InvalidTokens):
            await w(engine.fill(new, bad))
        assert await absent(engine, new), f"fill {bad} created the context"
    await w(engine.fill(old, prompts["plain"]))
    with pytest.raises(E.InvalidTokens):
        await w(engine.fill(old, [5, vocab_size]))
    with pytest.raises(E.InvalidTokens):
        await w(engine.fill(new, [vocab_size], parent_context_id=old))
    assert await absent(engine, new)
    assert await length(engine, old) == len(prompts["plain"])
    await still_serves(engine, ctx, prompts)


async def test_an_empty_fill_of_a_new_context_raises_invalid_tokens(engine, ctx, prompts):
    a = ctx.new("a")
    with pytest.raises(E.InvalidTokens):
        await w(engine.fill(a, []))
    assert await absent(engine, a)
    await still_serves(engine, ctx, prompts)


async def test_a_context_too_long_raises_context_too_long(engine, ctx, prompts):
    """9000 tokens: over the model's 8192 positions and any KV cache of this module."""
    new, old = ctx.new("new"), ctx.new("old")
    huge = [5] * 9000
    with pytest.raises(E.ContextTooLong):
        await w(engine.fill(new, huge))
    assert await absent(engine, new)
    await w(engine.fill(old, prompts["plain"]))
    with pytest.raises(E.ContextTooLong):
        await w(engine.fill(old, huge))
    with pytest.raises(E.ContextTooLong):
        await w(engine.fill(new, huge, parent_context_id=old))
    assert await absent(engine, new)
    assert await length(engine, old) == len(prompts["plain"])
    await still_serves(engine, ctx, prompts)


async def test_sampling_params_out_of_range_raise_invalid_sampling():
    for kw in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1},
               {"stop": [""]}, {"pause_on": [""]}):
        with pytest.raises(E.InvalidSampling):
            SamplingParams(**kw)


async def test_generate_validates_sampling_params_changed_after_construction(engine, ctx, prompts):
    a = ctx.new("a")
    await w(engine.fill(a, prompts["plain"]))
    bad = sp(4)
    bad.top_p = 0.0  # SamplingParams is a mutable dataclass: the engine validates again
    with pytest.raises(E.InvalidSampling):
        await events(engine, a, bad)
    assert len(ids(await events(engine, a, sp(3)))) == 3  # the context stayed idle


# ------------------------------------------------------------------ truncate, computed_tokens
async def test_computed_tokens_after_a_fill_is_the_whole_context(engine, ctx, prompts):
    a = ctx.new("a")
    n = await w(engine.fill(a, prompts["chat"]))
    kept = await w(engine.computed_tokens(a))
    if getattr(engine, "whole_blocks_only", False):  # a prefix cache of whole blocks (protocol.computed_tokens)
        assert kept == n // engine.block_size * engine.block_size
    else:
        assert kept == n


async def test_cached_tokens_report_the_prefix_caches_hits_and_a_forks_parent(engine, ctx, tok):
    """What ``usage.prompt_tokens_details.cached_tokens`` is made of: the first event and the
    last of a stream say how many prompt tokens came from KV that existed -- none for a prompt
    nobody sent before, whole blocks (never the last token) for the same prompt again, and a
    fork's parent's KV; each generation counts only its own (they are reset when it ends)."""
    bs = getattr(engine, "block_size", None) or engine.replicas[0].engine.block_size  # a ReplicaSet: its replicas'
    prompt = tok.encode(f"{time.time_ns()} is a number nobody wrote before.")
    while len(prompt) <= 2 * bs + 1:  # two whole blocks and more (vLLM's CPU build: blocks of 128)
        prompt += tok.encode(" The sheep count one by one.")
    a, b, c = ctx.new("a"), ctx.new("b"), ctx.new("c")
    await w(engine.fill(a, prompt))
    evs = await events(engine, a, sp(2))
    assert evs[0].cached_tokens == evs[-1].cached_tokens == {"prefix_cache": 0, "fork": 0}
    await w(engine.fill(b, prompt))
    evs = await events(engine, b, sp(2))
    hit = evs[-1].cached_tokens["prefix_cache"]
    assert evs[0].cached_tokens == evs[-1].cached_tokens and evs[-1].cached_tokens["fork"] == 0
    assert hit == (len(prompt) - 1) // bs * bs  # every whole block before the prompt's last token
    assert (await events(engine, b, sp(2)))[-1].cached_tokens == {"prefix_cache": 0, "fork": 0}  # reported
    evs = await events(engine, c, sp(2), parent_context_id=b)
    assert 0 < evs[-1].cached_tokens["fork"] <= len(prompt) + 4 and evs[-1].cached_tokens["prefix_cache"] == 0


async def test_truncate_keeps_the_first_n_tokens(engine, ctx, prompts):
    a, p, n = ctx.new("a"), prompts["chat"], 35
    await w(engine.fill(a, p))
    await events(engine, a, sp(4))
    kept = await w(engine.truncate(a, n))
    assert isinstance(kept, int) and 0 <= kept <= n
    assert await w(engine.computed_tokens(a)) == kept
    if hasattr(engine, "context_tokens"):
        assert await w(engine.context_tokens(a)) == p[:n]
    g = ids(await events(engine, a, sp(6)))
    assert g == await greedy(engine, ctx, p[:n], 6)
    assert await length(engine, a) == n + 6


# ------------------------------------------------------------------ cancellation, leaks
async def test_closing_a_stream_early_leaves_the_context_usable_and_nothing_running(engine, ctx, prompts):
    a, p = ctx.new("a"), prompts["plain"]
    await w(engine.fill(a, p))
    agen = engine.generate(a, sp(16))
    got = [await w(agen.__anext__()), await w(agen.__anext__())]
    await w(agen.aclose())
    checked = False
    if await engine_stats(engine) is not None:
        st = await settled_stats(engine)
        assert st["running"] == 0 and st["waiting"] == 0, st
        checked = True
    if await invariants(engine) is not None:
        checked = True
    assert checked, "the engine has neither stats() nor check_invariants()"
    # usable: generation stopped at some point past the two tokens seen; cut back to them
    deadline = time.monotonic() + 10
    while True:
        try:
            kept = await w(engine.truncate(a, len(p) + 2))
            break
        except E.ContextBusy:
            assert time.monotonic() < deadline, "the context stayed busy after its stream was closed"
            await asyncio.sleep(0.05)
    assert kept <= len(p) + 2
    assert ids(await events(engine, a, sp(6))) == await greedy(engine, ctx, p + ids(got), 6)


async def test_a_consumer_cancelled_while_its_stream_starts_leaves_nothing_running(engine, ctx, prompts):
    """Cancelled at various points of generate's start: whatever the engine
    had begun is stopped, so the context is idle again (a new generate on it
    is not ContextBusy) and nothing keeps decoding."""
    a, p = ctx.new("a"), prompts["plain"]
    await w(engine.fill(a, p))
    for delay in (0, 0, 0.001, 0.005, 0.02, 0.05):
        async def first():
            agen = engine.generate(a, sp(400))
            try:
                return await agen.__anext__()
            finally:
                await agen.aclose()
        t = asyncio.ensure_future(first())
        await asyncio.sleep(delay)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        deadline = time.monotonic() + 10
        while True:  # the abort may land a moment later; it must land
            try:
                got = await w(events(engine, a, sp(1)))
                break
            except E.ContextBusy:
                assert time.monotonic() < deadline, f"still generating 10 s after a cancel at {delay} s"
                await asyncio.sleep(0.05)
        assert len(got) == 1
        await w(engine.truncate(a, len(p)))


async def test_nothing_leaked_once_every_context_is_freed(engine, ctx, prompts):
    """Runs after every other test of the engine but close: each test's
    contexts are freed by then."""
    st = await settled_stats(engine, empty=True)  # a block still used 10 s after the last free is a leak
    assert st["running"] == 0 and st["waiting"] == 0, st
    assert st["kv_blocks_used"] == 0, st
    inv = await invariants(engine)
    if isinstance(inv, dict):
        assert inv.get("contexts", 0) == 0 and inv.get("used_blocks", 0) == 0, inv
        assert inv.get("intercepted", 0) == 0, inv


# ------------------------------------------------------------------ close (keep last: it ends the engine)
async def test_calls_after_close_raise_engine_closed(engine, ctx, prompts):
    a, g = ctx.new("a"), ctx.new("running")
    await w(engine.fill(a, prompts["plain"]))
    await w(engine.fill(g, prompts["plain"]))
    agen = engine.generate(g, sp(16))
    await w(agen.__anext__())
    await close_engine(engine)
    # the running stream ends instead of hanging, with an "abort" event
    rest = await w(_drain(agen))
    assert rest and rest[-1].finish_reason == "abort", rest[-1:]
    calls = {
        "fill": lambda: engine.fill(a, [5]),
        "fill new": lambda: engine.fill(ctx.new("b"), [5]),
        "generate": lambda: events(engine, a, sp(2)),
        "free_context": lambda: engine.free_context(a),
        "pause": lambda: engine.pause(a),
        "resume": lambda: engine.resume(a, [5]),
        "truncate": lambda: engine.truncate(a, 1),
        "computed_tokens": lambda: engine.computed_tokens(a),
    }
    for name, call in calls.items():
        with pytest.raises(E.EngineClosed):
            await w(call())
            pytest.fail(f"{name} after close did not raise EngineClosed")
    await close_engine(engine)  # a second close is harmless


async def _drain(agen) -> List[TokenEvent]:
    return [ev async for ev in agen]
