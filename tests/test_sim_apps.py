"""``interlace sim apps`` (engine_ext/sim/apps.py, app_engine.py, app_cli.py): Parrot's applications on a
simulated engine -- the DAGs equal bench apps', the modes' semantics, capacity and prefix sharing, determinism,
the CLI, and (the issue's test) the same order of the modes as the native engine on a small case."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import pytest

from interlace.cli import main as interlace_main
from interlace.engine_ext.policies import CapacityPolicy, Profile
from interlace.engine_ext.policies.capacity import NO_CAPACITY
from interlace.engine_ext.sim import apps as S
from interlace.engine_ext.sim.app_cli import main as apps_main
from interlace.engine_ext.sim.app_engine import (AppSimError, Variant, make_variant, run_variant, variants_for)

H100 = Profile.load("h100-llama-3-8b")


def _bench():
    from interlace.bench import apps as A  # httpx, no torch
    return A


def _bench_app(A, name: str, s: S.Sizes):
    chunks = [f"piece {i}" for i in range(s.chunks)]
    if name == "chain":
        return A.chain_app(chunks, s.output_tokens)
    if name == "mapreduce":
        return A.mapreduce_app(chunks, s.output_tokens)
    if name == "shared":
        return A.shared_app("system", s.users, s.output_tokens)
    return A.multiagent_app(s.files, s.rounds, s.output_tokens)


# ---------------------------------------------------------------------------- the DAGs
@pytest.mark.parametrize("sizes", [S.BENCH, S.QUICK, S.Sizes(chunks=5, output_tokens=7, users=3, files=3, rounds=3)])
@pytest.mark.parametrize("name", S.APPS)
def test_dags_equal_bench_apps(name, sizes):
    """Call for call: the variable written, its stage, client, output length and the variables it reads."""
    A = _bench()
    mine, theirs = S.build_app(name, sizes), _bench_app(A, name, sizes)
    assert [c.out for c in mine.calls] == [c.out for c in theirs.calls]
    for a, b in zip(mine.calls, theirs.calls):
        assert (a.stage, a.client, a.max_tokens) == (b.stage, b.client, b.max_tokens), a.out
        assert set(a.inputs) == {v for kind, v in b.inputs.values() if kind == "var"}, a.out
    assert mine.finals == theirs.finals and mine.clients == theirs.clients


def test_dag_shapes_at_bench_sizes():
    shapes = {n: (len(a.calls), len(a.stages()), a.clients) for n, a in
              ((n, S.build_app(n, S.BENCH)) for n in S.APPS)}
    assert shapes == {"chain": (8, 8, 1), "mapreduce": (9, 2, 1), "shared": (16, 1, 16), "multiagent": (21, 6, 1)}
    mr = S.build_app("mapreduce", S.BENCH)
    assert set(mr.call("summary").inputs) == {f"part_{i}" for i in range(8)}
    ch = S.build_app("chain", S.BENCH)
    assert all(ch.calls[i].inputs == (f"summary_{i - 1}",) for i in range(1, 8)) and ch.calls[0].inputs == ()
    ma = S.build_app("multiagent", S.BENCH)
    assert set(ma.call("review_2_r1").inputs) == {"design"} | {f"code_{j}_r1" for j in range(4)}
    assert set(ma.call("code_2_r2").inputs) == {"design", "code_2_r1", "review_2_r1"}
    # the prompt of a shared-app user: chat head, system prompt + "Customer:", query, "TripMate:", chat tail
    sh = S.build_app("shared", S.BENCH)
    assert sh.calls[3].prompt_tokens == 24 + 805 + S.USER_QUERY_TOKENS[3] + 6 + 6
    assert sum(c.prompt_tokens for c in sh.calls) == 13689  # bench apps' measured prompt tokens (docs/benchmarks.md)


@pytest.mark.parametrize("name", S.APPS)
def test_objectives_as_the_gateway_deduces(name):
    """The simulator's objectives are the gateway's deduction's (per session), and what bench apps expects."""
    from interlace.engine_ext.policies.deduction import CallNode, deduce

    app = S.build_app(name, S.BENCH)
    mine = S.deduce_objectives(app)
    for cid in range(app.clients):
        calls = [c for c in app.calls if c.client == cid]
        ref = deduce([CallNode(c.out, c.inputs, (c.out,)) for c in calls],
                     {f: "latency" for f in app.finals if app.call(f).client == cid})
        assert {c.out: ref[c.out].objective for c in calls} == {c.out: mine[c.out][0] for c in calls}
        groups = lambda d: sorted(sorted(o for o in d if d[o] == g) for g in {v for v in d.values() if v})
        assert groups({c.out: ref[c.out].task_group for c in calls}) == groups({c.out: mine[c.out][1] for c in calls})
    if name == "mapreduce":
        assert mine["summary"] == ("latency", None) and mine["part_0"][0] == "throughput"


