"""Paired OFF/ON measurements of partial tool execution, and what may be
concluded from them.

Why pairs.  On a shared machine a run's latency moves by seconds between
runs; comparing the median of the OFF runs with the median of the ON runs
(and a bound built from medians of each round's parts, a sum of medians
that is not the median of the sums) let an earlier version of this benchmark
report "153% of the theoretical best", i.e. an ON latency below Conveyor's
lower bound: the measurement, not the system, was off.  Here each OFF run is
paired with the ON run measured right after (or right before) it, and every
number that compares the two modes is computed inside a pair and only then
summarised over pairs (median and min-max), never as a ratio of medians.

The bound of one pair (Conveyor, Xu et al. 2024, section 3.4, equation 2),
from the OFF run's own decode times ``g_i`` (round start to the pause at the
call's end marker), tool times ``t_i`` (that pause to the round's last tool
result) and final round ``g_{n+1}``::

    L_old  = sum(g_i + t_i) + g_{n+1}               (eq. 2, upper end)
    L_best = sum(max(g_i, t_i)) + g_{n+1}           (eq. 2, lower end)

The OFF run's end-to-end latency ``L_off`` also holds a few milliseconds that
are neither decoding nor tool time (request handling, formatting results,
streaming): ``other = L_off - sum(g_i + t_i) - g_{n+1}``.  ON pays them as
well, so both ends get them: ``L_old = L_off`` and ``L_best`` = eq. 2's lower
end + ``other``, the bound on the ON latency of this pair.  The most partial
execution can save is ``L_old - L_best = sum(min(g_i, t_i))``.  Per pair::

    efficiency = (L_off - L_on) / (L_old - L_best)

A pair with ``L_on < L_best`` (efficiency above 100%) is a
measurement error (the modes decoded at different speeds, or the machine's
load changed between the two runs): it is flagged and counted, never
reported as a result above 100%.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

#: Below this share of L_old the saving partial execution could make is lost in
#: the noise (a 1 ms calculator call), so no efficiency is computed.
MIN_SAVING_SHARE = 0.01


@dataclass(frozen=True)
class Timing:
    """One run's measured parts (seconds): what :func:`pair` needs."""

    latency_s: float           # end to end (Validation: until the tool error is known)
    g: Sequence[float]         # decode time of each round that ended in tool calls
    t: Sequence[float]         # tool time after each such round's decoding (pause -> last result)
    g_final: float             # the final round's decode time


@dataclass(frozen=True)
class Pair:
    """One OFF run and its ON partner, compared."""

    off_s: float
    on_s: float
    parts_s: float             # eq. 2's L_old from the OFF run's parts: sum(g_i + t_i) + g_{n+1}
    other_s: float             # off_s - parts_s: neither decoding nor tools (both modes pay it)
    l_old_s: float             # parts_s + other_s (= off_s)
    l_best_s: float            # eq. 2's L_best + other_s: the bound on on_s
    max_saving_s: float        # L_old - L_best = sum(min(g_i, t_i))
    saved_s: float             # L_off - L_on
    below_bound: bool          # L_on < L_best: a measurement error, flagged
    hideable: bool             # the possible saving is at least MIN_SAVING_SHARE of L_old
    efficiency: Optional[float]  # saved / max_saving; None when flagged or the possible saving is noise
    improvement: float         # L_off / L_on - 1 (the paper's metric, for this pair)
    theoretical: float         # L_old / L_best - 1 (the best improvement, for this pair)
    decode_ratio: Optional[float]  # ON decode time / OFF decode time (1.0: both modes decoded alike)

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def pair(off: Timing, on: Timing, min_saving_share: float = MIN_SAVING_SHARE) -> Pair:
    """Compare one OFF run with its ON partner (see the module docstring)."""
    if len(off.g) != len(off.t):
        raise ValueError(f"OFF run has {len(off.g)} decode times but {len(off.t)} tool times")
    parts = sum(g + t for g, t in zip(off.g, off.t)) + off.g_final
    max_saving = sum(min(g, t) for g, t in zip(off.g, off.t))
    other = off.latency_s - parts
    l_old = off.latency_s                        # = parts + other
    l_best = l_old - max_saving                  # = sum(max(g_i, t_i)) + g_{n+1} + other
    saved = off.latency_s - on.latency_s
    below = on.latency_s < l_best
    useful = max_saving >= min_saving_share * max(l_old, 1e-9)
    off_decode = sum(off.g) + off.g_final
    on_decode = sum(on.g) + on.g_final
    return Pair(
        off_s=off.latency_s, on_s=on.latency_s, parts_s=parts, other_s=other, l_old_s=l_old, l_best_s=l_best,
        max_saving_s=max_saving, saved_s=saved, below_bound=below, hideable=useful,
        efficiency=(saved / max_saving) if useful and not below else None,
        improvement=off.latency_s / on.latency_s - 1 if on.latency_s > 0 else float("nan"),
        theoretical=(l_old / l_best - 1) if l_best > 0 else float("nan"),
        decode_ratio=(on_decode / off_decode) if off_decode > 0 else None,
    )


