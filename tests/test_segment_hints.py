"""Per-segment hints reach the ranking on every engine (issue 32): a
``resume`` carries the predictions for the segment it starts, they replace
the first segment's in the context's ``SchedInfo`` (the tenant stays) and
LAMPS orders by them; the process worker and a replica set pass the hint
through; a bad ``future`` is refused with ``InvalidSampling`` naming it."""

import asyncio

import pytest

from helpers import run
from interlace.engine_ext import errors as E
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.policies import PolicySpec, Profile, make_interception, make_ranking
from interlace.engine_ext.protocol import MAX_FUTURE_SEGMENTS, PauseHint, RequestHint, SamplingParams
from interlace.engine_ext.replicas import ReplicaSet
from interlace.engine_ext.worker import ProcessEngine

BS = 4
PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [20, 21, 22, 23, 24, 25, 26]}
TOOL = [40, 41, 42]
SP = SamplingParams(max_tokens=30, ignore_eos=True)


def profile() -> Profile:
    return Profile(model="tiny", device="test", source="derived (test)", block_size=BS, kv_bytes_per_token=1,
                   kv_capacity_tokens=512, max_batched_tokens=64, fwd_tokens=(1, 1000), fwd_seconds=(1.0, 1.0),
                   fwd_s_per_context_token=0.0, swap_s_per_block=1.0, saturation_tokens=8)


def lamps_engine(tiny_dirs):
    prof = profile()
    policy = make_interception("preserve", prof)
    return NativeEngine.load(tiny_dirs["llama"][0], block_size=BS, max_model_len=64, kv_cache_tokens=512,
                             interception=policy, ranking=make_ranking("lamps", prof, policy, horizon="job"))


def spy_orders(eng):
    """Record the ids of every order the engine's own LAMPS returns (it still decides)."""
    ranking, seen = eng.scheduler.ranking, []
    real = ranking.order

    def order(items, *args, **kw):
        out = real(items, *args, **kw)
        seen.append([it.id for it in out])
        return out
    ranking.order = order
    return seen


def last_order_of_both(seen):
    both = [o for o in seen if "a" in o and "b" in o]
    assert both, seen
    return both[-1].index("a") < both[-1].index("b")


async def paused_pair(eng, first_hints):
    """``a`` and ``b`` each generate with their first segment's hint and pause after one token."""
    streams = {}
    for cid in ("a", "b"):
        await eng.fill(cid, PROMPTS[cid])
        streams[cid] = eng.generate(cid, SP, hint=first_hints[cid])
        asked = False
        async for ev in streams[cid]:
            if ev.paused:
                break
            if not asked:
                await eng.pause(cid, PauseHint(tool="t", expected_duration_s=1.0))
                asked = True
    return streams


async def drain(stream):
    return [ev.token_id async for ev in stream if ev.token_id is not None]


def test_a_resumes_hint_replaces_the_segments_schedinfo_and_lamps_order(tiny_dirs):
    first = {"a": RequestHint(app="x", expected_output=1000, tenant="alice"),
             "b": RequestHint(app="x", expected_output=1, tenant="bob")}
    second = {"a": RequestHint(app="x", expected_output=1, expected_tool="search", expected_tool_s=0.5,
                               future=((3, None, 2),), objective="latency", task_group="g"),
              "b": RequestHint(app="x", expected_output=1000)}
    with lamps_engine(tiny_dirs) as eng:
        seen = spy_orders(eng)

        async def go():
            streams = await paused_pair(eng, first)
            sa, sb = eng.contexts["a"].sched, eng.contexts["b"].sched
            before = (sa.expected_output, sb.expected_output, sa.tenant)
            await asyncio.gather(eng.resume("a", TOOL, hint=second["a"]), eng.resume("b", TOOL, hint=second["b"]))
            await asyncio.gather(drain(streams["a"]), drain(streams["b"]))
            after = (sa.expected_output, sa.expected_tool, sa.expected_tool_s, sa.future, sa.objective,
                     sa.task_group, sa.tenant, sb.expected_output, sb.tenant)
            for cid in ("a", "b"):
                await eng.free_context(cid)
            return before, after

        before, after = run(go())
    assert before == (1000, 1, "alice")
    # every ranking field from the resume's hint; the tenant is the request's, not the hint's None
    assert after == (1, "search", 0.5, ((3, None, 2),), "latency", "g", "alice", 1000, "bob")
    # decoding after the resume: LAMPS puts the now-shorter ``a`` first (the first hints put ``b`` first)
    assert last_order_of_both(seen)


def test_without_a_resume_hint_the_first_segments_prediction_stays(tiny_dirs):
    """The control of the test above: the same run with plain resumes keeps ``b`` first."""
    first = {"a": RequestHint(app="x", expected_output=1000), "b": RequestHint(app="x", expected_output=1)}
    with lamps_engine(tiny_dirs) as eng:
        seen = spy_orders(eng)

        async def go():
            streams = await paused_pair(eng, first)
            await asyncio.gather(eng.resume("a", TOOL), eng.resume("b", TOOL))
            await asyncio.gather(drain(streams["a"]), drain(streams["b"]))
            out = eng.contexts["a"].sched.expected_output
            for cid in ("a", "b"):
                await eng.free_context(cid)
            return out

        assert run(go()) == 1000
    assert not last_order_of_both(seen)


