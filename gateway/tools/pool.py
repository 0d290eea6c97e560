"""The gateway side of the tool workers: one handle per process, one pool per tool, callers in a fair queue.

Why started ahead: a call should not pay for an interpreter start and warm
imports; that is paid before the call, by a warm spare.

Each tool has its own pool because worker set-up is tool-specific (the
``python`` tool's workers drop network access, which a search tool's must
not).  Two kinds of pool:

* reusable (the default): ``Tool.workers`` processes, each serving one call
  after another;
* per call (``Tool.process_per_call``, the ``python`` tool): every call gets a
  fresh process, pre-spawned as one of ``Tool.workers`` warm spares and
  killed when the call ends, so no interpreter state, file or child process
  survives from one call (or one API key) to the next.  Up to
  ``Tool.max_concurrent`` calls run at once; a slow call never blocks
  another while that cap is not reached.

An :class:`~interlace.gateway.tools.base.AsyncTool` has a :class:`LoopPool`
instead: no process, a cap on the calls running at once.

Calls waiting for a worker are served round-robin between API keys
(``request["key"]``), so one key's flood cannot starve another key.

IPC is one socket pair per worker, framed by
:class:`multiprocessing.connection.Connection`.  The gateway side never
blocks the event loop: replies are read from an ``add_reader`` callback, and
requests go through a per-worker sender thread (a worker busy running a long
statement would otherwise stall the loop once the socket buffer filled).

Protocol (tuples; ``token`` tags every message with the call it belongs to,
so a late reply from an abandoned call can never be mistaken for another's)::

    gateway -> worker   ("init", sys_path, tool_pickle, limits)
                        ("start", token) ("field", token, key, value)
                        ("line", token, text) ("finish", token, arguments)
                        ("cancel", token) ("stop",)
    worker -> gateway   ("ready", info) ("init_error", text)
                        ("idle", token)      an early event (start/field/line) is done
                        ("error", token, error_type, message, field)   early failure
                        ("result", token, ok, content, error_type, message, field)
                        ("cancelled", token)

A :class:`Worker` reads the replies and hands those of its current call to
that call (:class:`ServedCall`, in practice a :class:`~.call.ToolCall`,
which this module does not import: the call knows its pool, the pool knows
only what a call must answer to).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Coroutine, Hashable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from .base import AsyncTool, Tool, ToolError
from .cgroup import CallCgroup
from .process import has_exited, kill_process_tree, make_scratch, remove_stale_scratch, worker_environment
from .sandbox import Sandbox, SandboxUnavailable
from .settings import Lifecycle, RuntimeSettings

__all__ = ["Worker", "ServedCall", "FairQueue", "WorkerPool", "LoopPool", "DEFAULT_MAX_CONCURRENT"]

log = logging.getLogger(__name__)

_WORKER_ENTRY = "from interlace.gateway.tools.worker import main; main()"
#: Calls a per-call pool runs at once when its tool does not say (``Tool.max_concurrent``).
DEFAULT_MAX_CONCURRENT = 8
#: How often a sandboxed worker's cgroup is checked for OOM kills.
_OOM_POLL_S = 0.2


class ServedCall(Protocol):
    """What a worker reports its current call's messages and its own death to."""

    token: int

    def on_worker_message(self, msg: tuple[Any, ...]) -> None:
        """A reply tagged with this call's token."""

    def on_worker_dead(self, exitcode: int | None) -> None:
        """The worker died (or was killed) while serving this call."""


