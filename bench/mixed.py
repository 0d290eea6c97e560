"""Latency-critical chats beside a map-reduce task group on one engine (``interlace bench apps --mixed``).

    interlace bench apps --mixed [--capacity both] [--latency-cap 1024] [--repeats 3] [--seed 0]
                                 [--chats 24] [--chat-rate 1.0] [--json out.json] [--quick]

Parrot's capacity regulation (section 5.4; ``engine_ext/policies/capacity.py``)
is for one engine serving both kinds of work: while a latency-critical request
runs, the tokens the engine runs beside it stay under a small cap, so its
steps stay short, and the throughput work fills the engine otherwise.  This
run measures exactly that, on the native engine with the embedded model in
the configuration of ``bench apps`` (``bench/apps.py``: as shipped, KV cache
16384 tokens, 512 tokens per step, the gateway in process on loopback):

* **the task group**: the map-reduce application of ``bench apps``
  (``--pieces`` pieces of ``--piece-tokens`` tokens of the bundled document,
  ``--map-tokens`` per map call, ``--reduce-tokens`` for the reduce), through
  Semantic Variables as ``bench apps``' variant ``b`` runs it: one session,
  every call submitted up front, the reduce's output fetched with ``criterion:
  latency``, so the map calls form a task group (objective throughput, one
  ``task_group``; checked on the server after the run) and the reduce is
  latency-critical;
* **the chats**: ``--chats`` small semantic sessions arriving as a Poisson
  process at ``--chat-rate`` per second (seeded: the same arrival times and
  questions in every setting of a repeat), each created with its one call in
  the session's first batch (one round trip) -- a question of a travel app's
  customer, ``chat: true``, ``--chat-tokens`` greedy tokens, marked
  ``criterion: latency`` -- and its output fetched with ``criterion:
  latency``.  A chat's latency: from its session request to its answer.

Both start together on a fresh gateway (after a warm-up), once per capacity
setting (``--capacity``: ``off`` = ``engine.capacity.latency_tokens: null``,
``on`` = the ``--latency-cap`` while a latency-critical request has work, no
cap otherwise), the settings' order alternating from repeat to repeat.
Reported per setting: chat latency p50 / p99 / max over every chat of every
repeat (with 24 chats and 3 repeats, p99 lies between the two slowest of 72),
the p99 of each repeat (the spread), the same for the chats that arrived
while the map-reduce job ran (the later ones meet an idle engine in either
setting), the job's completion time (regulation holds its map calls back
while chats run: it should cost the job something), and what the cap did:
the most requests it held back at one step (sampled every 20 ms) and the
engine's steps that held some back, of all its steps in the run
(``load_stats()``'s ``capacity_held`` / ``capacity_held_steps``).

No simulated network here (``bench apps`` adds 200-300 ms per request): a
delay would add the same half second to every chat in both settings and hide
nothing the engine's scheduling decides.

Sizing, so that the cap binds: the default job's map contexts are ~40
(chat template) + 14 (instruction) + 176 (piece) tokens prompt, + up to 128
generated: 16 of them hold 3,700-5,700 tokens while they run, beyond a cap
of 1,024 (a chat holds ~70-100), so with regulation on at most 2-3 map calls
run beside a chat.  The default cap here is 1,024 tokens (the engine's
default is Parrot's 2,048, meant for a GPU: on this CPU a step's time grows
with the tokens it computes, and a 512-token prefill chunk of map work beside
a chat's decode is what a chat waits for).  The sizing run (one repeat,
2026-11-28 17:04 UTC, this 2-core Xeon with other test runs beside it, load
average 4-6: times several times a quiet machine's): the map calls held up
to 5,086 active tokens; with regulation on the cap held up to 16 requests
back, in 78 of the engine's 386 steps; chat p50 / p99 22.6 / 37.0 s off,
14.5 / 25.3 s on; the job 170 s / 169 s; every chat arrived while the job
ran.  ``--quick`` is a smoke run (sizes in its ``--help``): it checks the
run works end to end, not the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import httpx

from interlace.engine_ext.machine import describe_machine, machine as machine_description

from .apps import (MODEL, USER_QUERIES, BenchError, Capacity, Gateway, _check, _warm_up, add_engine_arguments,
                   chunk_text, engine_header, engine_options, fmt, gateway_config, load_document, mapreduce_app,
                   run_semantic)

#: the latency cap of ``on`` in the mixed run unless ``--latency-cap`` says otherwise (module doc: sizing)
MIXED_LATENCY_CAP = 1024


@dataclass
class MixedSizes:
    chats: int = 24
    chat_rate: float = 1.0       # chats per second (Poisson)
    chat_tokens: int = 32
    pieces: int = 16
    piece_tokens: int = 176
    map_tokens: int = 128
    reduce_tokens: int = 32


FULL = MixedSizes()
QUICK = MixedSizes(chats=2, chat_rate=4.0, chat_tokens=3, pieces=2, piece_tokens=32, map_tokens=4, reduce_tokens=2)


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0-100) of ``xs``, linear between the closest
    ranks (numpy's default); None for no values."""
    v = sorted(xs)
    if not v:
        return None
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def arrivals(n: int, rate: float, rng: random.Random) -> List[float]:
    """``n`` Poisson arrival times (seconds from the start) at ``rate`` per second."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def chat_text(i: int) -> str:
    return (f"Customer {i + 1} asks: {USER_QUERIES[i % len(USER_QUERIES)]} "
            "Suggest a plan for the first day in two sentences.")


def chat_call(i: int, max_tokens: int) -> Dict[str, Any]:
    """The chat's one call, as ``POST /v1/sessions`` takes it in its first batch."""
    return {"model": MODEL, "template": chat_text(i) + "{{output:answer}}", "inputs": {}, "chat": True,
            "outputs": {"answer": {"sampling": {"max_tokens": max_tokens, "temperature": 0},
                                   "criterion": "latency"}}}


