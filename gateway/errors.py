"""One error shape for every route.

Domain code (the semantic graph, the chat loop's planning) raises the
HTTP-neutral errors below; the HTTP layer maps each class to a status and the
API's own error body in one place, registered once as Starlette exception
handlers (:func:`exception_handlers`, which ``create_app`` passes to
Starlette).  Routes never wrap themselves.

The body is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on
every route but the Anthropic Messages API's (``/v1/messages...``), which
answers in Anthropic's ``{"type": "error", "error": {"type", "message"}}``
(:func:`dialect`; the middleware's refusals too) -- the official clients retry 5xx, so a bad request must never
look like a server failure.  Engine errors are mapped here too
(:func:`engine_error`), once for the chat route and the semantic calls: a
context too long is the client's mistake (400), an engine that is gone a 503
to retry, anything else ours (500).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine_ext.errors import ContextTooLong, EngineClosed, EngineError, EngineUnavailable


class GatewayError(Exception):
    """A request the gateway cannot serve, said in the API's terms: a message, and
    optionally the request field it concerns (``param``) and a machine-readable ``code``."""

    def __init__(self, message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class InvalidInput(GatewayError):
    """The request itself is wrong (an HTTP 400)."""


class NotFound(GatewayError):
    """Something the request names does not exist (an HTTP 404): a model, a tool, a variable, a closed session."""


class NotAllowed(GatewayError):
    """The caller may not do this (an HTTP 403): e.g. a server-side tool its API key is not granted."""


class Conflict(GatewayError):
    """The request contradicts the state it acts on (an HTTP 409): e.g. a variable set twice."""


class TooLarge(GatewayError):
    """The request would make what it adds to exceed a size limit (an HTTP 413)."""


class LimitReached(GatewayError):
    """A count limit is reached; the client may retry once it has freed some (an HTTP 429)."""


class DependencyFailed(GatewayError):
    """Something the request depends on failed: a tool node, or an upstream call (an HTTP 424)."""


class ClientGone(Exception):
    """The client closed the connection before the answer was ready (nobody to answer: 499)."""


class APIError(Exception):
    """An error answered in OpenAI's shape, with its HTTP status (what the HTTP layer raises)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers  # extra response headers (Retry-After of a 503)

    def body(self, dialect: str = "openai") -> Dict[str, Any]:
        """The error body in OpenAI's shape, or (``dialect="anthropic"``) in Anthropic's."""
        if dialect == "anthropic":
            return anthropic_body(self)
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as the route at ``path`` answers it (its API's shape: :func:`dialect`)."""
        return JSONResponse(self.body(dialect(path)), status_code=self.status, headers=self.headers)


#: Path prefixes answered in Anthropic's error shape (the Messages API wing, gateway/anthropic/).
ANTHROPIC_PATHS = ("/v1/messages",)

#: Anthropic's error ``type`` by HTTP status (docs.anthropic.com, "Errors"); others: by class of status.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def dialect(path: str) -> str:
    """Which API's error shape the route at ``path`` speaks: ``"anthropic"`` or ``"openai"``."""
    return "anthropic" if path == ANTHROPIC_PATHS[0] or path.startswith(tuple(p + "/" for p in ANTHROPIC_PATHS)) \
        else "openai"


def anthropic_body(err: APIError) -> Dict[str, Any]:
    """``err`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.  Anthropic's
    errors have no ``param``: the field at fault leads the message (``"max_tokens: ..."``)."""
    type_ = ANTHROPIC_TYPES.get(err.status) or ("invalid_request_error" if err.status < 500 else "api_error")
    message = err.message
    if err.param and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": type_, "message": message}}


#: The HTTP status of each domain error.
STATUS = {InvalidInput: 400, NotAllowed: 403, NotFound: 404, Conflict: 409, TooLarge: 413, LimitReached: 429,
          DependencyFailed: 424}
#: The error ``type`` of a domain error whose type is not OpenAI's ``invalid_request_error``.
ERROR_TYPE = {NotAllowed: "permission_error"}

#: Seconds a client is asked to wait before retrying a request no engine (replica) could serve.
RETRY_AFTER_S = 1


def api_error(e: GatewayError) -> APIError:
    """A domain error in the API's shape."""
    status = next(STATUS[c] for c in type(e).__mro__ if c in STATUS)
    type_ = next((ERROR_TYPE[c] for c in type(e).__mro__ if c in ERROR_TYPE), "invalid_request_error")
    return APIError(status, e.message, type_, param=e.param, code=e.code)


def engine_error(e: EngineError) -> APIError:
    """An engine error in the API's shape: a context too long for the model is the
    client's mistake; an engine (replica) that is gone is a 503 to retry; other
    engine errors are ours.  The chat route answers it; a semantic call records
    its message and code as the call's error."""
    if isinstance(e, ContextTooLong):
        return APIError(400, str(e), code="context_length_exceeded")
    if isinstance(e, (EngineUnavailable, EngineClosed)):
        return APIError(503, f"engine unavailable: {e}", "server_error", code="engine_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, f"engine error: {e}", "server_error", code="engine_error")


def exception_handlers(metrics: Any) -> Dict[Any, Callable[[Request, Exception], Any]]:
    """The handlers ``create_app`` registers with Starlette, one per class.  Refused
    requests (an :class:`APIError`, a domain error) and clients gone (499) are
    counted in ``metrics`` by path; unknown endpoints and methods are answered
    in the same shape, uncounted, as is an unexpected exception (500)."""

    def refused(request: Request, err: APIError) -> Response:
        metrics.request(request.url.path, "", err.status)
        return err.response(request.url.path)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return refused(request, exc)

    async def on_domain_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return refused(request, api_error(exc))

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        # nobody to answer; 499 is what the access log and metrics show
        metrics.request(request.url.path, "", 499)
        return Response(status_code=499)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = {404: f"no such endpoint: {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return JSONResponse(APIError(exc.status_code, message, code=code).body(dialect(request.url.path)),
                            status_code=exc.status_code, headers=exc.headers)

    async def on_server_error(request: Request, exc: Exception) -> Response:
        # Starlette logs the traceback (the exception is re-raised after this answer).
        return JSONResponse(APIError(500, f"internal server error ({type(exc).__name__}); the gateway's log "
                                          "has the details", "server_error", code="internal_error").body(
                                              dialect(request.url.path)), status_code=500)

    return {APIError: on_api_error, GatewayError: on_domain_error, ClientGone: on_client_gone,
            HTTPException: on_http_error, Exception: on_server_error}
