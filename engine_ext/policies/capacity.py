"""Parrot's capacity regulation (section 5.4): an engine's token capacity set by its work's objective.

Decode time per token grows with the tokens the batch attends to (Parrot's
Figure 10: vLLM's time per output token turns up past ~6k running tokens on
an A100).  So an engine that runs a *latency-critical* request keeps the
aggregate tokens of the requests it runs under a small cap (Parrot's
example: 2,000 tokens, where throughput work alone may fill 64,000), while
an engine running only throughput work (task groups, plain traffic) fills up
to its memory.  Parrot: "if a latency-sensitive request is scheduled to an
LLM engine that can run up to 64,000 tokens of throughput-driven requests,
its capacity will be significantly reduced to 2,000 ... if it is scheduled
to an engine that has already been running a latency-sensitive request, the
capacity reduction is negligible."

The rule, one step at a time, over the requests with work in the ranking's
order (:class:`~.objectives.ObjectiveRanking` puts latency-critical ones
first):

* the *limit* is ``latency_tokens`` while any request with work is
  latency-critical, else ``throughput_tokens`` (None: no cap but memory);
* latency-critical requests always run (the cap bounds what runs *beside*
  them);
* every other request runs if the tokens of those running so far -- the
  latency-critical ones first, wherever they stand in the order -- plus its
  own context stay within the limit (first fit: starving requests first,
  then the rest in rank order), else it is *held*: not scheduled this step,
  its KV kept where it is (a held request is not preempted, it waits for
  capacity).

If nothing would run (no latency-critical request, and the first request
alone exceeds the limit), the first request runs anyway: a request larger
than the cap runs alone rather than never.

Starvation (LAMPS' threshold, which the engines apply to held requests as
to any passed-over one) moves a request to the front of the first fit; it
does not lift the cap.  It did at first, and the mixed run (``interlace
bench apps --mixed``, 2026-11-28) showed why it must not: the map calls of
a task group are held together, age together and cross the threshold in
the same step, so the whole group ran at once beside the chats -- and ahead
of them in the ranking's order -- and one repeat's chat p99 was 25.7 s
against 7.7 and 10.6 s in the other two (the job finished sooner than
without regulation).  Within the cap, starving work still always moves:
the room the latency work leaves goes to it first, and the engines run
held work when nothing else can run.

The latency-critical requests are counted first because an order need not
put them first: the native scheduler splits its decodes-then-prefills order
(a throughput decode ranks before a latency-critical prefill), vLLM its
running queue before its waiting one.  Counted where they stand, a latency
request arriving beside 2,000 tokens of running throughput decodes would
run beside all of them (4,000 tokens under a 2,048 cap); counted first, the
decodes that do not fit beside it are held.

A request's tokens are its context length (``SchedInfo.context_len``): what
its decode attends to, Parrot's "aggregate token count from all active
requests".  Free of torch: the native scheduler, vLLM's
``InterlaceScheduler`` and the simulator apply this one rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from .objectives import LATENCY
from .ranking import Rankable, T

#: Parrot's example of a latency engine's capacity (tokens)
DEFAULT_LATENCY_TOKENS = 2048


def is_latency(item: Rankable) -> bool:
    return item.sched.objective == LATENCY


@dataclass(frozen=True)
class CapacityPolicy:
    """Token capacity by objective (module doc).  ``latency_tokens`` None
    turns regulation off (every request runs as memory allows)."""

    latency_tokens: Optional[int] = DEFAULT_LATENCY_TOKENS
    throughput_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("latency_tokens", "throughput_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"capacity.{name} must be a positive integer or null, got {v!r}")
        if self.latency_tokens is not None and self.throughput_tokens is not None \
                and self.latency_tokens > self.throughput_tokens:
            raise ValueError(f"capacity.latency_tokens ({self.latency_tokens}) must not exceed "
                             f"capacity.throughput_tokens ({self.throughput_tokens})")

    @property
    def enabled(self) -> bool:
        return self.latency_tokens is not None or self.throughput_tokens is not None

    def limit(self, items: Iterable[Rankable]) -> Optional[int]:
        """The engine's capacity now: the latency cap while any of ``items``
        (the requests with work) is latency-critical, else the throughput cap."""
        if self.latency_tokens is not None and any(is_latency(it) for it in items):
            return self.latency_tokens
        return self.throughput_tokens

    def split(self, ordered: Sequence[T], limit: Optional[int] = None) -> Tuple[List[T], List[T]]:
        """``(run, held)`` of ``ordered`` (the ranking's order) under the
        limit (``limit(ordered)`` unless given): module doc's rule."""
        lim = self.limit(ordered) if limit is None else limit
        if lim is None:
            return list(ordered), []
        # the latency work's tokens first (module doc); the others first fit, starving ones first
        total = sum(_tokens(it) for it in ordered if always_runs(it))
        rest = [it for it in ordered if not always_runs(it)]
        fits: set = set()
        for it in sorted(rest, key=lambda it: not it.sched.starving):  # stable: rank order otherwise
            n = _tokens(it)
            if total + n <= lim:
                fits.add(id(it))
                total += n
        run = [it for it in ordered if always_runs(it) or id(it) in fits]
        held = [it for it in rest if id(it) not in fits]
        if not run and held:  # a request larger than the cap runs alone rather than never (module doc)
            run.append(held.pop(0))
        return run, held


def always_runs(item: Rankable) -> bool:
    """Latency-critical requests run whatever the cap (module doc)."""
    return is_latency(item)


def _tokens(item: Rankable) -> int:
    return max(0, int(item.sched.context_len))


#: regulation off: the engines' behaviour before capacity existed
NO_CAPACITY = CapacityPolicy(latency_tokens=None, throughput_tokens=None)
