"""The same agent trace on different engines and on several replicas
(``interlace bench trace --engines ...``, issue #11).

    interlace bench trace --trace mixed --rates 0.25,0.5 --num-requests 12 --max-context 192 \\
        --time-scale 0.1 --engines vllm-server,vllm,native,native-x2

Engines (each fresh, the embedded model in float32, one after another):

* ``vllm-server`` -- stock vLLM: its OpenAI server (``vllm serve``, FCFS,
  automatic prefix caching) driven over HTTP by
  :class:`~engine_ext.openai_http.OpenAIEngine`; every tool call ends the
  request and the next segment is a new one (what vLLM does today).
* ``vllm`` -- vLLM inside Interlace (:class:`~engine_ext.vllm.VLLMEngine`)
  with Interlace's default policies: LAMPS ranking inside vLLM's scheduler
  (profile measured through the engine, cached), the job's arrival kept
  across tool calls, the trace's lengths as hints, and a paused request's
  KV kept inside vLLM by InferCept's min-waste (pins, issue 37).
* ``vllm-preserve`` -- the same with ``interception: preserve``: every
  pause keeps its KV, bounded only by the pin budget, the running
  requests' need and the TTL (the mechanism without InferCept's choice).
* ``vllm-discard`` -- the same with ``interception: discard``: every pause
  aborts the vLLM request and the resume recomputes what the prefix cache
  lost (vLLM in Interlace before issue 37).
* ``native`` -- the native engine as the gateway builds it (InferCept's
  handling + LAMPS, its measured profile).
* ``native-x2`` -- two native engines in worker processes (one torch thread
  each) behind a :class:`~engine_ext.replicas.ReplicaSet`; next to
  ``native-x1`` (one worker process with two threads), it answers "two
  replicas behind one gateway vs one" on the same cores.

Each request is driven exactly as in the native trace bench
(``bench/trace.py`` ``_drive_request``): random prompt ids, the trace's
completion tokens forced (``ForcedOutput``; on vLLM a grammar of token
ids), a pause marker token ending each non-final segment, a real sleep for
the call.  All engines therefore decode the same tokens; the tables
compare latency and throughput under the same arrivals.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

ENGINES = ("vllm-server", "vllm", "vllm-preserve", "vllm-discard", "native", "native-x1", "native-x2")
VLLM_CPU_BLOCK = 128  # vLLM's CPU build's KV block size
VLLM = {"kind": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_space_gb": 1, "max_model_len": 2048}


def parse_engines(text: str) -> List[str]:
    from .trace import BenchError

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad or not names:
        raise BenchError(f"--engines: unknown engine {bad[0] if bad else text!r}; choose from {', '.join(ENGINES)}")
    return names


class _Server:
    """``vllm serve`` on a free loopback port, for the stock-vLLM baseline."""

    def __init__(self, model: str, blocks: Optional[int] = None, max_model_len: int = 2048,
                 extra_args: Sequence[str] = ()):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        from interlace.engine_ext.vllm.engine import server_env

        env, self.ipc_dir = server_env({**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})  # the dir: removed at close
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
             "--enforce-eager", "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port",
             str(self.port), "--enable-prefix-caching", "--structured-outputs-config.backend", "guidance"]
            + (["--num-gpu-blocks-override", str(blocks)] if blocks else []) + list(extra_args),
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import httpx

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url[:-3]}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError("vllm serve did not start in 300 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def build_engine(name: str, model: str, threads: int = 0, kv_tokens: Optional[int] = None) -> tuple:
    """(engine, close, notes) for an engine name of :data:`ENGINES`.
    ``threads``: torch threads of the in-process native engine (0: torch's
    default); worker replicas split the CPUs between them.  ``kv_tokens``:
    every engine's KV cache, in tokens (None: each engine's default) -- vLLM
    gets whole blocks of its block size (128 on its CPU build), and each
    worker replica a share."""
    from interlace.engine_ext.policies import PolicySpec

    vllm_blocks = -(-kv_tokens // VLLM_CPU_BLOCK) if kv_tokens else None
    native_kv = kv_tokens or 16384

    policy = PolicySpec()  # Interlace's defaults: infercept + lamps, profile auto
    if name == "vllm-server":
        from interlace.engine_ext.openai_http import load_openai_engine

        server = _Server(model, vllm_blocks)
        try:
            eng = load_openai_engine({"kind": "openai", "url": server.url}, model, None, name="vllm-server")
        except BaseException:
            server.close()
            raise

        def close() -> None:
            eng.close()
            server.close()
        return eng, close, "vllm serve (FCFS, prefix caching) over HTTP"
    if name in ("vllm", "vllm-preserve", "vllm-discard"):
        import dataclasses

        from interlace.engine_ext.vllm import load_vllm_engine

        if name != "vllm":
            policy = dataclasses.replace(policy, interception=name.split("-")[1])
        eng = load_vllm_engine({**VLLM, **({"args": {"num_gpu_blocks_override": vllm_blocks}} if vllm_blocks else {})},
                               model, policy)
        how = "pauses keep their KV (pins, min-waste)" if eng.keep_kv else "pauses discard (prefix reuse)"
        return eng, eng.close, f"vLLM in process, LAMPS in its scheduler, {how}"
    if name == "native":
        from interlace.engine_ext.native.setup import build_native_engine

        import torch

        if threads:
            torch.set_num_threads(threads)
        eng = build_native_engine(model, {"dtype": "float32", "kv_cache_tokens": native_kv}, policy)
        return eng, eng.close, f"native in process, {torch.get_num_threads()} thread(s), infercept + lamps"
    from interlace.engine_ext.replicas import ReplicaSet
    from interlace.engine_ext.worker import ProcessEngine

    n = 2 if name == "native-x2" else 1
    threads = max(1, (os.cpu_count() or 2) // n)
    workers: List[Any] = []
    try:
        for i in range(n):
            workers.append(ProcessEngine.start({"path": model, "dtype": "float32", "kv_cache_tokens": native_kv // n,
                                                "threads": threads}, policy, name=f"{name}-{i}"))
    except BaseException:
        for w in workers:
            w.close()
        raise
    eng = workers[0] if n == 1 else ReplicaSet(workers)

    def close_all() -> None:
        if n > 1:
            eng.close()
        else:
            workers[0].close()
    return eng, close_all, f"{n} worker process(es), {threads} thread(s) each"


def run_engine(name: str, model: str, trace: Any, seed: int, threads: int = 0,
               kv_tokens: Optional[int] = None) -> Dict[str, Any]:
    from interlace.engine_ext.protocol import RequestHint
    from interlace.engine_ext.sim.metrics import summarize

    from .trace import _drive_request, _warm_up, mean_non_tool, mean_norm_latency, pause_marker

    eng, close, note = build_engine(name, model, threads, kv_tokens)
    try:
        hint_cls = None if name == "vllm-server" else RequestHint  # stock vLLM knows nothing of the trace
        eos = getattr(eng, "eos_token_ids", None) or eng.tokenizer.eos_token_ids
        marker = pause_marker(eng.tokenizer, eos)
        records: list = []
        problems: list = []

        async def go() -> float:
            await _warm_up(eng)
            t0 = time.monotonic() + 0.05
            await asyncio.gather(*(_drive_request(eng, r, t0, marker=marker, vocab=eng.vocab_size, seed=seed,
                                                  time_scale=1.0, hint_cls=hint_cls, records=records,
                                                  problems=problems) for r in trace.requests))
            return time.monotonic() - t0
        wall = asyncio.run(go())
        # what resumes computed again, where the engine says it at the resume (vLLM in process); a vLLM server
        # reports its cache hits only at a request's end, which a request cut by a pause never reaches
        resumes = dict(getattr(eng, "resume_counts", None) or {}) if name != "vllm-server" else {}
        pins = asyncio.run(eng.fetch_pin_stats()) if getattr(eng, "keep_kv", False) else {}
    finally:
        close()
    if problems:
        raise RuntimeError(f"{name}: forced decoding did not replay the trace exactly: " + "; ".join(problems[:5]))
    return summarize(records, wall, float("nan"), {"notes": [note], "norm_latency_mean": mean_norm_latency(records),
                                                   "non_tool_mean": mean_non_tool(records), "resumes": resumes,
                                                   "pins": {k: pins.get(k, 0) for k in PIN_KEYS}})


PIN_KEYS = ("hits", "expired", "dropped", "discarded", "misses")


def run_engines(args: Any, base: Any, rates: List[float], per_rate: Callable[[Any, float], Any]) -> int:
    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.sim import traces

    from interlace.engine_ext.machine import describe_machine, machine
    from .trace import plot_rates, print_table

    names = parse_engines(args.engines)
    model = str(embedded_model_dir()) if not args.model else args.model
    import vllm

    print(f"machine: {describe_machine(machine())}; vLLM {vllm.__version__}")
    kv = f"KV cache {args.engine_kv_tokens} tokens each" if args.engine_kv_tokens else "each engine's default KV cache"
    print(f"\nengines side by side, {Path(model).name} (float32); trace {args.trace} ({len(base)} requests, seed "
          f"{args.seed}, max context {args.max_context}, call times x{args.time_scale:g}); {kv}\n")
    grid: Dict[float, Dict[str, Dict[str, Any]]] = {}
    for r in rates:
        tr = traces.with_poisson_arrivals(per_rate(base, r), r, args.seed)
        grid[r] = {}
        for n in names:
            t = time.monotonic()
            grid[r][n] = run_engine(n, model, tr, args.seed, args.threads, args.engine_kv_tokens)
            print(f"  [{n} @ {r:g} req/s: {time.monotonic() - t:.0f} s]", file=sys.stderr, flush=True)
        print_table(r, names, grid[r], {n: _Label(n) for n in names}, {})
        for n in names:
            print(f"  {n}: {'; '.join(grid[r][n]['notes'])}")
            rs, pins = grid[r][n].get("resumes") or {}, grid[r][n].get("pins") or {}
            if rs.get("resumes"):
                print(f"    resumes {rs['resumes']}: {rs['recomputed_after_resume']} of their "
                      f"{rs['paused_context_tokens']} paused-context tokens computed again"
                      + (f"; pins {', '.join(f'{k} {pins[k]}' for k in PIN_KEYS)}" if any(pins.values()) else ""))
        first = grid[r][names[0]]
        for n in names[1:]:
            a, b = first.get("norm_latency_p50"), grid[r][n].get("norm_latency_p50")
            if a and b:
                print(f"  {n}: p50 normalized latency {b / a:.2f}x {names[0]}'s, throughput "
                      f"{grid[r][n]['rps'] / first['rps']:.2f}x")
        print()
    if args.out_png:
        plot_rates(rates, grid, names, "engines on one agent trace", args.out_png, {})
        print(f"plot: {args.out_png}")
    return 0


class _Label:
    """What print_table reads of a variant (its policy label), for an engine row."""

    def __init__(self, name: str):
        self.name = name
        self.label = {"vllm-server": "vllm, fcfs, on", "vllm-discard": "discard, lamps, on",
                      "vllm-preserve": "preserve, lamps, on"}.get(name, "infercept, lamps, on")
