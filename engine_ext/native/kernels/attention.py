"""The native engine's attention through the Triton kernels (``attention: triton``).

:class:`TritonAttention` is what the model runner hands each layer instead of
the torch attention: per step it builds the kernels' arguments once (int32
block tables padded to the longest context, sequence lengths, the prefill
chunks' row offsets and start positions; :meth:`step_args`), and per layer
it writes the new K/V by slot (:func:`~.paged_attention.store_kv`) and runs
chunked-prefill attention over each prefilling context's paged keys and
decode attention over each decoding one's (:func:`~.prefill_attention.
paged_prefill_attention`, :func:`~.paged_attention.paged_decode_attention`).
On a GPU these are compiled Triton kernels; without CUDA they run under
Triton's interpreter, which is how the tests check the engine with them on
any machine (far too slow to serve with there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch

from .paged_attention import paged_decode_attention, store_kv
from .prefill_attention import paged_prefill_attention


@dataclass
class TritonStepArgs:
    """One step's arguments for every layer (built by :meth:`TritonAttention.step_args`)."""

    prefill_rows: Optional[torch.Tensor]      # [Tp] long: the prefilling rows of the flat batch, in chunk order
    prefill_tables: Optional[torch.Tensor]    # [N, nb] int32
    cu_seqlens: Optional[torch.Tensor]        # [N + 1] int32: chunk i's rows in prefill_rows
    start_pos: Optional[torch.Tensor]         # [N] int32: position of chunk i's first new token
    max_new: int
    decode_rows: Optional[torch.Tensor]       # [B] long
    decode_tables: Optional[torch.Tensor]     # [B, nb] int32
    decode_lens: Optional[torch.Tensor]       # [B] int32: keys per context (the query's position + 1)
    window: int
    # split-K partitions of decode attention; None: chosen from the longest context (read on the host).
    # Fixed under CUDA graphs (``native/cuda_graphs.py``), where nothing may read the device.
    num_splits: Optional[int] = None


def _table(rows: Sequence[Sequence[int]]) -> List[List[int]]:
    width = max(1, max(len(r) for r in rows))
    return [list(r) + [0] * (width - len(r)) for r in rows]


class TritonAttention:
    """Attention for :class:`~interlace.engine_ext.native.models.llama.Attention` through the kernels."""

    name = "triton"

    def supports(self, kv_dtype: torch.dtype, group: int, head_dim: int) -> bool:
        # any GQA group (padded to a power of two); head dims up to 256 fit a tile's registers
        return kv_dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim <= 256

    @staticmethod
    def step_args(prefills: List[tuple], decodes: List[tuple], block_size: int, window: int,
                  device: torch.device, tensor: Optional[Callable[[list, torch.dtype], Any]] = None,
                  ) -> TritonStepArgs:
        """``prefills``: ``(first row, rows, start position, the context's blocks)`` per chunk;
        ``decodes``: ``(row, keys, the context's blocks)`` per decoding context.  ``tensor(values,
        dtype)`` makes each tensor (default: ``torch.tensor`` on ``device``; the model runner's
        :meth:`~..staging.StepStaging.tensor` on CUDA, whose placeholders it resolves after one copy)."""
        if tensor is None:
            def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
                return torch.tensor(values, dtype=dtype, device=device)
        p_rows: List[int] = []
        cu = [0]
        for row, n, _, _ in prefills:
            p_rows += range(row, row + n)
            cu.append(cu[-1] + n)
        long, i32 = torch.long, torch.int32
        return TritonStepArgs(
            prefill_rows=tensor(p_rows, long) if prefills else None,
            prefill_tables=tensor(_table([b[:-(-(s + n) // block_size)] for _, n, s, b in prefills]), i32)
            if prefills else None,
            cu_seqlens=tensor(cu, i32) if prefills else None,
            start_pos=tensor([s for _, _, s, _ in prefills], i32) if prefills else None,
            max_new=max((n for _, n, _, _ in prefills), default=0),
            decode_rows=tensor([r for r, _, _ in decodes], long) if decodes else None,
            decode_tables=tensor(_table([b[:-(-n // block_size)] for _, n, b in decodes]), i32) if decodes else None,
            decode_lens=tensor([n for _, n, _ in decodes], i32) if decodes else None,
            window=window or 0)

    @staticmethod
    def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping)

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, args: TritonStepArgs,
               scale: float) -> torch.Tensor:
        """Attention of every row of ``q`` [T, H, D] (its K/V already stored)."""
        out = torch.empty_like(q)
        if args.prefill_rows is not None:
            out[args.prefill_rows] = paged_prefill_attention(
                q[args.prefill_rows].contiguous(), k_cache, v_cache, args.prefill_tables, args.cu_seqlens,
                args.start_pos, scale, args.window, max_new=args.max_new)
        if args.decode_rows is not None:
            out[args.decode_rows] = paged_decode_attention(
                q[args.decode_rows].contiguous(), k_cache, v_cache, args.decode_tables, args.decode_lens, scale,
                args.window, num_splits=args.num_splits)
        return out
