"""Token selection: greedy, temperature, top-k, top-p, per-request seeds and
logits processors, for the whole batch at once.

Logits processors (user code) run row by row, once per processor per row
that has them; everything else is tensor operations over all rows.

Sampling is an exponential race (the Gumbel-max trick): the token is
argmax(log p_i - log E_i), E_i ~ Exp(1), an exact draw from p with no
multinomial and nothing normalised across rows, so rows with different
temperatures and truncations share one argmax.

Rows race over candidates, not the vocabulary.  Each takes its best tokens
-- its top_k, else the K_CAP best -- with a topk that ranks about 16 k tokens
rather than V (``_topk``).  A top-p row decides top-p on them, and only if
they hold less than its top_p does it retry wider (at worst a full sort), so
what it keeps never depends on K_CAP.  An untruncated row races its
candidates against one more racer standing for all its other tokens, and
only when that one wins -- with their total probability, a few percent for
a language model's logits -- races those tokens among themselves.  Either
way the draw is exact; drawing noise for all V tokens of every row would
cost more than the rest of the sampler together.

Rows without top-k (temperature alone, top-p) go through a compiled kernel
instead where it is built (``sample_top_p`` in :mod:`.cpu_matmul`): per row
one pass for the weights e^((x - max) / T) and a histogram of their
log-probability gaps, the nucleus found from the histogram with a sort of
only the bin where the mass crosses top_p, and one uniform number drawn by
inverse CDF over the kept tokens in vocabulary order -- exact, and no sort
of the vocabulary (top-p at batch 32 over 49 k tokens: 13 ms with the
race, 1.9 ms; ``python -m interlace.bench.sampler``).  Top-k rows keep the
race, which needs only their k best.

Each row draws its noise from its own ``Generation.rng`` (the engine seeds it
from ``seed``, or from os.urandom without one), one number per candidate it
keeps, in rank order: a seeded request's tokens depend on its seed and its
logits only, not on its row or on what shares the batch (nor does an
unseeded one come to depend on torch's global seed).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .sequence import Generation

# Candidates of a row without top-k.  SmolLM2-135M's logits on text, at
# temperature 1: top-p 0.9 needs more than 256 tokens at ~30% of positions
# (median 39), and the tokens past the best 256 hold ~8% of the mass; at
# 0.7, ~1% and ~1%.  bench/sampler.py --k-cap measures other values.
K_CAP = 256


def sample(logits: torch.Tensor, gens: Sequence[Generation]) -> List[Tuple[int, Optional[float]]]:
    """``logits`` [R, V] float32, one row per generation; returns (token,
    logprob) per row, or (-1, exception) for a row whose logits processor
    raised, or a sampled row with nothing to sample (all -inf, or NaN) --
    that request fails alone, the rest of the batch goes on.  The logprob
    (when ``sampling.logprobs``) is log_softmax of the row after its
    processors, before temperature and truncation."""
    out: List[Optional[Tuple[int, object]]] = [None] * len(gens)
    x = logits
    if any(g.sampling.logits_processors for g in gens):
        x = logits.clone()  # the processors' rows replace ours, never the caller's tensor
        for i, g in enumerate(gens):
            if g.sampling.logits_processors:
                try:
                    row = x[i]
                    for proc in g.sampling.logits_processors:
                        row = proc(g.generated, row)
                    x[i] = torch.as_tensor(row, dtype=x.dtype)
                except Exception as e:  # a broken processor (user code) must not take the batch down
                    out[i] = (-1, e)
    live = [i for i, o in enumerate(out) if o is None]
    greedy = [i for i in live if gens[i].sampling.greedy]
    drawn = [i for i in live if not gens[i].sampling.greedy]
    tok = torch.zeros(len(gens), dtype=torch.long)
    if greedy:
        tok[greedy] = _rows(x, greedy).argmax(dim=-1)
    ops = _nucleus_kernel() if drawn else None
    V = x.shape[1]
    nucleus = [i for i in drawn if not 0 < gens[i].sampling.top_k < V] if ops is not None else []
    if nucleus:  # no top-k: the compiled kernel, one uniform per row (see the module docstring)
        sps = [gens[i].sampling for i in nucleus]
        u = torch.cat([torch.rand(1, generator=gens[i].rng, dtype=torch.float64) for i in nucleus])
        tok[nucleus] = ops.sample_top_p(_rows(x, nucleus).contiguous(), torch.tensor([sp.temperature for sp in sps]),
                                        torch.tensor([sp.top_p for sp in sps]), u)
        done = set(nucleus)
        drawn = [i for i in drawn if i not in done]
    if drawn:
        tok[drawn] = _draw(_rows(x, drawn), [gens[i] for i in drawn])
    if nucleus or drawn:
        for i in (tok < 0).nonzero()[:, 0].tolist():
            out[i] = (-1, ValueError("no token to sample: the logits are all -inf, or NaN or +inf"))
    lp_rows = [i for i in live if gens[i].sampling.logprobs and out[i] is None]
    lps = {}
    if lp_rows:
        xl = _rows(x, lp_rows)
        lp = torch.log_softmax(xl, dim=-1).gather(1, tok[lp_rows, None])[:, 0]  # (logsumexp is slower)
        lps = dict(zip(lp_rows, lp.tolist()))
    toks = tok.tolist()
    return [o if o is not None else (toks[i], lps.get(i)) for i, o in enumerate(out)]


#: rows without top-k go through the compiled nucleus kernel where it is built (tests turn it off to
#: check the torch path, which runs wherever the kernel cannot be built)
USE_KERNEL = True


def _nucleus_kernel():
    if not USE_KERNEL:
        return None
    from . import cpu_matmul

    return cpu_matmul.load()


def _rows(x: torch.Tensor, idx: List[int]) -> torch.Tensor:
    return x if len(idx) == x.shape[0] else x[idx]  # all rows: no copy


def _draw(x: torch.Tensor, gens: Sequence[Generation], K: int = 0,
          P: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row of ``x`` (processed logits) from the row's own
    temperature / top-k / top-p distribution.  A row without top-k takes its
    ``K`` best tokens as candidates (K_CAP unless this is a wider retry, which
    passes the rows' softmax(x / T) as ``P``)."""
    n, V = x.shape
    K = K or K_CAP
    K = V if 4 * K > V else K  # a row needing that many tends to need a sort in the end
    sps = [g.sampling for g in gens]
    ks = [sp.top_k if sp.top_k < V else 0 for sp in sps]
    temp = torch.tensor([sp.temperature for sp in sps], dtype=x.dtype)[:, None]
    top_p = torch.tensor([sp.top_p for sp in sps], dtype=x.dtype)[:, None]
    vals, idx = _topk(x, max([K] + ks))
    w = vals.shape[1]
    z = (vals / temp).masked_fill(torch.arange(w) >= torch.tensor([k or K for k in ks])[:, None], float("-inf"))
    prob, tail = torch.empty_like(z), torch.zeros(n, 1, dtype=x.dtype)
    topk_rows = [r for r in range(n) if ks[r]]
    if topk_rows:  # top-p is taken over the top-k survivors (as in vLLM and HF)
        prob[topk_rows] = z[topk_rows].softmax(dim=-1)
    free = [r for r in range(n) if not ks[r]]
    if free:  # the other rows' probabilities are over the whole vocabulary
        if P is None:
            P = (_rows(x, free) / temp[free]).softmax(dim=-1)
        prob[free] = P.gather(1, idx[free]).masked_fill(z[free] == float("-inf"), 0.0)
        plain = [j for j, r in enumerate(free) if sps[r].top_p >= 1.0]
        if plain:  # the mass past an untruncated row's candidates: it races as one (below)
            rows = [free[j] for j in plain]
            tail[rows] = _rows(P, plain).scatter_(1, idx[rows][:, :K], 0.0).sum(dim=-1, keepdim=True)
    cum = prob.cumsum(dim=-1)
    # rank j stays while the mass above it is <= top_p: the smallest prefix that reaches top_p
    keep = (((cum - prob) <= top_p) | (top_p >= 1.0)) & (z > float("-inf"))
    short = [False] * n
    if K < V:  # a top-p row whose candidates hold less than top_p may keep tokens past them
        short = (torch.tensor([not k for k in ks]) & (top_p[:, 0] < 1.0) & (cum[:, -1] <= top_p[:, 0])).tolist()
    tok = torch.empty(n, dtype=torch.long)
    if any(short):  # retry those wider: 4x the fewest tokens that could reach top_p (no later
        rows = [r for r in range(n) if short[r]]  # token is likelier than the K-th)
        need = (K + (top_p[:, 0] - cum[:, -1]) / prob[:, K - 1])[rows].max().clamp(max=V)
        at = {r: j for j, r in enumerate(free)}  # (no plain row here: P's rows are intact)
        tok[rows] = _draw(x[rows], [gens[r] for r in rows], 4 * int(need), P[[at[r] for r in rows]])
    done = [r for r in range(n) if not short[r]]
    if done:
        # An untruncated row's other tokens race as one, with their total probability, just
        # after its candidates: the first of a set of exponential racers to arrive arrives
        # at Exp(sum of their rates), and which one it is does not depend on when, so if
        # that racer wins, a race among those tokens alone completes an exact draw.
        n_keep = keep.sum(dim=-1)
        s = torch.cat([prob.log().masked_fill(~keep, float("-inf")), z.new_full((n, 1), float("-inf"))], dim=1)
        s.scatter_(1, n_keep[:, None], tail.log())
        pos = _race(s[done], (n_keep[done] + 1).tolist(), [gens[r] for r in done])
        tok[done] = idx[done].gather(1, pos.clamp(max=w - 1)[:, None])[:, 0]
        for j in (pos == n_keep[done]).nonzero()[:, 0].tolist():
            r = done[j]
            rest = (x[r] / temp[r]).index_fill_(0, idx[r, :K], float("-inf"))
            tok[r] = _race(rest[None], [V], [gens[r]])[0]
    return tok.masked_fill_(~vals[:, 0].isfinite(), -1)  # topk ranks NaN first


