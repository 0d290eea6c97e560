"""Parrot's capacity regulation (section 5.4; engine_ext/policies/capacity.py):
the rule, the native engine holding throughput work beside a latency-critical
request (KV kept, no preemption), the configuration and /metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.native.setup import build_native_engine
from interlace.engine_ext.policies import FCFS, NO_CAPACITY, CapacityPolicy, ObjectiveRanking, PolicySpec, SchedInfo
from interlace.engine_ext.protocol import RequestHint, SamplingParams
from interlace.gateway.config import ConfigError, load_config, parse_config


class Item:
    def __init__(self, name, tokens, objective=None, group=None, starving=False):
        self.name = name
        self.sched = SchedInfo(context_len=tokens, objective=objective, task_group=group, starving=starving)


def names(items):
    return [i.name for i in items]


# ------------------------------------------------------------------ the rule
def test_limit_is_the_latency_cap_while_latency_work_runs_else_the_throughput_cap():
    p = CapacityPolicy(latency_tokens=2048, throughput_tokens=64000)
    assert p.limit([Item("g", 10, "throughput", "g"), Item("l", 10, "latency")]) == 2048
    assert p.limit([Item("g", 10, "throughput", "g"), Item("plain", 10)]) == 64000
    assert CapacityPolicy().limit([Item("plain", 10)]) is None  # Parrot's default: no throughput cap
    assert CapacityPolicy().limit([Item("l", 10, "latency")]) == 2048
    assert NO_CAPACITY.limit([Item("l", 10, "latency")]) is None and not NO_CAPACITY.enabled


def test_split_fits_others_beside_latency_work_in_rank_order():
    p = CapacityPolicy(latency_tokens=2048)
    # a throughput decode ranked before the latency prefill (the native scheduler's decodes-then-prefills order):
    # the latency request's 1,500 tokens count first, so the 1,000-token member does not fit beside it
    order = [Item("g1", 1000, "throughput", "g"), Item("lat", 1500, "latency"), Item("plain", 100)]
    run, held = p.split(order)
    assert (names(run), names(held)) == (["lat", "plain"], ["g1"])  # first fit: plain still fits after g1
    order = [Item("g1", 1000, "throughput", "g"), Item("lat", 500, "latency"), Item("g2", 1000, "throughput", "g"),
             Item("plain", 100)]
    run, held = p.split(order)
    assert (names(run), names(held)) == (["g1", "lat", "plain"], ["g2"])  # the run keeps the given order
    # without latency work no cap (Parrot's default throughput capacity: memory)
    run, held = p.split([i for i in order if i.name != "lat"])
    assert held == []
    # latency requests run whatever the cap, and their tokens count
    big = [Item("lat", 3000, "latency"), Item("g", 10, "throughput")]
    run, held = p.split(big)
    assert (names(run), names(held)) == (["lat"], ["g"])


def test_starving_requests_go_first_within_the_cap_but_do_not_lift_it():
    """A task group held together ages together: were starvation to lift the cap, the whole group would run
    at once beside the latency work (the mixed run's chat p99 25.7 s against 7.7-10.6 s)."""
    p = CapacityPolicy(latency_tokens=1000)
    group = [Item(f"m{i}", 300, "throughput", "g", starving=True) for i in range(6)]
    run, held = p.split([Item("chat", 100, "latency")] + group)
    assert names(run) == ["chat", "m0", "m1", "m2"] and names(held) == ["m3", "m4", "m5"]
    # a starving request takes the room before a better-ranked one that is not starving; the order is kept
    order = [Item("chat", 100, "latency"), Item("fresh", 800, "throughput"), Item("old", 800, starving=True)]
    run, held = p.split(order)
    assert (names(run), names(held)) == (["chat", "old"], ["fresh"])


def test_a_request_larger_than_the_cap_runs_alone_rather_than_never():
    p = CapacityPolicy(latency_tokens=100, throughput_tokens=200)
    run, held = p.split([Item("big", 500, "throughput"), Item("big2", 300)])
    assert (names(run), names(held)) == (["big"], ["big2"])
    run, held = p.split([Item("big", 500, "throughput"), Item("small", 150)])
    assert (names(run), names(held)) == (["small"], ["big"])  # first fit: it runs when "small" is done


@pytest.mark.parametrize("kw", [{"latency_tokens": 0}, {"latency_tokens": -5}, {"latency_tokens": True},
                                {"throughput_tokens": 1.5}, {"latency_tokens": 4096, "throughput_tokens": 2048}])
def test_bad_caps_are_refused(kw):
    with pytest.raises(ValueError, match="capacity"):
        CapacityPolicy(**kw)


# ------------------------------------------------------------------ the native engine
CAP = 48        # tokens: the latency request (20 + 8) fits; no group member (30 and more) fits beside it
GROUP = 3
LAT_PROMPT, LAT_OUT = 20, 8
GROUP_PROMPT, GROUP_OUT = 30, 48  # long enough to be running when the latency request comes


def prompt(n, start):
    return [(start + 13 * i) % 300 + 1 for i in range(n)]


def run_latency_beside_group(model_dir, capacity):
    """A throughput task group generating on the engine; once each member has
    a token, a latency-critical request arrives.  Returns the steps (the
    contexts each step ran, the engine's load stats after it was scheduled),
    the order the streams finished in, the engine's stats and invariants."""
    with NativeEngine.load(model_dir, block_size=4, kv_cache_tokens=1024, max_batched_tokens=64,
                           ranking=ObjectiveRanking(FCFS()), capacity=capacity, adapt_threads=False) as eng:
        steps = []
        schedule = eng.scheduler.schedule

        def traced():  # on the engine thread: what each step runs, and the load it reports then
            batch = schedule()
            if batch.chunks:
                steps.append(({ch.ctx.id for ch in batch.chunks}, eng.load_stats()))
            return batch
        eng.scheduler.schedule = traced

        async def go():
            finished = []
            started = [asyncio.Event() for _ in range(GROUP)]

            async def member(i):
                cid = f"g{i}"
                hint = RequestHint(objective="throughput", task_group="tg")
                await eng.fill(cid, prompt(GROUP_PROMPT, 7 * i + 1), hint=hint)
                n = 0
                async for ev in eng.generate(cid, SamplingParams(max_tokens=GROUP_OUT, ignore_eos=True), hint=hint):
                    n += ev.token_id is not None
                    started[i].set()
                finished.append((cid, n))

            async def latency():
                for s in started:
                    await s.wait()
                hint = RequestHint(objective="latency")
                await eng.fill("lat", prompt(LAT_PROMPT, 101), hint=hint)
                n = 0
                async for ev in eng.generate("lat", SamplingParams(max_tokens=LAT_OUT, ignore_eos=True), hint=hint):
                    n += ev.token_id is not None
                finished.append(("lat", n))

            await asyncio.gather(latency(), *(member(i) for i in range(GROUP)))
            return finished, await eng.check_invariants()

        finished, inv = asyncio.run(go())
        return steps, finished, dict(eng.stats), inv


def test_a_latency_request_runs_under_the_cap_while_the_task_group_waits(tiny_dirs):
    steps, finished, stats, inv = run_latency_beside_group(tiny_dirs["llama"][0], CapacityPolicy(latency_tokens=CAP))
    group = {f"g{i}" for i in range(GROUP)}
    lat_steps = [(ran, st) for ran, st in steps if "lat" in ran]
    assert lat_steps, steps
    # the latency request ran alone: no group member computed a token in any of its steps (its fill's included)
    assert all(not ran & group for ran, _ in lat_steps), [sorted(ran) for ran, _ in lat_steps]
    # ... while the group waited with work: held, the latency cap in force
    ran, st = lat_steps[0]
    assert (st["capacity_held"], st["capacity_tokens"], st["latency_running"]) == (GROUP, CAP, 1), st
    assert st["active_tokens"] >= LAT_PROMPT + GROUP * (GROUP_PROMPT + 1)
    # every stream got all its tokens; the latency request finished first, the group after it
    assert dict(finished) == {"lat": LAT_OUT, **{g: GROUP_OUT for g in group}}
    assert finished[0][0] == "lat", finished
    # held contexts kept their KV: nothing preempted, dropped or recomputed
    assert inv["preemptions"] == 0 and stats["running_preemptions"] == 0 and stats["recomputed_tokens"] == 0
    assert steps[-1][1]["capacity_held_steps"] == len(lat_steps)  # every step of it held the group
    # once the latency request is done, the throughput work fills the engine again
    assert steps[-1][1]["capacity_held"] == 0 and steps[-1][1]["capacity_tokens"] == 0


def test_without_regulation_the_group_runs_beside_the_latency_request(tiny_dirs):
    """The same run with NO_CAPACITY: the group computes in the latency
    request's steps (what the test above rules out)."""
    steps, finished, stats, _ = run_latency_beside_group(tiny_dirs["llama"][0], NO_CAPACITY)
    group = {f"g{i}" for i in range(GROUP)}
    assert any("lat" in ran and ran & group for ran, _ in steps)
    assert all(st["capacity_held"] == 0 and st["capacity_tokens"] == 0 for _, st in steps)
    assert dict(finished) == {"lat": LAT_OUT, **{g: GROUP_OUT for g in group}}


# ------------------------------------------------------------------ the native scheduler, step by step
def sched_setup(capacity, num_blocks=64):
    from interlace.engine_ext.native.block_manager import BlockManager
    from interlace.engine_ext.native.scheduler import Scheduler

    blocks = BlockManager(num_blocks=num_blocks, block_size=4, hash_key=b"k")
    sched = Scheduler(blocks, ObjectiveRanking(FCFS()), max_batched_tokens=64)
    sched.capacity = capacity
    return blocks, sched


def ctx(blocks, cid, n, computed, objective, arrival, group=None):
    """A context of ``n`` tokens, ``computed`` of them with KV (``n - 1``: decoding; 0: waiting)."""
    from interlace.engine_ext.native.sequence import Context, Generation

    c = Context(cid, list(range(1000 * arrival, 1000 * arrival + n)), num_computed=computed, arrival=float(arrival))
    c.sched.objective, c.sched.task_group = objective, group
    if computed:
        c.gen = Generation(SamplingParams(), lambda ev: None)
        c.table.blocks = [blocks.allocate() for _ in range(blocks.blocks_for(computed))]
    return c


@pytest.mark.parametrize("capacity", [CapacityPolicy(latency_tokens=40), NO_CAPACITY])
def test_held_contexts_keep_their_kv_and_do_not_stop_admission(capacity):
    """Beside a decoding latency request (20 tokens) under a 40-token cap: an
    admitted group member (30) is held with its KV, a waiting request (30)
    is held without being admitted, and a smaller one ranked after it (8)
    is still admitted: a held context is not head of line, nor a
    preemption.  Without regulation all four run (the contrast)."""
    blocks, sched = sched_setup(capacity)
    lat = ctx(blocks, "lat", 20, 19, "latency", 1)
    member = ctx(blocks, "member", 30, 29, "throughput", 2, group="tg")
    big = ctx(blocks, "big", 30, 0, "throughput", 3)
    small = ctx(blocks, "small", 8, 0, "throughput", 4)
    for c in (lat, member, big, small):
        sched.add(c)
    member_blocks = list(member.table.blocks)
    batch = sched.schedule()
    ran = {ch.ctx.id for ch in batch.chunks}
    assert not batch.failed and sched.num_preemptions == 0
    assert sched.stats == {"running_preemptions": 0, "paused_dropped": 0, "idle_dropped": 0}
    if capacity is NO_CAPACITY:
        assert ran == {"lat", "member", "big", "small"} and sched.capacity_held == 0
        return
    assert ran == {"lat", "small"}
    assert (sched.capacity_held, sched.capacity_held_steps, sched.capacity_limit) == (2, 1, 40)
    assert member.num_computed == 29 and member.table.blocks == member_blocks  # KV kept where it is
    assert big.num_computed == 0 and big.table.blocks == []  # not admitted: holds nothing


def test_held_contexts_run_when_nothing_the_cap_allows_can(monkeypatch):
    """The group's KV fills the cache and the cap holds it beside a waiting
    latency request, which cannot be admitted (admission never preempts a
    running context): the step runs the held group rather than nothing --
    failing the latency request as KVCacheExhausted would be wrong, the
    group's blocks free up as it finishes."""
    blocks, sched = sched_setup(CapacityPolicy(latency_tokens=10), num_blocks=8)
    g1 = ctx(blocks, "g1", 16, 15, "throughput", 1, group="tg")
    g2 = ctx(blocks, "g2", 16, 15, "throughput", 2, group="tg")
    lat = ctx(blocks, "lat", 8, 0, "latency", 3)
    for c in (g1, g2, lat):
        sched.add(c)
    assert blocks.num_free == 0
    batch = sched.schedule()
    assert not batch.failed, batch.failed
    assert {ch.ctx.id for ch in batch.chunks} == {"g1", "g2"} and sched.capacity_held == 0
    assert sched.num_preemptions == 0 and lat.num_computed == 0


def test_the_policy_reaches_engines_built_from_a_spec_in_process_and_in_a_worker(tiny_dirs):
    from interlace.engine_ext.worker import ProcessEngine

    spec = PolicySpec(profile="h100-llama-3-8b", latency_capacity_tokens=96, throughput_capacity_tokens=4096)
    args = {"kv_cache_tokens": 256, "block_size": 16}
    with build_native_engine(tiny_dirs["llama"][0], args, spec) as eng:
        assert eng.scheduler.capacity == CapacityPolicy(96, 4096)
        st = eng.load_stats()
        assert (st["capacity_tokens"], st["capacity_latency_tokens"], st["capacity_throughput_tokens"]) == (
            4096, 96, 4096)  # no latency work: the throughput cap in force
    with build_native_engine(tiny_dirs["llama"][0], args) as eng:  # no policy: the library default, no cap
        assert eng.scheduler.capacity == NO_CAPACITY and eng.load_stats()["capacity_latency_tokens"] == 0
    worker = ProcessEngine.start({"path": str(tiny_dirs["llama"][0]), "threads": 1, **args}, spec, name="cap")
    try:
        assert worker.info["capacity"] == [96, 4096]
        assert worker.load_stats()["capacity_latency_tokens"] == 96
    finally:
        worker.close()


# ------------------------------------------------------------------ configuration
def test_config_defaults_overrides_and_off():
    p = load_config("configs/default.yaml").models["smollm2"].policy
    assert (p.latency_capacity_tokens, p.throughput_capacity_tokens) == (2048, None)  # Parrot's example
    assert parse_config({"models": {"m": {"path": "x"}}}).models["m"].policy.capacity() == CapacityPolicy(2048)
    cfg = parse_config({"engine": {"capacity": {"latency_tokens": 1000, "throughput_tokens": 8000}},
                        "models": {"a": {"path": "x"}, "b": {"path": "x", "capacity": {"latency_tokens": 500}},
                                   "off": {"path": "x", "capacity": {"latency_tokens": None}}}})
    assert cfg.models["a"].policy.capacity() == CapacityPolicy(1000, 8000)
    assert cfg.models["b"].policy.capacity() == CapacityPolicy(500, 8000)  # key by key
    off = cfg.models["off"].policy.capacity()
    assert off.latency_tokens is None and off.throughput_tokens == 8000
    assert off.limit([Item("l", 1, "latency")]) == 8000  # no latency cap: the throughput one
    assert "capacity" not in cfg.models["b"].engine_args


@pytest.mark.parametrize("data,where", [
    ({"engine": {"capacity": {"latency_tokens": 0}}}, "engine.capacity.latency_tokens: 0 is less than the minimum"),
    ({"m": {"capacity": {"throughput_tokens": "lots"}}}, "models.m.capacity.throughput_tokens: 'lots' is not of type"),
    ({"m": {"capacity": {"latency": 5}}}, "models.m.capacity: Additional properties are not allowed ('latency'"),
    ({"engine": {"capacity": {"throughput_tokens": 1000}}, "m": {"capacity": {"latency_tokens": 4000}}},
     "models.m.capacity.latency_tokens: 4000 exceeds engine.capacity.throughput_tokens (1000)"),
])
def test_bad_capacity_config_names_the_key(data, where):
    m = {"path": "x", **data.get("m", {})}
    with pytest.raises(ConfigError) as e:
        parse_config({"engine": data.get("engine", {}), "models": {"m": m}}, "gw.yaml")
    assert f"gw.yaml: {where}" in str(e.value), str(e.value)


# ------------------------------------------------------------------ /metrics
def metric(text, line_start):
    (value,) = [ln.rsplit(" ", 1)[1] for ln in text.splitlines() if ln.startswith(line_start)]
    return float(value)


def test_metrics_show_the_cap(tiny_dirs):
    from helpers.gateway_server import LiveGateway

    cfg = {"engine": {"capacity": {"throughput_tokens": 4096}},
           "models": {"m": {"path": str(tiny_dirs["llama"][0]), "dtype": "float32", "kv_cache_tokens": 256,
                            "profile": "h100-llama-3-8b", "capacity": {"latency_tokens": 96}}},
           "plugins": {"entrypoints": False}}
    with LiveGateway(cfg) as live:
        text = httpx.get(live.url + "/metrics").text
    assert metric(text, 'interlace_capacity_configured_tokens{model="m",objective="latency"}') == 96
    assert metric(text, 'interlace_capacity_configured_tokens{model="m",objective="throughput"}') == 4096
    assert metric(text, 'interlace_capacity_tokens{model="m"}') == 4096  # no latency work: the throughput cap
    assert metric(text, 'interlace_replica_capacity_tokens{model="m",replica="0"}') == 4096
    assert metric(text, 'interlace_capacity_held_requests{model="m"}') == 0
    assert metric(text, 'interlace_capacity_active_tokens{model="m"}') == 0


def test_metrics_sum_replicas_and_skip_engines_without_a_cap():
    from interlace.gateway.metrics import Metrics

    class Fake:
        def __init__(self, **stats):
            self.stats = stats

        def load_stats(self):
            return dict(self.stats)

    class Set:  # a replica set: its replicas' own stats
        def __init__(self, *engines):
            self.engines = engines

        def load_stats(self):
            return {}

        def replica_states(self):
            return [{"name": str(i), "alive": True, "contexts": 0, "stats": e.load_stats(), "routed": {}}
                    for i, e in enumerate(self.engines)]

    busy = dict(capacity_tokens=2048, active_tokens=900, latency_running=1, capacity_held=3,
                capacity_latency_tokens=2048, capacity_throughput_tokens=0)
    m = Metrics()
    m.watch_engine("two", Set(Fake(**busy), Fake(**{**busy, "capacity_tokens": 4096, "capacity_held": 0})))
    m.watch_engine("uncapped", Set(Fake(**busy), Fake(**{**busy, "capacity_tokens": 0})))
    m.watch_engine("remote", Fake(kv_blocks_used=1))  # no capacity keys: no capacity series
    text = m.render().decode()
    assert metric(text, 'interlace_capacity_tokens{model="two"}') == 2048 + 4096
    assert metric(text, 'interlace_capacity_held_requests{model="two"}') == 3
    assert metric(text, 'interlace_capacity_active_tokens{model="two"}') == 1800
    assert metric(text, 'interlace_capacity_latency_requests{model="two"}') == 2
    assert metric(text, 'interlace_replica_capacity_held{model="two",replica="0"}') == 3
    assert metric(text, 'interlace_capacity_tokens{model="uncapped"}') == 0  # one replica has no cap
    assert 'model="remote"' not in "".join(ln for ln in text.splitlines() if ln.startswith("interlace_capacity"))
