"""What the HTTP layer checks before a request reaches a model: who is calling
(API keys), what the caller may do (server-side tools, replay), where a
browser request comes from (Origin, CORS), and what the body is (JSON content
type, size limit enforced while reading) -- and, once a request runs, whether
its client is still there (:func:`until_disconnected`).

The threat model is in docs/security.md ("The HTTP surface").  In short: the
gateway runs code for callers (the ``python`` tool), so a request that only
*reaches* the port -- another user of the machine, a web page in the user's
browser posting ``text/plain`` to 127.0.0.1 -- must not be enough to use it.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from urllib.parse import urlsplit
from typing import Any, Awaitable, Dict, Iterable, List, Optional, TypeVar

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from .config import ApiKey, GatewayConfig, ServerTools, may_use_tool
from .errors import APIError, ClientGone

T = TypeVar("T")

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ identity
#: The challenge of every 401 (RFC 6750): the gateway takes bearer tokens (API keys) and is no
#: OAuth resource server, so there is no ``resource_metadata``.  Without a challenge MCP clients
#: (the MCP Inspector) assume OAuth and go looking for its discovery documents.
BEARER_REALM = 'Bearer realm="interlace"'


def unauthorized(message: str, request: Request) -> APIError:
    """A 401 in the API's shape with its ``WWW-Authenticate`` challenge; ``error="invalid_token"``
    only when a token was sent (RFC 6750 3.1: a request without credentials gets no error code)."""
    challenge = BEARER_REALM + (', error="invalid_token"' if api_key_token(request) else "")
    return APIError(401, message, "invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": challenge})


def bearer_token(request: Request) -> str:
    """The token of an ``Authorization: Bearer ...`` header, or ''."""
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def api_key_token(request: Request) -> str:
    """The key a request presents: its bearer token, else its ``x-api-key`` header (Anthropic's
    clients and Claude Code send the key there), or ''."""
    return bearer_token(request) or request.headers.get("x-api-key", "").strip()


def authenticate(config: GatewayConfig, request: Request) -> Optional[ApiKey]:
    """The caller's key, or None when the gateway has no keys (everyone is anonymous).

    Every configured key is compared in constant time, so timing does not tell
    how much of a guessed key was right."""
    if not config.api_keys:
        return None
    token = api_key_token(request)
    found = None
    for key in config.api_keys:
        if hmac.compare_digest(token.encode(), key.key.encode()) and token:
            found = key
    if found is None:
        raise unauthorized("invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                           request)
    return found


def authenticate_metrics(config: GatewayConfig, request: Request) -> None:
    """401 unless ``GET /metrics`` carries ``server.metrics_key`` (when one is set), compared in
    constant time.  A dedicated key: a scraper gets no API key that could run tools."""
    if config.metrics_key is None:
        return
    if not hmac.compare_digest(bearer_token(request).encode(), config.metrics_key.encode()):
        raise unauthorized("invalid or missing metrics key (send 'Authorization: Bearer <server.metrics_key>')",
                           request)


def permissions(config: GatewayConfig, caller: Optional[ApiKey]) -> tuple[ServerTools, bool]:
    """(server tools, replay) the caller may use: its key's, else the server-level ones."""
    if caller is not None:
        return caller.server_tools, caller.replay
    return config.server_tools, config.replay


def _forbidden(message: str, param: str) -> APIError:
    return APIError(403, message, "permission_error", param=param, code="permission_denied")


def authorize(config: GatewayConfig, caller: Optional[ApiKey], body: Dict[str, Any],
              enabled_tools: Iterable[str]) -> None:
    """Refuse (403) the Interlace extensions the caller may not use.

    ``interlace.server_tools: true`` with a key limited to a list of tools is
    narrowed to those tools (the request asked for "whatever I may use").  A
    name that is not an enabled tool is a 400 ``unknown_tool`` first, whoever
    asks, so a typo is not reported as a permission problem."""
    ext = body.get("interlace") or {}
    who = f"the API key {caller.name!r}" if caller else "an unauthenticated caller"
    allowed_tools, allowed_replay = permissions(config, caller)
    wanted = ext.get("server_tools")
    enabled = list(enabled_tools)
    if isinstance(wanted, list):
        unknown = next((n for n in wanted if n not in enabled), None)
        if unknown is not None:
            raise APIError(400, f"unknown server tool {unknown!r} (enabled: {', '.join(enabled) or 'none'})",
                           param="interlace.server_tools", code="unknown_tool")
    if wanted:
        if allowed_tools is False:
            raise _forbidden(f"{who} may not use server-side tools (interlace.server_tools); the gateway's "
                             "configuration grants them per key (server.api_keys[].server_tools)",
                             "interlace.server_tools")
        if wanted is True and allowed_tools is not True:
            ext["server_tools"] = [n for n in enabled if may_use_tool(allowed_tools, n)]
            if not ext["server_tools"]:
                raise _forbidden(f"{who} may use none of the enabled server-side tools", "interlace.server_tools")
        elif isinstance(wanted, list):
            for n in wanted:
                if not may_use_tool(allowed_tools, n):
                    raise _forbidden(f"{who} may not use the server-side tool {n!r} (allowed: "
                                     f"{', '.join(allowed_tools) or 'none'})", "interlace.server_tools")
    if ext.get("replay") is not None and not allowed_replay:
        raise _forbidden(f"{who} may not force the model's output (interlace.replay); it is for benchmarks "
                         "and tests and must be enabled in the configuration (server.replay)",
                         "interlace.replay")


