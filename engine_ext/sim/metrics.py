"""Per-request records and the metrics both the simulator and the native
bench report, so their numbers mean the same thing.

* normalized latency (InferCept's metric): ``(finish - arrival - tool_s) /
  output_tokens`` -- tool time is removed because it is the same under every
  policy; p50 is what InferCept plots against the request rate;
* end-to-end latency ``finish - arrival`` (LAMPS reports mean and p99);
* TTFT ``first_token - arrival``;
* ``rps``: completed requests per second of ``wall_s``;
* ``kv_waste_gb_s``: GPU memory wasted by interceptions (the engine or
  simulator says what it counts), in GB*s.

Percentiles interpolate linearly between the closest ranks (numpy's default
"linear" method): ``p`` of sorted ``xs`` is ``xs[i] + (xs[i+1] - xs[i]) * f``
with ``i + f = p / 100 * (n - 1)``.  With no completed request every latency
metric is ``None`` (there is nothing to report, and 0 would read as "fast");
``completed`` and ``rps`` are 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence


@dataclass(frozen=True)
class RequestRecord:
    id: str
    arrival: float
    first_token: float
    finish: float
    tool_s: float
    output_tokens: int

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def norm_latency(self) -> float:
        return (self.finish - self.arrival - self.tool_s) / max(1, self.output_tokens)


def percentile(xs: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (module doc); ValueError on no data."""
    if not xs:
        raise ValueError("percentile of no data")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    s = sorted(xs)
    pos = p / 100 * (len(s) - 1)
    i = int(math.floor(pos))
    if i >= len(s) - 1:
        return float(s[-1])
    return float(s[i] + (s[i + 1] - s[i]) * (pos - i))


def _mean(xs: List[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def summarize(records: Iterable[RequestRecord], wall_s: float, kv_waste_gb_s: float = 0.0,
              extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The metrics of the module doc as one flat dict (``extra`` merged in)."""
    recs = list(records)
    if not (isinstance(wall_s, (int, float)) and math.isfinite(wall_s) and wall_s >= 0):
        raise ValueError(f"wall_s must be a finite number >= 0, got {wall_s!r}")
    norm = [r.norm_latency for r in recs]
    e2e = [r.e2e for r in recs]
    ttft = [r.ttft for r in recs]

    def pct(xs: List[float], p: float) -> Optional[float]:
        return percentile(xs, p) if xs else None
    out: Dict[str, Any] = {
        "completed": len(recs),
        "rps": len(recs) / wall_s if wall_s > 0 else 0.0,
        "norm_latency_p50": pct(norm, 50), "norm_latency_p90": pct(norm, 90), "norm_latency_p99": pct(norm, 99),
        "e2e_mean": _mean(e2e), "e2e_p99": pct(e2e, 99),
        "ttft_mean": _mean(ttft), "ttft_p99": pct(ttft, 99),
        "kv_waste_gb_s": float(kv_waste_gb_s),
        "wall_s": float(wall_s),
    }
    if extra:
        out.update(extra)
    return out
