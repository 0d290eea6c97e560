"""What only the vLLM engine has: Interlace's ranking inside vLLM's scheduler,
grammars as vLLM structured outputs, the engine-args mapping, and the death
of vLLM's engine-core process.  The protocol semantics it shares with every
engine are in test_engine_conformance.py."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import tempfile
import time

import psutil
import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh --test (the CPU build here)")

from interlace.engine_ext import errors as E  # noqa: E402
from interlace.engine_ext.protocol import RequestHint, SamplingParams  # noqa: E402
from interlace.engine_ext.policies import PolicySpec  # noqa: E402

ENGINE = {"kind": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_space_gb": 1, "max_model_len": 1024}


def _engine(smol_dir, policy=None, **over):
    from interlace.engine_ext.vllm import load_vllm_engine

    return load_vllm_engine({**ENGINE, **over}, str(smol_dir), policy)


@pytest.fixture(scope="module")
def sjf_engine(smol_dir):
    """One request at a time, waiting requests ranked by predicted output (SJF)."""
    eng = _engine(smol_dir, PolicySpec(ranking="sjf", interception="discard"), max_num_seqs=1)
    yield eng
    eng.close()


def _engine_core_pids() -> list:
    me = psutil.Process()
    return [p.pid for p in me.children(recursive=True) if "EngineCore" in " ".join(p.cmdline() + [p.name()])]


async def _finish_order(eng, hints):
    """A blocker runs; then requests with ``hints`` arrive in order while it
    does; returns the order in which they finish."""
    prompt = eng.tokenizer.encode("Count: one two three")
    await eng.fill("base", prompt)
    for i in range(len(hints)):
        await eng.fill(f"r{i}", [], parent_context_id="base")
    await eng.fill("blocker", prompt)
    blocker = eng.generate("blocker", SamplingParams(max_tokens=40, ignore_eos=True))
    await blocker.__anext__()  # it holds the only slot now
    order = []

    async def run(i, hint):
        async for ev in eng.generate(f"r{i}", SamplingParams(max_tokens=3, ignore_eos=True), hint=hint):
            if ev.finish_reason:
                order.append(i)

    tasks = []
    for i, h in enumerate(hints):
        tasks.append(asyncio.create_task(run(i, h)))
        await asyncio.sleep(0.3)  # distinct arrivals, all while the blocker runs
    async for _ in blocker:
        pass
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for i in range(len(hints)):
        await eng.free_context(f"r{i}")
    await eng.free_context("base")
    await eng.free_context("blocker")
    return order


def test_the_ranking_orders_vllms_waiting_queue(sjf_engine):
    """Arrival order is longest-predicted first; SJF inside vLLM's scheduler
    serves them shortest first (plain vLLM would serve them as they came)."""
    hints = [RequestHint(expected_output=n) for n in (300, 200, 100, 5)]
    order = asyncio.run(_finish_order(sjf_engine, hints))
    assert order == [3, 2, 1, 0]


def test_grammar_runs_as_vllm_structured_output(sjf_engine):
    from interlace.engine_ext.constraints.grammar import GrammarCompiler

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    gc = GrammarCompiler(sjf_engine.tokenizer, vocab_size=sjf_engine.vocab_size)
    proc = gc.processor(gc.json_schema(schema))
    prompt = sjf_engine.tokenizer.encode_chat([{"role": "user", "content": "A trip as JSON."}])

    async def go():
        await sjf_engine.fill("g", prompt)
        text = []
        async for ev in sjf_engine.generate("g", SamplingParams(max_tokens=60, logits_processors=[proc])):
            text.append(ev.text)
            last = ev
        await sjf_engine.free_context("g")
        return "".join(text), last.finish_reason

    text, reason = asyncio.run(go())
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_python_logits_processors_are_refused_before_any_state_change(sjf_engine):
    async def go():
        await sjf_engine.fill("p", [1, 2, 3])
        with pytest.raises(E.InvalidSampling, match="grammars"):
            sjf_engine_gen = sjf_engine.generate("p", SamplingParams(logits_processors=[lambda ids, x: x]))
            await sjf_engine_gen.__anext__()
        # the context is untouched and usable
        assert await sjf_engine.context_tokens("p") == [1, 2, 3]
        async for ev in sjf_engine.generate("p", SamplingParams(max_tokens=2)):
            pass
        await sjf_engine.free_context("p")
    asyncio.run(go())


def test_engine_args_map_the_yaml_and_refuse_what_interlace_sets(smol_dir):
    from interlace.engine_ext.vllm import engine_args

    args = engine_args({**ENGINE, "tensor_parallel_size": 1, "args": {"seed": 7}}, str(smol_dir),
                       PolicySpec(ranking="fcfs", prefix_caching=False))
    assert args.scheduler_cls == "interlace.engine_ext.vllm.scheduler.InterlaceScheduler"  # or its async twin
    assert args.additional_config["interlace"]["ranking"] == "fcfs"
    assert args.enable_prefix_caching is False and args.seed == 7 and args.max_model_len == 1024
    with pytest.raises(ValueError, match="scheduler_cls"):
        engine_args({**ENGINE, "args": {"scheduler_cls": "x.Y"}}, str(smol_dir))
    embedded = engine_args({"kind": "vllm"}, "embedded")
    assert os.path.isdir(embedded.model)


def test_a_dead_engine_core_fails_streams_and_calls_with_engine_unavailable(smol_dir):
    others = set(_engine_core_pids())  # other engines of this module: not to be killed
    eng = _engine(smol_dir)
    try:
        before = set(_engine_core_pids()) - others
        assert before, "vLLM's engine core runs in a child process"

        async def go():
            await eng.fill("d", eng.tokenizer.encode("Tell me a long story about a dragon."))
            stream = eng.generate("d", SamplingParams(max_tokens=500, ignore_eos=True))
            await stream.__anext__()
            for pid in before:
                os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(E.EngineUnavailable):
                async for _ in stream:
                    pass
            assert time.monotonic() - t0 < 30
            with pytest.raises(E.EngineUnavailable):
                await eng.fill("e", [1, 2, 3])
        asyncio.run(asyncio.wait_for(go(), 90))
        assert not eng.alive
    finally:
        eng.close()


def test_close_leaves_none_of_vllms_ipc_socket_files(smol_dir, monkeypatch):
    """vLLM binds its ZMQ sockets as files in the temp dir and leaves them
    behind at shutdown; the engine starts it in a directory of its own and
    removes that at close."""
    tmp = tempfile.mkdtemp(prefix="t")  # short: a socket's path must fit 107 bytes (tmp_path's does not)
    monkeypatch.setattr(tempfile, "tempdir", tmp)  # where vLLM's default and ours both go
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    try:
        eng = _engine(smol_dir)
        try:
            own = eng._ipc_dir
            assert own and os.path.dirname(own) == tmp and "VLLM_RPC_BASE_PATH" not in os.environ
            assert any(stat.S_ISSOCK(os.stat(os.path.join(own, f)).st_mode) for f in os.listdir(own)), (
                "vLLM did not bind its sockets in the engine's directory")
            asyncio.run(asyncio.wait_for(eng.fill("x", [1, 2, 3]), 60))
        finally:
            eng.close()
        assert os.listdir(tmp) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_socket_dir_is_left_to_an_operators_path_and_to_a_too_long_temp_dir(tmp_path, monkeypatch):
    from interlace.engine_ext.vllm.engine import _own_ipc_dir

    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/srv/vllm-sockets")
    with _own_ipc_dir() as d:
        assert d is None and os.environ["VLLM_RPC_BASE_PATH"] == "/srv/vllm-sockets"
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    deep = tmp_path / ("x" * 80)  # a socket's path under it would pass 107 bytes: vLLM's own default then
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with _own_ipc_dir() as d:
        assert d is None and "VLLM_RPC_BASE_PATH" not in os.environ
    assert list(deep.iterdir()) == []


def test_a_forced_replay_runs_as_a_token_grammar_across_pauses(sjf_engine):
    """interlace.replay / the trace benchmark force recorded tokens: on vLLM
    they become a grammar of token ids per request (decoded at full cost),
    moving to the next piece after each resume, as on the native engine."""
    from interlace.engine_ext.constraints.forced import ForcedOutput

    tok = sjf_engine.tokenizer
    pieces = [tok.encode(" The weather tool says"), tok.encode(" sunny and warm today.")]
    forced = ForcedOutput(pieces, end_token_id=min(tok.eos_token_ids))
    tool = tok.encode(" [tool result]")

    async def go():
        await sjf_engine.fill("f", tok.encode("Question: weather?"))
        got = []
        async for ev in sjf_engine.generate("f", SamplingParams(max_tokens=40, pause_on=["says"],
                                                                logits_processors=[forced])):
            got.append(ev.token_id)
            if ev.paused:
                forced.on_resume()
                await sjf_engine.resume("f", tool)
            last = ev
        ctx = await sjf_engine.context_tokens("f")
        await sjf_engine.free_context("f")
        return got, last.finish_reason, ctx

    got, reason, ctx = asyncio.run(go())
    assert reason == "stop"
    assert got[:-1] == pieces[0] + pieces[1]
    assert ctx[-len(pieces[1]) - 1 - len(tool):-len(pieces[1]) - 1] == tool


def test_serve_refuses_an_unknown_vllm_argument_in_one_line_before_starting():
    from interlace.cli import UserError, check_serve_config
    from interlace.gateway.config import parse_config

    cfg = parse_config({"models": {"m": {"path": "embedded", "engine": {"kind": "vllm", "args": {"bogus_arg": 1}}}}},
                       "f.yaml")
    with pytest.raises(UserError, match=r"f.yaml: models.m.engine: engine.args: .*bogus_arg"):
        check_serve_config(cfg)
    # vLLM's checks against the model: SmolLM2-135M has 9 attention heads
    tp = parse_config({"models": {"m": {"path": "embedded", "engine": {"kind": "vllm", "tensor_parallel_size": 2}}}},
                      "f.yaml")
    with pytest.raises(UserError, match=r"^f.yaml: models.m.engine: vLLM refuses this engine: .*divisible by tensor"):
        check_serve_config(tp)
    ok = parse_config({"models": {"m": {"path": "embedded", "engine": {"kind": "vllm", "args": {"seed": 1}}}}})
    check_serve_config(ok)


def test_generate_right_behind_a_pending_fill_decodes_after_its_tokens(sjf_engine):
    """As on the native engine, a generate queued while the context's fill is
    still in flight runs over the filled tokens (the trace bench does this)."""
    tok = sjf_engine.tokenizer
    prompt = tok.encode("One, two, three, four," * 40)
    assert len(prompt) > sjf_engine.block_size  # so the fill really computes (whole blocks) while generate starts

    async def go():
        # hold the engine's loop for a moment so the fill and the generate are both queued behind it:
        # they must then run in the order they were made
        sjf_engine._loop.call_soon_threadsafe(time.sleep, 0.3)
        fill = asyncio.ensure_future(sjf_engine.fill("q", prompt))
        await asyncio.sleep(0)
        out = [ev.token_id async for ev in sjf_engine.generate("q", SamplingParams(max_tokens=5, ignore_eos=True))]
        assert await fill == len(prompt)
        await sjf_engine.fill("ref", prompt)
        ref = [ev.token_id async for ev in sjf_engine.generate("ref", SamplingParams(max_tokens=5, ignore_eos=True))]
        for c in ("q", "ref"):
            await sjf_engine.free_context(c)
        return out, ref

    out, ref = asyncio.run(go())
    assert out == ref and len(out) == 5


def test_a_resumes_hint_reaches_the_ranking_in_vllms_scheduler(sjf_engine):
    """Issue 32: a resumed stream is a new vLLM request carrying the hint given
    to ``resume`` (the next segment's prediction), not its first segment's.
    ``a`` and ``b`` pause; while a blocker holds the only slot, ``a`` resumes
    first predicting a long segment, ``b`` after it a short one: SJF inside
    vLLM's scheduler serves ``b`` first (their first hints said the opposite)."""
    eng = sjf_engine
    sp = SamplingParams(max_tokens=6, ignore_eos=True)

    async def go():
        prompt = eng.tokenizer.encode("Count: one two three")
        streams = {}
        for cid, first in (("a", 5), ("b", 300)):
            await eng.fill(cid, prompt)
            streams[cid] = eng.generate(cid, sp, hint=RequestHint(expected_output=first))
            asked = False
            async for ev in streams[cid]:
                if ev.paused:
                    break
                if not asked:
                    await eng.pause(cid)
                    asked = True
        await eng.fill("blocker", prompt)
        blocker = eng.generate("blocker", SamplingParams(max_tokens=40, ignore_eos=True))
        await blocker.__anext__()  # it holds the only slot now
        order = []

        async def drain(cid):
            async for ev in streams[cid]:
                if ev.finish_reason:
                    order.append(cid)

        tasks = [asyncio.create_task(drain(c)) for c in ("a", "b")]
        await eng.resume("a", [], hint=RequestHint(expected_output=300))
        await asyncio.sleep(0.3)  # distinct arrivals, both while the blocker runs
        await eng.resume("b", [], hint=RequestHint(expected_output=5))
        async for _ in blocker:
            pass
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for cid in ("a", "b", "blocker"):
            await eng.free_context(cid)
        return order

    assert asyncio.run(go()) == ["b", "a"]


def test_the_hints_every_ranking_field_reaches_the_schedulers_schedinfo():
    """What the frontend puts in ``extra_args`` (``RequestEngine._extra``: a
    resume's hint, ``future`` included) is what the scheduler's ranking reads,
    after vLLM's own msgpack round trip between frontend and engine core."""
    import msgspec
    from vllm import SamplingParams as VSP
    from vllm.v1.request import Request

    from interlace.engine_ext.request_engine import RequestEngine, _Context
    from interlace.engine_ext.vllm.scheduler import CONFIG_KEY, _Item, request_hint

    ctx = _Context("c", [1, 2, 3])
    ctx.hint = RequestHint(expected_output=7, expected_tool="calc", expected_tool_s=1.5,
                           future=((4, 2.0, 3), (9, None, 1)), objective="latency", task_group="g", tenant="alice")
    extra = msgspec.msgpack.decode(msgspec.msgpack.encode(RequestEngine._extra(ctx, None)))
    req = Request("r", [1, 2, 3], VSP(max_tokens=4, extra_args={CONFIG_KEY: extra}), None, arrival_time=1.0)
    s = _Item(req, request_hint(req)).sched
    assert (s.expected_output, s.expected_tool, s.expected_tool_s, s.future, s.objective, s.task_group,
            s.tenant) == (7, "calc", 1.5, ((4, 2.0, 3), (9, None, 1)), "latency", "g", "alice")


def test_the_rankings_c_other_is_the_running_requests_computed_tokens():
    """C_other as every engine computes it (the policies' docstrings): the KV
    tokens of the requests running now; waiting ones hold none."""
    import types

    from vllm import SamplingParams as VSP
    from vllm.v1.request import Request

    from interlace.engine_ext.vllm.scheduler import _Ranked

    running = [Request(f"r{i}", list(range(1, 30)), VSP(max_tokens=4), None, arrival_time=1.0) for i in range(2)]
    running[0].num_computed_tokens, running[1].num_computed_tokens = 29, 12
    state = _Ranked.rank_state(types.SimpleNamespace(running=running, _iteration=3))
    assert (state.batch_context_tokens, state.iteration) == (41, 3)
