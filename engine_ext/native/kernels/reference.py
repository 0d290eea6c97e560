"""Plain-PyTorch references for the Triton kernels, for the tests.

Written independently of the kernels and as simply as possible: gather a
context's keys and values position by position from its block table into a
dense ``[L, Hkv, D]`` tensor, build the mask explicitly, softmax in float32.
Slow (Python loops over contexts) and obviously right.
"""

from __future__ import annotations

import torch


def gather(cache: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    """Positions ``0..n-1`` of a context with block list ``blocks`` as ``[n, Hkv, D]`` float32."""
    bs = cache.shape[2]
    rows = [cache[:, blocks[p // bs], p % bs] for p in range(n)]    # each [Hkv, D]
    if not rows:
        return cache.new_zeros(0, cache.shape[0], cache.shape[3], dtype=torch.float32)
    return torch.stack(rows).float()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, H, D], k/v [L, Hkv, D], allowed [R, L] bool -> (o [R, H, D] float32, lse [R, H]).

    Query head h reads KV head ``h // (H // Hkv)``.  Rows with no allowed key
    give 0 and LSE -inf.
    """
    R, H, D = q.shape
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1)                                  # [L, H, D]
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("rhd,lhd->rhl", q.float(), k) * scale                 # [R, H, L]
    s = s.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                       # -inf where nothing allowed
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("rhl,lhd->rhd", p, v), lse


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    bs = k_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[:, slot // bs, slot % bs] = k[t].to(k_cache.dtype)
        v_cache[:, slot // bs, slot % bs] = v[t].to(v_cache.dtype)


def decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window=0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, D] float32, lse [B, H]) of one query row per context."""
    B, H, D = q.shape
    o = torch.zeros(B, H, D)
    lse = torch.full((B, H), float("-inf"))
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        blocks = block_tables[b].tolist()
        k, v = gather(k_cache, blocks, n), gather(v_cache, blocks, n)
        pos = torch.arange(n)
        allowed = pos >= n - window if window > 0 else torch.ones(n, dtype=torch.bool)
        ob, lb = attend(q[b:b + 1], k, v, allowed[None], scale)
        o[b], lse[b] = ob[0], lb[0]
    return o, lse


def prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, window=0) -> torch.Tensor:
    """[T, H, D] float32: each new row attends causally over its context's keys ``0..pos``."""
    o = torch.zeros(q.shape)
    cu = cu_seqlens_q.tolist()
    for i in range(len(cu) - 1):
        n_new, sp = cu[i + 1] - cu[i], int(start_pos[i])
        if n_new == 0:
            continue
        L = sp + n_new
        blocks = block_tables[i].tolist()
        k, v = gather(k_cache, blocks, L), gather(v_cache, blocks, L)
        qpos = sp + torch.arange(n_new)[:, None]
        kpos = torch.arange(L)[None, :]
        allowed = kpos <= qpos
        if window > 0:
            allowed &= kpos > qpos - window
        o[cu[i]:cu[i + 1]] = attend(q[cu[i]:cu[i + 1]], k, v, allowed, scale)[0]
    return o


def cascade_decode(q, k_cache, v_cache, prefix_tables, prefix_lens, row_group, suffix_tables, suffix_lens,
                   scale) -> torch.Tensor:
    """[B, H, D] float32: row b attends its group's prefix keys followed by its own suffix keys."""
    B, H, D = q.shape
    o = torch.zeros(B, H, D)
    for b in range(B):
        g = int(row_group[b])
        pre_k = gather(k_cache, prefix_tables[g].tolist(), int(prefix_lens[g])) if g >= 0 else gather(k_cache, [], 0)
        pre_v = gather(v_cache, prefix_tables[g].tolist(), int(prefix_lens[g])) if g >= 0 else gather(v_cache, [], 0)
        n = int(suffix_lens[b])
        k = torch.cat([pre_k, gather(k_cache, suffix_tables[b].tolist(), n)])
        v = torch.cat([pre_v, gather(v_cache, suffix_tables[b].tolist(), n)])
        if len(k):
            o[b] = attend(q[b:b + 1], k, v, torch.ones(1, len(k), dtype=torch.bool), scale)[0][0]
    return o
