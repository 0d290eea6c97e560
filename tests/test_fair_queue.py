"""The engine's queue is served fairly across tenants (API keys): a key's burst cannot starve another's request.

The rule (engine_ext/policies/fairness.py) on its own; the native scheduler applying it to a full
engine (a burst of one tenant, another tenant's request admitted at the next free slot); and the
gateway passing each API key's name as the tenant, so another key's short chat is answered while a
large semantic batch of the first key is still running.  Orders of admission and completion, not
wall time, are asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from interlace.engine_ext.errors import InvalidSampling
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.policies import FCFS, LAMPS, ObjectiveRanking, SchedInfo, unit_profile
from interlace.engine_ext.policies.fairness import fair_order
from interlace.engine_ext.protocol import RequestHint, SamplingParams

from helpers.gateway_server import LiveGateway, wait_idle


@dataclass(eq=False)
class Item:
    name: str
    arrival: float
    sched: SchedInfo = field(default_factory=SchedInfo)


def items(spec):
    """``"A1 A2 B1"`` -> items of tenants A, B in that arrival order."""
    return [Item(n, float(i), SchedInfo(tenant=n[0])) for i, n in enumerate(spec.split())]


def names(seq):
    return " ".join(it.name for it in seq)


# ------------------------------------------------------------------ the rule
def test_one_tenant_keeps_the_rankings_order_exactly():
    lamps = LAMPS(unit_profile(), starvation_threshold=2)
    xs = [Item(f"r{i}", float(i), SchedInfo(context_len=10 * (5 - i), expected_output=3)) for i in range(5)]
    for _ in range(3):  # some become starving (LAMPS puts them first): still the ranking's order
        ranked = ObjectiveRanking(lamps).order(xs)
        assert fair_order(ranked, {None: 7}) == ranked
        lamps.observe(ranked[:1], ranked[1:])
    assert any(x.sched.starving for x in xs)


def test_the_tenant_with_fewer_running_goes_first_and_each_tenant_keeps_its_order():
    ranked = FCFS().order(items("A1 A2 A3 A4 B1 B2 C1"))
    assert names(fair_order(ranked)) == "A1 B1 C1 A2 B2 A3 A4"            # nothing running: round robin
    assert names(fair_order(ranked, {"A": 3})) == "B1 C1 B2 A1 A2 A3 A4"  # A's burst runs: the others first
    assert names(fair_order(ranked, {"A": 1, "B": 1})) == "C1 A1 B1 A2 B2 A3 A4"


def test_starving_requests_still_go_first_fairly_among_themselves():
    xs = items("A1 A2 A3 B1 B2")
    for it in xs:
        it.sched.starving = it.name in ("A2", "A3", "B2")
    ranked = [xs[i] for i in (1, 2, 4, 0, 3)]  # what LAMPS gives: the starving ones first
    assert names(fair_order(ranked, {"A": 5})) == "B2 A2 A3 B1 A1"


def test_a_hints_tenant_is_checked():
    RequestHint(tenant="key-a").validate()
    for bad in ("", 7, "x" * 129):
        with pytest.raises(InvalidSampling, match="tenant"):
            RequestHint(tenant=bad).validate()


# ------------------------------------------------------------ native engine
def test_the_native_scheduler_admits_another_tenants_request_before_a_bursts_backlog(tiny_dirs):
    """Two decode slots: tenant A holds one with a long request and has three more waiting; B's
    request, the last to arrive, takes the next slot (FCFS alone serves it after all of A's)."""
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=2048, max_seqs=2) as eng:
        async def go():
            names_ = ["blocker", "a1", "a2", "a3", "b"]
            for i, n in enumerate(names_):  # created in this order: FCFS ranks them so
                await eng.fill(n, [3, 4, 5, 6 + i])
            finished = []

            async def run(cid, tenant, max_tokens):
                hint = RequestHint(tenant=tenant)
                async for ev in eng.generate(cid, SamplingParams(max_tokens=max_tokens, ignore_eos=True), hint=hint):
                    if ev.finish_reason:
                        finished.append(cid)

            blocker = asyncio.create_task(run("blocker", "A", 60))
            while not eng.load_stats()["running"]:
                await asyncio.sleep(0.01)
            tasks = [asyncio.create_task(run(n, "A", 6)) for n in ("a1", "a2", "a3")]
            tasks.append(asyncio.create_task(run("b", "B", 6)))
            await asyncio.gather(blocker, *tasks)
            return finished

        finished = asyncio.run(go())
    assert finished.index("b") < finished.index("a2") and finished.index("b") < finished.index("a3"), finished


