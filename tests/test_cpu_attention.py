"""The compiled CPU decode-attention kernel (engine_ext/native/cpu_attention.py)
against a plain softmax reference, and the engine with it against the torch path."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from interlace.engine_ext.native import cpu_attention

# every test but the no-compiler fallback needs the kernel built (a C++ compiler); CI has one
needs_kernel = pytest.mark.skipif(cpu_attention.load() is None, reason="no C++ compiler to build the kernel")


def paged(lens, hkv, d, bs, num_blocks, seed, share_prefix=0):
    """A cache with ragged contexts whose blocks are scattered; with ``share_prefix`` blocks, every
    context starts with the same first blocks (forks of one parent)."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(hkv, num_blocks, bs, d, generator=g)
    vc = torch.randn(hkv, num_blocks, bs, d, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    shared = [free.pop() for _ in range(share_prefix)]
    tables, starts = [], []
    for n in lens:
        starts.append(len(tables))
        need = -(-n // bs)
        own = shared[:need] + [free.pop() for _ in range(max(0, need - len(shared)))]
        tables += own
    return kc, vc, tables, starts


def reference(q, kc, vc, tables, starts, lens, bs, scale, window=0):
    B, H, D = q.shape
    hkv = kc.shape[0]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b, n in enumerate(lens):
        blocks = tables[starts[b]:starts[b] + -(-n // bs)]
        k = kc[:, blocks].reshape(hkv, -1, D)[:, :n].double().repeat_interleave(H // hkv, 0)
        v = vc[:, blocks].reshape(hkv, -1, D)[:, :n].double().repeat_interleave(H // hkv, 0)
        s = torch.einsum("hd,hld->hl", q[b].double(), k) * scale
        if window and n > window:
            s[:, : n - window] = float("-inf")
        out[b] = torch.einsum("hl,hld->hd", s.softmax(-1), v)
    return out


@needs_kernel
@pytest.mark.parametrize("hkv, group, d", [(1, 1, 16), (3, 3, 64), (2, 4, 32), (4, 1, 128)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference_on_ragged_contexts(hkv, group, d, kv_dtype):
    kernel = cpu_attention.load()
    bs = 16
    lens = [1, 15, 16, 17, 32, 33, 100, 250]  # inside, at and past block boundaries
    kc, vc, tables, starts = paged(lens, hkv, d, bs, 64, seed=hkv * 10 + d)
    q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(1))
    scale = d ** -0.5
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    got = kernel(q, kc, vc, torch.tensor(tables), torch.tensor(starts), torch.tensor(lens), scale)
    want = reference(q, kc.float(), vc.float(), tables, starts, lens, bs, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert (got.double() - want).abs().max() < 1e-5  # float32 accumulation over <= 250 keys


@needs_kernel
def test_kernel_forks_sharing_blocks_and_sliding_window():
    kernel = cpu_attention.load()
    bs, hkv, d = 8, 2, 32
    lens = [40, 41, 47, 48, 60]
    kc, vc, tables, starts = paged(lens, hkv, d, bs, 48, seed=3, share_prefix=5)
    assert len(set(tables)) < len(tables)  # the forks really share their prefix blocks
    q = torch.randn(len(lens), hkv * 2, d, generator=torch.Generator().manual_seed(2))
    for window in (0, 10, 45):
        got = kernel(q, kc, vc, torch.tensor(tables), torch.tensor(starts), torch.tensor(lens), 0.2, window)
        want = reference(q, kc, vc, tables, starts, lens, bs, 0.2, window)
        assert (got.double() - want).abs().max() < 1e-5, window


@needs_kernel
def test_kernel_splits_work_over_threads_identically(monkeypatch):
    kernel = cpu_attention.load()
    lens = [5 + 7 * i for i in range(13)]
    kc, vc, tables, starts = paged(lens, 3, 64, 16, 64, seed=5)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(3))
    args = (q, kc, vc, torch.tensor(tables), torch.tensor(starts), torch.tensor(lens), 0.125)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(*args)
        torch.set_num_threads(3)
        small = kernel(*args)  # 611 keys x 9 heads x 64: below PARALLEL_MIN_WORK, in this thread
        monkeypatch.setattr(cpu_attention, "PARALLEL_MIN_WORK", 0)
        three = kernel(*args)  # the 39 (context, head) items split over three threads
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, three) and torch.equal(one, small)  # each (context, head): one thread, the same way


@needs_kernel
def test_kernel_rejects_what_it_cannot_compute():
    kernel = cpu_attention.load()
    kc, vc, tables, starts = paged([5, 9], 2, 64, 4, 16, seed=1)
    q = torch.randn(2, 4, 64)
    args = [torch.tensor(tables), torch.tensor(starts), torch.tensor([5, 9])]
    with pytest.raises(RuntimeError, match="float32"):
        kernel(q.double(), kc, vc, *args, 0.125)
    with pytest.raises(RuntimeError, match="alike"):
        kernel(q, kc, vc.bfloat16(), *args, 0.125)
    with pytest.raises(RuntimeError, match="head shape"):
        kernel(torch.randn(2, 3, 64), kc, vc, *args, 0.125)  # 3 query heads over 2 KV heads
    with pytest.raises(RuntimeError, match="one per context"):
        kernel(q, kc, vc, args[0], args[1], torch.tensor([5]), 0.125)


@needs_kernel
def test_engine_with_the_kernel_generates_what_the_torch_path_does(smol_dir):
    """Greedy tokens of the embedded model, ragged prompts decoding together and a fork of one of
    them, with the kernel and with the torch path (both float32)."""
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.protocol import SamplingParams

    prompts = [[1, 28, 1126, 314, 253, 2092, 30] * k for k in (1, 3, 5, 9)]

    async def run(engine):
        sp = SamplingParams(max_tokens=24, ignore_eos=True)
        await asyncio.gather(*(engine.fill(f"c{i}", p) for i, p in enumerate(prompts)))
        await engine.fill("fork", [2092, 30], parent_context_id="c2")

        async def tokens(cid):
            return [ev.token_id async for ev in engine.generate(cid, sp) if ev.token_id is not None]

        return await asyncio.gather(*(tokens(c) for c in ("c0", "c1", "c2", "c3", "fork")))

    got = {}
    for attention in ("torch", "kernel"):
        with NativeEngine.load(smol_dir, kv_cache_tokens=4096, attention=attention) as eng:
            assert eng.runner.attention.name == attention
            got[attention] = asyncio.run(run(eng))
    assert got["kernel"] == got["torch"]


def test_without_a_compiler_auto_falls_back_and_kernel_is_an_error(tmp_path, monkeypatch, caplog):
    from interlace.engine_ext.native.attention import choose_backend

    monkeypatch.setenv("CXX", "/no/such/compiler")
    monkeypatch.setattr(cpu_attention, "_loaded", {})
    monkeypatch.setattr(cpu_attention, "FLAGS", (*cpu_attention.FLAGS, "-DFRESH"))  # not the cached build
    monkeypatch.setattr("interlace.engine_ext.native.loader.cache_root", lambda: tmp_path)
    with caplog.at_level(logging.WARNING):
        assert choose_backend("auto", torch.device("cpu")).name == "torch"
    assert "not available" in caplog.text
    with pytest.raises(ValueError, match="cannot be built"):
        choose_backend("kernel", torch.device("cpu"))
    with pytest.raises(ValueError, match="'auto', 'kernel', 'triton' or 'torch'"):
        choose_backend("fast", torch.device("cpu"))
    assert choose_backend("torch", torch.device("cpu")).name == "torch"
