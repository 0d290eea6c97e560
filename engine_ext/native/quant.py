"""Quantized weights: a GGUF's tensors run as shipped, and int8 from float weights.

``weights: as-shipped`` loads a GGUF's quantized tensors without
dequantizing them to a float checkpoint: Q4_0, Q4_1 and Q8_0 matrices run in
their blocks through Interlace's own kernel (:mod:`.cpu_matmul`), or as
fp16 weights through fbgemm's GEMM where it cannot be built, or through
aten's int4 kernel (:func:`int4_kernel` says which and why); other quantized types (Q4_K, Q6_K, ...) are dequantized to dense weights,
with one log line naming them; F32/F16/BF16 tensors load as they are.
``weights: int8`` quantizes a model's float weights per output channel
(``torch._weight_int8pack_mm``).  docs/quantization.md has the measured
quality and speed.

How a GGUF block maps onto aten's int4 format.  aten dequantizes a 4-bit
code ``q`` (0..15) of group ``g`` as ``(q - 8) * scale[g] + zero[g]``
(:func:`dequantize_int4`); a GGUF block holds 32 consecutive weights of one
row (along the input dimension), exactly one aten group:

* Q4_1 ``w = d*q + m``  ->  scale ``d``, zero ``m + 8d``;
* Q4_0 ``w = d*(q - 8)``  ->  scale ``d``, zero 0;
* Q8_0 ``w = d*q`` with ``q`` in -128..127: ``q + 128 = 16*hi + lo`` with two
  4-bit codes, so ``w = 16d*(hi - 8) + [d*(lo - 8) + 8d]``: two int4 groups
  (scale ``16d`` zero 0, and scale ``d`` zero ``8d``).  The matrix is stored
  with its input dimension doubled (the hi codes of every row, then the lo
  codes) and the activations are concatenated with themselves, ``[x, x]``:
  one int4 matmul, exact up to float32 rounding, 1.5 bytes per weight with
  the scales.  (A per-output-channel int8 requantization would take 1 byte
  per weight but add a second rounding: ``bench/quant_quality.py``
  ``--q8-check`` measures its error.)

These int4 groups are the loader's one representation; the gguf kernel's
blocks are made back from them (:func:`gguf_blocks`: a Q8_0 block's codes are
``16*hi + lo - 128``).

A fused projection (q/k/v, gate/up) stays one matmul: its parts' packed rows
are concatenated.  Q4_0 and Q4_1 parts mix freely; a part in Q8_0 puts the
whole module in the doubled layout (a 4-bit part then gets all-zero hi
groups); a part in any other type makes the module dense.

The scales stay float32 (a GGUF's fp16 ``d`` and ``m`` exactly) and the
quantized matmuls run on float32 activations, whatever the compute dtype
(``dtype``: the activations, norms, embeddings and KV cache): with bfloat16
compute their inputs are converted to float32 and their outputs back.

llama.cpp's converter permutes the rows of Q and K for the ``llama``
architecture (its RoPE pairs adjacent dimensions, Hugging Face's the two
halves); the loader undoes it as transformers does
(``modeling_gguf_pytorch_utils.LlamaTensorProcessor``).  A row permutation
moves whole rows of blocks, so it is exact on the quantized bytes.

The quantized kernels are CPU ones (aten's, fbgemm's): quantized weights
need ``device: cpu``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .amx import AmxPath, amx_path
from .models.llama import LlamaForCausalLM, ModelConfig, UnsupportedModel, rope_inv_freq

log = logging.getLogger(__name__)

GROUP = 32  # a GGUF block of Q4_0/Q4_1/Q8_0 = one aten int4 group

# ggml type ids (gguf.GGMLQuantizationType), kept here so importing this module does not import gguf
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
#: Quantized types run as int4 matmuls, with their block bytes and the name used in messages.
RUNNABLE = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
DENSE = {F32, F16, BF16}
#: GGUF architectures whose Q/K rows llama.cpp's converter permutes (transformers' LlamaTensorProcessor).
PERMUTED_ARCHS = {"llama"}
#: The GGUF architectures this loader reads (the native model's Llama family).
ARCHS = {"llama", "mistral", "qwen2", "qwen3"}


class QuantError(ValueError):
    """Weights the engine cannot load or run quantized as asked."""


def type_name(t: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(t).name
    except (ImportError, ValueError):
        return f"type {t}"


# ===================================================================== reading a GGUF
@dataclass
class GGUFTensor:
    """One tensor of a GGUF file under its Hugging Face name, [out, in] order.

    ``data``: the raw blocks (uint8 [rows, bytes per row]) for a runnable
    quantized type (:data:`RUNNABLE`), else the float32 values (dense, or
    dequantized from ``type``)."""

    name: str
    type: int
    shape: Tuple[int, ...]
    data: torch.Tensor

    @property
    def quantized(self) -> bool:
        return self.type in RUNNABLE

    def dequantize(self) -> torch.Tensor:
        return dequantize_rows(self.data, self.type) if self.quantized else self.data


_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
#: Tensors the native model does not read (it computes RoPE frequencies from the config).
_IGNORED = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> Optional[str]:
    """The Hugging Face name of a llama-family GGUF tensor, or None (not mapped)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (``LlamaTensorProcessor._reverse_permute_weights``)
    on any [rows, ...] tensor: float rows or a quantized matrix's rows of blocks."""
    rows = t.shape[0]
    return t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def permute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's permutation (the inverse of :func:`unpermute_rows`; tests write GGUFs with it)."""
    rows = t.shape[0]
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def read_gguf_tensors(path: str | os.PathLike, config: dict) -> Tuple[str, Dict[str, GGUFTensor]]:
    """The GGUF's architecture and its tensors by Hugging Face name (see
    :class:`GGUFTensor`), Q/K rows un-permuted as transformers does.
    ``config``: the model's Hugging Face config (head counts)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else "?"
    if arch not in ARCHS:
        raise UnsupportedModel(f"{path}: GGUF architecture {arch!r} is not run quantized by the native engine "
                               f"(supported: {sorted(ARCHS)})")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    out: Dict[str, GGUFTensor] = {}
    dequantized: Dict[str, int] = {}
    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        name = hf_name(t.name)
        if name is None:
            raise UnsupportedModel(f"{path}: tensor {t.name!r} is not one the native engine knows")
        ttype = int(t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # ggml lists the input dimension first
        if ttype in RUNNABLE:
            data = torch.from_numpy(t.data.copy()).reshape(shape[0] if len(shape) > 1 else 1, -1)
            if len(shape) < 2:  # a 1-D quantized tensor (never seen in practice): dense
                data, ttype = dequantize_rows(data, ttype).reshape(shape), F32
        elif ttype in (F32, F16):
            data = torch.from_numpy(t.data.astype("float32")).reshape(shape)
        else:  # BF16 and the types without an int4 mapping
            data = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32")).reshape(shape)
            if ttype != BF16:
                dequantized[type_name(ttype)] = dequantized.get(type_name(ttype), 0) + 1
        if arch in PERMUTED_ARCHS and (".q_proj." in name or ".k_proj." in name):
            data = unpermute_rows(data, heads if ".q_proj." in name else kv_heads)
        out[name] = GGUFTensor(name, ttype, shape, data.contiguous())
    if dequantized:
        log.warning("%s: %s not run quantized by the native engine: dequantized to dense weights", path,
                    ", ".join(f"{n} ({c} tensors)" for n, c in sorted(dequantized.items())))
    return arch, out


# ===================================================================== blocks and int4 groups
def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte ``at`` of each block (``b`` [..., nb, block bytes]) as float32 [..., nb, 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit order: byte j holds element j (low nibble) and element j + 16 (high)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _blocks(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    size = RUNNABLE[qtype]
    if raw.shape[-1] % size:
        raise QuantError(f"{type_name(qtype)} rows of {raw.shape[-1]} bytes are not whole blocks")
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // size, size)


def dequantize_rows(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """Float32 values of raw Q4_0/Q4_1/Q8_0 rows ([..., bytes] -> [..., K]), as ggml computes them."""
    b = _blocks(raw, qtype)
    if qtype == Q4_0:
        w = _f16(b, 0) * (_nibbles(b[..., 2:18]).float() - 8)
    elif qtype == Q4_1:
        w = _f16(b, 0) * _nibbles(b[..., 4:20]).float() + _f16(b, 2)
    elif qtype == Q8_0:
        w = _f16(b, 0) * b[..., 2:34].contiguous().view(torch.int8).float()
    else:
        raise QuantError(f"no dequantizer for {type_name(qtype)}")
    return w.reshape(*raw.shape[:-1], -1)


@dataclass
class Int4Groups:
    """A matrix as aten's int4 groups: ``w[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]``.
    ``doubled``: the input dimension is stored twice (hi codes, then lo codes: Q8_0), so the
    activations are ``[x, x]``."""

    q: torch.Tensor       # uint8 [N, K or 2K], 0..15
    scale: torch.Tensor   # float32 [N, groups]
    zero: torch.Tensor    # float32 [N, groups]
    doubled: bool = False

    @property
    def in_features(self) -> int:
        return self.q.shape[1] // (2 if self.doubled else 1)

    def dense(self) -> torch.Tensor:
        w = dequantize_int4(self.q, self.scale, self.zero)
        if self.doubled:
            k = self.in_features
            w = w[:, :k] + w[:, k:]
        return w


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """aten's int4 dequantization (the formula its CPU kernel applies), in float32."""
    g = q.shape[1] // scale.shape[1]
    return ((q.float() - 8).view(q.shape[0], -1, g) * scale[..., None] + zero[..., None]).view(q.shape)


