"""The quantized matmuls side by side: Interlace's gguf kernel (as built for
this CPU, and optionally built for AVX2 only), fbgemm's fp16 GEMM (the
fallback) and a dense float32 matmul, over one decode step's matrices of the
embedded model, per number of rows.

    python -m interlace.bench.gguf_kernels [--rows 1 4 8 32 128 512] [--threads 2]
                                           [--isa avx2] [--json PATH]

Method.  The matrices have SmolLM2-135M's shapes (per layer: q/k/v fused
960x576, o 576x576, gate/up 3072x576, down 576x1536; 30 layers, each its own
weights; the tied head 49152x576) with random Q4 codes, scales and offsets
(the kernels' speed does not depend on the values).  Each cell is one decode
step's 121 matmuls in order, the best of 5 steps after an untimed one: the
weights stream from memory as in the engine (timing one matrix called again
and again would measure it from the cache: at one row that read faster than
this machine's memory bandwidth).  The variants take turns step by step, so
a noisy neighbour hits them alike.  ``--isa avx2`` also builds the kernel with
``-mno-avx512f`` (the code path of a CPU without AVX-512) in a separate
build directory, to compare the two code paths on one machine -- this CPU's
clock and caches, not an AVX2 machine's.  Two columns check the numbers
against their bounds: the gguf kernel's implied multiply-add rate (rows x
weights / time), against the CPU's peak, and at one row its read rate (0.625
bytes a weight), against the memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from interlace.engine_ext.machine import describe_machine
from interlace.bench.engine import machine
from interlace.engine_ext.native import cpu_matmul

# (out, in, how many per step) for SmolLM2-135M
SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]


def build_variant(extra_flags: List[str], build_dir: str) -> object:
    """The kernel built with extra compiler flags, in ``build_dir`` (not the shared cache: the
    caller removes it).  The library registers the same op namespace, so only one build can be
    loaded per process: the caller runs this in its own subprocess (see :func:`_variant_worker`)."""
    original = cpu_matmul._command

    def command():
        cmd, libs = original()
        i = cmd.index("-march=native")
        return cmd[:i + 1] + extra_flags + cmd[i + 1:], libs

    cpu_matmul._command = command
    return cpu_matmul.load(Path(build_dir))


def measure(rows: List[int], threads: int, variants: List[str], rounds: int = 5) -> Dict[str, Dict[int, float]]:
    """ms per step's matmuls for each variant ("gguf", "fp16", "float32") and row count: the best
    of ``rounds`` steps, each the 121 matmuls of one decode step in order over distinct weights (as in
    the model: 84 MB of Q4 tiles stream from memory, as they do in the engine, instead of one matrix
    called again and again from the cache); the variants take turns, step by step."""
    torch.set_num_threads(threads)
    ops = cpu_matmul.load()
    if ops is None and "gguf" in variants:
        raise SystemExit("the gguf kernel cannot be built here (no C++ compiler)")
    g = torch.Generator().manual_seed(0)
    mats = []
    for n, k, count in SHAPES:
        for _ in range(count):
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            d = (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).half().float()
            m = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.02).half().float()
            tiles = cpu_matmul.pack(codes, d, m)
            w = cpu_matmul.dequantize(tiles, True, n, k) if set(variants) - {"gguf"} else None
            fp16 = torch.ops.quantized.linear_prepack_fp16(w, None) if "fp16" in variants else None
            mats.append((n, k, tiles, w if "float32" in variants else None, fp16))
    out: Dict[str, Dict[int, float]] = {v: {} for v in variants}
    for r in rows:
        xs = {k: torch.randn(r, k, generator=g) for k in {k for _, k, _ in SHAPES}}
        step = {"gguf": lambda: [ops.q4_linear(xs[k], t, n) for n, k, t, _, _ in mats],
                "fp16": lambda: [torch.ops.quantized.linear_dynamic_fp16(xs[k], f) for n, k, _, _, f in mats],
                "float32": lambda: [xs[k] @ w.T for n, k, _, w, _ in mats]}
        best = dict.fromkeys(variants, float("inf"))
        for v in variants:
            step[v]()  # untimed
        for _ in range(rounds):
            for v in variants:
                t0 = time.perf_counter()
                step[v]()
                best[v] = min(best[v], time.perf_counter() - t0)
        for v in variants:
            out[v][r] = best[v] * 1e3
    return out


def _variant_worker(args: argparse.Namespace) -> Dict[str, Dict[int, float]]:
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="interlace-gguf-") as build_dir:
        code = ("import json,sys; from interlace.bench import gguf_kernels as b; "
                f"b.build_variant(['-mno-avx512f'], {build_dir!r}); "
                f"print(json.dumps(b.measure({args.rows!r}, {args.threads}, ['gguf'])))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return {"gguf (avx2 build)": {int(r): v for r, v in got["gguf"].items()}}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interlace.bench.gguf_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", choices=["avx2"], help="also the kernel built for AVX2 only (in a subprocess)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    res = measure(args.rows, args.threads, ["gguf", "fp16", "float32"])
    if args.isa == "avx2":
        res.update(_variant_worker(args))
    weights = sum(n * k * c for n, k, c in SHAPES)
    names = list(res)
    print(f"one decode step's matmuls of SmolLM2-135M (Q4, {weights / 1e6:.0f} M weights), ms, "
          f"{args.threads} threads\nmachine: {describe_machine(machine())}\n")
    print("| rows | " + " | ".join(names) + " | fp16 / gguf | gguf GMAC/s | gguf GB/s read |")
    print("|---" * (len(names) + 4) + "|")
    q4_bytes = weights * 0.625
    for r in args.rows:
        cells = " | ".join(f"{res[v][r]:.2f}" for v in names)
        print(f"| {r} | {cells} | {res['fp16'][r] / res['gguf'][r]:.2f}x | "
              f"{r * weights / (res['gguf'][r] * 1e-3) / 1e9:.0f} | {q4_bytes / (res['gguf'][r] * 1e-3) / 1e9:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "threads": args.threads, "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
