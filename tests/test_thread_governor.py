"""The engine's thread count from what the cores do (issue 31): the policy on
synthetic windows, the sampler on a fake procfs and on this machine, the
governor's windows, and an engine that gives up a core to a busy neighbour."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from interlace.engine_ext.native import cores
from interlace.engine_ext.native.cores import CoreSampler, ThreadGovernor, cgroup_quota
from interlace.engine_ext.policies.threads import CoreWindow, ThreadPolicy


def win(wait: float, idle: float, wall: float = 0.2) -> CoreWindow:
    """A window in cores' worth: ``wait`` and ``idle`` cores over ``wall`` seconds."""
    return CoreWindow(wall_s=wall, wait_s=wait * wall, idle_s=idle * wall)


# ------------------------------------------------------------------ the policy
def test_quiet_machine_keeps_every_core():
    p = ThreadPolicy(4)
    for t in range(20):
        assert p.decide(t * 0.2, win(wait=0.05, idle=0.1)) == 4
    assert p.changes == 0


def test_waiting_threads_give_back_as_many_cores_as_they_waited():
    p = ThreadPolicy(4)
    assert p.decide(0.0, win(wait=1.1, idle=0.0)) == 3   # one core's worth queued: one thread fewer
    assert p.decide(0.2, win(wait=2.0, idle=0.0)) == 1   # two more
    assert p.decide(0.4, win(wait=3.0, idle=0.0)) == 1   # never below one


def test_small_waits_are_tolerated():
    p = ThreadPolicy(2, wait_tolerance=0.15)
    assert p.decide(0.0, win(wait=0.14, idle=0.0)) == 2
    assert p.decide(0.2, win(wait=0.3, idle=0.0)) == 1


def test_an_idle_core_is_taken_back_after_the_hold():
    p = ThreadPolicy(2, hold_s=0.5)
    assert p.decide(0.0, win(wait=1.0, idle=0.0)) == 1
    assert p.decide(0.2, win(wait=0.0, idle=1.0)) == 1   # held: the neighbour may still be there
    assert p.decide(0.6, win(wait=0.0, idle=1.0)) == 2   # the hold is over: probe
    assert p.decide(0.8, win(wait=0.0, idle=0.0)) == 2


def test_a_partly_busy_core_is_not_taken():
    p = ThreadPolicy(2, idle_needed=0.75)
    p.decide(0.0, win(wait=1.0, idle=0.0))
    assert p.decide(5.0, win(wait=0.0, idle=0.5)) == 1


def test_failed_probes_back_off_and_a_held_probe_resets():
    p = ThreadPolicy(2, hold_s=0.5, max_hold_s=2.0, settle_s=3.0)
    t = 0.0
    assert p.decide(t, win(1.0, 0.0)) == 1               # neighbour: down, hold 0.5 s
    t += 0.6
    assert p.decide(t, win(0.0, 1.0)) == 2               # probe
    t += 0.2
    assert p.decide(t, win(1.0, 0.0)) == 1               # it failed: hold doubles to 1 s
    assert p.hold_s == 1.0
    t += 0.6
    assert p.decide(t, win(0.0, 1.0)) == 1               # still held
    t += 0.5
    assert p.decide(t, win(0.0, 1.0)) == 2               # probe again
    t += 0.2
    assert p.decide(t, win(1.0, 0.0)) == 1
    assert p.hold_s == 2.0
    t += 2.1
    assert p.decide(t, win(1.0, 0.0)) == 1 and p.hold_s == 2.0  # at one thread: waiting changes nothing
    t += 2.1
    assert p.decide(t, win(0.0, 1.0)) == 2
    t += 3.1
    assert p.decide(t, win(0.0, 0.0)) == 2               # held for settle_s: the neighbour left
    assert p.hold_s == 0.5


def test_one_core_has_nothing_to_decide():
    p = ThreadPolicy(1)
    assert p.decide(0.0, win(5.0, 0.0)) == 1
    with pytest.raises(ValueError):
        ThreadPolicy(0)


# ----------------------------------------------------------------- the sampler
def fake_proc(root: Path, waits: dict, cpus: list) -> Path:
    """A procfs with ``self/task/TID/schedstat`` (wait ns per thread) and ``stat`` (idle, iowait ticks per CPU)."""
    for tid, wait in waits.items():
        d = root / "self" / "task" / str(tid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "schedstat").write_text(f"123456 {wait} 7\n")
    lines = ["cpu  1 2 3 4 5 6 7 8 9 10"]
    lines += [f"cpu{i} 10 0 10 {idle} {iowait} 0 0 0 0 0" for i, (idle, iowait) in enumerate(cpus)]
    (root / "stat").write_text("\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n")
    return root


def test_sampler_reads_waits_per_thread_and_idle_of_its_cpus(tmp_path):
    root = fake_proc(tmp_path, {101: 1_000_000, 102: 0}, [(100, 0), (100, 0), (100, 0)])
    s = CoreSampler(str(root), cpus=[0, 1])
    assert s.available()
    s.start(10.0)
    # thread 101 waited 0.1 s more, 102 ended, 103 is new (0.05 s); CPU 0 idled 10 ticks, CPU 1 5 (+5 iowait),
    # CPU 2 (not ours) 100
    import shutil
    shutil.rmtree(root / "self" / "task" / "102")
    fake_proc(root, {101: 101_000_000, 103: 50_000_000}, [(110, 0), (105, 5), (200, 0)])
    w = s.window(10.5)
    assert w.wall_s == pytest.approx(0.5)
    assert w.wait_s == pytest.approx(0.15)
    assert w.idle_s == pytest.approx(20 / cores.USER_HZ)


