"""The engine over a remote vLLM OpenAI server (``engine_ext/openai_http.py``).

One real server per module: vLLM's OpenAI API server on the embedded
SmolLM2-135M (float32, CPU build), started as a subprocess in its own
process group and killed at the end (the last test kills it on purpose,
mid-generation).  Greedy outputs are compared token for token with the
in-process native engine.  Every wait is bounded (``T``).

    .venv/bin/python -m pytest tests/test_engine_openai.py
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence

import pytest
import pytest_asyncio

from interlace.engine_ext import errors as E
from interlace.engine_ext.protocol import RequestHint, SamplingParams, TokenEvent

from helpers.gateway_server import free_port

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.asyncio(loop_scope="module")

T = 60.0                 # seconds any one wait may take
STARTUP_S = 300.0        # the server's start (imports dominate; ~100 s on a busy 2-core machine)
MAX_MODEL_LEN = 2048


# ------------------------------------------------------------------ the server
class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}/v1"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group (API server, engine core, worker)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def server(smol_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(smol_dir),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
           "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
           # the gateway's grammars are llguidance's (x-guidance layout options, Lark tool-call grammars)
           "--structured-outputs-config.backend", "guidance"]
    from interlace.engine_ext.vllm.engine import server_env

    env, ipc = server_env(dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))  # its socket files' dir: removed at the end
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(proc, port, log)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited with {proc.returncode}:\n{srv.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not come up in {STARTUP_S:g} s:\n{srv.log_tail()}")
            time.sleep(1.0)
        yield srv
    finally:
        srv.kill(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        srv.kill(signal.SIGKILL)  # the engine core and worker too, whatever the API server did
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(ipc, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(server, smol_dir):
    from interlace.engine_ext.openai_http import load_openai_engine

    eng = load_openai_engine({"kind": "openai", "url": server.url, "timeout_s": 60}, str(smol_dir))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def native(smol_dir):
    from interlace.engine_ext.native.engine import NativeEngine

    eng = NativeEngine.load(smol_dir, dtype="float32")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tok(smol_dir):
    from interlace.engine_ext.tokenizer import Tokenizer

    return Tokenizer(Path(smol_dir), json.loads((Path(smol_dir) / "config.json").read_text()))


@pytest.fixture(scope="module")
def prompts(tok) -> dict:
    return {
        # greedy: " Berlin. The capital of the United States is New York City."
        "plain": tok.encode("The capital of France is Paris. The capital of Germany is"),
        "chat": tok.encode_chat([{"role": "user", "content": "Count from 1 to 20."}]),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ref_plain(native, prompts) -> List[TokenEvent]:
    """The native engine's greedy 12 tokens after the plain prompt."""
    return await run(native, prompts["plain"], sp(12))


# ------------------------------------------------------------------ helpers
_n = iter(range(10**9))


def cid(name: str) -> tuple:
    return ("openai-test", name, next(_n))


async def w(aw: Any, t: float = T) -> Any:
    return await asyncio.wait_for(aw, t)


def sp(n: int, **kw: Any) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=n, **kw)


async def run(engine: Any, tokens: Sequence[int], sampling: SamplingParams) -> List[TokenEvent]:
    """Fill a fresh context with ``tokens``, generate, free it."""
    c = cid("run")
    await w(engine.fill(c, list(tokens)))
    try:
        return await w(_collect(engine.generate(c, sampling)))
    finally:
        await w(engine.free_context(c))


async def _collect(stream: Any) -> List[TokenEvent]:
    return [ev async for ev in stream]


def ids(evs: Sequence[TokenEvent]) -> List[int]:
    return [e.token_id for e in evs if e.token_id is not None]


def text(evs: Sequence[TokenEvent]) -> str:
    return "".join(e.text for e in evs)


