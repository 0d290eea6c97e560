"""The cores a CPU engine may use, what they are doing, and the engine's
thread count governed by it (:class:`ThreadGovernor`).

The decision is :class:`~interlace.engine_ext.policies.threads.ThreadPolicy`
(plain Python, tested on its own); this module reads Linux's accounting for
it and applies it to torch:

* **wait** from ``/proc/self/task/*/schedstat`` (the second field: the
  nanoseconds each of this process's threads spent runnable but not
  running).  Precise, per thread, and it sees every kind of neighbour: other
  processes, tool workers, and this process's own event loop when the
  engine's OpenMP threads crowd it out.
* **idle** from ``/proc/stat``: the idle and iowait ticks of the CPUs in this
  process's affinity mask (``USER_HZ`` ticks: a window of 0.2 s on one core
  is 20 ticks, fine enough for "most of a core is free").

:meth:`ThreadGovernor.tick` runs on the engine thread before each step (torch's
thread count is per calling thread under OpenMP: the engine thread is the one
whose parallel regions matter).  Reading the files costs ~0.1-0.3 ms per
window of 0.2 s.  Where they cannot be read (not Linux, a sandbox without
/proc) the governor keeps the count it started with and says so once.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

from ..policies.threads import CoreWindow, ThreadPolicy

log = logging.getLogger(__name__)

USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def affinity() -> Sequence[int]:
    """The CPUs this process may run on (a container's or ``taskset``'s limit)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def cgroup_quota(root: str = "/sys/fs/cgroup") -> Optional[float]:
    """The CPU quota of this process's cgroup v2, in cores (``cpu.max``:
    ``quota period``), or None when unlimited or unknown.  A container limited
    by quota rather than by a CPU set sees every core in its affinity mask but
    may use only this much of them."""
    try:
        rel = next((ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.startswith("0::")), None)
        if rel is None:
            return None
        quota, period = (Path(root) / rel.lstrip("/") / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError, StopIteration):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask, capped by its
    cgroup's CPU quota (rounded up: a quota of 1.5 cores runs 2 threads)."""
    n = len(affinity())
    quota = cgroup_quota()
    return max(1, min(n, math.ceil(quota))) if quota else max(1, n)


class CoreSampler:
    """Reads the two counters of :mod:`this module <.cores>` and returns the
    :class:`CoreWindow` since the previous read.  ``proc`` is the procfs root
    (tests give a fake one); ``cpus`` the CPUs whose idle time counts."""

    def __init__(self, proc: str = "/proc", cpus: Optional[Sequence[int]] = None):
        self.proc = Path(proc)
        self.cpus = {f"cpu{c}" for c in (affinity() if cpus is None else cpus)}
        self._wait: Dict[str, int] = {}
        self._idle = 0
        self._at = 0.0

    def available(self) -> bool:
        try:
            self._read_wait()
            self._read_idle()
        except (OSError, ValueError, IndexError):
            return False
        return True

    def _read_wait(self) -> Dict[str, int]:
        out = {}
        for tid in os.listdir(self.proc / "self" / "task"):
            try:
                out[tid] = int((self.proc / "self" / "task" / tid / "schedstat").read_text().split()[1])
            except (FileNotFoundError, ProcessLookupError):  # the thread ended while we listed
                continue
        if not out:
            raise OSError("no readable /proc/self/task/*/schedstat")
        return out

    def _read_idle(self) -> int:
        ticks = 0
        for line in (self.proc / "stat").read_text().splitlines():
            name, _, rest = line.partition(" ")
            if name in self.cpus:
                f = rest.split()
                ticks += int(f[3]) + int(f[4])  # idle, iowait
        return ticks

    def start(self, now: float) -> None:
        """Begin a window at ``now`` (monotonic seconds)."""
        self._wait, self._idle, self._at = self._read_wait(), self._read_idle(), now

    def window(self, now: float) -> CoreWindow:
        """The window from the last :meth:`start` (or :meth:`window`) to ``now``; starts the next."""
        wait, idle = self._read_wait(), self._read_idle()
        # a thread new in this window counts all its waiting (it began inside the window, or close to it)
        waited = sum(max(0, w - self._wait.get(t, 0)) for t, w in wait.items())
        win = CoreWindow(wall_s=max(1e-9, now - self._at), wait_s=waited / 1e9,
                         idle_s=max(0, idle - self._idle) / USER_HZ)
        self._wait, self._idle, self._at = wait, idle, now
        return win


class ThreadGovernor:
    """The engine's torch thread count, re-chosen every ``window_s`` of
    stepping by :class:`ThreadPolicy` from what :class:`CoreSampler` saw.

    ``ceiling``: the most threads (``engine.threads``, else the usable
    cores).  ``set_threads``: applies a count (``torch.set_num_threads``, on
    the engine thread).  The engine calls :meth:`idle` before it waits for
    work: the next step starts a fresh window, since an idle engine's cores
    are idle and that says nothing about the next step's neighbours.  (Not
    inferred from the time between steps: a step that a neighbour stalls
    takes seconds, and that is exactly the window to measure.)"""

    def __init__(self, ceiling: int, set_threads: Callable[[int], None], *, window_s: float = 0.2,
                 sampler: Optional[CoreSampler] = None, policy: Optional[ThreadPolicy] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy or ThreadPolicy(ceiling)
        self.window_s = window_s
        self.sampler = sampler or CoreSampler()
        self._set, self._clock = set_threads, clock
        self.enabled = self.policy.cores > 1 and self.sampler.available()
        if self.policy.cores > 1 and not self.enabled:
            log.info("engine threads fixed at %d: this system's per-thread scheduler statistics "
                     "(/proc/self/task/*/schedstat) cannot be read", self.policy.threads)
        self._fresh = True  # the next tick starts a window (first step, or after idling)
        self._window_at = 0.0
        self.last_window: Optional[CoreWindow] = None

    @property
    def threads(self) -> int:
        return self.policy.threads

    def tick(self) -> int:
        """Before a step: the count to run it with (applied when it changed)."""
        if not self.enabled:
            return self.policy.threads
        now = self._clock()
        if self._fresh:
            self.sampler.start(now)
            self._window_at, self._fresh = now, False
        elif now - self._window_at >= self.window_s:
            self.last_window = self.sampler.window(now)
            self._window_at = now
            before = self.policy.threads
            n = self.policy.decide(now, self.last_window)
            if n != before:
                self._set(n)
                log.debug("engine threads %d -> %d (waiting %.2f cores, idle %.2f cores)", before, n,
                          self.last_window.waiting_cores, self.last_window.idle_cores)
        return self.policy.threads

    def idle(self) -> None:
        """The engine has nothing to step and is about to wait: the next step starts a fresh window."""
        self._fresh = True


__all__ = ["affinity", "cgroup_quota", "usable_cores", "CoreSampler", "ThreadGovernor"]
