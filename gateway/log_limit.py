"""A logging filter that lets a burst of like lines through, then one summary line per interval.

Why: lines a client can cause -- an accept that fails, an invalid request, a
connection closed for being slow -- are logged once per event, so a flood of
such events is a flood of lines.  In the adversarial trial 20,000 slow
connections wrote 313,343 "Too many open files" lines (141 MB) and the log
became the second thing the attack exhausted.  :class:`RateLimitFilter` keeps
the first ``burst`` lines of each kind (logger and message template) per
``interval_s`` and drops the rest; the first line of that kind in a later
interval (or the next line of any kind once that interval ended) says how
many were dropped.

:func:`limit_logs` puts one filter on each logger whose records start there
(a filter on a logger sees only records logged on that logger, not those
propagated from its children).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, Iterable, Tuple

#: The loggers whose lines a client can cause: uvicorn's protocol warnings and
#: errors, asyncio's (a failing accept), and the connection limits'.
CLIENT_CAUSED = ("uvicorn.error", "asyncio", "interlace.gateway.connections")

#: Kinds remembered at most (a message that embeds its values is a kind each time).
MAX_KINDS = 1024


class RateLimitFilter(logging.Filter):
    """Passes the first ``burst`` records of each kind per ``interval_s``; counts the others."""

    def __init__(self, burst: int = 10, interval_s: float = 10.0, clock=time.monotonic) -> None:
        super().__init__()
        self.burst, self.interval_s, self.clock = burst, interval_s, clock
        # kind -> [window start, passed in the window, dropped in the window]
        self._kinds: Dict[Tuple[str, str], list] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        kind = (record.name, str(record.msg))
        state = self._kinds.get(kind)
        if state is not None and now - state[0] < self.interval_s:
            if state[1] < self.burst:
                state[1] += 1
                return True
            state[2] += 1
            return False
        dropped = self._expire(now)
        if len(self._kinds) >= MAX_KINDS:
            self._kinds.clear()
        self._kinds[kind] = [now, 1, 0]
        if dropped:
            record.msg = f"{record.msg} (rate limit: {dropped} log lines dropped in the last {self.interval_s:g} s)"
        return True

    def _expire(self, now: float) -> int:
        """Forget the kinds whose window ended; how many lines of them were dropped (to report once)."""
        gone = [k for k, s in self._kinds.items() if now - s[0] >= self.interval_s]
        dropped = 0
        for k in gone:
            dropped += self._kinds.pop(k)[2]
        return dropped


def limit_logs(names: Iterable[str] = CLIENT_CAUSED, burst: int = 10, interval_s: float = 10.0) -> RateLimitFilter:
    """One :class:`RateLimitFilter` on each of the loggers ``names`` (replacing one put there before)."""
    flt = RateLimitFilter(burst, interval_s)
    for name in names:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RateLimitFilter)]:
            logger.removeFilter(old)
        logger.addFilter(flt)
    return flt
