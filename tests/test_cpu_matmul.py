"""The GGUF-block matmul kernel and the fused decode ops (engine_ext/native/cpu_matmul.py).

Tolerance of the quantized matmuls.  The kernel computes ``x @ W.T`` for the
exact weights ``W`` the tiles hold (:func:`cpu_matmul.dequantize`), except that
each activation row is rounded per 32-group to ``dx * round(x / dx)`` with
``dx = max|x_group| / 32767``: every activation moves by at most ``dx / 2``, so
the result moves by at most ``sum_g dx_g / 2 * sum_{i in g} |w_i|``, plus
float32 arithmetic (1e-5 of ``sum |x_i w_i|``).  A misplaced nibble, a swapped
scale or a wrong offset moves it by a sizeable part of ``sum |x_i w_i|``."""

from __future__ import annotations

import logging

import pytest
import torch

from interlace.engine_ext.native import cpu_matmul

# every test but the no-compiler fallback needs the kernel built (a C++ compiler); CI has one
needs_kernel = pytest.mark.skipif(cpu_matmul.load() is None, reason="no C++ compiler to build the kernel")


def blocks(n: int, k: int, four_bit: bool, seed: int, offsets: bool = True):
    g = torch.Generator().manual_seed(seed)
    if four_bit:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    m = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.1).half().float() if offsets else torch.zeros(n, k // 32)
    return codes, d, m


def reference(codes, d, m):
    n, k = codes.shape
    return (codes.float().view(n, k // 32, 32) * d[..., None] + m[..., None]).view(n, k)


def bound(x: torch.Tensor, w: torch.Tensor):
    """``x @ w.T`` in float64 and the tolerance of the module docstring."""
    x64, w64 = x.double(), w.double()
    step = x64.abs().view(x.shape[0], -1, 32).amax(-1) / 32767 / 2                    # [M, G]
    tol = step.repeat_interleave(32, dim=1) @ w64.abs().T + 1e-5 * (x64.abs() @ w64.abs().T) + 1e-7
    return x64 @ w64.T, tol


@pytest.mark.parametrize("four_bit", [True, False], ids=["q4", "q8"])
@pytest.mark.parametrize("n, k", [(13, 32), (8, 96), (40, 576)])
def test_pack_holds_exactly_the_weights(four_bit, n, k):
    codes, d, m = blocks(n, k, four_bit, seed=n + k)
    tiles = cpu_matmul.pack(codes, d, m)
    assert tiles.shape == (-(-n // 16), k // 32 * (64 + 16 * (16 if four_bit else 32)))
    assert torch.equal(cpu_matmul.dequantize(tiles, four_bit, n, k), reference(codes, d, m))


def test_pack_rejects_what_the_kernel_cannot_hold():
    codes, d, m = blocks(8, 64, True, seed=1)
    with pytest.raises(ValueError, match="not fp16 values"):
        cpu_matmul.pack(codes, d * 1.0001, m)  # the kernel would compute with other weights
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_matmul.pack(codes[:, :48], d[:, :1], m[:, :1])
    with pytest.raises(ValueError, match="uint8 .* or int8"):
        cpu_matmul.pack(codes.int(), d, m)


@needs_kernel
@pytest.mark.parametrize("four_bit", [True, False], ids=["q4", "q8"])
# rows: one register block (8 with AVX-512, 4 with AVX2) and less, more, several with a remainder
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 19])
@pytest.mark.parametrize("n, k", [(13, 64), (48, 576)])
def test_kernel_matches_the_weights_within_the_activation_rounding(four_bit, rows, n, k):
    ops = cpu_matmul.load()
    codes, d, m = blocks(n, k, four_bit, seed=3, offsets=four_bit)
    tiles = cpu_matmul.pack(codes, d, m)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] *= 20  # one group far larger than the rest: its own scale
    y = (ops.q4_linear if four_bit else ops.q8_linear)(x, tiles, n)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    ref, tol = bound(x, reference(codes, d, m))
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"worst error/tolerance {(err / tol).max().item():.2f}"
    assert err.max() > 0  # the activations are rounded (not a float path in disguise)


@needs_kernel
def test_kernel_threads_and_empty_inputs():
    ops = cpu_matmul.load()
    codes, d, m = blocks(1000, 128, True, seed=4)
    tiles = cpu_matmul.pack(codes, d, m)
    x = torch.randn(3, 128)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.q4_linear(x, tiles, 1000)
        torch.set_num_threads(2)
        two = ops.q4_linear(x, tiles, 1000)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)  # each output is one thread's, computed the same way
    assert ops.q4_linear(torch.zeros(0, 128), tiles, 1000).shape == (0, 1000)
    with pytest.raises(RuntimeError, match="tiles"):
        ops.q4_linear(torch.randn(1, 96), tiles, 1000)  # another input size
    with pytest.raises(RuntimeError, match="float32"):
        ops.q4_linear(x.double(), tiles, 1000)


@needs_kernel
def test_fused_norms_and_silu_match_torch():
    ops = cpu_matmul.load()
    g = torch.Generator().manual_seed(5)
    x, delta, w = torch.randn(7, 96, generator=g), torch.randn(7, 96, generator=g), torch.randn(96, generator=g)

    def rms(v):
        return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5))

    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), rms(x), rtol=1e-5, atol=1e-6)
    res = x.clone()
    normed = ops.add_rms_norm_(res, delta, w, 1e-5)
    torch.testing.assert_close(res, x + delta, rtol=0, atol=0)  # the residual stream, updated in place
    torch.testing.assert_close(normed, rms(x + delta), rtol=1e-5, atol=1e-6)
    gu = torch.randn(4, 2 * 48, generator=g)
    torch.testing.assert_close(ops.silu_mul(gu), torch.nn.functional.silu(gu[:, :48]) * gu[:, 48:],
                               rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_and_cache_write_match_the_model(cache_dtype):
    from interlace.engine_ext.native.models.llama import rotate

    ops = cpu_matmul.load()
    H, Hkv, D, T, blocks_, bs = 6, 2, 16, 5, 7, 4
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    pos = torch.tensor([0, 3, 4, 9, 17]).float()
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()
    kc = torch.zeros(Hkv, blocks_, bs, D, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([27, 1, 14, 8, 22])
    q = ops.rope_store(qkv, cos, sin, H, Hkv, kc, vc, slots)
    rq, rk, rv = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    torch.testing.assert_close(q, rotate(rq.view(T, H, D), cos[:, None], sin[:, None]), rtol=1e-6, atol=1e-6)
    k_ref = rotate(rk.view(T, Hkv, D), cos[:, None], sin[:, None]).to(cache_dtype)
    for t, s in enumerate(slots.tolist()):
        torch.testing.assert_close(kc.view(Hkv, -1, D)[:, s], k_ref[t], rtol=0, atol=1e-6)
        torch.testing.assert_close(vc.view(Hkv, -1, D)[:, s], rv.view(T, Hkv, D)[t].to(cache_dtype), rtol=0, atol=0)
    untouched = torch.ones(blocks_ * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (kc.view(Hkv, -1, D)[:, untouched] == 0).all()  # nothing else written
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_store(qkv, cos, sin, H, Hkv, kc, vc, torch.tensor([0, 1, 2, 3, blocks_ * bs]))


def test_without_a_compiler_quantized_weights_take_the_fp16_path(tmp_path, monkeypatch, caplog):
    from interlace.engine_ext.native import quant

    monkeypatch.setenv("CXX", "/no/such/compiler")
    monkeypatch.setattr(cpu_matmul, "_loaded", {})
    monkeypatch.setattr("interlace.engine_ext.native.loader.cache_root", lambda: tmp_path)  # not the cached build
    monkeypatch.delenv("INTERLACE_INT4_KERNEL", raising=False)
    with caplog.at_level(logging.WARNING):
        assert cpu_matmul.load() is None
        assert quant.int4_kernel() == ("fp16" if quant._has_fbgemm() else "aten")
        groups = quant.Int4Groups(torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1))
        with pytest.raises(ValueError, match="cannot be built"):
            quant.Int4Linear(groups, kernel="gguf")
        assert quant.Int4Linear(groups, kernel="auto").kernel == quant.int4_kernel()
    assert "not available" in caplog.text
