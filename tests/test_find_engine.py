"""Parrot's FindEngine across replicas (engine_ext/replicas.py, issue 35): a
task group lands on one replica where it fits, a call goes to the replica
holding its prefix (``RequestHint.prefix_keys``) even where load routing would
pick another, latency work goes to a replica whose cap allows it; semantic
calls and chat requests with a ``prompt_cache_key`` carry their keys through
the gateway; bad keys are refused.

Each placement test also shows what the rule overrides: the same call
without the hint goes elsewhere (so the test fails with plain load routing).
"""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from interlace.engine_ext import errors as E
from interlace.engine_ext.protocol import MAX_PREFIX_KEYS, RequestHint
from interlace.engine_ext.replicas import ROUTE_REASONS, ReplicaSet
from interlace.gateway.semantic.prefix_share import Piece, boundary_keys, hint_keys, with_prefix_keys

KA, KB, KC, KZ = "aa" * 16, "bb" * 16, "cc" * 16, "ff" * 16


class Fake:
    """An engine with the calls routing needs; its ``load_stats`` are what the test sets."""

    max_model_len = 4096

    def __init__(self, **stats):
        self.stats = {"kv_blocks_used": 0, "kv_blocks_total": 100, "queued_tokens": 0, "running": 0,
                      "waiting": 0, **stats}
        self.contexts, self.hints = {}, {}

    def load_stats(self):
        return dict(self.stats)

    async def fill(self, cid, tokens, parent_context_id=None, hint=None):
        if hint is not None:
            hint.validate()
        self.hints[cid] = hint
        self.contexts[cid] = self.contexts.get(parent_context_id, []) + list(tokens)
        return len(self.contexts[cid])

    async def free_context(self, cid):
        self.contexts.pop(cid)

    def free_context_nowait(self, cid):
        self.contexts.pop(cid, None)

    def close(self):
        pass


def fakes(*stats):
    engines = [Fake(**s) for s in stats]
    return ReplicaSet(engines), engines


def routed(rs, reason):
    """Per replica name: new contexts placed there for ``reason``."""
    return {s["name"]: s["routed"].get(reason, 0) for s in rs.replica_states()}


def toks(seed, n=8):
    """Tokens no other call's first 16 begin with (short: no token-level prefix key at all)."""
    return [(seed * 31 + 7 * i) % 250 + 1 for i in range(n)]


# ================================================================== the hint
def test_prefix_keys_are_validated_and_never_ranked():
    ok = RequestHint(objective="throughput", prefix_keys=[KA, KB])
    ok.validate()
    assert ok.prefix_keys == (KA, KB)  # a JSON list becomes the field's tuple
    assert ok.ranking() == dataclasses.replace(ok, prefix_keys=()).ranking()  # placement only
    assert "prefix_keys" not in ok.ranking()
    for bad in ("ab", [""], ["AB"], ["xyz"], ["a" * 129], [KA] * (MAX_PREFIX_KEYS + 1), [1], None):
        with pytest.raises(E.InvalidSampling, match="prefix_keys"):
            RequestHint(prefix_keys=bad).validate()


def test_prefix_keys_travel_where_hints_travel():
    """To a worker process (the hint is pickled) and into a vLLM request's
    ``extra_args`` (JSON-able: vLLM sends them msgpack'd), beside the ranking fields."""
    import json
    import pickle

    from interlace.engine_ext.request_engine import RequestEngine, _Context

    h = RequestHint(objective="throughput", task_group="g", tenant="t", prefix_keys=(KA, KB))
    assert pickle.loads(pickle.dumps(h)) == h
    ctx = _Context("c", [1, 2, 3])
    extra = json.loads(json.dumps(RequestEngine._extra(ctx, h)))
    assert extra["prefix_keys"] == [KA, KB] and extra["task_group"] == "g" and extra["tenant"] == "t"
    assert "prefix_keys" not in RequestEngine._extra(ctx, dataclasses.replace(h, prefix_keys=()))


