"""Sampler microbenchmark: the batched sampler (engine_ext/native/sampler.py)
against the per-row sampler it replaced (``old_sample`` below), median ms per
decode step.

    python -m interlace.bench.sampler [--batches 1 8 32] [--vocab 49152] [--steps 50]
                                      [--k-cap 256] [--threads N]

Method.  Each case is a batch of identical rows (``mixed``: the cases in
turn), each row a Generation with its own generator, as the engine makes
them; temperature 1 but in one case.  Logits are random, drawn once per
case and batch size: ``3 * randn`` plus 20 tokens per row raised by 2..14,
a Gaussian bulk with a few likely tokens.  That is somewhat harder than a
real model's logits: at temperature 1, top-p 0.9 needs more than 256 tokens
in ~40% of these rows, and the tokens past the best 256 hold ~10% of the
mass (SmolLM2-135M on text: ~30% and ~8%; at temperature 0.7: ~1% and
~1%); the line under the table gives the figures for the logits used.
``top-p 0.9 flat`` uses ``randn`` alone: top-p needs ~2/3 of the
vocabulary, the new sampler's worst case (it ends in a full sort, as the old
one always did).  Each cell is the median of ``--steps`` timed calls after 3
untimed ones, the old and the new sampler taking turns.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from interlace.engine_ext.machine import describe_machine
from interlace.bench.engine import machine
from interlace.engine_ext.native import sampler
from interlace.engine_ext.native.sampler import sample as new_sample
from interlace.engine_ext.native.sequence import Generation
from interlace.engine_ext.protocol import SamplingParams

T = dict(temperature=1.0)
CASES: Dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "temperature 1": T,
    "top-k 50": dict(T, top_k=50),
    "top-p 0.9": dict(T, top_p=0.9),
    "top-p 0.9, temperature 0.7": dict(temperature=0.7, top_p=0.9),
    "top-k 50 + top-p 0.9": dict(T, top_k=50, top_p=0.9),
    "seeded top-p 0.9": dict(T, top_p=0.9, seed=1),
    "mixed (all of the above)": {},
    "top-p 0.9 flat": dict(T, top_p=0.9),
}


# --- baseline: the per-row sampler before the batched rewrite (verbatim) ------------------------------

def old_sample(logits: torch.Tensor, gens: Sequence[Generation]) -> List[Tuple[int, Optional[float]]]:
    out: List[Tuple[int, Optional[float]]] = [(0, None)] * len(gens)
    simple = [i for i, g in enumerate(gens) if g.sampling.greedy and not g.sampling.logits_processors]
    if simple:
        rows = logits[simple]
        toks = rows.argmax(dim=-1)
        lps = None
        if any(gens[i].sampling.logprobs for i in simple):
            lps = torch.log_softmax(rows, dim=-1).gather(1, toks[:, None])[:, 0]
        for j, i in enumerate(simple):
            out[i] = (int(toks[j]), float(lps[j]) if lps is not None and gens[i].sampling.logprobs else None)
    for i, g in enumerate(gens):
        if i in simple:
            continue
        try:
            out[i] = old_sample_one(logits[i], g)
        except Exception as e:  # a broken processor (user code) must not take the batch down
            out[i] = (-1, e)
    return out


def old_sample_one(row: torch.Tensor, g: Generation) -> Tuple[int, Optional[float]]:
    sp = g.sampling
    for proc in sp.logits_processors:
        row = proc(g.generated, row)
    if sp.greedy:
        tok = int(row.argmax())
    else:
        x = row / sp.temperature
        if sp.top_k and sp.top_k < x.shape[-1]:
            kth = torch.topk(x, sp.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_x, idx = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            cum = probs.cumsum(-1)
            drop = cum - probs > sp.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
        probs = torch.softmax(x, dim=-1)
        tok = int(torch.multinomial(probs, 1, generator=g.rng))
    lp = float(torch.log_softmax(row, dim=-1)[tok]) if sp.logprobs else None
    return tok, lp

# --- end of baseline ----------------------------------------------------------------------------------


def logits_for(case: str, batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=g)
    if case.endswith("flat"):
        return x
    x *= 3
    top = torch.randint(0, vocab, (batch, 20), generator=g)
    return x.scatter_add_(1, top, 2 + 12 * torch.rand(batch, 20, generator=g))


def difficulty(logits: torch.Tensor, k: int) -> str:
    """How far past the best ``k`` tokens these logits reach at temperature 1."""
    p, _ = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    cum = p.cumsum(dim=-1)
    need = (cum < 0.9).sum(dim=-1) + 1
    return (f"top-p 0.9 needs more than {k} tokens in {100 * float((need > k).float().mean()):.0f}% of rows "
            f"(median {int(need.float().median())}), the tokens past the best {k} hold "
            f"{100 * float((1 - cum[:, k - 1]).mean()):.1f}% of the mass")


def generations(case: str, batch: int) -> List[Generation]:
    mixed = [kw for name, kw in CASES.items() if kw and not name.endswith("flat")]
    gens = []
    for i in range(batch):
        kw = dict(CASES[case] or mixed[i % len(mixed)])
        if "seed" in kw:
            kw["seed"] = i
        sp = SamplingParams(**kw)
        rng = None
        if not sp.greedy:  # as the engine does
            rng = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 1000 + i)
        gens.append(Generation(sp, emit=lambda ev: None, rng=rng))
    return gens


def time_pair(logits: torch.Tensor, case: str, batch: int, steps: int) -> Tuple[float, float]:
    """Median ms per call of the old and the new sampler, taking turns
    (so a noisy neighbour on a shared machine hits both alike)."""
    runs = [(old_sample, generations(case, batch), []), (new_sample, generations(case, batch), [])]
    for i in range(steps + 3):
        for fn, gens, times in (runs if i % 2 == 0 else runs[::-1]):
            t0 = time.perf_counter()
            fn(logits, gens)
            if i >= 3:  # the first calls warm up
                times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(runs[0][2]), 1000 * statistics.median(runs[1][2])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interlace.bench.sampler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--k-cap", type=int, default=sampler.K_CAP, help="the new sampler's K_CAP")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    sampler.K_CAP = args.k_cap
    if args.threads:
        torch.set_num_threads(args.threads)

    res: Dict[str, Dict[int, Tuple[float, float]]] = {}
    for case in args.cases:
        res[case] = {}
        for b in args.batches:
            res[case][b] = time_pair(logits_for(case, b, args.vocab, seed=b), case, b, args.steps)
        print(f"{case}: " + ", ".join(f"b={b} {o:.2f} -> {n:.2f} ms" for b, (o, n) in res[case].items()),
              flush=True)

    print(f"\nsampler, vocabulary {args.vocab}, K_CAP {args.k_cap}, median ms per step over {args.steps} steps "
          f"(old: per-row sampler, new: batched)\nmachine: {describe_machine(machine())}\n")
    print("| case | " + " | ".join(f"b={b} old | b={b} new" for b in args.batches)
          + f" | speed-up b={args.batches[-1]} |")
    print("|---|" + "---:|" * (2 * len(args.batches) + 1))
    for case, r in res.items():
        last = r[args.batches[-1]]
        print(f"| {case} | " + " | ".join(f"{o:.2f} | {n:.2f}" for o, n in r.values())
              + f" | {last[0] / last[1]:.1f}x |")
    big = max(args.batches)
    print(f"\nlogits at b={big}: {difficulty(logits_for('top-p 0.9', big, args.vocab, seed=big), args.k_cap)}; "
          f"flat: {difficulty(logits_for('top-p 0.9 flat', big, args.vocab, seed=big), args.k_cap)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
