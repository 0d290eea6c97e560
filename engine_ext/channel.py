"""Token events from an engine's own thread to the consumer's event loop.

Engines decode on a thread of their own (the native engine's thread, the
request-level engines' loop), while ``generate``'s caller iterates on its
loop.  A :class:`Channel` is the one way across: the engine ``emit``s events
(or an exception) from any thread; :meth:`Channel.events` yields them to
the consumer until a finish, and tells the engine to stop decoding when the
consumer leaves early -- including when it was cancelled while the stream
was being started.

An engine that emits to many streams at once (a decode step of the native
engine: one token per running stream) hands its events to an
:class:`Outbox` instead, which delivers them with one
``call_soon_threadsafe`` per consumer loop.  Why: each
``call_soon_threadsafe`` writes a byte to the loop's self-pipe (a socket
send) and wakes the loop, and one per token per stream was a large part of
the host's time per decode step at large batches, where a GPU step takes a
few ms (issue 36).  Measured (a 2-core CPU host, 256 streams on one loop,
one token each per step; medians over 380 steps, 6 runs): the engine thread spent
0.7-1.0 ms per step delivering them one by one, 0.09-0.14 ms in one call;
the step's tokens reached all 256 consumers after 2.1-7.3 ms, now 1.1-2.0 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterator, List, Tuple


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


def _put_all(items: List[Tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:  # on the consumer's loop, in the order they were put
        q.put_nowait(item)


class Outbox:
    """Events for many channels, delivered with one wake-up per consumer loop.

    Owned by one thread (the engine's).  ``put(channel, item)`` (``channel``:
    anything with the ``loop`` and ``queue`` of a :class:`Channel`) delivers
    at once, as :meth:`Channel.emit` does, unless inside :meth:`holding`: then
    items wait until the outermost ``holding`` block ends, however it ends
    (an exception included), and go out grouped by loop, each loop's in the
    order they were put.  So nothing waits past the block that produced it,
    and an event put outside one still reaches its queue before anything
    that thread does next (the future of the command that emitted it)."""

    def __init__(self) -> None:
        self._held = 0
        self._items: List[Tuple[Any, Any]] = []

    def emitter(self, channel: Any) -> Callable[[Any], None]:
        """A one-argument ``emit`` for ``channel`` through this outbox."""
        return lambda item: self.put(channel, item)

    def put(self, channel: Any, item: Any) -> None:
        self._items.append((channel, item))
        if not self._held:
            self.flush()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self.flush()

    def flush(self) -> None:
        """Send what was put: one ``call_soon_threadsafe`` per loop."""
        if not self._items:
            return
        items, self._items = self._items, []
        by_loop: Dict[asyncio.AbstractEventLoop, List[Tuple[asyncio.Queue, Any]]] = {}
        for ch, item in items:
            by_loop.setdefault(ch.loop, []).append((ch.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that consumer's loop is gone: nobody reads its events
                pass