def int4_groups(raw: torch.Tensor, qtype: int, doubled: bool = False) -> Int4Groups:
    """Raw GGUF rows ([N, bytes]) as int4 groups (see the module's docstring for the mapping).
    ``doubled``: in the doubled layout even for a 4-bit type (to share a module with Q8_0 parts)."""
    b = _blocks(raw, qtype)
    n = raw.shape[0]
    d = _f16(b, 0)[..., 0]                                              # [N, nb]
    if qtype == Q8_0:
        v = b[..., 2:34].contiguous().view(torch.int8).to(torch.int16) + 128    # [N, nb, 32], 0..255
        hi, lo = (v >> 4).to(torch.uint8), (v & 15).to(torch.uint8)
        return Int4Groups(torch.cat([hi.reshape(n, -1), lo.reshape(n, -1)], 1),
                          torch.cat([16 * d, d], 1), torch.cat([torch.zeros_like(d), 8 * d], 1), True)
    if qtype == Q4_0:
        q, zero = _nibbles(b[..., 2:18]), torch.zeros_like(d)
    elif qtype == Q4_1:
        q, zero = _nibbles(b[..., 4:20]), _f16(b, 2)[..., 0] + 8 * d
    else:
        raise QuantError(f"{type_name(qtype)} has no int4 mapping")
    q = q.reshape(n, -1)
    if not doubled:
        return Int4Groups(q, d, zero)
    zeros = torch.zeros_like(d)
    return Int4Groups(torch.cat([torch.full_like(q, 8), q], 1), torch.cat([zeros, d], 1),
                      torch.cat([zeros, zero], 1), True)


