"""Owns the model weights and the KV cache tensor; turns a scheduled
:class:`~.scheduler.Batch` into tensors and runs one forward pass.

On CUDA the step's integer inputs go through one reused pinned buffer and one
asynchronous copy (:mod:`.staging`), and with the Triton attention decode-only
steps are padded and replayed as CUDA graphs (:mod:`.cuda_graphs`).  On the
CPU the inputs are plain tensors, as they always were.

What a step does not redo (issue 31, a profile of one batch-1 step in
docs/cpu-engine.md): the fused layers' modules, weights and cache views are
gathered once (``fused_plan``); a step whose every row wants logits passes
no row index; cos/sin come from the model's table up to the step's largest
position (``positions_end``).  Together with the attention's decode-only path
they took a batch-1 step of the embedded model from 12.4 to 8.7 ms on a
2-core Zen 3 (81.7 -> 121.3 tokens/s), with the same logits."""

from __future__ import annotations

import collections
from typing import Any, Deque, List, Optional, Tuple

import torch

from .attention import TorchAttention
from .block_sharing import VariantSet
from .models.llama import AttentionMetadata, LlamaForCausalLM
from .scheduler import Batch


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype, device: torch.device, variants: Optional[VariantSet] = None,
                 attention: Optional[Any] = None, *, max_seqs: int = 256,
                 max_model_len: Optional[int] = None, cuda_graphs: Optional[bool] = None,
                 fused_ops: Optional[bool] = None):
        """``attention``: the attention backend (:func:`.attention.choose_backend`): a
        :class:`~.attention.KernelAttention` (decode attention on the CPU reading the blocks in place),
        a :class:`~.kernels.attention.TritonAttention` (the KV store, prefill and decode attention as
        Triton kernels, any device), or None / a :class:`~.attention.TorchAttention` for the torch
        path (the gather; the reference numerics), which also stands in for a backend that does not
        support this model's KV dtype or head shape (and for the CPU kernel off the CPU).

        ``cuda_graphs``: decode-only steps through :class:`~.cuda_graphs.DecodeGraphs` (the Triton
        attention only): captured CUDA graphs on a GPU; on a CPU (``True``, for the tests) the same
        padded static-buffer path run eagerly.  None: on where the device is CUDA and the attention
        Triton.  ``max_seqs`` and ``max_model_len`` (default: the cache's tokens) bound the graphs'
        batch sizes and static block tables.

        ``fused_ops``: the decoder layer's small ops fused (:func:`_fused_ops`).  None: where they
        pay (the C++ ops for quantized weights on the CPU; the Triton ops with the Triton attention
        on CUDA); True: the Triton ops with the Triton attention on any device (on a CPU under
        Triton's interpreter: for the tests), else as None; False: never."""
        cfg = model.cfg
        if attention is None or not attention.supports(kv_dtype, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim) \
                or (attention.name == "kernel" and device.type != "cpu"):
            attention = TorchAttention()
        self.attention = attention
        self.triton = attention if attention.name == "triton" else None  # what the decode graphs replay
        self.model = model
        # the fused ops write the cache themselves (rope_store): the C++ ops with the torch or C++ attention
        # on the CPU, the Triton ops (``kernels/fused.py``) with the Triton attention; both in its layout
        self.fused = None if fused_ops is False else _fused_ops(model, device, self.triton is not None, fused_ops)
        self.variants = variants  # several fine-tuned variants in one batch (BlockLLM), or None
        self.block_size = block_size
        self.device = device
        self.window = cfg.sliding_window
        # [layers, k/v, kv_heads, blocks, block_size, head_dim]: head-major, so a
        # gathered block table is one contiguous [tokens, head_dim] matrix per head
        self.kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim,
                              dtype=kv_dtype, device=device)
        # the fused layers' modules, weights and cache views, gathered once (not once per step)
        self.fused_plan = model.fused_plan(self.kv) if self.fused is not None else None
        # one pinned host buffer and one async copy per step, on CUDA; plain tensors on the CPU
        self.staging = None
        if device.type == "cuda":
            from .staging import StepStaging

            self.staging = StepStaging(device, pin=True)
        self._timing: Deque[Tuple[Any, Any]] = collections.deque()  # CUDA (start, end) events of recent steps
        self.graphs = None
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda" and self.triton is not None
        if cuda_graphs:
            if self.triton is None:
                raise ValueError("cuda_graphs: true needs attention: triton (the decode graphs replay the Triton "
                                 "kernels); set cuda_graphs: false or use the Triton attention")
            from .cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.kv, self.triton, block_size,
                                       max_model_len or num_blocks * block_size, max_seqs, self.window or 0, device,
                                       capture=device.type == "cuda", fused=self.fused)

    def close(self) -> None:
        """Free the per-step buffers and graphs (pinned host memory among them); the cache stays."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None

    @staticmethod
    def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
        c = model.cfg
        return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * torch.empty(0, dtype=dtype).element_size()

    def forward_seconds(self) -> List[float]:
        """On CUDA: the GPU seconds of each step whose forward pass finished since the last call, in
        order (read from its start/end events without waiting).  Elsewhere empty: the caller's own
        wall clock times the step (``run`` returns when it has run)."""
        got = []
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.popleft()
            got.append(start.elapsed_time(end) / 1e3)
        return got

    def run(self, batch: Batch) -> Tuple[torch.Tensor, List[int]]:
        """Returns logits [R, V] and, for each row, the index of its chunk in
        ``batch.chunks`` (only chunks that reach their context's end).  On CUDA the logits may
        still be being computed (stream order makes every later use wait)."""
        if self.device.type != "cuda":
            return self._run(batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        got = self._run(batch)
        end.record()
        self._timing.append((start, end))
        if len(self._timing) > 64:  # nobody reads them: keep a bounded window
            self._timing.popleft()
        return got

    def _run(self, batch: Batch) -> Tuple[torch.Tensor, List[int]]:
        for src, dst in batch.copies:  # copy-on-write before anything writes
            self.kv[:, :, :, dst].copy_(self.kv[:, :, :, src])
        if self.graphs is not None and (self.variants is None or len(self.variants) <= 1):
            logits = self.graphs.run(batch)  # None: not a decode-only step the graphs take
            if logits is not None:
                return _finished(logits), list(range(len(batch.chunks)))
        dev = self.device
        stage = self.staging
        tensor = stage.tensor if stage is not None else (
            lambda values, dtype: torch.tensor(values, dtype=dtype, device=dev))
        ids: List[int] = []
        pos: List[int] = []
        slot_mapping: List[int] = []
        prefills: List[tuple] = []  # (first row, rows, start position, blocks) per prefill chunk
        decodes: List[tuple] = []   # (row, keys, blocks) per decode row
        logit_rows: List[int] = []
        logit_chunks: List[int] = []
        bs = self.block_size
        positions_end = 0
        order = range(len(batch.chunks))
        if self.variants is not None and len(self.variants) > 1:
            # a variant's rows together: its unique blocks and adapter then run over one slice
            order = sorted(order, key=lambda i: batch.chunks[i].ctx.variant)
        for ci in order:
            ch = batch.chunks[ci]
            ctx = ch.ctx
            row = len(ids)
            end = ch.start + ch.num
            positions_end = max(positions_end, end)
            ids += ctx.token_ids[ch.start:end]
            pos += range(ch.start, end)
            blocks = ctx.table.blocks
            slot_mapping += [blocks[p // bs] * bs + p % bs for p in range(ch.start, end)]
            if ch.num == 1 and ch.start > 0:
                decodes.append((row, ch.start + 1, blocks))
            else:
                prefills.append((row, ch.num, ch.start, blocks))
            if ch.reaches_end:
                logit_rows.append(row + ch.num - 1)
                logit_chunks.append(ci)
        meta = AttentionMetadata(slot_mapping=tensor(slot_mapping, torch.long), attention=self.attention,
                                 attention_args=self.attention.step_args(prefills, decodes, bs, self.window or 0,
                                                                         dev, tensor),
                                 fused=self.fused, positions_end=positions_end, fused_plan=self.fused_plan)
        if self.variants is not None and len(self.variants) > 1:
            meta.variants = self.variants.batch([batch.chunks[ci].ctx.variant for ci in order
                                                 for _ in range(batch.chunks[ci].num)])
            meta.fused = None
        # every row a logit row (a decode-only step): None, the model takes them all without indexing
        rows_t = None if len(logit_rows) == len(ids) else tensor(logit_rows, torch.long)
        ids_t, pos_t = tensor(ids, torch.long), tensor(pos, torch.long)
        if stage is not None:  # one copy of everything staged above, then the placeholders become its views
            stage.upload()
            meta = stage.resolve(meta)
            ids_t, pos_t, rows_t = stage.resolve([ids_t, pos_t, rows_t])
        return _finished(self.model(ids_t, pos_t, self.kv, meta, rows_t)), logit_chunks


def _finished(logits: torch.Tensor) -> torch.Tensor:
    """Float32 logits where the model ran: on a GPU the sampler samples there
    (``sampler.sample_on_device``) and only the ids come to the host.  On a GPU
    this returns as soon as the step is queued, not when it has run: the
    sampler's one copy of ids to the host is the step's only wait, and the
    engine reads the forward pass's time from CUDA events
    (:meth:`ModelRunner.forward_seconds`).  A ``torch.cuda.synchronize`` here
    (as before issue 36) held the host idle for every forward pass."""
    return logits.float()


def _fused_ops(model: LlamaForCausalLM, device: torch.device, triton: bool = False,
               asked: Optional[bool] = None) -> Optional[Any]:
    """The fused ops (``rms_norm``, ``add_rms_norm_``, ``silu_mul``, ``rope_store``) where they apply:
    no q/k norm (qwen3), and

    * with the Triton attention (``triton``): the Triton kernels of :mod:`.kernels.fused` on CUDA
      (fewer kernel launches per step), or on any device when ``asked`` (the CPU tests, under
      Triton's interpreter); float32, bfloat16 or float16 activations;
    * otherwise the C++ ops of :mod:`.cpu_matmul` on the CPU for quantized weights (whose matmuls
      are not the float32 reference anyway: the dense float32 path stays token-for-token
      transformers'), float32 activations.

    None otherwise or where the kernels cannot be built.  Batches mixing variants never use them
    (``ModelRunner.run`` drops them per step)."""
    if model.cfg.qk_norm:
        return None
    dtype = model.norm.weight.dtype
    if triton:
        if not (device.type == "cuda" or asked) or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        from .kernels import fused

        return fused
    if device.type != "cpu" or getattr(model, "weights_format", None) not in ("as-shipped", "int8"):
        return None
    if dtype != torch.float32:
        return None
    from . import cpu_matmul

    return cpu_matmul.load()
