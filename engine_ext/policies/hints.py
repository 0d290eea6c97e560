"""Online predictions of a request's segments: what the gateway (and the
simulator and benchmarks, under the product's conditions) tells LAMPS.

LAMPS ranks by memory over time *up to the next tool call*, plus the waste
of the handling that call will get; with ``horizon="job"`` also the later
segments.  None of that is known when a request arrives, so it is learned
from the requests that finished, per *application* (the gateway's app key:
model and API key; a trace's application in the simulator):

* output tokens of a segment: :class:`OutputLengths` (per app and
  prompt-length bucket);
* whether a call follows and how long it takes: the app's segment counts
  (:class:`RoundsLeft`) and its calls' mean time (per app), or the learned
  time of a named tool (:class:`ToolDurations`) once the model has written
  the call;
* the tokens a call's result adds: a running mean per app.

A segment is predicted to end in a call when at least half of the app's
finished requests that got this far went on (``P(rounds > k+1 | rounds >
k) >= 0.5``); the later segments (``future``) are the expected number of
rounds left, each with the app's mean output, call time and result size.
Everything starts unknown (``None`` / ``()``): the ranking then falls back
to what it knows (no call term, the bare memory area).  Thread-safe; free
of torch.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Hashable, Optional, Tuple

from .predictors import OutputLengths, RunningMean, ToolDurations

#: one later segment: (output tokens, call seconds or None for the last, tokens its call's result adds)
Segment = Tuple[int, Optional[float], int]


@dataclass(frozen=True)
class SegmentPrediction:
    """The ranking's inputs for one segment (the fields of ``RequestHint``)."""

    expected_output: Optional[int] = None
    expected_tool: Optional[str] = None
    expected_tool_s: Optional[float] = None
    future: Tuple[Segment, ...] = ()


class RoundsLeft:
    """Segments per request of each application, from the last ``window``
    finished requests: how likely a request that has done ``k`` segments
    goes on, and how many it has left."""

    def __init__(self, window: int = 256):
        self._by_app: Dict[Hashable, Deque[int]] = {}
        self._lock = threading.Lock()
        self.window = window

    def observe(self, app: Hashable, segments: int) -> None:
        if not isinstance(segments, int) or segments < 1:
            return
        with self._lock:
            self._by_app.setdefault(app, deque(maxlen=self.window)).append(segments)

    def _reached(self, app: Hashable, done: int):
        with self._lock:
            counts = list(self._by_app.get(app, ()))
        return [n for n in counts if n > done]

    def p_continue(self, app: Hashable, done: int) -> Optional[float]:
        """P(a request of ``app`` has more than ``done + 1`` segments | it
        has more than ``done``): the current segment (number ``done + 1``)
        ends in a call.  None before any request of the app got this far."""
        reached = self._reached(app, done)
        return sum(n > done + 1 for n in reached) / len(reached) if reached else None

    def expected_left(self, app: Hashable, done: int) -> Optional[float]:
        """Mean segments left after the current one, over finished requests
        that got as far (None: unknown)."""
        reached = self._reached(app, done)
        return sum(n - done - 1 for n in reached) / len(reached) if reached else None


class SegmentPredictor:
    """Per-application online predictions of a request's segments (module doc).

    ``durations`` may be the interception policy's own :class:`ToolDurations`
    (so the ranking and the handling agree on a tool's time); the caller
    observes each finished segment, each call and each finished request.
    """

    def __init__(self, lengths: Optional[OutputLengths] = None, durations: Optional[ToolDurations] = None,
                 rounds: Optional[RoundsLeft] = None, window: int = 256):
        self.lengths = lengths if lengths is not None else OutputLengths()
        self.durations = durations if durations is not None else ToolDurations()
        self.rounds = rounds if rounds is not None else RoundsLeft(window)
        self._call_s: Dict[Hashable, RunningMean] = {}
        self._result: Dict[Hashable, RunningMean] = {}
        self._lock = threading.Lock()
        self.window = window

    # ------------------------------------------------------------ learning
    def observe_segment(self, app: Hashable, prompt_tokens: int, output_tokens: int) -> None:
        """A segment of ``app`` that started at ``prompt_tokens`` of context produced ``output_tokens``."""
        self.lengths.observe(app, prompt_tokens, output_tokens)

    def observe_call(self, app: Hashable, tool: Optional[str], seconds: float, result_tokens: int = 0,
                     tool_durations: bool = True) -> None:
        """A call of ``app`` (to ``tool``) took ``seconds`` and added
        ``result_tokens`` to the context.  ``tool_durations=False``: the
        per-tool time is observed elsewhere (an engine that measures its own
        pauses shares ``durations``): only the app's figures are updated."""
        if not (isinstance(seconds, (int, float)) and seconds >= 0 and seconds == seconds
                and seconds != float("inf")):
            return
        if tool_durations:
            self.durations.observe(tool, float(seconds))
        with self._lock:
            self._call_s.setdefault(app, RunningMean(self.window)).add(float(seconds))
            if isinstance(result_tokens, int) and result_tokens >= 0:
                self._result.setdefault(app, RunningMean(self.window)).add(result_tokens)

    def observe_finish(self, app: Hashable, segments: int) -> None:
        """A request of ``app`` finished after ``segments`` segments (1: no call)."""
        self.rounds.observe(app, segments)

    # ---------------------------------------------------------- predicting
    def call_seconds(self, app: Hashable, tool: Optional[str] = None) -> Optional[float]:
        """The expected time of the call: the named tool's learned time, else the app's mean call."""
        if tool is not None:
            t = self.durations.estimate(tool)
            if t is not None:
                return t
        m = self._call_s.get(app)
        return m.mean if m is not None and m.n else None

    def predict(self, app: Hashable, context_tokens: int, segment: int = 0, *, may_call: bool = True,
                tool: Optional[str] = None, horizon: bool = True) -> SegmentPrediction:
        """The ranking's inputs for segment number ``segment`` (0-based) of a
        request of ``app`` whose context holds ``context_tokens`` tokens.
        ``may_call=False``: this request cannot call a tool (no tools
        offered, or its rounds are spent): no call term, no later segments.
        ``tool``: the call is already known (the model has named it).
        ``horizon``: also predict the later segments (LAMPS' job horizon)."""
        out = self.lengths.estimate(app, context_tokens)
        if not may_call:
            return SegmentPrediction(out)
        p = self.rounds.p_continue(app, segment)
        calls = tool is not None or (p is not None and p >= 0.5)
        if not calls:
            return SegmentPrediction(out)
        call_s = self.call_seconds(app, tool)
        future: Tuple[Segment, ...] = ()
        if horizon:
            left = self.rounds.expected_left(app, segment)
            n = int(round(left)) if left is not None else 0
            if n > 0:
                res = self._result.get(app)
                result = int(round(res.mean)) if res is not None and res.n else 0
                seg_out = out if out is not None else 0
                later_s = self.call_seconds(app)
                c = context_tokens + seg_out
                segs = []
                for j in range(n):
                    c += result
                    o = self.lengths.estimate(app, c)
                    o = o if o is not None else seg_out
                    segs.append((o, later_s if j < n - 1 else None, result))
                    c += o
                future = tuple(segs)
        return SegmentPrediction(out, tool, call_s, future)


__all__ = ["SegmentPrediction", "RoundsLeft", "SegmentPredictor", "Segment"]
