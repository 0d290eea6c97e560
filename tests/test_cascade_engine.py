"""Cascade (shared-prefix) decode in the engine (issue 36).

The engine plans a cascade on the host (``TritonAttention.step_args``) where
a step's decode rows share a long prefix of full blocks -- forks of one
context -- and runs it in place of plain paged decode; such a step leaves the
decode CUDA graphs (``DecodeGraphs.run`` returns None) and runs eagerly.
Without CUDA the kernels run under Triton's interpreter, so the shapes here are
tiny and the thresholds (``kernels/attention.py``: ``CASCADE_MIN_*``) are
lowered to them.  Also here: the launch itself (``cascade_decode``) is three
kernels, a few allocations and no host read of the device, and the prefix pass
of 64 forks of a 4k prefix spreads over hundreds of programs.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("triton")

from interlace.engine_ext.native import kernels  # noqa: E402,F401  (sets TRITON_INTERPRET without CUDA)
from interlace.engine_ext.native.kernels import attention as attn_mod  # noqa: E402
from interlace.engine_ext.native.kernels import cascade as casc  # noqa: E402
from interlace.engine_ext.native.kernels import reference as ref  # noqa: E402
from interlace.engine_ext.native.kernels.attention import TritonAttention  # noqa: E402
from interlace.engine_ext.native.staging import Staged, StepStaging  # noqa: E402

from test_cuda_graphs import BS, tiny_model  # noqa: E402
from test_triton_kernels import DEVICE, F32, Cache, close  # noqa: E402


@pytest.fixture
def low_thresholds(monkeypatch):
    """Cascade for any two rows sharing one full block (the tiny shapes here)."""
    monkeypatch.setattr(attn_mod, "CASCADE", True)
    monkeypatch.setattr(attn_mod, "CASCADE_MIN_ROWS", 2)
    monkeypatch.setattr(attn_mod, "CASCADE_MIN_PREFIX_KEYS", 1)
    monkeypatch.setattr(attn_mod, "CASCADE_MIN_SAVED_KEYS", 1)


# ------------------------------------------------------------------------------------------------ step_args
def test_step_args_plan_the_cascade_and_choose_splits_on_the_host(low_thresholds, monkeypatch):
    bs = 4
    shared = [7, 8, 9]                              # three full blocks shared by rows 0, 1 and 3
    decodes = [(0, 14, shared + [20]), (1, 13, shared + [21]), (2, 9, [30, 31, 32]), (3, 12, shared)]
    args = TritonAttention.step_args([], decodes, bs, 0, torch.device("cpu"))
    assert args.decode_in_order and args.decode_max_len == 14 and args.num_splits is None
    plan = args.cascade
    assert plan is not None and args.decode_tables is None and args.decode_lens is None  # the plan has them
    assert plan.row_group.tolist() == [0, 0, -1, 0] and plan.prefix_lens.tolist() == [12]
    assert plan.prefix_tables.tolist() == [shared] and plan.grows.tolist() == [0, 1, 3]
    assert plan.suffix_lens.tolist() == [2, 1, 9, 0]
    assert plan.suffix_tables.tolist() == [[20, 0, 0], [21, 0, 0], [30, 31, 32], [0, 0, 0]]
    # a mixed step: the decode rows are not rows 0..T-1
    mixed = TritonAttention.step_args([(0, 3, 0, [40])], [(3, 14, shared + [20]), (4, 13, shared + [21])], bs, 0,
                                      torch.device("cpu"))
    assert not mixed.decode_in_order and mixed.cascade is not None
    # thresholds: too few keys saved, a sliding window, or switched off: plain decode
    assert TritonAttention.step_args([], decodes, bs, 6, torch.device("cpu")).cascade is None
    monkeypatch.setattr(attn_mod, "CASCADE_MIN_SAVED_KEYS", 2 * 12 + 1)
    assert TritonAttention.step_args([], decodes, bs, 0, torch.device("cpu")).cascade is None
    monkeypatch.setattr(attn_mod, "CASCADE_MIN_SAVED_KEYS", 2 * 12)
    assert TritonAttention.step_args([], decodes, bs, 0, torch.device("cpu")).cascade is not None
    monkeypatch.setattr(attn_mod, "CASCADE", False)
    off = TritonAttention.step_args([], decodes, bs, 0, torch.device("cpu"))
    assert off.cascade is None and off.decode_lens.tolist() == [14, 13, 9, 12]


def test_default_thresholds_take_long_shared_prefixes_only():
    bs = 16
    prefix = list(range(256))                                   # 4096 keys
    tables = [prefix + [1000 + i] for i in range(8)]
    assert attn_mod.cascade_groups(tables, [4096 + 5] * 8, bs)  # 7 x 4096 keys saved a layer
    assert not attn_mod.cascade_groups(tables[:2], [4096 + 5] * 2, bs)  # one fork: 4096 saved
    short = [list(range(8)) + [1000 + i] for i in range(200)]          # 199 x 128 keys saved, but
    assert not attn_mod.cascade_groups(short, [8 * bs + 3] * 200, bs)  # a 128-key prefix is too short


def test_step_args_plan_is_staged_with_the_step(low_thresholds):
    st = StepStaging(torch.device("cpu"), pin=False)
    args = TritonAttention.step_args([], [(0, 9, [5, 6, 1]), (1, 10, [5, 6, 2])], BS, 0, torch.device("cpu"),
                                     st.tensor)
    assert isinstance(args.cascade.suffix_tables, Staged)
    st.upload()
    st.resolve(args)
    plan = args.cascade
    assert plan.prefix_tables.tolist() == [[5, 6]] and plan.suffix_tables.tolist() == [[1], [2]]
    assert plan.suffix_lens.dtype == torch.int32 and plan.suffix_lens.tolist() == [1, 2]


# ------------------------------------------------------------------------------------------------ attend()
@pytest.mark.parametrize("mixed", [False, True])
def test_attend_with_cascade_equals_plain(low_thresholds, monkeypatch, mixed):
    """Decode rows through cascade (and a prefill chunk beside them) against the same step without."""
    h, hkv, d, bs = 4, 2, 16, 4
    cache = Cache(hkv, d, bs, 40, F32, seed=5)
    parent = cache.alloc(3 * bs)
    lens = [3 * bs + 2, 3 * bs + 5, 7]
    tables = [cache.alloc(lens[0], parent), cache.alloc(lens[1], parent), cache.alloc(lens[2])]
    first = 5 if mixed else 0
    decodes = [(first + i, n, t) for i, (n, t) in enumerate(zip(lens, tables))]
    prefills = [(0, 5, 3, cache.alloc(8))] if mixed else []
    q = torch.randn(first + len(lens), h, d).to(DEVICE)
    kc, vc = cache.to(DEVICE)
    before = TritonAttention.cascade_calls
    on = TritonAttention.step_args(prefills, decodes, bs, 0, torch.device(DEVICE))
    assert on.cascade is not None and on.decode_in_order == (not mixed)
    o_on = TritonAttention.attend(q, kc, vc, on, 0.25)
    assert TritonAttention.cascade_calls == before + 1
    monkeypatch.setattr(attn_mod, "CASCADE", False)
    off = TritonAttention.step_args(prefills, decodes, bs, 0, torch.device(DEVICE))
    o_off = TritonAttention.attend(q, kc, vc, off, 0.25)
    assert off.num_splits == 1  # chosen on the first layer from the host-known lengths
    assert (o_on - o_off).abs().max().item() <= 1e-5
    expected = ref.decode(q[first:].cpu(), cache.k, cache.v, cache.table(tables), lens, 0.25)[0]
    close(o_on[first:], expected, F32)


# ------------------------------------------------------------------------------------------------ the launch
def _fake_launch(monkeypatch):
    """Replace the kernel by a recorder of its grid (nothing runs)."""
    grids = {}

    class Rec:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*a, **kw):
                grids[self.name] = grid
            return launch

    monkeypatch.setattr(casc, "_cascade_kernel", Rec("cascade"))
    return grids


def test_launch_is_one_kernel_without_host_reads_and_hundreds_of_prefix_programs(monkeypatch):
    """64 forks of a 4096-token prefix, 128 tokens each, Llama-3-8B's heads (32 q, 8 KV, D 128):
    the grid of each kernel, and every torch op the launch makes (no ``.item()``/``.tolist()``,
    which would be ``aten._local_scalar_dense``, nor any other op than allocations and views)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    bs, forks, pre, suf = 16, 64, 256, 8
    tables = [list(range(pre)) + list(range(pre + f * suf, pre + (f + 1) * suf)) for f in range(forks)]
    plan = casc.plan_cascade(tables, [(pre + suf) * bs] * forks, bs)
    grids = _fake_launch(monkeypatch)
    kc = torch.empty(8, 2, bs, 128, dtype=torch.bfloat16)
    q = torch.empty(forks, 32, 128, dtype=torch.bfloat16)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    casc.cascade_decode(q, kc, kc, plan, 0.1)  # the first call chooses the launch shape and makes the scratch
    with Ops() as mode:
        casc.cascade_decode(q, kc, kc, plan, 0.1)
    assert mode.ops == ["aten.empty"], mode.ops        # the output; no .item() (aten._local_scalar_dense)
    cfg = plan.config(32, 8, q.device)
    assert cfg.rows_per_program == 16 and cfg.chunks == 4 and cfg.suffix_splits == 1
    programs, kv_heads = grids["cascade"]
    assert kv_heads == 8 and programs == 4 * cfg.prefix_splits + forks      # prefix programs, then one per row
    assert 4 * cfg.prefix_splits * 8 >= 256           # the prefix pass: was 4 chunks x 8 KV heads = 32 programs