def test_template_token_counts_match_the_tokenizer():
    """The constant pieces' token counts are what the embedded model's tokenizer gives bench's templates."""
    from tokenizers import Tokenizer as HF

    from interlace.engine_ext.embedded import embedded_model_dir

    hf = HF.from_file(str(embedded_model_dir() / "tokenizer.json"))

    class Tok:  # what bench's system_prompt() uses of a tokenizer
        def encode(self, text):
            return hf.encode(text, add_special_tokens=False).ids

        def decode(self, ids):
            return hf.decode(ids)

    A = _bench()
    tok = Tok()
    for name in S.APPS:
        s = S.BENCH
        theirs = _bench_app(A, name, s) if name != "shared" else A.shared_app(A.system_prompt(tok, s.system_tokens),
                                                                              s.users, s.output_tokens)
        for a, b in zip(S.build_app(name, s).calls, theirs.calls):
            const = [len(tok.encode(t)) for t in A._PLACEHOLDER.split(b.text)[::2]]
            static = [p.tokens for p in a.pieces[1:-1] if p.static]  # without the chat template's head and tail
            assert static == [n for n in const if n], (name, a.out)


# ---------------------------------------------------------------------------- the modes
def test_b_has_no_round_trip_between_dependent_calls():
    app = S.build_app("chain", S.BENCH)
    b = run_variant(app, make_variant("b"), H100, delay=(0.25, 0.25))
    for i in range(1, 8):  # the next step enters the engine at the iteration its input finished
        assert b["dispatch_at"][f"summary_{i}"] == b["done_at"][f"summary_{i - 1}"]
    assert b["http_requests"] == 8 + 1  # one submit per call (all at once), one fetch
    a = run_variant(app, make_variant("a-seq"), H100, delay=(0.25, 0.25))
    for i in range(1, 8):  # request-centric: an answer's way back and the next request's way there
        assert a["arrivals"][f"summary_{i}"] - a["done_at"][f"summary_{i - 1}"] == pytest.approx(0.25)
    assert a["http_requests"] == 8
    # 8 round trips against one (half a submit, half a fetch), less b's prefix fills (a step each)
    assert a["e2e_s"] - b["e2e_s"] == pytest.approx(7 * 0.25, abs=0.1)
    # the SDK's client (bench apps): a session, first stage + 7 declarations, 7 later submits, one fetch
    assert run_variant(app, make_variant("b"), H100, protocol="sdk")["http_requests"] == 17


def test_a_par_sends_a_stage_together_after_the_last_answer():
    app = S.build_app("mapreduce", S.BENCH)
    r = run_variant(app, make_variant("a-par"), H100, delay=(0.2, 0.2))
    maps = [f"part_{i}" for i in range(8)]
    assert [r["arrivals"][m] for m in maps] == [pytest.approx(0.1)] * 8
    assert r["arrivals"]["summary"] == pytest.approx(max(r["done_at"][m] for m in maps) + 0.2)
    seq = run_variant(app, make_variant("a-seq"), H100, delay=(0.2, 0.2))
    assert seq["e2e_s"] > 3 * r["e2e_s"]


