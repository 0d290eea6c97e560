"""ProcessEngine (engine_ext/worker.py): the native engine in a worker process.

Real child processes: a tiny random Llama for the mechanics (compared with
the same engine built in process), the embedded SmolLM2 for one greedy text
check against the in-process engine."""

import asyncio
import os
import signal
import time

import psutil
import pytest

from helpers import run
from interlace.engine_ext import errors as E
from interlace.engine_ext.constraints.forced import ForcedOutput
from interlace.engine_ext.native.setup import build_native_engine
from interlace.engine_ext.tokenizer import Tokenizer
from interlace.engine_ext.protocol import Engine, PauseHint, RequestHint, SamplingParams
from interlace.engine_ext.worker import ProcessEngine
from interlace.engine_ext.policies import PolicySpec

# small budgets: a 300-token fill takes many steps, so calls overlap with streams
ARGS = {"kv_cache_tokens": 2048, "max_batched_tokens": 16, "block_size": 16}
POLICY = PolicySpec(interception="infercept", ranking="lamps", profile="h100-llama-3-8b", swap_space_tokens=512)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def prompt(n, start=7):
    return [(start + 13 * i) % 300 + 1 for i in range(n)]


def no_child(pid):
    return pid not in {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def tiny_dir(tiny_dirs):
    return tiny_dirs["llama"][0]


@pytest.fixture(scope="module")
def worker(tiny_dir):
    eng = ProcessEngine.start({"path": str(tiny_dir), "threads": 1, **ARGS}, POLICY, name="tiny")
    yield eng
    eng.close()
    assert not eng.process.is_alive()


@pytest.fixture(scope="module")
def local(tiny_dir):
    """The same engine, built the same way, in this process."""
    eng = build_native_engine(tiny_dir, ARGS, POLICY)
    yield eng
    eng.close()


def test_start_applies_the_policy_and_reports_the_model(worker, local):
    assert isinstance(worker, Engine)
    assert worker.alive and worker.process.is_alive() and worker.pid != os.getpid()
    assert (worker.vocab_size, worker.max_model_len, worker.block_size, worker.name) == (
        local.vocab_size, local.max_model_len, local.block_size, local.name)
    assert worker.tokenizer is None  # the tiny model has no tokenizer.json, as in process
    assert worker.info["torch_threads"] == 1
    # built as gateway/models.py load_engine builds it: the objectives around the configured ranking
    assert (worker.info["interception"], worker.info["ranking"], worker.info["inner_ranking"]) == (
        type(local.interception).__name__, "ObjectiveRanking", type(local.scheduler.ranking.inner).__name__)
    assert worker.info["interception"] != "Preserve"


def test_greedy_tokens_equal_the_in_process_engine(worker, local):
    async def go(eng):
        await eng.fill("g", prompt(40))
        first = [ev async for ev in eng.generate("g", GREEDY)]
        # a fork generates from its parent's tokens without changing them
        forked = [ev async for ev in eng.generate("g-fork", GREEDY, parent_context_id="g")]
        tokens = await eng.context_tokens("g-fork")
        await eng.free_context("g-fork")
        await eng.free_context("g")
        return ([e.token_id for e in first], first[-1].finish_reason, [e.token_id for e in forked], tokens,
                [e.logprob for e in first])

    mine, theirs = run(go(worker)), run(go(local))
    assert mine[:4] == theirs[:4]
    assert mine[1] == "length" and len(mine[0]) == 12
    assert mine[4] == pytest.approx(theirs[4], abs=1e-4)


def test_fill_fork_generate_pause_resume_free(worker):
    async def go():
        assert await worker.fill("p", prompt(20)) == 20
        assert await worker.fill("c", prompt(5, 3), parent_context_id="p") == 25  # fork + extend
        assert await worker.context_length("c") == 25
        assert (await worker.context_tokens("c"))[:20] == prompt(20)
        events, paused_at = [], None
        stream = worker.generate("c", SamplingParams(max_tokens=30, ignore_eos=True), hint=RequestHint(app="t"))
        async for ev in stream:
            events.append(ev)
            if len(events) == 3:
                await worker.pause("c", PauseHint(tool="calc", expected_duration_s=0.1))
            if ev.paused:
                paused_at = len(await worker.context_tokens("c"))
                with pytest.raises(E.InvalidContextState):
                    await worker.pause("c")  # not generating any more
                await worker.resume("c", [9, 8, 7])
        assert paused_at is not None and events[-1].finish_reason == "length"
        generated = [e.token_id for e in events if e.token_id is not None]
        tokens = await worker.context_tokens("c")
        assert tokens[paused_at:paused_at + 3] == [9, 8, 7] and len(tokens) == 25 + 3 + len(generated)
        assert await worker.computed_tokens("p") == 20
        with pytest.raises(E.ContextHasChildren):
            await worker.free_context("p")
        assert await worker.truncate("c", 20) == 16  # whole blocks before the cut keep their KV
        await worker.park("c", PauseHint(tool="client"))
        worker.set_pause_hint("c", PauseHint(tool="client", expected_duration_s=2.0))
        worker.set_request_hint("c", RequestHint(objective="latency"))
        assert (await worker.last_logits("p")).shape == (worker.vocab_size,)
        await worker.free_context("c")
        await worker.free_context("p")
        worker.free_context_nowait("nobody")  # ignored, like in process
        with pytest.raises(E.ContextNotFound):
            await worker.context_tokens("p")
        assert (await worker.check_invariants())["contexts"] == 0

    run(go())


def test_typed_errors_cross_the_process_boundary_as_in_process(worker, local):
    async def failures(eng):
        await eng.fill("e", prompt(10))
        calls = [
            lambda: eng.free_context("missing"),                                      # ContextNotFound
            lambda: eng.fill("e", [], parent_context_id="e"),                         # ContextExists
            lambda: eng.fill("e2", [eng.vocab_size + 5]),                             # InvalidTokens
            lambda: eng.fill("e3", []),                                               # InvalidTokens (empty)
            lambda: eng.fill("e4", prompt(eng.max_model_len + 1)),                    # ContextTooLong
            lambda: eng.fill("e5", [1], hint=RequestHint(expected_output=-1)),        # InvalidSampling
            lambda: eng.resume("e", [1]),                                             # InvalidContextState
            lambda: anext(aiter(eng.generate("e", bad_sampling))),                    # InvalidSampling
            lambda: anext(aiter(eng.generate("missing", GREEDY))),                    # ContextNotFound
        ]
        out = []
        for call in calls:
            try:
                await call()
            except E.EngineError as e:
                out.append((type(e), str(e), getattr(e, "context_id", None)))
        await eng.free_context("e")
        return out

    bad_sampling = SamplingParams()
    bad_sampling.top_p = 0.0  # past the constructor's check: the engine's own validation refuses it
    mine, theirs = run(failures(worker)), run(failures(local))
    assert [t for t, _, _ in mine] == [E.ContextNotFound, E.ContextExists, E.InvalidTokens, E.InvalidTokens,
                                       E.ContextTooLong, E.InvalidSampling, E.InvalidContextState,
                                       E.InvalidSampling, E.ContextNotFound]
    assert mine == theirs  # same classes, same messages
    assert mine[0][2] == "missing"


def test_a_stream_does_not_block_other_calls_and_stats_see_it(worker):
    async def go():
        await worker.fill("s", prompt(8))
        stream = worker.generate("s", LONG)
        await anext(stream)
        # while it decodes: a 300-token fill (19 steps of 16 tokens) and reads on other contexts
        assert await worker.fill("other", prompt(300)) == 300
        assert len(await worker.context_tokens("other")) == 300
        stats = await worker.fetch_stats()  # now, a round trip
        assert {"kv_blocks_used", "kv_blocks_total", "queued_tokens", "running", "waiting"} <= set(stats)
        assert stats["running"] == 1 and stats["kv_blocks_total"] == 2048 // 16 and stats["kv_blocks_used"] > 0
        await asyncio.sleep(0.3)  # the child sends its load while it changes: stats() reads it without waiting
        assert worker.load_stats()["running"] == 1 and worker.load_stats()["kv_blocks_used"] > 0
        rest = [ev async for ev in stream]
        assert rest[-1].finish_reason == "length" and 1 + len(rest) == 400  # nothing lost on the way
        await worker.free_context("s")
        await worker.free_context("other")
        await asyncio.sleep(0.3)
        assert worker.load_stats()["running"] == 0 and worker.load_stats()["contexts"] == 0

    run(go())


def test_cancellation_aborts_streams_and_undoes_fills(worker):
    async def go():
        await worker.fill("x", prompt(8))
        stream = worker.generate("x", LONG)
        await anext(stream)
        await stream.aclose()  # the consumer stops early: aborted in the child, the context idle again
        assert await worker.fill("x", [1]) > 9

        # a fill cancelled before the child answers is undone: a context it created is gone
        os.kill(worker.pid, signal.SIGSTOP)  # the child reads the fill and the cancel only once resumed
        try:
            task = asyncio.ensure_future(worker.fill("y", prompt(300)))
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled()
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        with pytest.raises(E.ContextNotFound):
            await worker.context_tokens("y")

        # ... and so is one whose answer had already arrived when its caller was cancelled
        task = asyncio.ensure_future(worker.fill("x", [2, 3]))
        await asyncio.sleep(0)  # sent
        deadline = time.monotonic() + 30
        while worker._calls and time.monotonic() < deadline:  # this loop is blocked: the reader thread
            time.sleep(0.01)                                   # takes the answer, which waits in the loop's queue
        assert not worker._calls and not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        await asyncio.sleep(0.2)
        assert (await worker.context_tokens("x"))[-1] == 1  # [2, 3] taken back out
        await worker.free_context("x")
        assert (await worker.check_invariants())["contexts"] == 0

    run(go())


class _ResumesUncounted:
    """A processor with on_resume() but no ``resumes`` count: its calls could not reach the child's copy."""

    def on_resume(self):
        pass

    def __call__(self, generated, logits):
        return logits


def test_unpicklable_processors_and_arguments_are_refused_before_anything_changes(worker):
    async def go():
        await worker.fill("l", prompt(4))
        for proc, match in ((lambda generated, logits: logits, r"logits processor 1 \(\S*<lambda>\) cannot be sent"),
                            (_ResumesUncounted(), r"processor 1 \(_ResumesUncounted\) has on_resume\(\) but no")):
            sp = SamplingParams(max_tokens=2, logits_processors=[ForcedOutput([[5, 6]]), proc])
            with pytest.raises(E.InvalidSampling, match=match):
                await anext(aiter(worker.generate("l", sp)))
            assert await worker.context_tokens("l") == prompt(4) and not worker._streams  # nothing changed
        with pytest.raises(TypeError, match="cannot be sent to the worker process"):
            await worker.fill(lambda: 0, [1])  # hashable, not picklable
        # the context is idle: a forced stream runs on it
        sp = SamplingParams(max_tokens=3, ignore_eos=True, logits_processors=[ForcedOutput([[5, 6, 7]])])
        assert [ev.token_id async for ev in worker.generate("l", sp)] == [5, 6, 7]
        await worker.free_context("l")
        assert (await worker.check_invariants())["contexts"] == 0

    run(go())


def test_a_killed_worker_fails_its_stream_and_every_later_call(tiny_dir):
    eng = ProcessEngine.start({"path": str(tiny_dir), "threads": 1, **ARGS}, name="doomed")
    pid = eng.pid

    async def go():
        await eng.fill("k", prompt(8))
        stream = eng.generate("k", LONG)
        await anext(stream)
        os.kill(pid, signal.SIGSTOP)  # frozen: the next call stays pending until the kill
        pending = asyncio.ensure_future(eng.fill("k2", prompt(4)))
        await asyncio.sleep(0.2)
        assert not pending.done()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(E.EngineUnavailable, match="is gone"):
            await asyncio.wait_for(_drain(stream), timeout=5)
        with pytest.raises(E.EngineUnavailable):
            await asyncio.wait_for(pending, timeout=5)
        assert time.monotonic() - t0 < 5
        assert not eng.alive
        with pytest.raises(E.EngineUnavailable):
            await eng.fill("k3", [1])
        with pytest.raises(E.EngineUnavailable):
            await anext(aiter(eng.generate("k", GREEDY)))
        with pytest.raises(E.EngineUnavailable):
            eng.load_stats()
        eng.free_context_nowait("k")  # fire and forget: nothing to tell anyone

    try:
        run(go())
    finally:
        eng.close()
    assert not eng.process.is_alive() and no_child(pid)
    with pytest.raises(E.EngineClosed):
        run(eng.fill("k4", [1]))


def test_start_errors_are_raised_in_the_parent(tmp_path):
    from interlace.engine_ext.native.loader import ModelNotFound

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ModelNotFound, match="neither a model directory nor a .gguf"):
        ProcessEngine.start({"path": str(tmp_path / "nothing")}, name="bad")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