async def _sample(engine, stop: asyncio.Event, out: Dict[str, Any], every_s: float = 0.02) -> None:
    """What the cap did: sampled every ``every_s``, the most requests held at
    one step, the most active tokens, the caps in force; counted by the
    engine, the steps that held some back, of all its steps (an engine whose
    ``load_stats`` lacks them counts 0)."""
    held0 = int(engine.load_stats().get("capacity_held_steps", 0))
    steps0 = engine.stats["steps"]
    while not stop.is_set():
        st = engine.load_stats()
        out["held_max"] = max(out.get("held_max", 0), int(st.get("capacity_held", 0)))
        out["active_tokens_max"] = max(out.get("active_tokens_max", 0), int(st.get("active_tokens", 0)))
        out["peak_blocks"] = max(out.get("peak_blocks", 0), int(st.get("kv_blocks_used", 0)))
        out.setdefault("caps_seen", set()).add(int(st.get("capacity_tokens", 0)))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    out["steps"] = engine.stats["steps"] - steps0
    out["held_steps"] = int(engine.load_stats().get("capacity_held_steps", 0)) - held0
    out["caps_seen"] = sorted(out.get("caps_seen", ()))


async def _call_info(client: httpx.AsyncClient, sid: str, token: str, cid: str) -> Dict[str, Any]:
    return _check(await client.get(f"/v1/sessions/{sid}/calls/{cid}", headers={"Authorization": f"Bearer {token}"}),
                  "call info")


