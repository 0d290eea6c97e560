"""One cgroup per sandboxed worker process: memory, process and CPU limits on everything it starts.

Why a cgroup: rlimits bind one process each.  A call that forks N children,
each below ``RLIMIT_AS``, held N times ``memory_mb`` (1.9 GB against 1024 MB
in the adversarial trial), and ``RLIMIT_NPROC`` counts a whole uid (every
concurrent call of the sandbox's uid together) and does not bind root at all
(300 forks went through).  A cgroup counts every task of the call, children
and threads included, and nothing else.

The worker joins its cgroup before it runs anything: the gateway starts it
through :data:`JOIN_WRAPPER`, a one-line ``sh`` that writes its own pid into
each ``cgroup.procs`` and then ``exec``\\ s the sandbox, so every later task
(bubblewrap, its init, the worker, the call's children) is born inside.

Both hierarchies are supported:

* cgroup v2 (``memory.max``, ``memory.swap.max``, ``memory.oom.group``,
  ``pids.max``, ``cpu.max``, ``cgroup.kill``): the cgroups are made under the
  gateway's own cgroup, whose ``cgroup.subtree_control`` must offer ``memory``
  and ``pids`` (delegated, as systemd's ``Delegate=yes`` does);
* cgroup v1 (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``,
  ``pids.max``, ``cpu.cfs_quota_us``): one directory per controller, under the
  gateway's own cgroup of that controller.  v1 has no ``oom.group`` nor
  ``cgroup.kill``: an OOM kill is seen in ``memory.oom_control`` (the pool
  then kills the whole call) and killing means SIGKILL to every listed pid
  until none is left (the pids limit bounds how many there can be).

Measured on the development container (cgroup v1, 2026-11-27): creating,
limiting and removing one cgroup per call costs well under a millisecond.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from dataclasses import dataclass, field

__all__ = ["CgroupUnavailable", "CgroupRoot", "CallCgroup", "find_root", "JOIN_WRAPPER"]

#: ``sh -c JOIN_WRAPPER sh PROCS_FILE... -- COMMAND...``: join the cgroups, then become COMMAND.
JOIN_WRAPPER = 'for f do [ "$f" = -- ] && break; echo $$ > "$f" || exit 126; shift; done; shift; exec "$@"'

_V1_CONTROLLERS = ("memory", "pids", "cpu")
_STALE_RE = re.compile(r"^interlace-(\d+)-")
_REQUIRED = ("memory", "pids")


class CgroupUnavailable(RuntimeError):
    """No writable cgroup with the memory and pids controllers; the message says what is missing."""


@dataclass(frozen=True)
class CgroupRoot:
    """Where per-worker cgroups are made: ``{controller: directory}`` (v1) or one directory (v2)."""

    version: int
    dirs: dict[str, str] = field(default_factory=dict)  # v2: {"unified": path}

    @property
    def controllers(self) -> list[str]:
        if self.version == 2:
            return list(_REQUIRED) + (["cpu"] if "cpu" in _v2_controllers(self.dirs["unified"]) else [])
        return list(self.dirs)

    def remove_stale(self) -> list[str]:
        """Remove the cgroups ``interlace-<pid>-...`` of gateways no longer alive (a SIGKILL leaves them)."""
        removed = []
        for directory in self.dirs.values():
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in names:
                match = _STALE_RE.match(name)
                if match is None or _pid_alive(int(match.group(1))):
                    continue
                path = os.path.join(directory, name)
                if CallCgroup(self.version, [path], path).remove(timeout_s=0.5):
                    removed.append(path)
        return removed

    def create(self, name: str, *, memory_bytes: int, pids: int, cpu_cores: float | None) -> CallCgroup:
        """A new cgroup named ``name`` with the limits set (removed again if a limit cannot be)."""
        paths = ([os.path.join(self.dirs["unified"], name)] if self.version == 2
                 else [os.path.join(d, name) for d in self.dirs.values()])
        memory_dir = paths[0] if self.version == 2 else paths[list(self.dirs).index("memory")]
        group = CallCgroup(self.version, paths, memory_dir)
        try:
            for path in paths:
                os.mkdir(path, 0o755)
            if self.version == 2:
                base = paths[0]
                _write(base, "memory.max", memory_bytes)
                _write(base, "memory.swap.max", 0, optional=True)
                _write(base, "memory.oom.group", 1, optional=True)
                _write(base, "pids.max", pids)
                if cpu_cores:
                    _write(base, "cpu.max", f"{int(cpu_cores * 100_000)} 100000")
            else:
                by = dict(zip(self.dirs, paths))
                _write(by["memory"], "memory.limit_in_bytes", memory_bytes)
                _write(by["memory"], "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
                _write(by["pids"], "pids.max", pids)
                if cpu_cores and "cpu" in by:
                    _write(by["cpu"], "cpu.cfs_period_us", 100_000)
                    _write(by["cpu"], "cpu.cfs_quota_us", int(cpu_cores * 100_000))
        except BaseException:
            group.remove()
            raise
        return group


class CallCgroup:
    """The cgroup(s) of one worker: join, watch for OOM kills, kill everything, remove."""

    def __init__(self, version: int, paths: list[str], memory_dir: str) -> None:
        self.version = version
        self.paths = paths
        self.memory_dir = memory_dir

    @property
    def procs_files(self) -> list[str]:
        """What :data:`JOIN_WRAPPER` writes its pid into."""
        return [os.path.join(p, "cgroup.procs") for p in self.paths]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files:
            try:
                with open(path) as fh:
                    found.update(int(line) for line in fh if line.strip())
            except OSError:
                pass
        return found

    def oom_kills(self) -> int:
        """How many processes the kernel OOM-killed in this cgroup."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.memory_dir, name)) as fh:
                for line in fh:
                    k, _, v = line.partition(" ")
                    if k == "oom_kill":
                        return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def kill(self) -> None:
        """SIGKILL every task in the cgroup (``cgroup.kill`` on v2, else pid by pid until none is left)."""
        if self.version == 2 and _write(self.paths[0], "cgroup.kill", 1, optional=True):
            return
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Kill what is left and remove the cgroup; ``False`` if it still held tasks at the deadline."""
        deadline = time.monotonic() + timeout_s
        left = list(self.paths)
        while left:
            self.kill()
            for path in list(left):
                try:
                    os.rmdir(path)
                    left.remove(path)
                except FileNotFoundError:
                    left.remove(path)
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        left.remove(path)
            if left:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)  # SIGKILLed tasks take a moment to leave
        return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write(directory: str, name: str, value: object, *, optional: bool = False) -> bool:
    try:
        with open(os.path.join(directory, name), "w") as fh:
            fh.write(str(value))
        return True
    except OSError:
        if optional:
            return False
        raise


def _v2_controllers(directory: str) -> set[str]:
    try:
        with open(os.path.join(directory, "cgroup.subtree_control")) as fh:
            return set(fh.read().split())
    except OSError:
        return set()


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, options) of every cgroup file system."""
    out = []
    with open("/proc/self/mounts") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                out.append((parts[1].replace("\\040", " "), parts[2], set(parts[3].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup per v1 controller, and ``"unified"`` for v2 (from ``/proc/self/cgroup``)."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else ["unified"]:
                own[name] = path
    return own


def _writable(directory: str) -> bool:
    probe = os.path.join(directory, f"interlace-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
        return True
    except OSError:
        return False


def find_root() -> CgroupRoot:
    """Where this process may make cgroups with memory and pids limits; raise :class:`CgroupUnavailable`."""
    if not os.path.exists("/proc/self/cgroup"):
        raise CgroupUnavailable("no cgroups on this OS (Linux only)")
    own, mounts = _own_paths(), _mounts()
    v1 = {}
    for point, kind, options in mounts:
        if kind == "cgroup":
            for name in _V1_CONTROLLERS:
                if name in options and name in own:
                    v1[name] = os.path.join(point, own[name].lstrip("/"))
    if all(name in v1 for name in _REQUIRED):
        dirs = {name: path for name, path in v1.items() if _writable(path)}
        if all(name in dirs for name in _REQUIRED):
            return CgroupRoot(1, dirs)
        raise CgroupUnavailable(
            f"cgroup v1 directories {', '.join(v1[n] for n in _REQUIRED)} are not writable "
            "(run the gateway as root, or give its user a delegated cgroup)")
    unified = next((point for point, kind, _ in mounts if kind == "cgroup2"), None)
    if unified is None or "unified" not in own:
        raise CgroupUnavailable("no cgroup file system with the memory and pids controllers is mounted")
    base = os.path.join(unified, own["unified"].lstrip("/"))
    have = _v2_controllers(base)
    if not {"memory", "pids"} <= have:
        try:
            _write(base, "cgroup.subtree_control", "+memory +pids")
        except OSError as exc:
            raise CgroupUnavailable(
                f"cgroup v2: cannot enable the memory and pids controllers for children of {base} ({exc}); "
                "run the gateway in a cgroup of its own with those controllers delegated "
                "(e.g. systemd's Delegate=yes)") from None
        _write(base, "cgroup.subtree_control", "+cpu", optional=True)
    if not _writable(base):
        raise CgroupUnavailable(f"cgroup v2 directory {base} is not writable")
    return CgroupRoot(2, {"unified": base})
