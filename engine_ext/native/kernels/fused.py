"""The decoder layer's small ops fused, as Triton kernels: the GPU twin of :mod:`..cpu_matmul`'s fused ops.

What: four ops with the interface of the CPU ones, so that
``LlamaForCausalLM._fused_forward`` (``models/llama.py``) runs either set
unchanged (:func:`~..model_runner._fused_ops` picks one):

* ``rms_norm(x, w, eps)`` -- RMSNorm of ``x`` [T, N], one kernel;
* ``add_rms_norm_(x, y, w, eps)`` -- the residual add in place (``x += y``)
  and the next RMSNorm of the new ``x``, one kernel;
* ``silu_mul(gate_up)`` -- ``silu(gate) * up`` of the fused gate/up
  projection [T, 2I] -> [T, I], one kernel;
* ``rope_store(qkv, cos, sin, h, hkv, k_cache, v_cache, slot_mapping)`` --
  from the fused q/k/v projection [T, (h + 2 hkv) D]: the rotary embedding
  of q and k (rotate-half, as ``models/llama.py``'s ``rotate``), k and v
  written into the paged cache (``[Hkv, num_blocks, block_size, D]``, as
  :func:`~.paged_attention.store_kv`; a slot of -1 writes nothing: the padded
  rows of a CUDA graph), q [T, h, D] returned; one kernel.

Why: in eager PyTorch each of these is several kernels.  Counted per decoder
layer of a bfloat16 decode step (the aten ops dispatched, views aside: on a GPU
one kernel each; float32 drops the 4 casts), the unfused path launches

* RMSNorm, twice: ``float()``, ``pow``, ``mean``, ``+ eps``, ``rsqrt``, ``mul``,
  ``to(dtype)``, ``* weight`` -- 8 each, 16;
* the rotary embedding of q and of k: ``x * cos``, ``neg`` and ``cat`` (rotate-half),
  ``* sin``, ``add`` -- 5 each, 10; then the KV store: ``contiguous()`` of the
  split v and ``store_kv``, 2;
* the two residual adds, 2; ``silu`` and ``* up``, 2;

32 small kernels beside the 4 matmuls and the attention's few (about 40 in
all, as the review of issue 36 counted); fused, those 32 become 4
(``add_rms_norm_`` twice, ``rope_store``, ``silu_mul``).  Per step the final
norm (8) becomes the last layer's second ``add_rms_norm_``, and one
``rms_norm`` before the first layer is added.  The win is launches and the
memory round trips of the intermediates, which is what a small-batch decode
step is made of (and what a CUDA graph replays: fewer, larger nodes).

Decisions:

* Arithmetic in float32 whatever the dtype; results are rounded where the
  eager module rounds them, so the fused path follows the unfused one closely
  in bfloat16/float16 too: the residual sum is rounded to ``x``'s dtype before
  its norm is taken (the norm of the stored stream, as the next layer sees
  it); RMSNorm rounds ``x * rstd`` to the dtype before the weight multiplies
  it (as ``RMSNorm.forward`` and Hugging Face's ``LlamaRMSNorm``); SiLU is
  rounded before ``* up`` (as ``F.silu(gate) * up``).  The rotary embedding
  alone is computed in float32 and rounded once (the eager path rounds each
  of its products in bf16): q and k differ by at most an ulp of the dtype.
* One program per row for the norms: the whole row (the hidden size,
  thousands) sits in registers, one read of ``x`` and ``y``, one write of
  each output.  ``silu_mul`` tiles the row (intermediate sizes reach tens of
  thousands).  ``rope_store`` runs one program per (row, head): q heads write
  q; a KV head rotates k and copies v into the cache.
* CUDA-graph capture-safe: the launchers read only shapes and strides on the
  host, allocate by shape only (the outputs), and never read device data; the
  slot test (-1) happens in the kernel.  Slots may be int64 (the model runner)
  or int32 (:mod:`..cuda_graphs`' static buffer).
* Only ``triton.language`` features of Triton 3.x (3.6 compiles them on the
  GPU machines): loads and stores with masks, ``tl.sum``, ``tl.sqrt``,
  ``tl.exp``, ``tl.where``, casts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: elements of a ``silu_mul`` row per program
SILU_BLOCK = 1024


def _warps(block: int) -> int:
    """Warps for a program over ``block`` elements: about 8 elements per thread, 1 to 16 warps."""
    return max(1, min(16, block // 256))


# ------------------------------------------------------------------------------------------------------- RMSNorm

@triton.jit
def _rms_norm_kernel(x_ptr, y_ptr, w_ptr, out_ptr, stride_x, stride_y, stride_o, N, eps,
                     BLOCK_N: tl.constexpr, ADD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    xp = x_ptr + t * stride_x + offs
    x = tl.load(xp, mask=mask, other=0.0)
    if ADD:  # the residual stream: x += y, rounded to x's dtype and stored, its norm taken from what is stored
        x = (x.to(tl.float32) + tl.load(y_ptr + t * stride_y + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(xp, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as RMSNorm.normed rounds it
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(x: torch.Tensor, w: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x: [T, N], rows contiguous"
    assert w.shape == (x.shape[1],) and w.stride(0) == 1, "w: [N]"


def _norm(x: torch.Tensor, y, w: torch.Tensor, eps: float) -> torch.Tensor:
    _check_rows(x, w)
    T, N = x.shape
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block = triton.next_power_of_2(N)
    _rms_norm_kernel[(T,)](x, x if y is None else y, w, out, x.stride(0), 0 if y is None else y.stride(0),
                           out.stride(0), N, float(eps), BLOCK_N=block, ADD=y is not None,
                           num_warps=_warps(block))
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` per row of ``x`` [T, N]; float32 math, output in ``x``'s dtype."""
    return _norm(x, None, w, eps)


