"""Several engine replicas behind one engine (engine_ext/replicas.py): routing
(forks to their parent, shared prefixes together, the rest by load), a replica
that dies (its streams end with EngineUnavailable at once, its contexts are
lost, new ones go to the others), and the gateway serving ``replicas: 2``."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from interlace.engine_ext import errors as E
from interlace.engine_ext.native.cores import usable_cores
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.protocol import PauseHint, RequestHint, SamplingParams
from interlace.engine_ext.replicas import HEALTH_INTERVAL_S, ReplicaSet

LONG = SamplingParams(max_tokens=480, ignore_eos=True)


def prompt(seed: int, n: int = 40) -> list:
    return [(seed * 37 + 11 * i) % 300 + 1 for i in range(n)]


def load(tiny_dirs, cls=NativeEngine):
    return cls.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=1024)


@pytest.fixture
def pair(tiny_dirs):
    engines = [load(tiny_dirs), load(tiny_dirs)]
    rs = ReplicaSet(engines)
    yield rs, engines
    rs.close()


async def used_blocks(engine) -> int:
    return (await engine.check_invariants())["used_blocks"]


async def no_leaks(rs: ReplicaSet) -> None:
    """Every live replica's books hold and no KV block is left in use."""
    for r in rs.replicas:
        if r.alive:
            assert await used_blocks(r.engine) == 0, f"replica {r.name} leaks KV blocks"
    st = await rs.check_invariants()
    assert st["contexts"] == 0 and st["used_blocks"] == 0
    assert rs.load_stats()["kv_blocks_used"] == 0


# ================================================================== routing
def test_forks_land_on_their_parents_replica(pair):
    rs, (a, b) = pair

    async def go():
        await rs.fill("x", prompt(1, 60))   # replica 0 (the first of two idle ones)
        await rs.fill("p", prompt(2, 20))   # replica 1: more free KV blocks
        assert (rs.replica_of("x"), rs.replica_of("p")) == ("0", "1")
        await rs.fill("p2", prompt(3, 80))  # replica 1 again; now it is the busier one
        assert rs.replica_of("p2") == "1"
        await rs.fill("kid", [5, 6, 7], parent_context_id="p")
        assert rs.replica_of("kid") == "1"
        assert await b.context_length("kid") == 23   # it is really there, sharing the parent's KV
        # a fork by generate follows its parent as well
        evs = [ev async for ev in rs.generate("gkid", SamplingParams(max_tokens=3, ignore_eos=True),
                                               parent_context_id="p")]
        assert evs[-1].finish_reason == "length" and rs.replica_of("gkid") == "1"
        assert await rs.context_length("gkid") == 23
        states = {s["name"]: s for s in rs.replica_states()}
        assert states["1"]["routed"]["affinity"] == 2
        with pytest.raises(E.ContextHasChildren):
            await rs.free_context("p")
        rs.free_context_nowait("p")  # refused by the engine: the set keeps routing it
        assert rs.replica_of("p") == "1"
        for cid in ("kid", "gkid", "p", "x", "p2"):
            await rs.free_context(cid)
        await no_leaks(rs)

    asyncio.run(go())


def test_shared_prefix_lands_together_and_unrelated_spread_by_load(pair):
    rs, (a, b) = pair
    conv = prompt(7, 64)

    async def go():
        await rs.fill("turn1", conv)                 # replica 0
        await rs.fill("other", prompt(8, 16))        # replica 1: most free blocks
        assert (rs.replica_of("turn1"), rs.replica_of("other")) == ("0", "1")
        await rs.free_context("turn1")               # the conversation's KV stays cached on replica 0
        await rs.fill("big", prompt(9, 120))         # by load: replica 0 (its cached blocks count as free)
        assert rs.replica_of("big") == "0"           # now replica 0 is the busier one
        hits = (await a.check_invariants())["prefix_hit_blocks"]
        await rs.fill("turn2", conv + [3, 4, 5, 6, 7])
        assert rs.replica_of("turn2") == "0"
        assert (await a.check_invariants())["prefix_hit_blocks"] > hits  # its prefix was cached there
        assert await rs.computed_tokens("turn2") == len(conv) + 5
        states = {s["name"]: s for s in rs.replica_states()}
        assert states["0"]["routed"]["prefix"] == 1
        for cid in ("turn2", "other", "big"):
            await rs.free_context(cid)
        # a burst of unrelated requests, sent together, is spread over both replicas
        await asyncio.gather(*(rs.fill(f"u{i}", prompt(20 + i, 24)) for i in range(6)))
        placed = [rs.replica_of(f"u{i}") for i in range(6)]
        assert placed.count("0") == placed.count("1") == 3, placed
        for i in range(6):
            rs.free_context_nowait(f"u{i}")
        assert all(rs.replica_of(f"u{i}") is None for i in range(6))
        await asyncio.sleep(0.2)
        await no_leaks(rs)

    asyncio.run(go())


