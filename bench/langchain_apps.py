"""LangChain chains run step by step or as one Semantic Variable DAG:
``interlace bench langchain``.

The map-reduce summary and the chain summary of ``interlace bench apps``,
written as ordinary LCEL chains over :class:`ChatInterlace`, run (a) as
LangChain runs them (``chain.invoke``: one chat request per model call, a
RunnableParallel's branches in threads) and (b) converted with
``to_semantic`` (the whole DAG submitted in two round trips, the final value
fetched).  Same prompts, greedy decoding: the results must be equal, and the
table says so.  Every HTTP request pays a simulated network delay (an ASGI
middleware sleeps half of it before the request reaches the gateway and
half before the answer leaves), so both modes pay the same per request.
Each run's gateway and engine are released before the next run's start
(``bench apps``' :class:`~interlace.bench.apps.Gateway`); ``--quick`` runs
each mode once at ``bench apps --quick``'s sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

from .apps import FULL, MODEL, QUICK, BenchError, Gateway, chunk_text, gateway_config, load_document, parse_delay

MODES = ("a: ChatInterlace", "b: to_semantic")


class DelayedASGI:
    """Wraps an ASGI app: each HTTP request waits ``d/2`` before it is handled and
    ``d/2`` before its answer starts, ``d`` uniform in ``[lo, hi]`` seconds."""

    def __init__(self, app: Any, lo: float, hi: float, seed: int):
        self.app, self.lo, self.hi = app, lo, hi
        self.rng = random.Random(seed)
        self.requests = 0

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.hi <= 0:
            return await self.app(scope, receive, send)
        d = self.rng.uniform(self.lo, self.hi)
        self.requests += 1
        await asyncio.sleep(d / 2)
        first = [True]

        async def delayed_send(message: Dict[str, Any]) -> None:
            if first[0] and message["type"] == "http.response.start":
                first[0] = False
                await asyncio.sleep(d / 2)
            await send(message)

        await self.app(scope, receive, delayed_send)



def mapreduce_chain(llm: Any, n: int) -> Any:
    """``bench apps``' map-reduce: each part summarized, then one summary of the summaries."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnableParallel

    part = ChatPromptTemplate.from_messages(
        [("human", "Summarize the following part of a document in detail.\n{chunk}")]) | llm | StrOutputParser()
    mapper = RunnableParallel({f"s{i}": RunnableLambda(lambda x, i=i: {"chunk": x["chunks"][i]}) | part
                               for i in range(n)})
    join = RunnableLambda(lambda d: {"body": "\n\n".join(f"Part {i + 1}:\n{d[f's{i}']}" for i in range(n))})
    reduce = ChatPromptTemplate.from_messages(
        [("human", "Here are summaries of the parts of a document, in order.\n\n{body}\n\n"
                   "Write one detailed summary of the whole document.")]) | llm | StrOutputParser()
    return mapper | join | reduce


def chain_summary_chain(llm: Any, n: int) -> Any:
    """``bench apps``' chain summary: a running summary updated with each next part."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    first = ChatPromptTemplate.from_messages(
        [("human", "Summarize the following text in detail.\n{chunk_0}")]) | llm | StrOutputParser()
    chain: Any = RunnablePassthrough.assign(summary_0=first)
    for i in range(1, n):
        step = ChatPromptTemplate.from_messages(
            [("human", "Here is a summary of a document so far:\n{summary_%d}\n\n"
                       "Here is the next part of the document:\n{chunk_%d}\n\n"
                       "Write an updated, detailed summary that covers both." % (i - 1, i))]) | llm | StrOutputParser()
        chain = chain | RunnablePassthrough.assign(**{f"summary_{i}": step})
    return chain | (lambda d: d[f"summary_{n - 1}"])


def run(args: argparse.Namespace) -> List[Dict[str, Any]]:
    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.tokenizer import Tokenizer

    sizes = QUICK if args.quick else FULL
    chunks = chunk_text(Tokenizer(embedded_model_dir()), load_document(), args.chunks or sizes.chunks,
                        args.chunk_tokens or sizes.chunk_tokens)
    out_tokens = args.output_tokens or sizes.output_tokens
    lo, hi = parse_delay(args.delay_ms)
    rows: List[Dict[str, Any]] = []
    cfg = gateway_config(True, args.kv_cache_tokens, args.max_batched_tokens)
    for name in args.apps:
        for rep in range(args.repeats):
            for mode in (MODES if rep % 2 == 0 else tuple(reversed(MODES))):
                # a fresh gateway per run: no mode finds the other's prompts in the prefix cache
                seed = f"{args.seed}:{name}:{rep}"
                with Gateway(cfg, wrap=lambda app: DelayedASGI(app, lo, hi, seed)) as gw:
                    rows.append(run_once(gw, name, mode, rep, chunks, out_tokens))
                # (leaving the block closed the engine and collected it: Gateway's docstring says why)
                print(f"  {name:9s} {mode:16s} run {rep}: {rows[-1]['e2e_s']:6.2f} s, {rows[-1]['requests']} requests",
                      flush=True)
    return rows


def run_once(gw: Gateway, name: str, mode: str, rep: int, chunks: Sequence[str], out_tokens: int) -> Dict[str, Any]:
    """One run of app ``name`` in ``mode`` on ``gw``; returns plain data and keeps no
    reference to the engine, so leaving ``gw``'s block releases it."""
    from interlace.sdk.langchain import ChatInterlace, to_semantic

    llm = ChatInterlace(base_url=gw.url + "/v1", model=MODEL, temperature=0, max_tokens=out_tokens, timeout=900)
    chain, inputs = ((mapreduce_chain(llm, len(chunks)), {"chunks": list(chunks)}) if name == "mapreduce"
                     else (chain_summary_chain(llm, len(chunks)), {f"chunk_{i}": c for i, c in enumerate(chunks)}))
    run_it = chain.invoke if mode.startswith("a") else to_semantic(chain).invoke
    llm.invoke("Hi", max_tokens=2)  # a fresh engine's first steps are slow
    before, req0 = dict(gw.engine.stats), gw.served.requests
    t0 = time.monotonic()
    result = run_it(inputs)
    wall = time.monotonic() - t0
    after = gw.engine.stats
    return {"app": name, "mode": mode, "repeat": rep, "e2e_s": wall, "requests": gw.served.requests - req0,
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "decode_tokens": after["decode_tokens"] - before["decode_tokens"], "result": result}


