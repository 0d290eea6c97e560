"""Ranking of waiting work: which request the scheduler serves first.

Every iteration the scheduler asks a ranking to order its candidates, fills
the batch from the front, preempts from the back, and then tells the ranking
which were served (:meth:`RankingPolicy.observe`) so it can count starvation.

* ``fcfs``      -- arrival order (InferCept, vLLM).
* ``sjf``       -- shortest predicted remaining output first.
* ``sjf-total`` -- shortest output plus tool time (both in iterations).
* ``lamps``     -- LAMPS: least *memory over time* first.  A request's score
  is the area under its memory curve up to its next tool call (its context
  grows one token per iteration) plus the waste of the handling predicted
  for that call by the InferCept equations (preserve holds the context for
  the whole call; discard costs recomputation that stalls the batch; swap
  costs the link time).  Starvation prevention (its Algorithm 1): a request
  passed over ``starvation_threshold`` iterations in a row goes to the head
  and stays there until it completes; scores are refreshed every
  ``refresh_interval`` iterations (selective update) rather than every one.
  ``horizon="segment"`` scores up to the next call, as the paper does (each
  call starts a new "request"); ``horizon="job"`` (Interlace's default)
  adds the later segments' memory over time and call waste when they are
  known or predicted (``SchedInfo.future``), so a long multi-call job does
  not look short at each of its segments -- the paper's own remark that
  segmenting "does not account for the cumulative memory consumption of
  the entire job".  ``handling_at_call=True`` applies, at the call, the
  handling LAMPS predicted for the segment (Algorithm 1, lines 5 and 35-42:
  the request goes to the preserve, discard or swap queue its label names,
  and stays there until its call returns) instead of letting the runtime
  interception policy decide afresh with the batch of that moment.

C_other, one meaning in every engine and the simulator: the KV tokens on
the device of the requests *running* at the moment of the decision
(decoding or prefilling; not paused, not swapped out or swapping), without
the deciding context.  Rankings get it in
:attr:`RankState.batch_context_tokens`, interception decisions in
``BatchState.context_tokens``.

Items are the engines' own request objects; a ranking reads ``arrival`` and
``sched`` (a :class:`SchedInfo` the engine keeps up to date) and writes
only ``sched``'s ranking fields.  Free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Protocol, Sequence, Tuple, TypeVar

from .costmodel import Profile
from .interception import (BatchState, Handling, InterceptedContext, InterceptionPolicy, best_case_waste)


@dataclass
class SchedInfo:
    """What rankings know of one request (kept by the engine or simulator)."""

    context_len: int = 0                   # tokens in its context now
    segment_generated: int = 0             # tokens generated since its last tool call (or start)
    expected_output: Optional[int] = None  # predicted tokens of this segment (to the next call or the end)
    expected_tool: Optional[str] = None
    expected_tool_s: Optional[float] = None  # predicted time of the call ending this segment (None: no call)
    handling: Optional[Handling] = None    # handling fixed for that call (a worked example), else predicted
    # the segments after this one, when known or predicted: (output tokens, call seconds or None, result tokens)
    future: Tuple[Tuple[int, Optional[float], int], ...] = ()
    # Parrot's deduced preference (ObjectiveRanking): "latency", "throughput" or None, and the task group
    objective: Optional[str] = None
    task_group: Optional[str] = None
    tenant: Optional[str] = None  # whose request (the API key's name): fairness.py orders admissions by it
    # owned by the ranking:
    predicted_handling: Optional[Handling] = None  # LAMPS' prediction, once per segment (Algorithm 1, line 5)
    future_score: Optional[float] = None           # the later segments' part of a job-horizon score
    starvation: int = 0
    starving: bool = False
    score: Optional[float] = None
    scored_at: int = -(1 << 30)

    @property
    def remaining_output(self) -> int:
        if self.expected_output is None:
            return 1 << 20  # unknown: behind every known one (ties keep arrival order)
        return max(1, self.expected_output - self.segment_generated)


class Rankable(Protocol):
    arrival: float  # when the request arrived (kept across interceptions by ImprovedDiscard)
    sched: SchedInfo


T = TypeVar("T", bound=Rankable)


@dataclass(frozen=True)
class RankState:
    """The engine's state a ranking may use.

    ``batch_context_tokens`` is C_other (module doc): the device KV tokens
    of the requests running when the ranking is asked (decoding or
    prefilling; not paused, not swapped out or swapping in).  One number
    for the whole ranked set: a running request's own context is among
    them, a waiting one's is not (LAMPS predicts a segment's handling once,
    when the segment is first scored, usually while it waits).  None only
    where an engine cannot know it: LAMPS then assumes a full cache around
    the request (capacity minus its context).
    """

    iteration: int = 0
    iteration_s: float = 1.0                    # a recent iteration's time (converts tool time to iterations)
    batch_context_tokens: Optional[int] = None  # C_other: the running requests' device KV tokens (None: unknown)


class RankingPolicy:
    name = "ranking"

    def key(self, item: Rankable, state: RankState) -> float:
        raise NotImplementedError

    def order(self, items: Iterable[T], state: RankState = RankState()) -> List[T]:
        """``items`` best first (ties in arrival order)."""
        return sorted(items, key=lambda it: (self.key(it, state), it.arrival))

    def observe(self, scheduled: Iterable[Rankable], waiting: Iterable[Rankable]) -> None:
        """Called after each iteration with what ran and what waited."""

    def handling_at_call(self, item: Rankable) -> Optional[Handling]:
        """The handling ``item``'s call must get now that it has reached it,
        as the ranking predicted it for the segment; None: the interception
        policy decides afresh (every ranking but LAMPS with
        ``handling_at_call=True``).  Engines ask *before*
        ``on_interception`` (which starts the next segment's prediction)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class FCFS(RankingPolicy):
    """First come, first served."""

    name = "fcfs"

    def order(self, items, state=RankState()):
        return sorted(items, key=lambda it: it.arrival)

    def key(self, item, state):
        return item.arrival


class SJF(RankingPolicy):
    """Shortest (predicted) remaining output first."""

    name = "sjf"

    def key(self, item, state):
        return item.sched.remaining_output


class SJFTotal(RankingPolicy):
    """Shortest output plus tool time first (LAMPS' "SJF by total length")."""

    name = "sjf-total"

    def key(self, item, state):
        s = item.sched
        return s.remaining_output + (s.expected_tool_s or 0.0) / max(state.iteration_s, 1e-12)


class LAMPS(RankingPolicy):
    """Least memory over time first, with starvation prevention (module doc).

    The handling term charges the call with the waste of the handling
    predicted for it (``interception.decide`` on the predicted context at
    the call, the predicted call time and C_other = the running requests'
    device KV from :class:`RankState`; a full cache only when the engine
    passes None).  ``handling_at_call``: that prediction is also what the
    call gets (:meth:`handling_at_call`), as in the paper's Algorithm 1.
    """

    name = "lamps"

    def __init__(self, profile: Profile, interception: Optional[InterceptionPolicy] = None, *,
                 starvation_threshold: int = 100, refresh_interval: int = 1, horizon: str = "job",
                 handling_at_call: bool = False):
        if horizon not in ("segment", "job"):
            raise ValueError(f"horizon must be 'segment' or 'job', got {horizon!r}")
        if not isinstance(handling_at_call, bool):
            raise ValueError(f"handling_at_call must be a boolean, got {handling_at_call!r}")
        self.horizon = horizon
        self.apply_at_call = handling_at_call
        self._last_state = RankState()
        if not isinstance(starvation_threshold, int) or starvation_threshold < 1:
            raise ValueError(f"starvation_threshold must be a positive integer, got {starvation_threshold!r}")
        if not isinstance(refresh_interval, int) or refresh_interval < 1:
            raise ValueError(f"refresh_interval must be a positive integer, got {refresh_interval!r}")
        self.profile = profile
        self.interception = interception
        self.starvation_threshold = starvation_threshold
        self.refresh_interval = refresh_interval

    def predicted_handling(self, item: Rankable, c_call: int, t_call_s: float, batch: BatchState) -> Handling:
        s = item.sched
        if s.handling is not None:
            return s.handling
        if s.predicted_handling is None:
            s.predicted_handling = Handling.PRESERVE if self.interception is None else self.interception.decide(
                InterceptedContext(c_call, expected_duration_s=t_call_s, tool=s.expected_tool, id=id(item)), batch)
        return s.predicted_handling

    def _c_other(self, c_call: int, state: RankState) -> int:
        """C_other of the prediction: the running requests' device KV (the
        one meaning, module doc); a full cache only when it is unknown."""
        if state.batch_context_tokens is not None:
            return state.batch_context_tokens
        return max(0, self.profile.kv_capacity_tokens - c_call)

    def _call_waste(self, item: Rankable, c_call: int, t_call_s: float, state: RankState,
                    handling: Optional[Handling] = None) -> float:
        """Iterations-worth of waste of the call at context ``c_call``."""
        batch = BatchState(context_tokens=self._c_other(c_call, state))
        h = handling or self.predicted_handling(item, c_call, t_call_s, batch)
        ic = self.interception
        budgeted = ic.budgeted_swap if ic is not None else True
        chunked = ic.chunked_recompute if ic is not None else True
        return best_case_waste(h, c_call, t_call_s, batch, self.profile, budgeted, chunked) / max(state.iteration_s,
                                                                                                  1e-12)

    def score(self, item: Rankable, state: RankState) -> float:
        """Token-iterations of memory until the next call (or, with the job
        horizon, the end), plus the predicted handlings' waste."""
        s = item.sched
        c0, o = s.context_len, s.remaining_output
        area = o * c0 + o * (o + 1) / 2  # the context after each of the o iterations
        c_call = c0 + o
        if s.expected_tool_s is not None:
            area += self._call_waste(item, c_call, s.expected_tool_s, state)
        # later segments count with or without a call ending this one: a Semantic Variables call's
        # downstream calls (gateway/semantic/dag.py) follow its end, not a tool call
        if self.horizon == "job" and s.future:
            if s.future_score is None:
                s.future_score = self._future_score(item, c_call, state)
            area += s.future_score
        return area

    def _future_score(self, item: Rankable, c: int, state: RankState) -> float:
        """Memory over time of the later segments (computed once per segment)."""
        total = 0.0
        for out, call_s, result in item.sched.future:
            c += result  # the previous call's result is prefilled
            total += out * c + out * (out + 1) / 2
            c += out
            if call_s is not None:
                # predicted like the current call's, without caching it as this segment's
                h = None
                if self.interception is not None and item.sched.handling is None:
                    h = self.interception.decide(InterceptedContext(c, expected_duration_s=call_s, id=id(item)),
                                                 BatchState(context_tokens=self._c_other(c, state)))
                total += self._call_waste(item, c, call_s, state, h or item.sched.handling or Handling.PRESERVE)
        return total

    def key(self, item, state):
        s = item.sched
        if s.score is None or state.iteration - s.scored_at >= self.refresh_interval:
            s.score, s.scored_at = self.score(item, state), state.iteration
        return s.score

    def order(self, items, state=RankState()):
        self._last_state = state
        ranked = sorted(items, key=lambda it: (self.key(it, state), it.arrival))
        return [it for it in ranked if it.sched.starving] + [it for it in ranked if not it.sched.starving]

    def handling_at_call(self, item: Rankable) -> Optional[Handling]:
        """With ``handling_at_call``: the handling predicted for the segment
        that just reached its call (Algorithm 1, line 5, applied at lines
        35-42) -- fixed by a worked example, else the one predicted when the
        segment was scored, else (a segment never scored, e.g. it never
        waited) predicted now from the last ranking's state.  None when the
        option is off or no call was predicted (no expected call time): the
        interception policy decides afresh."""
        if not self.apply_at_call:
            return None
        s = item.sched
        if s.handling is not None:
            return s.handling
        if s.predicted_handling is None:
            if s.expected_tool_s is None:
                return None
            c = s.context_len
            self.predicted_handling(item, c, s.expected_tool_s,
                                    BatchState(context_tokens=self._c_other(c, self._last_state)))
        return s.predicted_handling

    def observe(self, scheduled, waiting):
        for it in scheduled:
            if not it.sched.starving:
                it.sched.starvation = 0
        for it in waiting:
            s = it.sched
            if s.starving:
                continue
            s.starvation += 1
            if s.starvation >= self.starvation_threshold:
                s.starving, s.starvation = True, 0

    @staticmethod
    def on_interception(item: Rankable) -> None:
        """A request that reaches a tool call starts a new segment: its
        counter restarts (unless it is already prioritized) and its score
        is recomputed."""
        s = item.sched
        if not s.starving:
            s.starvation = 0
        s.score = s.predicted_handling = s.future_score = None


RANKING_NAMES = ("lamps", "fcfs", "sjf", "sjf-total")


def make_ranking(name: str, profile: Optional[Profile] = None,
                 interception: Optional[InterceptionPolicy] = None, *, starvation_threshold: int = 100,
                 refresh_interval: int = 1, horizon: str = "job",
                 handling_at_call: bool = False) -> RankingPolicy:
    """Build a ranking by its configuration name (ValueError names the choices).
    ``horizon`` and ``handling_at_call`` are LAMPS' options (module doc);
    the other rankings have neither."""
    if horizon not in ("segment", "job"):
        raise ValueError(f"horizon must be 'segment' or 'job', got {horizon!r}")
    if not isinstance(handling_at_call, bool):
        raise ValueError(f"handling_at_call must be a boolean, got {handling_at_call!r}")
    if name == "fcfs":
        return FCFS()
    if name == "sjf":
        return SJF()
    if name == "sjf-total":
        return SJFTotal()
    if name == "lamps":
        if profile is None:
            raise ValueError("the lamps ranking needs a profile")
        return LAMPS(profile, interception, starvation_threshold=starvation_threshold,
                     refresh_interval=refresh_interval, horizon=horizon, handling_at_call=handling_at_call)
    raise ValueError(f"unknown ranking {name!r}; choose one of {', '.join(RANKING_NAMES)}")


__all__: Sequence[str] = ["SchedInfo", "Rankable", "RankState", "RankingPolicy", "FCFS", "SJF", "SJFTotal",
                          "LAMPS", "make_ranking", "RANKING_NAMES"]
