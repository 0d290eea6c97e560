"""Client-side tool calls keep their context for the follow-up request
(gateway/retention.py): adoption through the OpenAI endpoint, tenant
isolation, eviction, and the store's own rules on a stand-in engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from helpers.gateway_server import LiveGateway
from interlace.engine_ext.errors import ContextNotFound
from interlace.gateway.config import RetentionSpec
from interlace.gateway.retention import RetentionStore

KEYS = [{"key": "alice-key", "name": "alice"}, {"key": "bob-key", "name": "bob"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def live():
    m = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}
    cfg = {"server": {"api_keys": KEYS, "replay": True}, "models": {"smollm2": m},
           # preserve: the retained KV stays (infercept may rightly discard it: recomputing looks cheap
           # with an H100 profile), so what a hit saves is known exactly
           "engine": {"profile": "h100-llama-3-8b", "interception": "preserve"}, "plugins": {"entrypoints": False}}
    with LiveGateway(cfg) as gw:
        yield gw


def client(live, key):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=120)


def store(live) -> RetentionStore:
    return live.gateway.models["smollm2"].retention


def engine_contexts(live) -> int:
    return asyncio.run(live.gateway.models["smollm2"].engine.check_invariants())["contexts"]


def call_then_history(c):
    """A replayed client-side call, and the conversation the client sends back after running it."""
    r = c.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER], temperature=0, max_tokens=60,
                                  extra_body={"interlace": {"replay": CALL}})
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    (tc,) = r.choices[0].message.tool_calls
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
                      {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    return r, history


def metric(live, name) -> float:
    for line in httpx.get(live.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and 'model="smollm2"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_follow_up_adopts_the_context_and_gives_the_same_reply(live):
    alice, bob = client(live, "alice-key"), client(live, "bob-key")
    saved_before = metric(live, "interlace_retention_prefill_tokens_saved_total")
    r, history = call_then_history(alice)
    assert len(store(live)) == 1 and engine_contexts(live) == 1  # kept for the follow-up
    # another tenant sending the same conversation does not adopt alice's context
    other = bob.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], temperature=0,
                                        max_tokens=16)
    assert other.usage.prompt_tokens_details.cached_tokens == 0 and len(store(live)) == 1
    mine = alice.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], temperature=0,
                                         max_tokens=16)
    cached = mine.usage.prompt_tokens_details.cached_tokens
    # everything alice's context held: the prompt and the reply, all but its last token (never computed)
    assert cached == r.usage.prompt_tokens + r.usage.completion_tokens - 1
    assert mine.choices[0].message.content == other.choices[0].message.content  # greedy: the same reply
    assert mine.usage.prompt_tokens == other.usage.prompt_tokens
    assert len(store(live)) == 0
    assert metric(live, "interlace_retention_prefill_tokens_saved_total") == saved_before + cached
    assert metric(live, "interlace_retention_hits_total") >= 1


def test_streaming_follow_up_reports_cached_tokens(live):
    alice = client(live, "alice-key")
    _, history = call_then_history(alice)
    chunks = list(alice.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], temperature=0,
                                                max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert len(store(live)) == 0


def test_eviction_frees_contexts(live):
    s = store(live)
    spec = s.spec
    try:
        s.spec = RetentionSpec(max_contexts=1, max_tokens=spec.max_tokens, ttl_s=1.0)
        alice, bob = client(live, "alice-key"), client(live, "bob-key")
        call_then_history(alice)
        _, bob_history = call_then_history(bob)
        assert [e.owner for e in s.entries.values()] == ["bob"]  # alice's, the older one, went first
        deadline = time.time() + 10
        while len(s) and time.time() < deadline:  # the TTL frees bob's with no request coming
            time.sleep(0.05)
        assert len(s) == 0
        deadline = time.time() + 5
        while engine_contexts(live) and time.time() < deadline:
            time.sleep(0.05)
        assert engine_contexts(live) == 0
        # an evicted context is simply not there: the follow-up is prefilled anew
        r = bob.chat.completions.create(model="smollm2", messages=bob_history, tools=[WEATHER], max_tokens=4)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert metric(live, "interlace_retention_evictions_total") >= 2
    finally:
        s.spec = spec


# ------------------------------------------------------------------ the store alone
class FakeEngine:
    """Records frees and parks; ``fail_park`` makes park raise."""

    def __init__(self):
        self.freed, self.parked, self.fail_park = [], [], False

    def free_context_nowait(self, ctx):
        self.freed.append(ctx)

    async def free_context(self, ctx):
        self.freed.append(ctx)

    async def park(self, ctx, hint):
        if self.fail_park:
            raise ContextNotFound(ctx)
        self.parked.append((ctx, hint))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make(max_contexts=4, max_tokens=100, ttl_s=60.0):
    eng, clock = FakeEngine(), Clock()
    return eng, clock, RetentionStore(eng, "m", RetentionSpec(True, max_contexts, max_tokens, ttl_s), clock=clock)


def test_store_longest_prefix_owner_and_gap():
    async def go():
        eng, clock, s = make()
        for ctx, toks in (("a", [1, 2]), ("b", [1, 2, 3, 4])):
            await s.park(s.retain("alice", ctx, toks, "get_weather"))
        # learned apart from a server-side tool of the same name, and unknown so far
        assert eng.parked[0][1].tool == "client:get_weather" and eng.parked[0][1].expected_duration_s is None
        assert s.claim("bob", [1, 2, 3, 4, 5]) is None            # another tenant's
        assert s.claim("alice", [1, 2]) is None                   # nothing left to fill: not a follow-up
        got = s.claim("alice", [1, 2, 3, 4, 9])
        assert got.ctx == "b" and len(s) == 1                       # the longest match, taken out
        s.gaps.observe("client:get_weather", 7.5)                  # as the engine does once it is adopted
        await s.park(s.retain("alice", "c", [5, 6], "get_weather"))
        assert eng.parked[-1][1].expected_duration_s == 7.5        # the learned gap goes to the engine
        await s.close()
        assert sorted(eng.freed) == ["a", "c"] and len(s) == 0
    asyncio.run(go())


def test_store_limits_ttl_and_engine_errors():
    async def go():
        eng, clock, s = make(max_contexts=2, max_tokens=10, ttl_s=30)
        assert s.retain("k", "huge", list(range(11)), None) is None  # never fits: the caller keeps it
        for i in range(3):
            s.retain("k", f"c{i}", [i] * 3, None)
        assert eng.freed == ["c0"]                                   # max_contexts: least recent first
        s.retain("k", "c3", [7] * 5, None)
        assert eng.freed == ["c0", "c1"] and s.tokens == 8            # max_tokens
        clock.t += 31
        assert s.claim("k", [7] * 6) is None and len(s) == 0         # expired on the way
        eng.fail_park = True
        e = s.retain("k", "bad", [1], None)
        await s.park(e)                                              # an engine error drops it
        assert "bad" in eng.freed and len(s) == 0
        await s.close()
    asyncio.run(go())


@pytest.mark.parametrize("replay,whole", [
    ("Let me check.\n" + CALL, True),       # text before the call: rendered back as the model wrote it
    (CALL + "\n" + CALL.replace("Paris", "Rome"), True),  # two calls
    (CALL.replace('", "', '","').replace('": ', '":'), False),  # not the canonical JSON: re-rendered differently
])
def test_what_the_follow_up_matches(live, replay, whole):
    alice = client(live, "alice-key")
    r = alice.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER], temperature=0, max_tokens=80,
                                      extra_body={"interlace": {"replay": replay}})
    m = r.choices[0].message
    history = USER + [m.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": t.id, "content": "sunny"} for t in m.tool_calls]
    r2 = alice.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], max_tokens=2)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    held = r.usage.prompt_tokens + r.usage.completion_tokens - 1  # all but the reply's last token
    bs = live.gateway.models["smollm2"].engine.block_size
    if whole:
        assert cached == held
    else:  # adopted up to the whole blocks before the first differing token: the prompt at least
        assert r.usage.prompt_tokens // bs * bs <= cached < held and cached % bs == 0
    assert len(store(live)) == 0  # adopted


def test_store_adopts_a_reply_rendered_differently_up_to_the_difference():
    async def go():
        eng, clock, s = make()
        s.retain("alice", "a", [1, 2, 3, 4], "t", prompt_len=2)
        s.retain("alice", "other", [7, 8, 9], "t", prompt_len=2)
        got = s.claim("alice", [1, 2, 3, 5, 6])  # a's whole prompt, then a reply rendered differently
        assert got.ctx == "a" and got.matched == 3 and len(s) == 1
        s.retain("alice", "b", [1, 2, 3, 4], "t", prompt_len=2)
        assert s.claim("alice", [1, 2]) is None and len(s) == 2  # the same first prompt again: a new chat, kept
        assert s.claim("alice", [1, 9, 9]) is None and len(s) == 2  # less than its prompt in common: kept
        # two contexts of one conversation: the longer match is adopted, the other can never be: freed
        s.retain("alice", "c", [1, 2, 3, 6, 6], "t", prompt_len=2)
        got = s.claim("alice", [1, 2, 3, 6, 7, 8])
        assert got.ctx == "c" and got.matched == 4 and "b" in eng.freed and len(s) == 1
        await s.close()
    asyncio.run(go())