def test_a_bad_hint_is_refused_before_anything_is_placed():
    rs, (a, b) = fakes({}, {})

    async def go():
        with pytest.raises(E.InvalidSampling, match="prefix_keys"):
            await rs.fill("c", toks(1), hint=RequestHint(prefix_keys=("NOT-HEX",)))
        with pytest.raises(E.InvalidSampling):
            await rs.fill("c", toks(1), hint={"prefix_keys": [KA]})
        assert rs.replica_of("c") is None and not a.hints and not b.hints and not rs._prefixes

    asyncio.run(go())


def test_hint_keys_are_the_boundary_hashes_at_least_min_tokens_long_shortest_first():
    pieces = [Piece([1, 2], True), Piece(list(range(3, 20)), True), Piece([7] * 30, False)]
    keys = boundary_keys("m", pieces)
    assert hint_keys(keys, 16) == (keys[1][0].hex(), keys[2][0].hex())  # the 2-token head is left out
    assert hint_keys(keys) == tuple(k.hex() for k, _, _ in keys)
    many = boundary_keys("m", [Piece([i], False) for i in range(MAX_PREFIX_KEYS + 10)])
    assert hint_keys(many) == tuple(k.hex() for k, _, _ in many[:MAX_PREFIX_KEYS])  # the shortest kept
    h = RequestHint(objective="latency", tenant="t")
    assert with_prefix_keys(h, ()) is h
    assert with_prefix_keys(h, (KA,)) == dataclasses.replace(h, prefix_keys=(KA,))
    assert with_prefix_keys(None, (KA,)) == RequestHint(prefix_keys=(KA,))


# ============================================================ task groups
def test_a_task_group_lands_on_one_replica_where_it_fits():
    # replica 1 has the most room under its cap; replica 0 is the least loaded
    rs, (a, b) = fakes({"capacity_tokens": 4096, "active_tokens": 3000},
                       {"capacity_tokens": 8192, "active_tokens": 1000, "queued_tokens": 900})
    g = RequestHint(objective="throughput", task_group="s1:tg1")

    async def go():
        await rs.fill("solo", toks(1))
        assert rs.replica_of("solo") == "0"  # load routing alone picks replica 0
        for i in range(4):
            await rs.fill(f"m{i}", toks(10 + i), hint=g)
        assert {rs.replica_of(f"m{i}") for i in range(4)} == {"1"}
        assert routed(rs, "group") == {"0": 0, "1": 4}
        # a member that no longer fits the group's replica is placed on its own; the group keeps it
        b.stats["active_tokens"] = 8100
        await rs.fill("big", toks(20, 200), hint=g)
        assert rs.replica_of("big") == "0" and routed(rs, "load")["0"] == 2
        b.stats["active_tokens"] = 1000
        await rs.fill("m9", toks(21), hint=g)
        assert rs.replica_of("m9") == "1"
        # another group, seen first when replica 0 has more room: it goes there, whole
        a.stats["active_tokens"], b.stats["active_tokens"] = 0, 7000
        for i in range(3):
            await rs.fill(f"h{i}", toks(30 + i), hint=RequestHint(task_group="s2:tg1"))
        assert {rs.replica_of(f"h{i}") for i in range(3)} == {"0"}

    asyncio.run(go())


def test_a_group_on_engines_without_capacity_figures_goes_to_the_least_loaded_and_stays():
    rs, (a, b) = fakes({"queued_tokens": 500}, {})
    g = RequestHint(task_group="tg")

    async def go():
        await rs.fill("g0", toks(1), hint=g)
        assert rs.replica_of("g0") == "1"
        b.stats["queued_tokens"] = 5000  # now load routing would pick replica 0
        await rs.fill("x", toks(2))
        assert rs.replica_of("x") == "0"
        await rs.fill("g1", toks(3), hint=g)  # no cap reported: it fits
        assert rs.replica_of("g1") == "1"

    asyncio.run(go())