# ------------------------------------------------ logits processors (SmolLM2: pause_on needs a tokenizer)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "country": {"type": "string", "maxLength": 24}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol_worker():
    eng = ProcessEngine.start({"path": "embedded", "kv_cache_tokens": 8192}, name="smol-procs")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def grammars(smol_worker):
    from interlace.engine_ext.constraints.grammar import GrammarCompiler

    return GrammarCompiler(smol_worker.tokenizer, vocab_size=smol_worker.vocab_size)


def chat_ids(eng, text):
    return eng.tokenizer.encode_chat([{"role": "user", "content": text}])


async def run_rounds(eng, cid, ids, sampling, on_pause):
    """Fill, generate; at each pause ``on_pause(n)`` (the pause's number)
    returns the tokens to resume with.  Returns (events, the pauses' event indices)."""
    await eng.fill(cid, ids)
    events, pauses = [], []
    try:
        async for ev in eng.generate(cid, sampling):
            events.append(ev)
            if ev.paused:
                pauses.append(len(events))
                await eng.resume(cid, on_pause(len(pauses)))
    finally:
        await eng.free_context(cid)
    return events, pauses


def test_forced_output_across_a_pause_equals_the_in_process_engine(smol_worker, smol_engine):
    """Two pieces with a pause between them: the caller's on_resume() moves
    the child's copy to the next piece (the rest of the first, cut short, is
    not replayed); a second pause resumed without on_resume() changes nothing."""
    tok = smol_worker.tokenizer
    first, second = tok.encode("Let me look it up.</tool> and more"), tok.encode(" It is sunny.</tool> Done.")
    cut = next(k for k in range(1, len(first) + 1) if "</tool>" in tok.decode(first[:k]))
    assert cut < len(first)
    eos = min(tok.eos_token_ids)
    ids = chat_ids(smol_worker, "What is the weather?")

    def replay(eng, cid):
        forced = ForcedOutput([first, second], eos)

        def on_pause(n):
            if n == 1:  # a tool round: the recording moves on
                forced.on_resume()
                return tok.encode(" [sunny, 24 C] ")
            return []   # a spurious pause: resumed with nothing, no on_resume

        sp = SamplingParams(max_tokens=60, pause_on=["</tool>"], logits_processors=[forced])
        events, pauses = run(run_rounds(eng, cid, ids, sp, on_pause))
        return [e.token_id for e in events if e.token_id is not None], events[-1].finish_reason, len(pauses), forced

    mine, reason, n_pauses, forced = replay(smol_worker, "forced")
    assert (mine, reason, n_pauses) == replay(smol_engine, "forced-ref")[:3]
    assert mine == first[:cut] + second + [eos] and reason == "stop" and n_pauses == 2
    assert (forced.piece, forced.resumes) == (0, 1)  # the caller's copy saw the call, never a token


