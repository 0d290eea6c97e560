"""Runs tool calls in pre-started worker processes, fed while the model decodes.

Why processes: tools are arbitrary Python (a code interpreter, a database
driver) and must neither hold the gateway's GIL nor take it down when they
crash, hang or get OOM-killed.  Why pre-started: a call should not pay for an
interpreter start and warm imports; that is paid once at start-up and again
only when a worker has to be replaced.

Each tool gets its own small pool (``Tool.workers`` processes) because worker
set-up is tool-specific: the ``python`` tool's workers drop network access and
lower resource limits, which a search tool's workers must not inherit.

IPC is one duplex :func:`multiprocessing.Pipe` per worker.  The gateway side
never blocks the event loop: replies are read from an ``add_reader`` callback,
and requests go through a per-worker sender thread (a worker busy running a
long statement would otherwise stall the loop once the pipe buffer filled).

Protocol (tuples; ``token`` tags every message with the call it belongs to,
so a late reply from an abandoned call can never be mistaken for another's)::

    gateway -> worker   ("start", token) ("field", token, key, value)
                        ("line", token, text) ("finish", token, arguments)
                        ("cancel", token) ("stop",)
    worker -> gateway   ("ready", info) ("init_error", text)
                        ("error", token, error_type, message, field)   early failure
                        ("result", token, ok, content, error_type, message, field)
                        ("cancelled", token)

Failure model: a tool that raises gives an error result; one that outlives
``timeout_s`` after ``finish()`` is killed (SIGKILL) and its worker replaced;
one whose worker dies gives a :class:`ToolCrashed` result and a replacement.
``finish()`` never raises for a tool failure, it returns an error
:class:`ToolResult`; ``field()``/``line()`` raise the failure once it is known
so the caller can stop feeding (and, for invalid arguments, stop decoding).
"""

from __future__ import annotations

import asyncio
import copy
import ctypes
import itertools
import json
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .tools import (
    Granularity,
    InvalidToolArguments,
    Tool,
    ToolCancelled,
    ToolCrashed,
    ToolError,
    ToolTimeout,
    ToolVetoed,
    UnknownTool,
)

__all__ = ["ToolRuntime", "ToolCall", "ToolResult", "Policy"]

log = logging.getLogger(__name__)

#: ``policy(tool_name, arguments, request) -> veto message or None``.
Policy = Callable[[str, dict[str, Any], Any], "str | None"]

_tokens = itertools.count(1)
_call_ids = itertools.count(1)


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


# =========================================================================== worker side


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the gateway dies, even mid-computation.

    PR_SET_PDEATHSIG fires when the *thread* that forked us exits, which is
    why the runtime starts workers from the event-loop thread only.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # parent already gone before prctl took effect
        os._exit(0)


def _describe(exc: BaseException) -> tuple[str, str, str | None]:
    """(error_type, message, field) for an exception raised by a handler."""
    if isinstance(exc, InvalidToolArguments):
        return "InvalidToolArguments", exc.message, exc.field
    if isinstance(exc, ToolError):
        return exc.error_type, str(exc), None
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    return type(exc).__name__, f"{type(exc).__name__}: {exc}", None