@dataclass(frozen=True)
class Spread:
    """Median and range of a per-pair quantity."""

    n: int
    median: float
    lo: float
    hi: float

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def spread(values: Sequence[Optional[float]]) -> Optional[Spread]:
    """Median, min and max of the values that exist (``None`` ones are left out); None if none do."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return Spread(len(xs), statistics.median(xs), min(xs), max(xs))


def summarize_pairs(pairs: Sequence[Pair]) -> Dict[str, Any]:
    """Per-pair quantities summarised over pairs (median and range), plus the flagged count.

    The efficiency summary uses only pairs with a defined efficiency, which
    excludes flagged pairs; by construction it never exceeds 1.0."""
    eff = spread([p.efficiency for p in pairs])
    return {
        "pairs": len(pairs),
        "below_bound": sum(p.below_bound for p in pairs),
        "hideable": sum(p.hideable for p in pairs),
        "efficiency": _d(eff),
        "max_saving_s": _d(spread([p.max_saving_s for p in pairs])),
        "saved_s": _d(spread([p.saved_s for p in pairs])),
        "improvement": _d(spread([p.improvement for p in pairs])),
        "theoretical": _d(spread([p.theoretical for p in pairs])),
        "decode_ratio": _d(spread([p.decode_ratio for p in pairs])),
        "other_s": _d(spread([p.other_s for p in pairs])),
    }


def _d(s: Optional[Spread]) -> Optional[Dict[str, Any]]:
    return s.to_dict() if s else None


# ----------------------------------------------------------------------- parallel tools in OFF runs


def concurrency(results: Sequence[Dict[str, Any]], round_ends: Sequence[float]) -> List[Dict[str, Any]]:
    """For each round, the independent calls of one tool made in it (two or
    more), and whether they really ran at the same time.

    ``results`` are the gateway's server tool results (``started_at``: the
    call's name was decoded; ``tool_started_at``: the gateway asked the tool
    to run; ``finished_at``), ``round_ends`` the absolute times of the pauses
    that ended each round.  "Independent": no ``depends_on`` (plan steps).

    The gateway's ``tool_started_at`` is when it asked for the run, not when
    a worker took the call: with too few workers both calls "start" together
    and the second waits inside.  So calls of the same tool (same cost) count
    as concurrent only if they started AND ended close together: starts
    within a tenth of the shortest call, ends within half of it.  Queued one
    after the other, the ends would be a whole call apart.
    """
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in results:
        args = r.get("arguments")
        if isinstance(args, dict) and args.get("depends_on"):
            continue
        if r.get("tool_started_at") is None:
            continue
        rnd = next((i for i, end in enumerate(round_ends) if r["started_at"] <= end), len(round_ends))
        groups.setdefault((rnd, r["name"]), []).append(r)
    out = []
    for (rnd, name), calls in sorted(groups.items()):
        if len(calls) < 2:
            continue
        starts = [c["tool_started_at"] for c in calls]
        ends = [c["finished_at"] for c in calls]
        durations = [e - s for s, e in zip(starts, ends)]
        shortest = min(durations)
        start_spread, end_spread = max(starts) - min(starts), max(ends) - min(ends)
        out.append({
            "round": rnd, "tool": name, "calls": len(calls),
            "start_spread_s": start_spread, "end_spread_s": end_spread,
            "shortest_s": shortest, "span_s": max(ends) - min(starts),
            "intervals_overlap": max(starts) < min(ends),
            "concurrent": (max(starts) < min(ends) and start_spread <= 0.1 * shortest
                           and end_spread <= 0.5 * shortest),
        })
    return out
