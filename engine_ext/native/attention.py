"""The attention layer: store a step's K/V in the paged cache, attend over it.

One backend per engine, chosen once (:func:`choose_backend`, from the
``attention`` setting, whose names :mod:`.options` declares).  Every backend
has the same four members:

* ``step_args(prefills, decodes, block_size, window, device, tensor)``: what
  ``attend`` needs for one step (block tables, masks, lengths ...), built once
  per step by the model runner from the step's prefill chunks ``(first row,
  rows, start position, blocks)`` and decode rows ``(row, keys, blocks)``;
* ``store(k, v, k_cache, v_cache, slot_mapping)``: write the new rows' K/V;
* ``attend(q, k_cache, v_cache, args, scale)``: attention of every row of the
  flat batch (its K/V already stored);
* ``supports(kv_dtype, group, head_dim)``, and a ``name``.

The model (``models/llama.py``) calls ``meta.attention.store`` and
``meta.attention.attend`` in every layer and never asks which backend it
has: as in nano-vllm's ``layers/attention.py``, one layer owns "store KV,
then attend" (the per-layer branching over backends it replaces lived in the
model's forward), while the step's arguments stay explicit in
:class:`~.models.llama.AttentionMetadata` rather than in a global context.
Choosing once keeps each layer's Python work what it was: two method calls.

The backends:

* :class:`TorchAttention` (``torch``): the reference numerics.  Prefill
  chunks through ``scaled_dot_product_attention`` over their gathered blocks,
  decode rows through two batched matmuls over the gathered block tables.
* :class:`KernelAttention` (``kernel``): decode rows through the compiled CPU
  kernel reading the blocks in place (:mod:`.cpu_attention`); prefill chunks
  and the store as torch.
* :class:`~.kernels.attention.TritonAttention` (``triton``): the store,
  chunked prefill and decode (cascade where rows share a prefix) as Triton
  kernels (:mod:`.kernels`; imported only when chosen: Triton is optional).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F

from .options import ATTENTION, one_of

log = logging.getLogger(__name__)


@dataclass
class PrefillSpan:
    row_start: int        # first row in the flat batch
    num_new: int          # rows of this context in the batch
    start_pos: int        # position of the first new token
    blocks: torch.Tensor  # [nb] long: the context's blocks covering all its keys
    mask: Optional[torch.Tensor] = None  # [num_new, L] bool, True = attend; None = plain causal from 0


@dataclass
class TorchStepArgs:
    """One step's arguments of :class:`TorchAttention` (and :class:`KernelAttention`): prefill
    chunks attended one by one; decode rows gathered into one padded batch, or (the kernel)
    every decoding context's blocks concatenated.  Masks (causal offset, sliding window,
    padding) are built here once per step, not once per layer."""

    prefills: List[PrefillSpan]
    decode_rows: Optional[torch.Tensor] = None    # [B] long: rows of the flat batch
    decode_blocks: Optional[torch.Tensor] = None  # [B, nb] long: block tables, padded (torch)
    decode_masked: Optional[torch.Tensor] = None  # [1, B, 1, nb * block_size] bool: key not attended (torch)
    decode_tables: Optional[torch.Tensor] = None  # every decoding context's blocks, concatenated (long; kernel)
    decode_starts: Optional[torch.Tensor] = None  # [B] long: where context b's blocks start in decode_tables
    decode_lens: Optional[torch.Tensor] = None    # [B] long: keys per context (its length)
    window: int = 0                               # sliding window (0: none), for the kernel
    decode_only: bool = False                     # no prefill: decode_rows is every row, in order


def prefill_mask(start: int, end: int, window: int, device: torch.device) -> Optional[torch.Tensor]:
    """Which keys [0, end) each new position [start, end) attends to, or
    None where plain causal attention from position 0 does it."""
    windowed = bool(window) and end > window
    if start == 0 and not windowed:
        return None
    q = torch.arange(start, end, device=device)[:, None]
    k = torch.arange(end, device=device)[None, :]
    mask = k <= q
    if windowed:
        mask &= k > q - window
    return mask


def _tensor_on(device: torch.device) -> Callable[[list, torch.dtype], torch.Tensor]:
    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)
    return tensor


class TorchAttention:
    """Attention with torch ops over the gathered cache: the reference numerics, any device."""

    name = "torch"

    def supports(self, kv_dtype: torch.dtype, group: int, head_dim: int) -> bool:
        return True

    @staticmethod
    def _prefills(prefills: List[tuple], block_size: int, window: int, device: torch.device,
                  tensor: Callable[[list, torch.dtype], Any]) -> List[PrefillSpan]:
        return [PrefillSpan(row, n, start, tensor(blocks[:-(-(start + n) // block_size)], torch.long),
                            prefill_mask(start, start + n, window, device))
                for row, n, start, blocks in prefills]

    def step_args(self, prefills: List[tuple], decodes: List[tuple], block_size: int, window: int,
                  device: torch.device, tensor: Optional[Callable[[list, torch.dtype], Any]] = None,
                  ) -> TorchStepArgs:
        """``tensor(values, dtype)`` makes the prefill chunks' block tensors (default: on ``device``;
        the model runner's staging on CUDA); the decode batch is built on ``device``."""
        args = TorchStepArgs(self._prefills(prefills, block_size, window, device, tensor or _tensor_on(device)))
        if not decodes:
            return args
        lens = [n for _, n, _ in decodes]
        nb = -(-max(lens) // block_size)
        bt = torch.zeros(len(lens), nb, dtype=torch.long, device=device)
        for i, (_, _, blocks) in enumerate(decodes):
            b = blocks[:nb]
            bt[i, :len(b)] = torch.tensor(b, dtype=torch.long)
        lens_t = torch.tensor(lens, device=device)
        args.decode_rows = torch.tensor([r for r, _, _ in decodes], dtype=torch.long, device=device)
        args.decode_blocks = bt
        keys = torch.arange(nb * block_size, device=device)[None, :]
        masked = keys >= lens_t[:, None]
        if window and max(lens) > window:  # the query is at lens - 1
            masked |= keys < (lens_t - window)[:, None]
        args.decode_masked = masked[None, :, None, :]
        return args

    @staticmethod
    def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """K/V [T, Hkv, D] of the new rows into the slots ``slot_mapping`` (block * block_size + offset)."""
        hkv, d = k_cache.shape[0], k_cache.shape[-1]
        k_cache.view(hkv, -1, d).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.view(hkv, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, args: TorchStepArgs,
               scale: float) -> torch.Tensor:
        """Attention of every row of ``q`` [T, H, D]; caches [Hkv, num_blocks, block_size, D]."""
        out = torch.empty_like(q)
        if args.prefills:
            _prefill_attention(q, k_cache, v_cache, args.prefills, scale, out)
        if args.decode_rows is not None:
            out[args.decode_rows] = _gathered_decode(q[args.decode_rows], k_cache, v_cache, args, scale)
        return out


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefills: List[PrefillSpan],
                       scale: float, out: torch.Tensor) -> None:
    """Each prefill chunk's rows of ``out``: SDPA over its context's gathered keys."""
    hkv, d = k_cache.shape[0], k_cache.shape[-1]
    for p in prefills:
        L = p.start_pos + p.num_new
        qs = q[p.row_start:p.row_start + p.num_new].transpose(0, 1)                     # [H, n, D]
        ks = k_cache.index_select(1, p.blocks).view(hkv, -1, d)[:, :L].to(q.dtype)      # [Hkv, L, D]
        vs = v_cache.index_select(1, p.blocks).view(hkv, -1, d)[:, :L].to(q.dtype)
        if p.mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, scale=scale, enable_gqa=True)
        out[p.row_start:p.row_start + p.num_new] = o.transpose(0, 1)


