"""The swap path's copies (engine_ext/native/swap.py): a context's exclusive KV blocks go to the
host pool and come back bit for bit, whatever the device blocks held meanwhile, and leave no block
of either pool taken; on CUDA the copies run on the side stream (the same test, where one is)."""

from __future__ import annotations

import pytest
import torch

from interlace.engine_ext.native.block_manager import BlockManager, BlockTable
from interlace.engine_ext.native.sequence import Context, Interception
from interlace.engine_ext.native.swap import SWAPPED, Swapper
from interlace.engine_ext.protocol import PauseHint

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_out_and_in_round_trips_bit_exact_and_leaks_nothing(device, dtype):
    bm = BlockManager(8, 4, prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 3, 8, 4, 16, generator=g).to(dtype).to(device)  # [layers, k/v, heads, blocks, bs, D]
    table = BlockTable([bm.allocate() for _ in range(3)])
    ctx = Context("c", [1] * 11, table)
    ctx.intercept = Interception(PauseHint(), call_time=0.0)  # paused: landing does not queue a swap-in itself
    before = kv[:, :, :, table.blocks].clone()
    sw = Swapper(bm, kv, host_blocks=4)
    assert sw.swap_out(ctx)
    assert sw.issue(None) == (3, 0, [])
    sw.land()
    assert table.blocks == [SWAPPED] * 3 and bm.num_free == 8 and sw.pool.num_used == 3
    kv[:, :, :, :] = float("nan")  # what the device blocks hold meanwhile (other contexts' KV)
    ctx.intercept = None
    sw.swap_in(ctx)
    assert sw.issue(None) == (0, 3, [])
    assert sw.land() == {ctx}
    assert all(b >= 0 for b in table.blocks) and not ctx.host and ctx.swap_ops == 0
    assert torch.equal(kv[:, :, :, table.blocks].cpu(), before.cpu())  # bit for bit, NaN nowhere
    assert sw.pool.num_used == 0 and bm.num_free == 5  # the host blocks back; the context holds its 3
