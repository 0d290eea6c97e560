"""Runs tool calls in contained worker processes, fed while the model decodes: the runtime the gateway holds.

Why processes: tools are arbitrary Python (a code interpreter, a database
driver) and must neither hold the gateway's GIL nor take it down when they
crash, hang or get OOM-killed.  Why started ahead: see :mod:`.pool`.

:class:`ToolRuntime` is the one object the gateway (the chat loop, Semantic
Variables' tool nodes, the MCP server) talks to: it prepares every tool,
starts its pool, begins calls and closes it all down.  The work is done by
the modules below it, which it hands its :class:`~.settings.RuntimeSettings`
and :class:`~.settings.Lifecycle` instead of itself:

* :mod:`.pool`: the gateway-side worker handles, the fair queue of callers and
  the pools (the IPC protocol is described there);
* :mod:`.call`: one call's life and its :class:`~.call.ToolResult` (the wall
  time and the failure model are described there);
* :mod:`.process`: the worker's environment and killing its process tree
  (the containment is described there);
* :mod:`.worker`: the worker process itself.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .base import AsyncTool, Tool, ToolCancelled, UnknownTool
from .call import ToolCall, ToolResult
from .pool import LoopPool, WorkerPool
from .sandbox import unavailable_reason
from .settings import Lifecycle, Policy, RuntimeSettings

__all__ = ["ToolRuntime"]

log = logging.getLogger(__name__)

_call_ids = itertools.count(1)


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
        ungranted: Iterable[str] = (),
    ) -> None:
        """``workers`` overrides ``Tool.workers`` (one count for all, or per tool name).

        ``ungranted`` names tools no caller may use (the gateway's permissions
        grant them to nobody): one of those whose sandbox cannot be built here
        is left out -- not started, reported by its ``info()`` and in
        :attr:`left_out` -- instead of failing start-up.  Any other tool whose
        sandbox cannot be built fails start-up (``SandboxUnavailable``)."""
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
        self.settings = RuntimeSettings(policy=policy, start_timeout_s=start_timeout_s,
                                        acquire_timeout_s=acquire_timeout_s, cancel_grace_s=cancel_grace_s,
                                        stop_grace_s=stop_grace_s)
        self._life = Lifecycle()
        self._pools: dict[str, WorkerPool | LoopPool] = {}
        self._ungranted = frozenset(ungranted)
        self.left_out: dict[str, Tool] = {}  # tools not started because their sandbox cannot be built here

    async def start(self) -> None:
        """Prepare every tool and start its warm workers; return when all are warm.

        Raises what a tool's ``setup`` raises (e.g. the python tool's
        :class:`~interlace.gateway.tools.base.ToolConfigError` when the network
        cannot be isolated) or :class:`RuntimeError` when a worker fails to start.
        """
        if self._life.state != "new":
            raise RuntimeError("ToolRuntime.start() called twice")
        self._life.state = "starting"
        try:
            for name in sorted(self._ungranted & set(self.tools)):  # before setup: nothing to undo
                self._leave_out_if_unsandboxable(self.tools[name])
            for tool in self.tools.values():
                await asyncio.to_thread(tool.setup)
            for name, tool in self.tools.items():
                self._pools[name] = self._new_pool(tool)
            await asyncio.gather(*(pool.spawn() for pool in self._pools.values() for _ in range(pool.spares)))
        except BaseException:
            await self.close()
            raise
        self._life.state = "running"
        for pool in self._pools.values():
            pool.top_up()
            self._log_containment(pool)

    def _leave_out_if_unsandboxable(self, tool: Tool) -> None:
        """Leave out a tool no caller may use when its sandbox cannot be built: the gateway still starts."""
        if getattr(tool, "allow_unisolated", False):
            return  # it runs without the sandbox, as configured
        reason = unavailable_reason(tool)
        if reason is None:
            return
        tool.sandbox_in_force = {"sandbox": "unavailable", "reason": reason}
        self.left_out[tool.name] = self.tools.pop(tool.name)
        log.warning("tool %r is NOT available: %s. No caller may use it in this configuration, so the gateway "
                    "starts without it; a request naming it gets unknown_tool. Granting it (server.server_tools, "
                    "server.api_keys[].server_tools) makes start-up fail until the sandbox can be built.",
                    tool.name, reason)

    def _new_pool(self, tool: Tool) -> WorkerPool | LoopPool:
        if isinstance(tool, AsyncTool):
            return LoopPool(tool)
        return WorkerPool(tool, self._sizes[tool.name], self.settings, self._life)

    def update_tools(self, add: Iterable[AsyncTool] = (), remove: Iterable[str] = ()) -> None:
        """Add or drop :class:`AsyncTool` tools while running (an MCP server's tool
        list changed when it reconnected).  Calls already begun keep their tool;
        a tool with worker processes cannot be added or dropped here."""
        if not self._life.running:
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
            self._pools[tool.name] = LoopPool(tool)

    def _log_containment(self, pool: WorkerPool | LoopPool) -> None:
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
        if not self._life.running:
            raise RuntimeError("ToolRuntime is not running (call start() first)")
        pool = self._pools.get(name)
        if pool is None or not pool.tool.enabled:
            raise UnknownTool(f"unknown tool {name!r}")
        call = ToolCall(
            self.settings,
            pool,
            call_id or f"call_{next(_call_ids)}",
            partial=partial,
            request=request,
            timeout_s=timeout_s or pool.tool.timeout_s,
        )
        await call.open()  # a failure is held by the call; reported by field/line/finish
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
        if self._life.state == "closed":
            return
        self._life.state = "closing"
        await self._life.cancel_background()
        for pool in self._pools.values():
            pool.waiters.fail_all(ToolCancelled("the tool runtime is shutting down"))
        workers = [w for pool in self._pools.values() for w in pool.workers]
        await asyncio.gather(*(w.stop(self.settings.stop_grace_s) for w in workers), return_exceptions=True)
        for tool in self.tools.values():
            try:
                tool.teardown()
            except Exception:
                log.exception("tool %r teardown failed", tool.name)
        self._life.state = "closed"

    async def __aenter__(self) -> ToolRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