def _race(s: torch.Tensor, n_draw: List[int], gens: Sequence[Generation]) -> torch.Tensor:
    """argmax(s - log E), E ~ Exp(1): per row, the position of a draw from
    softmax(s).  Only row r's first ``n_draw[r]`` positions can win (the rest
    are -inf); they get noise from the row's own generator, in order, so a
    seeded row draws the same numbers wherever it sits."""
    e = torch.ones_like(s)
    for r, (m, g) in enumerate(zip(n_draw, gens)):
        e[r, :m].exponential_(generator=g.rng)
    return (s - e.log_()).argmax(dim=-1)


def _topk(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k)``, sorted, without ranking the whole row when k is
    small: split the row into strided groups of C tokens; the k groups with
    the largest maxima hold the k best tokens (each holds a token >= the k-th
    largest group maximum, so the k-th best token is >= it too, and so is its
    group's maximum), so only k*C tokens are ranked.  torch.topk's cost grows
    with k * V; this is ~3x faster at k=256, V=49152 (bench/sampler.py)."""
    n, V = x.shape
    if k >= V:
        return torch.sort(x, dim=-1, descending=True)
    C = 16
    while C >= 4 and (V % C or 4 * k * C > V):
        C //= 2
    if C < 4:
        return torch.topk(x, k, dim=-1)
    G = V // C  # group g is tokens g, g+G, g+2G, ...: its maximum is a vectorised max over C rows
    best = torch.topk(x.reshape(n, C, G).amax(dim=1), k, dim=-1, sorted=False).indices
    pos = (best[:, None, :] + torch.arange(0, V, G)[:, None]).reshape(n, -1)
    vals, j = torch.topk(x.gather(1, pos), k, dim=-1)
    return vals, pos.gather(1, j)
