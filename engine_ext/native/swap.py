"""Swapping KV blocks between the device cache and a host pool (InferCept 4.1).

A swapped-out context keeps its block table; the entries whose KV lives in
the host pool hold :data:`SWAPPED` and ``ctx.host`` maps those table indexes
to host block ids.  Only blocks the context alone holds (ref count 1) are
swapped: a block shared with a fork or another context through the prefix
cache stays on the device, referenced, so no other context's KV is ever
touched.  A swapped-out block that was in the prefix cache is released like
any other: with ref count 0 it becomes *cached* (its KV is still valid on
the device until the block is evicted, which also removes its hash), so the
prefix cache never points at a reused block.

Moves are queued and issued a budget at a time (what hides behind one
forward pass): swap-outs first (they free device memory), then swap-ins in
the contexts' original-arrival order (InferCept 4.3's swap queue, FCFS; the
rule the simulator follows too).  Ops
issued in one step *land* at the start of the next: on CUDA the copies run
on a side stream, overlapped with the forward pass, from/to pinned memory,
and landing waits for them; on CPU the copy is immediate but the same
bookkeeping applies, and the host pool is a separate tensor with its own
free list, so the accounting is real.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, List, Optional, Set

import torch

from .block_manager import BlockManager, OutOfBlocks

SWAPPED = -1  # a block-table entry whose KV is in the host pool


class HostPool:
    """Host memory for ``num_blocks`` KV blocks shaped like the device cache."""

    def __init__(self, kv: torch.Tensor, num_blocks: int):
        shape = list(kv.shape)
        shape[3] = max(0, num_blocks)
        pin = kv.device.type == "cuda"
        self.kv = torch.empty(shape, dtype=kv.dtype, device="cpu", pin_memory=pin)
        self.num_blocks = max(0, num_blocks)
        self.free: Deque[int] = deque(range(self.num_blocks))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        return self.free.popleft()

    def release(self, hb: int) -> None:
        self.free.append(hb)


@dataclass(eq=False)
class SwapOp:
    ctx: Any
    idx: int            # index in the context's block table
    out: bool           # device -> host (else host -> device)
    dev: int = -1
    host: int = -1


class Swapper:
    """The queues, the host pool and the copies.  Owned by the engine thread."""

    def __init__(self, blocks: BlockManager, kv: torch.Tensor, host_blocks: int):
        self.blocks = blocks
        self.dev_kv = kv
        self.pool = HostPool(kv, host_blocks)
        self.queue_out: Deque[SwapOp] = deque()
        self.queue_in: Deque[SwapOp] = deque()
        self.inflight: List[SwapOp] = []
        self.reserved = 0  # host blocks promised to queued swap-outs
        cuda = kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=kv.device) if cuda else None
        self.event: Optional[Any] = None
        self.stats = {"swap_out_blocks": 0, "swap_in_blocks": 0}

    @property
    def busy(self) -> bool:
        return bool(self.queue_out or self.queue_in or self.inflight)

    @property
    def backlog_blocks(self) -> int:
        return len(self.queue_out)

    # ------------------------------------------------------------ requests
    def exclusive(self, ctx) -> List[int]:
        """Table indexes of the device blocks only ``ctx`` holds."""
        blk = self.blocks.blocks
        return [i for i, b in enumerate(ctx.table.blocks) if b >= 0 and blk[b].ref_count == 1]

    def swap_out(self, ctx) -> bool:
        """Queue ``ctx``'s exclusive blocks for swap-out.  False (nothing
        queued) when the host pool cannot take them all."""
        idxs = self.exclusive(ctx)
        if not idxs or len(self.pool.free) - self.reserved < len(idxs):
            return False
        self.reserved += len(idxs)
        for i in idxs:
            self.queue_out.append(SwapOp(ctx, i, True))
        ctx.swap_ops += len(idxs)
        return True

    def cancel_out(self, ctx) -> None:
        """Drop ``ctx``'s swap-outs not issued yet (it is needed again)."""
        keep = deque()
        for op in self.queue_out:
            if op.ctx is ctx:
                self.reserved -= 1
                ctx.swap_ops -= 1
            else:
                keep.append(op)
        self.queue_out = keep

    def swap_in(self, ctx) -> None:
        """Queue every host block of ``ctx`` back (issued in arrival order,
        whatever the order of the resumes)."""
        self.cancel_out(ctx)
        queued = {op.idx for op in self.queue_in if op.ctx is ctx} | {
            op.idx for op in self.inflight if op.ctx is ctx and not op.out}
        for i in sorted(ctx.host):
            if i not in queued:
                self.queue_in.append(SwapOp(ctx, i, False))
                ctx.swap_ops += 1

    def forget(self, ctx) -> None:
        """``ctx`` is dropped or discarded: land what is in flight, cancel
        its queued moves and free its host blocks.  Its table keeps its
        device blocks (the caller releases them); SWAPPED entries remain."""
        if any(op.ctx is ctx for op in self.inflight):
            self.land()
        self.cancel_out(ctx)
        keep = deque()
        for op in self.queue_in:
            if op.ctx is ctx:
                ctx.swap_ops -= 1
            else:
                keep.append(op)
        self.queue_in = keep
        for hb in ctx.host.values():
            self.pool.release(hb)
        ctx.host.clear()
        assert ctx.swap_ops == 0

    # ---------------------------------------------------------------- moves
    def issue(self, limit_blocks: Optional[int], make_room=None, can_wait: bool = False) -> tuple:
        """Start up to ``limit_blocks`` moves (None: all queued), swap-outs
        first, then swap-ins, the earliest-arrived context's first.
        ``make_room()`` frees a device block for a swap-in or returns
        False.  A swap-in that gets no device block waits for one when
        ``can_wait`` (other work runs and will free blocks: the host copy is
        kept, as InferCept and the simulator do); otherwise its context is
        returned as failed and the caller discards it (recomputation).
        Returns (blocks out, blocks in, failed contexts)."""
        n_out = n_in = 0
        failed: List[Any] = []
        budget = limit_blocks if limit_blocks is not None else 1 << 60
        stream_ctx = torch.cuda.stream(self.stream) if self.stream is not None else None
        if stream_ctx is not None:  # the side stream must see the device cache as the main stream left it
            self.stream.wait_stream(torch.cuda.current_stream(self.dev_kv.device))
            stream_ctx.__enter__()
        try:
            while self.queue_out and budget > 0:
                op = self.queue_out.popleft()
                self.reserved -= 1
                op.dev, op.host = op.ctx.table.blocks[op.idx], self.pool.allocate()
                self.pool.kv[:, :, :, op.host].copy_(self.dev_kv[:, :, :, op.dev], non_blocking=True)
                self.inflight.append(op)
                n_out += 1
                budget -= 1
            if len(self.queue_in) > 1:  # FCFS by original arrival (stable: a context's blocks keep their order)
                self.queue_in = deque(sorted(self.queue_in, key=lambda op: op.ctx.arrival))
            while self.queue_in and budget > 0:
                op = self.queue_in[0]
                if op.ctx in failed:
                    self.queue_in.popleft()
                    op.ctx.swap_ops -= 1
                    continue
                try:
                    dev = self._alloc(make_room)
                except OutOfBlocks:
                    if can_wait:
                        break  # the queue keeps its order: the oldest swap-in gets the next free block
                    failed.append(op.ctx)
                    continue
                self.queue_in.popleft()
                op.dev, op.host = dev, op.ctx.host[op.idx]
                op.ctx.table.blocks[op.idx] = dev
                self.dev_kv[:, :, :, dev].copy_(self.pool.kv[:, :, :, op.host], non_blocking=True)
                self.inflight.append(op)
                n_in += 1
                budget -= 1
            if self.inflight and self.stream is not None:
                self.event = torch.cuda.Event()
                self.event.record(self.stream)
        finally:
            if stream_ctx is not None:
                stream_ctx.__exit__(None, None, None)
        self.stats["swap_out_blocks"] += n_out
        self.stats["swap_in_blocks"] += n_in
        return n_out, n_in, failed

    def _alloc(self, make_room) -> int:
        while True:
            try:
                return self.blocks.allocate()
            except OutOfBlocks:
                if make_room is None or not make_room():
                    raise

    def land(self) -> Set[Any]:
        """Finish the moves issued last step.  Returns the contexts whose
        swap-in is now complete."""
        if not self.inflight:
            return set()
        if self.event is not None:
            self.event.synchronize()  # host buffers are read / device blocks reused after this
            torch.cuda.current_stream(self.dev_kv.device).wait_event(self.event)
            self.event = None
        done = set()
        ops, self.inflight = self.inflight, []
        for op in ops:
            ctx = op.ctx
            ctx.swap_ops -= 1
            if op.out:
                ctx.table.blocks[op.idx] = SWAPPED
                ctx.host[op.idx] = op.host
                self.blocks.decref(op.dev)
            else:
                del ctx.host[op.idx]
                self.pool.release(op.host)
                if not ctx.host and not ctx.swap_ops:
                    done.add(ctx)
        # a context resumed while its swap-out was in flight: what landed on the host comes back
        for ctx in {op.ctx for op in ops if op.out}:
            if ctx.intercept is None:
                self.swap_in(ctx)
        return done

    def check(self, contexts) -> None:
        """No leaked host blocks: every used one belongs to a live context
        (landed in ``ctx.host`` or in flight)."""
        live = set(map(id, contexts))
        held: List[int] = []
        for c in contexts:
            for i, hb in c.host.items():
                assert c.table.blocks[i] == SWAPPED or any(op.ctx is c and op.idx == i for op in self.inflight), (
                    f"context {c.id!r}: host block for table entry {i} that is on the device")
                held.append(hb)
            assert all(b != SWAPPED or i in c.host for i, b in enumerate(c.table.blocks)), (
                f"context {c.id!r}: swapped entry without a host block")
        held += [op.host for op in self.inflight if op.out]
        for op in list(self.inflight) + list(self.queue_in) + list(self.queue_out):
            assert id(op.ctx) in live, "swap op of a dropped context"
        assert len(held) == len(set(held)), "host block held twice"
        assert len(held) == self.pool.num_used, f"host pool: {self.pool.num_used} used, {len(held)} held"
        assert 0 <= self.reserved <= len(self.pool.free)
