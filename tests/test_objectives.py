"""Parrot's objective deduction (section 5.2) and the ranking that carries it
into the engine (section 5.4), composed with the configured ranking."""

from __future__ import annotations

import asyncio

import pytest

from interlace.engine_ext.errors import InvalidSampling
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.policies import FCFS, LAMPS, ObjectiveRanking, SchedInfo, unit_profile
from interlace.engine_ext.protocol import RequestHint
from interlace.engine_ext.policies.deduction import CallNode, deduce


def figure9():
    """Two latency-critical outputs (R1, R2) of one shared step (R3), fed by
    two parallel stages: R4, R5 (each reading both of R6, R7), and R6, R7.
    R9 feeds only a variable nobody fetched."""
    return [
        CallNode("R1", ["c"], ["out1"]), CallNode("R2", ["c"], ["out2"]),
        CallNode("R3", ["d4", "d5"], ["c"]),
        CallNode("R4", ["f6", "f7"], ["d4"]), CallNode("R5", ["f6", "f7"], ["d5"]),
        CallNode("R6", ["doc"], ["f6"]), CallNode("R7", ["doc"], ["f7"]),
        CallNode("R9", ["doc"], ["side"]),
    ]


def test_figure9_latency_critical_calls_and_task_groups():
    p = deduce(figure9(), {"out1": "latency", "out2": "latency"})
    assert [p[r].objective for r in ("R1", "R2", "R3")] == ["latency"] * 3  # the outputs' producers and R3
    assert p["R1"].task_group is None and p["R3"].task_group is None
    assert p["R4"].task_group == p["R5"].task_group == "tg2"  # a parallel stage: one task group
    assert p["R6"].task_group == p["R7"].task_group == "tg3"  # the stage before it: another
    assert {p[r].objective for r in ("R4", "R5", "R6", "R7")} == {"throughput"}
    assert p["R9"].objective is None and p["R9"].task_group is None  # nothing fetched depends on it


def test_stage_is_the_longest_path_and_latency_wins_over_throughput():
    # X feeds both the final call and the step before it: it must finish before both, so stage 2
    calls = [CallNode("F", ["a", "x"], ["out"]), CallNode("A", ["x"], ["a"]), CallNode("X", [], ["x"]),
             CallNode("B", [], ["bulk"])]
    p = deduce(calls, {"out": "latency", "x": "throughput", "bulk": "throughput"})
    assert p["X"].stage == 2 and p["A"].stage == 1
    assert p["X"].objective == "latency"  # also upstream of a throughput variable: latency wins
    assert p["B"].objective == "throughput" and p["B"].task_group is None
    # a throughput-only application: everything upstream is throughput, no groups
    p = deduce(figure9(), {"out1": "throughput"})
    assert all(p[r].objective == "throughput" for r in ("R1", "R3", "R4", "R6"))
    assert p["R2"].objective is None


class Item:
    def __init__(self, name, arrival, objective=None, group=None, starving=False, remaining=None):
        self.name, self.arrival = name, arrival
        self.sched = SchedInfo(objective=objective, task_group=group, starving=starving,
                               expected_output=remaining)


def names(items):
    return [i.name for i in items]


def test_objective_ranking_classes_around_fcfs():
    items = [Item("g1a", 0, "throughput", "g1"), Item("plain", 1), Item("g2a", 2, "throughput", "g2"),
             Item("bulk", 3, "throughput"), Item("g1b", 4, "throughput", "g1"), Item("lat", 5, "latency"),
             Item("starved", 6, "throughput", starving=True)]
    order = ObjectiveRanking(FCFS()).order(items)
    assert names(order) == ["starved", "lat", "plain", "g1a", "g1b", "g2a", "bulk"]
    # without objectives it is the wrapped ranking's order, unchanged
    plain = [Item(str(i), 10 - i) for i in range(5)]
    assert names(ObjectiveRanking(FCFS()).order(plain)) == names(FCFS().order(plain))


def test_objective_ranking_keeps_lamps_order_within_a_class():
    lamps = LAMPS(unit_profile())
    items = [Item("lat-long", 0, "latency", remaining=500), Item("lat-short", 1, "latency", remaining=5),
             Item("g-long", 2, "throughput", "g", remaining=400), Item("g-short", 3, "throughput", "g", remaining=3),
             Item("none-short", 4, remaining=1)]
    order = ObjectiveRanking(lamps).order(items)
    assert names(order) == ["lat-short", "lat-long", "none-short", "g-short", "g-long"]
    assert ObjectiveRanking(lamps).starvation_threshold == lamps.starvation_threshold  # reads through


def test_hints_are_validated():
    with pytest.raises(InvalidSampling):
        RequestHint(objective="fast").validate()
    with pytest.raises(InvalidSampling):
        RequestHint(task_group=3).validate()


def test_the_engine_prefills_latency_critical_work_first(tiny_dirs):
    """Under a small step budget, a latency-critical fill submitted last is
    computed before the task group's fills submitted before it (FCFS alone
    would serve it last)."""
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=2048, max_batched_tokens=8,
                           ranking=ObjectiveRanking(FCFS())) as eng:
        done = []

        async def fill(cid, hint):
            await eng.fill(cid, [(5 * i + len(cid)) % 200 + 1 for i in range(40)], hint=hint)
            done.append(cid)

        async def go():
            group = [asyncio.create_task(fill(f"map{i}", RequestHint(objective="throughput", task_group="g")))
                     for i in range(3)]
            await asyncio.sleep(0)
            lat = asyncio.create_task(fill("reduce", RequestHint(objective="latency")))
            await asyncio.gather(*group, lat)
            # a running context's objective can change (a criterion deduced later)
            eng.set_request_hint("map0", RequestHint(objective="latency"))
            await eng.check_invariants()  # after the posted update
            return eng.contexts["map0"].sched.objective

        assert asyncio.run(go()) == "latency"
    assert done[0] == "reduce", done