async def run_with_pause(engine: Any, tokens: Sequence[int], sampling: SamplingParams,
                         tool: Sequence[int], hint: Optional[RequestHint] = None) -> tuple:
    """(events up to and including the first pause, events after it): the
    first pause is resumed with ``tool`` (and ``hint``, after a bad hint is
    refused), a later one with nothing."""
    c = cid("pause")
    await w(engine.fill(c, list(tokens)))
    before: List[TokenEvent] = []
    after: List[TokenEvent] = []

    async def go() -> None:
        paused = False
        async for ev in engine.generate(c, sampling):
            (after if paused else before).append(ev)
            if ev.paused:
                if paused:
                    await engine.resume(c, [])
                else:
                    paused = True
                    if hint is not None:  # accepted and validated like every engine's (issue 32)
                        with pytest.raises(E.InvalidSampling, match=r"hint\.future"):
                            await engine.resume(c, list(tool), hint=RequestHint(future=((1, -1.0, 0),)))
                    await engine.resume(c, list(tool), hint=hint)
    try:
        await w(go())
    finally:
        await w(engine.free_context(c))
    return before, after


def pause_string(tok: Any, ref: List[int]) -> tuple:
    """(k, s): ``s`` is the text of tokens k-2 and k-1, completed first by token k-1."""
    for k in range(3, len(ref) - 3):
        start, end = tok.decode(ref[:k - 2]), tok.decode(ref[:k])
        s = end[len(start):]
        if len(s) >= 3 and s not in tok.decode(ref[:k - 1]):
            return k, s
    pytest.fail(f"no usable pause string in {tok.decode(ref)!r}")


# ------------------------------------------------------------------ start-up
async def test_start_up_reads_the_servers_model_and_limits(engine, server, smol_dir):
    assert engine.url == server.url and engine.alive
    assert engine.model == str(smol_dir)  # the only model served (vLLM names it by its path)
    assert engine.max_model_len == MAX_MODEL_LEN
    assert engine.vocab_size == json.loads((Path(smol_dir) / "config.json").read_text())["vocab_size"]
    assert engine.block_size >= 16 and engine.num_blocks > 0  # from vllm:cache_config_info


async def test_start_up_against_a_dead_port_names_the_url(smol_dir):
    from interlace.engine_ext.openai_http import load_openai_engine

    url = f"http://127.0.0.1:{free_port()}/v1"
    t0 = time.monotonic()
    with pytest.raises(E.EngineUnavailable, match="127.0.0.1"):
        load_openai_engine({"kind": "openai", "url": url}, str(smol_dir))
    assert time.monotonic() - t0 < 15


async def test_start_up_with_a_model_the_server_does_not_serve(server, smol_dir):
    from interlace.engine_ext.openai_http import load_openai_engine

    with pytest.raises(ValueError, match=r"does not serve model 'no-such-model'.*") as err:
        load_openai_engine({"kind": "openai", "url": server.url, "model": "no-such-model"}, str(smol_dir))
    assert server.url in str(err.value) and str(smol_dir) in str(err.value)  # the URL, and what it serves


async def test_start_up_with_a_tokenizer_of_another_vocabulary(server, smol_dir, tmp_path):
    from interlace.engine_ext.openai_http import load_openai_engine

    d = tmp_path / "bigger-vocab"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smol_dir) / f, d / f)
    cfg = json.loads((Path(smol_dir) / "config.json").read_text())
    cfg["vocab_size"] += 64
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="fewer tokens than the tokenizer") as err:
        load_openai_engine({"kind": "openai", "url": server.url}, str(d))
    assert server.url in str(err.value)