def test_a_groups_replica_that_dies_is_forgotten():
    rs, (a, b) = fakes({}, {})
    g = RequestHint(task_group="tg")

    async def go():
        await rs.fill("g0", toks(1), hint=g)
        assert rs.replica_of("g0") == "0"
        rs._mark_dead(rs.replicas[0], None)
        await rs.fill("g1", toks(2), hint=g)
        assert rs.replica_of("g1") == "1" and routed(rs, "group")["1"] == 1
        assert set(rs._groups.values()) == {rs.replicas[1]}

    asyncio.run(go())


# ========================================================== shared prefixes
def test_a_call_goes_to_the_replica_holding_its_prefix_keys_not_the_least_loaded():
    rs, (a, b) = fakes({}, {})

    async def go():
        await rs.fill("doc", toks(1), hint=RequestHint(prefix_keys=(KA,)))
        assert rs.replica_of("doc") == "0"
        a.stats["queued_tokens"] = 2000  # replica 0 is busy now
        await rs.fill("plain", toks(2), hint=RequestHint(prefix_keys=(KZ,)))
        assert rs.replica_of("plain") == "1"  # load routing alone picks replica 1
        await rs.fill("q", toks(3), hint=RequestHint(prefix_keys=(KA, KC)))
        assert rs.replica_of("q") == "0"  # its prefix KA is on replica 0
        assert routed(rs, "prefix") == {"0": 1, "1": 0}
        # the longest key seen wins: KB was placed on replica 1
        await rs.fill("doc2", toks(4), hint=RequestHint(prefix_keys=(KB,)))
        assert rs.replica_of("doc2") == "1"
        await rs.fill("q2", toks(5), hint=RequestHint(prefix_keys=(KA, KB)))
        assert rs.replica_of("q2") == "1"
        # every key of a placed context is remembered: KC (q's) leads to replica 0 now
        await rs.fill("q3", toks(6), hint=RequestHint(prefix_keys=(KC,)))
        assert rs.replica_of("q3") == "0"

    asyncio.run(go())


def test_a_forks_prefix_keys_are_remembered_for_its_parents_replica():
    rs, (a, b) = fakes({}, {"queued_tokens": 10})

    async def go():
        await rs.fill("p", toks(1))
        await rs.fill("kid", toks(2), parent_context_id="p", hint=RequestHint(prefix_keys=(KB,)))
        assert rs.replica_of("kid") == "0" and routed(rs, "affinity")["0"] == 1
        a.stats["queued_tokens"] = 1000
        await rs.fill("later", toks(3), hint=RequestHint(prefix_keys=(KB,)))
        assert rs.replica_of("later") == "0"

    asyncio.run(go())


def test_prefix_keys_of_a_model_variant_are_its_own():
    class Variant(Fake):
        variant_names = frozenset({"v"})

        async def fill(self, cid, tokens, parent_context_id=None, hint=None, variant=None):
            return await super().fill(cid, tokens, parent_context_id, hint)

    a, b = Variant(), Variant(queued_tokens=10)
    rs = ReplicaSet([a, b])

    async def go():
        await rs.fill("base", toks(1), hint=RequestHint(prefix_keys=(KA,)))
        a.stats["queued_tokens"] = 1000
        await rs.fill("v1", toks(2), hint=RequestHint(prefix_keys=(KA,)), variant="v")
        assert (rs.replica_of("base"), rs.replica_of("v1")) == ("0", "1")  # KA of the base model: not v's

    asyncio.run(go())