def test_grammar_processor_output_is_valid_json_and_equals_the_in_process_engine(smol_worker, smol_engine,
                                                                                   grammars):
    import json
    import pickle

    import jsonschema

    ids = chat_ids(smol_worker, "Describe Paris as JSON with its city and country.")
    grammar = grammars.json_schema(SCHEMA)

    def constrained(eng, cid):
        proc = grammars.processor(grammar)
        sp = SamplingParams(max_tokens=40, logits_processors=[proc])
        events, _ = run(run_rounds(eng, cid, ids, sp, None))
        return "".join(e.text for e in events), [e.token_id for e in events], events[-1].finish_reason, proc

    text, tokens, reason, proc = constrained(smol_worker, "json")
    ref_text, ref_tokens, ref_reason, used = constrained(smol_engine, "json-ref")
    assert (text, tokens, reason) == (ref_text, ref_tokens, ref_reason)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert (proc.steps, proc.done) == (0, False) and used.steps > 0  # the caller's copy stays as it started
    # one that has started cannot be shipped; a recipe rebuilds only in a worker process
    with pytest.raises(E.InvalidSampling, match=r"processor 0 \(GrammarProcessor\) .* has started"):
        run(_first_event(smol_worker, SamplingParams(max_tokens=4, logits_processors=[used]), ids))
    with pytest.raises(RuntimeError, match="only in an engine worker process"):
        pickle.loads(pickle.dumps(grammars.processor(grammar)))