async def run_mixed_once(url: str, engine, app, sizes: MixedSizes, at: Sequence[float]) -> Dict[str, Any]:
    """The job and the chats (arriving at ``at``) started together; their times and what the cap did."""
    from interlace.sdk import AsyncClient

    lat: List[Optional[float]] = [None] * len(at)
    chat_ids: List[Any] = [None] * len(at)
    errors: List[str] = []
    stop = asyncio.Event()
    seen: Dict[str, Any] = {}
    before = dict(engine.stats)
    plain = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=200, max_keepalive_connections=200))
    async with AsyncClient(url, model=MODEL, timeout=900.0, transport=plain) as client:
        t0 = time.monotonic()

        async def chat(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + at[i] - time.monotonic()))
            t = time.monotonic()
            try:
                s = await client.session(calls=[chat_call(i, sizes.chat_tokens)])
                await s.calls[0].outputs["answer"].aget(criterion="latency")
                lat[i] = time.monotonic() - t
                chat_ids[i] = (s.id, s.token, s.calls[0].id)
            except Exception as e:  # noqa: BLE001 -- counted and reported; the other chats go on
                errors.append(f"chat {i}: {type(e).__name__}: {e}")

        async def run_job():
            # its own connections: run_semantic's client closes its transport when the job ends
            oc = await run_semantic(url, httpx.AsyncHTTPTransport(), app)
            return oc, time.monotonic() - t0

        sampler = asyncio.ensure_future(_sample(engine, stop, seen))
        job = asyncio.ensure_future(run_job())
        try:
            await asyncio.gather(*(chat(i) for i in range(len(at))))
            oc, job_s = await job
        finally:
            stop.set()
            await sampler
            if not job.done():
                job.cancel()
        after = dict(engine.stats)
        async with httpx.AsyncClient(base_url=url, timeout=60.0) as c:
            sid, token, cid = oc.extra["calls"]["part_0"]
            part = await _call_info(c, sid, token, cid)
            first = next((x for x in chat_ids if x is not None), None)
            chat_info = await _call_info(c, *first) if first is not None else {}
            for sid, token, _ in [x for x in chat_ids if x is not None]:
                await c.delete(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {token}"})
            for sid, token in oc.extra["sessions"]:
                await c.delete(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {token}"})
    return {"chat_arrival_s": list(at), "chat_latency_s": lat, "chat_errors": errors, "job_s": job_s,
            "map_objective": part.get("objective"), "map_task_group": part.get("task_group"),
            "chat_objective": chat_info.get("objective"),
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "decode_tokens": after["decode_tokens"] - before["decode_tokens"],
            "summary": oc.values.get("summary"), **seen}


def measure_mixed(app, sizes: MixedSizes, *, capacity: Capacity, seed: int, repeat: int, kv_cache_tokens: int,
                  max_batched_tokens: int, weights: Optional[str], threads: int) -> Dict[str, Any]:
    """One run on a fresh gateway under ``capacity``; the chats' arrivals are
    seeded by ``seed`` and ``repeat`` only (the same in every setting)."""
    at = arrivals(sizes.chats, sizes.chat_rate, random.Random(f"bench-mixed:{seed}:{repeat}"))
    cfg = gateway_config(True, kv_cache_tokens, max_batched_tokens, weights=weights, threads=threads,
                         capacity=capacity)
    with Gateway(cfg) as gw:

        async def go() -> Dict[str, Any]:
            await _warm_up(gw.url)
            return await run_mixed_once(gw.url, gw.engine, app, sizes, at)

        row = asyncio.run(go())
    row.update(capacity=capacity.label, repeat=repeat)
    return row


def summarize_mixed(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One setting's runs: chat latency percentiles pooled over the repeats
    (all chats, and those that arrived while the job ran), per-repeat p99,
    the job's median completion time, what the cap did."""
    ok = [r for r in rows if "error" not in r]
    lat = [x for r in ok for x in r["chat_latency_s"] if x is not None]
    during = [x for r in ok for a, x in zip(r["chat_arrival_s"], r["chat_latency_s"])
              if x is not None and r["job_s"] is not None and a < r["job_s"]]
    jobs = [r["job_s"] for r in ok if r["job_s"] is not None]
    return {"runs": len(ok), "errors": [r["error"] for r in rows if "error" in r]
            + [e for r in ok for e in r["chat_errors"]],
            "chats": len(lat), "p50_s": percentile(lat, 50), "p90_s": percentile(lat, 90),
            "p99_s": percentile(lat, 99), "max_s": max(lat) if lat else None,
            "p99_per_repeat": [percentile([x for x in r["chat_latency_s"] if x is not None], 99) for r in ok],
            "chats_during_job": len(during), "during_p50_s": percentile(during, 50),
            "during_p99_s": percentile(during, 99),
            "job_s": statistics.median(jobs) if jobs else None, "job_all": jobs,
            "held_max": max((r.get("held_max", 0) for r in ok), default=0),
            "held_steps": sum(r.get("held_steps", 0) for r in ok), "steps": sum(r.get("steps", 0) for r in ok),
            "active_tokens_max": max((r.get("active_tokens_max", 0) for r in ok), default=0),
            "caps_seen": sorted({c for r in ok for c in r.get("caps_seen", ())}),
            "map_objective": sorted({f"{r['map_objective']}/{r['map_task_group']}" for r in ok}),
            "chat_objective": sorted({str(r["chat_objective"]) for r in ok})}


COLUMNS = ("capacity", "chats", "p50 s", "p99 s", "max s", "p99 per repeat", "chats during job", "their p50 s",
           "their p99 s", "map-reduce s", "job per repeat", "held at most", "steps holding", "runs")


def table(summ: Dict[str, Dict[str, Any]]) -> List[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for label, s in summ.items():
        if not s["runs"]:
            why = s["errors"][0][:200] if s["errors"] else "?"
            lines.append(f"| {label} | failed: {why} |" + " |" * (len(COLUMNS) - 2))
            continue
        lines.append("| " + " | ".join([
            label, str(s["chats"]), fmt(s["p50_s"], 2), fmt(s["p99_s"], 2), fmt(s["max_s"], 2),
            " ".join(fmt(x, 2) for x in s["p99_per_repeat"]), str(s["chats_during_job"]),
            fmt(s["during_p50_s"], 2), fmt(s["during_p99_s"], 2), fmt(s["job_s"], 2),
            " ".join(fmt(x, 2) for x in s["job_all"]), str(s["held_max"]),
            f"{s['held_steps']} of {s['steps']}", str(s["runs"])]) + " |")
    return lines


def compare_lines(summ: Dict[str, Dict[str, Any]]) -> List[str]:
    off, on = summ.get("off"), summ.get("on")
    if not (off and on and off["runs"] and on["runs"]):
        return []

    def r(a, b):
        return fmt(a / b, 2) if a is not None and b else "n/a"

    return [f"regulation on vs off: chat p99 {r(off['p99_s'], on['p99_s'])}x lower (off / on), p50 "
            f"{r(off['p50_s'], on['p50_s'])}x; chats during the job: p99 {r(off['during_p99_s'], on['during_p99_s'])}x;"
            f" map-reduce job {r(on['job_s'], off['job_s'])}x the time (on / off)"]


def check_lines(summ: Dict[str, Dict[str, Any]]) -> List[str]:
    out = []
    for label, s in summ.items():
        out.append(f"{label}: map calls' objective/task group {', '.join(s['map_objective'])}; chats' objective "
                   f"{', '.join(s['chat_objective'])}; caps in force seen {s['caps_seen']} (0: none but memory); "
                   f"active tokens at most {s['active_tokens_max']}")
        for e in s["errors"][:5]:
            out.append(f"{label}: error: {e[:300]}")
    on = summ.get("on")
    if on and on["runs"] and not on["held_max"]:
        out.append("on: the cap never held a request back (it did not bind: larger map calls or a smaller "
                   "--latency-cap)")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="interlace bench apps --mixed", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run): " + ", ".join(
        f"{f.name} {getattr(QUICK, f.name)}" for f in fields(MixedSizes)))
    ap.add_argument("--repeats", type=int, default=1, help="runs per capacity setting (percentiles pooled over them; "
                                                           "the settings' order alternates)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the chats' arrivals")
    for f in fields(MixedSizes):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(FULL, f.name)),
                        help=f"default {getattr(FULL, f.name)} ({getattr(QUICK, f.name)} with --quick)")
    add_engine_arguments(ap, capacity_default="both", latency_cap_default=MIXED_LATENCY_CAP)
    ap.add_argument("--json", metavar="PATH", help="write every run and the summaries as JSON")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except BenchError as e:
        print(f"interlace bench apps --mixed: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    import torch

    if args.repeats < 1:
        raise BenchError(f"--repeats must be positive, got {args.repeats}")
    settings, engine_kw = engine_options(args)
    base = QUICK if args.quick else FULL
    sizes = MixedSizes(**{f.name: (getattr(args, f.name) if getattr(args, f.name) is not None
                                   else getattr(base, f.name)) for f in fields(MixedSizes)})
    for k, v in sizes.__dict__.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise BenchError(f"--{k.replace('_', '-')} must be positive, got {v}")

    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.native.loader import load_config
    from interlace.engine_ext.tokenizer import Tokenizer

    d = embedded_model_dir()
    app = mapreduce_app(chunk_text(Tokenizer(d, load_config(d)[0]), load_document(), sizes.pieces,
                                   sizes.piece_tokens), sizes.map_tokens, sizes.reduce_tokens)
    mach = machine_description(torch=torch.__version__, engine_threads=args.threads or "adapted")
    header = (f"mixed run: {sizes.chats} chats at {sizes.chat_rate:g}/s (Poisson, seed {args.seed}), "
              f"{sizes.chat_tokens} tokens each, beside {app.about} (task group, {sizes.reduce_tokens}-token reduce); "
              f"{engine_header(args, settings)}; no network delay; {args.repeats} repeat(s)")
    rows: List[Dict[str, Any]] = []
    failed = False
    for rep in range(args.repeats):
        for cap in settings[rep % len(settings):] + settings[:rep % len(settings)]:
            t = time.perf_counter()
            try:
                row = measure_mixed(app, sizes, capacity=cap, seed=args.seed, repeat=rep,
                                    kv_cache_tokens=args.kv_cache_tokens, max_batched_tokens=args.max_batched_tokens,
                                    **engine_kw)
                done = [x for x in row["chat_latency_s"] if x is not None]
                failed |= bool(row["chat_errors"])
                print(f"  capacity {cap.label} #{rep}: chat p50 {fmt(percentile(done, 50), 2)} s, p99 "
                      f"{fmt(percentile(done, 99), 2)} s ({len(done)}/{sizes.chats} chats), map-reduce "
                      f"{fmt(row['job_s'], 2)} s, held at most {row.get('held_max', 0)} "
                      f"({time.perf_counter() - t:.1f} s with start-up)", file=sys.stderr)
            except Exception as e:  # noqa: BLE001 -- a failed run is reported, the others still run
                failed = True
                row = {"capacity": cap.label, "repeat": rep, "error": f"{type(e).__name__}: {e}"}
                print(f"  capacity {cap.label} #{rep}: FAILED: {row['error']}", file=sys.stderr)
            rows.append(row)
    summ = {c.label: summarize_mixed([r for r in rows if r["capacity"] == c.label]) for c in settings}

    print(f"\n{header}\nmachine: {describe_machine(mach)}\n")
    for ln in table(summ):
        print(ln)
    print()
    for ln in compare_lines(summ):
        print(ln)
    for ln in check_lines(summ):
        print(f"check: {ln}")
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "machine": mach, "sizes": sizes.__dict__,
                                               "seed": args.seed, "capacity": {c.label: c.config() for c in settings},
                                               "engine": {**engine_kw, "kv_cache_tokens": args.kv_cache_tokens,
                                                          "max_batched_tokens": args.max_batched_tokens},
                                               "summaries": summ, "runs": rows}, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
