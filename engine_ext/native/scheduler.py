"""Iteration-level (continuous batching) scheduler.

Every engine step it picks, in the ranking policy's order, a chunk of
uncomputed tokens from each active context until the step's token budget is
spent: a decoding context needs one token, a prefill takes what the budget
leaves (chunked prefill), so prefills and decodes share one forward pass.
When the KV cache has no room, a context's KV is dropped to make some:
first idle contexts' (least recently used first), then paused ones', then the
lowest-ranked active context's (preemption by recompute).  A dropped context
keeps its tokens and is recomputed when next used; its full blocks stay in
the prefix cache until evicted, so that is often cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Tuple

from ..errors import KVCacheExhausted
from ..policies.ranking import FCFS, RankingPolicy
from .block_manager import BlockManager, OutOfBlocks
from .sequence import Context


@dataclass
class ScheduledChunk:
    ctx: Context
    start: int   # first position computed this step
    num: int     # tokens computed this step

    @property
    def reaches_end(self) -> bool:
        return self.start + self.num == len(self.ctx.token_ids)


@dataclass
class Batch:
    chunks: List[ScheduledChunk] = field(default_factory=list)
    copies: List[Tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies
    failed: List[Tuple[Context, Exception]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, ranking: RankingPolicy | None = None,
                 max_batched_tokens: int = 512, max_seqs: int = 256,
                 inactive: Callable[[], Iterable[Context]] = lambda: ()):
        self.blocks = blocks
        self.inactive = inactive  # idle and paused contexts, in the order their KV may be dropped
        self.ranking = ranking or FCFS()
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        self.active: List[Context] = []
        self.num_preemptions = 0

    def add(self, ctx: Context) -> None:
        if ctx not in self.active:
            self.active.append(ctx)

    def remove(self, ctx: Context) -> None:
        if ctx in self.active:
            self.active.remove(ctx)

    def has_work(self) -> bool:
        return any(c.num_uncomputed > 0 for c in self.active)

    def preempt(self, ctx: Context) -> None:
        self.blocks.release(ctx.table)
        ctx.num_computed = 0
        ctx.last_logits = None
        self.num_preemptions += 1

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_batched_tokens
        order = self.ranking.order(c for c in self.active if c.num_uncomputed > 0)
        scheduled: set = set()
        for ctx in order:
            if budget == 0 or len(batch.chunks) >= self.max_seqs:
                break
            if ctx in scheduled:
                continue
            if not ctx.table.blocks and ctx.num_computed == 0:
                ctx.num_computed = self.blocks.match_prefix(ctx.table, ctx.token_ids)
            n = min(ctx.num_uncomputed, budget)
            start = ctx.num_computed
            while True:
                try:
                    batch.copies += self.blocks.prepare_append(ctx.table, start, start + n)
                    break
                except OutOfBlocks:
                    victim = next((v for v in self.inactive() if v.table.blocks and v is not ctx), None)
                    if victim is None:
                        victim = next((v for v in reversed(order) if v is not ctx and v not in scheduled
                                       and v.table.blocks), None)
                    if victim is None:
                        break
                    self.preempt(victim)
            if self.blocks.blocks_for(start + n) > len(ctx.table.blocks):
                # Nothing left to preempt.  If nothing at all runs this step,
                # waiting cannot help: the cache is held by idle/paused contexts.
                if not batch.chunks:
                    batch.failed.append((ctx, KVCacheExhausted(
                        f"KV cache full ({self.blocks.num_blocks} blocks): idle or paused contexts hold it; "
                        "free some contexts")))
                break
            batch.chunks.append(ScheduledChunk(ctx, start, n))
            scheduled.add(ctx)
            budget -= n
        return batch
