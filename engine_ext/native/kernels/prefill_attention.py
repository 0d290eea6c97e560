"""Chunked prefill attention over the paged KV cache (Triton).

The new rows' K/V are stored into the cache (``store_kv``) before this runs,
so every key -- a cached prefix, earlier chunks of the same prompt, and the
new rows themselves -- is read the same way, through the context's block
table.  That makes plain prefill (``start_pos == 0``), prefix-cache hits and
chunked prefill one kernel with one causal rule: the row at position ``p``
attends keys ``max(0, p - window + 1) .. p`` (``window == 0``: from 0).

One program per (context, tile of new rows, KV head).  Its rows are the
tile's query positions times the GQA group's heads (row ``r`` is position
``r // G``, head ``r % G``), so a K/V tile is loaded once per group as in
decode.  The key loop stops at the tile's last position and, with a window,
starts at the first position's window start; the causal and window masks are
applied per element (cheap next to the two dots).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .paged_attention import LOG2E, _check_cache, _pow2, dot_in_f32, finish, load_kv_tile, mma, softmax_step

#: rows (query positions x GQA heads) and keys per tile
PREFILL_BLOCK_R = 64
PREFILL_BLOCK_N = 32


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, start_ptr, o_ptr,
                    stride_qt, stride_qh, stride_kh, stride_kb, stride_kt, stride_vh, stride_vb, stride_vt,
                    stride_bt, stride_ot, stride_oh, qk_scale, window,
                    G: tl.constexpr, D: tl.constexpr, QPP: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    ctx = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q0 = tl.load(cu_ptr + ctx)
    n_new = tl.load(cu_ptr + ctx + 1) - q0
    sp = tl.load(start_ptr + ctx)
    if tile * QPP < n_new:
        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        j = tile * QPP + offs_r // G
        heads = (kvh * G + offs_r % G).to(tl.int64)
        valid_r = (offs_r // G < QPP) & (j < n_new)
        rows = (q0 + j).to(tl.int64)
        qpos = sp + j
        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=valid_r[:, None] & mask_d[None, :], other=0.0)
        hi = sp + tl.minimum(n_new, (tile + 1) * QPP)
        lo = tl.where(window > 0, tl.maximum(sp + tile * QPP - window + 1, 0), 0)
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh
        table = bt_ptr + ctx.to(tl.int64) * stride_bt
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            valid = pos < hi
            k, v = load_kv_tile(k_head, v_head, table, pos, valid, stride_kb, stride_kt, stride_vb, stride_vt,
                                offs_d, mask_d, BLOCK_SIZE, DOT_F32)
            s = mma(q.to(k.dtype), tl.trans(k), DOT_F32) * qk_scale
            allowed = valid[None, :] & (pos[None, :] <= qpos[:, None])
            allowed = allowed & ((window <= 0) | (pos[None, :] > qpos[:, None] - window))
            s = tl.where(allowed, s, float("-inf"))
            acc, m_i, l_i = softmax_step(s, v, acc, m_i, l_i, DOT_F32)
        o, _ = finish(acc, m_i, l_i)
        tl.store(o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=valid_r[:, None] & mask_d[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, start_pos: torch.Tensor,
                            scale: float, window: int = 0, max_new: Optional[int] = None) -> torch.Tensor:
    """Causal attention of the new rows of N contexts over their paged keys.

    q ``[T, H, D]``: context i's new rows are ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``
    (int32 ``[N+1]``) at positions ``start_pos[i] + j`` (int32 ``[N]``), their
    K/V already in the cache; ``block_tables`` ``[N, max_blocks]`` int32.
    ``max_new`` (the most new rows of any context) sizes the grid; ``None``
    reads it from ``cu_seqlens_q`` on the host.  Returns ``[T, H, D]`` in q's dtype.
    """
    T, H, D = q.shape
    hkv = k_cache.shape[0]
    _check_cache(k_cache, v_cache, hkv, D)
    assert H % hkv == 0 and q.stride(-1) == 1
    N = start_pos.shape[0]
    assert cu_seqlens_q.shape == (N + 1,) and block_tables.shape[0] == N
    out = torch.empty_like(q)
    if T == 0 or N == 0:
        return out
    if max_new is None:
        max_new = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    G = H // hkv
    block_r = max(PREFILL_BLOCK_R, _pow2(G))
    qpp = block_r // G
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    _prefill_kernel[(N, triton.cdiv(max(max_new, 1), qpp), hkv)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), float(scale) * LOG2E, int(window),
        G=G, D=D, QPP=qpp, BLOCK_R=block_r, BLOCK_D=_pow2(D), BLOCK_SIZE=k_cache.shape[2],
        BLOCK_N=PREFILL_BLOCK_N, DOT_F32=dot_in_f32(k_cache.dtype))
    return out