def test_baseline_cap_bounds_the_batch():
    """Parrot's baseline: 4096 tokens of requests at a time; without the cap the map stage runs together."""
    app = S.build_app("mapreduce", S.PARROT)  # 20 map calls of ~1100 tokens
    capped = run_variant(app, make_variant("a-par"), H100, timeline=True)
    assert all(s.limit == 4096 and s.run_tokens <= 4096 for s in capped["timeline"])
    assert any(s.held for s in capped["timeline"]) and capped["held_steps"] > 0
    free = run_variant(app, make_variant("a-par-nocap"), H100)
    assert free["held_steps"] == 0 and free["max_run_tokens"] > 20 * 1000
    assert capped["e2e_s"] > 1.5 * free["e2e_s"]


def test_oversized_request_runs_alone_under_the_cap():
    app = S.build_app("shared", S.Sizes(users=3, system_tokens=5000, output_tokens=4))
    r = run_variant(app, make_variant("a-par"), H100, timeline=True)
    assert r["alone_steps"] > 0 and all(s.scheduled == 1 for s in r["timeline"])


def _latency_beside_group() -> S.AppDAG:
    """X (final: latency) runs while G0..G3 (a task group feeding the final F) want to run beside it."""
    calls = [S.SimCall("X", (S.Piece("x", 100, True),), 40, 0)]
    calls += [S.SimCall(f"G{i}", (S.Piece(("g", i), 1000),), 40, 0) for i in range(4)]
    calls.append(S.SimCall("F", (S.Piece("f", 10, True),) + tuple(S.Piece(("out", f"G{i}"), 40, False, f"G{i}")
                                                                 for i in range(4)), 40, 1))
    return S.AppDAG("custom", calls, ["X", "F"], "latency call beside a task group")


def test_latency_cap_holds_the_group_beside_a_latency_call():
    app = _latency_beside_group()
    objs = S.deduce_objectives(app)
    assert objs["X"][0] == "latency" and {objs[f"G{i}"][1] for i in range(4)} == {"c0.tg1"}
    r = run_variant(app, make_variant("b", latency_cap=2048), H100, delay=(0.0, 0.0), timeline=True)
    tl = r["timeline"]
    beside = [s for s in tl if s.latency_in_run]
    assert beside and all(s.limit == 2048 for s in beside)
    assert all(s.other_tokens == 0 or s.run_tokens <= 2048 for s in beside)
    assert any(s.held for s in beside)  # the group waits for capacity while X runs
    assert max(s.other_tokens for s in beside) <= 1040
    off = run_variant(app, make_variant("b", latency_cap=None), H100, delay=(0.0, 0.0), timeline=True)
    assert off["held_steps"] == 0 and max(s.other_tokens for s in off["timeline"] if s.latency_in_run) >= 4000
    assert r["done_at"]["X"] < off["done_at"]["X"]  # X's steps are lighter under the cap


def test_shared_prefix_is_prefilled_once():
    app = S.build_app("shared", S.BENCH)
    prefix = 24 + 805  # the chat head and the static system prompt
    suffix = sum(c.prompt_tokens - prefix for c in app.calls)
    for v in ("b", "b-nocache"):  # forks share it with or without the block cache
        r = run_variant(app, make_variant(v), H100)
        assert r["prefill_tokens"] == prefix + suffix, v
        assert r["prefix_filled_tokens"] == prefix
    nocache = run_variant(app, make_variant("a-par-nocache"), H100)
    assert nocache["prefill_tokens"] == sum(c.prompt_tokens for c in app.calls)
    # without forks, users admitted in the same iteration each compute it before it is cached
    nofork = run_variant(app, make_variant("b-nofork"), H100, delay=(0.0, 0.0))
    assert nofork["prefill_tokens"] > prefix + suffix + prefix
    assert run_variant(app, make_variant("b"), H100, delay=(0.0, 0.0))["prefill_tokens"] == prefix + suffix


