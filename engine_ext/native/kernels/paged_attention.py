"""Paged KV store and decode attention (Triton).

Cache layout, per layer: ``k_cache`` and ``v_cache`` are ``[Hkv, num_blocks,
block_size, D]``, head-major.  Head-major because one (KV head, block) is then
a contiguous ``[block_size, D]`` tile: a program that serves one KV head walks
a context's block table and each step is a single dense load of
``block_size * D`` elements, the same for every head; the token at position
``p`` of a context with block list ``blocks`` lives at slot
``blocks[p // block_size] * block_size + p % block_size``.

Decode runs one program per (context, KV head[, split]).  The query heads of
the GQA group are the rows of the tile (padded to 16, the smallest
``tl.dot``), so each K/V tile is loaded once for the whole group and both
products (``q @ k^T`` and ``p @ v``) are tensor-core dots with float32
accumulation.  The softmax is online (running max and sum per row) in the
base-2 domain; what leaves a program is the normalised output and its
log-sum-exp, which is what makes partial results composable: two attentions
over disjoint key sets merge exactly as ``o = (e^{lse_a} o_a + e^{lse_b} o_b)
/ (e^{lse_a} + e^{lse_b})``.  Split-K uses that to spread one long context
over several programs (the batch alone may not fill the GPU at small batch
sizes), and the cascade kernel uses it to merge a shared prefix with each
row's own suffix.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from . import interpreted

LOG2E = 1.4426950408889634

#: keys per tile of the decode loop (independent of the cache's block size)
DECODE_BLOCK_N = 64
#: split-K: aim for at least this many keys per split
KEYS_PER_SPLIT = 256
MAX_SPLITS = 16


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether tiles of this cache dtype are upcast to float32 before ``tl.dot``.

    float16 and bfloat16 tiles go to the tensor cores as they are (with float32
    accumulation).  float32 caches use an IEEE float32 dot.  Triton's
    interpreter computes bfloat16 dots wrongly (3.9: garbage), so there the
    bfloat16 tiles are upcast; on a GPU they are not.
    """
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and interpreted()


# ----------------------------------------------------------------------------------------------- shared jit helpers

@triton.jit
def load_kv_tile(k_head, v_head, table, pos, valid, stride_kb, stride_kt, stride_vb, stride_vt, offs_d, mask_d,
                 BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr):
    """K and V at positions ``pos`` ([N]) of a context whose block table starts at ``table``.

    Entries of the table past the context and slots past its length are never
    read: the block id and the K/V loads are masked by ``valid``.
    """
    blk = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    tok = (pos % BLOCK_SIZE).to(tl.int64)
    mask = valid[:, None] & mask_d[None, :]
    k = tl.load(k_head + blk[:, None] * stride_kb + tok[:, None] * stride_kt + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_head + blk[:, None] * stride_vb + tok[:, None] * stride_vt + offs_d[None, :], mask=mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def mma(a, b, DOT_F32: tl.constexpr):
    """``a @ b`` with float32 accumulation; float32 operands in IEEE precision (not TF32)."""
    if DOT_F32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def softmax_step(s, v, acc, m_i, l_i, DOT_F32: tl.constexpr):
    """One online-softmax step: ``s`` [R, N] base-2 scores (-inf where masked), ``v`` [N, D].

    A row whose scores are all -inf so far keeps m = -inf; subtracting a 0
    instead of -inf keeps it free of NaN (its p and alpha are then 0).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_F32)
    return acc, m_new, l_i


@triton.jit
def attend_range(q, acc, m_i, l_i, k_head, v_head, table, lo, hi, qk_scale,
                 stride_kb, stride_kt, stride_vb, stride_vt, offs_d, mask_d,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """Every row of ``q`` [R, D] attends keys ``[lo, hi)`` of one context (no causal mask)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k, v = load_kv_tile(k_head, v_head, table, pos, valid, stride_kb, stride_kt, stride_vb, stride_vt,
                            offs_d, mask_d, BLOCK_SIZE, DOT_F32)
        s = mma(q.to(k.dtype), tl.trans(k), DOT_F32) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        acc, m_i, l_i = softmax_step(s, v, acc, m_i, l_i, DOT_F32)
    return acc, m_i, l_i


@triton.jit
def finish(acc, m_i, l_i):
    """Normalised output and natural-log LSE; rows that saw no key give 0 and -inf."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)  # ln 2
    return o, lse


# ----------------------------------------------------------------------------------------------------------- store

@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kch, stride_kcb, stride_kct, stride_vch, stride_vcb, stride_vct,
                     HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    tok = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    if slot >= 0:   # -1: a padded row, nothing to store
        mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
        h = offs_h[:, None].to(tl.int64)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d[None, :], mask=mask)
        kc = kc_ptr + h * stride_kch + blk * stride_kcb + tok * stride_kct + offs_d[None, :]
        vc = vc_ptr + h * stride_vch + blk * stride_vcb + tok * stride_vct + offs_d[None, :]
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k``, ``v`` [T, Hkv, D] into the caches at ``slot_mapping`` [T] (int64).

    ``slot = block * block_size + offset``; a slot of -1 is skipped (padded rows
    of a captured CUDA graph).  Values are cast to the cache dtype.
    """
    T, hkv, d = k.shape
    if T == 0:
        return
    _check_cache(k_cache, v_cache, hkv, d)
    assert v.shape == k.shape and slot_mapping.shape == (T,)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head dim must be contiguous"
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HKV=hkv, D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_SIZE=k_cache.shape[2])


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, hkv: int, d: int) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches are [Hkv, num_blocks, block_size, D]"
    assert k_cache.shape[0] == hkv and k_cache.shape[3] == d, (k_cache.shape, hkv, d)
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head dim of the cache must be contiguous"


