"""Intercepted contexts (InferCept): paused for a tool, or parked for a client's follow-up.

An intercepted context is handed to the interception policy before the next
step's scheduling, and every step after while it is preserved (the dynamic
estimate t_now - t_call may change the answer): *preserve* keeps its blocks,
*discard* releases them (full ones stay in the prefix cache) and recomputes
on resume -- in chunks under S mixed with decodes if the policy says so --,
*swap* moves its exclusive blocks to a host pool (``swap.py``), a budget per
step (InferCept's N_i, from the cost model) behind the forward pass.  A
resumed (or un-parked) swapped context is scheduled again only once all its
blocks are back.  The KV held by intercepted contexts is accounted as waste
(token-seconds), and each call's duration is learned from intercept to resume.
The policy sees the batch as every engine and the simulator describe it
(``BatchState.context_tokens`` = C_other: the device KV of the running
contexts, :meth:`Scheduler.running_kv_tokens`).  A ranking that predicts each
call's handling (LAMPS with ``handling_at_call``) decides it at the call
instead of the policy (:meth:`Interceptor.plan`).

:class:`Interceptor` is the engine's collaborator for all of it: it owns the
intercepted contexts, the policy and cost model they are planned with, and
the swapper (allocated by the engine thread beside the KV cache); the engine
step calls :meth:`~Interceptor.plan` and :meth:`~Interceptor.issue_swaps`,
the context commands and the token output call :meth:`~Interceptor.intercept`,
:meth:`~Interceptor.end` and :meth:`~Interceptor.unpark`.  It knows nothing
of commands or tokens: its only way to free device blocks is the scheduler's
(``preempt``, ``make_room``).
"""

from __future__ import annotations

import time
from typing import Dict, Hashable, Optional, Tuple

from ..policies.costmodel import Profile
from ..policies.interception import BatchState, Handling, InterceptedContext, InterceptionPolicy
from ..protocol import PauseHint
from .block_manager import BlockManager
from .scheduler import Batch, Scheduler
from .sequence import Context, Interception
from .swap import Swapper


