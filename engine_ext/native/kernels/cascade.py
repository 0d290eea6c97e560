"""Shared-prefix (cascade) decode attention (Triton).

When many decoding rows share a prefix -- forks of one prompt, parallel
samples, agents on one system prompt -- plain paged decode reads the prefix's
K/V once per row.  Cascade decode (Parrot's shared-prefix kernel, FlashInfer's
two-level cascade) splits each row's keys into the group's prefix and the
row's own suffix:

1. the prefix pass runs one program per (group, KV head): its tile rows are
   the group's rows times the GQA heads, so each prefix K/V tile is loaded
   once for the whole group and used in one ``tl.dot`` -- the prefix is read
   ``1/rows`` as often and the dot has real rows instead of a padded GQA group;
2. the suffix pass is ordinary :func:`paged_decode_attention` over each row's
   suffix blocks (with LSE);
3. :func:`merge_attention` combines the two by log-sum-exp; it is exact
   because the two key sets are disjoint, so the result equals plain decode
   over prefix + suffix.

:func:`find_shared_prefixes` finds such groups from the batch's block tables
(rows whose tables start with the same full blocks share those blocks
physically, so their keys are identical).
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .paged_attention import LOG2E, _check_cache, _pow2, attend_range, decode, dot_in_f32, finish, merge_attention

#: most tile rows (group rows x GQA heads) per prefix program; larger groups use several programs
CASCADE_MAX_ROWS = 64
CASCADE_BLOCK_N = 64


@triton.jit
def _prefix_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, plens_ptr, gstart_ptr, grows_ptr, o_ptr, lse_ptr,
                   stride_qb, stride_qh, stride_kh, stride_kb, stride_kt, stride_vh, stride_vb, stride_vt,
                   stride_pt, stride_ob, stride_oh, stride_lb, stride_lh, qk_scale,
                   G: tl.constexpr, D: tl.constexpr, RPP: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    grp = tl.program_id(0)
    kvh = tl.program_id(1)
    chunk = tl.program_id(2)
    r0 = tl.load(gstart_ptr + grp) + chunk * RPP
    r1 = tl.load(gstart_ptr + grp + 1)
    if r0 < r1:
        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        local = offs_r // G
        valid_r = (local < RPP) & (r0 + local < r1)
        row = tl.load(grows_ptr + r0 + local, mask=valid_r, other=0).to(tl.int64)
        heads = (kvh * G + offs_r % G).to(tl.int64)
        q = tl.load(q_ptr + row[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=valid_r[:, None] & mask_d[None, :], other=0.0)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        n = tl.load(plens_ptr + grp)
        acc, m_i, l_i = attend_range(q, acc, m_i, l_i, k_ptr + kvh.to(tl.int64) * stride_kh,
                                     v_ptr + kvh.to(tl.int64) * stride_vh, pt_ptr + grp.to(tl.int64) * stride_pt,
                                     0, n, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, offs_d, mask_d,
                                     BLOCK_SIZE, BLOCK_N, DOT_F32)
        o, lse = finish(acc, m_i, l_i)
        tl.store(o_ptr + row[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], o,
                 mask=valid_r[:, None] & mask_d[None, :])
        tl.store(lse_ptr + row * stride_lb + heads * stride_lh, lse, mask=valid_r)


def prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_tables: torch.Tensor,
                     prefix_lens: torch.Tensor, row_group: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix pass: ``(o [B, H, D] float32, lse [B, H])``; rows with group -1 get 0 and -inf."""
    B, H, D = q.shape
    hkv = k_cache.shape[0]
    G = H // hkv
    o = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float32, device=q.device)
    n_groups = prefix_lens.shape[0]
    if B == 0 or n_groups == 0:
        return o, lse
    # the rows of each group, contiguous (CSR): group g's rows are grows[gstart[g]:gstart[g+1]]
    grouped = torch.nonzero(row_group >= 0).flatten()
    order = torch.argsort(row_group[grouped], stable=True)
    grows = grouped[order].to(torch.int32)
    counts = torch.bincount(row_group[grouped].long(), minlength=n_groups)
    gstart = torch.zeros(n_groups + 1, dtype=torch.int32, device=q.device)
    gstart[1:] = torch.cumsum(counts, 0)
    max_rows = int(counts.max()) if len(grows) else 0
    if max_rows == 0:
        return o, lse
    block_r = max(_pow2(G), min(CASCADE_MAX_ROWS, _pow2(max_rows * G)))
    rpp = block_r // G
    prefix_tables = prefix_tables if prefix_tables.stride(1) == 1 else prefix_tables.contiguous()
    _prefix_kernel[(n_groups, hkv, triton.cdiv(max_rows, rpp))](
        q, k_cache, v_cache, prefix_tables, prefix_lens, gstart, grows, o, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), prefix_tables.stride(0),
        o.stride(0), o.stride(1), lse.stride(0), lse.stride(1), float(scale) * LOG2E,
        G=G, D=D, RPP=rpp, BLOCK_R=block_r, BLOCK_D=_pow2(D), BLOCK_SIZE=k_cache.shape[2],
        BLOCK_N=CASCADE_BLOCK_N, DOT_F32=dot_in_f32(k_cache.dtype))
    return o, lse


