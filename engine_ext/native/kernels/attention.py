"""The native engine's attention through the Triton kernels (``attention: triton``).

:class:`TritonAttention` is one of the engine's attention backends
(``native/attention.py``, whose ``store``/``attend`` pair each layer calls):
per step it builds the kernels' arguments once (int32
block tables padded to the longest context, sequence lengths, the prefill
chunks' row offsets and start positions, the decode split-K from the
host-known lengths, and a cascade plan where decode rows share a long prefix;
:meth:`step_args`), and per layer it writes the new K/V by slot
(:func:`~.paged_attention.store_kv`) and runs chunked-prefill attention over
each prefilling context's paged keys and decode attention over each decoding
one's (:func:`~.prefill_attention.paged_prefill_attention`,
:func:`~.paged_attention.paged_decode_attention`, or
:func:`~.cascade.cascade_decode` for a step whose decode rows share prefixes:
forks, parallel samples).  Nothing in a layer reads the device on the host.
On a GPU these are compiled Triton kernels; without CUDA they run under
Triton's interpreter, which is how the tests check the engine with them on
any machine (far too slow to serve with there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .cascade import CascadePlan, cascade_decode, plan_cascade, shared_prefix_groups
from .paged_attention import paged_decode_attention, pick_num_splits, store_kv
from .prefill_attention import paged_prefill_attention

#: Cascade decode in the engine (:meth:`TritonAttention.step_args`): decode rows whose block
#: tables start with the same full blocks (forks, parallel samples) read that prefix once per
#: group.  It serves the engine's eager steps (mixed prefill + decode steps, batches past the
#: largest decode graph, graphs off): a decode-only step that a CUDA graph takes stays in the
#: graph with plain decode (``native/cuda_graphs.py``: a plan that changes every step cannot be
#: replayed, and leaving the graph cost ~0.5 ms a layer on the H200 against the 0.13 ms a layer
#: cascade saved at 64 forks of a 4k prefix).  A group needs CASCADE_MIN_ROWS rows sharing
#: CASCADE_MIN_PREFIX_KEYS keys (below about one split-K partition the prefix pass is all
#: launch and merge), and the step must save CASCADE_MIN_SAVED_KEYS prefix keys per layer,
#: ``sum over groups of (rows - 1) * prefix`` (16384 keys of Llama-3-8B: 64 MiB a layer not
#: read, ~15 us of H200 bandwidth, about the cost of the plan's launch and merge; arithmetic,
#: not a measurement).  CASCADE = False turns it off.
CASCADE = True
CASCADE_MIN_ROWS = 2
CASCADE_MIN_PREFIX_KEYS = 256
CASCADE_MIN_SAVED_KEYS = 16384


def cascade_groups(tables: Sequence[Sequence[int]], lens: Sequence[int], block_size: int,
                   window: int = 0) -> List[Tuple[List[int], int]]:
    """The shared-prefix groups (rows, full blocks) cascade decode would use for decode rows with
    these block tables and key counts; ``[]``: plain paged decode (thresholds above; never with
    a sliding window, which cuts into a shared prefix differently per row)."""
    if not CASCADE or window or len(lens) < CASCADE_MIN_ROWS:
        return []
    groups = shared_prefix_groups(tables, lens, block_size, CASCADE_MIN_ROWS,
                                  max(1, -(-CASCADE_MIN_PREFIX_KEYS // block_size)))
    saved = sum((len(rows) - 1) * common * block_size for rows, common in groups)
    return groups if groups and saved >= CASCADE_MIN_SAVED_KEYS else []


@dataclass
class TritonStepArgs:
    """One step's arguments for every layer (built by :meth:`TritonAttention.step_args`)."""

    prefill_rows: Optional[torch.Tensor]      # [Tp] long: the prefilling rows of the flat batch, in chunk order
    prefill_tables: Optional[torch.Tensor]    # [N, nb] int32
    cu_seqlens: Optional[torch.Tensor]        # [N + 1] int32: chunk i's rows in prefill_rows
    start_pos: Optional[torch.Tensor]         # [N] int32: position of chunk i's first new token
    max_new: int
    decode_rows: Optional[torch.Tensor]       # [B] long
    decode_tables: Optional[torch.Tensor]     # [B, nb] int32 (None where ``cascade`` has the tables)
    decode_lens: Optional[torch.Tensor]       # [B] int32: keys per context (the query's position + 1)
    window: int
    # split-K partitions of decode attention; None: chosen on the first layer from ``decode_max_len``
    # and the KV heads (host ints), or where that is 0 (a caller that set neither) from the longest
    # context read on the device.  Fixed under CUDA graphs (``native/cuda_graphs.py``).
    num_splits: Optional[int] = None
    decode_max_len: int = 0                   # the longest decode context, keys (host-known)
    # every row of the step is a decode row, rows 0..T-1 in order: attention needs no gather or
    # scatter.  None (a caller that did not say): inferred from the shapes -- no prefill and as
    # many decode rows as rows (the model runner and the decode graphs list them in row order)
    decode_in_order: Optional[bool] = None
    cascade: Optional[CascadePlan] = None     # the decode rows through cascade decode (see ``CASCADE``)