def test_unknown_contexts_raise_without_touching_a_replica(pair):
    rs, engines = pair
    for e in engines:  # a call that reached a replica would raise EngineClosed / EngineUnavailable
        e.close()

    async def go():
        for call in (rs.free_context("nope"), rs.truncate("nope", 1), rs.computed_tokens("nope"),
                     rs.context_tokens("nope"), rs.pause("nope"), rs.resume("nope", [1]), rs.park("nope"),
                     rs.fill("kid", [1], parent_context_id="nope")):
            with pytest.raises(E.ContextNotFound):
                await call
        rs.free_context_nowait("nope")  # cleanup never raises
        rs.set_pause_hint("nope", PauseHint(tool="t"))  # hints for a gone context are ignored
        rs.set_request_hint("nope", RequestHint(objective="latency"))
        assert all(r.alive for r in rs.replicas)

    asyncio.run(go())


# ============================================================== replica death
def test_replica_closed_mid_generate(pair, caplog):
    rs, (a, b) = pair

    async def go():
        await rs.fill("x", prompt(1, 60))
        await rs.fill("g", prompt(2, 20))
        assert rs.replica_of("g") == "1"
        await rs.fill("held", prompt(3, 8), parent_context_id="g")
        got = []

        async def consume():
            async for ev in rs.generate("g", LONG):
                got.append(ev)
                if len(got) == 3:
                    asyncio.get_running_loop().run_in_executor(None, b.close)  # from another thread
            return got

        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="interlace.engine_ext.replicas"):
            with pytest.raises(E.EngineUnavailable):
                await asyncio.wait_for(consume(), timeout=30)
        assert 3 <= len(got) < 480 and all(ev.finish_reason is None for ev in got)
        assert time.monotonic() - t0 < 30
        gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
        assert len(gone) == 1 and "replica 1" in gone[0], gone
        # every call for its contexts says so, and nothing waits on the dead replica
        for call in (rs.computed_tokens("g"), rs.context_tokens("held"), rs.fill("g", [1]),
                     rs.fill("kid", [1], parent_context_id="held"), rs.truncate("held", 2)):
            with pytest.raises(E.EngineUnavailable):
                await asyncio.wait_for(call, 10)
        with pytest.raises(E.EngineUnavailable):
            await asyncio.wait_for(anext(rs.generate("g", LONG)), 10)
        with pytest.raises(E.EngineUnavailable):
            await rs.free_context("g")
        rs.free_context_nowait("held")
        # new contexts go to the live replica, even one sharing the dead one's prefix
        await rs.fill("n", prompt(2, 20) + [9])
        assert rs.replica_of("n") == "0"
        states = {s["name"]: s for s in rs.replica_states()}
        assert states["1"]["alive"] is False and states["1"]["contexts"] == 0 and states["1"]["stats"] is None
        assert states["0"]["alive"] is True and states["0"]["contexts"] == 2
        assert rs.load_stats()["kv_blocks_total"] == a.load_stats()["kv_blocks_total"]  # the dead one's KV is gone
        await rs.free_context("n")
        await rs.free_context("x")
        await no_leaks(rs)

    asyncio.run(go())


def test_a_new_context_placed_on_a_replica_that_just_died_goes_to_another(pair):
    rs, (a, b) = pair
    a.close()  # not known yet: the set learns it from this fill

    async def go():
        await rs.fill("c", prompt(4))
        assert rs.replica_of("c") == "1" and [r.alive for r in rs.replicas] == [False, True]
        await rs.free_context("c")
        await no_leaks(rs)

    asyncio.run(go())


def test_no_replica_left(pair):
    rs, (a, b) = pair

    async def go():
        await rs.fill("c", prompt(5))
        a.close()
        b.close()
        with pytest.raises(E.EngineUnavailable):
            await rs.fill("new", prompt(6))
        with pytest.raises(E.EngineUnavailable):
            await rs.fill("new2", prompt(7))
        with pytest.raises(E.EngineUnavailable):
            await rs.computed_tokens("c")
        assert not rs.alive and [s["alive"] for s in rs.replica_states()] == [False, False]
        assert rs.load_stats()["kv_blocks_total"] == 0
        rs.close()
        with pytest.raises(E.EngineClosed):
            await rs.fill("after", prompt(8))

    asyncio.run(go())


class Failing(NativeEngine):
    """A native engine with an ``alive`` property, as engines in worker processes or
    behind a network have: set False, it is gone though nothing raised."""

    alive = True


def test_a_replica_that_stops_being_alive_wakes_its_streams(tiny_dirs):
    engines = [load(tiny_dirs, Failing), load(tiny_dirs, Failing)]
    rs = ReplicaSet(engines, names=["a", "b"])
    try:
        async def go():
            await rs.fill("s", prompt(1))
            assert rs.replica_of("s") == "a"
            n = 0
            with pytest.raises(E.EngineUnavailable):
                async def consume():
                    nonlocal n
                    async for ev in rs.generate("s", LONG):
                        n += 1
                        if n == 2:
                            engines[0].alive = False  # its engine goes on decoding: only its health says
                        await asyncio.sleep(0.05)     # slower than the engine: the stream is not waiting
                await asyncio.wait_for(consume(), timeout=HEALTH_INTERVAL_S * 20)
            assert n < 100
            await rs.fill("t", prompt(2))
            assert rs.replica_of("t") == "b"
            await rs.free_context("t")

        asyncio.run(go())
    finally:
        rs.close()


