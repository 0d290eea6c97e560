"""Token events from an engine's own thread to the consumer's event loop.

Engines decode on a thread of their own (the native engine's thread, the
request-level engines' loop), while ``generate``'s caller iterates on its
loop.  A :class:`Channel` is the one way across: the engine ``emit``s events
(or an exception) from any thread; :meth:`Channel.events` yields them to
the consumer until a finish, and tells the engine to stop decoding when the
consumer leaves early -- including when it was cancelled while the stream
was being started.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable


class Channel:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def emit(self, item: Any) -> None:
        """Deliver a TokenEvent or an exception (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is gone
            pass

    async def events(self, start: Awaitable[Any], abort: Callable[[], None]) -> AsyncIterator[Any]:
        """Await ``start`` (the engine's command that begins the stream),
        then yield events until one has a ``finish_reason``; ``abort()`` is
        called when the consumer stops first (closed early, or cancelled
        while ``start`` ran: it may have started decoding)."""
        try:
            await start
        except asyncio.CancelledError:
            abort()
            raise
        finished = False
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:  # consumer stopped early: stop decoding at once
                abort()
