"""Connection limits and read timeouts for uvicorn's h11 protocol; HTTP protocol errors in the API's error shape.

Why a protocol subclass: uvicorn's own settings do not cover a slow client.
``timeout_keep_alive`` runs only between requests (h11_impl arms it when a
response completes and cancels it at the first byte received), so a client
that sends part of a request head and then nothing -- or nothing at all --
holds its connection, and a file descriptor, forever; ``limit_concurrency``
answers 503 to *requests* beyond the limit but accepts every socket.  In the
adversarial trial 20,000 such connections exhausted the process's
descriptors: every accept failed ("Too many open files", 313,343 log lines)
and nobody was served.  :class:`GatewayProtocol` adds:

* **a cap on open connections** (``server.connections.max_connections``):
  at the cap, a new connection closes the oldest connection still waiting
  for a request head (an idle keep-alive one or a slow one), and is refused
  (503, closed at once) only when every connection has a request in flight.
  Descriptors stay bounded, and a client that sends its request promptly is
  served however many slow connections are open (tests/test_connections.py:
  250 slow connections against a cap of 40);
* **a header timeout** (``header_timeout_s``, from the connection or the
  request's first byte): a head not complete by then gets 408 (JSON) if
  part of it came, and the connection is closed;
* **a body timeout** (``body_timeout_s``, from the end of the head): a
  body not complete by then gets 408 if no response has started, and the
  connection is closed (the route sees a disconnect: a 499);
* **protocol errors answered in the API's shape** (a bad Content-Length, bad
  chunking, a NUL in a header, ...): 400 ``{"error": {..., "code":
  "bad_http_request"}}`` instead of uvicorn's plain text.

The gateway always serves HTTP/1.1 with h11 (gateway/server.py passes this
class as uvicorn's ``http=``): httptools, uvicorn's "auto" choice when it is
installed, has a different protocol class these hooks do not cover.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from .errors import RETRY_AFTER_S, APIError

log = logging.getLogger(__name__)


class Limits:
    """The limits of one server and what its connections share: the connections
    open now, and those waiting for a request head (oldest first: the first to go)."""

    def __init__(self, max_connections: int, header_timeout_s: float, body_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.open: set = set()
        self.waiting: "OrderedDict[GatewayProtocol, None]" = OrderedDict()

    def make_room(self) -> bool:
        """Whether a new connection may stay: below the cap, or once the oldest waiting one is closed."""
        if len(self.open) < self.max_connections:
            return True
        if not self.waiting:
            return False
        oldest, _ = self.waiting.popitem(last=False)
        log.info("connection cap (%d) reached: closed the oldest connection waiting for a request, from %s",
                 self.max_connections, _peer(oldest.client))
        oldest.close_waiting()
        return True


def error_response(status: int, message: str, type_: str, code: str, headers: Any = ()) -> bytes:
    """A whole HTTP/1.1 response with the API's error body, closing the connection:
    written to the socket as is where h11 has no request to answer."""
    body = json.dumps(APIError(status, message, type_, code=code).body()).encode()
    head = [f"HTTP/1.1 {status} {STATUS_PHRASES[status].decode()}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GatewayProtocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`Limits`' cap and timeouts, and JSON protocol errors.
    Built by uvicorn as ``http_protocol_class(config=..., server_state=..., app_state=...)``;
    gateway/server.py binds ``limits`` with functools.partial."""

    def __init__(self, config: Any, server_state: Any, app_state: Any, _loop: Any = None, *,
                 limits: Limits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.refused = False
        self.deadline: Optional[asyncio.TimerHandle] = None
        self.deadline_phase: Optional[str] = None  # "head" or "body": what the deadline waits for

    # ---- the cap
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        if not self.limits.make_room():
            self.refused = True
            log.warning("connection cap (%d) reached with every connection busy: refused %s",
                        self.limits.max_connections, _peer(transport.get_extra_info("peername")))
            transport.write(error_response(503, "the server has too many open connections; retry later",
                                           "server_error", "too_many_connections",
                                           [("retry-after", str(RETRY_AFTER_S))]))
            transport.close()
            return
        super().connection_made(transport)
        self.limits.open.add(self)
        self._set_deadline("head", self.limits.header_timeout_s)  # a silent connection too
        self.limits.waiting[self] = None

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.refused:
            return
        self._forget()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """uvicorn's graceful close; nothing to do for a connection this class is closing already."""
        if not self.refused and not self.transport.is_closing():
            super().shutdown()

    def close_waiting(self) -> None:
        """Close this connection, which waits for a request head, to make room for a new one."""
        self._forget()
        if not self.transport.is_closing():
            self.transport.close()

    def _forget(self) -> None:
        self.limits.open.discard(self)
        self.limits.waiting.pop(self, None)
        self._cancel_deadline()

    # ---- the timeouts: follow h11's state after every batch of events
    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # between requests or inside a head
            if self not in self.limits.waiting:
                self.limits.waiting[self] = None
            if self.deadline_phase != "head" and self.conn.trailing_data[0]:  # the first bytes of a head
                self._set_deadline("head", self.limits.header_timeout_s)
            return
        self.limits.waiting.pop(self, None)
        if state is h11.SEND_BODY:
            if self.deadline_phase != "body":
                self._set_deadline("body", self.limits.body_timeout_s)
        else:  # the request is in (or the connection is done): the app has it
            self._cancel_deadline()

    def _set_deadline(self, phase: str, seconds: float) -> None:
        self._cancel_deadline()
        self.deadline_phase = phase
        self.deadline = self.loop.call_later(seconds, self._deadline_passed)

    def _cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline, self.deadline_phase = None, None

    def _deadline_passed(self) -> None:
        phase, self.deadline, self.deadline_phase = self.deadline_phase, None, None
        if self.transport.is_closing():
            return
        if phase == "head":
            seconds, what = self.limits.header_timeout_s, "request head"
            answer = bool(self.conn.trailing_data[0])  # a silent or idle connection is just closed
        else:
            seconds, what = self.limits.body_timeout_s, "request body"
            answer = self.cycle is None or not self.cycle.response_started
        log.info("closed a connection from %s: no complete %s in %g s", _peer(self.client), what, seconds)
        if answer:
            self._answer(408, f"the {what} did not arrive within {seconds:g} s", "request_timeout")
        else:
            self._forget()
            self.transport.close()

    # ---- protocol errors (h11's RemoteProtocolError: uvicorn has logged a warning)
    def send_400_response(self, msg: str) -> None:
        if self.cycle is not None and self.cycle.response_started:  # too late for an answer
            self._forget()
            self.transport.close()
            return
        self._answer(400, "the request is not valid HTTP/1.1 (its request line, a header, Content-Length or "
                          "the chunked body)", "bad_http_request")

    def _answer(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` in the API's shape and close; the route, if one runs, sees a disconnect."""
        self._forget()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # its response goes nowhere now; its receive() says disconnect
            self.cycle.message_event.set()
        self.transport.write(error_response(status, message, "invalid_request_error", code))
        self.transport.close()


def _peer(addr: Any) -> str:
    return "%s:%d" % tuple(addr[:2]) if addr else "?"
