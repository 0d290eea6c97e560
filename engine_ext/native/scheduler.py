"""Iteration-level (continuous batching) scheduler.

Every engine step it first serves every running decode (one token each),
then gives what is left of the step's token budget to prefill chunks
(chunked prefill), each group in the ranking policy's order, so prefills and
decodes share one forward pass and a long prefill -- a new prompt, or an old
agent context resumed with a long tool result -- never stalls decoding.
When the KV cache has no room, a context's KV is dropped to make some:
first idle contexts' (least recently used first), then paused ones', then the
lowest-ranked active context's (preemption by recompute), skipping any whose
blocks are all shared with contexts that keep theirs (dropping it would free
nothing).  Admitting a context with nothing computed (a new request, a
discarded or preempted one) never preempts a running context (decoding or
part-way through its prefill), as in vLLM: it takes free and prefix-cached
blocks, and idle contexts' KV; the first waiting context that does not fit
stops admission for the step (head of line; the running ones ranked below
it are still served) and keeps nothing of its prefix-cache match.  (Letting
newcomers preempt running prefills made contexts thrash: preempted at
122 of 125 tokens, recomputed, preempted again; 3x the simulator's
recomputation.)  Nor does it drop a paused context's KV while anything
else runs this step: the interception policy chose to keep it, and the
newcomer waits, as in InferCept (and the simulator); only a step that
would otherwise run nothing takes it (a paused call may never return).  A dropped context keeps its tokens and is recomputed when next
used; its full blocks stay in the prefix cache until evicted, so that is
often cheap.

Contexts with KV in (or moving to or from) the host pool are skipped until
their swap-in is complete.  Under chunked recomputation (the engine sets
``prefill_budget``: decodes -> tokens) a step's waiting work -- new prompts,
tool results and recomputation alike -- takes at most that many tokens
beside the decodes (InferCept 4.3: the iteration is filled up to the
saturation point S, :meth:`Profile.prefill_budget`, the simulator's rule
too); otherwise prefills take what ``max_batched_tokens`` leaves.

Parrot's capacity regulation (:class:`~..policies.capacity.CapacityPolicy`,
``capacity``; none unless set: the engine library's default keeps the old
behaviour, the gateway configures a 2,048-token latency cap) splits the
ranked work before it is served: while a latency-critical request has work,
the contexts run beside it are kept, first fit in rank order, within the
latency cap (else within the throughput cap, if any); the split runs over
the step's ranked decodes before its ranked prefills, so throughput contexts
already decoding keep their room before new ones take any.  A context over the
cap is *held*: skipped this step, its KV kept, not counted as a
preemption; it neither stops admission (later contexts that fit are still
admitted) nor counts as stuck.  Latency-critical contexts always run; a
held context ages like any passed-over one and, once starving, takes the
room under the cap first (starvation does not lift the cap: capacity.py).  Memory may still take a held
context's KV, as it takes that of any active context not running this step
(counted as ``running_preemptions``: the KV of admitted work, dropped for
room, not for the cap).  A step in which nothing the cap lets run
could be scheduled (all out of memory) runs the held contexts instead
rather than nothing: a latency request waiting for memory that a held
throughput group occupies would otherwise wait for ever and fail as
``KVCacheExhausted``.

Both groups are served fairly across tenants (the API keys of
``RequestHint.tenant``): a step's ``max_seqs`` slots are dealt out
round-robin between the tenants with work, each tenant's decodes before its
prefills; the ranking's order stands within each tenant, and with one tenant
it is the order (:mod:`..policies.fairness`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Set, Tuple

from ..errors import KVCacheExhausted
from ..policies.capacity import NO_CAPACITY, CapacityPolicy
from ..policies.fairness import fair_order
from ..policies.ranking import FCFS, RankingPolicy, RankState
from .block_manager import BlockManager, OutOfBlocks
from .sequence import Context, State


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
                 inactive: Callable[[], Iterable[Context]] = lambda: (),
                 release: Optional[Callable[[Context], None]] = None):
        self.blocks = blocks
        self.release = release or (lambda ctx: blocks.release(ctx.table))  # drop a context's KV (device and host)
        self.prefill_budget: Optional[Callable[[int], int]] = None  # decodes -> max prefill tokens this step
        self.rank_state: Callable[[], RankState] = RankState
        self.inactive = inactive  # idle and paused contexts, in the order their KV may be dropped
        self.ranking = ranking or FCFS()
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        self.active: List[Context] = []
        self.num_preemptions = 0  # every KV drop (check_invariants' "preemptions"); by kind in ``stats``
        # KV dropped for memory, by what the context was doing -- the simulator's counters of the same
        # names (a discard is a handling, counted by the interceptor): the engine's stats dict once the
        # interceptor shares it
        self.stats = {"running_preemptions": 0, "paused_dropped": 0, "idle_dropped": 0}
        # Parrot's capacity regulation (module doc); NO_CAPACITY: every context runs as memory allows
        self.capacity: CapacityPolicy = NO_CAPACITY
        self.capacity_limit: Optional[int] = None  # the cap in force at the last step (None: memory only)
        self.capacity_held = 0        # contexts held back by the cap at the last step
        self.capacity_held_steps = 0  # steps that held some context back

    def add(self, ctx: Context) -> None:
        if ctx not in self.active:
            self.active.append(ctx)

    def remove(self, ctx: Context) -> None:
        if ctx in self.active:
            self.active.remove(ctx)

    def has_work(self) -> bool:
        return any(c.num_uncomputed > 0 for c in self.active)

    def running_kv_tokens(self) -> int:
        """C_other as every engine and the simulator define it: the device KV
        tokens of the contexts running now (decoding or prefilling; paused
        contexts are not in ``active``, swapped ones are skipped).  A context
        waiting for admission holds none."""
        bs = self.blocks.block_size
        return sum(min(c.num_computed, bs * sum(b >= 0 for b in c.table.blocks))
                   for c in self.active if not c.on_host)

    def preempt(self, ctx: Context) -> None:
        self.release(ctx)
        ctx.num_computed = 0
        ctx.last_logits = None
        self.num_preemptions += 1

    def drop_for_room(self, ctx: Context) -> None:
        """Preempt ``ctx`` to free memory, counted by what it was doing:
        running (decoding or prefilling, or resumed and swapping in),
        paused, or idle."""
        key = ("paused_dropped" if ctx.state is State.PAUSED and ctx.intercept is not None
               else "running_preemptions" if ctx in self.active else "idle_dropped")
        self.stats[key] += 1
        self.preempt(ctx)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_batched_tokens
        decodes, prefills = [], []
        for c in self.active:
            c.sched.context_len = len(c.token_ids)
            if c.on_host:
                continue
            n = c.num_uncomputed
            if n == 1 and c.num_computed:
                decodes.append(c)
            elif n:
                prefills.append(c)
        state = self.rank_state()
        # fairly across tenants: a step's max_seqs slots are dealt out round-robin between tenants,
        # each tenant's own decodes before its prefills in the ranking's order.  Decodes of one
        # tenant before every prefill would let a burst that fills max_seqs hold another tenant's
        # new request out until the burst's requests end (the trial: a 4-token chat, 14 s).
        ranked = self.ranking.order(decodes, state) + self.ranking.order(prefills, state)
        # Parrot's capacity: the contexts over the cap in force are held (skipped, KV kept; module doc)
        held = self._hold(ranked)
        order = fair_order(ranked)
        # waiting work's share of the step (chunked recomputation: up to S beside the decodes)
        prefill_left = self.prefill_budget(len(decodes)) if self.prefill_budget is not None else budget
        scheduled: set = set()
        admit = True   # waiting contexts are admitted in rank order until one does not fit (head of line)
        stuck: Optional[Context] = None  # the first context that got no memory

        def candidates():
            yield from (c for c in order if c not in held)
            if held and not batch.chunks:
                # nothing the cap lets run could be scheduled (memory): the held ones run rather than nothing
                yield from (c for c in order if c in held)

        for ctx in candidates():
            if budget == 0 or len(batch.chunks) >= self.max_seqs:
                break
            if ctx in scheduled:
                continue
            is_decode = ctx.num_uncomputed == 1 and ctx.num_computed > 0
            if not is_decode and prefill_left <= 0:
                continue  # a tenant's decodes may still follow in the fair order
            waiting = ctx.num_computed == 0  # not admitted yet (the sim's WAITING): new, discarded, preempted
            if waiting and not admit:
                continue
            if not ctx.table.blocks and ctx.num_computed == 0:
                ctx.num_computed = self.blocks.match_prefix(ctx.table, ctx.token_ids)
            n = min(ctx.num_uncomputed, budget)
            if not is_decode:
                n = min(n, prefill_left)
                if n <= 0:
                    continue
            start = ctx.num_computed
            while True:
                try:
                    batch.copies += self.blocks.prepare_append(ctx.table, start, start + n)
                    break
                except OutOfBlocks:
                    victim = self._victim(ctx, order, scheduled, waiting=waiting,
                                          spare_paused=waiting and bool(batch.chunks))
                    if victim is None:
                        break
                    self.drop_for_room(victim)
            if self.blocks.blocks_for(start + n) > len(ctx.table.blocks):
                # no memory for it: a waiting context stays out without holding anything (its
                # prefix-cache match goes back to the cache) and no later one is admitted this step;
                # running contexts ranked below it may still fit
                if waiting:
                    admit = False
                    if ctx.table.blocks:
                        self.blocks.release(ctx.table)
                        ctx.num_computed = 0
                stuck = stuck or ctx
                continue
            batch.chunks.append(ScheduledChunk(ctx, start, n))
            scheduled.add(ctx)
            budget -= n
            if not is_decode:
                prefill_left -= n
        if stuck is not None and not batch.chunks and not self._moves_pending():
            # Nothing runs this step and no swap is moving blocks (a swap-out frees them; a
            # swap-in that cannot finish is given up to recomputation): waiting cannot help,
            # idle/paused contexts hold the cache.
            batch.failed.append((stuck, KVCacheExhausted(
                f"KV cache full ({self.blocks.num_blocks} blocks): idle or paused contexts hold it; "
                "free some contexts")))
        self.capacity_held = sum(1 for c in held if c not in scheduled)
        if self.capacity_held:
            self.capacity_held_steps += 1
        # a held context counts as passed over: the ranking's starvation guarantee bounds its wait
        self.ranking.observe([ch.ctx for ch in batch.chunks], [c for c in order if c not in scheduled])
        return batch

    def _hold(self, ranked: List[Context]) -> Set[Context]:
        """The contexts of ``ranked`` (this step's work, the ranking's order)
        that the capacity policy holds back this step.  The cap in force is
        set by every context with work, those swapping in included."""
        if not self.capacity.enabled:
            self.capacity_limit = None
            return set()
        self.capacity_limit = self.capacity.limit(c for c in self.active if c.num_uncomputed > 0)
        _, held = self.capacity.split(ranked, self.capacity_limit)
        return set(held)

    def _moves_pending(self) -> bool:
        return any(c.swap_ops for c in self.active) or any(c.swap_ops for c in self.inactive())

    def make_room(self) -> bool:
        """Drop the KV of one context that is not running (idle, then paused: the drop order
        below) to free device blocks outside :meth:`schedule` (a swap-in's blocks).  False:
        no such context holds a block whose drop would free it."""
        victim = self._victim(None, [], set())
        if victim is None:
            return False
        self.drop_for_room(victim)
        return True

    def _victim(self, ctx: Optional[Context], order: List[Context], scheduled: Set[Context],
                waiting: bool = False, spare_paused: bool = False) -> Optional[Context]:
        """The first context, in drop order, whose KV it helps to drop.
        ``waiting``: for admitting a context (it never preempts a running
        one, as in vLLM: only idle and paused contexts' KV is taken for it).

        A block is freed only when its last holder lets go, so dropping a
        context whose blocks are all shared (a fork's parent, a fork that
        added nothing) frees nothing by itself: it is passed over unless all
        the holders of one of its blocks are droppable too (then dropping
        them one after the other does free it).
        """
        candidates = [v for v in self.inactive() if v.table.blocks and v is not ctx
                      and not (spare_paused and v.state is State.PAUSED)]
        if not waiting:
            candidates += [v for v in reversed(order) if v is not ctx and v not in scheduled and v.table.blocks]
        # blocks moving to or from the host are busy: not dropped mid-copy
        candidates = [v for v in dict.fromkeys(candidates) if not v.swap_ops]
        blocks = self.blocks.blocks
        for v in candidates:
            if any(b >= 0 and blocks[b].ref_count == 1 for b in v.table.blocks):
                return v
        holders = Counter(b for v in candidates for b in v.table.blocks if b >= 0)
        for v in candidates:
            if any(b >= 0 and holders[b] == blocks[b].ref_count for b in v.table.blocks):
                return v
        return None