def _worker_main(conn: Any, tool: Tool, parent_pid: int) -> None:
    """Entry point of a worker process: serve calls one at a time until told to stop."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the gateway's to handle
    try:
        if tool.nice > 0:
            os.nice(tool.nice)
        info = dict(tool.worker_init() or {})
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", {"pid": os.getpid(), **info}))

    token: int | None = None
    inst: Tool | None = None
    failure: tuple[str, str, str | None] | None = None

    def attempt(fn: Callable[..., Any], *args: Any) -> Any:
        nonlocal failure
        try:
            return fn(*args)
        except BaseException as exc:  # noqa: BLE001 - a tool's SystemExit must not end the worker
            failure = _describe(exc)
            return None

    def close_call() -> None:
        nonlocal token, inst, failure
        if inst is not None:
            try:
                inst.on_close()
            except BaseException as exc:  # noqa: BLE001
                _describe(exc)
        token, inst, failure = None, None, None

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        op = msg[0]
        if op == "stop":
            break
        if op == "start":
            close_call()
            token, inst = msg[1], copy.copy(tool)
            attempt(inst.on_start)
            if failure:
                conn.send(("error", token, *failure))
            continue
        if inst is None or msg[1] != token:
            continue  # stale message for a call this worker no longer serves
        if op in ("field", "line"):
            if failure:
                continue  # the call is doomed; the gateway already knows
            attempt(inst.on_field if op == "field" else inst.on_line, *msg[2:])
            if failure:
                conn.send(("error", token, *failure))
        elif op == "finish":
            result = None if failure else attempt(inst.on_finish, msg[2])
            if failure is None and not isinstance(result, str):
                try:
                    json.dumps(result)
                except (TypeError, ValueError) as exc:
                    failure = ("ToolError", f"tool returned a non-JSON result: {exc}", None)
            if failure:
                conn.send(("result", token, False, None, *failure))
            else:
                conn.send(("result", token, True, result, None, None, None))
            close_call()
        elif op == "cancel":
            close_call()
            conn.send(("cancelled", msg[1]))
    close_call()


# =========================================================================== gateway side


class _Worker:
    """Gateway-side handle of one worker process."""

    def __init__(self, runtime: ToolRuntime, pool: _Pool) -> None:
        self.runtime = runtime
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.alive = False
        self.info: dict[str, Any] = {}
        self.call: ToolCall | None = None
        self._ready: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        parent_conn, child_conn = runtime._ctx.Pipe(duplex=True)
        self.conn = parent_conn
        self.process = runtime._ctx.Process(
            target=_worker_main,
            args=(child_conn, pool.tool, os.getpid()),
            name=f"interlace-tool-{pool.tool.name}",
            daemon=True,  # multiprocessing's atexit kills daemons instead of joining them
        )
        self.process.start()
        child_conn.close()  # so EOF on our end means the worker is gone
        self.pid = self.process.pid
        self.alive = True
        self.loop.add_reader(self.conn.fileno(), self._on_readable)
        self._sender = threading.Thread(target=self._send_loop, name=f"interlace-send-{self.pid}", daemon=True)
        self._sender.start()

    async def wait_ready(self, timeout: float) -> None:
        try:
            self.info = await asyncio.wait_for(self._ready, timeout)
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
        self.loop.remove_reader(self.conn.fileno())
        self._outbox.put(None)
        self.process.join(0.5)  # reap; after EOF or SIGKILL this is quick
        try:
            self.conn.close()
        except OSError:
            pass
        if not self._ready.done():
            self._ready.set_exception(RuntimeError(f"tool {self.pool.tool.name!r} worker exited during start-up"))
        call, self.call = self.call, None
        if call is not None:
            call._on_worker_dead(self.process.exitcode)
        self.runtime._worker_lost(self)

    def kill(self) -> None:
        """SIGKILL the worker (hung or abandoned call) and report it dead."""
        if self.process.exitcode is None:
            try:
                self.process.kill()
            except (OSError, ValueError):
                pass
        self._on_dead()

    async def stop(self, grace_s: float) -> None:
        """Ask the worker to exit; kill it if it has not after ``grace_s``."""
        self.send(("stop",))
        deadline = time.monotonic() + grace_s
        while self.process.exitcode is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.kill()


class _Pool:
    """The warm workers of one tool."""

    def __init__(self, tool: Tool, size: int) -> None:
        self.tool = tool
        self.size = size
        self.workers: set[_Worker] = set()
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()

    async def acquire(self, timeout: float) -> _Worker:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                worker = await asyncio.wait_for(self.idle.get(), max(remaining, 0.0))
            except asyncio.TimeoutError:
                raise ToolError(f"no worker for tool {self.tool.name!r} became free in {timeout:g}s") from None
            if worker.alive:
                return worker

    def release(self, worker: _Worker) -> None:
        worker.call = None
        if worker.alive:
            self.idle.put_nowait(worker)


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
        pool: _Pool,
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
        self._done = False

    # -- events from the parser --------------------------------------------------------

    async def _open(self) -> None:
        """Run at begin: the policy check, then the worker for early granularities."""
        self._check_policy(self.fields)
        if self.partial and self.tool.granularity is not Granularity.ON_FINISH:
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
            self._worker.send(("field", self.token, key, value))

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
            self._worker.send(("line", self.token, text))

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
            if self._worker is None:  # partial off or ON_FINISH: replay everything now
                worker = await self._attach_worker()
                kind = self.tool.granularity
                if kind is Granularity.ON_FIELD:
                    for key, value in self.fields.items():
                        worker.send(("field", self.token, key, value))
                elif kind is Granularity.ON_LINE:
                    for text in self.lines:
                        worker.send(("line", self.token, text))
            assert self._worker is not None and self._result is not None
            self._worker.send(("finish", self.token, arguments))
            try:
                reply = await asyncio.wait_for(asyncio.shield(self._result), self.timeout_s)
            except asyncio.TimeoutError:
                self._fail(ToolTimeout(f"tool {self.tool.name!r} did not finish within {self.timeout_s:g}s"))
                self._kill_worker()
                return self._make_result(ok=False)
            except ToolError as exc:  # worker died
                self._fail(exc)
                return self._make_result(ok=False)
            _, _, ok, content, error_type, message, field = reply
            self._release_worker()
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

    async def cancel(self, reason: str = "cancelled") -> None:
        """Abandon the call: the worker drops it (or is killed if busy).  Idempotent."""
        if self._done:
            return
        self._done = True
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
        return ToolError(message, error_type=error_type)

    async def _attach_worker(self) -> _Worker:
        worker = await self.pool.acquire(self.runtime.acquire_timeout_s)
        worker.call = self
        self._worker = worker
        self._worker_pid = worker.pid
        loop = asyncio.get_running_loop()
        self._result = loop.create_future()
        self._cancel_ack = loop.create_future()
        worker.send(("start", self.token))
        return worker

    def _on_message(self, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        if op == "error":
            self._fail(self._rebuild(*msg[2:5]))
        elif op == "result" and self._result is not None and not self._result.done():
            self._result.set_result(msg)
        elif op == "cancelled" and self._cancel_ack is not None and not self._cancel_ack.done():
            self._cancel_ack.set_result(None)

    def _on_worker_dead(self, exitcode: int | None) -> None:
        self._worker = None
        how = f"killed by signal {-exitcode}" if exitcode and exitcode < 0 else f"exit code {exitcode}"
        exc = ToolCrashed(f"tool {self.tool.name!r} worker died ({how})")
        self._fail(exc)
        if self._result is not None and not self._result.done():
            self._result.set_exception(exc)
            self._result.exception()  # mark retrieved: nobody may be awaiting yet
        if self._cancel_ack is not None and not self._cancel_ack.done():
            self._cancel_ack.set_result(None)

    def _release_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            self.pool.release(worker)

    def _kill_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.call = None
            worker.kill()

    async def _abandon_worker(self) -> None:
        """Take the call off its worker: polite cancel, SIGKILL after a grace period."""
        worker = self._worker
        if worker is None or self._cancel_ack is None:
            return
        if worker.call is not self:  # already handed back
            self._worker = None
            return
        worker.send(("cancel", self.token))
        try:
            await asyncio.wait_for(asyncio.shield(self._cancel_ack), self.runtime.cancel_grace_s)
        except asyncio.TimeoutError:
            self._kill_worker()
            return
        self._release_worker()

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
    """Warm worker pools for a set of tools, and the calls that run on them.

    Use from one event loop (the one that called :meth:`start`)::

        runtime = ToolRuntime(tools, policy=host.before_tool_execution)
        await runtime.start()
        call = await runtime.begin("python", "call_1")
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
        start_method: str = "spawn",
        start_timeout_s: float = 60.0,
        acquire_timeout_s: float = 60.0,
        cancel_grace_s: float = 0.5,
        stop_grace_s: float = 1.0,
    ) -> None:
        """``workers`` overrides ``Tool.workers`` (one count for all, or per tool name).

        ``start_method`` defaults to ``spawn``: forking a gateway that holds
        threads, an event loop and possibly CUDA state is unsafe, and the
        start-up cost is paid once, not per call.
        """
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
        self._ctx: Any = multiprocessing.get_context(start_method)
        self._pools: dict[str, _Pool] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._state = "new"

    async def start(self) -> None:
        """Prepare every tool and start all its workers; return when all are warm."""
        if self._state != "new":
            raise RuntimeError("ToolRuntime.start() called twice")
        self._state = "starting"
        try:
            for tool in self.tools.values():
                await asyncio.to_thread(tool.setup)
            for name, tool in self.tools.items():
                self._pools[name] = _Pool(tool, max(1, self._sizes[name]))
            await asyncio.gather(*(self._spawn(pool) for pool in self._pools.values() for _ in range(pool.size)))
        except BaseException:
            await self.close()
            raise
        self._state = "running"

    async def _spawn(self, pool: _Pool) -> None:
        worker = _Worker(self, pool)  # started here, in the loop thread (see _die_with_parent)
        pool.workers.add(worker)
        await worker.wait_ready(self.start_timeout_s)
        pool.idle.put_nowait(worker)

    def _worker_lost(self, worker: _Worker) -> None:
        pool = worker.pool
        pool.workers.discard(worker)
        if self._state != "running":
            return
        log.warning("tool %r worker %s exited; starting a replacement", pool.tool.name, worker.pid)
        task = asyncio.get_running_loop().create_task(self._replace(pool))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, pool: _Pool) -> None:
        for attempt in range(5):
            try:
                await self._spawn(pool)
                return
            except Exception:
                log.exception("tool %r: replacement worker failed to start", pool.tool.name)
                await asyncio.sleep(0.2 * 2**attempt)

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
        (the baseline a benchmark compares against).  Raises
        :class:`UnknownTool`; a veto or other failure is held by the call and
        surfaces from its ``field``/``line``/``finish``.
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
        """What each live worker of ``name`` reported at start-up (pid, isolation, ...)."""
        pool = self._pools.get(name)
        return [dict(w.info) for w in pool.workers if w.alive and w.info] if pool else []

    def worker_pids(self) -> list[int]:
        return [w.pid for pool in self._pools.values() for w in pool.workers if w.alive]

    async def close(self) -> None:
        """Stop every worker (killing stragglers) and tear tools down.  Idempotent."""
        if self._state == "closed":
            return
        self._state = "closing"
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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
