"""Decode steps replayed as CUDA graphs (the Triton attention only).

Why: a decode step of a small model is a few hundred tiny kernel launches
(per layer: norms, matmuls, rotary, the KV store, decode attention), and at
small batch sizes the GPU finishes each faster than Python launches the next.
A CUDA graph records the whole step once and replays it with one launch.

A graph has fixed shapes and fixed addresses, so :class:`DecodeGraphs`:

* pads a decode-only batch to the next captured size (1, 2, 4, 8, then steps
  of 8 up to ``max_seqs``, at most :data:`MAX_GRAPH_BATCH`).  Padded rows have
  token 0 at position 0, slot -1 (``store_kv`` skips it: they never write the
  cache) and 0 keys (the decode kernel reads nothing for them and outputs 0);
  their logits are computed and dropped.
* keeps the step's inputs in **static buffers**: one int32 matrix
  ``[max batch, 4 + max_blocks]`` whose row ``i`` is ``token id, position,
  slot, keys, block table`` of batch row ``i``, the table padded to
  ``max_blocks = ceil(max_model_len / block_size)`` entries.  Row-major so
  that a step's rows ``[:b]`` are one contiguous range: the host fills them in
  a staging copy (pinned on CUDA) and one asynchronous copy moves them to the
  device.  Table entries past a context's last block are never read by the
  kernel, so they are left as earlier steps wrote them (only the step's
  longest table is written).  Inside the recorded forward one small device
  copy turns the four leading columns into contiguous vectors.
* fixes split-K per graph: ``num_splits`` is chosen from ``max_model_len``
  (the longest context any replay may see) and the padded batch size, so
  nothing reads the device on the host while capturing; the decode kernel's
  trailing splits are simply empty for shorter contexts.

Graphs are captured **lazily**, the first time a batch pads to that size:
start-up stays as fast as before (an agent gateway often never sees the
larger sizes), and each capture costs one eager warm-up (which also compiles
the Triton kernels, which must not happen during a capture) plus the capture.
All graphs share one memory pool (``torch.cuda.graph_pool_handle()``).  A
later capture may reuse memory an earlier graph freed at the end of its
capture, including where a later graph keeps its output; that is safe
because graphs are replayed one at a time on one stream and each replay's
logits are copied out (a device copy, which the sampler and the contexts'
last logits keep) before the next replay.

Without CUDA the same class runs the same static-buffer path, and a
"replay" is the forward called on the static buffers: everything except the
capture itself is exercised by the CPU tests under Triton's interpreter.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Tuple

import torch

from .kernels.attention import TritonStepArgs
from .kernels.paged_attention import pick_num_splits
from .models.llama import AttentionMetadata, LlamaForCausalLM
from .scheduler import Batch

log = logging.getLogger(__name__)

#: the largest padded batch a graph is captured for (larger decode batches run eagerly)
MAX_GRAPH_BATCH = 256
#: one capture at a time in the process (PyTorch's rule), whichever engine replica captures
_CAPTURE_LOCK = threading.Lock()
#: columns of the static input matrix before the block table
ID, POS, SLOT, LEN, TABLE = 0, 1, 2, 3, 4


def graph_sizes(max_seqs: int, cap: int = MAX_GRAPH_BATCH) -> List[int]:
    """The padded batch sizes graphs are captured for: 1, 2, 4, 8, 16, 24, ... up to the
    first that holds ``max_seqs`` rows, none above ``cap``."""
    sizes: List[int] = []
    s = 1
    while s <= cap:
        sizes.append(s)
        if s >= max_seqs:
            break
        s = s * 2 if s < 8 else s + 8
    return sizes


def is_decode_only(batch: Batch) -> bool:
    """Every chunk is one new token after a computed prefix, and its logits are needed."""
    return bool(batch.chunks) and all(ch.num == 1 and ch.start > 0 and ch.reaches_end for ch in batch.chunks)


class DecodeGraphs:
    """Padded decode steps over static input buffers, replayed as CUDA graphs (see the module doc).

    ``capture``: record CUDA graphs (needs CUDA); False runs the same padded static-buffer
    path eagerly (the CPU, and what the tests compare against the plain eager path).
    """

    def __init__(self, model: LlamaForCausalLM, kv: torch.Tensor, triton, block_size: int, max_model_len: int,
                 max_seqs: int, window: int, device: torch.device, capture: bool, fused=None):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model, self.kv, self.triton = model, kv, triton
        self.fused = fused  # the model runner's fused ops (``kernels/fused.py``), or None
        self.block_size, self.window, self.device, self.capture = block_size, window or 0, device, capture
        self.max_blocks = -(-max_model_len // block_size)
        self.sizes = graph_sizes(max_seqs)
        self.max_batch = self.sizes[-1]
        width = TABLE + self.max_blocks
        self.host = torch.zeros(self.max_batch, width, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.static = torch.zeros(self.max_batch, width, dtype=torch.int32, device=device)
        self.rows = torch.arange(self.max_batch, dtype=torch.long, device=device)
        hkv = model.cfg.num_kv_heads
        self.num_splits: Dict[int, int] = {b: pick_num_splits(max_model_len, b * hkv, device) for b in self.sizes}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0   # steps served by this path (graph replays, or their eager stand-in)
        self._copied = None  # CUDA: the event after the last host-to-device copy of the inputs

    def padded_size(self, n: int) -> Optional[int]:
        """The captured size that ``n`` rows pad to, or None: more rows than the largest."""
        return next((s for s in self.sizes if s >= n), None)

    def run(self, batch: Batch) -> Optional[torch.Tensor]:
        """Logits ``[n, V]`` (device, float32; row i is chunk i) of a decode-only batch, or None
        where this path does not apply (a prefill or mixed step, too many rows, a context
        longer than the static block tables): the caller runs the step eagerly.

        Rows sharing a prefix stay here, with plain paged decode: cascade decode (whose plan varies
        by step) runs in eager steps only (mixed steps, batches past the largest graph, graphs off).
        Leaving the graph costs more than cascade saves at the fan-outs agents make: on the H200
        (2026-11-27) an eager decode step of Llama-3.2-1B at batch 32 took 11.5 ms of wall time
        against 2.85 ms replayed, about 0.5 ms per layer, while cascade saved 0.13 ms per layer at 64
        forks of a 4k prefix (Llama-3-8B heads: 58 vs 187 us)."""
        n = len(batch.chunks)
        b = self.padded_size(n)
        if b is None or not is_decode_only(batch):
            return None
        bs = self.block_size
        lead: List[List[int]] = []
        tables: List[List[int]] = []
        for ch in batch.chunks:
            p = ch.start
            nb = -(-(p + 1) // bs)
            if nb > self.max_blocks:
                return None
            blocks = ch.ctx.table.blocks
            lead.append([ch.ctx.token_ids[p], p, blocks[p // bs] * bs + p % bs, p + 1])
            tables.append(blocks[:nb])
        self._stage(lead, tables, b)
        self.replays += 1
        if not self.capture:
            return self._forward(b)[:n]
        if b not in self.graphs:
            self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        # a copy: the graph's output is rewritten by the next replay (of any size: the pool is shared),
        # and the engine keeps a context's last logits on the device across steps
        return out[:n].clone()

    def _stage(self, lead: List[List[int]], tables: List[List[int]], b: int) -> None:
        """Write the rows ``[:b]`` of the host buffer (padding included) and copy them to the device."""
        n = len(lead)
        width = max(len(t) for t in tables)
        if self._copied is not None:  # the last step's copy may still read the pinned buffer: no device-wide sync
            self._copied.synchronize()
        self.host[:n, :TABLE] = torch.tensor(lead, dtype=torch.int32)
        self.host[:n, TABLE:TABLE + width] = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                         dtype=torch.int32)
        if b > n:  # padded rows: token 0 at position 0, no slot (-1: nothing stored), no keys (nothing read)
            self.host[n:b, :TABLE] = torch.tensor([0, 0, -1, 0], dtype=torch.int32)
        self.static[:b].copy_(self.host[:b], non_blocking=True)
        if self.capture:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))

    def _forward(self, b: int) -> torch.Tensor:
        """The padded step of ``b`` rows on the static buffers; the body a graph records.
        Nothing in it reads the device on the host or allocates by data."""
        cols = self.static[:b, :TABLE].t().contiguous()  # [4, b]: each input a contiguous vector
        rows = self.rows[:b]
        args = TritonStepArgs(prefill_rows=None, prefill_tables=None, cu_seqlens=None, start_pos=None, max_new=0,
                              decode_rows=rows, decode_tables=self.static[:b, TABLE:], decode_lens=cols[LEN],
                              window=self.window, num_splits=self.num_splits[b])
        meta = AttentionMetadata(slot_mapping=cols[SLOT], attention=self.triton, attention_args=args,
                                 fused=self.fused)
        return self.model(cols[ID], cols[POS], self.kv, meta, rows)

    def _capture(self, b: int) -> None:
        """Warm up (compiles the kernels; cuBLAS picks its algorithms) on a side stream, then record.

        The warm-up runs the current step for real on the static buffers; the replay that follows
        writes the same K/V to the same slots again, so running it twice changes nothing.
        """
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (an engine replica on the same GPU) does not
        # invalidate this capture, as it would in the default "global" mode
        with _CAPTURE_LOCK, torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(b)
        self.graphs[b] = (graph, out)
        log.info("captured the decode CUDA graph for batch size %d (split-K %d)", b, self.num_splits[b])

    def close(self) -> None:
        """Drop the graphs and the buffers (the pinned host buffer with them)."""
        self.graphs.clear()
        self.host = self.static = self.rows = None