def _gathered_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, args: TorchStepArgs,
                     scale: float) -> torch.Tensor:
    """One query row per context against its blocks; q [B, H, D].

    The cache is laid out head-major, so gathering the batch's block
    tables yields one contiguous [L, D] matrix per (KV head, context):
    two batched matmuls read the keys and values in place, with the
    query heads of a GQA group as the rows.  (PyTorch's CPU SDPA kernel
    would first copy keys and values into [B, H, L, D], and in bfloat16
    runs several times slower than this at one query row.)  The softmax
    runs in float32 whatever the dtype.
    """
    B, h, d = q.shape
    hkv = k_cache.shape[0]
    g = h // hkv
    flat = args.decode_blocks.flatten()
    kd = k_cache.index_select(1, flat).view(hkv * B, -1, d).to(q.dtype)   # [Hkv*B, L, D]
    vd = v_cache.index_select(1, flat).view(hkv * B, -1, d).to(q.dtype)
    qg = q.view(B, hkv, g, d).transpose(0, 1).reshape(hkv * B, g, d)
    s = torch.bmm(qg, kd.transpose(1, 2)).float().mul_(scale).view(hkv, B, g, -1)
    s.masked_fill_(args.decode_masked, float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype).view(hkv * B, g, -1)
    return torch.bmm(p, vd).view(hkv, B, g, d).transpose(0, 1).reshape(B, h, d)


