"""A streaming HTTP client for an ASGI app in the same process.

The tools benchmark drives the gateway through its public HTTP API (the
route authenticates, checks the caller's permissions for server tools and
replay, validates and plans the request) without a socket, so no network
stack adds noise.  It needs each server-sent event with the time it left the
app (the Validation workload measures when the tool error is known, mid-
stream), which a buffering test client cannot give: hence this small client
on the raw ASGI interface.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Dict, Iterable, Optional, Tuple


class HTTPStatusError(RuntimeError):
    """The app answered with a status other than 200 (the body says why)."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body.decode('utf-8', 'replace')[:2000]}")
        self.status = status
        self.body = body


async def post_sse(app: Any, path: str, body: Dict[str, Any],
                   headers: Iterable[Tuple[str, str]] = ()) -> AsyncIterator[Tuple[float, Any]]:
    """POST ``body`` as JSON to ``path``; yield ``(time.time(), event)`` for each
    server-sent event as the app sends it (``event`` is the parsed JSON, or the
    string ``"[DONE]"``).  Raises :class:`HTTPStatusError` for a non-200 answer.
    Leaving the loop early disconnects the client (the app sees
    ``http.disconnect``) and waits for the app to finish."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode()),
                    *((k.lower().encode(), v.encode()) for k, v in headers)],
        "client": ("127.0.0.1", 0), "server": ("bench", 80),
    }
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> Dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    status: Optional[int] = None
    error_body = bytearray()
    buf = bytearray()

    async def send(message: Dict[str, Any]) -> None:
        nonlocal status
        now = time.time()
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            if status != 200:
                error_body.extend(chunk)
            else:
                buf.extend(chunk)
                while b"\n\n" in buf:
                    event, _, rest = bytes(buf).partition(b"\n\n")
                    buf[:] = rest
                    for line in event.decode().splitlines():
                        if line.startswith("data: "):
                            data = line[len("data: "):]
                            out.put_nowait((now, data if data == "[DONE]" else json.loads(data)))
            if not message.get("more_body", False):
                out.put_nowait(None)

    async def serve() -> None:
        try:
            await app(scope, receive, send)
        finally:
            out.put_nowait(None)

    task = asyncio.ensure_future(serve())
    try:
        while True:
            item = await out.get()
            if item is None:
                break
            yield item
        if status != 200:
            raise HTTPStatusError(status or 0, bytes(error_body))
    finally:
        gone.set()
        await task  # the app's own errors surface here
