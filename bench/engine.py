"""Engine throughput: prefill and decode tokens/s at several batch sizes, the
native engine side by side with Hugging Face transformers ``generate`` on the
same prompts and the same weights (the embedded SmolLM2-135M-Instruct unless
``--model`` says otherwise).

    interlace bench engine [--batches 1 8 32] [--prompt-len 128] [--new 64]

Method.  All prompts have the same length (slices of one text), so
transformers needs no padding.  Prefill tokens/s = batch * prompt_len /
(time to compute the prompts' KV): for the engine, concurrent ``fill`` calls;
for transformers, ``generate(max_new_tokens=1)``.  Decode tokens/s = batch *
(new - 1) / decode time: for the engine, the ``generate`` streams after the
fill (its first token comes from the fill's logits and is not counted); for
transformers, ``generate(new)`` minus ``generate(1)``.  Greedy, EOS ignored,
best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

TEXT = ("The history of computing is a story of abstractions layered on abstractions. Early machines were "
        "programmed by rewiring; stored programs made software possible; compilers let people think in "
        "expressions instead of registers; operating systems hid devices behind files. Each layer traded a "
        "little efficiency for a great deal of leverage, and each was at first dismissed as too slow. ") * 20


def prompts(tok, n: int, length: int) -> List[List[int]]:
    ids = tok.encode(TEXT)
    return [ids[i * 7:i * 7 + length] for i in range(n)]


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


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="interlace bench engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="engine dtypes to run")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--plot", help="save a PNG plot of decode tokens/s here")
    args = ap.parse_args(argv)

    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.native.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model) if args.model else embedded_model_dir()
    rows: Dict[str, Dict[int, Dict[str, float]]] = {}
    tok = None
    for dtype in args.dtypes:
        need = max(args.batches) * (args.prompt_len + args.new) + 1024
        with NativeEngine.load(model_dir, dtype=dtype, kv_cache_tokens=need) as eng:
            tok = eng.tokenizer
            bench_native(eng, prompts(tok, 2, 16), 4)  # warm-up
            rows[f"interlace {dtype}"] = {
                b: _best([bench_native(eng, prompts(tok, b, args.prompt_len), args.new) for _ in range(args.repeat)])
                for b in args.batches}
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        bench_hf(hf, prompts(tok, 2, 16), 4)
        rows["transformers float32"] = {
            b: _best([bench_hf(hf, prompts(tok, b, args.prompt_len), args.new) for _ in range(args.repeat)])
            for b in args.batches}

    print(f"\n{model_dir.name} | prompt {args.prompt_len} tokens, {args.new} new | {machine()} | "
          f"{datetime.date.today()}\n")
    head = "| engine | " + " | ".join(f"prefill b={b} | decode b={b}" for b in args.batches) + " |"
    print(head)
    print("|" + "---|" * (1 + 2 * len(args.batches)))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[b]['prefill']:.0f} | {r[b]['decode']:.0f}" for b in args.batches) + " |")
    base = rows.get("transformers float32")
    if base:
        print("\ndecode speed-up over transformers float32 (tokens/s ratio):")
        for name, r in rows.items():
            if name != "transformers float32":
                print(f"  {name}: " + ", ".join(f"b={b}: {r[b]['decode'] / base[b]['decode']:.2f}x"
                                                 for b in args.batches))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, r in rows.items():
            ax.plot(args.batches, [r[b]["decode"] for b in args.batches], marker="o", label=name)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model_dir.name}: decode throughput")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot saved to {args.plot}")
    return 0


def _best(runs: List[Dict[str, float]]) -> Dict[str, float]:
    return {k: max(r[k] for r in runs) for k in runs[0]}


if __name__ == "__main__":
    raise SystemExit(main())