async def test_start_up_with_a_tokenizer_that_splits_text_differently(server, smol_dir, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from interlace.engine_ext.openai_http import load_openai_engine

    cfg = json.loads((Path(smol_dir) / "config.json").read_text())
    words = ["[UNK]", "<|endoftext|>", "Hello", ",", "world", "!"]
    hf = HFTokenizer(models.WordLevel({w_: i for i, w_ in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path / "other-tokenizer"
    d.mkdir()
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (d / "config.json").write_text(json.dumps({"vocab_size": cfg["vocab_size"], "eos_token_id": 1}))
    with pytest.raises(ValueError, match="does not match") as err:
        load_openai_engine({"kind": "openai", "url": server.url}, str(d))
    assert server.url in str(err.value)


# ------------------------------------------------------------------ without the real server
class FakeServer:
    """A stand-in HTTP server: answers every request with ``status`` and
    ``body`` and records the requests' paths and Authorization headers."""

    def __init__(self, status: int, body: dict):
        import http.server
        import threading

        self.seen: List[tuple] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                fake.seen.append((self.command, self.path, self.headers.get("Authorization")))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def test_start_up_sends_the_api_key_and_names_a_refused_one(smol_dir):
    from interlace.engine_ext.openai_http import load_openai_engine

    fake = FakeServer(401, {"error": {"message": "Unauthorized", "code": 401}})
    try:
        with pytest.raises(ValueError, match="refused the API key") as err:
            load_openai_engine({"kind": "openai", "url": fake.url, "api_key": "sk-test"}, str(smol_dir))
        assert fake.url in str(err.value)
        assert fake.seen == [("GET", "/v1/models", "Bearer sk-test")]
    finally:
        fake.close()


async def test_a_5xx_answer_marks_the_engine_dead(tok):
    from interlace.engine_ext.openai_http import OpenAIEngine

    fake = FakeServer(500, {"error": {"message": "engine core died", "code": 500}})
    eng = OpenAIEngine(fake.url, tok, model="m", max_model_len=2048, vocab_size=49152, api_key="k",
                       metrics_interval_s=0)
    try:
        assert eng.alive
        with pytest.raises(E.EngineUnavailable, match="engine core died"):
            await w(eng.fill(cid("5xx"), list(range(1, 41))))  # whole blocks: a request
        assert not eng.alive
        with pytest.raises(E.EngineUnavailable):
            await w(eng.fill(cid("5xx-after"), [1, 2, 3]))
        assert fake.seen == [("POST", "/v1/completions", "Bearer k")]  # refused before sending
    finally:
        eng.close()
        fake.close()


async def test_metrics_parsing():
    from interlace.engine_ext.openai_http import _split_url, parse_cache_config, parse_metrics

    text = "\n".join([
        "# HELP vllm:kv_cache_usage_perc KV-cache usage.",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75',
        'vllm:kv_cache_usage_perc{engine="0",model_name="other"} 1.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0',
        'vllm:cache_config_info{block_size="128",enable_prefix_caching="True",num_gpu_blocks="182"} 1.0',
    ])
    assert parse_metrics(text, "m") == {"kv_cache_usage": 0.5, "running": 4, "waiting": 2}
    assert parse_cache_config(text) == {"block_size": 128, "num_blocks": 182}
    assert parse_cache_config("") == {}
    assert _split_url("http://h:8000/v1/") == ("http://h:8000/v1", "http://h:8000")
    assert _split_url("http://h:8000") == ("http://h:8000/v1", "http://h:8000")


# ------------------------------------------------------------------ same tokens as the native engine
async def test_greedy_output_equals_the_native_engines(engine, prompts, ref_plain):
    remote = await run(engine, prompts["plain"], sp(12))
    assert ids(remote) == ids(ref_plain)
    assert text(remote) == text(ref_plain)
    assert remote[-1].finish_reason == "length" and len(ids(remote)) == 12


async def test_greedy_output_of_a_chat_prompt_equals_the_native_engines(engine, native, prompts):
    remote = await run(engine, prompts["chat"], sp(12))
    local = await run(native, prompts["chat"], sp(12))
    assert ids(remote) == ids(local) and text(remote) == text(local)


async def test_logprobs_come_back_for_every_token(engine, prompts):
    evs = await run(engine, prompts["plain"], sp(6, logprobs=True))
    assert len(evs) == 6 and all(e.logprob is not None and e.logprob <= 0.0 for e in evs)


async def test_fork_continues_from_the_parent(engine, prompts, tok):
    parent, child = cid("parent"), cid("child")
    await w(engine.fill(parent, prompts["plain"]))
    suffix = tok.encode(" Rome is the capital of")
    try:
        assert await w(engine.fill(child, suffix, parent_context_id=parent)) == len(prompts["plain"]) + len(suffix)
        got = await w(_collect(engine.generate(child, sp(8))))
        await w(engine.free_context(child))
    finally:
        await w(engine.free_context(parent))
    assert ids(got) == ids(await run(engine, prompts["plain"] + suffix, sp(8)))  # = a fresh context


async def test_pause_on_and_resume_give_the_native_engines_tokens(engine, native, prompts, tok, ref_plain):
    ref = ids(ref_plain)
    k, s = pause_string(tok, ref)
    tool = tok.encode(" (tool: 42)")
    hint = RequestHint(expected_output=3, expected_tool="calc", expected_tool_s=0.5, future=((4, None, 2),))
    r_before, r_after = await run_with_pause(engine, prompts["plain"], sp(12, pause_on=[s]), tool, hint)
    n_before, n_after = await run_with_pause(native, prompts["plain"], sp(12, pause_on=[s]), tool)
    assert r_before[-1].paused and text(r_before).endswith(s)
    assert ids(r_before) == ids(n_before) == ref[:k]  # nothing decoded past the pause string
    assert ids(r_after) == ids(n_after) and r_after[-1].finish_reason == "length"
    assert len(ids(r_before)) + len(ids(r_after)) == 12
    assert text(r_before) + text(r_after) == text(n_before) + text(n_after)


async def test_stop_string_ends_the_stream_as_on_the_native_engine(engine, prompts, ref_plain):
    full = text(ref_plain)
    stop = " United"
    assert stop in full, full
    remote = await run(engine, prompts["plain"], sp(12, stop=[stop]))
    assert remote[-1].finish_reason == "stop"
    assert text(remote) == full[:full.index(stop)]  # held back, then dropped: the native engine's rule
    n = len(ids(remote))
    assert ids(remote) == ids(ref_plain)[:n] and n < 12


async def test_a_json_schema_grammar_yields_valid_json(engine, tok):
    jsonschema = pytest.importorskip("jsonschema")
    from interlace.engine_ext.constraints.grammar import GrammarCompiler

    compiler = GrammarCompiler(tok, vocab_size=engine.vocab_size)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}
    grammar = compiler.json_schema(schema)
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a person as JSON with a name and an age."}])
    evs = await run(engine, prompt, SamplingParams(max_tokens=64, logits_processors=[compiler.processor(grammar)]))
    out = text(evs)
    assert evs[-1].finish_reason == "stop", out
    doc = json.loads(out)
    jsonschema.validate(doc, schema)
    assert out == json.dumps(doc)  # the grammar's layout (x-guidance: json.dumps separators) held


async def test_other_logits_processors_are_refused(engine, prompts):
    c = cid("procs")
    await w(engine.fill(c, prompts["plain"]))
    try:
        with pytest.raises(E.InvalidSampling):
            await w(_collect(engine.generate(c, sp(4, logits_processors=[lambda ids_, logits: logits]))))
    finally:
        await w(engine.free_context(c))


# ------------------------------------------------------------------ the server's refusals
async def test_a_request_the_server_refuses_raises_invalid_sampling(engine, prompts):
    c = cid("refused")
    await w(engine.fill(c, prompts["plain"]))
    try:
        with pytest.raises(E.InvalidSampling, match="seed"):  # vLLM takes int64 seeds only
            await w(_collect(engine.generate(c, sp(4, temperature=1.0, seed=2 ** 70))))
        assert engine.alive  # a 4xx is the request's fault, not the server's
        assert len(ids(await w(_collect(engine.generate(c, sp(3)))))) == 3
    finally:
        await w(engine.free_context(c))


async def test_the_servers_context_limit_raises_context_too_long(engine, server, tok):
    from interlace.engine_ext.openai_http import OpenAIEngine

    # an engine that believes the limit is larger than the server's: the server's 400 becomes ContextTooLong
    wrong = OpenAIEngine(server.url, tok, model=engine.model, max_model_len=4 * MAX_MODEL_LEN,
                         vocab_size=engine.vocab_size, metrics_interval_s=0)
    try:
        c = cid("long")
        await w(wrong.fill(c, [198] * 8))
        long = tok.encode("word " * (MAX_MODEL_LEN + 10))[:MAX_MODEL_LEN + 10]
        with pytest.raises(E.ContextTooLong, match="127.0.0.1"):
            await w(wrong.fill(c, long))
        assert wrong.alive
    finally:
        wrong.close()


# ------------------------------------------------------------------ stats and aborts
async def stats_until(engine: Any, pred: Any, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    st = engine.load_stats()
    while not pred(st) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        st = engine.load_stats()
    return st


async def test_stats_scrape_the_server_and_an_abandoned_stream_is_aborted_there(engine, prompts):
    st = engine.load_stats()
    assert {"kv_blocks_used", "kv_blocks_total", "queued_tokens", "running", "waiting"} <= set(st)
    assert st["kv_blocks_total"] == engine.num_blocks > 0
    c = cid("abandon")
    await w(engine.fill(c, prompts["plain"]))
    try:
        stream = engine.generate(c, sp(1000))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                st = await stats_until(engine, lambda s: s["running"] >= 1)
                assert st["running"] >= 1 and st["queued_tokens"] > 900, st
                assert st["kv_blocks_used"] >= 1, st
                break
        await stream.aclose()
        # the HTTP stream was closed: vLLM aborted the request
        st = await stats_until(engine, lambda s: s["running"] == 0 and s["queued_tokens"] == 0)
        assert st["running"] == 0 and st["queued_tokens"] == 0, st
    finally:
        await w(engine.free_context(c))


# ------------------------------------------------------------------ the server dies (last: it kills the server)
async def _pause_a_stream(engine: Any, c: tuple, tokens: Sequence[int], s: str) -> Any:
    """A stream of ``c`` run up to its first pause and left paused there."""
    await w(engine.fill(c, list(tokens)))
    stream = engine.generate(c, sp(12, pause_on=[s]))
    async for ev in stream:
        if ev.paused:
            return stream
    pytest.fail("no pause")


async def _unavailable_within(stream: Any, server: "Server", what: str, t: float = 10.0) -> None:
    """``stream`` ends with EngineUnavailable within ``t`` seconds.  Any other
    end fails with what came instead: a normal end (the events after the
    kill), a timeout, or another error, each with the server's log tail."""
    seen: List[TokenEvent] = []

    async def drain() -> None:
        async for ev in stream:
            seen.append(ev)
    task = asyncio.ensure_future(drain())
    done, _ = await asyncio.wait({task}, timeout=t)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        pytest.fail(f"the {what} stream was still open {t:g} s after the kill ({len(seen)} more events)\n"
                    f"{server.log_tail()}")
    if isinstance(task.exception(), E.EngineUnavailable):
        return
    if task.exception() is not None:
        raise task.exception()
    pytest.fail(f"the {what} stream ended normally after the kill: {len(seen)} more events, last {seen[-1:]!r}\n"
                f"{server.log_tail()}")


async def test_killing_the_server_ends_running_and_paused_streams_with_engine_unavailable(engine, server, prompts,
                                                                                       tok, smol_dir, ref_plain):
    from interlace.engine_ext.openai_http import load_openai_engine

    _, s = pause_string(tok, ids(ref_plain))
    running, paused = cid("running"), cid("paused")
    await w(engine.fill(running, prompts["chat"]))
    paused_stream = await w(_pause_a_stream(engine, paused, prompts["plain"], s))
    # a second engine on the same server with nothing running: only its /metrics reads can notice
    idle = load_openai_engine({"kind": "openai", "url": server.url}, str(smol_dir), name="openai-idle")
    try:
        idle_stream = await w(_pause_a_stream(idle, cid("idle"), prompts["plain"], s))

        stream = engine.generate(running, sp(1500))
        first = []
        async for ev in stream:
            first.append(ev)
            if len(first) == 3:
                break
        # still decoding when the server dies (1500 tokens take over a minute here)
        assert len(first) == 3 and all(ev.finish_reason is None for ev in first), first
        t0 = time.monotonic()
        server.kill(signal.SIGKILL)

        await _unavailable_within(stream, server, "running")
        await _unavailable_within(paused_stream, server, "paused")
        await _unavailable_within(idle_stream, server, "idle engine's paused")
        assert time.monotonic() - t0 < 10
        assert not engine.alive and not idle.alive

        with pytest.raises(E.EngineUnavailable):
            await w(engine.fill(cid("after"), prompts["plain"]))
        with pytest.raises(E.EngineUnavailable):
            await w(_collect(engine.generate(running, sp(2))))
        with pytest.raises(E.EngineUnavailable):
            await w(engine.resume(paused, [11]))
    finally:
        idle.close()