def test_set_request_hint_updates_every_ranking_field_and_drops_the_score(tiny_dirs):
    with lamps_engine(tiny_dirs) as eng:
        async def go():
            await eng.fill("a", PROMPTS["a"], hint=RequestHint(expected_output=7, future=((1, 2.0, 3),),
                                                               tenant="alice"))
            s = eng.contexts["a"].sched
            seeded = (s.expected_output, s.future, s.tenant)
            s.score, s.future_score = 123.0, 45.0  # as the ranking caches them
            eng.set_request_hint("a", RequestHint(expected_output=2, expected_tool="calc", expected_tool_s=0.3,
                                                  future=((4, None, 1),), objective="throughput"))
            await eng.context_length("a")  # the hint is applied before this later command
            got = (s.expected_output, s.expected_tool, s.expected_tool_s, s.future, s.objective, s.tenant,
                   s.score, s.future_score)
            await eng.free_context("a")
            return seeded, got

        seeded, got = run(go())
    assert seeded == (7, ((1, 2.0, 3),), "alice")  # fill's hint seeds the ranking fields
    assert got == (2, "calc", 0.3, ((4, None, 1),), "throughput", "alice", None, None)


BAD_FUTURES = [((1, -1.0, 0),), ((1, None),), ((1, float("inf"), 0),), ((-1, None, 0),), ((1, None, True),),
               tuple((1, None, 0) for _ in range(MAX_FUTURE_SEGMENTS + 1)), "abc"]


@pytest.mark.parametrize("future", BAD_FUTURES, ids=range(len(BAD_FUTURES)))
def test_a_bad_future_is_refused_naming_the_field(future):
    with pytest.raises(E.InvalidSampling, match=r"hint\.future"):
        RequestHint(future=future).validate()


def test_a_good_future_from_json_lists_is_kept_as_tuples():
    h = RequestHint(future=[[3, None, 2], [4, 1.5, 0]])
    h.validate()
    assert h.future == ((3, None, 2), (4, 1.5, 0)) and hash(h) == hash(RequestHint(future=((3, None, 2),
                                                                                           (4, 1.5, 0))))


def test_a_resume_with_a_bad_hint_changes_nothing(tiny_dirs):
    with lamps_engine(tiny_dirs) as eng:
        async def go():
            streams = await paused_pair(eng, {c: None for c in "ab"})
            n = await eng.context_length("a")
            with pytest.raises(E.InvalidSampling, match=r"hint\.future\[0\]"):
                await eng.resume("a", TOOL, hint=RequestHint(future=((1, -2.0, 0),)))
            assert await eng.context_length("a") == n  # still paused, nothing appended
            await eng.resume("a", TOOL)
            await eng.resume("b", TOOL)
            await asyncio.gather(drain(streams["a"]), drain(streams["b"]))
            for cid in ("a", "b"):
                await eng.free_context(cid)
        run(go())


# ---------------------------------------------------------------- pass-through
def test_replicas_pass_a_resumes_hint_to_the_replica_holding_the_context(tiny_dirs):
    engines = [lamps_engine(tiny_dirs), lamps_engine(tiny_dirs)]
    rs = ReplicaSet(engines)
    try:
        async def go():
            streams = await paused_pair(rs, {c: RequestHint(expected_output=9) for c in "ab"})
            await rs.resume("a", TOOL, hint=RequestHint(expected_output=3, future=((5, None, 1),)))
            await rs.resume("b", TOOL)
            held = [e.contexts["a"].sched for e in engines if "a" in e.contexts]
            got = [(s.expected_output, s.future) for s in held]
            await asyncio.gather(drain(streams["a"]), drain(streams["b"]))
            for cid in ("a", "b"):
                await rs.free_context(cid)
            return got

        assert run(go()) == [(3, ((5, None, 1),))]
    finally:
        rs.close()


def test_the_process_worker_passes_a_resumes_hint_to_its_engine(tiny_dirs):
    """The child's engine gets the hint: it is the one that refuses a bad one
    (the parent passes it over the channel as it is), and a good one resumes."""
    eng = ProcessEngine.start({"path": str(tiny_dirs["llama"][0]), "threads": 1, "block_size": BS,
                               "kv_cache_tokens": 512}, PolicySpec(ranking="lamps", profile="h100-llama-3-8b"),
                              name="hints")
    try:
        async def go():
            streams = await paused_pair(eng, {c: RequestHint(expected_output=9) for c in "ab"})
            with pytest.raises(E.InvalidSampling, match=r"hint\.future\[0\]"):
                await eng.resume("a", TOOL, hint=RequestHint(future=((1, None, -1),)))
            await eng.resume("a", TOOL, hint=RequestHint(expected_output=3, future=((5, None, 1),)))
            await eng.resume("b", TOOL)
            await asyncio.gather(drain(streams["a"]), drain(streams["b"]))
            lengths = [await eng.context_length(cid) for cid in ("a", "b")]
            for cid in ("a", "b"):
                await eng.free_context(cid)
            return lengths

        assert run(go()) == [len(PROMPTS[c]) + len(TOOL) + SP.max_tokens for c in "ab"]  # both ran to the end
    finally:
        eng.close()
