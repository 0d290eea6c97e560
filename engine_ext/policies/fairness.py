"""Fair admission across tenants (API keys): whose waiting request the engine admits next.

The rankings (LAMPS, FCFS, SJF, Parrot's objectives) order requests by what
serves the whole batch best and know nothing of whose they are, so one
caller's burst queues ahead of everyone else's: in the adversarial trial a
4-token chat of one key waited 106 s behind another key's batch of 256
semantic calls.  This module is the one rule both engines apply to their
waiting requests (the native scheduler's prefills that hold no KV yet, and
vLLM's waiting queue in ``InterlaceScheduler``):

* the next request admitted is the best-ranked waiting request of the tenant
  with the **fewest requests running** (admitted and not finished); each
  request placed counts as running from then on, so tenants with equal load
  alternate, and ties go to the tenant whose head the ranking put first;
* **within a tenant the ranking's order stands**, and with a single tenant
  (a gateway without API keys) the order is exactly the ranking's;
* **starvation prevention still wins**: requests the ranking marked starving
  (LAMPS' ``sched.starving``) go before all others, fairly ordered among
  themselves -- so every request is admitted within the ranking's starvation
  threshold whatever the other tenants send.

A tenant is ``SchedInfo.tenant`` (the ``RequestHint``'s), None being the one
anonymous tenant.  Max-min fairness on running requests, not on tokens: a
tenant's long requests are bounded by the gateway's per-key limits instead.
Free of torch.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict, deque
from typing import Deque, Dict, Iterable, List, Mapping, Optional, Sequence, TypeVar

from .ranking import Rankable

T = TypeVar("T", bound=Rankable)


def tenant_of(item: Rankable) -> Optional[str]:
    return item.sched.tenant


def running_by_tenant(items: Iterable[Rankable]) -> Counter:
    """How many of ``items`` (the running requests) each tenant has."""
    return Counter(tenant_of(it) for it in items)


def fair_order(ranked: Sequence[T], running: Optional[Mapping[Optional[str], int]] = None) -> List[T]:
    """``ranked`` (waiting requests, best first by the ranking) in fair
    admission order, given the requests each tenant has ``running`` now
    (module doc)."""
    if len({tenant_of(it) for it in ranked}) < 2:
        return list(ranked)
    load: Dict[Optional[str], int] = Counter(running or {})
    starving = [it for it in ranked if it.sched.starving]
    rest = [it for it in ranked if not it.sched.starving]
    return _merge(starving, load) + _merge(rest, load)


def _merge(ranked: Sequence[T], load: Dict[Optional[str], int]) -> List[T]:
    queues: Dict[Optional[str], Deque[tuple]] = defaultdict(deque)
    for i, it in enumerate(ranked):
        queues[tenant_of(it)].append((i, it))
    # (load, position of the tenant's head in the ranking, tenant): positions are unique, so the
    # tenant (possibly None) is never compared
    heap: List[tuple] = [(load.get(t, 0), q[0][0], t) for t, q in queues.items()]
    heapq.heapify(heap)
    out: List[T] = []
    while heap:
        n, _, t = heapq.heappop(heap)
        q = queues[t]
        out.append(q.popleft()[1])
        load[t] = n + 1
        if q:
            heapq.heappush(heap, (n + 1, q[0][0], t))
    return out


__all__: Sequence[str] = ["fair_order", "running_by_tenant", "tenant_of"]
