"""Runs tool calls in contained worker processes, fed while the model decodes.

Why processes: tools are arbitrary Python (a code interpreter, a database
driver) and must neither hold the gateway's GIL nor take it down when they
crash, hang or get OOM-killed.  Why started ahead: a call should not pay for
an interpreter start and warm imports; that is paid before the call, by a
warm spare.

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

Calls waiting for a worker are served round-robin between API keys
(``request["key"]``), so one key's flood cannot starve another key.

Every worker (see :mod:`interlace.gateway.tools.worker`) runs in its own
session and process group, with a clean environment (``PATH``, ``LANG``,
``HOME``/``TMPDIR`` = its private scratch directory, plus the tool's ``env``
setting: never the gateway's API keys), ``RLIMIT_AS`` = ``memory_mb``
(soft == hard) and a CPU budget of ``cpu_s`` per call.  The wall-time limit
``timeout_s`` counts the time the worker works on the call, from the first
event it gets (at :meth:`ToolRuntime.begin` under partial execution), not
from ``finish()``: a statement that hangs while the model is still writing
is killed then, while the model's own pauses between statements are not
counted.  A call past it is killed (its whole process group and every
descendant) and its worker replaced.  The scratch directory is removed with
the worker.

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

Failure model: a tool that raises gives an error result; one past its wall
time gives :class:`ToolTimeout` and a replacement worker; one whose worker
dies gives a :class:`ToolCrashed` result (or :class:`ToolTimeout` when the
kernel killed it at its hard CPU limit) and a replacement.  ``finish()``
never raises for a tool failure, it returns an error :class:`ToolResult`;
``field()``/``line()`` raise the failure once it is known so the caller can
stop feeding (and, for invalid arguments, stop decoding).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import psutil

from .base import (
    AsyncTool,
    Granularity,
    InvalidToolArguments,
    Tool,
    ToolCancelled,
    ToolCrashed,
    ToolError,
    ToolTimeout,
    ToolUnavailable,
    ToolVetoed,
    UnknownTool,
)

__all__ = ["ToolRuntime", "ToolCall", "ToolResult", "Policy", "worker_environment"]

log = logging.getLogger(__name__)

#: ``policy(tool_name, arguments, request) -> veto message or None``.
Policy = Callable[[str, dict[str, Any], Any], "str | None"]

_tokens = itertools.count(1)
_call_ids = itertools.count(1)
_WORKER_ENTRY = "from interlace.gateway.tools.worker import main; main()"
#: Calls a per-call pool runs at once when its tool does not say (``Tool.max_concurrent``).
DEFAULT_MAX_CONCURRENT = 8


@dataclass
class ToolResult:
    """The outcome of one call, success or failure, ready to show the model.

    Times are ``time.time()`` seconds: ``started_at`` when the call began (the
    tool name was decoded), ``finish_called_at`` when the arguments were
    complete, ``finished_at`` when the result arrived.  ``finished_at -
    finish_called_at`` is the latency partial execution tries to hide.
    """

    call_id: str
    name: str
    ok: bool
    content: Any = None
    error: str | None = None
    error_type: str | None = None
    field: str | None = None
    started_at: float = 0.0
    finish_called_at: float | None = None
    finished_at: float = 0.0
    partial: bool = True
    worker_pid: int | None = None

    @property
    def tail_latency_s(self) -> float | None:
        """Seconds from complete arguments to result (what the model waits for)."""
        return None if self.finish_called_at is None else self.finished_at - self.finish_called_at

    def to_text(self) -> str:
        """The text fed back to the model."""
        if not self.ok:
            return f"{self.error_type}: {self.error}"
        if isinstance(self.content, str):
            return self.content
        return json.dumps(self.content, ensure_ascii=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# =========================================================================== processes


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


def _has_exited(pid: int) -> bool:
    """Whether the child ``pid`` has exited, without reaping it (its pid stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


# =========================================================================== gateway side


class _Worker:
    """Gateway-side handle of one worker process."""

    def __init__(self, runtime: ToolRuntime, pool: _Pool) -> None:
        self.runtime = runtime
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.alive = False
        self.retired = False  # killed on purpose (end of a per-call worker, timeout, close)
        self.info: dict[str, Any] = {}
        self.call: ToolCall | None = None
        self.exitcode: int | None = None
        self._ready: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.scratch = tempfile.mkdtemp(prefix=f"interlace-{pool.tool.name}-")
        parent_sock, child_sock = socket.socketpair()
        try:
            # Started from the loop thread: PR_SET_PDEATHSIG fires when the
            # *thread* that forked the worker exits.
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_ENTRY, str(child_sock.fileno()), str(os.getpid())],
                env=worker_environment(pool.tool, self.scratch),
                cwd=self.scratch,
                pass_fds=(child_sock.fileno(),),
                start_new_session=True,  # its own session and process group, killed as one
                stdin=subprocess.DEVNULL,
                # Code run by a per-call tool (the python tool) may spawn programs that
                # print: that must not reach the gateway's log.  Its own output is captured.
                stdout=subprocess.DEVNULL if pool.per_call else None,
                stderr=subprocess.DEVNULL if pool.per_call else None,
            )
        except BaseException:
            parent_sock.close()
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise
        finally:
            child_sock.close()  # so EOF on our end means the worker is gone
        self.conn = Connection(parent_sock.detach())
        self.pid = self.process.pid
        self.alive = True
        self.loop.add_reader(self.conn.fileno(), self._on_readable)
        self._sender = threading.Thread(target=self._send_loop, name=f"interlace-send-{self.pid}", daemon=True)
        self._sender.start()
        self.send(("init", list(sys.path), pool.tool_bytes, pool.limits))

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
            self.call._on_message(msg)

    def _on_dead(self) -> None:
        """The worker is gone (EOF on the pipe, or we killed it).  Idempotent."""
        if not self.alive:
            return
        self.alive = False
        expected = self.retired  # read now: handing a dead worker back marks it retired
        self.loop.remove_reader(self.conn.fileno())
        self._outbox.put(None)
        kill_process_tree(self.pid)  # whatever it left behind, before its pid is released
        try:
            self.exitcode = self.process.wait(timeout=2)  # quick: it is dead or SIGKILLed
        except subprocess.TimeoutExpired:
            log.error("tool %r worker %s did not exit after SIGKILL", self.pool.tool.name, self.pid)
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
            call._on_worker_dead(self.exitcode)
        self.pool.worker_lost(self, expected=expected)

    def kill(self) -> None:
        """SIGKILL the worker and everything it started, and report it dead.  Idempotent."""
        self.retired = True
        if self.alive:
            kill_process_tree(self.pid)
        self._on_dead()

    async def stop(self, grace_s: float) -> None:
        """Ask the worker to exit; kill it (and its descendants) after at most ``grace_s``."""
        self.retired = True
        self.send(("stop",))
        deadline = time.monotonic() + grace_s
        while self.alive and not _has_exited(self.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.kill()


class _FairQueue:
    """Callers waiting for a worker, served round-robin between keys.

    Keys are API key names (``request["key"]``; ``None`` for anonymous
    callers).  Each key has its own FIFO; :meth:`pop` takes the head of the
    first key's FIFO and moves that key to the back, so a key with 100
    waiting calls gets one worker, then the next key gets one, and so on.
    """

    def __init__(self) -> None:
        self._by_key: dict[Hashable, deque[asyncio.Future[_Worker]]] = {}

    def push(self, key: Hashable, fut: asyncio.Future[_Worker]) -> None:
        self._by_key.setdefault(key, deque()).append(fut)

    def remove(self, key: Hashable, fut: asyncio.Future[_Worker]) -> None:
        waiting = self._by_key.get(key)
        if waiting is not None and fut in waiting:
            waiting.remove(fut)
            if not waiting:
                del self._by_key[key]

    def pop(self) -> asyncio.Future[_Worker] | None:
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


class _Pool:
    """The workers of one tool: warm spares, busy workers and a fair queue of callers.

    ``spares`` workers are kept warm (plus one per waiting caller, up to the
    capacity); ``capacity`` is how many calls may hold a worker at once.  A
    reusable pool's spares are its workers; a per-call pool kills each worker
    when its call ends and starts a fresh one.
    """

    in_loop = False  # calls run in worker processes

    def __init__(self, runtime: ToolRuntime, tool: Tool, size: int) -> None:
        self.runtime = runtime
        self.tool = tool
        self.per_call = bool(getattr(tool, "process_per_call", False))
        self.spares = max(1, size)
        max_concurrent = getattr(tool, "max_concurrent", None) or DEFAULT_MAX_CONCURRENT
        self.capacity = max(self.spares, int(max_concurrent)) if self.per_call else self.spares
        self.limits = {"memory_mb": tool.memory_mb, "cpu_s": tool.cpu_s, "per_call": self.per_call, "nice": tool.nice}
        self.tool_bytes = pickle.dumps(tool)
        self.workers: set[_Worker] = set()
        self.idle: deque[_Worker] = deque()
        self.busy = 0
        self.starting = 0
        self.waiters = _FairQueue()
        self.last_error: str | None = None

    # -- workers -----------------------------------------------------------------------

    def spawn(self) -> Coroutine[Any, Any, None]:
        """Start one worker and make it available once warm (counted as starting at once)."""
        self.starting += 1
        return self._start_worker()

    async def _start_worker(self) -> None:
        try:
            worker = _Worker(self.runtime, self)
            self.workers.add(worker)
            await worker.wait_ready(self.runtime.start_timeout_s)
        finally:
            self.starting -= 1
        if worker.alive:
            self.idle.append(worker)
            self._dispatch()

    def top_up(self) -> None:
        """Start workers until the warm ones (and those starting) cover spares and waiters."""
        if self.runtime._state != "running":
            return
        want = min(self.capacity - self.busy, max(self.spares, len(self.waiters)))
        while len(self.idle) + self.starting < want:
            self.runtime._background(self._spawn_logged(self.spawn()))

    async def _spawn_logged(self, starting: Coroutine[Any, Any, None]) -> None:
        try:
            await starting
        except Exception as exc:  # noqa: BLE001 - reported to the callers waiting for it
            self.last_error = str(exc)
            log.error("tool %r: a worker failed to start: %s", self.tool.name, exc)
            self.waiters.fail_all(ToolError(f"tool {self.tool.name!r}: a worker failed to start: {exc}"))

    def worker_lost(self, worker: _Worker, *, expected: bool) -> None:
        self.workers.discard(worker)
        if worker in self.idle:
            self.idle.remove(worker)
        if not expected and self.runtime._state == "running":
            log.warning("tool %r worker %s exited; starting a replacement", self.tool.name, worker.pid)
        self.top_up()

    # -- callers ------------------------------------------------------------------------

    def _take_idle(self) -> _Worker | None:
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

    async def acquire(self, key: Hashable, timeout: float) -> _Worker:
        """A warm worker for one call; waits its turn (round-robin by key) when all are busy."""
        if not len(self.waiters) and self.busy < self.capacity:
            worker = self._take_idle()
            if worker is not None:
                self.top_up()
                return worker
        fut: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
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

    def release(self, worker: _Worker, *, used: bool = True) -> None:
        """The call is over: keep a reusable worker, kill a per-call one."""
        worker.call = None
        self.busy -= 1
        if worker.alive and not (self.per_call and used):
            self.idle.append(worker)
        else:
            worker.kill()
        self._dispatch()


class _LoopPool:
    """What an :class:`AsyncTool` has in place of a pool: no processes, a cap on
    the calls running at once (``AsyncTool.max_concurrent``; the rest wait, in order)."""

    in_loop = True
    per_call = False
    spares = 0

    def __init__(self, runtime: ToolRuntime, tool: AsyncTool) -> None:
        self.runtime = runtime
        self.tool = tool
        self.workers: set[_Worker] = set()
        self.waiters = _FairQueue()
        self.limits: dict[str, Any] = {}
        self.slots = asyncio.Semaphore(max(1, int(tool.max_concurrent)))

    def top_up(self) -> None:
        """Nothing to start."""


class ToolCall:
    """One in-flight tool call, fed by the parser's events.  Get it from :meth:`ToolRuntime.begin`.

    ``field``/``line`` return as soon as the event is queued for the worker:
    the tool runs concurrently with decoding.  They raise the call's failure
    (a :class:`ToolError`, typically :class:`InvalidToolArguments`) once it is
    known; ``failure`` holds it for callers that prefer polling.
    """

    def __init__(
        self,
        runtime: ToolRuntime,
        pool: _Pool | _LoopPool,
        call_id: str,
        *,
        partial: bool,
        request: Any,
        timeout_s: float,
    ) -> None:
        self.runtime = runtime
        self.pool = pool
        self.tool = pool.tool
        self.call_id = call_id
        self.partial = partial
        self.request = request
        self.key: Hashable = request.get("key") if isinstance(request, Mapping) else None
        self.timeout_s = timeout_s
        self.token = next(_tokens)
        self.started_at = time.time()
        self.finish_called_at: float | None = None
        self.failure: ToolError | None = None
        self.fields: dict[str, Any] = {}
        self.lines: list[str] = []
        self._worker: _Worker | None = None
        self._worker_pid: int | None = None
        self._result: asyncio.Future[tuple[Any, ...]] | None = None
        self._cancel_ack: asyncio.Future[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._inflight = 0  # events sent to the worker and not yet acknowledged
        self._busy_since: float | None = None
        self._busy_total = 0.0  # seconds the worker has spent on this call so far
        self._done = False

    # -- events from the parser --------------------------------------------------------

    async def _open(self) -> None:
        """Run at begin: the policy check, then the worker for early granularities."""
        self._check_policy(self.fields)
        if self.partial and self.tool.granularity is not Granularity.ON_FINISH and not self.pool.in_loop:
            await self._attach_worker()

    async def field(self, key: str, value: Any) -> None:
        """A top-level argument completed.  May raise :class:`InvalidToolArguments` at once."""
        await self._raise_if_failed()
        try:
            if self.tool.validate_early:
                self.tool.validate_field(key, value)
            self.fields[key] = value
            self._check_policy(self._partial_arguments())
        except ToolError as exc:
            self._fail(exc)
            await self._abandon_worker()  # nothing more will reach it: free it now
            raise
        if self._worker is not None and self.tool.granularity is Granularity.ON_FIELD:
            self._send(("field", self.token, key, value))

    async def line(self, text: str) -> None:
        """A complete top-level code statement (delivered to ``ON_LINE`` tools)."""
        await self._raise_if_failed()
        self.lines.append(text)
        try:
            self._check_policy(self._partial_arguments())
        except ToolError:
            await self._abandon_worker()
            raise
        if self._worker is not None and self.tool.granularity is Granularity.ON_LINE:
            self._send(("line", self.token, text))

    async def finish(self, arguments: dict[str, Any] | None = None) -> ToolResult:
        """The arguments are complete: run the tool to its end and return the result.

        ``arguments`` defaults to the fields (and lines) received.  Never raises
        for a tool failure; an ``asyncio`` cancellation kills the worker.
        """
        if self._done:
            raise RuntimeError(f"call {self.call_id!r} already finished")
        self.finish_called_at = time.time()
        if arguments is None:
            arguments = self._partial_arguments()
        try:
            if self.failure is None:
                try:
                    self.tool.validate_arguments(arguments)
                    self._check_policy(arguments)
                except ToolError as exc:
                    self._fail(exc)
            if self.failure is not None:
                await self._abandon_worker()
                return self._make_result(ok=False)
            if self.pool.in_loop:
                return await self._finish_in_loop(arguments)
            if self._worker is None:  # partial off or ON_FINISH: replay everything now
                worker = await self._attach_worker()
                kind = self.tool.granularity
                if kind is Granularity.ON_FIELD:
                    for key, value in self.fields.items():
                        self._send(("field", self.token, key, value))
                elif kind is Granularity.ON_LINE:
                    for text in self.lines:
                        self._send(("line", self.token, text))
            assert self._worker is not None and self._result is not None
            self._send(("finish", self.token, arguments))
            # The watchdog kills the worker when its time is up, which resolves
            # the result; the extra second is a backstop, not the limit.
            backstop = self.timeout_s - self._busy_total + 1.0
            try:
                reply = await asyncio.wait_for(asyncio.shield(self._result), backstop)
            except asyncio.TimeoutError:
                self._on_deadline()
                return self._make_result(ok=False)
            except ToolError as exc:  # worker died (or was killed at the deadline)
                self._fail(exc)
                return self._make_result(ok=False)
            _, _, ok, content, error_type, message, field = reply
            self._detach(used=True)
            if not ok:
                self._fail(self._rebuild(error_type, message, field))
                return self._make_result(ok=False)
            return self._make_result(ok=True, content=content)
        except asyncio.CancelledError:
            self._kill_worker()
            raise
        except ToolError as exc:  # e.g. no worker became free
            self._fail(exc)
            return self._make_result(ok=False)
        finally:
            self._done = True
            self._cancel_watchdog()

    async def _finish_in_loop(self, arguments: dict[str, Any]) -> ToolResult:
        """Run an :class:`AsyncTool`'s call here, in the event loop, within its wall time.

        Its wall time counts from when a slot is free (like a worker's, from
        when it takes the call); waiting for a slot is bounded by the runtime's
        ``acquire_timeout_s``.  Cancelling the caller cancels the call."""
        assert isinstance(self.pool, _LoopPool)
        tool = self.tool
        why = tool.unavailable()
        if why:
            self._fail(ToolUnavailable(why))
            return self._make_result(ok=False)
        try:
            await asyncio.wait_for(self.pool.slots.acquire(), self.runtime.acquire_timeout_s)
        except asyncio.TimeoutError:
            self._fail(ToolError(f"no slot for tool {tool.name!r} became free in {self.runtime.acquire_timeout_s:g}s"))
            return self._make_result(ok=False)
        try:
            content = await asyncio.wait_for(tool.call(arguments, self.request), self.timeout_s)
            if not isinstance(content, str):
                json.dumps(content)  # what reaches the model and the client must be JSON
        except asyncio.TimeoutError:
            self._fail(ToolTimeout(f"tool {tool.name!r} ran past its wall-time limit of {self.timeout_s:g}s"))
            return self._make_result(ok=False)
        except ToolError as exc:
            self._fail(exc)
            return self._make_result(ok=False)
        except Exception as exc:  # a bug in the tool: reported to the model as a failure, logged here
            log.exception("tool %r raised", tool.name)
            self._fail(ToolError(f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__))
            return self._make_result(ok=False)
        finally:
            self.pool.slots.release()
        return self._make_result(ok=True, content=content)

    async def cancel(self, reason: str = "cancelled") -> None:
        """Abandon the call: the worker drops it (or is killed if busy).  Idempotent."""
        if self._done:
            return
        self._done = True
        self._cancel_watchdog()
        self._fail(ToolCancelled(reason))
        await self._abandon_worker()

    # -- internals -----------------------------------------------------------------

    def _partial_arguments(self) -> dict[str, Any]:
        args = dict(self.fields)
        if self.lines and self.tool.line_field and self.tool.line_field not in args:
            args[self.tool.line_field] = "\n".join(self.lines)
        return args

    def _check_policy(self, arguments: dict[str, Any]) -> None:
        if self.runtime.policy is None:
            return
        veto = self.runtime.policy(self.tool.name, arguments, self.request)
        if veto is not None:
            exc = ToolVetoed(str(veto))
            self._fail(exc)
            raise exc

    async def _raise_if_failed(self) -> None:
        if self._done:
            raise RuntimeError(f"call {self.call_id!r} is over")
        if self.failure is not None:
            await self._abandon_worker()
            raise self.failure

    def _fail(self, exc: ToolError) -> None:
        if self.failure is None:
            self.failure = exc

    @staticmethod
    def _rebuild(error_type: str, message: str, field: str | None) -> ToolError:
        if error_type == "InvalidToolArguments":
            return InvalidToolArguments(field, message)
        if error_type == "ToolTimeout":
            return ToolTimeout(message)
        return ToolError(message, error_type=error_type)

    async def _attach_worker(self) -> _Worker:
        worker = await self.pool.acquire(self.key, self.runtime.acquire_timeout_s)
        worker.call = self
        self._worker = worker
        self._worker_pid = worker.pid
        loop = asyncio.get_running_loop()
        self._result = loop.create_future()
        self._cancel_ack = loop.create_future()
        self._send(("start", self.token))
        return worker

    # -- the wall-time limit -----------------------------------------------------------
    #
    # The clock runs whenever the worker has an event of this call to work on,
    # from the first (``start``, sent when the worker takes the call: at begin()
    # under partial execution) to the result.  A statement that hangs while the
    # model is still writing the call is killed without waiting for finish(); a
    # slow model, whose next statement simply has not arrived, is not counted
    # against the tool.  The worker acknowledges each event ("idle", "result").

    def _send(self, msg: tuple[Any, ...]) -> None:
        assert self._worker is not None
        self._worker.send(msg)
        if self._inflight == 0:
            loop = asyncio.get_running_loop()
            self._busy_since = loop.time()
            self._watchdog = loop.call_later(max(self.timeout_s - self._busy_total, 0.0), self._on_deadline)
        self._inflight += 1

    def _acknowledged(self) -> None:
        if self._inflight == 0:
            return
        self._inflight -= 1
        if self._inflight == 0 and self._busy_since is not None:
            self._busy_total += asyncio.get_running_loop().time() - self._busy_since
            self._busy_since = None
            self._cancel_watchdog()

    def _on_deadline(self) -> None:
        """Wall time is up: the call fails with :class:`ToolTimeout` and its worker is killed."""
        self._watchdog = None
        if self._worker is None:
            return
        self._fail(ToolTimeout(f"tool {self.tool.name!r} ran past its wall-time limit of {self.timeout_s:g}s"))
        self._kill_worker()

    def _cancel_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _on_message(self, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        if op == "idle":
            self._acknowledged()
        elif op == "error":
            self._fail(self._rebuild(*msg[2:5]))
        elif op == "result" and self._result is not None and not self._result.done():
            self._acknowledged()
            self._result.set_result(msg)
        elif op == "cancelled" and self._cancel_ack is not None and not self._cancel_ack.done():
            self._cancel_ack.set_result(None)

    def _on_worker_dead(self, exitcode: int | None) -> None:
        worker = self._worker
        if exitcode == -signal.SIGKILL and worker is not None and not worker.retired and self._hit_cpu_limit():
            exc: ToolError = ToolTimeout(f"tool {self.tool.name!r} was killed at its CPU limit of "
                                         f"{self.pool.limits['cpu_s']:g}s")
        else:
            how = f"killed by signal {-exitcode}" if exitcode and exitcode < 0 else f"exit code {exitcode}"
            exc = ToolCrashed(f"tool {self.tool.name!r} worker died ({how})")
        self._fail(exc)
        exc = self.failure or exc
        self._detach(used=True)
        if self._result is not None and not self._result.done():
            self._result.set_exception(exc)
            self._result.exception()  # mark retrieved: nobody may be awaiting yet
        if self._cancel_ack is not None and not self._cancel_ack.done():
            self._cancel_ack.set_result(None)

    def _hit_cpu_limit(self) -> bool:
        """A SIGKILL nobody here sent, in a per-call worker, after its CPU budget: the hard RLIMIT_CPU."""
        cpu_s = self.pool.limits.get("cpu_s")
        return bool(self.pool.per_call and cpu_s and time.time() - self.started_at >= cpu_s)

    def _detach(self, *, used: bool) -> None:
        """Hand the worker back to its pool exactly once (a per-call worker is killed there)."""
        worker, self._worker = self._worker, None
        self._cancel_watchdog()
        if worker is not None:
            self.pool.release(worker, used=used)

    def _kill_worker(self) -> None:
        worker = self._worker
        if worker is not None:
            worker.kill()  # reports back through _on_worker_dead, which detaches
            self._detach(used=True)

    async def _abandon_worker(self) -> None:
        """Take the call off its worker: polite cancel, SIGKILL after a grace period."""
        worker = self._worker
        if worker is None or self._cancel_ack is None:
            return
        if worker.call is not self:  # already handed back
            self._worker = None
            return
        if self.pool.per_call:  # the worker ends with the call anyway
            self._kill_worker()
            return
        worker.send(("cancel", self.token))
        try:
            await asyncio.wait_for(asyncio.shield(self._cancel_ack), self.runtime.cancel_grace_s)
        except asyncio.TimeoutError:
            self._kill_worker()
            return
        self._detach(used=True)

    def _make_result(self, *, ok: bool, content: Any = None) -> ToolResult:
        failure = None if ok else self.failure
        return ToolResult(
            call_id=self.call_id,
            name=self.tool.name,
            ok=ok,
            content=content,
            error=str(failure) if failure else None,
            error_type=failure.error_type if failure else None,
            field=getattr(failure, "field", None),
            started_at=self.started_at,
            finish_called_at=self.finish_called_at,
            finished_at=time.time(),
            partial=self.partial,
            worker_pid=self._worker_pid,
        )


class ToolRuntime:
    """Worker pools for a set of tools, and the calls that run on them.

    Use from one event loop (the one that called :meth:`start`)::

        runtime = ToolRuntime(tools, policy=host.before_tool_execution)
        await runtime.start()
        call = await runtime.begin("python", "call_1", request={"key": "alice"})
        await call.line("import numpy as np")      # runs now, while decoding goes on
        result = await call.finish({"code": ...})
        await runtime.close()
    """

    def __init__(
        self,
        tools: Mapping[str, Tool] | Iterable[Tool],
        *,
        workers: int | Mapping[str, int] | None = None,
        policy: Policy | None = None,
        start_timeout_s: float = 60.0,
        acquire_timeout_s: float = 60.0,
        cancel_grace_s: float = 0.5,
        stop_grace_s: float = 1.0,
    ) -> None:
        """``workers`` overrides ``Tool.workers`` (one count for all, or per tool name)."""
        items = list(tools.values()) if isinstance(tools, Mapping) else list(tools)
        self.tools: dict[str, Tool] = {}
        for tool in items:
            if tool.name in self.tools:
                raise ValueError(f"duplicate tool name {tool.name!r}")
            self.tools[tool.name] = tool
        self._sizes = {
            name: (workers if isinstance(workers, int) else (workers or {}).get(name, tool.workers))
            for name, tool in self.tools.items()
        }
        self.policy = policy
        self.start_timeout_s = start_timeout_s
        self.acquire_timeout_s = acquire_timeout_s
        self.cancel_grace_s = cancel_grace_s
        self.stop_grace_s = stop_grace_s
        self._pools: dict[str, _Pool | _LoopPool] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._state = "new"

    async def start(self) -> None:
        """Prepare every tool and start its warm workers; return when all are warm.

        Raises what a tool's ``setup`` raises (e.g. the python tool's
        :class:`~interlace.gateway.tools.base.ToolConfigError` when the network
        cannot be isolated) or :class:`RuntimeError` when a worker fails to start.
        """
        if self._state != "new":
            raise RuntimeError("ToolRuntime.start() called twice")
        self._state = "starting"
        try:
            for tool in self.tools.values():
                await asyncio.to_thread(tool.setup)
            for name, tool in self.tools.items():
                self._pools[name] = self._new_pool(tool)
            await asyncio.gather(*(pool.spawn() for pool in self._pools.values() for _ in range(pool.spares)))
        except BaseException:
            await self.close()
            raise
        self._state = "running"
        for pool in self._pools.values():
            pool.top_up()
            self._log_containment(pool)

    def _new_pool(self, tool: Tool) -> _Pool | _LoopPool:
        if isinstance(tool, AsyncTool):
            return _LoopPool(self, tool)
        return _Pool(self, tool, self._sizes[tool.name])

    def update_tools(self, add: Iterable[AsyncTool] = (), remove: Iterable[str] = ()) -> None:
        """Add or drop :class:`AsyncTool` tools while running (an MCP server's tool
        list changed when it reconnected).  Calls already begun keep their tool;
        a tool with worker processes cannot be added or dropped here."""
        if self._state != "running":
            raise RuntimeError("ToolRuntime.update_tools() needs a running runtime")
        add, remove = list(add), list(remove)
        for name in remove:
            if name in self.tools and not isinstance(self.tools[name], AsyncTool):
                raise ValueError(f"tool {name!r} has worker processes: it cannot be removed while running")
        for tool in add:
            if not isinstance(tool, AsyncTool):
                raise ValueError(f"tool {tool.name!r} is not an AsyncTool: only those can be added while running")
            if tool.name in self.tools and tool.name not in remove:
                raise ValueError(f"duplicate tool name {tool.name!r}")
        for name in remove:
            self.tools.pop(name, None)
            self._pools.pop(name, None)
        for tool in add:
            self.tools[tool.name] = tool
            self._pools[tool.name] = _LoopPool(self, tool)

    def _log_containment(self, pool: _Pool | _LoopPool) -> None:
        """Say at start-up what each tool's workers are confined by (the README promises it)."""
        tool = pool.tool
        info_fn = getattr(tool, "info", None)
        info = dict(info_fn() or {}) if callable(info_fn) else {}
        if pool.in_loop:
            log.info("tool %r: runs in the gateway's event loop (its work is done by another service), up to %d "
                     "calls at once, wall time %ss; %s", tool.name, pool.tool.max_concurrent, tool.timeout_s,
                     json.dumps(info, default=str))
            return
        rlimits = next((w.info.get("rlimits") for w in pool.workers if w.info), None)
        kind = "a fresh process per call" if pool.per_call else f"{pool.spares} reusable worker(s)"
        log.info("tool %r: %s, memory %s MB, CPU %ss per call, wall time %ss; %s; rlimits %s",
                 tool.name, kind, pool.limits["memory_mb"], pool.limits["cpu_s"], tool.timeout_s,
                 json.dumps(info, default=str), json.dumps(rlimits))
        if info.get("network_isolation") == "none":
            log.warning("tool %r runs WITHOUT network isolation", tool.name)

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def begin(
        self,
        name: str,
        call_id: str | None = None,
        *,
        partial: bool = True,
        request: Any = None,
        timeout_s: float | None = None,
    ) -> ToolCall:
        """Start a call as soon as its name is decoded.

        ``partial=False`` holds every event back until :meth:`ToolCall.finish`
        (the baseline a benchmark compares against).  ``request`` is passed to
        the policy; its ``"key"`` (the caller's API key name) decides the
        caller's turn when workers are busy.  Raises :class:`UnknownTool`; a
        veto or other failure is held by the call and surfaces from its
        ``field``/``line``/``finish``.
        """
        if self._state != "running":
            raise RuntimeError("ToolRuntime is not running (call start() first)")
        pool = self._pools.get(name)
        if pool is None or not pool.tool.enabled:
            raise UnknownTool(f"unknown tool {name!r}")
        call = ToolCall(
            self,
            pool,
            call_id or f"call_{next(_call_ids)}",
            partial=partial,
            request=request,
            timeout_s=timeout_s or pool.tool.timeout_s,
        )
        try:
            await call._open()
        except ToolError as exc:
            call._fail(exc)  # held by the call; reported by field/line/finish
        return call

    async def run(
        self, name: str, arguments: dict[str, Any], *, call_id: str | None = None, request: Any = None
    ) -> ToolResult:
        """Run a complete call in one go (no partial execution); never raises ToolError."""
        try:
            call = await self.begin(name, call_id, partial=False, request=request)
        except UnknownTool as exc:
            now = time.time()
            return ToolResult(call_id or "", name, False, error=str(exc), error_type=exc.error_type,
                              started_at=now, finish_called_at=now, finished_at=now, partial=False)
        return await call.finish(arguments)

    def worker_info(self, name: str) -> list[dict[str, Any]]:
        """What each live worker of ``name`` reported at start-up (pid, isolation, rlimits, ...)."""
        pool = self._pools.get(name)
        return [dict(w.info) for w in pool.workers if w.alive and w.info] if pool else []

    def worker_pids(self) -> list[int]:
        return [w.pid for pool in self._pools.values() for w in pool.workers if w.alive]

    async def close(self) -> None:
        """Stop every worker (killing stragglers and their children) and tear tools down.  Idempotent."""
        if self._state == "closed":
            return
        self._state = "closing"
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for pool in self._pools.values():
            pool.waiters.fail_all(ToolCancelled("the tool runtime is shutting down"))
        workers = [w for pool in self._pools.values() for w in pool.workers]
        await asyncio.gather(*(w.stop(self.stop_grace_s) for w in workers), return_exceptions=True)
        for tool in self.tools.values():
            try:
                tool.teardown()
            except Exception:
                log.exception("tool %r teardown failed", tool.name)
        self._state = "closed"

    async def __aenter__(self) -> ToolRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
