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


def block_size(live) -> int:
    return live.gateway.models["smollm2"].engine.block_size


def call_then_history(c, live):
    """A replayed client-side call, and the conversation the client sends back after running it."""
    r = c.chat.completions.create(model="smollm2", messages=USER, tools=[WEATHER], temperature=0, max_tokens=60,
                                  extra_body={"interlace": {"replay": CALL}})
    assert r.choices[0].finish_reason == "tool_calls"
    # nothing adopted; the prefix cache may hold the prompt's whole blocks from an earlier test's request
    assert r.usage.prompt_tokens_details.cached_tokens % block_size(live) == 0
    (tc,) = r.choices[0].message.tool_calls
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
                      {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    return r, history


def metric(live, name, label: str = "") -> float:
    for line in httpx.get(live.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and 'model="smollm2"' in line and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


SAVED = "interlace_prefill_tokens_saved_total"


def test_follow_up_adopts_the_context_and_gives_the_same_reply(live):
    alice, bob = client(live, "alice-key"), client(live, "bob-key")
    saved_before = metric(live, SAVED, 'mechanism="retention"')
    r, history = call_then_history(alice, live)
    assert len(store(live)) == 1 and engine_contexts(live) == 1  # kept for the follow-up
    # another tenant sending the same conversation does not adopt alice's context
    other = bob.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], temperature=0,
                                        max_tokens=16)
    # (the prefix cache, shared by all callers as in vLLM, gives bob the whole blocks alice's context sealed)
    bs = block_size(live)
    assert other.usage.prompt_tokens_details.cached_tokens % bs == 0 and len(store(live)) == 1
    mine = alice.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], temperature=0,
                                         max_tokens=16)
    cached = mine.usage.prompt_tokens_details.cached_tokens
    # everything alice's context held: the prompt and the reply, all but its last token (never computed);
    # then the blocks of the rest that bob's request left in the prefix cache
    held = r.usage.prompt_tokens + r.usage.completion_tokens - 1
    assert held <= cached < mine.usage.prompt_tokens
    assert cached == held or cached % bs == 0
    assert mine.choices[0].message.content == other.choices[0].message.content  # greedy: the same reply
    assert mine.usage.prompt_tokens == other.usage.prompt_tokens
    assert len(store(live)) == 0
    assert metric(live, SAVED, 'mechanism="retention"') == saved_before + held
    assert metric(live, "interlace_retention_hits_total") >= 1


def test_streaming_follow_up_reports_cached_tokens(live):
    alice = client(live, "alice-key")
    _, history = call_then_history(alice, live)
    chunks = list(alice.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], temperature=0,
                                                max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert len(store(live)) == 0


def test_an_identical_prompt_reports_the_prefix_caches_hits(live):
    """cached_tokens counts the prompt tokens the engine's prefix cache served, as vLLM reports
    them (whole blocks, never the whole prompt: its last token is computed for the logits), streamed
    or not; ``interlace_prefill_tokens_saved{mechanism="prefix_cache"}`` counts them."""
    alice, bs = client(live, "alice-key"), block_size(live)
    messages = [{"role": "user", "content": f"Name three rivers of Europe ({time.time_ns()})."}]  # nobody's before
    first = alice.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=2)
    assert first.usage.prompt_tokens > 2 * bs
    assert first.usage.prompt_tokens_details.cached_tokens < bs  # at most a block shared with other prompts
    saved = metric(live, SAVED, 'mechanism="prefix_cache"')
    again = alice.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % bs == 0
    assert cached == (again.usage.prompt_tokens - 1) // bs * bs  # every whole block before the last token
    assert metric(live, SAVED, 'mechanism="prefix_cache"') == saved + cached
    chunks = list(alice.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=2,
                                                stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_eviction_frees_contexts(live):
    s = store(live)
    spec = s.spec
    try:
        s.spec = RetentionSpec(max_contexts=1, max_tokens=spec.max_tokens, ttl_s=1.0)
        alice, bob = client(live, "alice-key"), client(live, "bob-key")
        call_then_history(alice, live)
        _, bob_history = call_then_history(bob, live)
        assert [e.owner for e in s.entries.values()] == ["bob"]  # alice's, the older one, went first
        deadline = time.time() + 10
        while len(s) and time.time() < deadline:  # the TTL frees bob's with no request coming
            time.sleep(0.05)
        assert len(s) == 0
        deadline = time.time() + 5
        while engine_contexts(live) and time.time() < deadline:
            time.sleep(0.05)
        assert engine_contexts(live) == 0
        # an evicted context is simply not there: the follow-up is prefilled anew (but for the
        # whole blocks its freed KV left in the prefix cache)
        retained_before = metric(live, SAVED, 'mechanism="retention"')
        r = bob.chat.completions.create(model="smollm2", messages=bob_history, tools=[WEATHER], max_tokens=4)
        assert r.usage.prompt_tokens_details.cached_tokens % block_size(live) == 0
        assert metric(live, SAVED, 'mechanism="retention"') == retained_before
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
    saved = metric(live, SAVED, 'mechanism="retention"')
    r2 = alice.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], max_tokens=2)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    adopted = metric(live, SAVED, 'mechanism="retention"') - saved
    held = r.usage.prompt_tokens + r.usage.completion_tokens - 1  # all but the reply's last token
    bs = live.gateway.models["smollm2"].engine.block_size
    # cached: what the adopted context held, then perhaps blocks of the rest that an earlier
    # request (another case here) left in the prefix cache
    assert adopted <= cached < r2.usage.prompt_tokens and (cached == adopted or cached % bs == 0)
    if whole:
        assert adopted == held
    else:  # adopted up to the whole blocks before the first differing token: the prompt at least
        assert r.usage.prompt_tokens // bs * bs <= adopted < held and adopted % bs == 0
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
