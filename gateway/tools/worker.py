"""The worker side of the tool runtime: one tool's handlers in a contained process.

The gateway (:mod:`interlace.gateway.tools.pool`) starts this module with
``python -c "from interlace.gateway.tools.worker import main; main()" FD PID DIR``
in a new session (its own process group), with a clean environment and the
scratch directory ``DIR`` as its working directory.  A sandboxed worker
(:mod:`interlace.gateway.tools.sandbox`) gets ``PID`` 0: its parent is
bubblewrap's init, which dies with the gateway (``--die-with-parent``) and
takes its PID namespace with it; it enters ``DIR`` itself, because only its
unprivileged uid may.  ``FD`` is its end of a socket
pair; the first message on it is ``("init", sys_path, tool_pickle, limits)``.

Why not :mod:`multiprocessing`: its ``spawn`` passes the gateway's whole
environment (API keys read through ``os.environ/NAME`` included) and cannot
start the child in a new session; ``fork`` copies the gateway's threads and
secrets in memory.

What this process does before serving calls, in order:

1. asks the kernel to SIGKILL it when the gateway dies (``PR_SET_PDEATHSIG``)
   and to adopt its orphaned descendants (``PR_SET_CHILD_SUBREAPER``), so the
   gateway can find and kill everything a call started;
2. makes sure a child forked by tool code (``os.fork()`` without exit) can
   never read or write the pipe: at fork the child's copy of the pipe is
   replaced by ``/dev/null``, and every pipe operation first checks the pid;
3. runs ``tool.worker_init()`` (the python tool isolates the network there,
   then warms its imports), then sets ``RLIMIT_AS`` with soft == hard.

Per call, ``cpu_s`` is enforced by a CPU-time timer (``ITIMER_PROF``) that
raises :class:`CPUTimeExceeded` inside the tool's handler; a worker that
serves one call only (``per_call``) also gets a hard ``RLIMIT_CPU`` one
second above it, which the kernel enforces with SIGKILL even inside C code.

Protocol: see :mod:`interlace.gateway.tools.pool`.

:class:`CPUTimeExceeded` and :func:`set_hard_limit` are exported by
``interlace`` (the public API): a tool's handlers may tell the CPU budget's
exception apart (the ``python`` tool reports it as its own error), and its
``worker_init`` may set further limits as this module sets ``RLIMIT_AS``.
"""

from __future__ import annotations