def cascade_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             prefix_tables: torch.Tensor, prefix_lens: torch.Tensor, row_group: torch.Tensor,
                             suffix_tables: torch.Tensor, suffix_lens: torch.Tensor, scale: float,
                             num_splits: Optional[int] = None) -> torch.Tensor:
    """Decode attention of rows sharing prefixes; equals plain paged decode over prefix + suffix.

    Group g's prefix: blocks ``prefix_tables[g]`` (int32 ``[Gr, max_blocks]``),
    ``prefix_lens[g]`` keys (any count, whole blocks or not).  Row b belongs to
    group ``row_group[b]`` (``[B]``; -1: no prefix) and has its own suffix:
    blocks ``suffix_tables[b]``, ``suffix_lens[b]`` keys (may be 0), positions
    counted from the start of its own table.  ``num_splits`` goes to the suffix
    pass.  No sliding window (a window would cut into the shared prefix
    differently per row).  Returns ``[B, H, D]`` in q's dtype.
    """
    _check_cache(k_cache, v_cache, k_cache.shape[0], q.shape[2])
    assert row_group.shape == (q.shape[0],) and suffix_lens.shape == (q.shape[0],)
    o_pre, lse_pre = prefix_attention(q, k_cache, v_cache, prefix_tables, prefix_lens, row_group, scale)
    o_suf, lse_suf = decode(q, k_cache, v_cache, suffix_tables, suffix_lens, scale, 0, num_splits,
                            out_dtype=torch.float32)
    o, _ = merge_attention(o_pre, lse_pre, o_suf, lse_suf)
    return o.to(q.dtype)


class SharedPrefixes(NamedTuple):
    """The batch-dependent arguments of :func:`cascade_decode_attention` (``**x._asdict()``)."""
    prefix_tables: torch.Tensor   # [Gr, max_prefix_blocks] int32
    prefix_lens: torch.Tensor     # [Gr] int32
    row_group: torch.Tensor       # [B] int32, -1 for rows sharing nothing
    suffix_tables: torch.Tensor   # [B, max_suffix_blocks] int32
    suffix_lens: torch.Tensor     # [B] int32


def find_shared_prefixes(block_tables: list[list[int]], lens: list[int], block_size: int, min_rows: int = 2,
                         min_blocks: int = 1, device: Optional[torch.device] = None) -> Optional[SharedPrefixes]:
    """Groups of rows whose block tables start with the same full blocks.

    Only blocks that are full for every row of a group count as prefix (block
    ``i`` of a row with ``n`` keys is full when ``(i+1) * block_size <= n``): a
    shared, fully written block holds the same keys for all of them, and the
    suffix then starts on a block boundary.  Rows are grouped by their first
    block; the group's prefix is the longest common run of block ids.  A group
    needs ``min_rows`` rows and ``min_blocks`` common blocks; other rows get
    group -1 (their whole table is the suffix).  ``None`` when nothing is
    shared.  Greedy by design: one row that diverges early shortens its
    group's prefix rather than being split off.
    """
    by_first: dict[int, list[int]] = defaultdict(list)
    for b, (table, n) in enumerate(zip(block_tables, lens)):
        if n // block_size >= max(1, min_blocks):
            by_first[table[0]].append(b)
    groups: list[tuple[list[int], int]] = []
    for rows in by_first.values():
        if len(rows) < min_rows:
            continue
        common = min(lens[b] // block_size for b in rows)
        first = block_tables[rows[0]]
        for b in rows[1:]:
            i = 0
            while i < common and block_tables[b][i] == first[i]:
                i += 1
            common = i
        if common >= min_blocks:
            groups.append((rows, common))
    if not groups:
        return None
    B = len(lens)
    row_group = [-1] * B
    prefix_blocks = [0] * B
    for g, (rows, common) in enumerate(groups):
        for b in rows:
            row_group[b] = g
            prefix_blocks[b] = common
    suffix = [list(block_tables[b][prefix_blocks[b]:-(-lens[b] // block_size)]) for b in range(B)]

    def table(rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(r) for r in rows))
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)

    return SharedPrefixes(
        prefix_tables=table([list(block_tables[rows[0]][:common]) for rows, common in groups]),
        prefix_lens=torch.tensor([common * block_size for _, common in groups], dtype=torch.int32, device=device),
        row_group=torch.tensor(row_group, dtype=torch.int32, device=device),
        suffix_tables=table(suffix),
        suffix_lens=torch.tensor([lens[b] - prefix_blocks[b] * block_size for b in range(B)], dtype=torch.int32,
                                 device=device))
