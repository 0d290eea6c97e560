"""Performance objective deduction (Parrot section 5.2, Figure 9).

An application says what it cares about where it fetches a result: ``get``
with ``criterion=latency`` (someone waits for it) or ``throughput`` (bulk
work).  The calls that produce that variable, directly or through other
variables, inherit a scheduling preference:

* **throughput**: every call upstream of a throughput variable is
  throughput work.
* **latency**: calls are placed on reverse *stages*, a call's stage being
  the longest chain of calls from it to a latency-critical variable (its
  direct producers are stage 0).  Stage-0 calls are latency-critical; so is
  a stage holding a single call (a sequential step everything after it
  waits for -- Request 3 of Figure 9).  A stage holding two or more calls
  is a *task group*: parallel work whose completion as a whole matters (the
  map stage of a map-reduce), scheduled together with a large batch rather
  than each for its own latency.

Latency wins where the two meet.  The result feeds ``RequestHint.objective``
/ ``task_group`` and, in the engine, :class:`ObjectiveRanking`.  Pure
functions over a small graph view; no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .objectives import LATENCY, THROUGHPUT


@dataclass(frozen=True)
class CallNode:
    """What deduction needs of a call: the variables it reads and writes."""

    id: str
    inputs: Sequence[str]
    outputs: Sequence[str]


@dataclass(frozen=True)
class Preference:
    objective: Optional[str]          # "latency", "throughput" or None (nothing fetched depends on it)
    task_group: Optional[str] = None  # calls of one parallel stage share it
    stage: Optional[int] = None       # reverse stage from a latency-critical variable


def deduce(calls: Iterable[CallNode], criteria: Mapping[str, str], group_prefix: str = "tg") -> Dict[str, Preference]:
    """Each call's :class:`Preference` given the variables' criteria
    (variable id -> ``latency`` / ``throughput``)."""
    calls = list(calls)
    producer: Dict[str, CallNode] = {v: c for c in calls for v in c.outputs}
    consumers: Dict[str, List[CallNode]] = defaultdict(list)
    for c in calls:
        for v in c.inputs:
            consumers[v].append(c)

    def upstream(var_ids: Iterable[str]) -> Dict[str, CallNode]:
        seen: Dict[str, CallNode] = {}
        todo = [producer[v] for v in var_ids if v in producer]
        while todo:
            c = todo.pop()
            if c.id in seen:
                continue
            seen[c.id] = c
            todo += [producer[v] for v in c.inputs if v in producer]
        return seen

    latency_vars = {v for v, k in criteria.items() if k == LATENCY}
    throughput_calls = upstream(v for v, k in criteria.items() if k == THROUGHPUT)
    latency_calls = upstream(latency_vars)

    # stage = longest path to a latency-critical variable, over the calls upstream of one
    stage: Dict[str, int] = {}

    def stage_of(c: CallNode, visiting: Tuple[str, ...] = ()) -> int:
        if c.id in stage:
            return stage[c.id]
        best = 0 if any(v in latency_vars for v in c.outputs) else -1
        for v in c.outputs:
            for d in consumers.get(v, ()):
                if d.id in latency_calls and d.id not in visiting:  # the graph is acyclic; belt and braces
                    best = max(best, stage_of(d, visiting + (c.id,)) + 1)
        stage[c.id] = best
        return best

    by_stage: Dict[int, List[str]] = defaultdict(list)
    for c in latency_calls.values():
        by_stage[stage_of(c)].append(c.id)

    out: Dict[str, Preference] = {c.id: Preference(THROUGHPUT if c.id in throughput_calls else None)
                                  for c in calls}
    for s, ids in by_stage.items():
        grouped = s > 0 and len(ids) > 1
        for cid in ids:
            out[cid] = (Preference(THROUGHPUT, f"{group_prefix}{s}", s) if grouped
                        else Preference(LATENCY, None, s))
    return out