def test_sampler_without_schedstat_is_unavailable(tmp_path):
    (tmp_path / "self" / "task").mkdir(parents=True)
    (tmp_path / "stat").write_text("cpu0 1 2 3 4 5\n")
    assert not CoreSampler(str(tmp_path), cpus=[0]).available()
    gov = ThreadGovernor(2, lambda n: pytest.fail("nothing to apply"), sampler=CoreSampler(str(tmp_path), cpus=[0]))
    assert not gov.enabled and gov.tick() == 2


def test_cgroup_quota(tmp_path, monkeypatch):
    (tmp_path / "kubepods" / "pod1").mkdir(parents=True)
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")
    real_read = Path.read_text

    def read_text(self, *a, **kw):
        if str(self) == "/proc/self/cgroup":
            return "0::/kubepods/pod1\n"
        return real_read(self, *a, **kw)
    monkeypatch.setattr(Path, "read_text", read_text)
    assert cgroup_quota(str(tmp_path)) == pytest.approx(1.5)
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(str(tmp_path)) is None


# ---------------------------------------------------------------- the governor
class FakeSampler:
    def __init__(self, windows):
        self.windows, self.started = list(windows), 0

    def available(self):
        return True

    def start(self, now):
        self.started += 1

    def window(self, now):
        return self.windows.pop(0)


def test_governor_applies_changes_once_per_window_and_restarts_after_idling():
    now = [0.0]
    applied = []
    sampler = FakeSampler([win(1.0, 0.0), win(0.0, 0.0)])
    gov = ThreadGovernor(2, applied.append, window_s=0.2, sampler=sampler, clock=lambda: now[0],
                         policy=ThreadPolicy(2, hold_s=10.0))
    assert gov.tick() == 2 and sampler.started == 1
    now[0] = 0.1
    assert gov.tick() == 2 and applied == []            # inside the window
    now[0] = 0.25
    assert gov.tick() == 1 and applied == [1]           # the window said: a core's worth waited
    gov.idle()                                          # the engine waits for work
    now[0] = 5.0
    assert gov.tick() == 1 and sampler.started == 2 and applied == [1]
    now[0] = 5.3
    assert gov.tick() == 1 and applied == [1]           # nothing new to apply


def test_governor_measures_steps_longer_than_a_window():
    """A step a neighbour stalls takes longer than the window: that is the window to measure, not a pause."""
    now = [0.0]
    applied = []
    sampler = FakeSampler([win(1.0, 0.0, wall=1.5)])
    gov = ThreadGovernor(2, applied.append, window_s=0.2, sampler=sampler, clock=lambda: now[0])
    gov.tick()
    now[0] = 1.5
    assert gov.tick() == 1 and applied == [1] and sampler.started == 1


WAITING_THREADS = """
import hashlib, os, threading, time
from interlace.engine_ext.native.cores import CoreSampler
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # one core for three threads that never block
s = CoreSampler()
s.start(time.monotonic())
data, stop = bytes(16 << 20), time.monotonic() + 0.8
def work():
    while time.monotonic() < stop:
        hashlib.sha256(data).digest()   # hashes of large buffers run without the GIL
ts = [threading.Thread(target=work) for _ in range(3)]
[t.start() for t in ts]; [t.join() for t in ts]
print(s.window(time.monotonic()).waiting_cores)
"""


def test_sampler_on_this_machine_sees_threads_queued_for_a_core():
    """Three busy threads of one process on one core: they queue for it, and the sampler's window says
    so (0.7 cores' worth measured on a quiet machine, ~0 with one thread; a loaded machine only adds)."""
    if not CoreSampler().available():
        pytest.skip("no per-thread scheduler statistics on this system")
    out = subprocess.run([sys.executable, "-c", WAITING_THREADS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) > 0.4


NEIGHBOUR = "import os, time\nt = time.time()\nwhile time.time() - t < 60: pass\n"


@pytest.mark.skipif(len(cores.affinity()) < 2, reason="one usable core: nothing to give back")
def test_engine_gives_a_core_to_a_busy_neighbour():
    """A real engine decoding on every usable core beside as many busy processes as cores: within a few
    windows it runs on fewer threads than it started with (on a loaded machine it may have done so already)."""
    import asyncio

    import torch

    from helpers.tiny_models import tiny_engine

    n = len(cores.affinity())
    torch.set_num_threads(n)
    eng = tiny_engine(layers=4, hidden=256)
    neighbours = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) for _ in range(n)]
    try:
        from interlace.engine_ext.protocol import SamplingParams

        async def go():
            seen = set()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                await eng.fill("c", list(range(5, 69)))
                async for _ in eng.generate("c", SamplingParams(max_tokens=48, ignore_eos=True)):
                    pass
                await eng.free_context("c")
                seen.add(eng.stats.get("threads"))
                if eng.threads.threads < n:
                    return seen
            return seen
        seen = asyncio.run(go())
        assert eng.threads is not None and eng.threads.enabled
        assert eng.threads.threads < n, f"still {eng.threads.threads} threads beside {n} busy processes: {seen}"
    finally:
        for p in neighbours:
            p.kill()
            p.wait()
        eng.close()
        torch.set_num_threads(n)


def test_adapt_threads_off_keeps_the_count():
    from helpers.tiny_models import tiny_engine

    eng = tiny_engine(layers=1, hidden=64, adapt_threads=False)
    try:
        assert eng.threads is None
    finally:
        eng.close()
    with pytest.raises(ValueError, match="adapt_threads"):
        tiny_engine(layers=1, hidden=64, adapt_threads="yes")
