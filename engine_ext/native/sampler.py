"""Token selection: greedy, temperature, top-k, top-p, per-request seeds and
logits processors.

Greedy rows without processors are done in one batched argmax; every other
row is handled on its own, since each may carry its own processors and its
own random generator (a seeded request gives the same tokens whatever else
shares its batch).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .sequence import Generation


def sample(logits: torch.Tensor, gens: Sequence[Generation]) -> List[Tuple[int, Optional[float]]]:
    """``logits`` [R, V] float32, one row per generation; returns (token,
    logprob) per row, or (-1, exception) for a row whose logits processor
    raised -- that request fails alone, the rest of the batch goes on."""
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
            out[i] = sample_one(logits[i], g)
        except Exception as e:  # a broken processor (user code) must not take the batch down
            out[i] = (-1, e)
    return out


def sample_one(row: torch.Tensor, g: Generation) -> Tuple[int, Optional[float]]:
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
