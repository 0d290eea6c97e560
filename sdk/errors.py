"""Typed errors: one class per thing a caller may want to handle differently.

The server answers every error as ``{"error": {"message", "type", "param",
"code"}}`` (docs/semantic-variables.md).  The SDK turns that body into an
exception whose class says *what kind* of failure it was (so ``except
NotFoundError`` reads like the intent) and whose attributes keep everything
the server said (so nothing is lost for logs): ``message``, ``status``,
``code``, ``param``, ``type`` and the raw ``body``.

A streamed variable reports its failure as an SSE event, with no HTTP
status; the error's ``code`` then chooses the class (``producer_failed`` is
a :class:`ProducerFailedError` either way).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Type


class InterlaceError(Exception):
    """Every error the SDK raises.  ``str(err)`` is the server's message."""

    def __init__(self, message: str, *, status: Optional[int] = None, code: Optional[str] = None,
                 param: Optional[str] = None, type: Optional[str] = None,
                 body: Optional[Mapping[str, Any]] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.type = type
        self.body: Dict[str, Any] = dict(body or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status}, code={self.code!r})"


class BadRequestError(InterlaceError):
    """400: the request is malformed (a placeholder without a binding, a cycle, a bad transform),
    or 413 ``request_too_large`` (the body is over the server's size limit)."""


class AuthenticationError(InterlaceError):
    """401: a missing or wrong API key (creating a session) or session token."""


class PermissionDeniedError(InterlaceError):
    """403: another session's token, or a permission the API key lacks (server-side tools)."""


class NotFoundError(InterlaceError):
    """404: an unknown (deleted, expired, or another session's) session, variable, call,
    model or tool."""


class GetTimeoutError(InterlaceError):
    """408: the variable had no value within the requested ``timeout``.  Not a failure of the
    producer: asking again later may succeed."""


class ConflictError(InterlaceError):
    """409: the variable already has a value or a producer."""


class SessionLimitError(InterlaceError):
    """429 ``session_limit`` (too many variables or pending calls) or 413 ``session_bytes``
    (too much stored text): free something, or use another session."""


class ProducerFailedError(InterlaceError):
    """424: the call that produces the variable failed (engine or tool error, a transform that
    did not match, a failed input).  ``call`` is the failing call's id; the message says why."""

    def __init__(self, message: str, *, call: Optional[str] = None, **kw: Any):
        super().__init__(message, **kw)
        self.call = call


class ServerError(InterlaceError):
    """5xx: the server failed; the request may be retried."""


class APIConnectionError(InterlaceError):
    """The server could not be reached, or the connection broke before a full answer."""


class APITimeoutError(APIConnectionError):
    """The HTTP request itself timed out (the client's ``timeout``, not a variable's)."""


class NoSessionError(InterlaceError):
    """A semantic function was called outside any session: pass ``session=`` or call it
    inside ``with client.session():``."""


_BY_STATUS: Dict[int, Type[InterlaceError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
    408: GetTimeoutError, 409: ConflictError, 413: SessionLimitError, 424: ProducerFailedError,
    429: SessionLimitError,
}
#: For errors without an HTTP status (an SSE ``error`` event): the status their code implies.
_STATUS_BY_CODE: Dict[str, int] = {
    "producer_failed": 424, "timeout": 408, "session_not_found": 404, "variable_not_found": 404,
    "call_not_found": 404, "invalid_session_token": 401, "permission_denied": 403, "session_limit": 429,
    "session_bytes": 413, "variable_already_set": 409, "variable_has_producer": 409,
}


def error_class(status: Optional[int], code: Optional[str] = None) -> Type[InterlaceError]:
    """The exception class for an HTTP status (or, without one, for the error's code)."""
    if status is None:
        status = _STATUS_BY_CODE.get(code or "")
    if status is None:
        return InterlaceError
    if status == 413 and code == "request_too_large":
        return BadRequestError
    if status >= 500:
        return ServerError
    return _BY_STATUS.get(status, InterlaceError)


def error_from_body(body: Any, status: Optional[int] = None) -> InterlaceError:
    """The exception for an error body (``{"error": {...}}``) or a bare error object.
    A body that is not the server's error shape still becomes an error, with the text shown."""
    err = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(err, Mapping):
        err = body if isinstance(body, Mapping) and "message" in body else {}
    message = err.get("message") if isinstance(err.get("message"), str) else None
    if message is None:
        message = f"HTTP {status}: {body!r}" if status is not None else f"unexpected error: {body!r}"
    code = err.get("code") if isinstance(err.get("code"), str) else None
    cls = error_class(status, code)
    if cls is InterlaceError and status is None:  # an SSE error event: OpenAI's type says whose fault it was
        cls = {"server_error": ServerError, "invalid_request_error": BadRequestError}.get(err.get("type"), cls)
    kw: Dict[str, Any] = dict(status=status, code=code, param=err.get("param"), type=err.get("type"),
                              body=body if isinstance(body, Mapping) else {"error": err})
    if cls is ProducerFailedError:
        # The contract puts the failing call's id in "call"; accept it beside "error" too.
        call = err.get("call")
        if call is None and isinstance(body, Mapping):
            call = body.get("call")
        return ProducerFailedError(message, call=call, **kw)
    return cls(message, **kw)
