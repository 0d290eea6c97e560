"""Engine throughput: prefill and decode tokens/s at several batch sizes, the
native engine side by side with Hugging Face transformers ``generate`` on the
same prompts and the same weights (the embedded SmolLM2-135M-Instruct unless
``--model`` says otherwise), each in float32 and bfloat16.

    interlace bench engine [--batches 1 8 32] [--prompt-len 128] [--new 64] [--repeat 3]

Method.  All prompts have the same length, so transformers needs no padding;
they are random token ids, so no two share a prefix (nothing is served from
the engine's prefix cache).  Prefill tokens/s = batch * prompt_len /
(time to compute the prompts' KV): for the engine, concurrent ``fill`` calls;
for transformers, ``generate(max_new_tokens=1)``.  Decode tokens/s = batch *
(new - 1) / decode time: for the engine, the ``generate`` streams after the
fill (its first token comes from the fill's logits and is not counted); for
transformers, ``generate(new)`` minus ``generate(1)``.  Greedy, EOS ignored.

Each variant (engine x dtype) is measured in a fresh subprocess (so no
variant inherits another's threads, caches or allocator state), the variants
take turns within each of ``--repeat`` rounds (so a noisy neighbour on a
shared machine hits them alike), and the best round per cell is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from interlace.bench import describe_machine, machine as machine_description

def prompts(vocab_size: int, n: int, length: int, seed: int) -> List[List[int]]:
    """``n`` prompts of random token ids (clear of the special tokens at both
    ends of the vocabulary).  Random, so that no two prompts -- and no two
    batch sizes or rounds -- share a prefix: the engine's prefix cache must
    not turn a prefill measurement into a cache hit."""
    rng = random.Random(seed)
    lo, hi = min(1000, vocab_size // 4), vocab_size - 100
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def bench_native(engine, batch: List[List[int]], new: int) -> Dict[str, float]:
    from interlace.engine_ext.protocol import SamplingParams

    sp = SamplingParams(max_tokens=new, ignore_eos=True)

    async def go():
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.fill(f"b{i}", p) for i, p in enumerate(batch)))
        t1 = time.perf_counter()

        async def drain(i):
            n = 0
            async for _ in engine.generate(f"b{i}", sp):
                n += 1
            return n
        counts = await asyncio.gather(*(drain(i) for i in range(len(batch))))
        t2 = time.perf_counter()
        for i in range(len(batch)):
            await engine.free_context(f"b{i}")
        assert all(c == new for c in counts)
        return t1 - t0, t2 - t1

    tp, td = asyncio.run(go())
    plen = len(batch[0])
    return {"prefill": len(batch) * plen / tp, "decode": len(batch) * (new - 1) / td}


def bench_hf(model, batch: List[List[int]], new: int) -> Dict[str, float]:
    import torch

    ids = torch.tensor(batch)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, attention_mask=mask, pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        t2 = time.perf_counter()
    assert out.shape[1] == ids.shape[1] + new
    tp, tg = t1 - t0, t2 - t1
    return {"prefill": len(batch) * ids.shape[1] / tp, "decode": len(batch) * (new - 1) / max(tg - tp, 1e-9)}


def machine() -> Dict[str, object]:
    """The machine as recorded with the results: the CPU with its ISA flags
    (:func:`interlace.bench.machine`), torch's threads, version and the CPU
    kernel level it dispatches to, and the GPU if one is used."""
    import torch

    extra: Dict[str, object] = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if torch.cuda.is_available():
        extra["gpu"] = torch.cuda.get_device_name()
    return machine_description(**extra)


def measure(variant: str, model: Optional[str], batches: List[int], prompt_len: int, new: int) -> Dict[int, dict]:
    """One variant ("interlace float32", "transformers bfloat16", ...), all
    batch sizes, in this process."""
    import torch

    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.native.loader import load_config, resolve_model_dir

    engine, dtype = variant.split()
    model_dir = resolve_model_dir(model) if model else embedded_model_dir()
    vocab = load_config(model_dir)[1].vocab_size
    seeds = {b: 1000 * b + 7 for b in batches}
    if engine == "interlace":
        need = max(batches) * (prompt_len + new) + 1024
        with NativeEngine.load(model_dir, dtype=dtype, kv_cache_tokens=need) as eng:
            bench_native(eng, prompts(vocab, 2, prompt_len, seed=1), 4)  # warm-up: kernels for these shapes
            return {b: bench_native(eng, prompts(vocab, b, prompt_len, seeds[b]), new) for b in batches}
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    bench_hf(hf, prompts(vocab, 2, prompt_len, seed=1), 4)
    return {b: bench_hf(hf, prompts(vocab, b, prompt_len, seeds[b]), new) for b in batches}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="interlace bench engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each cell reports its best round")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--plot", help="save a PNG plot of decode tokens/s here")
    ap.add_argument("--json", help="also write every round as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one variant, print JSON
    args = ap.parse_args(argv)

    if args.worker:
        res = measure(args.worker, args.model, args.batches, args.prompt_len, args.new)
        print("RESULT " + json.dumps({"result": res, "machine": machine()}))
        return 0

    variants = [f"interlace {d}" for d in args.dtypes] + ([] if args.no_hf else [f"transformers {d}"
                                                                                  for d in args.dtypes])
    rounds: Dict[str, List[Dict[int, dict]]] = {v: [] for v in variants}
    mach: Dict[str, object] = {}
    for r in range(args.repeat):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            cmd = [sys.executable, "-m", "interlace.bench.engine", "--worker", v, "--batches",
                   *map(str, args.batches), "--prompt-len", str(args.prompt_len), "--new", str(args.new)]
            if args.model:
                cmd += ["--model", args.model]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"variant {v!r} failed (exit {out.returncode})")
            got = json.loads(line[len("RESULT "):])
            mach = got["machine"]
            rounds[v].append({int(b): x for b, x in got["result"].items()})
            print(f"round {r + 1}/{args.repeat} {v}: " + ", ".join(
                f"b={b} decode {x['decode']:.0f} tok/s" for b, x in rounds[v][-1].items()), file=sys.stderr)
    rows = {v: {b: {k: max(rd[b][k] for rd in rounds[v]) for k in ("prefill", "decode")} for b in args.batches}
            for v in variants}

    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (embedded)"
    print(f"\n{name} | prompt {args.prompt_len} tokens, {args.new} new | best of {args.repeat}\n"
          f"machine: {describe_machine(mach)}\n")
    print("| engine | " + " | ".join(f"prefill b={b} | decode b={b}" for b in args.batches) + " |")
    print("|" + "---|" * (1 + 2 * len(args.batches)))
    for v, r in rows.items():
        print(f"| {v} | " + " | ".join(f"{r[b]['prefill']:.0f} | {r[b]['decode']:.0f}" for b in args.batches) + " |")
    hf = {v: r for v, r in rows.items() if v.startswith("transformers")}
    if hf:
        best_hf = {b: max(r[b]["decode"] for r in hf.values()) for b in args.batches}
        print("\ndecode speed-up (tokens/s ratio) over transformers in the same dtype, and over the faster "
              "transformers dtype:")
        for v, r in rows.items():
            if v.startswith("interlace"):
                same = hf.get("transformers " + v.split()[1])
                print(f"  {v}: " + ", ".join(
                    f"b={b}: {r[b]['decode'] / same[b]['decode']:.2f}x / {r[b]['decode'] / best_hf[b]:.2f}x"
                    if same else f"b={b}: {r[b]['decode'] / best_hf[b]:.2f}x" for b in args.batches))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": mach, "rounds": rounds, "best": rows}, indent=1))
    if args.plot:
        plot(rows, args.batches, f"{name}: decode, best of {args.repeat}", args.plot)
        print(f"plot saved to {args.plot}")
    return 0


def plot(rows: Dict[str, Dict[int, dict]], batches: List[int], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for v, r in rows.items():
        ax.plot(batches, [r[b]["decode"] for b in batches], marker="o",
                linestyle="-" if v.startswith("interlace") else "--", label=v)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
