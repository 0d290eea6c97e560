"""Shared-prefix (cascade) decode attention (Triton).

When many decoding rows share a prefix -- forks of one prompt, parallel
samples, agents on one system prompt -- plain paged decode reads the prefix's
K/V once per row.  Cascade decode (Parrot's shared-prefix kernel, FlashInfer's
two-level cascade) splits each row's keys into its group's prefix and the
row's own suffix.  Two halves:

* **the plan** (:class:`CascadePlan`, built on the host by :func:`plan_cascade`
  from Python lists of block tables and lengths, or by
  :meth:`CascadePlan.build` from explicit prefixes): which rows share which
  full prefix blocks (:func:`shared_prefix_groups`), each group's prefix
  table and length, each row's suffix table and length, every device tensor
  in one host-to-device copy (or staged by the caller's ``tensor``, as the
  engine's one-copy step staging does), and the split-K partitions of both
  passes chosen from host-known lengths (:meth:`CascadePlan.config`);
* **the launch** (:func:`cascade_decode`): one kernel, one output
  allocation, no host sync.  Its programs are

  1. prefix partitions, one per (group row-chunk, KV head, partition): the
     tile rows are up to :data:`CASCADE_MAX_ROWS` of the group's rows times
     the GQA heads, so each prefix K/V tile is loaded once for the chunk's
     rows and used in one ``tl.dot``; the prefix's keys are split into
     partitions (split-K, like paged decode's) so that one group still
     spreads over the GPU (64 forks of a 4k prefix, 8 KV heads: 4 chunks x
     9 partitions x 8 heads = 288 programs on 132 SMs, where one program per
     (chunk, head) gave 32);
  2. suffix partitions, one per (row, KV head, partition): paged decode over
     the row's own blocks.

  Each program stores its partial output and LSE in the plan's scratch and
  counts itself in per-(row, head) arrival counters; the program that
  completes a (row, head) merges its partitions by log-sum-exp into the
  output (and zeroes the counter for the next launch).  Exact: the key sets
  are disjoint, so the result equals plain decode over prefix + suffix.
  Why one launch: the launches, not the bytes, bounded the first version
  (three kernels: 216 us against plain decode's 187 us for 64 forks on an
  H200, most of it host launch time); one launch: 58 us, 3.2x.

Bytes: plain decode reads ``rows x prefix`` K/V (from L2 where the forks
run together); cascade reads the prefix once per row-chunk (the chunks of
one partition run together: mostly once from memory, the rest from L2),
each row's suffix, and writes and reads ``rows x heads x partitions x D``
float32 partials.

:func:`cascade_decode_attention` is the older one-call form taking device
tensors; it reads them on the host to build its plan (syncs: for tests and
one-off use, not a decode step).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .paged_attention import (KEYS_PER_SPLIT, LOG2E, MAX_SPLITS, _check_cache, _pow2, attend_range, dot_in_f32,
                              finish)

#: most tile rows (group rows x GQA heads) per prefix program; larger groups use several programs
CASCADE_MAX_ROWS = 64
CASCADE_BLOCK_N = 64
#: prefix split-K: at least this many keys per partition, at most this many partitions
PREFIX_KEYS_PER_SPLIT = 256
PREFIX_MAX_SPLITS = 32
#: split-K aims at this many programs per SM for each pass
PROGRAMS_PER_SM = 2
#: warps of a prefix program (its tile is up to CASCADE_MAX_ROWS x D)
PREFIX_NUM_WARPS = 4


# ----------------------------------------------------------------------------------------------------------- kernels

@triton.jit
def _partial_done(o, lse, row, head, valid, first_slot, slot, op_ptr, lp_ptr, cnt_ptr, out_ptr, stride_ob, stride_oh,
                  offs_d, mask_d, H: tl.constexpr, S: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Store one partition's ``(o, lse)`` of tile rows ``(row, head)``; the program that stores the
    last partition of a (row, head) merges all of them by log-sum-exp into ``out`` and resets the
    (row, head)'s arrival counter for the next launch.  Partitions ``[first_slot, S)`` of a row
    exist (``first_slot``: 0 for a grouped row, the prefix's partitions count for another)."""
    bh = row * H + head
    tl.store(op_ptr + (bh * S + slot)[:, None] * D + offs_d[None, :], o, mask=valid[:, None] & mask_d[None, :])
    tl.store(lp_ptr + bh * S + slot, lse, mask=valid)
    tl.debug_barrier()  # every thread's stores before the arrival (the atomic releases them at GPU scope)
    old = tl.atomic_add(cnt_ptr + bh, tl.full([BLOCK_R], 1, tl.int32), mask=valid, sem="acq_rel")
    last = valid & (old == S - first_slot - 1)
    tl.debug_barrier()
    if tl.sum(last.to(tl.int32), 0) > 0:
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for s in range(S):
            ok = last & (first_slot <= s)
            m = tl.maximum(m, tl.load(lp_ptr + bh * S + s, mask=ok, other=float("-inf"), cache_modifier=".cg"))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        for s in range(S):
            ok = last & (first_slot <= s)
            w = tl.math.exp(tl.load(lp_ptr + bh * S + s, mask=ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
            w = tl.where(ok, w, 0.0)
            part = tl.load(op_ptr + (bh * S + s)[:, None] * D + offs_d[None, :], mask=ok[:, None] & mask_d[None, :],
                           other=0.0, cache_modifier=".cg")
            acc += part * w[:, None]
            total += w
        res = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + row[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=last[:, None] & mask_d[None, :])
        tl.store(cnt_ptr + bh, tl.zeros([BLOCK_R], dtype=tl.int32), mask=last)


@triton.jit
def _cascade_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, plens_ptr, gstart_ptr, grows_ptr, rg_ptr, st_ptr, slens_ptr,
                    op_ptr, lp_ptr, cnt_ptr, out_ptr, chunks, n_prefix,
                    stride_qb, stride_qh, stride_kh, stride_kb, stride_kt, stride_pt, stride_st, stride_ob, stride_oh,
                    qk_scale, G: tl.constexpr, H: tl.constexpr, D: tl.constexpr, RPP: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, S_PRE: tl.constexpr, S_SUF: tl.constexpr, DOT_F32: tl.constexpr):
    """Programs ``[0, n_prefix)``: a prefix partition for a chunk of a group's rows; the rest: a
    suffix partition of one row (paged decode).  Each stores its partial result and the last to
    finish a (row, head) merges it (:func:`_partial_done`): the whole cascade in one launch."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_kh
    if pid < n_prefix:
        chunk = pid % chunks
        rest = pid // chunks
        split = rest % S_PRE
        grp = rest // S_PRE
        r0 = tl.load(gstart_ptr + grp) + chunk * RPP
        r1 = tl.load(gstart_ptr + grp + 1)
        if r0 < r1:
            offs_r = tl.arange(0, BLOCK_R)
            local = offs_r // G
            valid = (local < RPP) & (r0 + local < r1)
            row = tl.load(grows_ptr + r0 + local, mask=valid, other=0).to(tl.int64)
            heads = (kvh * G + offs_r % G).to(tl.int64)
            q = tl.load(q_ptr + row[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0)
            acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
            m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
            n = tl.load(plens_ptr + grp)
            # each partition covers a whole number of tiles of [0, n); trailing ones may be empty (0, -inf)
            per = tl.cdiv(tl.cdiv(n, BLOCK_N), S_PRE) * BLOCK_N
            lo = split * per
            acc, m_i, l_i = attend_range(q, acc, m_i, l_i, k_head, v_head, pt_ptr + grp.to(tl.int64) * stride_pt,
                                         lo, tl.minimum(n, lo + per), qk_scale, stride_kb, stride_kt, stride_kb,
                                         stride_kt, offs_d, mask_d, BLOCK_SIZE, BLOCK_N, DOT_F32)
            o, lse = finish(acc, m_i, l_i)
            _partial_done(o, lse, row, heads, valid, tl.zeros([BLOCK_R], dtype=tl.int32), split, op_ptr, lp_ptr,
                          cnt_ptr, out_ptr, stride_ob, stride_oh, offs_d, mask_d, H, S_PRE + S_SUF, D, BLOCK_R, BLOCK_D)
    else:
        j = pid - n_prefix
        b = j // S_SUF
        split = j % S_SUF
        offs_g = tl.arange(0, BLOCK_G)
        valid = offs_g < G
        heads = (kvh * G + offs_g).to(tl.int64)
        row = tl.zeros([BLOCK_G], dtype=tl.int64) + b
        q = tl.load(q_ptr + row[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        n = tl.load(slens_ptr + b)
        per = tl.cdiv(tl.cdiv(n, BLOCK_N), S_SUF) * BLOCK_N
        lo = split * per
        acc, m_i, l_i = attend_range(q, acc, m_i, l_i, k_head, v_head, st_ptr + b.to(tl.int64) * stride_st,
                                     lo, tl.minimum(n, lo + per), qk_scale, stride_kb, stride_kt, stride_kb, stride_kt,
                                     offs_d, mask_d, BLOCK_SIZE, BLOCK_N, DOT_F32)
        o, lse = finish(acc, m_i, l_i)
        grouped = (tl.load(rg_ptr + b) + tl.zeros([BLOCK_G], dtype=tl.int32)) >= 0
        first = tl.where(grouped, 0, S_PRE)
        _partial_done(o, lse, row, heads, valid, first, S_PRE + split, op_ptr, lp_ptr, cnt_ptr, out_ptr,
                      stride_ob, stride_oh, offs_d, mask_d, H, S_PRE + S_SUF, D, BLOCK_G, BLOCK_D)


# -------------------------------------------------------------------------------------------------------------- plan

def shared_prefix_groups(block_tables: Sequence[Sequence[int]], lens: Sequence[int], block_size: int,
                         min_rows: int = 2, min_blocks: int = 1) -> List[Tuple[List[int], int]]:
    """Groups of rows whose block tables start with the same full blocks: ``[(rows, blocks), ...]``.

    Only blocks that are full for every row of a group count as prefix (block
    ``i`` of a row with ``n`` keys is full when ``(i+1) * block_size <= n``): a
    shared, fully written block holds the same keys for all of them, and the
    suffix then starts on a block boundary.  Rows are grouped by their first
    block; the group's prefix is the longest common run of block ids.  A group
    needs ``min_rows`` rows and ``min_blocks`` common blocks.  Greedy by
    design: one row that diverges early shortens its group's prefix rather
    than being split off.  Host only (list slices compared in C: cheap enough
    for every decode step).
    """
    by_first: Dict[int, List[int]] = defaultdict(list)
    need = max(1, min_blocks)
    for b, (table, n) in enumerate(zip(block_tables, lens)):
        if n // block_size >= need:
            by_first[table[0]].append(b)
    groups: List[Tuple[List[int], int]] = []
    for rows in by_first.values():
        if len(rows) < min_rows:
            continue
        common = min(lens[b] // block_size for b in rows)
        first = block_tables[rows[0]]
        for b in rows[1:]:
            t = block_tables[b]
            if list(t[:common]) != list(first[:common]):
                i = 0
                while t[i] == first[i]:
                    i += 1
                common = i
        if common >= need:
            groups.append((rows, common))
    return groups


class _OneCopy:
    """int32 tensors packed into one host list and moved to the device in one copy (views of it)."""

    def __init__(self, device: Optional[torch.device]):
        self.device = device
        self.flat: List[int] = []
        self.parts: List[Tuple[int, Tuple[int, ...]]] = []

    def tensor(self, values: Sequence[Any], dtype: torch.dtype) -> int:
        assert dtype == torch.int32
        start = len(self.flat)
        if values and isinstance(values[0], (list, tuple)):
            shape: Tuple[int, ...] = (len(values), len(values[0]))
            for r in values:
                self.flat.extend(r)
        else:
            shape = (len(values),)
            self.flat.extend(values)
        self.parts.append((start, shape))
        return len(self.parts) - 1

    def finish(self) -> List[torch.Tensor]:
        host = torch.tensor(self.flat, dtype=torch.int32)
        dev = host.to(self.device) if self.device is not None else host
        return [dev[s:s + (shape[0] * (shape[1] if len(shape) > 1 else 1))].view(shape) for s, shape in self.parts]


def _sm_count(device: torch.device, _cache: Dict[Any, int] = {}) -> int:  # noqa: B006 - a per-process memo
    if device.type != "cuda":
        return 132
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _cache:
        _cache[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _cache[key]


def _splits(max_len: int, keys_per_split: int, programs: int, sms: int, most: int) -> int:
    by_len = max_len // keys_per_split
    if by_len < 2:
        return 1
    return max(1, min(by_len, triton.cdiv(PROGRAMS_PER_SM * sms, max(1, programs)), most))


class CascadeConfig(NamedTuple):
    """The launch shape of a plan for one model's heads (host ints, chosen once per plan)."""
    group: int          # query heads per KV head
    block_r: int        # prefix program tile rows
    rows_per_program: int
    chunks: int         # prefix programs per (group, KV head, partition) along the group's rows
    prefix_splits: int
    suffix_splits: int


def _pad(rows: List[List[int]]) -> List[List[int]]:
    width = max([1] + [len(r) for r in rows])
    return [list(r) + [0] * (width - len(r)) for r in rows]


@dataclass
class CascadePlan:
    """One batch's cascade arguments: host ints (the launch's shape) and int32 device tensors.

    A dataclass so that a step staging (``staging.StepStaging.resolve``) can swap its
    placeholders for device views.  Group ``g``'s rows are ``grows[gstart[g]:gstart[g+1]]``
    (rows of q, ascending); row ``b``'s group is ``row_group[b]`` (-1: none).
    """

    rows: int
    groups: int
    max_group_rows: int
    max_prefix_len: int
    max_suffix_len: int
    row_group: Any          # [B]
    gstart: Any             # [Gr + 1]
    grows: Any              # [sum of group sizes]
    prefix_tables: Any      # [Gr, max prefix blocks] (one row of 0 with no group)
    prefix_lens: Any        # [Gr]
    suffix_tables: Any      # [B, max suffix blocks]
    suffix_lens: Any        # [B]
    #: fixed partitions (None: chosen in :meth:`config`); the tests force several on tiny shapes
    prefix_splits: Optional[int] = None
    suffix_splits: Optional[int] = None
    _configs: Dict[Tuple[int, int, str], CascadeConfig] = field(default_factory=dict, repr=False)
    _buffers: Dict[Tuple[int, int, int, str], Tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, prefix_tables: Sequence[Sequence[int]], prefix_lens: Sequence[int], row_group: Sequence[int],
              suffix_tables: Sequence[Sequence[int]], suffix_lens: Sequence[int], *,
              device: Optional[torch.device] = None,
              tensor: Optional[Callable[[list, torch.dtype], Any]] = None) -> "CascadePlan":
        """From Python lists: group ``g``'s prefix is ``prefix_lens[g]`` keys (any count) in blocks
        ``prefix_tables[g]``; row ``b`` is in group ``row_group[b]`` (-1: none) and has its own
        ``suffix_lens[b]`` keys (may be 0) in blocks ``suffix_tables[b]``, positions counted from
        the start of its own table.  ``tensor(values, dtype)`` stages each device tensor (default:
        all of them packed into one host-to-device copy on ``device``)."""
        B = len(row_group)
        n_groups = len(prefix_lens)
        members: List[List[int]] = [[] for _ in range(n_groups)]
        for b, g in enumerate(row_group):
            if g >= 0:
                members[g].append(b)
        gstart = [0]
        for m in members:
            gstart.append(gstart[-1] + len(m))
        own = tensor is None
        packer = _OneCopy(device) if own else None
        put = packer.tensor if own else tensor
        i32 = torch.int32
        devs = dict(row_group=put(list(row_group), i32), gstart=put(gstart, i32),
                    grows=put([b for m in members for b in m], i32),
                    prefix_tables=put(_pad([list(t) for t in prefix_tables]), i32),
                    prefix_lens=put(list(prefix_lens), i32),
                    suffix_tables=put(_pad([list(t) for t in suffix_tables]), i32),
                    suffix_lens=put(list(suffix_lens), i32))
        if own:
            views = packer.finish()
            devs = {k: views[i] for k, i in devs.items()}
        return cls(rows=B, groups=n_groups, max_group_rows=max([0] + [len(m) for m in members]),
                   max_prefix_len=max([0] + list(prefix_lens)), max_suffix_len=max([0] + list(suffix_lens)), **devs)

    def config(self, num_heads: int, num_kv_heads: int, device: torch.device) -> CascadeConfig:
        """The launch shape for these heads: rows per prefix program, and both passes' split-K
        partitions from the host-known longest prefix and suffix (about :data:`PROGRAMS_PER_SM`
        programs per SM).  Memoised: one computation per plan, not per layer."""
        key = (num_heads, num_kv_heads, str(device))
        cfg = self._configs.get(key)
        if cfg is None:
            G = num_heads // num_kv_heads
            block_r = max(_pow2(G), min(CASCADE_MAX_ROWS, _pow2(max(1, self.max_group_rows) * G)))
            rpp = block_r // G
            chunks = triton.cdiv(max(1, self.max_group_rows), rpp)
            sms = _sm_count(device)
            pre = self.prefix_splits or _splits(self.max_prefix_len, PREFIX_KEYS_PER_SPLIT,
                                                self.groups * chunks * num_kv_heads, sms, PREFIX_MAX_SPLITS)
            suf = self.suffix_splits or _splits(self.max_suffix_len, KEYS_PER_SPLIT, self.rows * num_kv_heads, sms,
                                                MAX_SPLITS)
            cfg = self._configs[key] = CascadeConfig(G, block_r, rpp, chunks, pre if self.groups else 0, suf)
        return cfg

    def buffers(self, num_heads: int, head_dim: int, slots: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
        """The launch's scratch, made once per plan: float32 partial outputs ``[B, H, slots, D]``
        and LSEs ``[B, H, slots]``, int32 arrival counters ``[B, H]`` (zero; each launch leaves
        them zero)."""
        key = (num_heads, head_dim, slots, str(device))
        got = self._buffers.get(key)
        if got is None:
            B = self.rows
            got = self._buffers[key] = (
                torch.empty(B, num_heads, slots, head_dim, dtype=torch.float32, device=device),
                torch.empty(B, num_heads, slots, dtype=torch.float32, device=device),
                torch.zeros(B, num_heads, dtype=torch.int32, device=device))
        return got


def plan_cascade(block_tables: Sequence[Sequence[int]], lens: Sequence[int], block_size: int, *, min_rows: int = 2,
                 min_blocks: int = 1, groups: Optional[List[Tuple[List[int], int]]] = None,
                 device: Optional[torch.device] = None, tensor: Optional[Callable[[list, torch.dtype], Any]] = None,
                 ) -> Optional[CascadePlan]:
    """The plan of a decode batch from its rows' block tables and key counts (host lists).

    ``groups`` (default: :func:`shared_prefix_groups` with ``min_rows``, ``min_blocks``): rows
    and shared full blocks; rows in no group have their whole table as suffix.  ``None`` when
    nothing is shared.
    """
    if groups is None:
        groups = shared_prefix_groups(block_tables, lens, block_size, min_rows, min_blocks)
    if not groups:
        return None
    B = len(lens)
    row_group = [-1] * B
    pre = [0] * B
    for g, (rows, common) in enumerate(groups):
        for b in rows:
            row_group[b] = g
            pre[b] = common
    return CascadePlan.build(
        [list(block_tables[rows[0]][:common]) for rows, common in groups],
        [common * block_size for _, common in groups], row_group,
        [list(block_tables[b][pre[b]:-(-lens[b] // block_size)]) for b in range(B)],
        [lens[b] - pre[b] * block_size for b in range(B)], device=device, tensor=tensor)


# ------------------------------------------------------------------------------------------------------------ launch

def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: CascadePlan, scale: float,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention of the plan's rows (row b of q ``[B, H, D]``); equals plain paged decode
    over each row's prefix + suffix.  One kernel launch, no host sync (the partials' buffers
    and arrival counters are the plan's, made on its first launch: launches of one plan must
    run in stream order, as a model's layers do); no sliding window (a window would cut into
    the shared prefix differently per row).  Writes ``out`` (``[B, H, D]``, any row/head
    strides; default a new tensor) in its dtype and returns it."""
    B, H, D = q.shape
    hkv = k_cache.shape[0]
    assert B == plan.rows and q.stride(-1) == 1, "q: the plan's rows, head dim contiguous"
    assert k_cache.stride() == v_cache.stride(), "k and v caches of one layout"
    cfg = plan.config(H, hkv, q.device)
    s_pre, s_suf = cfg.prefix_splits, cfg.suffix_splits
    slots = max(1, s_pre) + s_suf  # one unused prefix slot where no row has a prefix
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    o_part, l_part, counts = plan.buffers(H, D, slots, q.device)
    n_prefix = plan.groups * cfg.chunks * s_pre
    ks = k_cache.stride()
    _cascade_kernel[(n_prefix + B * s_suf, hkv)](
        q, k_cache, v_cache, plan.prefix_tables, plan.prefix_lens, plan.gstart, plan.grows, plan.row_group,
        plan.suffix_tables, plan.suffix_lens, o_part, l_part, counts, out, cfg.chunks, n_prefix,
        q.stride(0), q.stride(1), ks[0], ks[1], ks[2], plan.prefix_tables.stride(0), plan.suffix_tables.stride(0),
        out.stride(0), out.stride(1), float(scale) * LOG2E,
        G=cfg.group, H=H, D=D, RPP=cfg.rows_per_program, BLOCK_R=cfg.block_r, BLOCK_G=_pow2(cfg.group),
        BLOCK_D=_pow2(D), BLOCK_SIZE=k_cache.shape[2], BLOCK_N=CASCADE_BLOCK_N, S_PRE=max(1, s_pre), S_SUF=s_suf,
        DOT_F32=dot_in_f32(k_cache.dtype), num_warps=PREFIX_NUM_WARPS)
    return out


# ---------------------------------------------------------------------------------------- the one-call (sync) form

def cascade_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             prefix_tables: torch.Tensor, prefix_lens: torch.Tensor, row_group: torch.Tensor,
                             suffix_tables: torch.Tensor, suffix_lens: torch.Tensor, scale: float,
                             num_splits: Optional[int] = None, prefix_splits: Optional[int] = None) -> torch.Tensor:
    """:func:`cascade_decode` from device tensors (the arguments of :meth:`CascadePlan.build`;
    ``prefix_tables`` ``[Gr, max_blocks]``, ``row_group`` ``[B]``, ...).  Reads them on the host
    to build the plan: a sync -- build a plan once and call :func:`cascade_decode` in a step.
    ``num_splits`` fixes the suffix pass's partitions, ``prefix_splits`` the prefix pass's.
    Returns ``[B, H, D]`` in q's dtype."""
    _check_cache(k_cache, v_cache, k_cache.shape[0], q.shape[2])
    assert row_group.shape == (q.shape[0],) and suffix_lens.shape == (q.shape[0],)
    plan = CascadePlan.build(prefix_tables.tolist(), prefix_lens.tolist(), row_group.tolist(),
                             suffix_tables.tolist(), suffix_lens.tolist(), device=q.device)
    plan.suffix_splits, plan.prefix_splits = num_splits, prefix_splits
    return cascade_decode(q, k_cache, v_cache, plan, scale)


class SharedPrefixes(NamedTuple):
    """:func:`find_shared_prefixes` as tensors: the arguments of :func:`cascade_decode_attention`."""
    prefix_tables: torch.Tensor   # [Gr, max_prefix_blocks] int32
    prefix_lens: torch.Tensor     # [Gr] int32
    row_group: torch.Tensor       # [B] int32, -1 for rows sharing nothing
    suffix_tables: torch.Tensor   # [B, max_suffix_blocks] int32
    suffix_lens: torch.Tensor     # [B] int32


def find_shared_prefixes(block_tables: list[list[int]], lens: list[int], block_size: int, min_rows: int = 2,
                         min_blocks: int = 1, device: Optional[torch.device] = None) -> Optional[SharedPrefixes]:
    """:func:`shared_prefix_groups` as the tensors of :func:`cascade_decode_attention` (``None``
    when nothing is shared); other rows get group -1 (their whole table is the suffix)."""
    plan = plan_cascade(block_tables, lens, block_size, min_rows=min_rows, min_blocks=min_blocks, device=device)
    if plan is None:
        return None
    return SharedPrefixes(plan.prefix_tables, plan.prefix_lens, plan.row_group, plan.suffix_tables, plan.suffix_lens)
