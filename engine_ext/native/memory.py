"""How many KV cache blocks fit on the GPU (``gpu_memory_utilization``, as vLLM sizes its cache).

Why: a fixed ``kv_cache_tokens`` is either too small for a large GPU (fewer
contexts batched, more swapping) or too large for a small one (out of memory
at start, or worse, in the middle of a long prefill).  vLLM's rule instead:
this engine may use ``utilization`` of the device's memory in all; the
weights, the largest forward's activations and the allocator's overhead are
taken from that share, and what remains is KV cache::

    blocks = floor((total * utilization - weights - activation peak - other) / bytes per block)

The activation peak is measured, not estimated: one dummy forward of
``max_batched_tokens`` tokens (the largest step the scheduler builds) with the
allocator's peak statistics reset before it (:func:`measure_activation_peak`).
The KV cache is also never sized past the memory actually free (another
process or engine on the same GPU).

:func:`kv_blocks_for` is the pure rule (tested on any machine); the
measurement needs CUDA; :func:`blocks_from_memory` puts the two together for an engine.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import torch

log = logging.getLogger(__name__)

GIB = 1024 ** 3


class KVCacheMemoryError(ValueError):
    """The GPU memory share left for the KV cache holds no block."""


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def check_utilization(utilization: Any) -> float:
    """``utilization`` as a float in (0, 1], or a ValueError naming it."""
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")
    return float(utilization)


def kv_blocks_for(total_bytes: int, weights_bytes: int, activation_peak_bytes: int, utilization: float,
                  bytes_per_block: int, other_bytes: int = 0, free_bytes: Optional[int] = None) -> int:
    """KV blocks for an engine allowed ``utilization`` of a device of ``total_bytes``.

    ``weights_bytes``: the model's parameters and buffers on the device; ``activation_peak_bytes``:
    the peak a forward of the largest batch allocates beyond them; ``other_bytes``: anything else
    this engine holds there that the cache cannot use (the allocator's cached, unreleasable
    segments).  ``free_bytes`` (optional): memory free on the device now, which the cache plus the
    activations must also fit in.  Raises :class:`KVCacheMemoryError` when not one block fits.
    """
    utilization = check_utilization(utilization)
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    budget = int(total_bytes * utilization) - weights_bytes - activation_peak_bytes - other_bytes
    blocks = budget // bytes_per_block
    why = (f"{utilization:g} x {_gib(total_bytes)} of GPU memory = {_gib(total_bytes * utilization)}, less "
           f"{_gib(weights_bytes)} of weights, {_gib(activation_peak_bytes)} of activations at the peak and "
           f"{_gib(other_bytes)} other, leaves {_gib(budget)}")
    if free_bytes is not None:
        by_free = (free_bytes - activation_peak_bytes) // bytes_per_block
        if by_free < blocks:
            blocks = by_free
            why += (f"; but only {_gib(free_bytes)} is free on the device (another process or engine holds the "
                    f"rest), less the activations: {_gib(free_bytes - activation_peak_bytes)}")
    if blocks <= 0:
        raise KVCacheMemoryError(f"no room for the KV cache: {why}, and one block takes {bytes_per_block} bytes; "
                                 f"raise gpu_memory_utilization, lower max_batched_tokens, or free the GPU")
    return int(blocks)


def blocks_from_memory(model: Any, utilization: float, max_batched_tokens: int, block_size: int,
                       kv_dtype: torch.dtype, device: torch.device, attention: Any) -> int:
    """KV blocks for ``model``'s engine from the GPU's memory (CUDA): :func:`kv_blocks_for` with
    the activation peak of one dummy forward of ``max_batched_tokens`` tokens through the
    ``attention`` backend, measured before the cache exists."""
    from .model_runner import ModelRunner
    from .quant import weight_bytes

    peak, other = measure_activation_peak(model, max_batched_tokens, block_size, kv_dtype, device, attention)
    free, total = torch.cuda.mem_get_info(device)
    weights = weight_bytes(model)  # parameters, buffers, any prepacked copies
    per_block = ModelRunner.kv_bytes_per_block(model, block_size, kv_dtype)
    blocks = kv_blocks_for(total, weights, peak, utilization, per_block, other, free_bytes=free)
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB) from gpu_memory_utilization %g of %.2f GiB "
             "(weights %.2f GiB, activation peak %.2f GiB)", blocks, block_size, blocks * per_block / GIB,
             utilization, total / GIB, weights / GIB, peak / GIB)
    return blocks


def measure_activation_peak(model: Any, max_batched_tokens: int, block_size: int, kv_dtype: torch.dtype,
                            device: torch.device, attention: Any) -> Tuple[int, int]:
    """``(activation peak, other)`` bytes of one dummy prefill of ``max_batched_tokens`` tokens (CUDA).

    The forward runs through a :class:`~.model_runner.ModelRunner` of its own with just the blocks
    the dummy context needs (their bytes are not counted as activations), through the engine's
    ``attention`` backend (:mod:`.attention`), with CUDA graphs off.  Everything it allocated is
    freed before returning.
    """
    if device.type != "cuda":
        raise ValueError(f"measuring the activation peak needs a CUDA device, not {device}")
    from .block_manager import BlockTable
    from .model_runner import ModelRunner
    from .scheduler import Batch, ScheduledChunk
    from .sequence import Context

    n = max(1, int(max_batched_tokens))
    nb = -(-n // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    runner = ModelRunner(model, nb, block_size, kv_dtype, device, None, attention, cuda_graphs=False)
    cache_bytes = runner.kv.numel() * runner.kv.element_size()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ctx = Context("profile", [0] * n, BlockTable(blocks=list(range(nb))))
    runner.run(Batch(chunks=[ScheduledChunk(ctx, 0, n)]))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    runner.close()
    del runner
    torch.cuda.empty_cache()
    other = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    log.debug("activation peak of %d tokens: %d bytes (the dummy cache of %d bytes aside)", n, peak, cache_bytes)
    return max(0, peak), max(0, other)
