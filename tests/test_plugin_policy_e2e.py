"""The policy hook and the plugin listing through the HTTP API, as a deployed plugin sees them.

A real gateway (embedded model, replayed output so the test does not depend on
the small model's skill) with an API key named ``alice``: the
``before_tool_execution`` hook receives ``{"model", "user", "key"}`` with the
key's *name* (never the secret), its ``Veto`` becomes the tool result the model
reads, an `llm`-style ``return True`` refuses the call with an error naming the
plugin, and ``/v1/plugins`` lists the plugin's hooks and tools with ``info()``.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from helpers.gateway_server import LiveGateway
from interlace import Granularity, Tool, Veto, hookimpl

SECRET = "sk-alice-secret"


class Shout(Tool):
    """Upper-cases ``text`` in a worker; importable at module level for the spawn workers."""

    name = "shout"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    granularity = Granularity.ON_FINISH

    def info(self) -> dict[str, Any]:
        return {"volume": "loud"}

    def on_finish(self, arguments: dict[str, Any]) -> str:
        return arguments["text"].upper()


class Policy:
    """Records every request it is asked about; vetoes "forbidden", answers llm-style True to "llm"."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    @hookimpl
    def register_tools(self, register):
        register(Shout())

    @hookimpl
    def before_tool_execution(self, tool_name, arguments, request):
        self.requests.append(request)
        text = arguments.get("text", "")
        if text == "forbidden":
            return Veto(f"not for {request['key']}")
        if text == "llm":
            return True  # what a plugin written for llm's hook returns to allow
        return None


@pytest.fixture(scope="module")
def policy() -> Policy:
    return Policy()


@pytest.fixture(scope="module")
def live(policy: Policy):
    cfg = {"server": {"api_keys": [{"key": SECRET, "name": "alice", "server_tools": True, "replay": True}]},
           "models": {"smollm2": {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}}}
    with LiveGateway(cfg, plugins=[policy]) as gw:
        yield gw


def shout(live: LiveGateway, text: str) -> dict[str, Any]:
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=SECRET, max_retries=0, timeout=600)
    call = '<tool_call>\n{"name": "shout", "arguments": {"text": "%s"}}\n</tool_call>' % text
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "shout"}],
                                       max_tokens=80, user="u1",
                                       extra_body={"interlace": {"server_tools": ["shout"], "replay": [call, "ok"]}})
    (result,) = r.model_extra["interlace"]["tool_calls"]
    return result


def test_policy_gets_the_callers_key_name_and_allows(live, policy) -> None:
    policy.requests.clear()
    result = shout(live, "hello")
    assert result["ok"] and result["content"] == "HELLO"
    assert policy.requests and all(r == {"model": "smollm2", "user": "u1", "key": "alice"} for r in policy.requests)


def test_veto_is_the_tool_result(live) -> None:
    result = shout(live, "forbidden")
    assert not result["ok"] and result["error"] == "not for alice"


def test_llm_style_true_refuses_and_names_the_plugin(live) -> None:
    result = shout(live, "llm")
    assert not result["ok"] and "returned True" in result["error"] and "plugin '" in result["error"]


def test_plugins_route_lists_hooks_and_tool_info(live) -> None:
    r = httpx.get(live.url + "/v1/plugins", headers={"Authorization": f"Bearer {SECRET}"}, timeout=120)
    assert r.status_code == 200
    (mine,) = [p for p in r.json()["data"] if any(t["name"] == "shout" for t in p["tools"])]
    assert mine["hooks"] == ["before_tool_execution", "register_tools"] and not mine["builtin"]
    assert mine["tools"][0]["info"] == {"volume": "loud"}