def startup_warnings(config: GatewayConfig) -> List[str]:
    """Configurations that let anyone who reaches the port run code or force output."""
    if config.api_keys:
        return []
    out = []
    where = f"{config.host}:{config.port}"
    if config.server_tools:
        out.append(f"SECURITY: server-side tools are enabled (server.server_tools) and no API keys are "
                   f"configured: ANY client that can reach {where} can run them (the python tool runs "
                   f"arbitrary code). Configure server.api_keys, or turn server_tools off.")
    if config.replay:
        out.append(f"SECURITY: interlace.replay is enabled without API keys: any client that reaches {where} "
                   f"can force the model's output. Use it only for tests and benchmarks.")
    return out


# --------------------------------------------------------------------- body
def require_json(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (UTF-8).  A browser can send
    ``text/plain`` cross-origin without a preflight; it cannot send ``application/json``."""
    ctype = request.headers.get("content-type", "")
    kind, _, params = ctype.partition(";")
    charset = next((v.strip().strip('"').lower() for k, _, v in (p.partition("=") for p in params.split(";"))
                    if k.strip().lower() == "charset"), "utf-8")
    if kind.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise APIError(415, f"the request body must be JSON sent as 'Content-Type: application/json' "
                            f"(got {ctype or 'no Content-Type'!r})", code="unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit``: from its
    Content-Length before reading anything, else while the chunks arrive -- a client
    cannot make the gateway buffer more than ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(400, f"invalid Content-Length {declared!r}", code="invalid_request")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks: List[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over the limit of {limit} bytes (server.max_request_bytes)",
                    code="request_too_large")


# ------------------------------------------------------------------- client
async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` until it finishes or the client disconnects, whichever comes first;
    on a disconnect ``work`` is cancelled (its generation aborted, its context freed)
    and :class:`ClientGone` raised.  The body has been read, so the next ASGI message
    can only be ``http.disconnect``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            log.warning("request failed while its client disconnected: %r", task.exception())
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():  # we were cancelled ourselves
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ------------------------------------------------------------------- origin
def same_origin(origin: str, scope: Scope) -> bool:
    """Whether ``origin`` is the origin the request was sent to -- scheme, host and port equal to
    the connection's scheme and its ``Host`` header -- *and* that ``Host`` names this machine by
    address (an IP literal) or as ``localhost``.

    A DNS-rebinding page is same-origin too, but under the attacker's DNS name
    (``Host: evil.example``): only a name can be rebound, so such a request is
    still refused.  A page whose origin is ``http://127.0.0.1:8000`` was served
    by whatever listens on that port, i.e. by this server."""
    host = Headers(scope=scope).get("host")
    scheme = scope.get("scheme", "http")
    if not host:
        return False
    try:
        got, own = urlsplit(origin), urlsplit(f"{scheme}://{host}")
        ports = (got.port, own.port)
    except ValueError:  # a malformed port or address
        return False
    default = 443 if scheme == "https" else 80
    if (got.scheme, got.hostname, ports[0] or default) != (scheme, own.hostname, ports[1] or default):
        return False
    if got.path or got.query or got.fragment or got.username is not None or own.path or own.username is not None:
        return False
    return own.hostname is not None and _unrebindable(own.hostname)


def _unrebindable(hostname: str) -> bool:
    """An IP literal or ``localhost``: names no DNS server can point at this machine."""
    if hostname == "localhost":
        return True
    try:
        ipaddress.ip_address(hostname)
    except ValueError:
        return False
    return True


class OriginGuard:
    """Refuses (403) every request whose ``Origin`` header is neither an allowed origin
    nor the server's own (:func:`same_origin`).

    Browsers add ``Origin`` to cross-origin requests and to every POST; other
    clients (SDKs, curl) do not send it.  CORS headers alone would only stop a
    page from *reading* the answer -- the request would still run -- so a
    foreign origin is refused before any route sees it.  A same-origin request
    passes only when its ``Host`` is an address or ``localhost``: a
    DNS-rebinding page looks same-origin, but under a DNS name
    (docs/security.md, "Browsers: Content-Type, Origin, CORS")."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str] = ()):
        self.app = app
        self.allowed = {o.rstrip("/") for o in allowed}

    def allows(self, origin: str, scope: Scope) -> bool:
        return "*" in self.allowed or origin.rstrip("/") in self.allowed or same_origin(origin, scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            origin = Headers(scope=scope).get("origin")
            if origin is not None and not self.allows(origin, scope):
                err = APIError(403, f"requests from the browser origin {origin!r} are not allowed "
                                    "(server.cors_origins)", "permission_error", code="origin_not_allowed")
                await err.response(scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def cors_middleware_args(config: GatewayConfig) -> Dict[str, Any]:
    """Arguments of Starlette's CORSMiddleware for the configured origins."""
    return {"allow_origins": list(config.cors_origins), "allow_methods": ["GET", "POST"],
            "allow_headers": ["*"], "max_age": 600}
