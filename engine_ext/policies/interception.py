"""Interception handling (InferCept): what to do with a paused context's KV.

While a request waits for a tool, its KV can be *preserved* (kept on the
device: memory held for the whole call), *discarded* (freed, and recomputed
on resume: compute, and the memory of everyone waiting for it) or *swapped*
(copied to host memory and back: link time).  InferCept quantifies each as
GPU memory waste, in token-seconds (times M, the KV bytes per token, for
byte-seconds):

* eq. 1  WasteDiscard   = T_fwd(C_i) * C_i * M + T_fwd(C_i) * C_other * M
* eq. 2  WastePreserve  = T_INT * C_i * M
* eq. 3  WasteSwap      = 2 * T_swap(C_i) * C_batch * M           (synchronous swap)
* eq. 4  WasteChunkD    = T_fwd(C_i) * C_i * M / 2 + n * T_fwd(C_i / n) * C_other * M
                          (recomputation in n chunks, each under the saturation point S;
                          T_fwd(C_i / n) is a chunk's *added* iteration time)
* eq. 5  Waste          = min(WastePreserve, WasteChunkD)

and, each iteration, sorts the newly intercepted requests by eq. 5 (most
waste first), swaps what the *swap budget* allows (only what hides behind
the forward passes), and preserves or discards the rest by eq. 5.  The call
time T_INT is the caller's hint or the tool's learned mean, and once a call
has outlived that, InferCept's dynamic estimate t_now - t_call (section 4.4).

One copy of each policy, shared by the native engine, the simulator and any
other engine: engines describe the context and the batch, policies answer.
Free of torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence

from .costmodel import Profile
from .predictors import DurationPredictor, ToolDurations


class Handling(str, enum.Enum):
    PRESERVE = "preserve"
    DISCARD = "discard"
    SWAP = "swap"


@dataclass(frozen=True)
class InterceptedContext:
    """One intercepted context, as the engine sees it when deciding."""

    context_len: int                          # C_i: tokens whose KV it holds on the device
    num_blocks: int = 0
    expected_duration_s: Optional[float] = None  # the caller's hint (None: the learned estimate)
    tool: Optional[str] = None
    id: Hashable = None
    call_time: float = 0.0                    # engine clock when the call began


@dataclass(frozen=True)
class BatchState:
    """The running batch around a decision."""

    context_tokens: int = 0       # C_other: context tokens of the running requests (without this one)
    decode_tokens: int = 0        # decodes in an iteration (one token each)
    batched_tokens: int = 1       # tokens in an iteration
    swap_backlog_tokens: int = 0  # tokens already queued to swap out, not yet moved


# ------------------------------------------------------------------ equations
def waste_preserve(c_i: int, t_int: float) -> float:
    """Eq. 2, in token-seconds."""
    return t_int * c_i


def waste_discard(c_i: int, c_other: int, profile: Profile) -> float:
    """Eq. 1: recomputing all C_i tokens in one iteration."""
    t = profile.t_fwd(c_i)
    return t * c_i + t * c_other


def recompute_chunks(c_i: int, profile: Profile, decode_tokens: int = 0) -> int:
    """n of eq. 4: iterations a chunked recomputation of C_i tokens takes."""
    return max(1, -(-c_i // profile.recompute_chunk(decode_tokens)))


def waste_chunked_discard(c_i: int, c_other: int, profile: Profile, decode_tokens: int = 0) -> float:
    """Eq. 4: recomputation in n chunks, each under the saturation point.

    ``T_fwd(C_i / n)`` is, as InferCept defines it, the *added* iteration
    time of one chunk beside the ``decode_tokens`` decodes it rides with
    (:meth:`Profile.added_time`), not the time of a whole iteration of C/n
    tokens: hence the paper's n * T_fwd(C/n) <= T_fwd(C), and a chunk that
    keeps the iteration under S costs the other requests (almost) nothing.
    (Read as whole iterations, chunked discard cost more than discarding at
    once on any profile flat below S: 6688 vs 2652 token-s for C = 2000,
    C_other = 60k on h100-gpt-j-6b, against 43 read as published.)"""
    n = recompute_chunks(c_i, profile, decode_tokens)
    return profile.t_fwd(c_i) * c_i / 2 + n * profile.added_time(-(-c_i // n), decode_tokens) * c_other


def waste_of_discard(c_i: int, c_other: int, profile: Profile, decode_tokens: int = 0,
                     chunked: bool = True) -> float:
    """The waste of discarding: eq. 4 when recomputation is chunked, else
    eq. 1.  The one implementation every user of the equations calls
    (min-waste, LAMPS' handling term, the ablation's steps, reports)."""
    if chunked:
        return waste_chunked_discard(c_i, c_other, profile, decode_tokens)
    return waste_discard(c_i, c_other, profile)


def waste_swap(c_i: int, c_batch: int, profile: Profile) -> float:
    """Eq. 3: a synchronous swap out and in stalls the whole batch."""
    return 2 * profile.t_swap(c_i) * c_batch


def swap_iterations(c_i: int, profile: Profile, iteration_s: float, backlog_tokens: int = 0) -> int:
    """Iterations a budgeted swap of C_i tokens (behind ``backlog_tokens``
    already queued) takes one way; a huge number if nothing hides."""
    limit = profile.swap_limit_tokens(iteration_s)
    return -(-(c_i + backlog_tokens) // limit) if limit > 0 else 1 << 30


# ------------------------------------------------------------------- policies
class InterceptionPolicy:
    """Base of all handling policies.

    ``keeps_arrival``: a resumed request keeps its original arrival time in
    the ranking (InferCept's ImprovedDiscard; vLLM queued it as new).
    ``chunked_recompute``: recomputation goes in chunks under S mixed with
    decodes (else all at once).  ``budgeted_swap``: swaps move only what
    hides behind each forward pass (else the whole context, stalling the
    batch, as eq. 3 charges).
    """

    name = "policy"
    keeps_arrival = True
    chunked_recompute = True
    budgeted_swap = True

    def __init__(self, profile: Optional[Profile] = None, durations: Optional[DurationPredictor] = None):
        self.profile = profile
        self.durations: DurationPredictor = durations if durations is not None else ToolDurations()

    def expected_duration(self, ctx: InterceptedContext, now: float) -> float:
        """T_INT: the hint, else the tool's learned mean, raised to the time
        already waited once the call has outlived it (InferCept section 4.4)."""
        base = ctx.expected_duration_s
        if base is None:
            base = self.durations.estimate(ctx.tool)
        elapsed = max(0.0, now - ctx.call_time)
        return elapsed if base is None else max(base, elapsed)

    def decide(self, ctx: InterceptedContext, batch: BatchState = BatchState(), now: float = 0.0) -> Handling:
        raise NotImplementedError

    def plan(self, paused: Sequence[InterceptedContext], batch: BatchState = BatchState(),
             now: float = 0.0) -> Dict[Hashable, Handling]:
        """Handling for each of ``paused`` (contexts intercepted this
        iteration, or preserved ones to reconsider)."""
        return {c.id: self.decide(c, batch, now) for c in paused}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class Preserve(InterceptionPolicy):
    """Keep the KV of every paused context: never recomputes, holds memory."""

    name = "preserve"

    def decide(self, ctx, batch=BatchState(), now=0.0) -> Handling:
        return Handling.PRESERVE


class Discard(InterceptionPolicy):
    """Free the KV of every paused context and recompute it on resume.

    ``keeps_arrival=False, chunked_recompute=False`` is vLLM as the papers
    measured it (the resumed request queues as a new one, recomputes at once).
    """

    name = "discard"

    def __init__(self, profile=None, durations=None, *, keeps_arrival: bool = True,
                 chunked_recompute: bool = True, name: Optional[str] = None):
        super().__init__(profile, durations)
        self.keeps_arrival, self.chunked_recompute = keeps_arrival, chunked_recompute
        self.name = name or self.name

    def decide(self, ctx, batch=BatchState(), now=0.0) -> Handling:
        return Handling.DISCARD


class Swap(InterceptionPolicy):
    """Swap every paused context out to host memory (``budgeted``: at the
    link rate that hides behind the forward passes; else all at once)."""

    name = "swap"

    def __init__(self, profile=None, durations=None, *, budgeted: bool = True, name: Optional[str] = None):
        super().__init__(profile, durations)
        self.budgeted_swap = budgeted
        self.name = name or self.name

    def decide(self, ctx, batch=BatchState(), now=0.0) -> Handling:
        return Handling.SWAP


class MinWaste(InterceptionPolicy):
    """InferCept: preserve or (chunked) discard by eq. 5, after giving the
    swap budget to the contexts that would waste the most.

    The budget is pipelined across iterations: a context is swapped when its
    swap out (behind what is already queued) and back in fits in the call's
    expected time at the per-iteration swap limit, so the move hides behind
    forward passes and the request is back on the device when its tool
    returns.  ``swap=False`` or ``mode="heuristic"`` give the ablation steps
    of InferCept's Figure 3: swap within the budget then discard; swap within
    the budget then preserve short calls and discard long ones.
    """

    name = "infercept"

    def __init__(self, profile: Profile, durations=None, *, swap: bool = True, mode: str = "min-waste",
                 short_call_s: float = 1.0, name: Optional[str] = None):
        if profile is None:
            raise ValueError("the infercept policy needs a profile (forward and swap times)")
        if mode not in ("min-waste", "discard", "heuristic"):
            raise ValueError(f"unknown mode {mode!r}")
        super().__init__(profile, durations)
        self.swap, self.mode, self.short_call_s = swap, mode, short_call_s
        self.name = name or self.name

    def wastes(self, ctx: InterceptedContext, batch: BatchState, now: float) -> Dict[Handling, float]:
        """Token-seconds each handling would waste (eqs. 2 and 4)."""
        c, t_int = ctx.context_len, self.expected_duration(ctx, now)
        return {Handling.PRESERVE: waste_preserve(c, t_int),
                Handling.DISCARD: waste_of_discard(c, batch.context_tokens, self.profile, batch.decode_tokens,
                                                   self.chunked_recompute)}

    def _fallback(self, ctx: InterceptedContext, w: Dict[Handling, float], now: float) -> Handling:
        if self.mode == "discard":
            return Handling.DISCARD
        if self.mode == "heuristic":
            short = self.expected_duration(ctx, now) < self.short_call_s
            return Handling.PRESERVE if short else Handling.DISCARD
        return min(w, key=lambda h: (w[h], h is not Handling.PRESERVE))

    def decide(self, ctx, batch=BatchState(), now=0.0) -> Handling:
        return self.plan([ctx], batch, now)[ctx.id]

    def plan(self, paused, batch=BatchState(), now=0.0) -> Dict[Hashable, Handling]:
        scored = []
        for ctx in paused:
            w = self.wastes(ctx, batch, now)
            scored.append((min(w.values()), ctx, self._fallback(ctx, w, now)))
        scored.sort(key=lambda s: -s[0])  # most waste first gets the swap budget
        out: Dict[Hashable, Handling] = {}
        iteration_s = self.profile.t_fwd(batch.batched_tokens, batch.context_tokens)
        backlog = batch.swap_backlog_tokens
        for waste, ctx, fallback in scored:
            h = fallback
            if self.swap and waste > 0:
                t_int = self.expected_duration(ctx, now)
                moves = swap_iterations(ctx.context_len, self.profile, iteration_s, backlog)
                moves += swap_iterations(ctx.context_len, self.profile, iteration_s)
                if moves * iteration_s <= t_int:
                    h = Handling.SWAP
                    backlog += ctx.context_len
            out[ctx.id] = h
        return out


class Fixed(InterceptionPolicy):
    """The handling is given per context id (or per tool), as in a worked
    example; ``default`` otherwise."""

    name = "fixed"

    def __init__(self, by_id: Optional[Dict[Hashable, Handling]] = None, default: Handling = Handling.PRESERVE,
                 by_tool: Optional[Dict[str, Handling]] = None):
        super().__init__()
        self.by_id, self.by_tool, self.default = dict(by_id or {}), dict(by_tool or {}), default

    def decide(self, ctx, batch=BatchState(), now=0.0) -> Handling:
        if ctx.id in self.by_id:
            return self.by_id[ctx.id]
        return self.by_tool.get(ctx.tool, self.default)


#: Interception policies by configuration name.  ``vllm``: discard that
#: re-queues the request as new and recomputes at once (the papers' vLLM);
#: ``discard``: InferCept's ImprovedDiscard (keeps the arrival time);
#: ``discard-chunked``, ``swap-budget``, ``heuristic``: the ablation steps of
#: InferCept's Figure 3; ``infercept``: the whole min-waste policy.
INTERCEPTION_NAMES = ("infercept", "preserve", "discard", "swap", "vllm", "discard-chunked",
                      "swap-budget", "heuristic", "swap-sync")


def make_interception(name: str, profile: Optional[Profile] = None,
                      durations: Optional[DurationPredictor] = None) -> InterceptionPolicy:
    """Build a policy by its configuration name (raises ValueError naming
    the choices for an unknown one)."""
    if name == "preserve":
        return Preserve(profile, durations)
    if name == "vllm":
        return Discard(profile, durations, keeps_arrival=False, chunked_recompute=False, name="vllm")
    if name == "discard":
        return Discard(profile, durations, chunked_recompute=False)
    if name == "discard-chunked":
        return Discard(profile, durations, name="discard-chunked")
    if name == "swap":
        return Swap(profile, durations)
    if name == "swap-sync":
        return Swap(profile, durations, budgeted=False, name="swap-sync")
    if name in ("infercept", "swap-budget", "heuristic"):
        if profile is None:
            raise ValueError(f"interception policy {name!r} needs a profile")
        mode = {"infercept": "min-waste", "swap-budget": "discard", "heuristic": "heuristic"}[name]
        return MinWaste(profile, durations, mode=mode, name=name)
    raise ValueError(f"unknown interception policy {name!r}; choose one of {', '.join(INTERCEPTION_NAMES)}")


def best_case_waste(handling: Handling, c_i: int, t_int: float, batch: BatchState, profile: Profile,
                    budgeted: bool = True, chunked: bool = True) -> float:
    """Token-seconds of waste a handling costs one interception (for LAMPS'
    ranking and for reports): eq. 2, eq. 4 (or 1 unchunked), and for swap
    eq. 3, or with a budgeted swap only the memory held while the context
    drains out and fills back in (half of it on average, each way)."""
    if handling is Handling.PRESERVE:
        return waste_preserve(c_i, t_int)
    if handling is Handling.DISCARD:
        return waste_of_discard(c_i, batch.context_tokens, profile, batch.decode_tokens, chunked)
    if not budgeted:
        return waste_swap(c_i, batch.context_tokens + c_i, profile)
    it = profile.t_fwd(batch.batched_tokens, batch.context_tokens)
    return swap_iterations(c_i, profile, it) * it * c_i


__all__: List[str] = ["Handling", "InterceptedContext", "BatchState", "InterceptionPolicy", "Preserve",
                      "Discard", "Swap", "MinWaste", "Fixed", "make_interception", "INTERCEPTION_NAMES",
                      "waste_preserve", "waste_discard", "waste_chunked_discard", "waste_of_discard", "waste_swap",
                      "recompute_chunks", "swap_iterations", "best_case_waste"]
