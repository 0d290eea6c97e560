"""The gateway feeds LAMPS per segment (issue 32), over HTTP with a real
gateway and engine: what the engine receives is recorded by wrapping the
real engine's methods (they still run).

A server-side tool that declares its expected time is hinted with it before
any call was timed; once a request has called it, the next request's first
hint carries the learned output length, the app's call time and the later
segment, the hint at its call the tool's learned time, and its resume the
next segment's prediction.  The in-process engine learns the tool's time
itself (pause to resume, into the same ``ToolDurations``): the gateway does
not count it twice."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List

import httpx
import pytest

from helpers.gateway_server import LiveGateway
from interlace import AsyncTool, hookimpl

DELAY = 0.3
CALL = '<tool_call>\n{"name": "wait", "arguments": {"delay": %s}}\n</tool_call>' % DELAY


class Wait(AsyncTool):
    name = "wait"
    description = "Wait a while."
    parameters = {"type": "object", "properties": {"delay": {"type": "number"}}, "required": ["delay"]}
    expected_s = 2.5  # the declared prior: used until the gateway has timed a call of it

    async def call(self, arguments, request):
        await asyncio.sleep(arguments["delay"])
        return "waited"


class Tools:
    @hookimpl
    def register_tools(self, register):
        register(Wait())


class Spy:
    """Records the hints the real engine's generate / set_request_hint / resume get, then calls them."""

    def __init__(self, engine: Any) -> None:
        self.calls: List[tuple] = []
        for name in ("generate", "set_request_hint", "resume"):
            setattr(engine, name, self._wrap(name, getattr(engine, name)))

    def _wrap(self, name: str, real: Any) -> Any:
        def spy(*args: Any, **kw: Any) -> Any:
            hint = kw.get("hint", args[1] if name == "set_request_hint" else None)
            self.calls.append((name, hint))
            return real(*args, **kw)
        return spy

    def take(self) -> Dict[str, list]:
        out: Dict[str, list] = {}
        for name, hint in self.calls:
            out.setdefault(name, []).append(hint)
        self.calls.clear()
        return out


@pytest.fixture(scope="module")
def live():
    cfg = {"server": {"server_tools": ["wait"], "replay": True},
           "models": {"smollm2": {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32",
                                  "max_model_len": 2048, "parser": "hermes"}}}
    with LiveGateway(cfg, plugins=[Tools()]) as gw:
        yield gw


def ask(live: LiveGateway) -> Dict[str, Any]:
    r = httpx.post(live.url + "/v1/chat/completions", timeout=600, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "wait please"}], "max_tokens": 80,
        # the baseline (no partial execution): the tool starts at the pause, so the context waits for it
        "interlace": {"server_tools": ["wait"], "replay": [CALL, "Done."], "partial_execution": False}})
    assert r.status_code == 200, r.text
    out = r.json()
    (res,) = out["interlace"]["tool_calls"]
    assert res["ok"] and res["content"] == "waited", res
    return out


def test_the_engine_gets_the_learned_output_length_and_tool_time_per_segment(live):
    model = live.gateway.models["smollm2"]
    spy = Spy(model.engine)

    ask(live)  # nothing learned yet: the declared time at the call, no predictions before it
    first = spy.take()
    (g,) = first["generate"]
    assert g.expected_output is None and g.expected_tool_s is None and g.future == ()
    (at_call,) = first["set_request_hint"]
    assert at_call.expected_tool == "wait" and at_call.expected_tool_s == Wait.expected_s
    (resumed,) = first["resume"]
    assert resumed.expected_output is not None  # the first segment's length, learned at its end

    learned_call = model.durations.estimate("wait")  # the engine's pause-to-resume time of the call
    learned_app = model.predictor.call_seconds("smollm2:")  # the app's, measured by the gateway
    ask(live)  # a request of the same app after one that called the tool
    second = spy.take()
    (g,) = second["generate"]
    # the output length of the first segment, a call expected after it (the app's mean call time,
    # measured pause to resume: at least the tool's sleep), and the answer segment after that call
    assert g.expected_output is not None and g.expected_output > 0
    assert g.expected_tool_s == learned_app and learned_app >= DELAY
    assert len(g.future) == 1 and g.future[0][1] is None and g.future[0][2] > 0  # the result's tokens
    (at_call,) = second["set_request_hint"]
    # the tool's learned time replaces the declared prior
    assert at_call.expected_tool == "wait" and at_call.expected_tool_s == learned_call >= DELAY
    (resumed,) = second["resume"]
    # after the call: the answer, and no further call (every request of this app ended after two segments)
    assert resumed.expected_output is not None and resumed.expected_tool_s is None and resumed.future == ()

    # the in-process engine timed both calls into the shared ToolDurations; the gateway did not again
    assert model.engine_times_calls
    assert model.durations.snapshot()["wait"][0] == 2


def test_a_semantic_call_is_hinted_with_its_output_and_the_calls_downstream(live):
    """Semantic Variables: a call's expected output is its ``max_tokens``
    until the app ``"semantic"`` has learned lengths, and its later segments
    are the LLM calls downstream of it in the session (known from the DAG)."""
    model = live.gateway.models["smollm2"]
    eng = model.engine
    seen: Dict[Any, Any] = {}
    real = eng.generate

    def spy(cid, *args, **kw):
        seen[cid[2]] = kw.get("hint")
        return real(cid, *args, **kw)

    eng.generate = spy
    try:
        with httpx.Client(base_url=live.url, timeout=600) as http:
            r = http.post("/v1/sessions", json={})
            assert r.status_code == 201, r.text
            sid, h = r.json()["id"], {"Authorization": f"Bearer {r.json()['token']}"}

            def call(template, inputs, n):
                r = http.post(f"/v1/sessions/{sid}/calls", headers=h, json={
                    "model": "smollm2", "template": template, "inputs": inputs,
                    "outputs": {"out": {"sampling": {"max_tokens": n, "temperature": 0}}}})
                assert r.status_code == 201, r.text
                return r.json()

            topic = http.post(f"/v1/sessions/{sid}/variables", headers=h, json={"name": "topic"}).json()["id"]
            a = call("Topic: {{input:t}}. One word: {{output:out}}", {"t": topic}, 5)
            b = call("Say more about {{input:a}}: {{output:out}}", {"a": a["outputs"]["out"]}, 7)
            assert http.put(f"/v1/sessions/{sid}/variables/{topic}", headers=h, json={"value": "tea"}).status_code == 200
            r = http.get(f"/v1/sessions/{sid}/variables/{b['outputs']['out']}", headers=h)
            assert r.status_code == 200, r.text
            http.delete(f"/v1/sessions/{sid}", headers=h)
    finally:
        del eng.generate
    ha, hb = seen[a["id"]], seen[b["id"]]
    assert ha.app == "semantic" and ha.expected_output == 5  # nothing learned yet: its max_tokens
    ((out, call_s, added),) = ha.future  # b is still to come
    assert (out, call_s) == (7, None) and added == len(model.tokenizer.encode("Say more about : ",
                                                                              parse_special=False))
    assert hb.future == () and 1 <= hb.expected_output <= 5  # learned from a's output (at most 5), not b's 7


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "2s", True])
def test_a_tools_declared_expected_time_is_checked_at_registration(bad):
    from interlace.gateway.tools.base import ToolConfigError

    tool = Wait()
    tool.expected_s = bad
    with pytest.raises(ToolConfigError, match="expected_s"):
        tool.check()
    tool.expected_s = 0.0
    tool.check()
