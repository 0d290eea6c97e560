"""A step's results: computed tokens booked, fills answered, one token sampled and emitted per generation.

nano-vllm's ``Scheduler.postprocess``: after the forward pass, each chunk's
tokens count as computed (full blocks sealed into the prefix cache); a
context whose tokens are all computed answers its pending fills; a
generating one gets its next token sampled, and the token becomes text
(``stream_text.token_text``: stop strings, pause strings, the length limit),
then one of: emitted, the stream finished, the generation paused (handed to
the interceptor, with the text held back as a possible stop string), or,
where the logits processor failed, the stream failed.  A context that is not
generating keeps its last logits, so a ``generate`` right after a fill
samples from them at the next step (:attr:`TokenOutput.ready`) without a
forward pass.

:class:`TokenOutput` is the engine's collaborator for it; the context
commands use its :meth:`~TokenOutput.finish`, :meth:`~TokenOutput.pause` and
:meth:`~TokenOutput.activate` too (free, abort, pause, generate, resume).
It ends generations, never contexts: undoing a failed context's pending
fills is the context commands' (``contexts.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Optional

import torch

from .. import errors as E
from ..protocol import PauseHint, TokenEvent
from ..stream_text import token_text
from .block_manager import BlockManager
from .interception import Interceptor
from .sampler import sample
from .scheduler import Batch, Scheduler
from .sequence import Context, State


class TokenOutput:
    """Books a step's computed tokens and turns sampled tokens into stream events.

    ``stats`` is the engine's counters dict (``prefill_tokens``, ``decode_tokens``,
    ``recomputed_tokens`` are kept here)."""

    def __init__(self, scheduler: Scheduler, blocks: BlockManager, interceptor: Interceptor, stats: dict,
                 eos_token_ids: FrozenSet[int], max_model_len: int):
        self.scheduler = scheduler
        self.blocks = blocks
        self.interceptor = interceptor
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.ready: List[Context] = []  # generating, all computed: sample from last_logits next step

    def activate(self, ctx: Context) -> None:
        """Decode ``ctx`` (a new or resumed generation): from its kept logits at the next step, or
        once its uncomputed tokens (or, without kept logits, its last position again) are computed."""
        if ctx.num_uncomputed == 0 and ctx.last_logits is not None:
            self.ready.append(ctx)
        else:
            if ctx.num_uncomputed == 0:  # no logits kept: recompute the last position
                self.scheduler.preempt(ctx)
            self.scheduler.add(ctx)

    def sample_ready(self) -> None:
        """The next token of each generation whose logits were already computed (a generate after a fill)."""
        if self.ready:
            ready, self.ready = self.ready, []
            self.sample_and_emit(ready, torch.stack([c.last_logits for c in ready]))

    def postprocess(self, batch: Batch, logits: torch.Tensor, rows: List[int]) -> None:
        """Book the forward pass of ``batch``: ``logits`` [R, V], row r for chunk ``rows[r]``
        (the chunks that reach their context's end)."""
        for ch in batch.chunks:
            ctx = ch.ctx
            if ch.start < ctx.recompute_end:
                self.stats["recomputed_tokens"] += min(ch.start + ch.num, ctx.recompute_end) - ch.start
                if ch.start + ch.num >= ctx.recompute_end:
                    ctx.recompute_end = 0
            ctx.num_computed += ch.num
            self.blocks.seal_full_blocks(ctx.table, ctx.token_ids, ctx.num_computed)
            self.stats["decode_tokens" if ch.num == 1 and ch.start > 0 else "prefill_tokens"] += ch.num
        sampling_ctx, sampling_rows = [], []
        for r, ci in enumerate(rows):
            ctx = batch.chunks[ci].ctx
            if ctx.state is State.GENERATING:
                sampling_ctx.append(ctx)
                sampling_rows.append(r)
            else:
                ctx.last_logits = logits[r].clone()
                self.scheduler.remove(ctx)
            for op in ctx.fill_waiters:
                if not op.fut.done():
                    op.fut.set_result(len(ctx.token_ids))
            ctx.fill_waiters.clear()
        if sampling_ctx:
            self.sample_and_emit(sampling_ctx, logits[sampling_rows])

    def sample_and_emit(self, ctxs: List[Context], logits: torch.Tensor) -> None:
        picks = sample(logits, [c.gen for c in ctxs])
        for ctx, (tok, lp) in zip(ctxs, picks):
            if tok < 0:
                self.fail(ctx, E.EngineError(f"logits processor failed: {lp!r}"))
                continue
            gen = ctx.gen
            ctx.token_ids.append(tok)
            gen.generated.append(tok)
            ctx.sched.segment_generated += 1
            ctx.last_logits = None
            self.on_token(ctx, tok, lp)

    def on_token(self, ctx: Context, tok: int, lp: Optional[float]) -> None:
        gen = ctx.gen
        sp = gen.sampling
        is_eos = (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids
        text, finish, pause = token_text(gen, tok, is_eos=is_eos, at_limit=len(ctx.token_ids) >= self.max_model_len)
        if finish is not None:
            self.finish(ctx, finish, TokenEvent(tok, text, lp, finish))
            return
        if pause:  # pause emits the held-back text too
            hint, gen.pause_hint = gen.pause_hint or PauseHint(), None
            self.pause(ctx, hint, TokenEvent(tok, text, lp))
            return
        gen.emit(TokenEvent(tok, text, lp, cached_tokens=cached_tokens(ctx) if len(gen.generated) == 1 else None))
        if ctx not in self.scheduler.active:
            self.scheduler.add(ctx)

    def _stop(self, ctx: Context) -> None:
        """Nothing of ``ctx`` is scheduled or sampled any more."""
        self.scheduler.remove(ctx)
        if ctx in self.ready:
            self.ready.remove(ctx)

    def pause(self, ctx: Context, hint: Optional[PauseHint], token_event: Optional[TokenEvent] = None) -> None:
        """The generation waits (for a tool): intercepted, and its stream told so, with the token
        that paused it (``token_event``) and the text held back as a possible stop string."""
        self._stop(ctx)
        self.interceptor.intercept(ctx, hint or PauseHint(), parked=False)
        gen = ctx.gen
        gen.paused = True
        ev = token_event or TokenEvent(None, "")
        # text held back as a possible stop string ends here: what follows is the tool's output
        text, gen.held = ev.text + gen.held, ""
        gen.emit(TokenEvent(ev.token_id, text, ev.logprob, None, paused=True, cached_tokens=cached_tokens(ctx)))

    def finish(self, ctx: Context, reason: str, event: Optional[TokenEvent] = None, emit: bool = True) -> None:
        gen = ctx.gen
        gen.done = True
        ctx.gen = None
        if ctx.intercept is not None and not ctx.intercept.parked:  # aborted while paused
            self.interceptor.end(ctx, returned=False)
        self._stop(ctx)
        if emit:
            gen.emit(dataclasses.replace(event or TokenEvent(None, "", None, reason), cached_tokens=cached_tokens(ctx)))
        ctx.table.hits = ctx.table.forked = 0  # reported: the next request counts its own

    def fail(self, ctx: Context, err: Exception) -> None:
        """The generation of ``ctx`` (if any) cannot proceed: its stream ends with ``err``."""
        self._stop(ctx)
        if ctx.gen is not None:
            gen = ctx.gen
            gen.done = True
            ctx.gen = None
            if ctx.intercept is not None and not ctx.intercept.parked:
                self.interceptor.end(ctx, returned=False)
            ctx.table.hits = ctx.table.forked = 0
            gen.emit(err)


def cached_tokens(ctx: Context) -> Dict[str, int]:
    """What a stream reports as :attr:`TokenEvent.cached_tokens`: the positions of ``ctx`` the
    prefix cache or its fork's parent gave since its previous generation ended."""
    return {"prefix_cache": ctx.table.hits, "fork": ctx.table.forked}


__all__ = ["TokenOutput", "cached_tokens"]
