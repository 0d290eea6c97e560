"""Quantized weights checked, not assumed: quality and decode speed of
``weights: as-shipped`` (the GGUF's own quantized tensors) and ``weights:
int8`` (per-channel int8 from the float weights) against the float32
reference dequantized from the same GGUF (the engine's default).

    python -m interlace.bench.quant_quality [--model X.gguf] [--new 32] [--batches 1 8] [--repeat 3]

Quality, on ``--prompts`` chat prompts (20 built in), each variant in the
native engine at float32 compute:

* greedy agreement: ``--new`` greedy tokens per prompt (EOS ignored); the
  fraction of positions equal to the reference's before the first
  divergence (mean over prompts), and how many prompts match in full;
* logits error at the last prompt position (the first generated token's
  logits): max |delta| over prompts and vocabulary, and the relative RMS
  ``||delta|| / ||reference||`` (mean over prompts);
* teacher forcing: every variant reads the reference's greedy continuation
  token by token; top-1 agreement with the reference's logits over all
  ``prompts x new`` positions, and the mean relative RMS there.

``--reference`` compares with another variant than float32: ``--reference
as-shipped-no-amx --variants as-shipped+amx`` measures the AMX path
(``engine_ext/native/amx.py``, forced on with ``INTERLACE_AMX=on``, so on any
CPU) against the gguf kernel at every size; the table adds the largest logit
difference relative to the largest logit (last-pos max rel diff).

Speed: decode tokens/s at each batch size (random prompts of
``--prompt-len`` tokens, ``--speed-new`` new tokens, as ``interlace bench
engine`` measures the native engine), each variant in its own subprocess,
the variants taking turns for ``--repeat`` rounds, the best round reported.

``--q8-check``: the Q8_0 design (``engine_ext/native/quant.py``) measured on
real weight shapes: the exact doubled-int4 matmul against a per-channel int8
requantization of the same Q8_0 weights and against dense float32 (error of
the outputs, time per call).  ``--kernel-check THREADS``: one decode step's
weight matmuls (the model's shapes) timed per kernel: dense float32 and
bfloat16, aten int4 and int8, fbgemm fp16 and dynamic int8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from interlace.engine_ext.machine import describe_machine, machine as machine_description

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 20.",
    "How do I reverse a list in Python?",
    "What is the difference between weather and climate?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What does HTTP stand for, and what is it used for?",
    "Suggest a name for a friendly robot.",
    "How many legs does a spider have?",
    "Write a SQL query that counts the rows of a table named users.",
    "What are the benefits of regular exercise?",
    "Describe a cat to someone who has never seen one.",
    "What is 17 multiplied by 23?",
    "Tell me a fun fact about octopuses.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a black hole is to a ten-year-old.",
]

VARIANTS = {  # name -> NativeEngine.load keyword arguments (besides the model)
    "float32": {},
    "as-shipped": {"weights": "as-shipped"},
    "as-shipped+amx": {"weights": "as-shipped"},     # INTERLACE_AMX=on: the bf16 (AMX) path, any CPU
    "as-shipped-no-amx": {"weights": "as-shipped"},  # INTERLACE_AMX=off: the gguf kernel at every size
    "int8": {"weights": "int8"},
    "bfloat16": {"weights": "bfloat16"},
}
#: the environment a variant loads under (engine_ext/native/amx.py reads INTERLACE_AMX at load)
VARIANT_ENV = {"as-shipped+amx": {"INTERLACE_AMX": "on"}, "as-shipped-no-amx": {"INTERLACE_AMX": "off"}}


def machine() -> Dict[str, object]:
    import torch

    return machine_description(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                               torch_cpu_capability=torch.backends.cpu.get_cpu_capability())


def gguf_path(model: Optional[str]) -> Path:
    if model:
        return Path(model)
    from interlace.engine_ext.embedded import embedded_gguf

    return embedded_gguf()


def load(variant: str, model: Optional[str], **kw):
    import os

    from interlace.engine_ext.native.engine import NativeEngine

    env = VARIANT_ENV.get(variant, {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return NativeEngine.load(gguf_path(model), dtype="float32", **VARIANTS[variant], **kw)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ============================================================ quality
async def greedy(eng, prompts: List[List[int]], new: int, batch: int = 0):
    """Per prompt: the logits after the prompt and ``new`` greedy tokens; at most ``batch``
    prompts at a time (0: all), so decode steps run that many rows."""
    from interlace.engine_ext.protocol import SamplingParams

    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(batch or len(prompts))

    async def one(i: int, ids: List[int]):
        async with gate:
            c = f"g{i}"
            await eng.fill(c, ids)
            first = await eng.last_logits(c)
            toks = [ev.token_id async for ev in eng.generate(c, sp) if ev.token_id is not None]
            await eng.free_context(c)
            return first, toks

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def teacher_forced(eng, prompts: List[List[int]], conts: List[List[int]], batch: int = 0):
    """Per prompt: the logits at each position of the continuation ``conts[i]`` read token by token
    (at most ``batch`` prompts at a time, 0: all)."""
    import torch

    gate = asyncio.Semaphore(batch or len(prompts))

    async def one(i: int, ids: List[int], cont: List[int]):
        async with gate:
            c = f"t{i}"
            await eng.fill(c, ids)
            out = [await eng.last_logits(c)]
            for t in cont[:-1]:
                await eng.fill(c, [t])
                out.append(await eng.last_logits(c))
            await eng.free_context(c)
            return torch.stack(out)

    return await asyncio.gather(*(one(i, p, c) for i, (p, c) in enumerate(zip(prompts, conts))))


def rel_rms(d, ref) -> float:
    return float(d.float().pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt())


def quality(model: Optional[str], variants: List[str], new: int, batch: int = 0,
            reference: str = "float32") -> Dict[str, dict]:
    import torch

    with load(reference, model) as ref_eng:
        tok = ref_eng.tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        ref_g = asyncio.run(greedy(ref_eng, prompts, new))
        conts = [t for _, t in ref_g]
        ref_tf = asyncio.run(teacher_forced(ref_eng, prompts, conts))
    rows: Dict[str, dict] = {}
    for v in variants:
        t0 = time.perf_counter()
        with load(v, model) as eng:
            load_s = time.perf_counter() - t0
            got_g = asyncio.run(greedy(eng, prompts, new, batch))
            got_tf = asyncio.run(teacher_forced(eng, prompts, conts, batch))
        prefix, full = [], 0
        for (_, a), b in zip(got_g, conts):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            prefix.append(n / new)
            full += a == b
        last_d = [(g - r) for (g, _), (r, _) in zip(got_g, ref_g)]
        top1 = torch.cat([(g.argmax(-1) == r.argmax(-1)) for g, r in zip(got_tf, ref_tf)]).float().mean()
        rows[v] = {"prefix_agreement": sum(prefix) / len(prefix), "full_matches": full, "prompts": len(prompts),
                   "last_max_abs": max(float(d.abs().max()) for d in last_d),
                   "last_rel_rms": sum(rel_rms(d, r) for d, (r, _) in zip(last_d, ref_g)) / len(last_d),
                   "last_max_rel": max(float(d.abs().max() / r.abs().max()) for d, (r, _) in zip(last_d, ref_g)),
                   "tf_top1": float(top1),
                   "tf_rel_rms": sum(rel_rms(g - r, r) for g, r in zip(got_tf, ref_tf)) / len(got_tf),
                   "load_s": load_s}
        print(f"quality {v}: {rows[v]}", file=sys.stderr)
    return rows


# ============================================================ speed
def speed_worker(variant: str, model: Optional[str], batches: List[int], prompt_len: int, new: int) -> dict:
    from interlace.engine_ext.native.quant import weight_bytes

    from .engine import bench_native, prompts  # the engine benchmark's own measurement

    t0 = time.perf_counter()
    with load(variant, model, kv_cache_tokens=max(batches) * (prompt_len + new) + 512) as eng:
        load_s = time.perf_counter() - t0
        wbytes = weight_bytes(eng.model)
        vocab = eng.vocab_size
        bench_native(eng, prompts(vocab, 2, prompt_len, 1), 4)  # warm-up
        res = {b: bench_native(eng, prompts(vocab, b, prompt_len, 1000 * b + 7), new) for b in batches}
    return {"result": res, "load_s": load_s, "weights_mb": wbytes / 2 ** 20}


def speed(model: Optional[str], variants: List[str], batches: List[int], prompt_len: int, new: int,
          repeat: int) -> Dict[str, dict]:
    rounds: Dict[str, List[dict]] = {v: [] for v in variants}
    for r in range(repeat):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            cmd = [sys.executable, "-m", "interlace.bench.quant_quality", "--speed-worker", v, "--batches",
                   *map(str, batches), "--prompt-len", str(prompt_len), "--speed-new", str(new)]
            if model:
                cmd += ["--model", model]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"speed variant {v!r} failed (exit {out.returncode})")
            got = json.loads(line[len("RESULT "):])
            rounds[v].append(got)
            print(f"speed round {r + 1}/{repeat} {v}: " + ", ".join(
                f"b={b} decode {x['decode']:.1f} tok/s" for b, x in got["result"].items()), file=sys.stderr)
    return {v: {"best": {int(b): {k: max(rd["result"][str(b)][k] for rd in rs) for k in ("prefill", "decode")}
                         for b in batches},
                "load_s": min(rd["load_s"] for rd in rs), "weights_mb": rs[0]["weights_mb"],
                "rounds": rs}
            for v, rs in rounds.items()}


# ============================================================ the Q8_0 design check
def q8_check(model: Optional[str]) -> List[dict]:
    """The doubled-int4 Q8_0 matmul against per-channel int8 requantization and dense float32, on
    the model's own weight shapes (its float32 weights quantized to Q8_0 here)."""
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from interlace.engine_ext.native import quant as Q
    from interlace.engine_ext.native.loader import resolve_model_dir
    from safetensors.torch import load_file

    sd = load_file(str(resolve_model_dir(gguf_path(model)) / "model.safetensors"))
    names = [n for n in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
                         "model.embed_tokens.weight") if n in sd]
    rows = []
    torch.manual_seed(0)
    for name in names:
        w = sd[name].float()
        raw = torch.from_numpy(quantize(w.numpy(), T.Q8_0).copy())
        ref_w = Q.dequantize_rows(raw, Q.Q8_0)
        mods = {"doubled int4, aten (exact)": Q.Int4Linear(Q.int4_groups(raw, Q.Q8_0), kernel="aten"),
                "fp16 values, fbgemm": Q.Int4Linear(Q.int4_groups(raw, Q.Q8_0), kernel="fp16"),
                "requantized per channel, int8 aten": Q.Int8Linear(ref_w),
                "dense float32": torch.nn.Linear(w.shape[1], w.shape[0], bias=False)}
        with torch.no_grad():
            mods["dense float32"].weight.copy_(ref_w)
        for label, mod in mods.items():
            row = {"matrix": f"{name.replace('model.', '').replace('.weight', '')} {tuple(w.shape)}",
                   "variant": label}
            for m in (1, 8):
                x = torch.randn(m, w.shape[1])
                with torch.inference_mode():
                    ref = (x.double() @ ref_w.double().T)
                    y = mod(x)
                    row[f"rel_err_m{m}"] = rel_rms(y.double() - ref, ref)
                    n = 20 if m == 1 else 5
                    for _ in range(2):
                        mod(x)
                    t0 = time.perf_counter()
                    for _ in range(n):
                        mod(x)
                    row[f"us_m{m}"] = (time.perf_counter() - t0) / n * 1e6
            rows.append(row)
            print(f"q8 {row}", file=sys.stderr)
    return rows


