"""How a tool worker process is confined and ended: its environment, and killing its whole tree.

Every worker (see :mod:`interlace.gateway.tools.worker`) runs in its own
session and process group, with a clean environment (``PATH``, ``LANG``,
``HOME``/``TMPDIR`` = its private scratch directory, plus the tool's ``env``
setting: never the gateway's API keys), ``RLIMIT_AS`` = ``memory_mb``
(soft == hard) and a CPU budget of ``cpu_s`` per call.  A worker past its
wall time, or at the end of its call in a per-call pool, is killed: its whole
process group and every descendant.  The scratch directory is removed with
the worker.

These are the helpers the gateway side uses for that, kept apart from the
pools (:mod:`.pool`) because they are about processes, not about calls: what
a worker may see of the gateway (:func:`worker_environment`), and how nothing
it started survives it (:func:`kill_process_tree`, :func:`has_exited`).

Scratch directories are named ``interlace-<gateway pid>-<tool>-<random>``
(:func:`make_scratch`), so that a gateway killed with SIGKILL -- which
removes nothing -- leaves directories the next start can recognise:
:func:`remove_stale_scratch` deletes those whose gateway pid is no longer
alive, and never one of a running gateway.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile

import psutil

from .base import Tool

__all__ = ["worker_environment", "kill_process_tree", "has_exited", "make_scratch", "remove_stale_scratch"]

_SCRATCH_RE = re.compile(r"^interlace-(\d+)-")


def scratch_prefix(what: str) -> str:
    """``interlace-<this gateway's pid>-<what>-``: the prefix :func:`remove_stale_scratch` recognises."""
    return f"interlace-{os.getpid()}-{what}-"


def make_scratch(what: str) -> str:
    """A new private directory (mode 0700) under the system's temporary directory."""
    return tempfile.mkdtemp(prefix=scratch_prefix(what))


def remove_stale_scratch(parent: str | None = None) -> list[str]:
    """Remove the scratch directories of gateways that are gone (a crash or SIGKILL left them); return them."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = _SCRATCH_RE.match(name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        path = os.path.join(parent, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def worker_environment(tool: Tool, home: str) -> dict[str, str]:
    """The whole environment of a worker: minimal, never the gateway's own.

    The gateway's environment holds secrets (API keys read through
    ``os.environ/NAME`` in the config); a tool sees only what it needs to run
    plus what its ``env`` setting names explicitly.
    """
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": home,
        "TMPDIR": home,
    }
    env.update(tool.env)  # str -> str: Tool.check() and the host's settings validation see to it
    return env


def kill_process_tree(pid: int) -> None:
    """SIGKILL a worker, its process group and every descendant it has.

    The group catches ``fork`` and ``subprocess`` children; descendants that
    left the group (``setsid``) are found through the process tree, which
    keeps orphans under the worker because it is a child subreaper.  Each
    round stops what it found first (SIGSTOP), so nothing can fork between
    being seen and being killed.  Must run before the worker is reaped, so
    its pid (the group id) cannot have been reused.
    """
    try:
        root: psutil.Process | None = psutil.Process(pid)
    except psutil.NoSuchProcess:
        root = None
    victims: dict[int, psutil.Process] = {}
    for _ in range(5):
        try:
            os.killpg(pid, signal.SIGSTOP)
        except OSError:
            pass
        try:
            found = root.children(recursive=True) if root is not None else []
        except psutil.Error:
            found = []
        fresh = [p for p in found if p.pid not in victims]
        for proc in fresh:
            victims[proc.pid] = proc
            try:
                proc.suspend()
            except psutil.Error:
                pass
        if not fresh:
            break
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for proc in victims.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def has_exited(pid: int) -> bool:
    """Whether the child ``pid`` has exited, without reaping it (its pid stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True
