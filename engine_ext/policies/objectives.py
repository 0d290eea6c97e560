"""Parrot's application-centric order (section 5.4) around any other ranking.

The gateway deduces, from the DAG of an application's semantic calls, which
calls are *latency-critical* (on the path to a variable fetched with the
latency criterion) and which form a *task group* (parallel calls of one
stage, whose completion as a whole matters, not each one's latency).  It
passes that to the engine in ``RequestHint.objective`` / ``task_group``; the
engine copies it into each request's :class:`SchedInfo`.

:class:`ObjectiveRanking` wraps the configured ranking (LAMPS, FCFS, ...):
the wrapped one orders everything first, then requests are stably regrouped
by class --

0. starving requests (the wrapped ranking's starvation prevention wins),
1. latency-critical requests,
2. requests with no deduced objective (plain OpenAI-endpoint traffic),
3. task groups, each group's members next to each other (so a step's token
   budget admits the group together and it finishes as a batch), groups in
   the order of their best-ranked member,
4. throughput requests outside any group.

Within a class the wrapped ranking's order stands, so one policy object
composes LAMPS' memory-over-time order with Parrot's objectives.  Free of
torch.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from .interception import Handling
from .ranking import Rankable, RankingPolicy, RankState, T

LATENCY, THROUGHPUT = "latency", "throughput"
OBJECTIVES = (LATENCY, THROUGHPUT)


def objective_class(item: Rankable) -> int:
    """The class (module doc) of one request: lower runs first."""
    s = item.sched
    if s.starving:
        return 0
    if s.objective == LATENCY:
        return 1
    if s.task_group is not None:
        return 3
    if s.objective == THROUGHPUT:
        return 4
    return 2


class ObjectiveRanking(RankingPolicy):
    """Parrot's classes around ``inner`` (module doc)."""

    def __init__(self, inner: RankingPolicy):
        if not isinstance(inner, RankingPolicy):
            raise TypeError(f"inner must be a RankingPolicy, got {type(inner).__name__}")
        self.inner = inner
        self.name = f"objectives+{inner.name}"

    def key(self, item: Rankable, state: RankState) -> float:
        return self.inner.key(item, state)

    def order(self, items: Iterable[T], state: RankState = RankState()) -> List[T]:
        ranked = self.inner.order(items, state)
        group_at: Dict[str, int] = {}
        for i, it in enumerate(ranked):
            g = it.sched.task_group
            if g is not None and not it.sched.starving:
                group_at.setdefault(g, i)

        def sort_key(pair):
            i, it = pair
            c = objective_class(it)
            return (c, group_at[it.sched.task_group] if c == 3 else 0, i)

        return [it for _, it in sorted(enumerate(ranked), key=sort_key)]

    def observe(self, scheduled: Iterable[Rankable], waiting: Iterable[Rankable]) -> None:
        self.inner.observe(scheduled, waiting)

    def handling_at_call(self, item: Rankable) -> Optional[Handling]:
        # the wrapped ranking's prediction (LAMPS' Algorithm 1); Parrot's classes do not change it
        return self.inner.handling_at_call(item)

    def on_interception(self, item: Rankable) -> None:
        hook = getattr(self.inner, "on_interception", None)
        if hook is not None:
            hook(item)

    def __getattr__(self, name: str):
        # what else the engine or a benchmark reads of the wrapped ranking (LAMPS' threshold, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
