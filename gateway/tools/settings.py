"""What a tool runtime hands down to its pools and calls: its settings and its lifecycle.

Pools and calls once held a reference to the :class:`~.runtime.ToolRuntime`
that made them and read its timeouts, its policy, its state and its task set
through it, private attributes included.  That tied the three classes into
one knot: no one of them could live in a module of its own without an import
circle.  The runtime now builds the two objects below and passes them down;
pools and calls know nothing of the runtime, and the modules import one way
only: ``process`` and ``settings`` at the bottom, then ``pool``, ``call``,
and ``runtime`` on top.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

__all__ = ["Policy", "RuntimeSettings", "Lifecycle"]

#: ``policy(tool_name, arguments, request) -> veto message or None``.
Policy = Callable[[str, dict[str, Any], Any], "str | None"]


@dataclass(frozen=True)
class RuntimeSettings:
    """The runtime's timeouts and policy, fixed for its life.

    ``start_timeout_s`` bounds a worker's start-up (pools); ``acquire_timeout_s``
    a call's wait for a worker or a slot and ``cancel_grace_s`` a busy worker's
    answer to a cancel before it is killed (calls); ``stop_grace_s`` a worker's
    exit at shutdown (the runtime).  ``policy`` is asked before a call runs and
    whenever its arguments grow.
    """

    policy: Policy | None = None
    start_timeout_s: float = 60.0
    acquire_timeout_s: float = 60.0
    cancel_grace_s: float = 0.5
    stop_grace_s: float = 1.0


class Lifecycle:
    """Where the runtime is in its life, and the background tasks it owns.

    ``state`` goes ``new`` → ``starting`` → ``running`` → ``closing`` →
    ``closed``; the runtime moves it, pools read it (a pool replaces lost
    workers only while the runtime runs).  A pool starts replacement workers
    as background tasks here, so that closing the runtime cancels them.
    """

    def __init__(self) -> None:
        self.state = "new"
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> bool:
        return self.state == "running"

    def background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task of the runtime's (cancelled by :meth:`cancel_background`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel_background(self) -> None:
        """Cancel every background task and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