def test_a_dead_replica_wakes_a_stream_waiting_on_it(tiny_dirs):
    """The stream waits inside the replica (a paused context decodes nothing) when the
    replica's health turns bad: it is woken with EngineUnavailable, not left waiting."""
    engines = [load(tiny_dirs, Failing), load(tiny_dirs, Failing)]
    rs = ReplicaSet(engines)
    try:
        async def go():
            await rs.fill("s", prompt(1))
            events = []

            async def consume():
                async for ev in rs.generate("s", LONG):
                    events.append(ev)
                    if len(events) == 2:
                        await rs.pause("s")

            task = asyncio.create_task(consume())
            while not any(ev.paused for ev in events):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert not task.done()  # paused: waiting in the replica's stream
            engines[0].alive = False
            with pytest.raises(E.EngineUnavailable):
                await asyncio.wait_for(task, timeout=HEALTH_INTERVAL_S * 10)

        asyncio.run(go())
    finally:
        rs.close()


# ================================================================== gateway
def test_a_replica_that_fails_to_start_closes_those_started(monkeypatch, tiny_dirs):
    from interlace.gateway import models
    from interlace.gateway.config import parse_config

    started = []
    real = models.load_native

    def load_native(*args, **kw):
        started.append(real(*args, **kw))
        return started[-1]

    monkeypatch.setattr(models, "load_native", load_native)
    spec = parse_config({"models": {"m": {
        "path": str(tiny_dirs["llama"][0]), "dtype": "float32", "kv_cache_tokens": 256, "profile": "h100-llama-3-8b",
        "replicas": [{"kind": "native"}, {"kind": "native", "device": "no-such-device"}]}}}).models["m"]
    with pytest.raises(RuntimeError, match="no-such-device"):
        models.load_engine(spec)
    assert len(started) == 1
    with pytest.raises(E.EngineClosed):
        asyncio.run(started[0].fill("c", prompt(1)))


def metric(text: str, line_start: str) -> float:
    (value,) = [ln.rsplit(" ", 1)[1] for ln in text.splitlines() if ln.startswith(line_start)]
    return float(value)


def test_gateway_serves_two_replicas_and_answers_503_when_none_is_left():
    from helpers.gateway_server import LiveGateway

    cfg = {"models": {"smollm2": {"path": "embedded", "dtype": "float32", "kv_cache_tokens": 2048, "replicas": 2}},
           "plugins": {"entrypoints": False}}
    chat = {"model": "smollm2", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with LiveGateway(cfg) as live:
        rs = live.gateway.models["smollm2"].engine
        assert isinstance(rs, ReplicaSet) and len(rs.replicas) == 2

        def post(body):
            return httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)

        r = post(chat)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        r = post({**chat, "messages": [{"role": "user", "content": "Name a color."}]})
        assert r.status_code == 200, r.text
        text = httpx.get(live.url + "/metrics").text
        for name in ("0", "1"):
            assert metric(text, f'interlace_replica_up{{model="smollm2",replica="{name}"}}') == 1.0
            assert metric(text, f'interlace_replica_kv_blocks_total{{model="smollm2",replica="{name}"}}') == 128
        assert metric(text, 'interlace_kv_blocks_total{model="smollm2"}') == 256
        # each replica's steps run on 1 .. the usable cores (the gateway's ceiling), adapted to the free cores
        assert 2 <= metric(text, 'interlace_engine_threads{model="smollm2"}') <= 2 * usable_cores()
        routed = sum(metric(text, f'interlace_replica_routed_total{{model="smollm2",reason="{why}",replica="{n}"}}')
                     for n in ("0", "1") for why in ("affinity", "prefix", "load"))
        assert routed == 2
        assert 'interlace_replica_contexts{model="smollm2",replica="0"}' in text
        assert 'interlace_replica_queued_tokens{model="smollm2",replica="1"}' in text

        rs.replicas[0].engine.close()  # one replica gone: the other answers
        for _ in range(2):
            r = post(chat)
            assert r.status_code == 200, r.text
        text = httpx.get(live.url + "/metrics").text
        assert metric(text, 'interlace_replica_up{model="smollm2",replica="0"}') == 0.0
        assert metric(text, 'interlace_replica_up{model="smollm2",replica="1"}') == 1.0
        assert metric(text, 'interlace_kv_blocks_total{model="smollm2"}') == 128

        rs.replicas[1].engine.close()  # none left: 503, to retry
        for body in (chat, {**chat, "stream": True}):
            r = post(body)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["code"] == "engine_unavailable" and err["type"] == "server_error" and err["message"]
        text = httpx.get(live.url + "/metrics").text
        assert metric(text, 'interlace_replica_up{model="smollm2",replica="1"}') == 0.0
        assert metric(text, 'interlace_requests_total{endpoint="/v1/chat/completions",model="",status="503"}') == 2