def test_two_real_replicas_a_call_finds_its_document_where_token_levels_point_elsewhere(tiny_dirs):
    """Native engines: a document's prefix (56 tokens: only the 16-token level
    is a token key) is on replica 0; a task group's call sharing the first 16
    tokens went to replica 1 after it.  A question about the document goes to
    replica 0 by its prefix keys, and its prefix is found cached there; by the
    token levels alone it would go to replica 1."""
    from interlace.engine_ext.native.engine import NativeEngine

    system = [(7 * i) % 250 + 1 for i in range(16)]
    doc, other, question = toks(1, 40), toks(2, 40), toks(3, 20)
    k = boundary_keys("m", [Piece(system, True), Piece(doc, False), Piece(question, False)])
    keys = [key.hex() for key, _, _ in k]

    async def go(rs, use_keys):
        await rs.fill("doc", system + doc, hint=RequestHint(prefix_keys=tuple(keys[:2])))
        await rs.fill("other", system + other, hint=RequestHint(task_group="tg"))
        assert (rs.replica_of("doc"), rs.replica_of("other")) == ("0", "1")
        await rs.free_context("doc")  # its blocks stay cached on replica 0
        hits = (await rs.replicas[0].engine.check_invariants())["prefix_hit_blocks"]
        await rs.fill("q", system + doc + question, hint=RequestHint(prefix_keys=tuple(keys) if use_keys else ()))
        where = rs.replica_of("q")
        found = (await rs.replicas[0].engine.check_invariants())["prefix_hit_blocks"] - hits
        for cid in ("other", "q"):
            await rs.free_context(cid)
        return where, found

    for use_keys in (False, True):
        with ReplicaSet([NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=1024)
                         for _ in range(2)]) as rs:
            where, found = asyncio.run(go(rs, use_keys))
        if not use_keys:
            assert where == "1"  # the token levels alone: where the group's call went last
        else:  # the document's replica, where its 14 whole blocks are found cached
            assert where == "0" and found >= (16 + 40) // 4 - 1, found


# ============================================================ latency work
def test_latency_work_goes_to_a_replica_whose_cap_allows_it():
    # replica 0 runs latency work under its 2048-token cap; replica 2 is the least loaded
    rs, (a, b, c) = fakes({"capacity_tokens": 2048, "active_tokens": 1500, "latency_running": 1,
                           "queued_tokens": 1500, "running": 3},
                          {"capacity_tokens": 0, "active_tokens": 6000, "queued_tokens": 2000},
                          {"capacity_tokens": 0, "active_tokens": 300, "queued_tokens": 300})
    lat = RequestHint(objective="latency")

    async def go():
        await rs.fill("plain", toks(1, 300))
        assert rs.replica_of("plain") == "2"  # load routing alone
        await rs.fill("chat", toks(2, 300), hint=lat)
        assert rs.replica_of("chat") == "0"  # joins the latency work: its cap is in force already
        assert routed(rs, "latency") == {"0": 1, "1": 0, "2": 0}
        # too long for replica 0's cap: the replica with the fewest active tokens
        await rs.fill("long", toks(3, 600), hint=lat)
        assert rs.replica_of("long") == "2"
        c.stats["active_tokens"] = 7000
        await rs.fill("long2", toks(4, 600), hint=lat)
        assert rs.replica_of("long2") == "0"  # fewest active tokens now

    asyncio.run(go())


def test_the_rules_apply_in_findengines_order():
    rs, (a, b) = fakes({"capacity_tokens": 2048, "active_tokens": 100, "latency_running": 1},
                       {"queued_tokens": 50})

    async def go():
        await rs.fill("g", toks(1), hint=RequestHint(task_group="tg"))
        assert rs.replica_of("g") == "1"  # a new group: the most room (no cap)
        await rs.fill("p", toks(2), hint=RequestHint(prefix_keys=(KA,)))
        assert rs.replica_of("p") == "0"  # by load
        await rs.fill("gp", toks(3), hint=RequestHint(task_group="tg", prefix_keys=(KA,)))
        assert rs.replica_of("gp") == "1"  # the group before the prefix (KA is now on replica 1 too)
        await rs.fill("pl", toks(4), hint=RequestHint(objective="latency", prefix_keys=(KA,)))
        assert rs.replica_of("pl") == "1"  # the prefix before latency (which would pick replica 0)
        a.stats["queued_tokens"] = 500
        await rs.fill("l", toks(5), hint=RequestHint(objective="latency"))
        assert rs.replica_of("l") == "0"  # latency before load (which would pick replica 1)
        assert routed(rs, "group") == {"0": 0, "1": 2} and routed(rs, "prefix") == {"0": 0, "1": 1}
        assert routed(rs, "latency") == {"0": 1, "1": 0} and routed(rs, "load") == {"0": 1, "1": 0}
        assert all(set(s["routed"]) <= set(ROUTE_REASONS) for s in rs.replica_states())

    asyncio.run(go())