def test_prefix_caching_of_request_centric_calls():
    app = S.build_app("shared", S.BENCH)
    cached = run_variant(app, make_variant("a-par-nocap"), H100)
    plain = run_variant(app, Variant("x", "par", NO_CAPACITY, prefix_caching=False), H100)
    assert cached["cache_hit_tokens"] > 10 * 800 and plain["cache_hit_tokens"] == 0
    assert cached["prefill_tokens"] < plain["prefill_tokens"] / 5


def test_deterministic_for_a_seed_and_repeat():
    app = S.build_app("multiagent", S.QUICK)
    for v in ("a-seq", "a-par", "b"):
        one = run_variant(app, make_variant(v), H100, seed=3, repeat=1)
        assert one == run_variant(app, make_variant(v), H100, seed=3, repeat=1)
    a = [run_variant(app, make_variant("a-seq"), H100, seed=3, repeat=r)["e2e_s"] for r in range(3)]
    assert len(set(a)) == 3  # each repeat draws its own delays


def test_kv_that_never_fits_is_an_error():
    small = Profile.from_dict(dict(H100.to_dict(), kv_capacity_tokens=256))
    with pytest.raises(AppSimError, match="never fit"):
        run_variant(S.build_app("chain", S.BENCH), make_variant("a-seq"), small)


def test_variants_per_app():
    assert variants_for(S.build_app("chain", S.BENCH))[1]["a-par"] == "a-seq"
    assert "a-seq" not in variants_for(S.build_app("shared", S.BENCH))[0]
    with pytest.raises(ValueError):
        make_variant("c")
    assert make_variant("a-par").capacity == CapacityPolicy(latency_tokens=None, throughput_tokens=4096)