class Worker:
    """Gateway-side handle of one worker process."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.alive = False
        self.retired = False  # killed on purpose (end of a per-call worker, timeout, close)
        self.info: dict[str, Any] = {}
        self.call: ServedCall | None = None
        self.exitcode: int | None = None
        self._ready: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.scratch = make_scratch(pool.tool.name)
        self.cgroup: CallCgroup | None = None
        self.death_reason: str | None = None  # set when the gateway kills it for a reason (out of memory)
        sandbox = pool.sandbox
        parent_sock, child_sock = socket.socketpair()
        # In the sandbox the worker's parent is bubblewrap's init: "0" skips the parent check.
        argv = [sys.executable, "-c", _WORKER_ENTRY, str(child_sock.fileno()),
                "0" if sandbox is not None else str(os.getpid()), self.scratch]
        pass_fds = [child_sock.fileno()]
        seccomp_fd = -1
        try:
            if sandbox is not None:
                sandbox.prepare_scratch(self.scratch)
                self.cgroup = sandbox.new_cgroup(os.path.basename(self.scratch))
                seccomp_fd = sandbox.seccomp_fd()
                pass_fds.append(seccomp_fd)
                argv = sandbox.command(argv, self.scratch, seccomp_fd, self.cgroup)
            # Started from the loop thread: PR_SET_PDEATHSIG (and bwrap's --die-with-parent)
            # fire when the *thread* that forked the worker exits.
            self.process = subprocess.Popen(
                argv,
                env=worker_environment(pool.tool, self.scratch),
                cwd=self.scratch if sandbox is None else "/",  # the sandboxed worker enters it itself
                pass_fds=tuple(pass_fds),
                start_new_session=True,  # its own session and process group, killed as one
                stdin=subprocess.DEVNULL,
                # Code run by a per-call tool (the python tool) may spawn programs that
                # print: that must not reach the gateway's log.  Its own output is captured.
                stdout=subprocess.DEVNULL if pool.per_call else None,
                stderr=subprocess.DEVNULL if pool.per_call else None,
            )
        except BaseException:
            parent_sock.close()
            if self.cgroup is not None:
                self.cgroup.remove()
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise
        finally:
            child_sock.close()  # so EOF on our end means the worker is gone
            if seccomp_fd >= 0:
                os.close(seccomp_fd)
        self.conn = Connection(parent_sock.detach())
        self.pid = self.process.pid
        self.alive = True
        self.loop.add_reader(self.conn.fileno(), self._on_readable)
        self._sender = threading.Thread(target=self._send_loop, name=f"interlace-send-{self.pid}", daemon=True)
        self._sender.start()
        if self.cgroup is not None:
            self.loop.call_later(_OOM_POLL_S, self._watch_memory)
        self.send(("init", list(sys.path), pool.tool_bytes, pool.limits))

    def _watch_memory(self) -> None:
        """Kill the whole worker once the kernel OOM-killed any of its tasks (cgroup v1 has no oom.group)."""
        if not self.alive or self.cgroup is None:
            return
        if self.cgroup.oom_kills():
            self.death_reason = (f"out of memory: its processes together exceeded memory_mb "
                                 f"({self.pool.tool.memory_mb} MiB)")
            log.warning("tool %r worker %s: %s; killed", self.pool.tool.name, self.pid, self.death_reason)
            self.kill()
            return
        self.loop.call_later(_OOM_POLL_S, self._watch_memory)

    async def wait_ready(self, timeout: float) -> None:
        try:
            self.info = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except BaseException:
            self.kill()
            raise

    def send(self, msg: tuple[Any, ...]) -> None:
        if self.alive:
            self._outbox.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # worker gone or conn closed: reader reports it
                return

    def _on_readable(self) -> None:
        try:
            while self.alive and self.conn.poll():
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            self._on_dead()

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        if op == "ready":
            if not self._ready.done():
                self._ready.set_result(msg[1])
        elif op == "init_error":
            if not self._ready.done():
                self._ready.set_exception(RuntimeError(f"tool {self.pool.tool.name!r} worker_init failed:\n{msg[1]}"))
        elif self.call is not None and msg[1] == self.call.token:
            self.call.on_worker_message(msg)

    def _on_dead(self) -> None:
        """The worker is gone (EOF on the pipe, or we killed it).  Idempotent."""
        if not self.alive:
            return
        self.alive = False
        expected = self.retired  # read now: handing a dead worker back marks it retired
        self.loop.remove_reader(self.conn.fileno())
        self._outbox.put(None)
        kill_process_tree(self.pid)  # whatever it left behind, before its pid is released
        if self.cgroup is not None:
            self.cgroup.kill()
        try:
            self.exitcode = self.process.wait(timeout=2)  # quick: it is dead or SIGKILLed
        except subprocess.TimeoutExpired:
            log.error("tool %r worker %s did not exit after SIGKILL", self.pool.tool.name, self.pid)
        if self.pool.sandbox is not None and self.exitcode is not None and self.exitcode > 128:
            self.exitcode = 128 - self.exitcode  # bwrap exits 128+N for a worker killed by N
        if self.cgroup is not None:
            if not self.cgroup.remove(timeout_s=1.0):
                log.error("tool %r worker %s: its cgroup still holds tasks", self.pool.tool.name, self.pid)
        try:
            self.conn.close()
        except OSError:
            pass
        shutil.rmtree(self.scratch, ignore_errors=True)
        if not self._ready.done():
            self._ready.set_exception(RuntimeError(f"tool {self.pool.tool.name!r} worker exited during start-up"))
            self._ready.exception()  # mark retrieved: start-up may not be waiting any more
        call, self.call = self.call, None
        if call is not None:
            call.on_worker_dead(self.exitcode)
        self.pool.worker_lost(self, expected=expected)

    def kill(self) -> None:
        """SIGKILL the worker and everything it started, and report it dead.  Idempotent."""
        self.retired = True
        if self.alive:
            if self.cgroup is not None:
                self.cgroup.kill()  # every task of the call, wherever it went
            kill_process_tree(self.pid)
        self._on_dead()

    async def stop(self, grace_s: float) -> None:
        """Ask the worker to exit; kill it (and its descendants) after at most ``grace_s``."""
        self.retired = True
        self.send(("stop",))
        deadline = time.monotonic() + grace_s
        while self.alive and not has_exited(self.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.kill()


class FairQueue:
    """Callers waiting for a worker, served round-robin between keys.

    Keys are API key names (``request["key"]``; ``None`` for anonymous
    callers).  Each key has its own FIFO; :meth:`pop` takes the head of the
    first key's FIFO and moves that key to the back, so a key with 100
    waiting calls gets one worker, then the next key gets one, and so on.
    """

    def __init__(self) -> None:
        self._by_key: dict[Hashable, deque[asyncio.Future[Worker]]] = {}

    def push(self, key: Hashable, fut: asyncio.Future[Worker]) -> None:
        self._by_key.setdefault(key, deque()).append(fut)

    def remove(self, key: Hashable, fut: asyncio.Future[Worker]) -> None:
        waiting = self._by_key.get(key)
        if waiting is not None and fut in waiting:
            waiting.remove(fut)
            if not waiting:
                del self._by_key[key]

    def pop(self) -> asyncio.Future[Worker] | None:
        """The next waiter in round-robin order (skipping abandoned ones), or ``None``."""
        while self._by_key:
            key = next(iter(self._by_key))
            waiting = self._by_key.pop(key)
            fut = waiting.popleft()
            if waiting:
                self._by_key[key] = waiting  # to the back of the round
            if not fut.done():
                return fut
        return None

    def __len__(self) -> int:
        return sum(1 for waiting in self._by_key.values() for fut in waiting if not fut.done())

    def fail_all(self, exc: BaseException) -> None:
        for waiting in self._by_key.values():
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(exc)
        self._by_key.clear()


class WorkerPool:
    """The workers of one tool: warm spares, busy workers and a fair queue of callers.

    ``spares`` workers are kept warm (plus one per waiting caller, up to the
    capacity); ``capacity`` is how many calls may hold a worker at once.  A
    reusable pool's spares are its workers; a per-call pool kills each worker
    when its call ends and starts a fresh one.
    """

    in_loop = False  # calls run in worker processes

    def __init__(self, tool: Tool, size: int, settings: RuntimeSettings, lifecycle: Lifecycle) -> None:
        self.tool = tool
        self.settings = settings
        self.lifecycle = lifecycle
        self.per_call = bool(getattr(tool, "process_per_call", False))
        self.spares = max(1, size)
        max_concurrent = getattr(tool, "max_concurrent", None) or DEFAULT_MAX_CONCURRENT
        self.capacity = max(self.spares, int(max_concurrent)) if self.per_call else self.spares
        self.limits = {"memory_mb": tool.memory_mb, "cpu_s": tool.cpu_s, "per_call": self.per_call, "nice": tool.nice}
        remove_stale_scratch()  # what a gateway killed before it could clean up left behind
        self.sandbox = self._sandbox_for(tool)
        self.tool_bytes = pickle.dumps(tool)  # after _sandbox_for: workers see what is in force
        self.workers: set[Worker] = set()
        self.idle: deque[Worker] = deque()
        self.busy = 0
        self.starting = 0
        self.waiters = FairQueue()
        self.last_error: str | None = None

    @staticmethod
    def _sandbox_for(tool: Tool) -> Sandbox | None:
        """The sandbox ``tool`` asked for (``Tool.sandbox``), and what is in force recorded on the tool.

        Raises :class:`~.sandbox.SandboxUnavailable` (a ``ToolConfigError``: start-up
        fails) where the OS cannot give it, unless ``tool.allow_unisolated``.
        """
        if not getattr(tool, "sandbox", False):
            tool.sandbox_in_force = {"sandbox": "none", "reason": "the tool does not ask for one"}
            return None
        try:
            sandbox = Sandbox.for_tool(tool)
        except SandboxUnavailable as exc:
            if not getattr(tool, "allow_unisolated", False):
                raise
            log.warning("SECURITY: tool %r runs WITHOUT its sandbox (allow_unisolated): %s", tool.name, exc)
            tool.sandbox_in_force = {"sandbox": "none", "reason": str(exc)}
            return None
        tool.sandbox_in_force = sandbox.info()
        if sandbox.not_enforced():
            log.warning("SECURITY: tool %r: sandboxed without a cgroup (%s); rlimits bound each process and "
                        "the call's task count, but these are NOT enforced: %s", tool.name, sandbox.no_cgroup,
                        "; ".join(sandbox.not_enforced()))
        return sandbox

    # -- workers -----------------------------------------------------------------------

    def spawn(self) -> Coroutine[Any, Any, None]:
        """Start one worker and make it available once warm (counted as starting at once)."""
        self.starting += 1
        return self._start_worker()

    async def _start_worker(self) -> None:
        try:
            worker = Worker(self)
            self.workers.add(worker)
            await worker.wait_ready(self.settings.start_timeout_s)
        finally:
            self.starting -= 1
        if worker.alive:
            self.idle.append(worker)
            self._dispatch()

    def top_up(self) -> None:
        """Start workers until the warm ones (and those starting) cover spares and waiters."""
        if not self.lifecycle.running:
            return
        want = min(self.capacity - self.busy, max(self.spares, len(self.waiters)))
        while len(self.idle) + self.starting < want:
            self.lifecycle.background(self._spawn_logged(self.spawn()))

    async def _spawn_logged(self, starting: Coroutine[Any, Any, None]) -> None:
        try:
            await starting
        except Exception as exc:  # noqa: BLE001 - reported to the callers waiting for it
            self.last_error = str(exc)
            log.error("tool %r: a worker failed to start: %s", self.tool.name, exc)
            self.waiters.fail_all(ToolError(f"tool {self.tool.name!r}: a worker failed to start: {exc}"))

    def worker_lost(self, worker: Worker, *, expected: bool) -> None:
        self.workers.discard(worker)
        if worker in self.idle:
            self.idle.remove(worker)
        if not expected and self.lifecycle.running:
            log.warning("tool %r worker %s exited; starting a replacement", self.tool.name, worker.pid)
        self.top_up()

    # -- callers ------------------------------------------------------------------------

    def _take_idle(self) -> Worker | None:
        while self.idle:
            worker = self.idle.popleft()
            if worker.alive:
                self.busy += 1
                return worker
        return None

    def _dispatch(self) -> None:
        while self.busy < self.capacity and len(self.waiters):
            worker = self._take_idle()
            if worker is None:
                break
            fut = self.waiters.pop()
            assert fut is not None  # len() counts only waiters still waiting
            fut.set_result(worker)
        self.top_up()

    async def acquire(self, key: Hashable, timeout: float) -> Worker:
        """A warm worker for one call; waits its turn (round-robin by key) when all are busy."""
        if not len(self.waiters) and self.busy < self.capacity:
            worker = self._take_idle()
            if worker is not None:
                self.top_up()
                return worker
        fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        self.waiters.push(key, fut)
        self._dispatch()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException as exc:
            self.waiters.remove(key, fut)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result(), used=False)  # handed over just as we gave up
            if isinstance(exc, asyncio.TimeoutError):
                raise ToolError(f"no worker for tool {self.tool.name!r} became free in {timeout:g}s") from None
            raise

    def release(self, worker: Worker, *, used: bool = True) -> None:
        """The call is over: keep a reusable worker, kill a per-call one."""
        worker.call = None
        self.busy -= 1
        if worker.alive and not (self.per_call and used):
            self.idle.append(worker)
        else:
            worker.kill()
        self._dispatch()


class LoopPool:
    """What an :class:`AsyncTool` has in place of a pool: no processes, a cap on
    the calls running at once (``AsyncTool.max_concurrent``; the rest wait, in order)."""

    in_loop = True
    per_call = False
    spares = 0

    def __init__(self, tool: AsyncTool) -> None:
        self.tool = tool
        self.workers: set[Worker] = set()
        self.waiters = FairQueue()
        self.limits: dict[str, Any] = {}
        self.slots = asyncio.Semaphore(max(1, int(tool.max_concurrent)))

    def top_up(self) -> None:
        """Nothing to start."""
