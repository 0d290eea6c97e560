"""The Triton kernels of engine_ext/native/kernels against their plain-PyTorch references.

Without CUDA the kernels run under Triton's interpreter (the package sets
TRITON_INTERPRET=1 on import, before any kernel is decorated).  Every cache
is built so that a wrong read shows: each context's blocks are scattered at
random, table entries past a context point at a block full of NaN, and the
slots past a context's last key hold NaN too -- a kernel that reads one of
them (even if it masks the score afterwards) produces NaN.

Tolerances (max abs error on outputs of magnitude ~1): float32 KV 1e-4;
float16 KV 5e-3 (queries and probabilities go through float16 dots);
bfloat16 KV 2e-2 (bfloat16 dots on a GPU; under the interpreter the tiles are
upcast, which Triton 3.9 needs there).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from interlace.engine_ext.native import kernels  # noqa: E402  (sets TRITON_INTERPRET without CUDA)
from interlace.engine_ext.native.kernels import reference as ref  # noqa: E402
from interlace.engine_ext.native.kernels.cascade import (cascade_decode, cascade_decode_attention,  # noqa: E402
                                                         find_shared_prefixes, plan_cascade)
from interlace.engine_ext.native.kernels.paged_attention import (merge_attention,  # noqa: E402
                                                                 paged_decode_attention, store_kv)
from interlace.engine_ext.native.kernels.prefill_attention import paged_prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


class Cache:
    """A paged cache of random K/V; the last block is the NaN poison block."""

    def __init__(self, hkv: int, d: int, bs: int, num_blocks: int, dtype: torch.dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.bs, self.poison = bs, num_blocks - 1
        self.k = torch.randn(hkv, num_blocks, bs, d, generator=g).to(dtype)
        self.v = torch.randn(hkv, num_blocks, bs, d, generator=g).to(dtype)
        self.k[:, self.poison] = float("nan")
        self.v[:, self.poison] = float("nan")
        self.free = torch.randperm(num_blocks - 1, generator=g).tolist()

    def alloc(self, n: int, shared: list[int] = ()) -> list[int]:
        """Blocks for ``n`` keys starting with ``shared``; the unused tail of the last block is NaN."""
        blocks = list(shared) + [self.free.pop() for _ in range(max(0, -(-n // self.bs) - len(shared)))]
        if n % self.bs and len(blocks) > len(shared):
            self.k[:, blocks[-1], n % self.bs:] = float("nan")
            self.v[:, blocks[-1], n % self.bs:] = float("nan")
        return blocks

    def table(self, rows: list[list[int]], width: int = 0) -> torch.Tensor:
        """Block tables padded with the poison block, int32."""
        width = max(width, 1, *(len(r) for r in rows))
        return torch.tensor([r + [self.poison] * (width - len(r)) for r in rows], dtype=torch.int32)

    def to(self, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V for the kernels (the references read ``self.k``, ``self.v``)."""
        return self.k.clone().to(device), self.v.clone().to(device)


def i32(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device=DEVICE)


def close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.float().cpu()
    assert not out.isnan().any(), "NaN in the output: the kernel read a masked slot"
    err = (out - expected).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err} > {TOL[dtype]}"