# ---------------------------------------------------------------------------- the CLI
def test_cli_table_targets_and_json(capsys):
    assert interlace_main(["sim", "apps", "--repeats", "3"]) == 0
    text = capsys.readouterr().out
    assert "derived (roofline)" in text
    for app in S.APPS:
        assert f"**{app}**" in text
    for line in ("target chain: b >= 1.3x", "target mapreduce: b >= 2x", "target multiagent: b >= 3x",
                 "target shared: b >= 5x fewer prefilled tokens than a-par-nocache",
                 "target shared: b >= 1.5x the throughput"):
        assert line in text
    assert apps_main(["--apps", "mapreduce,shared", "--sizes", "quick", "--users", "16", "--repeats", "3",
                      "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep["apps"]) == {"mapreduce", "shared"} and rep["profile_source"].startswith("derived")
    e2e = rep["apps"]["mapreduce"]["variants"]["a-seq"]["e2e_s"]
    assert e2e["min"] < e2e["mean"] < e2e["max"] and rep["apps"]["mapreduce"]["variants"]["b"]["runs"] == 3
    assert {t["verdict"] for t in rep["targets"]} <= {"PASS", "MISS", "n/a"} and len(rep["targets"]) == 3
    assert interlace_main(["sim", "apps", "--apps", "chain", "--repeats", "1", "--profile", "h200-llama-3-8b",
                           "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile_source"] == "measured"


@pytest.mark.parametrize("argv,msg", [
    (["--apps", "chain,nope"], "unknown application 'nope'"),
    (["--delay-ms", "300,200"], "--delay-ms"),
    (["--repeats", "0"], "--repeats must be positive"),
    (["--profile", "no-such-profile"], "no such file"),
    (["--baseline-cap", "-5"], "--baseline-cap"),
    (["--variants", "a-seq,zz"], "unknown variant 'zz'"),
    (["--chunks", "0"], "--chunks must be a positive integer"),
])
def test_cli_bad_input(capsys, argv, msg):
    assert interlace_main(["sim", "apps", "--apps", "chain", "--repeats", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and msg in err and "\n" not in err


def test_importable_without_torch():
    out = subprocess.run([sys.executable, "-c",
                          "import sys, interlace.engine_ext.sim.apps, interlace.engine_ext.sim.app_engine, "
                          "interlace.engine_ext.sim.app_cli; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


# ---------------------------------------------------------------------------- the native engine's order
#: ``interlace profile --quick`` of the embedded SmolLM2-135M (float32) on this VM type (Intel Xeon @ 2.80GHz,
#: 2 CPUs), 2026-11-28 13:14 UTC (the profile cache of the gateway's ``profile: auto``)
CPU_PROFILE = dict(model="SmolLM2-135M-Instruct", device="cpu: Intel(R) Xeon(R) Processor @ 2.80GHz (2 CPUs)",
                   source="measured", block_size=16, kv_bytes_per_token=46080, kv_capacity_tokens=4096,
                   max_batched_tokens=512, fwd_tokens=(1, 2, 4, 8, 32, 128),
                   fwd_seconds=(0.0558, 0.0676, 0.1796, 0.1796, 0.4196, 0.4196),
                   fwd_s_per_context_token=2.79e-05, swap_s_per_block=0.000109, saturation_tokens=128)


def test_simulator_orders_the_modes_as_the_native_engine():
    """Chain summary of 6 small pieces, 1-token steps, 1.5 s of network per request: on the native engine
    (bench apps' gateway, clients and network) the request-centric run pays 6 round trips, Semantic
    Variables 3.5 (bench's SDK client: session, submits, later submits, fetch) but two engine steps a call
    (a prefix context's fill, then the fork's).  Measured on the loaded 2-core VM (load 6): a-seq ~14 s,
    b ~10 s; twice the compute per step still leaves ~3 s between them; ~50 s in all, most of it the
    gateway's start.  The simulator, on this CPU's measured profile with the same
    client (``protocol="sdk"``), must order a-seq and b as the engine does (a-par = a-seq: one call a
    stage).  One gateway for both runs, prefix cache off (so neither finds the other's blocks); one torch
    thread (two stall on a busy 2-core machine)."""
    httpx = pytest.importorskip("httpx")
    A = _bench()
    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.tokenizer import Tokenizer

    n, d = 6, 1.5
    tok = Tokenizer.from_model_dir(embedded_model_dir())
    native_app = A.chain_app(A.chunk_text(tok, A.load_document(), n, 8), 1)
    sim_app = S.build_app("chain", S.Sizes(chunks=n, chunk_tokens=8, output_tokens=1))
    assert tok.encode_chat([{"role": "user", "content": "x"}])  # the template the pieces' counts assume
    native = {}
    with A.Gateway(A.gateway_config(False, 4096, 512, weights="float32", threads=1)) as gw:
        async def go():
            async with httpx.AsyncClient(base_url=gw.url, timeout=120.0) as c:  # warm-up
                r = await c.post("/v1/chat/completions", json={"model": A.MODEL, "max_tokens": 1,
                                                               "messages": [{"role": "user", "content": "Hi"}]})
                assert r.status_code == 200, r.text
            for kind in ("b", "a-seq"):
                tr = A.delayed_transport(random.Random(0), d, d)
                t0 = time.monotonic()
                if kind == "b":
                    await A.run_semantic(gw.url, tr, native_app)
                else:
                    async with httpx.AsyncClient(base_url=gw.url, transport=tr, timeout=300.0) as c:
                        await A.run_request_centric(c, native_app, parallel=False)
                native[kind] = time.monotonic() - t0

        asyncio.run(go())
    prof = Profile(**CPU_PROFILE)
    sim = {"a-seq": run_variant(sim_app, Variant("a-seq", "seq", NO_CAPACITY, prefix_caching=False), prof,
                                delay=(d, d))["e2e_s"],
           "b": run_variant(sim_app, Variant("b", "dag", CapacityPolicy(), prefix_caching=False, fork=True), prof,
                            delay=(d, d), protocol="sdk")["e2e_s"]}
    order = lambda e: sorted(e, key=e.get)
    assert order(sim) == order(native) == ["b", "a-seq"], (native, sim)
