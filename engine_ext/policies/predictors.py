"""Online predictors the policies rank and decide with (LAMPS section 4.2).

*Tool duration* is predicted per tool name: tools of one kind take similar
times (LAMPS Table 2), so a running mean learned from finished calls is a
good estimate.  *Output length before the next call* is predicted per
application and prompt-length bucket from the segments seen so far; LAMPS
uses an OPT-125M classifier here, which plugs in behind the same two
methods.  Both start knowing nothing (``None``), and callers fall back to
what they know (a hint, InferCept's dynamic estimate).  Free of torch.
"""

from __future__ import annotations

import math
import threading
from typing import Dict, Hashable, Optional, Protocol, Tuple


class RunningMean:
    """Mean of the last ``window`` observations or so (exponential weights
    once past ``window``): tools drift, a mean over all history would not follow."""

    __slots__ = ("n", "mean", "window")

    def __init__(self, window: int = 64):
        self.n, self.mean, self.window = 0, 0.0, window

    def add(self, x: float) -> None:
        self.n += 1
        self.mean += (x - self.mean) / min(self.n, self.window)


class DurationPredictor(Protocol):
    def estimate(self, tool: Optional[str]) -> Optional[float]: ...
    def observe(self, tool: Optional[str], seconds: float) -> None: ...


class ToolDurations:
    """Seconds a call of each tool takes, learned online.  Thread-safe: the
    gateway's tool runtime and the engine thread both use it."""

    def __init__(self, window: int = 64, prior: Optional[Dict[str, float]] = None):
        self._by_tool: Dict[Optional[str], RunningMean] = {}
        self._lock = threading.Lock()
        self.window = window
        for tool, s in (prior or {}).items():
            self.observe(tool, s)

    def estimate(self, tool: Optional[str]) -> Optional[float]:
        m = self._by_tool.get(tool)
        return m.mean if m is not None and m.n else None

    def observe(self, tool: Optional[str], seconds: float) -> None:
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            return  # a clock glitch must not poison the estimate
        with self._lock:
            self._by_tool.setdefault(tool, RunningMean(self.window)).add(float(seconds))

    def snapshot(self) -> Dict[Optional[str], Tuple[int, float]]:
        with self._lock:
            return {t: (m.n, m.mean) for t, m in self._by_tool.items()}


class LengthPredictor(Protocol):
    def estimate(self, app: Hashable, prompt_tokens: int) -> Optional[int]: ...
    def observe(self, app: Hashable, prompt_tokens: int, output_tokens: int) -> None: ...


def length_bucket(prompt_tokens: int) -> int:
    """Prompt lengths in powers of two: 0-1, 2-3, 4-7, ..."""
    return max(0, int(prompt_tokens)).bit_length()


class OutputLengths:
    """Output tokens a segment (up to the next tool call, or the end)
    produces, per application and prompt-length bucket, learned online.
    Falls back to the application's mean over all buckets, then to None."""

    def __init__(self, window: int = 256):
        self._by_key: Dict[Tuple[Hashable, int], RunningMean] = {}
        self._by_app: Dict[Hashable, RunningMean] = {}
        self._lock = threading.Lock()
        self.window = window

    def estimate(self, app: Hashable, prompt_tokens: int) -> Optional[int]:
        m = self._by_key.get((app, length_bucket(prompt_tokens))) or self._by_app.get(app)
        return max(1, round(m.mean)) if m is not None and m.n else None

    def observe(self, app: Hashable, prompt_tokens: int, output_tokens: int) -> None:
        if not isinstance(output_tokens, int) or output_tokens < 0:
            return
        with self._lock:
            self._by_key.setdefault((app, length_bucket(prompt_tokens)), RunningMean(self.window)).add(output_tokens)
            self._by_app.setdefault(app, RunningMean(self.window)).add(output_tokens)