def test_first_round_only_constrains_until_the_resume_then_not(smol_worker, smol_engine, grammars):
    import re

    from interlace.gateway.openai.completions import FirstRoundOnly

    tok = smol_worker.tokenizer
    ids = chat_ids(smol_worker, "Describe Paris as JSON with its city and country.")
    grammar = grammars.lark('start: "<tool>" NAME "</tool>"\nNAME: /[a-z]{1,8}/\n')

    def rounds(eng, cid):
        proc = FirstRoundOnly(grammars.processor(grammar))

        def on_pause(n):
            proc.on_resume()
            return tok.encode(" result: 42. ")

        sp = SamplingParams(max_tokens=14, pause_on=["</tool>"], logits_processors=[proc])
        events, pauses = run(run_rounds(eng, cid, ids, sp, on_pause))
        return ["".join(e.text for e in events[:pauses[0]]), [e.token_id for e in events[pauses[0]:]],
                pauses, events[-1].finish_reason]

    mine = rounds(smol_worker, "first-round")
    assert mine == rounds(smol_engine, "first-round-ref")
    constrained, free, pauses, reason = mine
    assert re.fullmatch(r"<tool>[a-z]{1,8}</tool>", constrained) and len(pauses) == 1
    # after the resume the grammar (complete: EOS only) no longer applies: the model writes on
    assert len(free) >= 3 and not set(free) <= smol_worker.eos_token_ids and reason == "length"


