"""How many threads a CPU engine's step should use, from what the cores did.

A CPU decode step is hundreds of OpenMP parallel regions (four matmuls, the
attention and the fused small ops per layer), and every region ends at a
barrier that waits for its slowest thread.  When another process holds one
of the cores (a tool worker of partial execution, the gateway's own event
loop, a neighbour on the server), the thread that shares a core with it
runs only part of the time and every barrier waits for its time slice: on a
2-core machine beside one busy process, the embedded model's batch-1 decode
fell from 71 to 21 tok/s with 2 threads, and ran at 65 with 1 thread
(docs/benchmarks.md, issue 31).  Spinning or sleeping at the barrier does
not cure it: a passive wait policy (``OMP_WAIT_POLICY=PASSIVE``) recovered
54 tok/s beside the neighbour but cost 40% when the machine was quiet.  The
cure is to run as many threads as there are free cores, and that number
changes while the engine runs.

So the count is measured, not guessed, from two signals over a short window
(:class:`CoreWindow`, filled by ``engine_ext/native/cores.py`` from Linux's
accounting):

* **wait**: the CPU time the process's own threads spent runnable but not
  running (``/proc/self/task/*/schedstat``, nanoseconds).  With as many
  threads as free cores it stays near zero; above a small tolerance some
  thread of ours is queued behind something else: one thread fewer (as many
  fewer as whole cores were waited for).
* **idle**: the idle time of the cores this process may run on
  (``/proc/stat``).  A core left idle for most of a window is free: one
  thread more.

Going up is a probe: if the next windows show waiting again, the count goes
back down and the next probe is held off twice as long (up to
``max_hold_s``), so a neighbour that comes and goes does not make the count
flap every window; a probe that holds for ``settle_s`` resets the hold.
Going down is never delayed: a wrong thread too many costs far more (0.3x
of the quiet speed) than a thread too few (0.6-0.9x).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional


@dataclasses.dataclass(frozen=True)
class CoreWindow:
    """What the cores did over ``wall_s`` seconds: ``wait_s`` CPU-seconds our
    threads waited runnable, ``idle_s`` CPU-seconds the usable cores idled."""

    wall_s: float
    wait_s: float
    idle_s: float

    @property
    def waiting_cores(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def idle_cores(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0


class ThreadPolicy:
    """The thread count of one engine, between 1 and ``cores``.

    ``wait_tolerance``: cores' worth of waiting ignored (timers, kernel
    threads, a short-lived helper).  ``idle_needed``: cores' worth of idle
    time that makes a probe upwards.  ``hold_s`` .. ``max_hold_s``: how long
    after a step down no probe is made (doubled each time a probe fails).
    ``settle_s``: a probe that held this long resets the hold."""

    def __init__(self, cores: int, start: Optional[int] = None, *, wait_tolerance: float = 0.15,
                 idle_needed: float = 0.75, hold_s: float = 0.5, max_hold_s: float = 8.0, settle_s: float = 4.0):
        if cores < 1:
            raise ValueError(f"cores must be at least 1, got {cores}")
        self.cores = cores
        self.threads = min(cores, max(1, start or cores))
        self.wait_tolerance, self.idle_needed = wait_tolerance, idle_needed
        self.min_hold_s, self.max_hold_s, self.settle_s = hold_s, max_hold_s, settle_s
        self.hold_s = hold_s
        self._hold_until = 0.0
        self._probed_at: Optional[float] = None  # when the count last went up (None: it has held since)
        self.changes = 0

    def decide(self, now: float, window: CoreWindow) -> int:
        """The count for the next window, given the last one (``now``: a monotonic time in seconds)."""
        waiting, idle = window.waiting_cores, window.idle_cores
        if self._probed_at is not None and now - self._probed_at >= self.settle_s:
            self._probed_at, self.hold_s = None, self.min_hold_s  # the probe held: the neighbour left
        if self.threads > 1 and waiting > self.wait_tolerance:
            fewer = max(1, math.floor(waiting + 0.5))
            if self._probed_at is not None:  # a probe that failed: wait longer before the next
                self.hold_s = min(self.max_hold_s, self.hold_s * 2)
                self._probed_at = None
            self._hold_until = now + self.hold_s
            return self._set(max(1, self.threads - fewer))
        if self.threads < self.cores and idle >= self.idle_needed and now >= self._hold_until:
            more = max(1, math.floor(idle + 1 - self.idle_needed))
            self._probed_at = now
            return self._set(min(self.cores, self.threads + more))
        return self.threads

    def _set(self, n: int) -> int:
        if n != self.threads:
            self.threads = n
            self.changes += 1
        return n


__all__ = ["CoreWindow", "ThreadPolicy"]
