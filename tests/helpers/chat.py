"""Chat-completions helpers the end-to-end format tests share: a raw POST, the calls of a message,
and streamed tool-call deltas joined the way OpenAI clients join them."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import httpx

Call = Tuple[str, Dict[str, Any]]


def post(live, body: Dict[str, Any]) -> httpx.Response:
    return httpx.post(live.url + "/v1/chat/completions", json=body, timeout=600)


def calls_of(message) -> List[Call]:
    return [(tc.function.name, json.loads(tc.function.arguments)) for tc in message.tool_calls or []]


def assemble(chunks) -> List[Dict[str, Any]]:
    """Client-side tool calls from streamed deltas, the way OpenAI clients join them."""
    calls: Dict[int, Dict[str, Any]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            d = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            d["id"] = tc.id or d["id"]
            if tc.function is not None:
                d["name"] = tc.function.name or d["name"]
                d["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)]