async def _first_event(eng, sampling, ids):
    await eng.fill("first", ids)
    try:
        return await anext(aiter(eng.generate("first", sampling)))
    finally:
        await eng.free_context("first")


def test_smollm2_greedy_text_equals_the_in_process_engine_then_close(smol_engine):
    """One SmolLM2 worker: its greedy text is the in-process engine's; then
    close() during a stream ends the stream with "abort" (as in process),
    later calls raise EngineClosed and no process is left."""
    eng = ProcessEngine.start({"path": "embedded", "kv_cache_tokens": 8192}, name="smol")
    pid = eng.pid
    try:
        assert isinstance(eng.tokenizer, Tokenizer) and eng.eos_token_ids == smol_engine.eos_token_ids
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        ids = eng.tokenizer.encode_chat(messages)
        assert ids == smol_engine.tokenizer.encode_chat(messages)

        async def greedy(e, cid):
            await e.fill(cid, ids)
            events = [ev async for ev in e.generate(cid, SamplingParams(max_tokens=12))]
            await e.free_context(cid)
            return "".join(ev.text for ev in events), [ev.token_id for ev in events]

        text, tokens = run(greedy(eng, "w"))
        assert (text, tokens) == run(greedy(smol_engine, "worker-ref"))
        assert "Paris" in text

        async def close_during_a_stream():
            await eng.fill("c", ids)
            stream = eng.generate("c", SamplingParams(max_tokens=200, ignore_eos=True))
            await anext(stream)
            t0 = time.monotonic()
            await asyncio.to_thread(eng.close, 30)  # a graceful close, however busy this machine is
            assert time.monotonic() - t0 < 30
            rest = [ev async for ev in stream]  # as in process: a running generation ends with "abort"
            assert rest and rest[-1].finish_reason == "abort"
            with pytest.raises(E.EngineClosed):
                await eng.fill("c", [1])
            with pytest.raises(E.EngineClosed):
                await anext(aiter(eng.generate("c", GREEDY)))
            with pytest.raises(E.EngineClosed):
                eng.load_stats()

        assert not no_child(pid)
        run(close_during_a_stream())
    finally:
        eng.close()  # idempotent
    assert not eng.alive and not eng.process.is_alive() and eng.process.exitcode == 0 and no_child(pid)


async def _drain(stream):
    async for _ in stream:
        pass