import copy
import ctypes
import json
import math
import os
import pickle
import resource
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["main", "CPUTimeExceeded", "set_hard_limit", "current_rlimits"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_RLIMITS = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC")


class CPUTimeExceeded(BaseException):
    """A call used its CPU budget.  A BaseException so ``except Exception`` in tool code cannot swallow it."""


def current_rlimits() -> dict[str, Any]:
    """The limits in force in this process: ``{name: [soft, hard]}``, ``None`` meaning unlimited."""
    out: dict[str, Any] = {}
    for name in _RLIMITS:
        soft, hard = resource.getrlimit(getattr(resource, name))
        out[name] = [None if v == resource.RLIM_INFINITY else v for v in (soft, hard)]
    return out


def set_hard_limit(name: str, value: int) -> int | None:
    """Set ``soft == hard == value`` (never above an existing hard limit); return what is in force."""
    res = getattr(resource, name)
    _, hard = resource.getrlimit(res)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    try:
        resource.setrlimit(res, (value, value))
    except (ValueError, OSError):
        return None
    return value


def _prctl(option: int, arg: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
        except (OSError, AttributeError):
            pass


class _Pipe:
    """The worker's end of the socket pair, usable only by the process that owns it.

    A child forked by tool code inherits the socket; if it ever reached the
    pipe it would read the parent's messages or interleave its own bytes
    with the parent's replies (the next call would then hang).  At fork the
    child's descriptor is pointed at ``/dev/null``, and every operation
    checks the pid and ends a stray child with ``os._exit``.
    """

    def __init__(self, fd: int) -> None:
        from multiprocessing.connection import Connection

        self.owner = os.getpid()
        self.fd = fd
        os.set_inheritable(fd, False)  # passed to us inheritable: programs the tool execs must not get it
        self.conn = Connection(fd)
        os.register_at_fork(after_in_child=self._detach_child)

    def _detach_child(self) -> None:
        if os.getpid() == self.owner:
            return
        try:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, self.fd, inheritable=False)
            os.close(null)
        except OSError:
            pass

    def guard(self) -> None:
        if os.getpid() != self.owner:
            os._exit(0)

    def send(self, msg: tuple[Any, ...]) -> None:
        self.guard()
        self.conn.send(msg)

    def recv(self) -> Any:
        self.guard()
        return self.conn.recv()


class _CpuBudget:
    """Per-call CPU time: a graceful exception first, a hard kill where allowed.

    The timer counts this process's CPU time (``ITIMER_PROF``); its signal
    raises :class:`CPUTimeExceeded` only while a tool handler runs, so the
    worker's own loop is never interrupted.  A signal handler runs between
    bytecodes, so C code that never returns (``round(1, -10**8)``) is
    stopped by the hard ``RLIMIT_CPU`` of a per-call worker, or by the
    gateway's wall-time limit.
    """

    def __init__(self, cpu_s: float | None, hard: bool) -> None:
        self.cpu_s = cpu_s
        self.hard = hard
        self.in_handler = False
        self.expired = False
        if cpu_s:
            signal.signal(signal.SIGPROF, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.expired = True
        if self.in_handler:
            raise CPUTimeExceeded(f"CPU time limit of {self.cpu_s:g}s exceeded")

    def start(self) -> None:
        self.expired = False
        if not self.cpu_s:
            return
        signal.setitimer(signal.ITIMER_PROF, self.cpu_s)
        if self.hard:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            set_hard_limit("RLIMIT_CPU", math.ceil(usage.ru_utime + usage.ru_stime + self.cpu_s) + 1)

    def stop(self) -> None:
        if self.cpu_s:
            signal.setitimer(signal.ITIMER_PROF, 0)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.expired:  # spent between handlers: fire again as soon as this one computes
            signal.setitimer(signal.ITIMER_PROF, 0.001)
        self.in_handler = True
        try:
            return fn(*args)
        finally:
            self.in_handler = False


def _describe(exc: BaseException) -> tuple[str, str, str | None]:
    """(error_type, message, field) for an exception raised by a handler."""
    from .base import InvalidToolArguments, ToolError

    if isinstance(exc, InvalidToolArguments):
        return "InvalidToolArguments", exc.message, exc.field
    if isinstance(exc, ToolError):
        return exc.error_type, str(exc), None
    if isinstance(exc, CPUTimeExceeded):
        return "ToolTimeout", str(exc), None
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    return type(exc).__name__, f"{type(exc).__name__}: {exc}", None


def main() -> None:
    """Entry point (``argv``: the socket's fd, the gateway's pid or 0 in a sandbox, the scratch directory)."""
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid and os.getppid() != parent_pid:  # the gateway died before prctl took effect
        os._exit(0)
    if len(sys.argv) > 3:
        os.chdir(sys.argv[3])
    os.environ.pop("PWD", None)  # bubblewrap sets it; the environment stays exactly what the gateway gave
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the gateway's to handle
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # oversized writes fail with EFBIG instead
    pipe = _Pipe(fd)
    try:
        _, sys_path, tool_bytes, limits = pipe.recv()
    except (EOFError, OSError):
        return
    try:
        sys.path[:] = list(dict.fromkeys([*sys_path, *sys.path]))
        tool = pickle.loads(tool_bytes)
        if limits.get("nice", 0) > 0:
            os.nice(limits["nice"])
        info = dict(tool.worker_init() or {})
        if limits.get("memory_mb"):
            set_hard_limit("RLIMIT_AS", int(limits["memory_mb"]) << 20)
        info["rlimits"] = current_rlimits()
        json.dumps(info)  # must cross the pipe as plain data
    except BaseException:  # noqa: BLE001 - reported to the gateway, which fails start-up
        pipe.send(("init_error", traceback.format_exc()))
        return
    pipe.send(("ready", {"pid": os.getpid(), **info}))
    _serve(pipe, tool, _CpuBudget(limits.get("cpu_s"), hard=bool(limits.get("per_call"))))


def _serve(pipe: _Pipe, tool: Any, budget: _CpuBudget) -> None:
    """Serve calls one at a time until told to stop (or the pipe closes)."""
    token: int | None = None
    inst: Any = None
    failure: tuple[str, str, str | None] | None = None

    def attempt(fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal failure
        try:
            return budget.run(fn, *args)
        except BaseException as exc:  # noqa: BLE001 - a tool's SystemExit must not end the worker
            pipe.guard()  # a forked child that raised SystemExit ends here
            failure = _describe(exc)
            return None
        finally:
            pipe.guard()  # a forked child returning from tool code ends here

    def close_call() -> None:
        nonlocal token, inst, failure
        budget.stop()
        if inst is not None:
            try:
                inst.on_close()
            except BaseException as exc:  # noqa: BLE001
                pipe.guard()
                _describe(exc)
        token, inst, failure = None, None, None

    while True:
        try:
            msg = pipe.recv()
        except (EOFError, OSError):
            break
        op = msg[0]
        if op == "stop":
            break
        if op == "start":
            close_call()
            token, inst = msg[1], copy.copy(tool)
            budget.start()
            attempt(inst.on_start)
            if failure:
                pipe.send(("error", token, *failure))
            pipe.send(("idle", token))  # the gateway's wall clock for this call stops
            continue
        if inst is None or msg[1] != token:
            continue  # stale message for a call this worker no longer serves
        if op in ("field", "line"):
            if not failure:  # else the call is doomed and the gateway already knows
                attempt(inst.on_field if op == "field" else inst.on_line, *msg[2:])
                if failure:
                    pipe.send(("error", token, *failure))
            pipe.send(("idle", token))
        elif op == "finish":
            result = None if failure else attempt(inst.on_finish, msg[2])
            if failure is None and not isinstance(result, str):
                try:
                    json.dumps(result)
                except (TypeError, ValueError) as exc:
                    failure = ("ToolError", f"tool returned a non-JSON result: {exc}", None)
            if failure:
                pipe.send(("result", token, False, None, *failure))
            else:
                pipe.send(("result", token, True, result, None, None, None))
            close_call()
        elif op == "cancel":
            close_call()
            pipe.send(("cancelled", msg[1]))
    close_call()
