"""A cost-model profile of a vLLM engine, measured through the engine
protocol (LAMPS' scores need forward times; ``profile: auto``).

vLLM does not expose single forward passes, so the measurement times what
the protocol offers and derives the same quantities the native profiler
measures directly (engine_ext/native/profiler.py):

* forward time vs batched tokens, small batches: ``n`` concurrent greedy
  decodes of ``k`` tokens each (``ignore_eos``) from short, distinct
  prompts; the time from the slowest first token to the last token, over
  ``k - 1`` steps, is one step of ``n`` decode rows;
* forward time of a prefill chunk of ``n`` tokens: a ``fill`` of ``n`` fresh
  tokens (one request that prefills them and samples one token), less one
  decode step;
* the attention slope: decodes of 4 rows over short vs long contexts;
* no swap: the vLLM engine discards (with prefix reuse) on every
  interception, so the swap time is set high enough that no waste model
  ever prefers it (the ranking predicts what the engine will do).

The result is cached per model, dtype, device and block size, as the
native engine's is, so only the first start-up pays (about a minute for a
small model on a CPU).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
from typing import Any, List, Tuple

from ..policies.costmodel import Profile, fit_piecewise
from ..protocol import SamplingParams

METHOD = 1
NO_SWAP_S_PER_BLOCK = 10.0  # "never worth it": the engine cannot swap
_ids = itertools.count()


async def _decode_step(engine: Any, rows: int, prompt_len: int, steps: int, rng: random.Random) -> float:
    V = min(engine.vocab_size, 30000)
    cids = [f"profile-{next(_ids)}" for _ in range(rows)]
    firsts: List[float] = []
    lasts: List[float] = []

    async def one(cid: str) -> None:
        await engine.fill(cid, [rng.randrange(100, V) for _ in range(prompt_len)])
        n = 0
        async for ev in engine.generate(cid, SamplingParams(max_tokens=steps, ignore_eos=True)):
            n += 1
            if n == 1:
                firsts.append(time.perf_counter())
        lasts.append(time.perf_counter())
    try:
        await asyncio.gather(*(one(c) for c in cids))
    finally:
        for c in cids:
            engine.free_context_nowait(c)
    return max(1e-6, (max(lasts) - max(firsts)) / (steps - 1))


async def _prefill(engine: Any, n: int, decode_s: float, rng: random.Random) -> float:
    V = min(engine.vocab_size, 30000)
    cid = f"profile-{next(_ids)}"
    t0 = time.perf_counter()
    await engine.fill(cid, [rng.randrange(100, V) for _ in range(n)])
    dt = time.perf_counter() - t0
    await engine.free_context(cid)
    return max(1e-6, dt - decode_s)


async def _measure(engine: Any, quick: bool) -> dict:
    rng = random.Random(0)
    steps = 12 if quick else 32
    reps = 1 if quick else 3
    await _decode_step(engine, 1, 8, 4, rng)  # warm-up
    fwd: List[Tuple[int, float]] = []
    for rows in (1, 2, 4, 8) if quick else (1, 2, 4, 8, 16):
        fwd.append((rows, statistics.median([await _decode_step(engine, rows, 8, steps, rng) for _ in range(reps)])))
    one = fwd[0][1]
    top = min(engine.max_model_len - 2, int(getattr(engine, "max_batched_tokens", 0) or 512))
    top = min(top, 512) if quick else top
    for n in sorted({n for n in (32, 128, 512, 2048) if 16 < n <= top} | ({top} if top > 16 else set())):
        fwd.append((n, statistics.median([await _prefill(engine, n, one, rng) for _ in range(reps)])))
    fwd.sort()
    short, long_ = 16, min(engine.max_model_len - steps - 1, 256 if quick else 1024)
    t_short = await _decode_step(engine, 4, short, steps, rng)
    t_long = await _decode_step(engine, 4, long_, steps, rng)
    slope = max(0.0, (t_long - t_short) / (4 * (long_ - short)))
    return {"fwd": fwd, "slope": slope}


def measure_request_profile(engine: Any, *, quick: bool = True, model: str = "", device: str = "",
                            kv_bytes_per_token: int = 1) -> Profile:
    """Measure ``engine`` (a running :class:`RequestEngine`) from a thread
    that is not its loop's."""
    from ..native.profiler import saturation_point

    m = asyncio.run(_measure(engine, quick))
    # keep ascending, strictly: a decode row count and a prefill size may coincide after dedup
    points = sorted({n: s for n, s in m["fwd"]}.items())
    xs, ys = fit_piecewise(points)
    return Profile(
        model=model or engine.name, device=device or "unknown", source="measured (through the engine protocol)",
        block_size=engine.block_size, kv_bytes_per_token=max(1, kv_bytes_per_token),
        kv_capacity_tokens=max(engine.block_size, engine.num_blocks * engine.block_size),
        max_batched_tokens=int(getattr(engine, "max_batched_tokens", 0) or 512), fwd_tokens=xs, fwd_seconds=ys,
        fwd_s_per_context_token=m["slope"], swap_s_per_block=NO_SWAP_S_PER_BLOCK,
        saturation_tokens=saturation_point(list(zip(xs, ys))),
        notes=f"vLLM engine, measured through fill/generate ({'quick' if quick else 'full'}); no swap",
        extra={"method": METHOD})
