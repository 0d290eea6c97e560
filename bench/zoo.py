"""Block-shared serving of fine-tuned variants against one engine per
variant (``interlace bench zoo``, issue #15; BlockLLM's Table 2 shape).

    interlace bench zoo --variants 1,2,4,8 --requests 4 --max-tokens 32 --rounds 2

Variants of the embedded SmolLM2-135M (float32), generated seeded and added
to a temporary block zoo: full fine-tunes with two perturbed layers each
and LoRA adapters of ranks 8, 16, 32, 64 on all seven projections,
alternating (``full1, lora1, full2, lora2, ...``).  For each N, the same
mixed request stream (``--requests`` per variant, varied prompt lengths,
``--max-tokens`` forced with ``ignore_eos``, all submitted at once) runs:

* ``shared``: one native engine holding the base once, each variant's
  unique blocks and adapters beside it, batching every variant's requests
  together (``native/block_sharing.py``), in a worker process with all the
  torch threads;
* ``per-variant``: one engine per variant, each in its own worker process
  with the whole model (a LoRA variant merged into its weights, so it pays
  no adapter compute), the torch threads split between them, and the same
  total KV cache split evenly.

Memory is counted from the tensors the engines hold (weights, each stored
tensor once, plus the KV cache), next to its bound: the base plus each
variant's unique blocks (the zoo's ``unique_bytes``).  The LoRA row serves
8 adapters in one batch against the same requests on the base model, in
the same engine.  Every figure comes from this one run; the machine is
printed above the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from interlace.engine_ext.machine import describe_machine, machine

RANKS = (8, 16, 32, 64)
PROMPTS = [
    "Write a short note to a colleague about the release schedule of the new search tool.",
    "List three ways to speed up a slow SQL query that joins two large tables.",
    "Explain what a hash table is to a first-year student.",
    "Summarize the plot of a detective story set in a lighthouse.",
    "What should an agent do when a tool call times out? Give practical advice.",
    "Describe the water cycle in four sentences.",
    "Draft an email asking for a meeting next Tuesday about the budget.",
    "Why do caches make programs faster? Answer briefly, with an example from web servers.",
]


class BenchError(ValueError):
    pass


def _names(n_full: int, n_lora: int) -> Tuple[List[str], List[str]]:
    return [f"full{i + 1}" for i in range(n_full)], [f"lora{i + 1}" for i in range(n_lora)]


def mixed_order(n: int) -> List[str]:
    """full1, lora1, full2, lora2, ...: the first ``n``."""
    out: List[str] = []
    i = 0
    while len(out) < n:
        out += [f"full{i + 1}", f"lora{i + 1}"]
        i += 1
    return out[:n]


def prepare(work: Path, n_mixed: int, n_lora: int, seed: int) -> Dict[str, Any]:
    """A zoo under ``work`` with the base ``smol``, the mixed variants and
    ``n_lora`` adapters, plus a whole-model directory per mixed variant (for
    the per-variant engines).  Returns {zoo, dirs, infos}."""
    from safetensors.torch import save_file

    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.native.loader import load_config
    from interlace.engine_ext.zoo import Zoo, load_peft_adapter, merge_into
    from interlace.engine_ext.zoo.variants import make_full_variant, make_lora_adapter

    base_dir = embedded_model_dir()
    _, cfg = load_config(base_dir)
    zoo = Zoo(work / "zoo")
    zoo.add("smol", str(base_dir))
    mixed = mixed_order(n_mixed)
    n_full = sum(1 for n in mixed if n.startswith("full"))
    fulls, loras = _names(n_full, max(n_lora, n_mixed - n_full))
    dirs: Dict[str, Path] = {}
    L = cfg.num_layers
    for i, name in enumerate(fulls):
        # two consecutive middle-to-late layers each (BlockLLM §4.2: those change least)
        first = L // 3 + (3 * i) % max(1, L - L // 3 - 2)
        d = make_full_variant(base_dir, work / "src" / name, layers=[first, first + 1], scale=0.05, seed=seed + i)
        zoo.add(name, str(d), base="smol")
        dirs[name] = d
    base_tensors = zoo.load("smol").tensors
    for i, name in enumerate(loras):
        d = make_lora_adapter(base_dir, work / "src" / name, rank=RANKS[i % len(RANKS)], seed=seed + 100 + i)
        zoo.add(name, str(d), base="smol")
        if name in mixed:  # a whole model for its own engine: the adapter merged in
            merged = work / "merged" / name
            merged.mkdir(parents=True)
            for f in base_dir.iterdir():
                if f.is_file() and not f.name.endswith((".safetensors", ".gguf")):
                    shutil.copy(f, merged / f.name)
            ad = load_peft_adapter(d, cfg, name)
            save_file({k: v.contiguous() for k, v in merge_into(base_tensors, ad).items()},
                      str(merged / "model.safetensors"))
            dirs[name] = merged
    return {"zoo": str(zoo.root), "dirs": {k: str(v) for k, v in dirs.items()},
            "infos": {v.name: v for v in zoo.variants()}}


def requests(names: Sequence[str], per_variant: int, tokenizer: Any, seed: int) -> List[Tuple[str, List[int]]]:
    """(variant, prompt ids), interleaved across variants, varied lengths."""
    rng = random.Random(seed)
    out = []
    for k in range(per_variant):
        for name in names:
            text = " ".join(rng.sample(PROMPTS, 1 + rng.randrange(3)))
            ids = tokenizer.encode_chat([{"role": "user", "content": text}])
            out.append((name, ids))
    return out


async def _drive(engines: Dict[str, Any], reqs: List[Tuple[str, List[int]]], max_tokens: int,
                 variant_arg: bool) -> Dict[str, float]:
    from interlace.engine_ext.protocol import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    done: List[float] = []

    async def one(i: int, name: str, ids: List[int]) -> int:
        eng = engines[name]
        cid = f"r{i}"
        if variant_arg:
            await eng.fill(cid, ids, variant=name)
        else:
            await eng.fill(cid, ids)
        n = 0
        async for _ in eng.generate(cid, sampling):
            n += 1
        await eng.free_context(cid)
        done.append(time.perf_counter())
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, name, ids) for i, (name, ids) in enumerate(reqs)))
    wall = time.perf_counter() - t0
    tokens = sum(counts)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "latency_mean_s": sum(t - t0 for t in done) / len(done)}


def run_shared(zoo: str, names: Sequence[str], reqs, max_tokens: int, kv_tokens: int,
               threads: int) -> Dict[str, Any]:
    """One engine with every variant in ``names``, in a worker process as
    the per-variant engines are (the same event-loop and GIL conditions).
    Its memory is counted on the same engine built in this process: what
    :meth:`VariantSet.weight_bytes` finds it holds, plus its KV cache."""
    from interlace.engine_ext.native.setup import load_zoo_engine
    from interlace.engine_ext.worker import ProcessEngine

    names = list(dict.fromkeys(names))
    eng = ProcessEngine.start({"path": "zoo/smol", "variants": names, "zoo": zoo, "threads": threads,
                               "kv_cache_tokens": kv_tokens, "max_batched_tokens": 2048}, name="bench-shared")
    try:
        warm = [next(r for r in reqs if r[0] == n) for n in names]
        asyncio.run(_drive({n: eng for n in names}, warm, max_tokens, True))
        res = asyncio.run(_drive({n: eng for n in names}, reqs, max_tokens, True))
    finally:
        eng.close()
    local = load_zoo_engine(names, zoo, kv_cache_tokens=kv_tokens)
    try:
        w = local.variants.weight_bytes()
        kv = local.runner.kv.numel() * local.runner.kv.element_size()
    finally:
        local.close()
    res.update(weights=w["total"], base_weights=w["base"], unique_weights=w["unique"], kv=kv)
    return res


def run_per_variant(dirs: Dict[str, str], names: Sequence[str], reqs, max_tokens: int, kv_tokens: int,
                    threads: int, model_bytes: int) -> Dict[str, Any]:
    """One worker process per variant with the whole model."""
    from interlace.engine_ext.worker import ProcessEngine

    each_threads = max(1, threads // len(names))
    each_kv = max(256, kv_tokens // len(names))
    engines: Dict[str, Any] = {}
    try:
        for n in names:
            engines[n] = ProcessEngine.start({"path": dirs[n], "threads": each_threads, "kv_cache_tokens": each_kv,
                                              "max_batched_tokens": 2048}, name=f"bench-{n}")
        warm = [next(r for r in reqs if r[0] == n) for n in names]
        asyncio.run(_drive(engines, warm, max_tokens, False))
        res = asyncio.run(_drive(engines, reqs, max_tokens, False))
    finally:
        for e in engines.values():
            e.close()
    from interlace.engine_ext.native.loader import load_config

    _, cfg = load_config(Path(dirs[names[0]]))
    kv_block = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32 bytes per token
    # each engine holds a whole model: the base's bytes (every variant has the base's shapes)
    res.update(weights=len(names) * model_bytes, kv=len(names) * each_kv * kv_block, threads_each=each_threads)
    return res


def _best(a: Optional[Dict[str, Any]], b: Dict[str, Any]) -> Dict[str, Any]:
    """The round with the higher throughput (the machine's noise only slows a run down)."""
    return b if a is None or b["tok_s"] > a["tok_s"] else a


def table(rows: List[Dict[str, Any]]) -> List[str]:
    mib = 1 / 2 ** 20
    out = ["| N | variants | shared tok/s | per-variant tok/s | ratio | shared weights+KV MiB | bound MiB "
           "| shared / bound | per-variant weights+KV MiB | memory ratio |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, p = r["shared"], r["per_variant"]
        sm, pm = s["weights"] + s["kv"], p["weights"] + p["kv"]
        bound = r["bound_weights"] + s["kv"]
        out.append(f"| {r['n']} | {', '.join(r['names'])} | {s['tok_s']:.1f} | {p['tok_s']:.1f} "
                   f"| {s['tok_s'] / p['tok_s']:.2f}x | {sm * mib:.0f} | {bound * mib:.0f} | {sm / bound:.3f} "
                   f"| {pm * mib:.0f} | {pm / sm:.2f}x |")
    return out


def lora_table(rows: List[Dict[str, Any]]) -> List[str]:
    """LoRA rows: the adapters' batch against the same requests on the base.
    ``weights read``: the bytes of weights a decode step reads, base plus
    every adapter in the batch, over the base's (each adapter is read once
    per step however few rows use it: with few rows per adapter that, not
    the arithmetic, is the adapters' cost)."""
    out = ["| adapters (ranks) | requests each | batch | LoRA tok/s | base tok/s | ratio "
           "| weights read / step vs base |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        read = (r["base_bytes"] + r["adapter_bytes"]) / r["base_bytes"]
        out.append(f"| {len(r['adapters'])} ({', '.join(map(str, r['ranks']))}) | {r['requests_each']} "
                   f"| {len(r['adapters']) * r['requests_each']} | {r['lora']['tok_s']:.1f} "
                   f"| {r['base']['tok_s']:.1f} | {r['lora']['tok_s'] / r['base']['tok_s']:.2f} | {read:.2f}x |")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="interlace bench zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="1,2,4,8", help="numbers of variants N (comma-separated; none: only "
                                                         "the LoRA rows)")
    p.add_argument("--requests", type=int, default=4, help="requests per variant")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each request decodes (forced)")
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV cache tokens in all (split per variant)")
    p.add_argument("--lora-adapters", type=int, default=8, help="adapters in the LoRA rows (0: skip them)")
    p.add_argument("--lora-requests", default="4,16", help="requests per adapter in the LoRA rows (comma-separated)")
    p.add_argument("--threads", type=int, default=None, help="torch threads in all (default: the cores usable)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds; each cell is the best round, the two sides of a row taking turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", help="directory for the generated variants and zoo (default: a temporary one)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="save a PNG of throughput and memory against N here")
    args = p.parse_args(argv)
    try:
        ns = [] if args.variants == "none" else sorted({int(x) for x in args.variants.split(",") if x.strip()})
        if (not ns and args.variants != "none") or (ns and ns[0] < 1):
            raise ValueError
    except ValueError:
        print(f"error: --variants must be positive integers, got {args.variants!r}", file=sys.stderr)
        return 2
    try:
        lora_requests = [int(x) for x in args.lora_requests.split(",") if x.strip()]
    except ValueError:
        lora_requests = [0]
    if (args.rounds < 1 or args.requests < 1 or args.max_tokens < 1 or args.lora_adapters < 0
            or min(lora_requests or [0]) < 1):
        print("error: --rounds, --requests, --lora-requests and --max-tokens must be >= 1, "
              "--lora-adapters >= 0", file=sys.stderr)
        return 2
    import torch

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    m = machine(torch=torch.__version__, threads=threads)
    print(describe_machine(m))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="interlace-bench-zoo-"))
    try:
        t = time.perf_counter()
        prep = prepare(work, max(ns or [0]), args.lora_adapters, args.seed)
        print(f"generated and added {len(prep['infos']) - 1} variants in {time.perf_counter() - t:.0f} s")
        from interlace.engine_ext.tokenizer import Tokenizer
        from interlace.engine_ext.zoo import Zoo

        z = Zoo(prep["zoo"])
        base_dir = z.base_dir("smol")
        tok = Tokenizer(base_dir, json.loads((base_dir / "config.json").read_text()))
        infos = prep["infos"]
        base_bytes = infos["smol"].unique_bytes
        rows = []
        for n in ns:
            names = mixed_order(n)
            reqs = requests(names, args.requests, tok, args.seed)
            shared = per = None
            for _ in range(args.rounds):
                shared = _best(shared, run_shared(prep["zoo"], names, reqs, args.max_tokens, args.kv_tokens, threads))
                per = _best(per, run_per_variant(prep["dirs"], names, reqs, args.max_tokens, args.kv_tokens, threads,
                                                 base_bytes))
            bound = base_bytes + sum(infos[x].unique_bytes for x in names)
            rows.append({"n": n, "names": names, "shared": shared, "per_variant": per, "bound_weights": bound})
            print(table(rows)[-1], flush=True)
        lora_rows = []
        if args.lora_adapters:
            names = [f"lora{i + 1}" for i in range(args.lora_adapters)]
            adapter_bytes = sum(infos[x].unique_bytes for x in names)
            for per in lora_requests:
                reqs = requests(names, per, tok, args.seed)
                on_base = [("smol", ids) for _, ids in reqs]
                # room for every request's KV at once: the row measures the adapters, not KV pressure
                kv = max(args.kv_tokens, sum(len(ids) + args.max_tokens + 16 for _, ids in reqs))
                with_lora = base_only = None
                for _ in range(args.rounds):
                    with_lora = _best(with_lora, run_shared(prep["zoo"], names, reqs, args.max_tokens, kv, threads))
                    base_only = _best(base_only, run_shared(prep["zoo"], ["smol"], on_base, args.max_tokens, kv,
                                                            threads))
                lora_rows.append({"adapters": names, "ranks": [RANKS[i % len(RANKS)] for i in range(len(names))],
                                  "requests_each": per, "lora": with_lora, "base": base_only,
                                  "adapter_bytes": adapter_bytes, "base_bytes": base_bytes})
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if rows:
        print()
        print("\n".join(table(rows)))
    if lora_rows:
        print("\n" + "\n".join(lora_table(lora_rows)))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": m, "args": vars(args), "rows": rows, "lora": lora_rows},
                                              indent=1, default=str))
    if args.plot and rows:
        _plot(rows, args.plot)
    return 0


def _plot(rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ns, [r["shared"]["tok_s"] for r in rows], "o-", label="block-shared (one engine)")
    a.plot(ns, [r["per_variant"]["tok_s"] for r in rows], "s--", label="one engine per variant")
    a.set_xlabel("variants N")
    a.set_ylabel("generated tokens/s (wall clock)")
    a.legend()
    mib = 1 / 2 ** 20
    b.plot(ns, [(r["shared"]["weights"] + r["shared"]["kv"]) * mib for r in rows], "o-", label="block-shared")
    b.plot(ns, [(r["per_variant"]["weights"] + r["per_variant"]["kv"]) * mib for r in rows], "s--",
           label="one engine per variant")
    b.plot(ns, [(r["bound_weights"] + r["shared"]["kv"]) * mib for r in rows], ":", label="base + unique blocks + KV")
    b.set_xlabel("variants N")
    b.set_ylabel("weights + KV (MiB)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
