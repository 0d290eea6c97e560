"""Sessions: who owns which Semantic Variables, and when they are freed.

Parrot keeps one DAG per registered session.  Here a session is created
with ``POST /v1/sessions`` (by whoever may use the API: the server's API key
when keys are configured) and answers with a fresh bearer *token*; every
later request about the session must carry that token.  So a session's
variables and calls are reachable only by the client that created it: an
unknown session is 404, another session's token 403, and a variable id of
another session is 404 inside yours (it is simply not in your graph).

A session holds engine contexts (its running calls, the prefix contexts it
shares) and text (its variables).  Everything is freed on ``DELETE``, when
the session has been idle for its ``ttl_s`` (no request in flight counts as
activity: a blocking ``get`` keeps it alive), and at shutdown.  Limits per
session (variables, pending calls, bytes of text) and on the number of
sessions keep one client from holding the server's memory; per API key (the
session's creator), the sessions it holds and its calls pending over all of
them are bounded too (gateway/key_limits.py), so one key cannot take every
session slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional, Tuple

from starlette.requests import Request

from ..errors import APIError
from .graph import Limits, Services, SessionGraph
from ..config import SessionsConfig
from ..http_guard import bearer_token
from ..key_limits import KeyLimits, key_name

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    id: str
    token: str
    caller: Any  # the ApiKey that created it (its permissions apply to tool nodes), or None
    ttl_s: float
    graph: SessionGraph
    last_used: float = field(default_factory=time.monotonic)
    active: int = 0  # requests in flight

    @property
    def expires_at(self) -> float:
        return time.time() + self.ttl_s - (time.monotonic() - self.last_used)

    def expired(self, now: float) -> bool:
        return self.active == 0 and now - self.last_used > self.ttl_s

    @contextlib.contextmanager
    def in_use(self) -> Iterator["Session"]:
        self.active += 1
        self.last_used = time.monotonic()
        try:
            yield self
        finally:
            self.active -= 1
            self.last_used = time.monotonic()

    def describe(self) -> Dict[str, Any]:
        return {"id": self.id, "ttl_s": self.ttl_s, "expires_at": round(self.expires_at, 3),
                "limits": self.graph.limits.as_dict(), **self.graph.describe()}


class SessionStore:
    def __init__(self, services: Services, config: SessionsConfig = SessionsConfig(),
                 key_limits: Optional[KeyLimits] = None):
        self.services, self.config, self.key_limits = services, config, key_limits
        if key_limits is not None:
            key_limits.holdings = self.holdings
        self.sessions: Dict[str, Session] = {}
        self._reaper: Optional["asyncio.Task[None]"] = None
        self._wake = asyncio.Event()  # a new session may expire sooner than the reaper's next round
        self._closing: set = set()    # expired sessions being freed outside the reaper

    async def start(self) -> None:
        self._reaper = asyncio.ensure_future(self._reap())

    def create(self, caller: Any, ttl_s: Any = None) -> Session:
        cfg = self.config
        if not cfg.enabled:
            raise APIError(404, "sessions are disabled on this server (server.sessions.enabled)",
                           code="sessions_disabled")
        if ttl_s is None:
            ttl_s = cfg.ttl_s
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= cfg.max_ttl_s:
            raise APIError(400, f"ttl_s must be a number of seconds in (0, {cfg.max_ttl_s}]", param="ttl_s")
        if len(self.sessions) >= cfg.max_sessions:
            raise APIError(429, f"the server holds its limit of {cfg.max_sessions} sessions; delete one or wait "
                                "for idle ones to expire", code="too_many_sessions")
        if self.key_limits is not None:
            self.key_limits.check_sessions(caller, len(self._of(caller)))
        sid = f"ses_{secrets.token_hex(12)}"
        limits = Limits(cfg.max_variables, cfg.max_pending_calls, cfg.max_bytes)
        s = Session(sid, f"sst_{secrets.token_urlsafe(32)}", caller, float(ttl_s),
                    SessionGraph(sid, self.services, limits, caller, key_check=self._key_check(caller)))
        self.sessions[sid] = s
        self._wake.set()
        return s

    def _of(self, caller: Any) -> list:
        """The sessions created by ``caller``'s key (every session without API keys)."""
        name = key_name(caller)
        return [s for s in self.sessions.values() if key_name(s.caller) == name]

    def _key_check(self, caller: Any) -> Any:
        """What a session's graph asks before it takes new calls: the key's pending calls over its sessions."""
        if self.key_limits is None:
            return None
        limits = self.key_limits

        def check(new_calls: int) -> None:
            limits.check_pending_calls(caller, sum(s.graph.pending_calls() for s in self._of(caller)), new_calls)
        return check

    def holdings(self) -> Iterator[Tuple[Optional[str], int, int]]:
        """(key name, sessions, pending calls) of each session (the per-key metrics sum them)."""
        for s in self.sessions.values():
            yield key_name(s.caller), 1, s.graph.pending_calls()

    def authorize(self, request: Request, sid: str) -> Session:
        """The session ``sid`` if the request carries its token."""
        token = bearer_token(request)
        if not token:
            raise APIError(401, "missing session token (send 'Authorization: Bearer <token>' with the token "
                                "POST /v1/sessions returned)", code="invalid_session_token")
        s = self.sessions.get(sid)
        if s is not None and s.expired(time.monotonic()):  # the reaper has not come round yet
            del self.sessions[sid]
            task = asyncio.ensure_future(s.graph.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            s = None
        if s is None or s.graph.closed:
            raise APIError(404, f"no session {sid!r} (deleted, expired, or never created)",
                           code="session_not_found")
        if not hmac.compare_digest(token.encode(), s.token.encode()):
            raise APIError(403, f"this token does not belong to session {sid!r}", "permission_error",
                           code="permission_denied")
        return s

    async def delete(self, session: Session) -> None:
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
        await session.graph.close()

    async def _reap(self) -> None:
        while True:
            shortest = min((s.ttl_s for s in self.sessions.values()), default=self.config.ttl_s)
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(5.0, max(0.05, shortest / 4)))
            now = time.monotonic()
            for s in [s for s in self.sessions.values() if s.expired(now)]:
                log.info("session %s expired after %.0f s idle", s.id, s.ttl_s)
                try:
                    await self.delete(s)
                except Exception:  # noqa: BLE001  (the reaper must go on; the error is logged)
                    log.exception("freeing expired session %s failed", s.id)

    async def close(self) -> None:
        """Shutdown: every session is freed."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        for s in list(self.sessions.values()):
            await self.delete(s)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