# ============================================================ the kernels on this CPU
def kernel_check(model: Optional[str], threads: int, ms: List[int]) -> List[dict]:
    """One decode step's weight matmuls (every projection of the model's shapes, random values,
    each kernel over all matrices: hundreds of MB, so memory-bound as in the engine), best of 3."""
    import warnings

    import torch

    from interlace.engine_ext.native import quant as Q
    from interlace.engine_ext.native.loader import load_config, resolve_model_dir

    warnings.filterwarnings("ignore")  # torch's deprecation notice of quantized tensors (fbgemm int8)
    c = load_config(resolve_model_dir(gguf_path(model)))[1]
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    shapes = [(qkv, c.hidden_size), (c.hidden_size, c.num_heads * c.head_dim),
              (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)] * c.num_layers
    shapes.append((c.vocab_size, c.hidden_size))
    torch.set_num_threads(threads)
    torch.manual_seed(0)

    def make(kind: str, n: int, k: int):
        w = torch.randn(n, k) * 0.05
        if kind == "float32 (dense)":
            return lambda x: torch.nn.functional.linear(x, w)
        if kind == "bfloat16 (dense)":
            wb = w.bfloat16()
            return lambda x: torch.nn.functional.linear(x.bfloat16(), wb)
        if kind.startswith("int4"):
            scale = (torch.rand(n, k // 32) * 0.01).half().float()  # a GGUF's scales are fp16 values
            g = Q.Int4Groups(torch.randint(0, 16, (n, k), dtype=torch.uint8), scale, 8 * scale)
            return Q.Int4Linear(g, kernel=kind.split()[1])
        if kind == "int8 aten (weight-only)":
            return Q.Int8Linear(w)
        if kind == "int8 fbgemm (dynamic activations)":
            qw = torch.quantize_per_channel(w, w.abs().amax(1) / 127, torch.zeros(n, dtype=torch.long), 0,
                                            torch.qint8)
            p = torch.ops.quantized.linear_prepack(qw, None)
            return lambda x: torch.ops.quantized.linear_dynamic(x, p, True)
        raise ValueError(kind)

    rows = []
    from interlace.engine_ext.native import cpu_matmul

    gguf = ("int4 gguf (Interlace's kernel)",) if cpu_matmul.load() is not None else ()
    for kind in ("float32 (dense)", "bfloat16 (dense)", "int4 aten", "int4 fp16 (fbgemm)", *gguf,
                 "int8 aten (weight-only)", "int8 fbgemm (dynamic activations)"):
        mods = [make(kind, n, k) for n, k in shapes]
        row = {"kernel": kind, "threads": threads}
        for m in ms:
            xs = {k: torch.randn(m, k) for k in {k for _, k in shapes}}
            best = float("inf")
            with torch.inference_mode():
                for _ in range(3):
                    t0 = time.perf_counter()
                    for (n, k), mod in zip(shapes, mods):
                        mod(xs[k])
                    best = min(best, time.perf_counter() - t0)
            row[f"ms_m{m}"] = best * 1e3
        rows.append(row)
        print(f"kernel {row}", file=sys.stderr)
        del mods
    return rows


# ============================================================ main
def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interlace.bench.quant_quality",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .gguf file (default: the embedded SmolLM2-135M-Instruct, Q4_1)")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--quality-batch", type=int, default=0, metavar="N",
                    help="quality: at most N prompts at a time, so the decode steps run N rows (default: all "
                         "20 at once; 1 measures batch-1 decode)")
    ap.add_argument("--variants", nargs="+", default=["as-shipped", "int8"], choices=list(VARIANTS))
    ap.add_argument("--reference", default="float32", choices=list(VARIANTS),
                    help="quality: the variant the others are compared with (default float32; as-shipped-no-amx "
                         "measures the AMX path against the gguf kernel)")
    ap.add_argument("--speed-variants", nargs="+", default=["float32", "as-shipped", "int8"],
                    choices=list(VARIANTS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--speed-new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--q8-check", action="store_true", help="also measure the Q8_0 options")
    ap.add_argument("--kernel-check", type=int, metavar="THREADS",
                    help="also time one step's weight matmuls per kernel with this many torch threads")
    ap.add_argument("--int4-kernel", choices=["auto", "gguf", "fp16", "aten"],
                    help="force the kernel of as-shipped's quantized matrices (default: this CPU's, see "
                         "engine_ext/native/quant.py int4_kernel)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--speed-worker", help=argparse.SUPPRESS)  # internal: one variant's speed, as JSON
    args = ap.parse_args(argv)

    if args.int4_kernel:  # inherited by the speed workers
        import os

        os.environ["INTERLACE_INT4_KERNEL"] = args.int4_kernel
    if args.speed_worker:
        res = speed_worker(args.speed_worker, args.model, args.batches, args.prompt_len, args.speed_new)
        print("RESULT " + json.dumps({**res, "machine": machine()}))
        return 0

    out: Dict[str, object] = {"machine": machine()}
    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (embedded, Q4_1 GGUF)"
    from interlace.engine_ext.native.quant import int4_kernel

    out["int4_kernel"] = int4_kernel()
    print(f"\n{name}\nmachine: {describe_machine(out['machine'])}\n"
          f"as-shipped kernel: {out['int4_kernel']}; int8 kernel: aten _weight_int8pack_mm")
    if not args.no_quality:
        q = out["quality"] = quality(args.model, args.variants, args.new, args.quality_batch, args.reference)
        against = ("float32 dequantized from the same GGUF" if args.reference == "float32"
                   else f"{args.reference} on the same GGUF")
        print(f"\nquality against {against} | {len(PROMPTS)} chat prompts, "
              f"{args.new} greedy tokens each, float32 compute\n")
        print("| weights | greedy prefix agreement | full matches | last-pos max abs diff | last-pos max rel diff "
              "| last-pos rel RMS | teacher-forced top-1 | teacher-forced rel RMS |")
        print("|---|---|---|---|---|---|---|---|")
        for v, r in q.items():
            print(f"| {v} | {r['prefix_agreement']:.3f} | {r['full_matches']}/{r['prompts']} | "
                  f"{r['last_max_abs']:.3f} | {r['last_max_rel']:.4f} | {r['last_rel_rms']:.4f} | "
                  f"{r['tf_top1']:.3f} | {r['tf_rel_rms']:.4f} |")
    if not args.no_speed:
        s = out["speed"] = speed(args.model, args.speed_variants, args.batches, args.prompt_len, args.speed_new,
                                 args.repeat)
        print(f"\ndecode tokens/s (prompt {args.prompt_len} random tokens, {args.speed_new} new, best of "
              f"{args.repeat}; each variant in its own process)\n")
        print("| weights | " + " | ".join(f"decode b={b} | prefill b={b}" for b in args.batches)
              + " | load s | weights MiB |")
        print("|" + "---|" * (3 + 2 * len(args.batches)))
        for v, r in s.items():
            print(f"| {v} | " + " | ".join(f"{r['best'][b]['decode']:.1f} | {r['best'][b]['prefill']:.0f}"
                                           for b in args.batches)
                  + f" | {r['load_s']:.1f} | {r['weights_mb']:.0f} |")
    if args.q8_check:
        rows = out["q8_check"] = q8_check(args.model)
        print("\nQ8_0 options (the model's float32 weights quantized to Q8_0; output error relative to the "
              "exact Q8_0 matmul, random activations)\n")
        print("| matrix | variant | rel err m=1 | rel err m=8 | us/call m=1 | us/call m=8 |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['matrix']} | {r['variant']} | {r['rel_err_m1']:.2e} | {r['rel_err_m8']:.2e} | "
                  f"{r['us_m1']:.0f} | {r['us_m8']:.0f} |")
    if args.kernel_check:
        ms = [1, 8]
        rows = out["kernel_check"] = kernel_check(args.model, args.kernel_check, ms)
        print(f"\none decode step's weight matmuls (the model's shapes, {args.kernel_check} torch thread(s), "
              f"best of 3), ms\n")
        print("| kernel | " + " | ".join(f"m={m}" for m in ms) + " |")
        print("|---|" + "---|" * len(ms))
        for r in rows:
            print(f"| {r['kernel']} | " + " | ".join(f"{r[f'ms_m{m}']:.1f}" for m in ms) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
