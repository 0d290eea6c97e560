"""Limits per API key: sessions, pending semantic calls and chat completions in flight.

The server-wide limits (``server.sessions.max_sessions``, the engine's own
queue) bounded what all callers hold together, so one key could take all of
it: in the adversarial trial one key took all 256 session slots, and nothing
stopped it from queueing any number of chat completions.  So each key (its
``name``; without API keys every caller is one key) holds at most
``max_sessions`` sessions, ``max_pending_calls`` semantic calls pending or
running over all its sessions, and ``max_concurrent_requests`` chat
completions in flight (``server.per_key``, or the key's own ``limits``;
gateway/config.py gives each key a share of the server's limits by default).
Beyond one the request is refused with 429 ``rate_limit_exceeded``, the
message naming the limit, and nothing of it is kept.

Who holds the compute once requests are admitted is the engine's business:
its queue is served fairly across keys (engine_ext/policies/fairness.py,
with the key's name as ``RequestHint.tenant``).  These limits bound what a
key can make the server *hold*; fairness bounds how long another key waits.

Sessions and pending calls are counted by the session store where they live
(gateway/semantic/sessions.py asks :meth:`KeyLimits.check_sessions` and
:meth:`KeyLimits.check_pending_calls`); chat completions are counted here by
:class:`ConcurrencyGuard`, an ASGI middleware, from the request's start to
its response's last byte (a stream included).  What each key holds is in
``/metrics`` by key name (names are operator-chosen, never secrets; one
label value per configured key, so the set is bounded).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request

from . import http_guard as guard_
from .config import ApiKey, GatewayConfig, PerKeyLimits
from .errors import APIError, LimitReached, api_error

#: The ``key`` label of callers when the gateway has no API keys (they are all one caller).
ANONYMOUS = ""

#: What a client is asked to wait before retrying a request refused by a per-key limit.
RETRY_AFTER_S = 1


def key_name(caller: Optional[ApiKey]) -> Optional[str]:
    """The caller's identity for the limits and the engine's fairness: its key's name (None: no keys)."""
    return caller.name if caller is not None else None


class KeyLimits:
    """The per-key limits of one gateway and the chat completions each key has in flight."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.in_flight: Counter = Counter()   # key name -> chat completions in flight
        self.refused: Counter = Counter()     # (key name, limit) -> requests refused
        # (key name, sessions, pending calls) of every key holding sessions; the session store sets it
        self.holdings: Callable[[], Iterable[Tuple[Optional[str], int, int]]] = lambda: ()

    def limits(self, caller: Optional[ApiKey]) -> PerKeyLimits:
        return caller.limits if caller is not None else self.config.per_key

    def _refuse(self, caller: Optional[ApiKey], limit: str, value: int, what: str) -> LimitReached:
        self.refused[(key_name(caller), limit)] += 1
        where = f"key {caller.name!r}" if caller is not None else "the server's callers (no API keys)"
        return LimitReached(f"per-key limit {limit} reached: {where} may hold at most {value} {what}; "
                            "retry when some have finished", code="rate_limit_exceeded")

    def check_sessions(self, caller: Optional[ApiKey], held: int) -> None:
        """Refuse a new session when the key holds ``held`` already."""
        limit = self.limits(caller).max_sessions
        if held + 1 > limit:
            raise self._refuse(caller, "max_sessions", limit, "sessions (delete one or let idle ones expire)")

    def check_pending_calls(self, caller: Optional[ApiKey], held: int, new: int) -> None:
        """Refuse ``new`` semantic calls when the key's sessions have ``held`` pending or running."""
        limit = self.limits(caller).max_pending_calls
        if held + new > limit:
            raise self._refuse(caller, "max_pending_calls", limit,
                               f"semantic calls pending or running over its sessions (it has {held}, the request "
                               f"adds {new})")

    def enter(self, caller: Optional[ApiKey], within_request: bool = False) -> None:
        """Count a chat completion in flight, or refuse it.  ``within_request``: asked from inside a
        request :class:`ConcurrencyGuard` already counts, for work that outlives it (a background
        response): that request's own slot is the one the work takes over, so it does not count."""
        name, limit = key_name(caller), self.limits(caller).max_concurrent_requests
        if self.in_flight[name] - within_request >= limit:
            raise self._refuse(caller, "max_concurrent_requests", limit, "chat completions in flight")
        self.in_flight[name] += 1

    def leave(self, caller: Optional[ApiKey]) -> None:
        name = key_name(caller)
        self.in_flight[name] -= 1
        if self.in_flight[name] <= 0:
            del self.in_flight[name]

    # ------------------------------------------------------------- metrics
    def describe(self) -> Iterator[Any]:
        return iter(())  # label values come from the config: nothing to describe ahead of a scrape

    def collect(self) -> Iterator[Any]:
        """Per key: chat completions in flight, sessions, pending calls, and refusals by limit."""
        names = [k.name for k in self.config.api_keys] or [None]
        label = {n: (ANONYMOUS if n is None else n) for n in names}
        held: Dict[Optional[str], Tuple[int, int]] = {}
        for name, sessions, pending in self.holdings():
            s, p = held.get(name, (0, 0))
            held[name] = (s + sessions, p + pending)
        gauges = [("interlace_key_requests_in_flight", "Chat completions in flight, per API key",
                   lambda n: self.in_flight.get(n, 0)),
                  ("interlace_key_sessions", "Semantic Variables sessions held, per API key",
                   lambda n: held.get(n, (0, 0))[0]),
                  ("interlace_key_pending_calls", "Semantic calls pending or running, per API key",
                   lambda n: held.get(n, (0, 0))[1])]
        for metric, doc, value in gauges:
            g = GaugeMetricFamily(metric, doc, labels=["key"])
            for n in names:
                g.add_metric([label[n]], value(n))
            yield g
        c = CounterMetricFamily("interlace_key_limit_refusals", "Requests refused by a per-key limit",
                                labels=["key", "limit"])
        for (n, limit), count in sorted(self.refused.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            if n in label:
                c.add_metric([label[n], limit], count)
        yield c


class ConcurrencyGuard:
    """ASGI middleware: at most ``max_concurrent_requests`` chat completions in flight per key.
    A request whose key is missing or wrong passes through (the route answers 401)."""

    # text completions, responses and messages count as chat's (one agent loop under all of them)
    PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})

    def __init__(self, app: Any, limits: KeyLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.PATHS:
            await self.app(scope, receive, send)
            return
        try:
            caller = guard_.authenticate(self.limits.config, Request(scope))
        except APIError:
            await self.app(scope, receive, send)
            return
        try:
            self.limits.enter(caller)
        except LimitReached as e:
            err = api_error(e)
            err.headers = {"Retry-After": str(RETRY_AFTER_S)}
            await err.response(scope.get("path", ""))(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limits.leave(caller)
