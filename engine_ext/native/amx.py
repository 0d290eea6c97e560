"""Which path a quantized matmul takes on this CPU: the GGUF kernel, or bfloat16 on AMX tiles.

Intel Xeons since Sapphire Rapids have AMX: tile registers and a bfloat16
(and int8) matrix-multiply unit, about 8x the multiply-adds per cycle of
AVX-512.  torch sends a bfloat16 CPU matmul to oneDNN, whose brgemm kernels
use the tiles when the CPU has them (vLLM's CPU backend reaches its bf16
numbers this way: issue 31 measured it at 1.6x Interlace at batch 32 on such
a machine).  So on an AMX CPU :class:`~.quant.Int4Linear` also keeps its
weights as a dense bfloat16 matrix (dequantized exactly from the GGUF's
groups, then rounded to bfloat16) and sends matmuls of at least
:data:`AMX_MIN_ROWS` rows through it (``torch.nn.functional.linear`` in
bfloat16, the output back in float32).  Fewer rows stay on the GGUF kernel:
batch-1 decode reads every weight once per token and is memory-bound, where
0.625 bytes per Q4 weight beat the 2 of bfloat16; with many rows (batched
decode, prefill) the matmul is compute-bound and the tiles win.

The cost: the bfloat16 copy is 2 bytes per weight beside the GGUF kernel's
0.625 (Q4) or 1.0625 (Q8_0), about 4x the quantized weights' memory (the
embedded SmolLM2-135M: +260 MB), and bfloat16's 8-bit mantissa in the
activations, weights and outputs of those matmuls: forced on, the embedded
model's greedy runs matched the gguf kernel's in full on 11 of 20 chat
prompts over 32 tokens (17/20 with decode at one row, which stays on the
gguf kernel; teacher-forced top-1 0.977 and 0.994; docs/quantization.md,
"AMX path").  ``auto`` therefore enables it only where the tiles exist.

:func:`amx_path` decides, from the CPU's flags (``amx_tile``, ``amx_bf16``,
``avx512_bf16`` in /proc/cpuinfo), torch's own detector
(``torch.cpu._is_amx_tile_supported``: cpuinfo's CPUID check, which also
sees a hypervisor that hides the tiles) and oneDNN being built in and
enabled, and the ``INTERLACE_AMX`` override: ``auto`` (the default: the
tiles when all of those say yes), ``on`` (the bfloat16 path even without
AMX: slow, emulated bfloat16; how the tests check its numerics on any
machine), ``off`` (never).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import torch

#: matmuls of at least this many rows take the bfloat16 (AMX) path; fewer stay on the GGUF kernel
AMX_MIN_ROWS = 8
ENV = "INTERLACE_AMX"
MODES = ("auto", "on", "off")
#: the /proc/cpuinfo flags a CPU needs for oneDNN's bfloat16 AMX kernels
FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class AmxPath:
    """Whether matmuls of ``min_rows`` rows or more run in bfloat16 (on AMX), and why."""

    enabled: bool
    reason: str
    min_rows: int = AMX_MIN_ROWS

    def takes(self, rows: int) -> bool:
        """Whether a matmul of ``rows`` rows takes the bfloat16 path."""
        return self.enabled and rows >= self.min_rows

    def describe(self) -> str:
        return (f"bf16 (oneDNN) for >= {self.min_rows} rows: {self.reason}" if self.enabled
                else f"off: {self.reason}")


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset:
    from .cbuild import cpu_flags

    return frozenset(cpu_flags().partition(":")[2].split())


def torch_detects_amx() -> Optional[bool]:
    """torch's own AMX check (``torch.cpu._is_amx_tile_supported``), or None where this torch lacks it."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return None if probe is None else bool(probe())


def onednn_usable() -> bool:
    """oneDNN (mkldnn) built into this torch and not switched off (``torch.backends.mkldnn.enabled``)."""
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def cpu_has_amx(flags: Optional[Iterable[str]] = None, detector: Optional[bool] = None,
                onednn: Optional[bool] = None) -> Tuple[bool, str]:
    """Whether this CPU and torch run bfloat16 matmuls on AMX tiles, and why (not).
    ``flags``, ``detector`` (torch's check; None: this torch has none), ``onednn``: read from
    this machine when omitted (tests pass them)."""
    have = frozenset(_cpu_flags() if flags is None else flags)
    if flags is None and detector is None:
        detector = torch_detects_amx()
    if onednn is None:
        onednn = onednn_usable()
    missing = [f for f in FLAGS if f not in have]
    if missing:
        return False, f"no AMX on this CPU (flags: no {' '.join(missing)})"
    if detector is False:
        return False, "the CPU lists AMX but torch's detector says no (hidden by a hypervisor?)"
    if not onednn:
        return False, "oneDNN is not built into this torch or is disabled (torch.backends.mkldnn)"
    return True, "AMX on this CPU (flags " + " ".join(FLAGS) + (", torch's detector agrees)" if detector else ")")


def amx_mode(env: Optional[str] = None) -> str:
    """The ``INTERLACE_AMX`` setting (``auto`` when unset); an unknown value is a QuantError."""
    from .quant import QuantError

    value = os.environ.get(ENV, "auto") if env is None else env
    value = value.strip().lower() or "auto"
    if value not in MODES:
        raise QuantError(f"{ENV} must be one of {list(MODES)}, got {value!r}")
    return value


def amx_path(flags: Optional[Iterable[str]] = None, detector: Optional[bool] = None,
             onednn: Optional[bool] = None, env: Optional[str] = None) -> AmxPath:
    """The path of this machine's quantized matmuls (see the module's docstring); the arguments
    as for :func:`cpu_has_amx` and :func:`amx_mode`."""
    mode = amx_mode(env)
    if mode == "off":
        return AmxPath(False, f"{ENV}=off")
    has, why = cpu_has_amx(flags, detector, onednn)
    if mode == "on":
        return AmxPath(True, f"forced by {ENV}=on" + ("" if has else f"; {why}: bf16 is emulated, slow"))
    return AmxPath(has, why)


__all__ = ["AMX_MIN_ROWS", "AmxPath", "amx_path", "amx_mode", "cpu_has_amx", "torch_detects_amx", "ENV"]
