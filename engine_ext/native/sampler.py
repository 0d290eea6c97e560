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

Logits on a GPU (the runner leaves them there) are sampled there, by
:func:`sample_on_device`, in one batched pass of plain torch ops: greedy rows
by argmax, the others by the same exponential race over the whole
vocabulary -- top-k as a threshold at each row's k-th best logit, top-p as a
threshold found by sorting only the top-p rows -- with noise from the
request's own device generator (``Generation.device_rng``, made on first use
and seeded from a draw of ``Generation.rng``, so from the request's seed:
reproducible whatever its row and its neighbours).  Rows with logits
processors go to the host, only they, in one copy, run their processors
there and go back; the rest of the sampling is the same for them.  What
comes back is one small tensor, the ids with the logprobs, in one copy.
The same function runs on CPU tensors (the tests check it there); on the
CPU, :func:`sample` keeps its own path and its compiled kernel.  The two
paths draw different numbers: a seeded request's tokens are reproducible on
one device, not across devices.
"""

from __future__ import annotations

import os
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
    processors, before temperature and truncation.  Logits off the CPU (a
    GPU's) are sampled where they are: :func:`sample_on_device`."""
    if logits.device.type != "cpu":
        return sample_on_device(logits, gens)
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


def sample_on_device(logits: torch.Tensor, gens: Sequence[Generation]) -> List[Tuple[int, Optional[float]]]:
    """:func:`sample` for logits on an accelerator, in one batched pass on
    the logits' device (plain torch ops: it runs on CPU tensors too).  Same
    results contract as :func:`sample`.

    A sampled row's token is argmax(z - log E) over its kept tokens, z =
    logits / temperature, E ~ Exp(1) drawn for the whole vocabulary from the
    row's own device generator (one ``exponential_`` per sampled row: the
    numbers a row gets depend on its generator only).  Top-k keeps the
    tokens >= the row's k-th best logit, top-p (over the top-k survivors,
    as on the CPU) the tokens >= the last one of the smallest sorted prefix
    whose mass reaches top_p; a token tied with the last one kept is kept
    too (the CPU path keeps exactly k).  A sampled row whose logits hold a
    NaN or +inf, or only -inf, fails alone."""
    n, V = logits.shape
    dev = logits.device
    out: List[Optional[Tuple[int, object]]] = [None] * n
    x = logits.float()
    procs = [i for i, g in enumerate(gens) if g.sampling.logits_processors]
    if procs:  # only these rows go to the host, and come back processed (one copy each way)
        x = x.clone() if x is logits else x
        host = x[procs].cpu()
        ok = []
        for j, i in enumerate(procs):
            g = gens[i]
            try:
                row = host[j]
                for proc in g.sampling.logits_processors:
                    row = proc(g.generated, row)
                host[j] = torch.as_tensor(row, dtype=host.dtype)
                ok.append(j)
            except Exception as e:  # a broken processor (user code) must not take the batch down
                out[i] = (-1, e)
        if ok:
            x[[procs[j] for j in ok]] = host[ok].to(dev)
    sps = [g.sampling for g in gens]
    drawn = [i for i in range(n) if out[i] is None and not sps[i].greedy]
    tok = x.argmax(dim=-1)
    if drawn:
        xs = x[drawn]
        m = len(drawn)
        temp = torch.tensor([sps[i].temperature for i in drawn], dtype=torch.float32)
        z = xs / temp.to(dev)[:, None]
        ks = [sps[i].top_k if 0 < sps[i].top_k < V else 0 for i in drawn]
        if any(ks):
            kth = torch.topk(z, max(ks), dim=-1).values.gather(
                1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
            kth.masked_fill_(torch.tensor([k == 0 for k in ks], device=dev)[:, None], float("-inf"))
            z = z.masked_fill(z < kth, float("-inf"))
        nuc = [j for j, i in enumerate(drawn) if sps[i].top_p < 1.0]
        if nuc:
            zn = z[nuc]
            srt = torch.sort(zn, dim=-1, descending=True).values
            prob = srt.softmax(dim=-1)
            top_p = torch.tensor([sps[drawn[j]].top_p for j in nuc], device=dev)[:, None]
            n_keep = ((prob.cumsum(dim=-1) - prob) <= top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
            z[nuc] = zn.masked_fill(zn < srt.gather(1, n_keep - 1), float("-inf"))
        e = torch.empty(m, V, device=dev)
        for j, i in enumerate(drawn):
            e[j].exponential_(generator=_device_rng(gens[i], dev))
        pick = (z - e.clamp_min_(torch.finfo(torch.float32).tiny).log_()).argmax(dim=-1)
        mx = xs.max(dim=-1).values  # NaN if any is, +inf if any is, -inf if all are
        pick = pick.masked_fill_(~mx.isfinite(), -1)
        tok = tok.index_copy(0, torch.tensor(drawn, device=dev), pick)
    res = tok.double()[None]
    if any(sp.logprobs for sp in sps):
        lp = x.gather(1, tok.clamp(min=0)[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
        res = torch.cat([res, lp.double()[None]])
    rows = res.tolist()  # the one copy to the host
    toks = [int(t) for t in rows[0]]
    for i in drawn:
        if toks[i] < 0 and out[i] is None:
            out[i] = (-1, ValueError("no token to sample: the logits are all -inf, or NaN or +inf"))
    return [o if o is not None else (toks[i], rows[1][i] if sps[i].logprobs else None)
            for i, o in enumerate(out)]


def _device_rng(g: Generation, device: torch.device) -> torch.Generator:
    """The request's generator on ``device``: made once, seeded from a draw of
    its CPU generator (itself seeded from the request's seed, or os.urandom),
    and kept with the generation."""
    rng = g.device_rng
    if rng is None or rng.device != device:
        if g.rng is not None:
            seed = int(torch.randint(0, 2 ** 62, (1,), generator=g.rng))
        else:
            seed = g.sampling.seed if g.sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 2
        rng = g.device_rng = torch.Generator(device=device)
        rng.manual_seed(seed)
    return rng