# ============================================================== the set's stats
def test_the_sets_load_stats_aggregate_the_capacity_figures():
    rs, (a, b, c) = fakes({"capacity_tokens": 2048, "active_tokens": 100, "latency_running": 1, "capacity_held": 2},
                          {"capacity_tokens": 4096, "active_tokens": 50, "capacity_held": 1},
                          {})
    st = rs.load_stats()
    assert (st["active_tokens"], st["latency_running"], st["capacity_held"]) == (150, 1, 3)
    assert st["capacity_tokens"] == 0  # replica 2 has no cap: neither has the set
    c.stats["capacity_tokens"] = 1000
    assert rs.load_stats()["capacity_tokens"] == 2048 + 4096 + 1000
    rs._mark_dead(rs.replicas[0], None)
    st = rs.load_stats()
    assert (st["capacity_tokens"], st["active_tokens"], st["latency_running"]) == (5096, 50, 0)


# ================================================================= the gateway
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def live():
    from helpers.gateway_server import LiveGateway

    cfg = {"server": {"replay": True},
           "models": {"smollm2": {"path": "embedded", "dtype": "float32", "kv_cache_tokens": 2048, "replicas": 2}},
           # preserve: a retained context keeps its KV, so its replica counts as the fuller one
           "engine": {"interception": "preserve"}, "plugins": {"entrypoints": False}}
    with LiveGateway(cfg) as gw:
        yield gw


def placements(rs):
    return {s["name"]: sum(s["routed"].values()) for s in rs.replica_states()}


def placed(rs, before):
    """The replica the one new context since ``before`` went to."""
    after = placements(rs)
    (name,) = [n for n in after if after[n] != before[n]]
    assert after[name] == before[name] + 1
    return name


def test_chat_requests_sharing_a_prompt_cache_key_land_on_one_replica(live):
    rs = live.gateway.models["smollm2"].engine
    assert isinstance(rs, ReplicaSet)

    def chat(system, key=None, **extra):
        body = {"model": "smollm2", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "What is the weather like in Paris?"}], **extra}
        if key is not None:
            body["prompt_cache_key"] = key
        before = placements(rs)
        r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return placed(rs, before), r.json()

    # the system prompts differ from their first tokens on: no token-level prefix is shared
    home, _ = chat("Alpha: you answer about cities.", key="conv-1")
    # a client-side call, kept for its follow-up on the key's replica: that replica is the fuller one
    where, r = chat("Bravo: you call tools.", key="conv-1", tools=[WEATHER],
                    interlace={"replay": CALL}, max_tokens=60)
    assert r["choices"][0]["finish_reason"] == "tool_calls" and where == home
    assert len(live.gateway.models["smollm2"].retention) == 1
    other, _ = chat("Charlie: you answer briefly.")
    assert other != home  # load routing picks the other replica
    where, _ = chat("Delta: you answer in French.", key="conv-1")
    assert where == home  # the key's replica, not the least loaded
    load = sum(routed(rs, "load").values())
    chat("Echo: you answer in German.", key="conv-2")
    assert sum(routed(rs, "load").values()) == load + 1  # a new key: by load
    live.gateway.models["smollm2"].retention.clear()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("key,ok", [("k" * 64, True), ("k" * 65, False), (7, False), ("", True)])