def table(rows: List[Dict[str, Any]], apps: Sequence[str]) -> List[str]:
    lines = ["| app | mode | e2e s (median) | runs | HTTP requests | prefilled tokens | speed-up vs a | same result |",
             "|---|---|---|---|---|---|---|---|"]
    for app in apps:
        med: Dict[str, float] = {}
        for mode in MODES:
            rs = [r for r in rows if r["app"] == app and r["mode"] == mode]
            med[mode] = statistics.median(r["e2e_s"] for r in rs)
        ref = [r["result"] for r in rows if r["app"] == app and r["mode"] == MODES[0]][0]
        for mode in MODES:
            rs = [r for r in rows if r["app"] == app and r["mode"] == mode]
            same = all(r["result"] == ref for r in rs)
            runs = ", ".join(f"{r['e2e_s']:.2f}" for r in rs)
            lines.append(f"| {app} | {mode} | {med[mode]:.2f} | {runs} | "
                         f"{rs[0]['requests']} | {int(statistics.median(r['prefill_tokens'] for r in rs))} | "
                         f"{med[MODES[0]] / med[mode]:.2f}x | {'yes' if same else 'NO'} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="interlace bench langchain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--apps", default="mapreduce,chain", help="comma-separated: mapreduce, chain")
    ap.add_argument("--quick", action="store_true", help=f"small sizes (a smoke run): {QUICK.chunks} parts of "
                    f"{QUICK.chunk_tokens} tokens, {QUICK.output_tokens} tokens per call, 1 run of each mode")
    ap.add_argument("--repeats", type=int, help="runs of each mode (medians; the order alternates); default 3, "
                                                "1 with --quick")
    ap.add_argument("--seed", type=int, default=0, help="seeds the network delays")
    ap.add_argument("--delay-ms", default="200,300", help="simulated network delay per HTTP request, uniform LO,HI")
    ap.add_argument("--chunks", type=int, help=f"document parts (default {FULL.chunks}; --quick {QUICK.chunks})")
    ap.add_argument("--chunk-tokens", type=int, help=f"tokens per part (default {FULL.chunk_tokens})")
    ap.add_argument("--output-tokens", type=int, help=f"max_tokens per call (default {FULL.output_tokens})")
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.apps = [a.strip() for a in args.apps.split(",") if a.strip()]
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    bad = [a for a in args.apps if a not in ("mapreduce", "chain")]
    if bad or args.repeats < 1:
        raise SystemExit(f"interlace bench langchain: unknown app(s) {bad}" if bad else "--repeats must be >= 1")
    try:
        import torch

        torch.set_num_threads(args.threads)
        rows = run(args)
    except BenchError as e:
        raise SystemExit(f"interlace bench langchain: {e}")
    print(f"\n{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}, "
          f"delay {args.delay_ms} ms per request, {args.repeats} runs per mode\n")
    print("\n".join(table(rows, args.apps)))
    return 0
