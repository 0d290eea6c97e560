"""One error shape for every route.

Domain code (the semantic graph, the chat loop's planning) raises the
HTTP-neutral errors below; the HTTP layer maps each class to a status and the
API's own error body in one place, registered once as Starlette exception
handlers.  Routes never wrap themselves.
"""

from __future__ import annotations

from typing import Optional


class GatewayError(Exception):
    """A request the gateway cannot serve, said in the API's terms: a message, and
    optionally the request field it concerns (``param``) and a machine-readable ``code``."""

    def __init__(self, message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class InvalidInput(GatewayError):
    """The request itself is wrong (an HTTP 400)."""


class DependencyFailed(GatewayError):
    """Something the request depends on failed: a tool node, or an upstream call (an HTTP 424)."""
