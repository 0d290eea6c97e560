"""What a streamed OpenAI answer needs of HTTP, shared by chat completions
(routes.py) and text completions (text_completions.py): the first event of a
completion awaited before the response starts (so an error up to it is still
an HTTP error: a context too long, an engine that refuses the sampling), and
a streaming response that closes its completion however it ends, and the
error event that ends a stream that broke after its first byte.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse

from ...engine_ext.errors import EngineError
from ..errors import APIError, engine_error

log = logging.getLogger(__name__)


async def first_event(events: AsyncIterator[Any]) -> Any:
    """The first event of ``events`` (None when there is none); an engine error as the API's error."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except EngineError as e:
        raise engine_error(e) from e


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes the completion it streams however it ends --
    even when the client is gone before the body iterator ever ran (which would
    otherwise leave the context to the garbage collector)."""

    def __init__(self, content: Any, on_close: Callable[[], Awaitable[None]], **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


async def chain(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``first`` (the event :func:`first_event` awaited), then the rest of ``events``."""
    if first is not None:
        yield first
        async for ev in events:
            yield ev


def stream_error(e: Exception) -> APIError:
    """What a stream that broke after its first byte tells its client (as an event, then ``[DONE]``):
    an engine error in the API's terms, anything else a 500; a 5xx is logged with its traceback."""
    err = engine_error(e) if isinstance(e, EngineError) else APIError(
        500, f"internal server error ({type(e).__name__}) while streaming; the gateway's log has the details",
        "server_error", code="internal_error")
    if err.status >= 500:
        log.error("streaming completion failed", exc_info=e)
    return err