class Interceptor:
    """Paused and parked contexts, their handling, the waste they hold and the swap budget.

    ``stats`` is the engine's counters dict: this object keeps ``handlings``
    (each call's first handling), ``replanned`` (a preserved context's later
    discard or swap), ``kv_waste_token_s``, ``swap_out_blocks``, ``swap_in_blocks`` and
    ``host_used_blocks`` current in it, and shares it with the scheduler,
    which counts the KV it drops for memory there (``running_preemptions``,
    ``paused_dropped``, ``idle_dropped``; the simulator's ``preemptions``
    and ``paused_dropped`` count the same things)."""

    def __init__(self, scheduler: Scheduler, blocks: BlockManager, stats: dict, policy: InterceptionPolicy,
                 profile: Optional[Profile] = None):
        self.scheduler = scheduler
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.stats = stats
        self.policy = policy
        self.profile = profile  # the engine's cost model (else the policy's own, else none)
        self.swap: Optional[Swapper] = None  # set by the engine thread, which allocates it beside the KV cache
        self.intercepted: Dict[Hashable, Context] = {}  # paused or parked contexts, by id
        self._held_tokens = 0   # device KV tokens held by intercepted contexts, since _waste_at
        self._waste_at = time.monotonic()
        stats.setdefault("replanned", {h.value: 0 for h in Handling})  # preserved, then discarded or swapped
        stats.update(scheduler.stats)  # the scheduler counts its drops for room in the engine's stats
        scheduler.stats = stats
        self.configure()

    # ---------------------------------------------------------------- policies
    def cost_model(self) -> Optional[Profile]:
        return self.profile if self.profile is not None else getattr(self.policy, "profile", None)

    def configure(self) -> None:
        """Apply the policy and cost model to the scheduler (after either changed)."""
        prof = self.cost_model()
        chunked = self.policy.chunked_recompute and prof is not None
        sched = self.scheduler
        sched.prefill_budget = ((lambda decodes: prof.prefill_budget(decodes, True, sched.max_batched_tokens))
                                if chunked else None)

    # ------------------------------------------------------------ one context
    def intercept(self, ctx: Context, hint: PauseHint, parked: bool) -> None:
        """``ctx`` waits for a tool (or a client): the next step plans its handling."""
        # the handling the ranking predicted for this call, asked before on_interception starts the next segment
        at_call = None if parked else getattr(self.scheduler.ranking, "handling_at_call", None)
        predicted = at_call(ctx) if at_call is not None else None
        ctx.intercept = Interception(hint, time.monotonic(), parked=parked,
                                     predicted=Handling(predicted) if predicted is not None else None)
        self.intercepted[ctx.id] = ctx
        on_interception = getattr(self.scheduler.ranking, "on_interception", None)
        if on_interception is not None:
            on_interception(ctx)
        ctx.sched.segment_generated = 0

    def end(self, ctx: Context, returned: bool = True) -> None:
        """The call returned (resume, or a follow-up on a parked context):
        learn its duration, fix the arrival time, bring swapped KV back.
        ``returned=False``: the paused generation ended without a resume
        (aborted): nothing to learn, the context just stops being intercepted."""
        rec = ctx.intercept
        if rec is None:
            return
        ctx.intercept = None
        self.intercepted.pop(ctx.id, None)
        now = time.monotonic()
        if returned:
            self.policy.durations.observe(rec.hint.tool, now - rec.call_time)
        if not self.policy.keeps_arrival:
            ctx.arrival = now  # re-queued as a new request (vLLM)
        if ctx.on_host:
            if returned:
                self.swap.swap_in(ctx)  # the scheduler skips it until every block is back
            else:
                self.release_kv(ctx)  # nobody waits for it: recompute if it is ever used

    def unpark(self, ctx: Context) -> None:
        if ctx.intercept is not None and ctx.intercept.parked:
            self.end(ctx)

    def release_kv(self, ctx: Context) -> None:
        """Drop a context's KV, on the device and in the host pool (it keeps
        its tokens: what was computed is recomputed when next needed)."""
        self.swap.forget(ctx)
        ctx.recompute_end = min(len(ctx.token_ids), max(ctx.recompute_end, ctx.num_computed))
        self.blocks.release(ctx.table)

    def drop(self, ctx: Context) -> None:
        """``ctx`` is going away: no longer intercepted, its KV released."""
        self.intercepted.pop(ctx.id, None)
        ctx.intercept = None
        self.release_kv(ctx)

    # ------------------------------------------------------------ every step
    def undecided(self) -> bool:
        """Some intercepted context waits for the next step to plan its handling."""
        return any(c.intercept.handling is None for c in self.intercepted.values())

    def preserving(self) -> bool:
        """Some context is preserved: reconsidered as its call ages, even with nothing else to do."""
        return any(c.intercept.handling is Handling.PRESERVE for c in self.intercepted.values())

    def _device_tokens(self, ctx: Context) -> int:
        on_dev = sum(b >= 0 for b in ctx.table.blocks)
        return min(ctx.num_computed, on_dev * self.block_size)

    def account_waste(self) -> None:
        """Token-seconds of device KV held by intercepted contexts (the
        holdings only change on the engine thread, between two calls)."""
        now = time.monotonic()
        self.stats["kv_waste_token_s"] += (now - self._waste_at) * self._held_tokens
        self._waste_at = now
        self._held_tokens = sum(self._device_tokens(c) for c in self.intercepted.values())

    def plan(self) -> None:
        """Ask the policy about contexts intercepted since the last step and
        those still preserved, and apply its answers.

        A ranking that predicts each call's handling and wants it applied
        at the call (LAMPS' Algorithm 1, lines 35-42:
        ``ranking.handling_at_call(ctx)``, asked by :meth:`intercept`)
        decides a newly intercepted context instead of the policy, once:
        that handling is not reconsidered while the call runs (a swap the
        host pool cannot take is still a discard)."""
        cands = [c for c in self.intercepted.values()
                 if c.intercept.handling is None or (c.intercept.handling is Handling.PRESERVE
                                                     and c.intercept.predicted is None)]
        if not cands:
            return
        infos = []
        for c in cands:
            held = self._device_tokens(c)
            if held == 0:  # nothing on the device (dropped for room, or never computed): nothing to decide
                if c.intercept.handling is None:
                    c.intercept.handling = Handling.DISCARD
                    self.stats["handlings"]["discard"] += 1  # every call counts once, as in the simulator
                continue
            rec = c.intercept
            if rec.handling is None and rec.predicted is not None:
                self._apply(c, rec.predicted)
                continue
            infos.append(InterceptedContext(context_len=held, num_blocks=sum(b >= 0 for b in c.table.blocks),
                                            expected_duration_s=rec.hint.expected_duration_s, tool=rec.hint.tool,
                                            id=c.id, call_time=rec.call_time))
        if not infos:
            return
        sched = self.scheduler
        runnable = [c for c in sched.active if not c.on_host]
        decodes = sum(1 for c in runnable if c.num_uncomputed == 1 and c.num_computed)
        waiting = sum(c.num_uncomputed for c in runnable) - decodes
        # the step about to run: its decodes and the waiting work its prefill budget lets in
        cap = sched.prefill_budget(decodes) if sched.prefill_budget is not None else sched.max_batched_tokens
        batched = max(1, min(sched.max_batched_tokens, decodes + min(waiting, cap)))
        # C_other (one meaning everywhere): the running contexts' device KV; the deciding ones are paused,
        # so none of them is among it
        batch = BatchState(context_tokens=sched.running_kv_tokens(), decode_tokens=decodes, batched_tokens=batched,
                           swap_backlog_tokens=self.swap.backlog_blocks * self.block_size)
        plan = self.policy.plan(infos, batch, time.monotonic())
        for info in infos:
            self._apply(self.intercepted[info.id], plan.get(info.id, Handling.PRESERVE))

    def _apply(self, ctx: Context, h: Handling) -> None:
        rec = ctx.intercept
        if h is Handling.PRESERVE:
            if rec.handling is None:
                self.stats["handlings"]["preserve"] += 1
            rec.handling = h
            return
        if h is Handling.SWAP and not self.swap.swap_out(ctx):
            h = Handling.DISCARD  # the host pool is full
        if h is Handling.DISCARD:
            self.scheduler.preempt(ctx)  # blocks released; full ones stay in the prefix cache
        # a call's first handling, or (a preserved context reconsidered) a later change, as the simulator counts
        self.stats["handlings" if rec.handling is None else "replanned"][h.value] += 1
        rec.handling = h

    def issue_swaps(self, batch: Batch) -> Tuple[int, int, Optional[int]]:
        """Move what the swap budget allows behind this step's forward pass
        (InferCept's N_i), or everything queued for an unbudgeted swap.
        Returns the blocks issued out and in, and the budget (None: unbudgeted)."""
        n_out = n_in = 0
        limit = None
        if self.swap.busy:
            prof = self.cost_model()
            if self.policy.budgeted_swap and prof is not None:
                ctx_tokens = sum(ch.start + ch.num for ch in batch.chunks)
                it = prof.t_fwd(max(1, batch.num_tokens), ctx_tokens)
                limit = max(1, prof.swap_limit_tokens(it) // self.block_size)  # at least one block: progress
            n_out, n_in, failed = self.swap.issue(limit, self.scheduler.make_room, can_wait=bool(batch.chunks))
            for ctx in failed:  # no device block to come back to: recompute instead
                self.scheduler.drop_for_room(ctx)
            self.stats["swap_out_blocks"] = self.swap.stats["swap_out_blocks"]
            self.stats["swap_in_blocks"] = self.swap.stats["swap_in_blocks"]
        self.stats["host_used_blocks"] = self.swap.pool.num_used
        return n_out, n_in, limit


__all__ = ["Interceptor"]
