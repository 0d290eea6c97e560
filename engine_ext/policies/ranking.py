"""Ranking of waiting work: which context the scheduler serves first.

The scheduler asks a ranking policy to order its waiting contexts and
preempts from the back of the running ones.  First-come-first-served is the
baseline; LAMPS' memory-over-time ranking plugs in here later.  Free of torch.
"""

from __future__ import annotations

from typing import Iterable, List, Protocol, TypeVar


class Rankable(Protocol):
    arrival: float  # monotonic time the work was submitted


T = TypeVar("T", bound=Rankable)


class RankingPolicy(Protocol):
    def order(self, items: Iterable[T]) -> List[T]:
        """Return ``items`` best first."""
        ...


class FCFS:
    """First come, first served (ties keep submission order)."""

    def order(self, items: Iterable[T]) -> List[T]:
        return sorted(items, key=lambda it: it.arrival)
