"""One tool call's life, fed by the parser while the model decodes: begin, field, line, finish, cancel.

A :class:`ToolCall` takes a worker from its tool's pool (:mod:`.pool`) when
the tool wants events early, forwards each argument or statement as soon as
the parser completes it, and turns the worker's reply into a
:class:`ToolResult`.  It asks the runtime's policy before it runs and again
whenever its arguments grow.

The wall-time limit ``timeout_s`` counts the time the worker works on the
call, from the first event it gets (at :meth:`ToolRuntime.begin
<interlace.gateway.tools.runtime.ToolRuntime.begin>` under partial
execution), not from ``finish()``: a statement that hangs while the model is
still writing is killed then, while the model's own pauses between
statements are not counted.  A call past it is killed (its whole process
group and every descendant, :mod:`.process`) and its worker replaced.

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
import signal
import time
from collections.abc import Hashable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .base import (
    Granularity,
    InvalidToolArguments,
    ToolCancelled,
    ToolCrashed,
    ToolError,
    ToolTimeout,
    ToolUnavailable,
    ToolVetoed,
)
from .pool import LoopPool, Worker, WorkerPool
from .settings import RuntimeSettings

__all__ = ["ToolCall", "ToolResult"]

log = logging.getLogger(__name__)

_tokens = itertools.count(1)


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


class ToolCall:
    """One in-flight tool call, fed by the parser's events.  Get it from :meth:`~.runtime.ToolRuntime.begin`.

    ``field``/``line`` return as soon as the event is queued for the worker:
    the tool runs concurrently with decoding.  They raise the call's failure
    (a :class:`ToolError`, typically :class:`InvalidToolArguments`) once it is
    known; ``failure`` holds it for callers that prefer polling.
    """

    def __init__(
        self,
        settings: RuntimeSettings,
        pool: WorkerPool | LoopPool,
        call_id: str,
        *,
        partial: bool,
        request: Any,
        timeout_s: float,
    ) -> None:
        self.settings = settings
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
        self._worker: Worker | None = None
        self._worker_pid: int | None = None
        self._result: asyncio.Future[tuple[Any, ...]] | None = None
        self._cancel_ack: asyncio.Future[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._inflight = 0  # events sent to the worker and not yet acknowledged
        self._busy_since: float | None = None
        self._busy_total = 0.0  # seconds the worker has spent on this call so far
        self._done = False

    # -- events from the parser --------------------------------------------------------

    async def open(self) -> None:
        """Run at begin: the policy check, then the worker for early granularities.

        A failure (a veto, no worker free in time) is held by the call and
        reported by :meth:`field`, :meth:`line` or :meth:`finish`.
        """
        try:
            self._check_policy(self.fields)
            if self.partial and self.tool.granularity is not Granularity.ON_FINISH and not self.pool.in_loop:
                await self._attach_worker()
        except ToolError as exc:
            self._fail(exc)

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
                await self._attach_worker()
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
        assert isinstance(self.pool, LoopPool)
        tool = self.tool
        why = tool.unavailable()
        if why:
            self._fail(ToolUnavailable(why))
            return self._make_result(ok=False)
        try:
            await asyncio.wait_for(self.pool.slots.acquire(), self.settings.acquire_timeout_s)
        except asyncio.TimeoutError:
            self._fail(ToolError(f"no slot for tool {tool.name!r} became free in {self.settings.acquire_timeout_s:g}s"))
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
        if self.settings.policy is None:
            return
        veto = self.settings.policy(self.tool.name, arguments, self.request)
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

    async def _attach_worker(self) -> Worker:
        worker = await self.pool.acquire(self.key, self.settings.acquire_timeout_s)
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

    def on_worker_message(self, msg: tuple[Any, ...]) -> None:
        """A reply of the worker to this call (its pool's :class:`~.pool.Worker` hands it over)."""
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

    def on_worker_dead(self, exitcode: int | None) -> None:
        """The worker died while serving this call: the call fails (timeout at the CPU limit, else crash)."""
        worker = self._worker
        if exitcode == -signal.SIGKILL and worker is not None and not worker.retired and self._hit_cpu_limit():
            exc: ToolError = ToolTimeout(f"tool {self.tool.name!r} was killed at its CPU limit of "
                                         f"{self.pool.limits['cpu_s']:g}s")
        else:
            how = f"killed by signal {-exitcode}" if exitcode and exitcode < 0 else f"exit code {exitcode}"
            reason = worker.death_reason if worker is not None else None  # e.g. its cgroup ran out of memory
            exc = ToolCrashed(f"tool {self.tool.name!r} worker died ({reason or how})")
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
            worker.kill()  # reports back through on_worker_dead, which detaches
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
            await asyncio.wait_for(asyncio.shield(self._cancel_ack), self.settings.cancel_grace_s)
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