# ---------------------------------------------------------------------------------------------------------- decode

@triton.jit(do_not_specialize=["window"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr,
                   stride_qb, stride_qh, stride_kh, stride_kb, stride_kt, stride_vh, stride_vb, stride_vt,
                   stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
                   qk_scale, window,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_F32: tl.constexpr, STORE_LSE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    # each split covers a whole number of tiles of [lo, n); trailing splits may be empty
    per = tl.cdiv(tl.cdiv(n - lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
    s_lo = lo + split * per
    s_hi = tl.minimum(n, s_lo + per)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = (kvh * G + offs_g).to(tl.int64)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, m_i, l_i = attend_range(q, acc, m_i, l_i, k_ptr + kvh.to(tl.int64) * stride_kh,
                                 v_ptr + kvh.to(tl.int64) * stride_vh, bt_ptr + b.to(tl.int64) * stride_bt,
                                 s_lo, s_hi, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, offs_d, mask_d,
                                 BLOCK_SIZE, BLOCK_N, DOT_F32)
    o, lse = finish(acc, m_i, l_i)
    out = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out, o.to(o_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    if STORE_LSE:
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=mask_g)


@triton.jit
def _merge_splits_kernel(op_ptr, lp_ptr, o_ptr, lse_ptr,
                         stride_pb, stride_ph, stride_ps, stride_lpb, stride_lph,
                         stride_ob, stride_oh, stride_lb, stride_lh,
                         S: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                         STORE_LSE: tl.constexpr):
    """Combine the splits of one (context, head) by their LSEs."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < S
    mask_d = offs_d < D
    lse = tl.load(lp_ptr + b * stride_lpb + h * stride_lph + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(w, 0)
    part = tl.load(op_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty), mask=mask_d)
    if STORE_LSE:
        tl.store(lse_ptr + b * stride_lb + h * stride_lh,
                 tl.where(total == 0.0, float("-inf"), m + tl.math.log(tl.where(total == 0.0, 1.0, total))))


def pick_num_splits(max_len: int, programs: int, device: torch.device) -> int:
    """Split-K partitions for a batch whose longest context has ``max_len`` keys.

    1 for short contexts (under ``2 * KEYS_PER_SPLIT`` keys); otherwise enough
    splits to give the GPU about two programs per SM, never fewer than
    ``KEYS_PER_SPLIT`` keys per split nor more than ``MAX_SPLITS``.
    """
    by_len = max_len // KEYS_PER_SPLIT
    if by_len < 2:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    by_occupancy = triton.cdiv(2 * sms, max(1, programs))
    return max(1, min(by_len, by_occupancy, MAX_SPLITS))


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, window: int = 0, num_splits: Optional[int] = None,
           out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_decode_attention` returning ``(o, lse)`` with ``o`` in ``out_dtype`` (default q's)."""
    B, H, D = q.shape
    hkv = k_cache.shape[0]
    _check_cache(k_cache, v_cache, hkv, D)
    assert H % hkv == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1, "head dim of q must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == B and seq_lens.shape == (B,)
    G = H // hkv
    out = torch.empty(B, H, D, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q.device)
    if B == 0:
        return out, lse
    if num_splits is None:
        num_splits = pick_num_splits(int(seq_lens.max()), B * hkv, q.device)
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    if num_splits > 1:
        o_dst = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        l_dst = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
        so = (o_dst.stride(0), o_dst.stride(1), o_dst.stride(2))
        sl = (l_dst.stride(0), l_dst.stride(1), l_dst.stride(2))
    else:
        o_dst, l_dst = out, lse
        so = (out.stride(0), out.stride(1), 0)
        sl = (lse.stride(0), lse.stride(1), 0)
    BLOCK_D = _pow2(D)
    _decode_kernel[(B, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, o_dst, l_dst,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), *so, *sl,
        float(scale) * LOG2E, int(window),
        G=G, D=D, BLOCK_G=_pow2(G), BLOCK_D=BLOCK_D, BLOCK_SIZE=k_cache.shape[2], BLOCK_N=DECODE_BLOCK_N,
        NUM_SPLITS=num_splits, DOT_F32=dot_in_f32(k_cache.dtype), STORE_LSE=True)
    if num_splits > 1:
        _merge_splits_kernel[(B, H)](
            o_dst, l_dst, out, lse, o_dst.stride(0), o_dst.stride(1), o_dst.stride(2), l_dst.stride(0),
            l_dst.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            S=num_splits, D=D, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=BLOCK_D, STORE_LSE=True)
    return out, lse


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0,
                           num_splits: Optional[int] = None, return_lse: bool = False,
                           ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention of one query row per context over its paged keys.

    q ``[B, H, D]`` (row b is at position ``seq_lens[b] - 1``, its own K/V
    already stored); ``block_tables`` ``[B, max_blocks]`` int32 (entries past a
    context's blocks are never read); ``seq_lens`` ``[B]`` int32 -- a row with
    0 keys gives zeros (LSE -inf) and reads nothing.  ``window > 0`` attends
    only the last ``window`` keys.  ``num_splits`` KV partitions per context
    (``None``: :func:`pick_num_splits` from the longest context, which reads
    ``seq_lens`` on the host -- pass it explicitly under CUDA graphs).

    Returns ``[B, H, D]`` in q's dtype, and with ``return_lse`` the natural-log
    log-sum-exp of ``scale * q.k`` ``[B, H]`` float32.
    """
    out, lse = decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, num_splits)
    return (out, lse) if return_lse else out


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the two partial results.

    ``o`` ``[..., D]``, ``lse`` ``[...]`` (natural log).  A side that saw no key
    (LSE -inf) contributes nothing; if neither did, the output is 0 and the LSE
    -inf.  Computed in float32; the output has ``o_a``'s dtype.
    """
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa = torch.exp(lse_a - m_safe)
    wb = torch.exp(lse_b - m_safe)
    total = wa + wb
    denom = torch.where(total == 0, torch.ones_like(total), total)
    o = (o_a.float() * (wa / denom).unsqueeze(-1) + o_b.float() * (wb / denom).unsqueeze(-1)).to(o_a.dtype)
    lse = torch.where(total == 0, torch.full_like(total, float("-inf")), m_safe + torch.log(denom))
    return o, lse
