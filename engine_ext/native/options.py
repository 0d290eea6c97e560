"""The native engine's settings, named once.

The values a configuration may give ``dtype``, ``weights`` and ``attention``,
and which settings reach :meth:`~.engine.NativeEngine.load`, used to be
listed in four places (the engine's two tables, its attention chooser, the
gateway's config schema and the gateway's key list), and the lists drifted:
the gateway validated ``cuda_graphs`` and ``gpu_memory_utilization`` but
never passed them on.  The engine declares them here and everything else
reads them: :mod:`.loader` (dtypes, weights), :mod:`.attention` (backends)
and the gateway's config (its schema enums, the keys it forwards).

No torch here, and nothing the engine would pull in: the gateway's config
imports this module, and must stay importable (and cheap) without torch.
"""

from __future__ import annotations

from typing import Iterable

#: ``dtype``: the compute dtype (activations, KV cache, dense weights); ``auto`` picks the
#: fastest that keeps float32's exponent range on the device (:func:`.loader.resolve_dtype`)
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: other spellings of the concrete dtypes the engine also takes (not offered by the config schema)
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: ``weights``: how the weight matmuls are stored (unset: dense in the compute dtype):
#: as-shipped = a GGUF's quantized tensors, int8 = per output channel (:func:`.loader.resolve_weights`)
WEIGHTS = ("as-shipped", "float32", "bfloat16", "int8")

#: ``attention``: the backend that stores K/V and attends over the paged cache (:func:`.attention.choose`):
#: kernel = the compiled CPU decode kernel, triton = the Triton kernels, torch = the gather (the
#: reference numerics), auto = the CPU kernel where it builds, Triton on a GPU where it is installed
ATTENTION = ("auto", "kernel", "triton", "torch")

#: The settings of a native engine (a model's, or a native engine object's, in the gateway's
#: config) that are :meth:`NativeEngine.load` keyword arguments, passed on as they are.
LOAD_KEYS = ("dtype", "weights", "device", "block_size", "kv_cache_tokens", "max_batched_tokens", "max_seqs",
             "max_model_len", "attention", "cuda_graphs", "gpu_memory_utilization", "adapt_threads")


def one_of(names: Iterable[str]) -> str:
    """``'a', 'b' or 'c'``: the valid names in an error message."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


__all__ = ["DTYPES", "DTYPE_ALIASES", "WEIGHTS", "ATTENTION", "LOAD_KEYS", "one_of"]
