"""``interlace profile``: measure the cost model (:class:`Profile`) of one
model on this device, with the engine's own forward pass and swap copies.

* forward time vs batched tokens (n from 1 to ``max_batched_tokens``, a few
  points, the median of a few runs each): up to 16 tokens, a batch of n
  decodes of n contexts (each attending one block), which is what small
  batches are in decode-bound traffic and costs more than one n-token
  prefill chunk (a row per sequence: ~30% more at 4-8 rows on the embedded
  model); above, one prefill chunk of n tokens;
* forward time vs attended context: a batch of decodes over short and long
  contexts; the slope per context token (summed over the batch);
* swap time per block, out and in (averaged over a batch of blocks);
* S, the saturation point, defined as the smallest measured batch whose
  time per token is within 15% of the best time per token at any size: past
  it a larger batch costs proportionally more (InferCept 4.2 keeps
  recomputation chunks under it).

The measurement runs as one command on the engine thread (it owns the KV
cache), in blocks that are free at the time and released after: KV values
do not matter for timing.  ``source`` is "measured"; the device names the
CPU model (or the GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, List, Optional, Tuple

import torch

from ..policies.costmodel import Profile, fit_piecewise
from .block_manager import BlockTable
from .scheduler import Batch, ScheduledChunk
from .sequence import Context

SATURATION_TOLERANCE = 0.15
DECODE_ROWS_UP_TO = 16  # batch sizes measured as decode rows rather than one prefill chunk
METHOD = 2  # bumped when the measurement changes (2: small batches as decode rows); keys cached profiles


def _device_name(engine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    try:
        from ..machine import cpu_description

        cpu = cpu_description()
        return f"cpu: {cpu['model_name']} ({cpu['cpus']} CPUs)"
    except Exception:  # the description is a label: never fail the profile for it
        import platform
        return f"cpu: {platform.processor() or platform.machine()}"


def saturation_point(points: List[Tuple[int, float]], tolerance: float = SATURATION_TOLERANCE) -> int:
    """S: the smallest token count whose seconds per token are within
    ``tolerance`` of the best seconds per token measured."""
    best = min(s / n for n, s in points)
    return min(n for n, s in points if s / n <= best * (1 + tolerance))


def _measure(engine, quick: bool) -> dict:
    """On the engine thread: time forward passes and swaps."""
    bm, runner, bs = engine.blocks, engine.runner, engine.block_size
    free = len(bm.free)
    taken: List[int] = []

    def table(n_tokens: int) -> BlockTable:
        t = BlockTable([bm.allocate() for _ in range(bm.blocks_for(n_tokens))])
        taken.extend(t.blocks)
        return t

    def sync():
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    warm = []

    def timed(batch: Batch, reps: int) -> float:
        if not warm or not quick:
            runner.run(batch)  # warm-up (once in quick mode)
            sync()
            warm.append(1)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.run(batch)
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    reps = 1 if quick else 5
    try:
        max_tok = min(engine.scheduler.max_batched_tokens, (free // 2) * bs, engine.max_model_len)
        if quick:  # small batches matter most to decode-bound traffic; the largest 128
            max_tok = min(max_tok, 128)
        sizes = sorted({n for n in ([1, 2, 4, 8, 32] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048])
                        if n <= max_tok} | {max(1, max_tok)})
        fwd = []
        for n in sizes:
            if n <= DECODE_ROWS_UP_TO:  # n decodes of n contexts (each attending one block): what small batches are
                ctxs = [Context(f"p{i}", [1] * (bs + 1), table(bs + 1)) for i in range(n)]
                batch = Batch([ScheduledChunk(c, bs, 1) for c in ctxs])
            else:  # one prefill chunk of n tokens
                ctxs = [Context("profile", [1] * n, table(n))]
                batch = Batch([ScheduledChunk(ctxs[0], 0, n)])
            fwd.append((n, timed(batch, reps)))
            for c in ctxs:
                bm.release(c.table)
            taken.clear()
        # decodes over short vs long contexts: the attention term
        rows = 4
        long_ctx = max(2 * bs, min(engine.max_model_len - 1, (free // rows) * bs - 1, 256 if quick else 2048))
        short_ctx = bs
        times = {}
        for L in (short_ctx, long_ctx):
            ctxs = [Context(f"p{i}", [1] * (L + 1), table(L + 1)) for i in range(rows)]
            times[L] = timed(Batch([ScheduledChunk(c, L, 1) for c in ctxs]), reps)
            for c in ctxs:
                bm.release(c.table)
            taken.clear()
        slope = max(0.0, (times[long_ctx] - times[short_ctx]) / (rows * (long_ctx - short_ctx)))
        # swap: a batch of blocks out and back in, through the engine's host pool tensor shape
        nblk = max(1, min(4 if quick else 32, free))
        devs = [bm.allocate() for _ in range(nblk)]
        taken.extend(devs)
        host = torch.empty_like(runner.kv[:, :, :, :nblk], device="cpu",
                            pin_memory=engine.device.type == "cuda")
        swap = {}
        for direction in ("out", "in"):
            ts = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                for j, d in enumerate(devs):
                    if direction == "out":
                        host[:, :, :, j].copy_(runner.kv[:, :, :, d], non_blocking=True)
                    else:
                        runner.kv[:, :, :, d].copy_(host[:, :, :, j], non_blocking=True)
                sync()
                ts.append((time.perf_counter() - t0) / nblk)
            swap[direction] = statistics.median(ts)
        return {"fwd": fwd, "slope": slope, "swap": swap}
    finally:
        for b in taken:
            if bm.blocks[b].ref_count:
                bm.decref(b)


def measure_profile(engine, *, quick: bool = False) -> Profile:
    """Measure ``engine``'s model on its device (see the module doc).
    Runs on the engine thread; don't call it while the engine serves load
    you care about (it holds the thread for the measurement)."""
    def cmd(fut):
        fut.set_result(_measure(engine, quick))
    m = engine.call_sync(cmd)
    xs, ys = fit_piecewise(m["fwd"])
    s = saturation_point(list(zip(xs, ys)))
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    kv_bytes = engine.runner.kv_bytes_per_block(engine.model, engine.block_size, engine.runner.kv.dtype)
    swap_s = max(1e-9, (m["swap"]["out"] + m["swap"]["in"]) / 2)
    return Profile(
        model=engine.name, device=_device_name(engine), source="measured", block_size=engine.block_size,
        kv_bytes_per_token=kv_bytes // engine.block_size,
        kv_capacity_tokens=engine.blocks.num_blocks * engine.block_size,
        max_batched_tokens=engine.scheduler.max_batched_tokens, fwd_tokens=xs, fwd_seconds=ys,
        fwd_s_per_context_token=m["slope"], swap_s_per_block=swap_s, saturation_tokens=s,
        host_capacity_tokens=engine.swap.pool.num_blocks * engine.block_size,
        notes=f"dtype {dtype}; {'quick' if quick else 'full'} measurement; S: smallest batch within "
              f"{SATURATION_TOLERANCE:.0%} of the best time per token",
        extra={"swap_out_s_per_block": m["swap"]["out"], "swap_in_s_per_block": m["swap"]["in"], "dtype": dtype})


# ------------------------------------------------------------------------ CLI
def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="model path (HF dir or GGUF) or 'embedded'")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto")
    parser.add_argument("--out", default=None, help="write the JSON profile here (default: stdout)")
    parser.add_argument("--quick", action="store_true", help="a few points only (seconds)")
    parser.add_argument("--kv-cache-tokens", type=int, default=16384)
    parser.add_argument("--max-batched-tokens", type=int, default=512)


def run_profile(args: Any) -> int:
    from ..embedded import embedded_model_dir
    from .engine import NativeEngine

    path = embedded_model_dir() if args.model == "embedded" else args.model
    with NativeEngine.load(path, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens,
                           max_batched_tokens=args.max_batched_tokens) as eng:
        prof = measure_profile(eng, quick=args.quick)
    text = json.dumps(prof.to_dict(), indent=2) + "\n"
    if args.out:
        prof.save(args.out)
    else:
        sys.stdout.write(text)
    return 0