def add_rms_norm_(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += y`` in place (the residual stream), then :func:`rms_norm` of the new ``x``; one kernel."""
    assert y.shape == x.shape and y.stride(1) == 1, "y like x"
    return _norm(x, y, w, eps)


# ------------------------------------------------------------------------------------------------------ SiLU * up

@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, I, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu's rounding
    tl.store(out_ptr + t * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` [T, 2I]; returns [T, I] in its dtype."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0, "gate_up: [T, 2I]"
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(I))
    _silu_mul_kernel[(T, triton.cdiv(I, block))](gate_up, out, gate_up.stride(0), out.stride(0), I,
                                                 BLOCK=block, num_warps=_warps(block))
    return out


# ----------------------------------------------------------------------------------------- RoPE + the KV store

@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
                       stride_qkv, stride_cos, stride_sin, stride_qt, stride_qh,
                       stride_kch, stride_kcb, stride_kct, stride_vch, stride_vcb, stride_vct,
                       H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF_BLOCK: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)           # < H: a query head; else KV head head - H (its k and its v)
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < HALF
    row = qkv_ptr + t * stride_qkv + head * D   # q heads, then k heads: head h's columns are h * D
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_sin + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1 - x2 * s1            # x * cos + cat(-x2, x1) * sin
    o2 = x2 * c2 + x1 * s2
    if head < H:
        qp = q_ptr + t * stride_qt + head * stride_qh
        tl.store(qp + offs, o1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(qp + HALF + offs, o2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:   # -1: a padded row, nothing to store
            kvh = (head - H).to(tl.int64)
            blk = slot // BLOCK_SIZE
            tok = slot % BLOCK_SIZE
            kp = kc_ptr + kvh * stride_kch + blk * stride_kcb + tok * stride_kct
            tl.store(kp + offs, o1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kp + HALF + offs, o2.to(kc_ptr.dtype.element_ty), mask=mask)
            vrow = row + HKV * D      # this KV head's v: hkv heads further along the row
            vp = vc_ptr + kvh * stride_vch + blk * stride_vcb + tok * stride_vct
            v1 = tl.load(vrow + offs, mask=mask, other=0.0)
            v2 = tl.load(vrow + HALF + offs, mask=mask, other=0.0)
            tl.store(vp + offs, v1.to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vp + HALF + offs, v2.to(vc_ptr.dtype.element_ty), mask=mask)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, h: int, hkv: int,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of q and k of ``qkv`` [T, (h + 2 hkv) D] (``cos``, ``sin`` [T, D]),
    k and v written into the caches [hkv, num_blocks, block_size, D] at ``slot_mapping`` [T]
    (int64 or int32; -1 writes nothing), cast to the cache dtype; returns q [T, h, D] in qkv's dtype."""
    T = qkv.shape[0]
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[0] == hkv, \
        "caches are [Hkv, num_blocks, block_size, D]"
    d = k_cache.shape[3]
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head dim of the cache must be contiguous"
    assert qkv.dim() == 2 and qkv.shape[1] == (h + 2 * hkv) * d and qkv.stride(1) == 1 and d % 2 == 0, \
        "qkv: [T, (h + 2 hkv) D], rows contiguous"
    assert cos.shape == sin.shape == (T, d) and cos.stride(1) == 1 and sin.stride(1) == 1, "cos, sin: [T, D]"
    assert slot_mapping.shape == (T,), "slot_mapping: [T]"
    q = torch.empty((T, h, d), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    half = triton.next_power_of_2(d // 2)
    _rope_store_kernel[(T, h + hkv)](
        qkv, cos, sin, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=h, HKV=hkv, D=d, HALF_BLOCK=half, BLOCK_SIZE=k_cache.shape[2], num_warps=1 if half <= 64 else 2)
    return q
