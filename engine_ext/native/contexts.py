"""The context commands: fill, fork, generate, free, truncate, pause, resume, park.

Each command runs on the engine thread and validates everything first,
raising a typed error (:mod:`interlace.engine_ext.errors`) before it changes
anything, so a failed call leaves the engine as it was; then it applies the
change and answers its caller's future (a fill whose tokens must be computed
first is answered by the step that computes them).

A fill records what it did (:class:`~.sequence.FillOp`), so that a caller
cancelled while waiting, or after its answer left, can have it undone
(:meth:`ContextCommands.undo_fill`): its tokens removed, a context it created
dropped, unless another call has built on it since.  Failing a context's
pending fills (a step that could not schedule or run them) undoes them the
same way, so the context is as it was before them.

:class:`ContextCommands` is the engine's collaborator for all of it: it
holds the engine's contexts by id and changes them through the scheduler,
the interceptor (paused and parked contexts, ``interception.py``) and the
token output (``output.py``: ending, pausing and starting generations).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, Hashable, List, Optional

import torch

from .. import errors as E
from ..protocol import PauseHint, RequestHint, SamplingParams
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .block_manager import BlockManager
from .block_sharing import VariantSet
from .interception import Interceptor
from .output import TokenOutput
from .scheduler import Scheduler
from .sequence import Context, FillOp, Generation, State
from .swap import SWAPPED


def apply_hint(ctx: Context, hint: RequestHint, tenant: bool = False) -> None:
    """Put ``hint``'s ranking fields into the context's ``SchedInfo`` and drop
    what the ranking cached from the old ones (its score, the handling it
    predicted, the later segments' score).  ``tenant``: set the tenant too
    (a new request: fill, generate); a resume or a hint update keeps it."""
    s = ctx.sched
    for k, v in hint.ranking().items():
        setattr(s, k, v)
    if tenant:
        s.tenant = hint.tenant
    s.score = s.predicted_handling = s.future_score = None


class ContextCommands:
    """The commands on the engine's ``contexts`` (by id; shared with the engine, which reads them).

    Every public method taking ``fut`` is a command: ``fut`` is its caller's
    ``concurrent.futures.Future``, answered here (or, for a fill that must be
    computed, by the step)."""

    def __init__(self, contexts: Dict[Hashable, Context], scheduler: Scheduler, blocks: BlockManager,
                 interceptor: Interceptor, output: TokenOutput, *, tokenizer: Optional[Tokenizer],
                 vocab_size: int, max_model_len: int, variants: Optional[VariantSet], name: str):
        self.contexts = contexts
        self.scheduler = scheduler
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.interceptor = interceptor
        self.output = output
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.variants = variants
        self.name = name

    # -------------------------------------------------------------- validation
    def get(self, cid: Hashable) -> Context:
        """The context ``cid`` (now used), or ContextNotFound."""
        ctx = self.contexts.get(cid)
        if ctx is None:
            raise E.ContextNotFound(cid)
        ctx.last_used = time.monotonic()
        return ctx

    def _check_tokens(self, tokens: List[int], allow_empty: bool) -> None:
        if not allow_empty and not tokens:
            raise E.InvalidTokens("token_ids must not be empty")
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise E.InvalidTokens(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")

    def _check_len(self, n: int) -> None:
        if n > self.max_model_len:
            raise E.ContextTooLong(f"context of {n} tokens exceeds the limit of {self.max_model_len} tokens")

    @staticmethod
    def _check_hint(hint: Optional[RequestHint]) -> None:
        if hint is not None:
            if not isinstance(hint, RequestHint):
                raise E.InvalidSampling(f"hint must be a RequestHint, got {type(hint).__name__}")
            hint.validate()

    def _new_context(self, cid: Hashable, parent_id: Optional[Hashable]) -> Optional[Context]:
        """Validate-only part of creating a context; returns the parent or None."""
        if cid in self.contexts:
            raise E.ContextExists(f"context {cid!r} already exists; fork into a new id")
        return self.get(parent_id) if parent_id is not None else None

    def _variant(self, name: Optional[str], existing: Optional[Context]) -> int:
        """The variant index a fill names (validate-only): a new context's,
        or None / the same one for a fork or an existing context."""
        if name is None:
            return existing.variant if existing is not None else 0
        if self.variants is None:
            if name == self.name:
                return 0
            raise E.UnknownVariant(f"no model variant {name!r} here (this engine serves only {self.name!r})")
        v = self.variants.get(name).index
        if existing is not None and existing.variant != v:
            raise E.InvalidContextState(f"context {existing.id!r} runs variant "
                                        f"{self.variants.variants[existing.variant].name!r}, not {name!r}")
        return v

    def _require_idle(self, ctx: Context, what: str) -> None:
        """Raise ContextBusy unless nothing runs on ``ctx`` (no generation, fill or step)."""
        if ctx.state is not State.IDLE or ctx.fill_waiters or ctx in self.scheduler.active:
            raise E.ContextBusy(f"context {ctx.id!r} is busy ({ctx.state.value}); {what} only idle contexts")

    # -------------------------------------------------------------------- fill
    def _fork(self, cid: Hashable, parent: Context) -> Context:
        """The child shares the parent's device blocks.  If part of the
        parent's KV is in the host pool, the child shares the leading
        device-resident blocks and recomputes the rest."""
        self.interceptor.unpark(parent)
        if parent.on_host:
            self.interceptor.swap.land()  # no block mid-copy is shared
        blocks = parent.table.blocks
        k = blocks.index(SWAPPED) if SWAPPED in blocks else len(blocks)
        shared = type(parent.table)(blocks[:k], parent.table.hashes[:k], parent.table.root)
        computed = min(parent.num_computed, k * self.block_size)
        child = Context(cid, list(parent.token_ids), self.blocks.fork(shared), computed, parent=parent,
                        last_logits=parent.last_logits if computed == parent.num_computed else None,
                        variant=parent.variant)
        child.recompute_end = parent.num_computed if computed < parent.num_computed else 0
        child.table.forked = child.table.high = computed  # served from the parent's KV (cached_tokens)
        parent.children.add(child)
        self.contexts[cid] = child
        return child

    def fill(self, fut, cid, tokens, parent_id, op: FillOp, hint: Optional[RequestHint] = None,
             variant: Optional[str] = None) -> None:
        self._check_hint(hint)
        ctx = self.contexts.get(cid)
        created = parent_id is not None or ctx is None
        if created:
            parent = self._new_context(cid, parent_id)
            self._check_tokens(tokens, allow_empty=parent is not None)
            base = len(parent.token_ids) if parent else 0
            self._check_len(base + len(tokens))
            v = self._variant(variant, parent)
            if parent:
                ctx = self._fork(cid, parent)
            else:
                ctx = Context(cid, [], variant=v)
                if v:
                    ctx.table.root = self.variants.variants[v].namespace
            self.contexts[cid] = ctx
        else:
            self._variant(variant, ctx)
            if ctx.state is not State.IDLE:
                raise E.ContextBusy(f"context {cid!r} is {ctx.state.value}; fill it when idle (or resume it)")
            self._check_tokens(tokens, allow_empty=True)
            self._check_len(len(ctx.token_ids) + len(tokens))
            self.interceptor.unpark(ctx)
            # a new request on a kept context (an adopted one): the KV it holds now is the caller's to
            # count (computed_tokens); what the prefix cache gives from here on is this request's saving
            ctx.table.high = ctx.num_computed
        if hint is not None:
            apply_hint(ctx, hint, tenant=True)
        op.fut, op.ctx, op.created, op.rollback = fut, ctx, created, len(ctx.token_ids)
        ctx.token_ids += tokens
        op.end = len(ctx.token_ids)
        if ctx.num_computed and not ctx.on_host and not ctx.swap_ops:
            # a fork's (or a longer context's) new tokens may repeat blocks computed before
            ctx.num_computed = self.blocks.extend_prefix(ctx.table, ctx.token_ids, ctx.num_computed)
        ctx.last_fill = op
        if ctx.num_uncomputed:
            ctx.last_logits = None
            ctx.fill_waiters.append(op)
            self.scheduler.add(ctx)
        else:
            fut.set_result(len(ctx.token_ids))

    def undo_fill(self, op: FillOp) -> None:
        """The caller of ``op`` was cancelled: take its tokens back out, unless
        it never ran, failed, or another call has built on it since (a failed
        or undone fill is neither pending nor ``last_fill`` any more)."""
        ctx = op.ctx
        if ctx is None or self.contexts.get(ctx.id) is not ctx:
            return
        if op in ctx.fill_waiters:  # still computing
            i = ctx.fill_waiters.index(op)
            self._rollback_fills(ctx, i, E.FillCancelled(
                f"an earlier fill of context {ctx.id!r} was cancelled; this later fill was undone with it"))
        elif (ctx.last_fill is op and ctx.gen is None and not ctx.fill_waiters
              and len(ctx.token_ids) == op.end):  # done, and nothing built on it
            self._truncate(ctx, op.rollback, op.created)

    def _rollback_fills(self, ctx: Context, i: int, err: Exception) -> None:
        """Fail the fills from the ``i``-th pending one on, and remove their
        tokens (a later fill's tokens sit on top of an earlier one's)."""
        ops, ctx.fill_waiters = ctx.fill_waiters[i:], ctx.fill_waiters[:i]
        for op in ops:
            if not op.fut.done():
                op.fut.set_exception(err)
        self._truncate(ctx, ops[0].rollback, ops[0].created)

    def _truncate(self, ctx: Context, n: int, created: bool) -> None:
        """Put a context back to its first ``n`` tokens, or drop it if the
        undone fill created it (and nobody forked it since)."""
        ctx.last_fill = None
        if created and not ctx.children:
            self._drop(ctx)
            return
        if created and n == 0:  # forks of it already read its tokens: it stays as it is
            return
        del ctx.token_ids[n:]
        ctx.last_logits = None
        ctx.table.high = min(ctx.table.high, n)
        if ctx.num_computed > n:  # its KV past n may be in cached blocks: recompute
            self.scheduler.preempt(ctx)
        if not ctx.num_uncomputed:
            self.scheduler.remove(ctx)

    def fail(self, ctx: Context, err: Exception) -> None:
        """A scheduled fill or generation cannot proceed: report ``err`` and
        undo the failed fills, so the context is as it was before them."""
        if ctx.fill_waiters:
            self._rollback_fills(ctx, 0, err)
        self.output.fail(ctx, err)

    # ---------------------------------------------------------------- generate
    def generate(self, fut, cid, sampling: SamplingParams, parent_id, emit,
                 hint: Optional[RequestHint] = None) -> None:
        sampling.validate()
        self._check_hint(hint)
        if (sampling.stop or sampling.pause_on) and self.tokenizer is None:
            raise E.InvalidSampling("stop and pause_on strings need an engine with a tokenizer")
        if parent_id is not None:
            parent = self._new_context(cid, parent_id)
            if not parent.token_ids:
                raise E.InvalidContextState(f"context {parent_id!r} is empty")
            ctx = None
        else:
            ctx = self.get(cid)
            if ctx.state is not State.IDLE:
                raise E.ContextBusy(f"context {cid!r} is already {ctx.state.value}")
            parent = None
        n = len((parent or ctx).token_ids)
        if n >= self.max_model_len:
            raise E.ContextTooLong(f"context of {n} tokens leaves no room to generate "
                                   f"(limit {self.max_model_len})")
        if ctx is None:
            ctx = self._fork(cid, parent)
        self.interceptor.unpark(ctx)
        s = ctx.sched
        s.segment_generated, s.score, s.predicted_handling, s.future_score = 0, None, None, None
        if hint is not None:
            apply_hint(ctx, hint, tenant=True)
        ctx.last_fill = None  # generated tokens build on the last fill: it stays
        rng = None
        if not sampling.greedy:
            rng = torch.Generator(device="cpu")
            rng.manual_seed(sampling.seed if sampling.seed is not None
                            else int.from_bytes(os.urandom(8), "little") >> 1)
        detok = (IncrementalDetokenizer(self.tokenizer, ctx.token_ids, sampling.skip_special_tokens)
                 if self.tokenizer else None)
        ctx.gen = Generation(sampling, emit, detok, rng)
        self.output.activate(ctx)
        fut.set_result(ctx.gen)

    def abort(self, cid, emit: Callable) -> None:
        """Stop the generation of the stream that owns ``emit``, if it still runs."""
        ctx = self.contexts.get(cid)
        if ctx is not None and ctx.gen is not None and ctx.gen.emit is emit:
            self.output.finish(ctx, "abort", emit=False)

    def pause(self, fut, cid, hint: Optional[PauseHint]) -> None:
        ctx = self.get(cid)
        if ctx.state is not State.GENERATING:
            raise E.InvalidContextState(f"context {cid!r} is {ctx.state.value}, not generating")
        self.output.pause(ctx, hint)
        fut.set_result(None)

    def resume(self, fut, cid, tokens: List[int], hint: Optional[RequestHint] = None) -> None:
        """``hint``: the predictions for the segment the resume starts (they
        replace the first segment's; :func:`apply_hint`)."""
        self._check_hint(hint)
        ctx = self.get(cid)
        if ctx.state is not State.PAUSED:
            raise E.InvalidContextState(f"context {cid!r} is {ctx.state.value}, not paused")
        self._check_tokens(tokens, allow_empty=True)
        self._check_len(len(ctx.token_ids) + len(tokens) + 1)
        self.interceptor.end(ctx)
        if hint is not None:
            apply_hint(ctx, hint)
        ctx.token_ids += tokens
        if tokens:
            ctx.last_logits = None
        gen = ctx.gen
        gen.paused = False
        if gen.detok is not None:
            gen.detok.reset_context(ctx.token_ids)
        gen.tail = gen.held = ""
        self.output.activate(ctx)
        fut.set_result(None)

    def set_pause_hint(self, cid, hint: PauseHint) -> None:
        ctx = self.contexts.get(cid)
        if ctx is None or ctx.gen is None or ctx.gen.done:
            return
        if ctx.intercept is not None and not ctx.intercept.parked:
            ctx.intercept.hint = hint  # paused already: later plans and the duration learned use it
        else:
            ctx.gen.pause_hint = hint

    # -------------------------------------------------------- free, truncate, park
    def free(self, fut, cid) -> None:
        ctx = self.get(cid)
        live = [c.id for c in ctx.children]
        if live:
            raise E.ContextHasChildren(f"context {cid!r} has live forked children {live[:5]!r}; free them first")
        if ctx.gen is not None:
            self.output.finish(ctx, "abort")
        for op in ctx.fill_waiters:
            if not op.fut.done():
                op.fut.set_exception(E.ContextNotFound(cid))
        ctx.fill_waiters.clear()
        self._drop(ctx)
        fut.set_result(None)

    def _drop(self, ctx: Context) -> None:
        self.scheduler.remove(ctx)
        self.interceptor.drop(ctx)
        if ctx.parent is not None:
            ctx.parent.children.discard(ctx)
        del self.contexts[ctx.id]

    def truncate(self, fut, cid, n) -> None:
        ctx = self.get(cid)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(ctx.token_ids):
            raise ValueError(f"num_tokens must be an integer in [0, {len(ctx.token_ids)}], got {n!r}")
        self._require_idle(ctx, "truncate")
        self.interceptor.unpark(ctx)
        if ctx.on_host:  # KV in (or on its way to or from) the host pool: recompute what is kept
            self.scheduler.preempt(ctx)
        keep = min(n, ctx.num_computed) // self.block_size
        self.blocks.truncate(ctx.table, keep)
        del ctx.token_ids[n:]
        ctx.num_computed = min(ctx.num_computed, keep * self.block_size)
        ctx.table.high = min(ctx.table.high, n)
        ctx.recompute_end = min(ctx.recompute_end, n)
        ctx.last_logits = ctx.last_fill = None
        fut.set_result(ctx.num_computed)

    def park(self, fut, cid, hint: Optional[PauseHint]) -> None:
        ctx = self.get(cid)
        if hint is not None and not isinstance(hint, PauseHint):
            raise E.InvalidContextState(f"hint must be a PauseHint, got {type(hint).__name__}")
        self._require_idle(ctx, "park")
        if ctx.intercept is not None:
            ctx.intercept.hint = hint or PauseHint()
        else:
            self.interceptor.intercept(ctx, hint or PauseHint(), parked=True)
        fut.set_result(None)


__all__ = ["ContextCommands", "apply_hint"]
