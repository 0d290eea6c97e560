"""The HTTP API as data, shared by the sync and the asyncio client.

Each endpoint is a function returning a :class:`Request` (method, path,
body, query, whose credential); :func:`decode` turns a response into its
JSON or a typed error; :func:`sse_events` reads a variable's event stream.
Nothing here does I/O, so the two clients differ only in how they send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, AsyncIterator, Dict, Iterable, Iterator, List, Optional

import httpx

from .errors import APIConnectionError, InterlaceError, error_from_body

API = "/v1/sessions"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    json: Optional[Dict[str, Any]] = None
    params: Dict[str, str] = field(default_factory=dict)
    #: The bearer credential: the API key (creating a session) or the session's token.
    token: Optional[str] = None
    #: Seconds the server may hold the answer back (a blocking get), added to the read timeout.
    wait_s: float = 0.0


def create_session(api_key: Optional[str], ttl_s: Optional[float],
                   calls: Optional[List[Dict[str, Any]]] = None) -> Request:
    body: Dict[str, Any] = {} if ttl_s is None else {"ttl_s": ttl_s}
    if calls is not None:
        body["calls"] = calls
    return Request("POST", API, json=body, token=api_key)


def session_info(sid: str, token: str) -> Request:
    return Request("GET", f"{API}/{sid}", token=token)


def delete_session(sid: str, token: str) -> Request:
    return Request("DELETE", f"{API}/{sid}", token=token)


def create_variable(sid: str, token: str, value: Optional[str], name: Optional[str]) -> Request:
    body = {k: v for k, v in (("name", name), ("value", value)) if v is not None}
    return Request("POST", f"{API}/{sid}/variables", json=body, token=token)


def set_variable(sid: str, token: str, vid: str, value: str) -> Request:
    return Request("PUT", f"{API}/{sid}/variables/{vid}", json={"value": value}, token=token)


def get_variable(sid: str, token: str, vid: str, criterion: Optional[str], wait_s: Optional[float],
                 stream: bool = False) -> Request:
    params = {"stream": "true" if stream else "false"}
    if criterion is not None:
        params["criterion"] = criterion
    if wait_s is not None:
        params["timeout_s"] = f"{wait_s:.3f}"
    return Request("GET", f"{API}/{sid}/variables/{vid}", params=params, token=token, wait_s=wait_s or 0.0)


def submit_call(sid: str, token: str, body: Dict[str, Any]) -> Request:
    return Request("POST", f"{API}/{sid}/calls", json=body, token=token)


def call_info(sid: str, token: str, cid: str) -> Request:
    return Request("GET", f"{API}/{sid}/calls/{cid}", token=token)


def headers(token: Optional[str]) -> Dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def decode(response: httpx.Response) -> Any:
    """The answer's JSON, or the typed error it stands for (any status outside 2xx)."""
    try:
        body = response.json() if response.content else None
    except ValueError:
        body = None
    if not response.is_success:
        if body is None:
            body = {"error": {"message": f"HTTP {response.status_code}: {response.text[:500]!r}"}}
        raise error_from_body(body, response.status_code)
    if body is None and response.content:
        raise InterlaceError(f"the server answered {response.status_code} with a body that is not JSON: "
                             f"{response.text[:500]!r}", status=response.status_code)
    return body


class SSEDecoder:
    """Server-sent events, line by line: :meth:`feed` returns an event's data once the blank
    line that ends it arrives.  Comments (``:`` keep-alives) and the ``event:``/``id:`` fields
    carry nothing this API uses and are skipped."""

    def __init__(self) -> None:
        self._data: List[str] = []

    def feed(self, line: str) -> Optional[str]:
        line = line.rstrip("\r")
        if line == "":
            return self.flush()
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> Optional[str]:
        data, self._data = self._data, []
        return "\n".join(data) if data else None


def is_done(data: str) -> bool:
    return data.strip() == "[DONE]"


def cut_off() -> APIConnectionError:
    """A stream that ends without ``[DONE]`` was cut off: the producer's result is unknown,
    which is an error rather than a silent end."""
    return APIConnectionError("the variable's event stream ended before [DONE]")


def sse_events(lines: Iterable[str]) -> Iterator[Dict[str, Any]]:
    """The JSON events of a stream of lines, up to ``data: [DONE]``."""
    decoder = SSEDecoder()
    for line in lines:
        data = decoder.feed(line)
        if data is not None:
            if is_done(data):
                return
            yield parse_event(data)
    data = decoder.flush()
    if data is not None and is_done(data):
        return
    raise cut_off()


async def asse_events(lines: AsyncIterable[str]) -> AsyncIterator[Dict[str, Any]]:
    """:func:`sse_events` over an async iterator of lines."""
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data is not None:
            if is_done(data):
                return
            yield parse_event(data)
    data = decoder.flush()
    if data is not None and is_done(data):
        return
    raise cut_off()


def parse_event(data: str) -> Dict[str, Any]:
    try:
        event = json.loads(data)
    except ValueError:
        raise InterlaceError(f"the server sent an event that is not JSON: {data[:200]!r}") from None
    if not isinstance(event, dict):
        raise InterlaceError(f"the server sent an event that is not an object: {data[:200]!r}")
    return event