def test_prompt_cache_key_is_validated(live, path, key, ok):
    if path == "/v1/responses":
        body = {"model": "smollm2", "input": "Hi", "max_output_tokens": 2, "store": False,
                "prompt_cache_key": key}
    else:
        body = {"model": "smollm2", "max_tokens": 2, "prompt_cache_key": key,
                "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(live.url + path, json=body, timeout=120)
    if ok:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_cache_key" and err["type"] == "invalid_request_error", err
    assert err["code"] == "invalid_value" and err["message"]


def test_semantic_calls_carry_their_prefix_keys_and_a_task_group_lands_on_one_replica(live):
    """A map stage (a task group: its reduce is fetched for latency) whose
    prompts share no prefix lands on one replica; without the group they are
    spread by load.  Calls sharing a long instruction and a document fork one
    prefix context whose first fill carries the prefix's keys, which begin
    each call's own."""
    rs = live.gateway.models["smollm2"].engine
    seen = {}

    def spy(name, orig):
        async def fill(cid, tokens, **kw):
            seen[cid] = (name, kw.get("hint"), kw.get("parent_context_id"))
            return await orig(cid, tokens, **kw)
        return fill

    for r in rs.replicas:
        r.engine.fill = spy(r.name, r.engine.fill)
    http = httpx.Client(base_url=live.url, timeout=120)
    try:
        sess = http.post("/v1/sessions", json={}).json()
        url, h = f"/v1/sessions/{sess['id']}", {"Authorization": f"Bearer {sess['token']}"}

        def var(**body):
            return http.post(url + "/variables", json=body, headers=h).json()["id"]

        def llm(template, inputs, max_tokens=2):
            r = http.post(url + "/calls", headers=h, json={"model": "smollm2", "template": template, "inputs": inputs,
                                                          "outputs": {"out": {"sampling": {"max_tokens": max_tokens}}}})
            assert r.status_code == 201, r.text
            return r.json()

        src = var(name="src")
        maps = [llm("{{input:i}} is part of {{input:s}}: {{output:out}}", {"i": {"value": w}, "s": src})
                for w in ("Apples", "Rivers", "Mountains")]
        red = llm("Combine {{input:a}} {{input:b}} {{input:c}}: {{output:out}}",
                  dict(zip("abc", (m["outputs"]["out"] for m in maps))))
        assert http.get(url + f"/variables/{red['outputs']['out']}", headers=h,
                        params={"criterion": "latency", "timeout_s": 0.1}).status_code == 408
        http.put(url + f"/variables/{src}", json={"value": "a story"}, headers=h)
        assert http.get(url + f"/variables/{red['outputs']['out']}", headers=h).status_code == 200
        group = {seen[("sv", sess["id"], m["id"])] for m in maps}
        assert len({name for name, _, _ in group}) == 1, group  # one replica
        assert all(hint.task_group for _, hint, _ in group)

        system = "You are a careful assistant. Answer in one short sentence, in plain English. " * 4
        doc = var(name="doc")
        tmpl = system + "Document: {{input:d}}\nQuestion: {{input:q}}\nAnswer: {{output:out}}"
        calls = [llm(tmpl, {"d": doc, "q": {"value": q}}) for q in ("Who?", "Where is it?")]
        http.put(url + f"/variables/{doc}", json={"value": "The harbour was rebuilt in stone. " * 4}, headers=h)
        for c in calls:
            assert http.get(url + f"/variables/{c['outputs']['out']}", headers=h).status_code == 200
        prefix = [v for cid, v in seen.items() if cid[0] == "svp"]
        assert prefix and all(hint.prefix_keys for _, hint, _ in prefix)
        longest = max((hint.prefix_keys for _, hint, _ in prefix), key=len)
        for c in calls:
            name, hint, parent = seen[("sv", sess["id"], c["id"])]
            assert parent is not None and parent[0] == "svp"  # a fork: the parent's replica
            assert hint.prefix_keys[:len(longest)] == longest and len(hint.prefix_keys) > len(longest)
        http.delete(url, headers=h)
    finally:
        http.close()
        for r in rs.replicas:
            del r.engine.fill