def decode_batch(hkv, d, bs, dtype, lens, seed=0):
    cache = Cache(hkv, d, bs, sum(-(-n // bs) for n in lens) + 4, dtype, seed)
    tables = [cache.alloc(n) for n in lens]
    return cache, cache.table(tables, width=max(len(t) for t in tables) + 2)


# --------------------------------------------------------------------------------------------------------- store

@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_store_kv_casts_and_skips_minus_one(dtype):
    hkv, d, bs = 2, 32, 8
    cache = Cache(hkv, d, bs, 6, dtype, seed=1)
    k, v = torch.randn(7, hkv, d), torch.randn(7, hkv, d)
    slots = torch.tensor([17, -1, 3, 40, 8, -1, 23], dtype=torch.int64)
    # the caches sit behind a guard head, so a stray write to slot -1 lands in memory we check
    guarded = [torch.cat([torch.zeros_like(c[:1]), c]).to(DEVICE) for c in (cache.k, cache.v)]
    kc, vc = guarded[0][1:], guarded[1][1:]
    store_kv(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE))
    assert all(not g[0].any() for g in guarded)
    ref.store_kv(k, v, cache.k, cache.v, slots)
    # Triton's interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to nearest): 1 ulp
    rtol = 2 ** -7 if dtype == BF16 and kernels.interpreted() else 0.0
    for out, expected in ((kc, cache.k), (vc, cache.v)):
        out, expected = out.cpu().float().nan_to_num(7.0), expected.float().nan_to_num(7.0)
        assert torch.allclose(out, expected, rtol=rtol, atol=0.0)
    assert torch.allclose(kc[:, 17 // bs, 17 % bs].cpu().float(), k[0], rtol=2 ** -7 if dtype == BF16 else 1e-3)


# -------------------------------------------------------------------------------------------------------- decode

DECODE_CASES = [  # H, Hkv, D, block_size, KV dtype, window
    (4, 4, 64, 16, F32, 0),
    (8, 4, 32, 8, F16, 0),
    (8, 2, 64, 16, BF16, 0),
    (8, 2, 128, 16, F32, 5),
    (12, 4, 80, 8, F32, 16),   # head dim not a power of two, GQA group of 3
]


@pytest.mark.parametrize("h,hkv,d,bs,dtype,window", DECODE_CASES)
def test_decode_matches_reference(h, hkv, d, bs, dtype, window):
    lens = [0, 1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 5, 70]
    cache, bt = decode_batch(hkv, d, bs, dtype, lens, seed=h + d)
    q = torch.randn(len(lens), h, d).to(dtype)
    scale = 1 / math.sqrt(d)
    kc, vc = cache.to(DEVICE)
    o, lse = paged_decode_attention(q.to(DEVICE), kc, vc, bt.to(DEVICE), i32(lens), scale, window=window,
                                    return_lse=True)
    ro, rlse = ref.decode(q, cache.k, cache.v, bt, lens, scale, window)
    assert o.dtype == q.dtype and lse.dtype == F32
    close(o, ro, dtype)
    assert torch.equal(o[0].cpu(), torch.zeros_like(o[0].cpu())), "a row with 0 keys gives zeros"
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1:]).all()
    close(lse[1:], rlse[1:], dtype)


def test_split_k_equals_single_pass():
    h, hkv, d, bs = 8, 2, 64, 16
    lens = [300, 0, 1, 17, 129, 64]
    cache, bt = decode_batch(hkv, d, bs, F32, lens, seed=5)
    q = torch.randn(len(lens), h, d)
    kc, vc = cache.to(DEVICE)
    args = (q.to(DEVICE), kc, vc, bt.to(DEVICE), i32(lens), 0.125)
    for window in (0, 100):
        ro, rlse = ref.decode(q, cache.k, cache.v, bt, lens, 0.125, window)
        o1, l1 = paged_decode_attention(*args, window=window, num_splits=1, return_lse=True)
        close(o1, ro, F32)
        for splits in (2, 5, None):
            o, lse = paged_decode_attention(*args, window=window, num_splits=splits, return_lse=True)
            assert (o - o1).abs().max().item() <= 1e-5
            assert torch.equal(lse.isinf(), l1.isinf())
            assert (lse - l1).nan_to_num().abs().max().item() <= 1e-5


def test_comparison_catches_wrong_scale_and_window_off_by_one():
    """The tolerances are tight enough that a 2% scale error or a window one key too wide fails."""
    h, hkv, d, bs = 4, 2, 64, 16
    lens = [40, 23]
    cache, bt = decode_batch(hkv, d, bs, F32, lens, seed=9)
    q = torch.randn(2, h, d) * 2
    kc, vc = cache.to(DEVICE)
    o = paged_decode_attention(q.to(DEVICE), kc, vc, bt.to(DEVICE), i32(lens), 0.125, window=10).cpu()
    close(o, ref.decode(q, cache.k, cache.v, bt, lens, 0.125, 10)[0], F32)
    for wrong in (ref.decode(q, cache.k, cache.v, bt, lens, 0.125 * 1.02, 10)[0],
                  ref.decode(q, cache.k, cache.v, bt, lens, 0.125, 11)[0]):
        with pytest.raises(AssertionError):
            close(o, wrong, F32)


# ------------------------------------------------------------------------------------------------------- prefill

PREFILL_CASES = [  # H, Hkv, D, block_size, KV dtype, window
    (4, 4, 64, 16, F32, 0),
    (8, 2, 64, 8, F16, 0),
    (8, 4, 32, 16, BF16, 6),
    (6, 2, 64, 16, F32, 20),
]


@pytest.mark.parametrize("h,hkv,d,bs,dtype,window", PREFILL_CASES)
def test_prefill_matches_reference(h, hkv, d, bs, dtype, window):
    starts = [0, bs, 5, 2 * bs + 1, 0]       # plain prefill, cached prefixes on and off block boundaries
    new = [20, bs + 1, 1, 40, 1]
    cache = Cache(hkv, d, bs, sum(-(-(s + n) // bs) for s, n in zip(starts, new)) + 2, dtype, seed=h * d)
    bt = cache.table([cache.alloc(s + n) for s, n in zip(starts, new)])
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], h, d).to(dtype)
    kc, vc = cache.to(DEVICE)
    scale = 1 / math.sqrt(d)
    o = paged_prefill_attention(q.to(DEVICE), kc, vc, bt.to(DEVICE), i32(cu), i32(starts), scale, window=window)
    assert o.shape == q.shape and o.dtype == q.dtype
    close(o, ref.prefill(q, cache.k, cache.v, bt, torch.tensor(cu), starts, scale, window), dtype)


def test_prefill_last_row_equals_decode():
    """The last new row of a chunk sees exactly what a decode step at that position sees."""
    h, hkv, d, bs = 8, 2, 64, 16
    cache = Cache(hkv, d, bs, 8, F32, seed=3)
    bt = cache.table([cache.alloc(50)])
    q = torch.randn(10, h, d)
    kc, vc = cache.to(DEVICE)
    o = paged_prefill_attention(q.to(DEVICE), kc, vc, bt.to(DEVICE), i32([0, 10]), i32([40]), 0.125)
    dec = paged_decode_attention(q[-1:].to(DEVICE), kc, vc, bt.to(DEVICE), i32([50]), 0.125)
    assert (o[-1] - dec[0]).abs().max().item() <= 1e-5


# ------------------------------------------------------------------------------------------------------- cascade

@pytest.mark.parametrize("h,hkv,d,bs,dtype", [(8, 2, 64, 16, F32), (4, 4, 32, 8, F16)])
def test_cascade_matches_reference(h, hkv, d, bs, dtype):
    rng = random.Random(h)
    prefix_lens = [3 * bs, 2 * bs + 5, bs - 3, 0]          # whole blocks, not, and an empty prefix
    cache = Cache(hkv, d, bs, 80, dtype, seed=d)
    prefixes = [cache.alloc(n) for n in prefix_lens]
    # group 0 has more rows than one program takes (64 tile rows / GQA heads), so it is chunked
    row_group = [0] * 18 + [1, 1, 1, -1, 2, 3]
    rng.shuffle(row_group)
    suffix_lens = [rng.choice([0, 1, bs, bs + 1, 7]) for _ in row_group]
    suffix_lens[row_group.index(-1)] = 9
    suffixes = [cache.alloc(n) for n in suffix_lens]
    q = torch.randn(len(row_group), h, d).to(dtype)
    args = dict(prefix_tables=cache.table(prefixes), prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
                row_group=torch.tensor(row_group, dtype=torch.int32), suffix_tables=cache.table(suffixes),
                suffix_lens=torch.tensor(suffix_lens, dtype=torch.int32))
    kc, vc = cache.to(DEVICE)
    o = cascade_decode_attention(q.to(DEVICE), kc, vc, scale=0.2, **{k: t.to(DEVICE) for k, t in args.items()})
    assert o.dtype == q.dtype
    close(o, ref.cascade_decode(q, cache.k, cache.v, scale=0.2, **args), dtype)


def test_find_shared_prefixes_and_cascade_equal_plain_decode():
    h, hkv, d, bs = 8, 4, 64, 16
    cache = Cache(hkv, d, bs, 40, F32, seed=11)
    a, b = cache.alloc(3 * bs), cache.alloc(2 * bs)         # two parents, whole blocks
    lens = [3 * bs + 4, 3 * bs + 20, 3 * bs, 2 * bs + 1, 2 * bs + 9, 25, 3 * bs + 1]
    tables = [cache.alloc(n, a) for n in lens[:3]] + [cache.alloc(n, b) for n in lens[3:5]] + [cache.alloc(25)]
    tables.append(a[:1] + cache.alloc(lens[6] - bs))         # shares only a's first block: shortens group 0
    sp = find_shared_prefixes(tables, lens, bs)
    assert sp is not None
    assert sp.row_group.tolist() == [0, 0, 0, 1, 1, -1, 0]
    assert sp.prefix_lens.tolist() == [bs, 2 * bs]
    assert sp.suffix_lens.tolist() == [n - p for n, p in zip(lens, [bs, bs, bs, 2 * bs, 2 * bs, 0, bs])]
    q = torch.randn(len(lens), h, d)
    kc, vc = cache.to(DEVICE)
    shared = {k: t.to(DEVICE) for k, t in sp._asdict().items()}
    o = cascade_decode_attention(q.to(DEVICE), kc, vc, scale=0.125, **shared)
    bt = cache.table(tables)
    close(o, ref.decode(q, cache.k, cache.v, bt, lens, 0.125)[0], F32)
    plain = paged_decode_attention(q.to(DEVICE), kc, vc, bt.to(DEVICE), i32(lens), 0.125)
    assert (o - plain).abs().max().item() <= 1e-5
    assert find_shared_prefixes(tables, lens, bs, min_rows=4) is not None      # group 0 has 4 rows
    assert find_shared_prefixes(tables, lens, bs, min_rows=5) is None
    assert find_shared_prefixes([[1, 2], [3, 4]], [20, 20], bs) is None
    assert find_shared_prefixes([[1, 2], [1, 4]], [bs - 1, 20], bs) is None    # block 1 is not full for row 0


def test_cascade_plan_with_partitions_launched_twice():
    """A plan (host lists in, one copy to the device) with several prefix and suffix partitions
    (forced: the shapes are tiny), a group of 18 rows over two prefix programs, a row in no group;
    launched twice, since its arrival counters must be left at zero by each launch."""
    h, hkv, d, bs = 8, 2, 32, 8
    cache = Cache(hkv, d, bs, 80, F16, seed=4)
    parent = cache.alloc(5 * bs)
    lens = [5 * bs + 3 + i for i in range(18)] + [30]
    tables = [cache.alloc(n, parent) for n in lens[:18]] + [cache.alloc(30)]
    plan = plan_cascade(tables, lens, bs, device=DEVICE)
    assert plan.row_group.tolist() == [0] * 18 + [-1] and plan.prefix_lens.tolist() == [5 * bs]
    plan.prefix_splits, plan.suffix_splits = 3, 2
    assert plan.config(h, hkv, torch.device(DEVICE)).chunks == 2
    q = torch.randn(len(lens), h, d).to(F16)
    kc, vc = cache.to(DEVICE)
    expected = ref.decode(q, cache.k, cache.v, cache.table(tables), lens, 0.2)[0]
    for _ in range(2):
        o = cascade_decode(q.to(DEVICE), kc, vc, plan, 0.2)
        assert o.dtype == F16
        close(o, expected, F16)


def test_merge_attention_of_disjoint_halves():
    h, hkv, d, bs = 4, 2, 32, 8
    cache = Cache(hkv, d, bs, 30, F32, seed=2)
    full = [cache.alloc(n) for n in (40, 16, 9)]
    q = torch.randn(3, h, d)
    kc, vc = cache.to(DEVICE)
    lens = [40, 16, 9]
    head = cache.table([t[:2] for t in full])            # first two blocks: 16 keys (9 for the last)
    tail = cache.table([t[2:] for t in full])            # the rest (none for the last two)
    oa, la = paged_decode_attention(q.to(DEVICE), kc, vc, head.to(DEVICE), i32([16, 16, 9]), 0.3, return_lse=True)
    ob, lb = paged_decode_attention(q.to(DEVICE), kc, vc, tail.to(DEVICE), i32([24, 0, 0]), 0.3, return_lse=True)
    o, lse = merge_attention(oa, la, ob, lb)
    ro, rlse = ref.decode(q, cache.k, cache.v, cache.table(full), lens, 0.3)
    close(o, ro, F32)
    close(lse, rlse, F32)
    o0, l0 = merge_attention(ob[1:], lb[1:], ob[1:], lb[1:])            # both sides empty
    assert torch.equal(o0, torch.zeros_like(o0)) and torch.isneginf(l0).all()


def test_package_runs_interpreted_without_cuda():
    assert kernels.available()
    assert kernels.interpreted() == (not torch.cuda.is_available())


GPU_IMAGE_TRITON = (3, 6)   # the triton of the GPU image this project's kernels are compiled by (issue 36)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile with the triton it has")
def test_cpu_suite_rehearses_the_gpu_images_triton():
    """Without CUDA this suite is the rehearsal of the GPU run: it must interpret the kernels with
    the GPU image's triton release (the `test` extra pins it), so an API that release lacks fails
    here, and with a NumPy its interpreter works with (3.6 does int() on a one-element array, a
    TypeError since NumPy 2.4)."""
    import numpy
    import triton

    def minor(v: str) -> tuple:
        return tuple(int(p) for p in v.split(".")[:2])

    assert minor(triton.__version__) == GPU_IMAGE_TRITON, (
        f"triton {triton.__version__} is not the GPU image's {GPU_IMAGE_TRITON}: run scripts/setup.sh --test")
    assert minor(numpy.__version__) < (2, 4), f"numpy {numpy.__version__}: triton 3.6's interpreter needs < 2.4"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only used without CUDA")
def test_kernels_work_when_the_package_is_imported_before_triton():
    """This file imports triton first; a fresh process checks the other order."""
    code = ("import torch\n"
            "from interlace.engine_ext.native.kernels import paged_attention as pa, reference as ref\n"
            "kc, vc = torch.randn(2, 4, 8, 32), torch.randn(2, 4, 8, 32)\n"
            "q, bt, n = torch.randn(1, 4, 32), torch.tensor([[2, 0, 3]], dtype=torch.int32), [20]\n"
            "o = pa.paged_decode_attention(q, kc, vc, bt, torch.tensor(n, dtype=torch.int32), 0.2)\n"
            "assert (o - ref.decode(q, kc, vc, bt, n, 0.2)[0]).abs().max() < 1e-4\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_engine_with_triton_attention_generates_what_the_torch_path_does(tiny_dirs, tmp_path, kind):
    """Greedy tokens of a tiny random model (GQA; mistral: a sliding window of 6) with the Triton
    kernels doing the KV store, chunked prefill and decode attention (under the interpreter without
    CUDA) and with the torch reference: ragged prompts decoding together, a fork of one of them, a
    prompt that hits the prefix cache (prefill from a cached start), chunked prefill (a small token
    budget per step), block size 4 so contexts cross many block boundaries."""
    import asyncio

    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.protocol import SamplingParams

    if kind == "mistral":
        from helpers.tiny_models import make_tiny_model

        make_tiny_model("mistral", tmp_path / "mistral", seed=7)
        model_dir = tmp_path / "mistral"
    else:
        model_dir = tiny_dirs[kind][0]
    prompts = [[5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2][:n] for n in (3, 7, 12)] + [[9, 8, 7, 6, 5] * 4]

    async def run(engine):
        sp = SamplingParams(max_tokens=10, ignore_eos=True)
        await asyncio.gather(*(engine.fill(f"c{i}", p) for i, p in enumerate(prompts)))
        await engine.fill("fork", [31, 32], parent_context_id="c2")
        await engine.fill("again", prompts[3][:16] + [44, 45])  # 16 tokens from the prefix cache

        async def tokens(cid):
            return [ev.token_id async for ev in engine.generate(cid, sp) if ev.token_id is not None]

        return await asyncio.gather(*(tokens(c) for c in ("c0", "c1", "c2", "c3", "fork", "again")))

    got = {}
    for attention in ("triton", "torch"):
        with NativeEngine.load(model_dir, block_size=4, kv_cache_tokens=512, max_batched_tokens=8,
                               attention=attention, dtype="float32") as eng:  # (a GPU's default: bfloat16)
            assert (eng.runner.triton is not None) == (attention == "triton")
            got[attention] = asyncio.run(run(eng))
            assert eng.blocks.stats["prefix_hit_blocks"] >= 4  # "again" started from cached blocks
    assert got["triton"] == got["torch"]


def test_engine_attention_setting_names_triton():
    from interlace.engine_ext.native.attention import choose_backend
    from interlace.engine_ext.native.kernels.attention import TritonAttention

    # where the kernels run: the interpreter on a CPU machine, the GPU on a CUDA machine (the second GPU
    # run found this test naming the CPU there, which the engine refuses by design there)
    assert isinstance(choose_backend("triton", torch.device(DEVICE)), TritonAttention)
    assert not isinstance(choose_backend("auto", torch.device("cpu")), TritonAttention)  # a CPU: its C kernel
    with pytest.raises(ValueError, match="'triton'"):
        choose_backend("cuda-graphs", torch.device("cpu"))