# ------------------------------------------------------------------------------------------------ the engine
def test_forks_decode_the_same_tokens_with_cascade_on_and_off(low_thresholds, monkeypatch):
    """A parent context and three forks of it (plus an unrelated context) decode together; greedy
    tokens with cascade and without, each with the decode graphs' path on (eager stand-in on the
    CPU) and off.  Decode-only steps that a graph takes stay in it (plain decode: leaving a graph
    costs more than cascade saves, ``DecodeGraphs.run``): cascade runs in the eager engine."""
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.protocol import SamplingParams

    parent = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2, 8]      # 13 tokens: 3 full blocks of 4

    async def run(engine):
        await engine.fill("p", parent)
        for i in range(3):
            await engine.fill(f"f{i}", [31 + i, 40 + i], parent_context_id="p")
        await engine.fill("other", [9, 8, 7, 6, 5])

        async def tokens(cid):
            sp = SamplingParams(max_tokens=5, ignore_eos=True)
            return [ev.token_id async for ev in engine.generate(cid, sp) if ev.token_id is not None]

        return await asyncio.gather(*(tokens(c) for c in ("p", "f0", "f1", "f2", "other")))

    got, calls, replays = {}, {}, {}
    for on in (True, False):
        monkeypatch.setattr(attn_mod, "CASCADE", on)
        for graphs in (False, True):
            before = TritonAttention.cascade_calls
            with NativeEngine(tiny_model(device=DEVICE), block_size=BS, kv_cache_tokens=256, max_batched_tokens=64,
                              attention="triton", cuda_graphs=graphs) as eng:
                got[on, graphs] = asyncio.run(run(eng))
                replays[on, graphs] = eng.runner.graphs.replays if graphs else 0
            calls[on, graphs] = TritonAttention.cascade_calls - before
    assert got[True, False] == got[False, False] == got[True, True] == got[False, True]
    assert calls[True, False] >= 2 * 4   # 2 layers x at least 4 decode steps
    assert calls[False, False] == calls[False, True] == calls[True, True] == 0
    assert replays[True, True] == replays[False, True] >= 4