def test_a_burst_that_fills_every_decode_slot_does_not_hold_another_tenant_out(tiny_dirs):
    """Two decode slots, both held by tenant A's long requests: B's new request gets a slot in the
    next step (the slots are dealt out between tenants) instead of waiting for one of A's to end."""
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=2048, max_seqs=2) as eng:
        async def go():
            for i, n in enumerate(["a1", "a2"]):
                await eng.fill(n, [3, 4, 5, 6 + i])
            finished = []

            async def run(cid, tenant, max_tokens):
                if cid == "b":  # a new request, as a chat is: its prompt's prefill waits for a slot too
                    await eng.fill(cid, [3, 4, 5, 9], hint=RequestHint(tenant=tenant))
                async for ev in eng.generate(cid, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                             hint=RequestHint(tenant=tenant)):
                    if ev.finish_reason:
                        finished.append(cid)

            a = [asyncio.create_task(run(n, "A", 80)) for n in ("a1", "a2")]
            while eng.load_stats()["running"] < 2:
                await asyncio.sleep(0.01)
            await asyncio.gather(*a, run("b", "B", 4))
            return finished

        finished = asyncio.run(go())
    assert finished[0] == "b", finished


# ------------------------------------------------------------------ gateway
KEY_A, KEY_B = "fair-key-a", "fair-key-b"
MODEL = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32", "max_seqs": 2, "ranking": "fcfs"}


def test_another_keys_short_chat_is_answered_while_a_keys_semantic_batch_is_still_running():
    """Key A submits 8 semantic calls (the engine runs 2 at a time); then key B asks a 2-token
    chat.  B is answered while half of A's batch is still to run: before the fix, B's chat was
    queued behind the whole batch."""
    cfg = {"server": {"api_keys": [{"key": KEY_A, "name": "a"}, {"key": KEY_B, "name": "b"}]},
           "models": {"smollm2": MODEL}}
    with LiveGateway(cfg) as live, httpx.Client(base_url=live.url, timeout=300) as http:
        r = http.post("/v1/sessions", headers={"Authorization": f"Bearer {KEY_A}"}, json={"calls": [
            {"model": "smollm2", "template": f"{i}. Write a long story. Once upon a time, {{{{output:out}}}}",
             "inputs": {}, "outputs": {"out": {"sampling": {"max_tokens": 8}}}} for i in range(8)]})
        assert r.status_code == 201, r.text
        sid, token = r.json()["id"], r.json()["token"]
        session = lambda: http.get(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {token}"}).json()  # noqa: E731
        engine, deadline = live.gateway.models["smollm2"].engine, time.time() + 120
        while engine.load_stats()["contexts"] < 8:  # A's whole batch is in the engine's queue
            assert time.time() < deadline, (engine.load_stats(), session())
            time.sleep(0.01)
        answered = {}

        def chat():
            answered["response"] = http.post(
                "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_B}"},
                json={"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
            answered["a_calls_then"] = session()["calls"]

        t = threading.Thread(target=chat)
        t.start()
        tenants = set()  # of the engine's contexts while B's chat runs: each key's name reaches the engine
        while t.is_alive():
            with contextlib.suppress(RuntimeError):  # the engine thread changed the dict meanwhile
                tenants |= {(str(c.id)[:5], c.sched.tenant) for c in list(engine.contexts.values())}
            time.sleep(0.005)
        t.join(300)
        assert ("chat-", "b") in tenants and any(k != "chat-" and t_ == "a" for k, t_ in tenants), tenants
        assert answered["response"].status_code == 200, answered["response"].text
        left = answered["a_calls_then"]["pending"] + answered["a_calls_then"]["running"]
        assert left >= 4, f"B's chat waited for A's batch: {answered['a_calls_then']}"
        assert http.delete(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert wait_idle(live)["contexts"] == 0


# ---------------------------------------------------------------- vLLM's scheduler
def test_vllms_scheduler_admits_another_tenants_request_before_a_bursts_backlog(smol_dir):
    """The same rule in ``InterlaceScheduler``: two sequences at a time, both held by tenant A,
    two more of A's waiting; B's request, the last to arrive, takes the first slot that frees
    (vLLM's FCFS queue would serve it after all of A's)."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh --test (the CPU build here)")
    from interlace.engine_ext.policies import PolicySpec
    from interlace.engine_ext.vllm import load_vllm_engine

    eng = load_vllm_engine({"kind": "vllm", "dtype": "float32", "enforce_eager": True, "kv_cache_space_gb": 1,
                            "max_model_len": 1024, "max_num_seqs": 2}, str(smol_dir),
                           PolicySpec(ranking="fcfs", interception="discard"))
    try:
        async def go():
            prompt = eng.tokenizer.encode("Count: one two three")
            for cid in ("blocker", "a1", "a2", "a3", "b"):  # created in this order: FCFS ranks them so
                await eng.fill(cid, prompt)
            finished = []

            async def run(cid, max_tokens, started=None):
                sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                async for ev in eng.generate(cid, sp, hint=RequestHint(tenant="B" if cid == "b" else "A")):
                    if started is not None:
                        started.set()
                    if ev.finish_reason:
                        finished.append(cid)

            first = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(run("blocker", 60, first[0])), asyncio.create_task(run("a1", 30, first[1]))]
            for e in first:
                await e.wait()  # A holds both slots
            tasks += [asyncio.create_task(run(cid, 3)) for cid in ("a2", "a3", "b")]
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
            return finished

        finished = asyncio.run(go())
    finally:
        eng.close()
    assert finished.index("b") < finished.index("a2") and finished.index("b") < finished.index("a3"), finished