class KernelAttention(TorchAttention):
    """Decode rows through the compiled CPU kernel (``kernel``: a
    :class:`~.cpu_attention.PagedDecodeKernel`), which reads each context's
    blocks in place: no gather, no padding, no mask.  Prefill chunks and the
    store as :class:`TorchAttention`.  The CPU only.  A decode-only step
    (``decode_only``) hands the kernel q itself: no gather of its rows and no
    scatter into an output, two ops a layer (issue 31)."""

    name = "kernel"

    def __init__(self, kernel: Any):
        self.kernel = kernel

    def supports(self, kv_dtype: torch.dtype, group: int, head_dim: int) -> bool:
        return self.kernel.supports(kv_dtype, group, head_dim)

    def step_args(self, prefills: List[tuple], decodes: List[tuple], block_size: int, window: int,
                  device: torch.device, tensor: Optional[Callable[[list, torch.dtype], Any]] = None,
                  ) -> TorchStepArgs:
        args = TorchStepArgs(self._prefills(prefills, block_size, window, device, tensor or _tensor_on(device)))
        if not decodes:
            return args
        tables: List[int] = []
        starts: List[int] = []
        for _, n, blocks in decodes:
            starts.append(len(tables))
            tables += blocks[:-(-n // block_size)]
        args.decode_rows = torch.tensor([r for r, _, _ in decodes], dtype=torch.long)
        args.decode_tables = torch.tensor(tables, dtype=torch.long)
        args.decode_starts = torch.tensor(starts, dtype=torch.long)
        args.decode_lens = torch.tensor([n for _, n, _ in decodes], dtype=torch.long)
        args.window = window or 0
        args.decode_only = not prefills
        return args

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, args: TorchStepArgs,
               scale: float) -> torch.Tensor:
        if args.decode_only:  # every row: no gather of q's rows, no scatter into an output (2 ops a layer)
            return self.kernel(q.float(), k_cache, v_cache, args.decode_tables, args.decode_starts, args.decode_lens,
                               scale, args.window).to(q.dtype)
        out = torch.empty_like(q)
        if args.prefills:
            _prefill_attention(q, k_cache, v_cache, args.prefills, scale, out)
        if args.decode_rows is not None:
            out[args.decode_rows] = self.kernel(
                q[args.decode_rows].float(), k_cache, v_cache, args.decode_tables, args.decode_starts,
                args.decode_lens, scale, args.window).to(q.dtype)
        return out


def choose_backend(attention: str, device: torch.device) -> Any:
    """The backend the ``attention`` setting asks for on ``device`` (see :mod:`.options`): ``torch``;
    ``kernel`` (an error where the CPU kernel cannot be built; torch off the CPU); ``triton`` (an
    error without the triton package); ``auto``: Triton on a GPU where it is installed, the CPU
    kernel on a CPU where it builds, else torch."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be {one_of(ATTENTION)}, not {attention!r}")
    if attention == "triton" or (attention == "auto" and device.type == "cuda"):
        from . import kernels

        if kernels.available():
            from .kernels.attention import TritonAttention

            if device.type == "cpu" and not kernels.interpreted():
                # found by the first GPU run: the compiled kernels were handed CPU tensors
                raise ValueError("attention: triton with the engine on the CPU: this machine has CUDA, so the "
                                 "Triton kernels are compiled for the GPU; put the engine on cuda, or use "
                                 "attention: torch / kernel on the CPU")
            return TritonAttention()
        if attention == "triton":
            raise ValueError("attention: triton needs the triton package (pip install triton)")
        log.warning("attention: auto on %s: triton is not installed; attention gathers the cache with torch",
                    device)
        return TorchAttention()
    if attention == "torch" or device.type != "cpu":
        return TorchAttention()
    from . import cpu_attention

    kernel = cpu_attention.load()
    if kernel is None:
        if attention == "kernel":
            raise ValueError("attention: kernel: the CPU paged-attention kernel cannot be built here (see the log)")
        return TorchAttention()
    return KernelAttention(kernel)


__all__ = ["PrefillSpan", "TorchStepArgs", "TorchAttention", "KernelAttention", "choose_backend", "prefill_mask"]