def _table(rows: Sequence[Sequence[int]]) -> List[List[int]]:
    width = max(1, max(len(r) for r in rows))
    return [list(r) + [0] * (width - len(r)) for r in rows]


class TritonAttention:
    """The attention backend (``native/attention.py``) through the kernels."""

    name = "triton"
    #: layer calls served by cascade decode, in this process (the tests check it was used)
    cascade_calls = 0

    def supports(self, kv_dtype: torch.dtype, group: int, head_dim: int) -> bool:
        # any GQA group (padded to a power of two); head dims up to 256 fit a tile's registers
        return kv_dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim <= 256

    cascade_groups = staticmethod(cascade_groups)

    @staticmethod
    def step_args(prefills: List[tuple], decodes: List[tuple], block_size: int, window: int,
                  device: torch.device, tensor: Optional[Callable[[list, torch.dtype], Any]] = None,
                  ) -> TritonStepArgs:
        """``prefills``: ``(first row, rows, start position, the context's blocks)`` per chunk;
        ``decodes``: ``(row, keys, the context's blocks)`` per decoding context.  ``tensor(values,
        dtype)`` makes each tensor (default: ``torch.tensor`` on ``device``; the model runner's
        :meth:`~..staging.StepStaging.tensor` on CUDA, whose placeholders it resolves after one copy).
        Where decode rows share long prefixes (:func:`cascade_groups`) their attention is a
        cascade, planned here on the host (:func:`~.cascade.plan_cascade`, staged the same way)."""
        if tensor is None:
            def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
                return torch.tensor(values, dtype=dtype, device=device)
        p_rows: List[int] = []
        cu = [0]
        for row, n, _, _ in prefills:
            p_rows += range(row, row + n)
            cu.append(cu[-1] + n)
        long, i32 = torch.long, torch.int32
        d_rows = [r for r, _, _ in decodes]
        d_lens = [n for _, n, _ in decodes]
        d_tables = [b[:-(-n // block_size)] for _, n, b in decodes]
        groups = cascade_groups(d_tables, d_lens, block_size, window or 0) if decodes else []
        plan = plan_cascade(d_tables, d_lens, block_size, groups=groups, device=device, tensor=tensor) \
            if groups else None
        return TritonStepArgs(
            prefill_rows=tensor(p_rows, long) if prefills else None,
            prefill_tables=tensor(_table([b[:-(-(s + n) // block_size)] for _, n, s, b in prefills]), i32)
            if prefills else None,
            cu_seqlens=tensor(cu, i32) if prefills else None,
            start_pos=tensor([s for _, _, s, _ in prefills], i32) if prefills else None,
            max_new=max((n for _, n, _, _ in prefills), default=0),
            decode_rows=tensor(d_rows, long) if decodes else None,
            decode_tables=tensor(_table(d_tables), i32) if decodes and plan is None else None,
            decode_lens=tensor(d_lens, i32) if decodes and plan is None else None,
            window=window or 0,
            decode_max_len=max(d_lens, default=0),
            decode_in_order=not prefills and d_rows == list(range(len(d_rows))),
            cascade=plan)

    @staticmethod
    def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping)

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, args: TritonStepArgs,
                scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode attention of the step's decode rows (``q`` holds just them, in order)."""
        if args.cascade is not None:
            TritonAttention.cascade_calls += 1
            return cascade_decode(q, k_cache, v_cache, args.cascade, scale, out=out)
        if args.num_splits is None and args.decode_max_len:  # host ints only: once per step, no sync
            args.num_splits = pick_num_splits(args.decode_max_len, q.shape[0] * k_cache.shape[0], q.device)
        return paged_decode_attention(q, k_cache, v_cache, args.decode_tables, args.decode_lens, scale,
                                      args.window, num_splits=args.num_splits)

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, args: TritonStepArgs,
               scale: float) -> torch.Tensor:
        """Attention of every row of ``q`` [T, H, D] (its K/V already stored)."""
        in_order = args.decode_in_order
        if in_order is None:
            in_order = (args.prefill_rows is None and args.decode_rows is not None
                        and args.decode_rows.shape[0] == q.shape[0])
        if in_order and args.decode_rows is not None:  # a decode-only step: no gather, no scatter
            return TritonAttention._decode(q, k_cache, v_cache, args, scale)
        out = torch.empty_like(q)
        if args.prefill_rows is not None:
            out[args.prefill_rows] = paged_prefill_attention(
                q[args.prefill_rows].contiguous(), k_cache, v_cache, args.prefill_tables, args.cu_seqlens,
                args.start_pos, scale, args.window, max_new=args.max_new)
        if args.decode_rows is not None:
            out[args.decode_rows] = TritonAttention._decode(q[args.decode_rows].contiguous(), k_cache, v_cache,
                                                            args, scale)
        return out