def concat_groups(parts: Sequence[Int4Groups]) -> Int4Groups:
    """Stack the rows of fused parts (all in the same layout)."""
    if len(parts) == 1:
        return parts[0]
    if len({p.doubled for p in parts}) != 1 or len({p.q.shape[1] for p in parts}) != 1:
        raise QuantError("fused parts differ in layout or input size")
    return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.zero for p in parts]), parts[0].doubled)


def gguf_blocks(groups: Int4Groups) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The GGUF blocks behind int4 groups, as :mod:`.cpu_matmul` takes them: ``(codes, d, m)``
    with ``w[n, 32g + i] = codes[n, 32g + i] * d[n, g] + m[n, g]`` (``m`` None when all zero).

    4-bit groups give their codes (uint8 0..15) with ``d = scale`` and ``m = zero - 8 scale``.
    The doubled layout gives int8 codes: a Q8_0 block's ``16 hi + lo - 128`` (its hi group
    has scale ``16 d`` and zero 0, its lo group scale ``d`` and zero ``8 d``), a 4-bit part's
    ``lo - 8`` with its offset (hi group all zero)."""
    if not groups.doubled:
        return groups.q, groups.scale, groups.zero - 8 * groups.scale
    k, g = groups.in_features, groups.scale.shape[1] // 2
    hi, lo = groups.q[:, :k].to(torch.int16), groups.q[:, k:].to(torch.int16)
    s_hi, s_lo, z_hi, z_lo = groups.scale[:, :g], groups.scale[:, g:], groups.zero[:, :g], groups.zero[:, g:]
    q8 = (s_hi == 16 * s_lo) & (z_hi == 0) & (z_lo == 8 * s_lo)
    q4 = (s_hi == 0) & (z_hi == 0) & ~q8
    if not bool((q8 | q4).all()):
        raise QuantError("doubled int4 groups that are neither Q8_0 nor 4-bit blocks")
    wide = q8.repeat_interleave(GROUP, dim=1)
    codes = torch.where(wide, 16 * hi + lo - 128, lo - 8).to(torch.int8)
    m = torch.where(q8, torch.zeros_like(z_lo), z_lo)
    return codes.contiguous(), s_lo, (m if bool(m.any()) else None)


# ===================================================================== modules
KERNELS = ("auto", "gguf", "fp16", "aten")


def int4_kernel() -> str:
    """The kernel quantized GGUF matrices run with on this CPU.

    ``gguf``: the GGUF blocks through Interlace's own kernel
    (:mod:`.cpu_matmul`: 0.625 bytes per Q4 weight, integer multiply-adds on
    activations rounded to int16 per 32-group), the fastest path measured
    here at every number of rows, from batch-1 decode to prefill
    (docs/quantization.md).
    ``fp16``: the GGUF's values (dequantized exactly, then rounded to fp16:
    a relative error of at most 2^-11 per weight, far below the
    quantization's own) through fbgemm's fp16-weight GEMM
    (``quantized::linear_dynamic_fp16``: fp32 activations and accumulation,
    vectorized with AVX2 + F16C), 2 bytes per weight: the fallback where the
    gguf kernel cannot be built (no C++ compiler).
    ``aten``: ``_weight_int4pack_mm_for_cpu`` on the packed 4-bit codes,
    exact, but slow on every CPU measured (torch 2.13: 20x a float32 matmul
    at one row even with AVX-512; docs/quantization.md): for comparison only.
    The default: ``gguf`` where it builds, else ``fp16`` where fbgemm
    exists, else ``aten``.  ``INTERLACE_INT4_KERNEL`` forces one (``auto``:
    the default)."""
    forced = os.environ.get("INTERLACE_INT4_KERNEL")
    if forced:
        if forced not in KERNELS:
            raise QuantError(f"INTERLACE_INT4_KERNEL must be one of {list(KERNELS)}, got {forced!r}")
        if forced != "auto":
            return forced
    from . import cpu_matmul

    return "gguf" if cpu_matmul.load() is not None else "fp16" if _has_fbgemm() else "aten"


def _has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int4Linear(nn.Module):
    """``x @ W.T (+ bias)`` for a matrix given as int4 groups, by ``kernel``
    (:func:`int4_kernel`; default: this CPU's).

    The activations are float32 inside the kernel (the scales are the GGUF's
    fp16 values held exactly in float32); the output is returned in the
    input's dtype.  Holds no parameters, so the model's parameters are its
    dense ones (norms, a dense embedding).

    ``amx`` (:func:`.amx.amx_path`; default: this CPU's and ``INTERLACE_AMX``):
    where enabled, the module also holds its weights as a dense bfloat16 matrix
    (2 bytes per weight more) and matmuls of ``amx.min_rows`` rows or more run
    through it in bfloat16 (oneDNN, on AMX tiles), whatever ``kernel`` is;
    fewer rows take ``kernel``."""

    def __init__(self, groups: Int4Groups, bias: Optional[torch.Tensor] = None, kernel: Optional[str] = None,
                 amx: Optional[AmxPath] = None):
        super().__init__()
        n, kk = groups.q.shape
        if kk % GROUP:
            raise QuantError(f"input size {kk} is not a multiple of {GROUP}")
        if kernel is not None and kernel not in KERNELS:
            raise QuantError(f"unknown int4 kernel {kernel!r}")
        self.kernel = int4_kernel() if kernel in (None, "auto") else kernel
        self.in_features, self.out_features, self.doubled = groups.in_features, n, groups.doubled
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._fp16 = None
        # on an AMX CPU, matmuls of many rows run on a dense bfloat16 copy (.amx's docstring: its cost)
        self.amx = amx_path() if amx is None else amx
        self._bf16 = groups.dense().to(torch.bfloat16).contiguous() if self.amx.enabled else None
        if self.kernel == "gguf":
            from . import cpu_matmul

            self._ops = cpu_matmul.load()
            if self._ops is None:
                raise QuantError("the gguf kernel cannot be built here: no C++ compiler? "
                                 "(see the log)")
            codes, d, m = gguf_blocks(groups)
            self._four_bit = codes.dtype == torch.uint8
            self.register_buffer("blocks", cpu_matmul.pack(codes, d, torch.zeros_like(d) if m is None else m))
        if self.kernel == "fp16":
            # the values (a doubled layout's two halves summed) as one fp16 matrix
            self._fp16 = torch.ops.quantized.linear_prepack_fp16(groups.dense().contiguous(), None)
        if self.kernel != "aten":
            return
        q, scale, zero = groups.q, groups.scale.float(), groups.zero.float()
        pad = -n % 16  # aten packs rows in sixteens: padding rows of zero weights, cut from the output
        if pad:
            q = torch.cat([q, q.new_full((pad, kk), 8)])
            scale, zero = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, zero))
        self._rows = n + pad
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1))
        sz = torch.stack([scale, zero], dim=-1)                                   # [N, groups, 2]
        self.register_buffer("scale_zeros", sz.transpose(0, 1).contiguous())     # [groups, N, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply_rows(self, x, self._matmul)

    def _matmul(self, a: torch.Tensor) -> torch.Tensor:
        if self._bf16 is not None and self.amx.takes(a.shape[0]):
            return nn.functional.linear(a.to(torch.bfloat16), self._bf16).float()
        if self.kernel == "gguf":
            return (self._ops.q4_linear if self._four_bit else self._ops.q8_linear)(a, self.blocks, self.out_features)
        if self._fp16 is not None:
            return torch.ops.quantized.linear_dynamic_fp16(a, self._fp16)
        if self.doubled:
            a = torch.cat([a, a], dim=1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(a.contiguous(), self.packed, GROUP, self.scale_zeros)
        return y[:, :self.out_features] if self._rows != self.out_features else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"
                + (", doubled (Q8_0)" if self.doubled else "") + f", amx={self.amx.describe()}")


class Int8Linear(nn.Module):
    """``x @ W.T (+ bias)`` with W int8 per output channel (``torch._weight_int8pack_mm``),
    float32 activations and scales; the output in the input's dtype."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def dense(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply_rows(self, x, lambda a: torch._weight_int8pack_mm(a, self.qweight, self.scales))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, per-channel int8"


def _apply_rows(mod: nn.Module, x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``matmul`` (float32 rows in, [rows, out_features] out) over ``x``'s rows, plus the bias,
    in ``x``'s dtype and shape: what every quantized linear does around its kernel."""
    shape = x.shape
    a = x.reshape(-1, mod.in_features).float().contiguous()
    y = matmul(a) if a.shape[0] else a.new_zeros(0, mod.out_features)
    if mod.bias is not None:
        y = y + mod.bias
    return y.to(x.dtype).reshape(*shape[:-1], mod.out_features)


class QuantEmbedding(nn.Module):
    """An embedding lookup from raw GGUF rows: the looked-up rows are dequantized
    (to ``dtype``) at each call."""

    def __init__(self, raw: torch.Tensor, qtype: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.qtype, self.dim, self.dtype = qtype, dim, dtype
        self.register_buffer("raw", raw.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw.index_select(0, ids.reshape(-1))
        return dequantize_rows(rows, self.qtype).to(self.dtype).reshape(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"{self.raw.shape[0]}, {self.dim}, {type_name(self.qtype)}"


# ===================================================================== building models
def _set_module(model: nn.Module, target: nn.Module, new: nn.Module) -> None:
    for name, mod in model.named_modules():
        if mod is target:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
            return
    raise KeyError("module not in the model")


def _quantized_linear(parts: Sequence[GGUFTensor], bias: Optional[torch.Tensor]) -> Optional[Int4Linear]:
    """The Int4Linear of a (fused) projection's GGUF parts, or None when a part must be dense."""
    if not all(p.quantized for p in parts):
        return None
    doubled = any(p.type == Q8_0 for p in parts)
    return Int4Linear(concat_groups([int4_groups(p.data, p.type, doubled) for p in parts]), bias)


def model_from_gguf(path: str | os.PathLike, config: dict, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """The native model of a GGUF file with its quantized tensors as shipped
    (see the module's docstring); ``config`` its Hugging Face config, ``dtype``
    the compute dtype (dense weights, activations)."""
    if torch.device(device).type != "cpu":
        raise QuantError(f"quantized weights run on the CPU only (aten's int4 CPU kernel), not on {device}")
    cfg = ModelConfig.from_hf(config)
    arch, tensors = read_gguf_tensors(path, config)
    with torch.device("meta"):  # modules are materialized one by one: quantized ones never hold float weights
        model = LlamaForCausalLM(cfg)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    used = set()

    def take(name: str) -> GGUFTensor:
        if name not in tensors:
            raise UnsupportedModel(f"{path}: the GGUF lacks the tensor for {name!r}")
        used.add(name)
        return tensors[name]

    types: Dict[str, int] = {}
    with torch.no_grad():
        for mod, names in model.hf_weight_map():
            parts = [take(n) for n in names]
            for p in parts:
                types[type_name(p.type)] = types.get(type_name(p.type), 0) + 1
            bias = None
            if getattr(mod, "bias", None) is not None:
                bias = torch.cat([take(n.replace(".weight", ".bias")).dequantize() for n in names])
            if mod is model.embed:
                (p,) = parts
                if p.quantized:
                    if p.shape != tuple(mod.weight.shape):
                        raise UnsupportedModel(f"{path}: {names[0]} has shape {p.shape}, the model expects "
                                               f"{tuple(mod.weight.shape)}")
                    model.embed = QuantEmbedding(p.data, p.type, cfg.hidden_size, dtype)
                    if cfg.tie_word_embeddings:  # the head: the same blocks, packed for the int4 matmul
                        model.lm_head = _quantized_linear(parts, None)
                    continue
            elif isinstance(mod, nn.Linear):
                q = _quantized_linear(parts, bias)
                if q is not None:
                    if (q.out_features, q.in_features) != (mod.out_features, mod.in_features):
                        raise UnsupportedModel(f"{path}: {names[0]}: a projection of {q.in_features} -> "
                                               f"{q.out_features}, the model expects {mod.in_features} -> "
                                               f"{mod.out_features}")
                    _set_module(model, mod, q)
                    continue
            w = torch.cat([p.dequantize() for p in parts]) if len(parts) > 1 else parts[0].dequantize()
            if tuple(w.shape) != tuple(mod.weight.shape):
                raise UnsupportedModel(f"{path}: {names[0]} has shape {tuple(w.shape)}, the model expects "
                                       f"{tuple(mod.weight.shape)}")
            mod.to_empty(device=device).to(dtype)
            mod.weight.copy_(w)
            if bias is not None:
                mod.bias.copy_(bias)
        if cfg.tie_word_embeddings and isinstance(model.embed, nn.Embedding):
            model.lm_head.weight = model.embed.weight  # a dense tied head, as the float loader ties it
    extra = set(tensors) - used - {"lm_head.weight"}
    if extra:
        raise UnsupportedModel(f"{path}: GGUF tensors this model does not use: {sorted(extra)[:5]}")
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise UnsupportedModel(f"{path}: no weights for {left[:5]}")
    model.weights_format = "as-shipped"
    model.weight_types = types
    log.info("%s: weights as shipped (%s)", path, ", ".join(f"{k}: {v}" for k, v in sorted(types.items())))
    amx = next((m.amx for m in model.modules() if isinstance(m, Int4Linear)), None)
    if amx is not None:
        log.info("%s: quantized matmuls: %s", path, amx.describe())
    return model.eval()


def weight_bytes(model: nn.Module) -> int:
    """The bytes the model's weights take: parameters (a tied one once), buffers, and the
    prepacked fp16 and the AMX path's bfloat16 matrices of :class:`Int4Linear` (2 bytes per weight each)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(m, Int4Linear):
            total += 2 * m.in_features * m.out_features * ((m._fp16 is not None) + (m._bf16 is not None))
    return total


def linear_modules(model: LlamaForCausalLM) -> List[nn.Module]:
    """The weight-matmul modules: every layer's q/k/v, o, gate/up, down, and the head."""
    out: List[nn.Module] = []
    for layer in model.layers:
        out += [layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down]
    return out + [model.lm_head]


def quantize_int8(model: LlamaForCausalLM, dtype: torch.dtype) -> LlamaForCausalLM:
    """Replace ``model``'s (float32) weight matmuls by per-output-channel int8
    ones and convert the rest (embedding, norms) to the compute ``dtype``.
    A tied head gets its own int8 copy; the embedding stays dense."""
    if next(model.parameters()).device.type != "cpu":
        raise QuantError("int8 weights run on the CPU only (aten's int8 CPU kernel)")
    with torch.no_grad():
        for mod in linear_modules(model):
            _set_module(model, mod, Int8Linear(mod.weight, getattr(mod, "bias", None)))
        for p in model.parameters():
            p.data = p.data.to(dtype)
    model.weights_format = "int8"
    return model.eval()


# ===================================================================== a GGUF's config and tokenizer
def gguf_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    return hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_file(model_path: str | os.PathLike) -> Path:
    """The GGUF file of ``model_path`` (a .gguf file, or a directory holding exactly one and no
    config.json); a clear error for anything else."""
    from .loader import ModelNotFound

    p = Path(model_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(p.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    if not p.exists():
        raise ModelNotFound(f"model path {str(model_path)!r} does not exist")
    raise QuantError(f"weights: as-shipped runs a GGUF file's quantized tensors, and {str(model_path)!r} is not "
                     f"a .gguf file (for quantized weights from a float model use weights: int8)")


def gguf_meta_dir(gguf_path: Path) -> Path:
    """A cached directory with the GGUF's config.json and tokenizer (when it
    has one), read from its metadata by transformers, without its weights."""
    from .loader import cache_root

    out = cache_root() / "models" / f"{gguf_path.stem}-{gguf_key(gguf_path)}.meta"
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".meta-"))
    try:
        if _has_tokenizer(gguf_path):
            AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        try:
            os.replace(tmp, out)
        except OSError:  # another process made it first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _has_tokenizer(gguf_path: Path) -> bool:
    from gguf import GGUFReader

    return "tokenizer.ggml.model" in GGUFReader(str(gguf_path)).fields


__all__ = ["QuantError", "GGUFTensor", "read_gguf_tensors", "dequantize_rows", "int4_groups",
           "Int4Groups", "Int4Linear", "Int8Linear", "QuantEmbedding", "model_from_gguf", "quantize_int8",
           "gguf_file", "gguf_meta_dir", "permute_rows", "unpermute_rows", "hf_name", "linear_modules", "weight_bytes",
           "int4_kernel", "gguf_blocks"]
