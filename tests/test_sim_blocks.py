"""The BlockLLM cluster simulator (engine_ext/sim/blocks.py): a cost model,
so these check its arithmetic and the direction of its policies on small
seeded workloads, not absolute numbers."""

import json

import pytest

from interlace.engine_ext.sim.block_cli import main as blocks_main
from interlace.engine_ext.sim.block_cluster import (ClusterSimError, ClusterSpec, FamilySpec, ModelSpec,
                                                    WorkloadSpec, build_family, generate_workload, migration_time)
from interlace.engine_ext.sim.blocks import BlockSimConfig, simulate_cluster
from interlace.cli import main as interlace_main

MODEL = ModelSpec()
CLUSTER = ClusterSpec()


def run(n=4, cfg=BlockSimConfig(), rate=20.0, requests=80, output_mean=24, seed=0, cluster=CLUSTER, **fam):
    family = build_family(MODEL, FamilySpec(variants=n, seed=seed, **fam))
    reqs = generate_workload(n, WorkloadSpec(requests=requests, rate=rate, output_mean=output_mean, seed=seed))
    return family, simulate_cluster(cluster, family, reqs, cfg)


def test_deterministic_for_a_seed():
    a = run(4, BlockSimConfig(speculate=2, placement="naive"))[1]
    b = run(4, BlockSimConfig(speculate=2, placement="naive"))[1]
    assert a.metrics == b.metrics and a.placement == b.placement
    c = run(4, BlockSimConfig(speculate=2, placement="naive"), seed=1)[1]
    assert c.metrics != a.metrics


@pytest.mark.parametrize("n", [2, 4, 8])
def test_block_weights_are_base_plus_unique_blocks_once(n):
    family, blk = run(n)
    _, pm = run(n, BlockSimConfig(mode="per-model"))
    h, m = MODEL.hidden, MODEL
    layer = 2 * h * h + 2 * h * m.kv_heads * (h // m.heads) + 3 * h * m.ffn + 2 * h
    lpb = family.spec.layers_per_block
    used_base = {b for v in family.variants for b in v.chain if "." not in b}
    params = sum(m.vocab * h if b == "embed" else m.vocab * h + h if b == "head" else lpb * layer
                 for b in used_base)
    lora = 16 * (h + h) + 16 * (h + m.kv_heads * (h // m.heads))
    for v in family.variants:
        for u in v.unique:
            params += lpb * (lora if v.kind == "lora" else layer)
    expected_gib = params * m.bytes_per_param / 2 ** 30
    assert blk.metrics["weights_initial_gib"] == pytest.approx(expected_gib, rel=1e-12)
    assert all(len(gpus) == 1 for gpus in blk.placement.values())       # one instance each
    full = (m.vocab * h * 2 + h + m.layers * layer) * m.bytes_per_param / 2 ** 30
    assert pm.metrics["weights_one_model_per_engine_gib"] >= n * full
    assert blk.metrics["weights_initial_gib"] < pm.metrics["weights_one_model_per_engine_gib"]
    assert blk.metrics["weights_initial_gib"] < n * full


def test_locality_placement_moves_fewer_inter_server_bytes_than_naive():
    _, loc = run(4, BlockSimConfig(placement="locality"))
    _, nai = run(4, BlockSimConfig(placement="naive"))
    assert nai.metrics["act_mib_inter"] > 0
    assert loc.metrics["act_mib_inter"] < nai.metrics["act_mib_inter"]
    assert loc.metrics["hop_frac_inter"] < nai.metrics["hop_frac_inter"]


def test_owner_first_moves_less_kv_than_least_loaded():
    # enough load that blocks scale and requests have a choice of instances
    kw = dict(rate=100.0, requests=300, output_mean=32)
    _, own = run(1, BlockSimConfig(kv_policy="owner-first"), **kw)
    _, ll = run(1, BlockSimConfig(kv_policy="least-loaded"), **kw)
    assert ll.metrics["load_events"] > 0 and ll.metrics["migrations"] > 0
    assert own.metrics["kv_mib_moved"] < ll.metrics["kv_mib_moved"]
    assert own.metrics["kv_tokens_recomputed"] < ll.metrics["kv_tokens_recomputed"]


def test_speculation_never_on_consecutive_or_last_blocks():
    for n, k in ((1, 3), (4, 5), (8, 12)):
        _, res = run(n, BlockSimConfig(speculate=k, placement="naive"), requests=30)
        spec = set(res.speculated)
        assert spec and len(spec) <= k
        for chain in res.chains.values():
            assert chain[-1] not in spec
            for a, b in zip(chain, chain[1:]):
                assert not (a in spec and b in spec), (a, b)
    # naive placement makes hops remote: surrogates get used, hits and misses both happen
    _, res = run(4, BlockSimConfig(speculate=2, placement="naive", surrogate_accuracy=0.5))
    assert res.metrics["spec_hits"] > 0 and res.metrics["spec_misses"] > 0
    _, perfect = run(4, BlockSimConfig(speculate=2, placement="naive", surrogate_accuracy=1.0))
    assert perfect.metrics["spec_misses"] == 0 and perfect.metrics["spec_saved_s"] > 0


def test_migration_meets_where_recompute_and_copy_cross():
    # 1000 tokens; recompute 3000 tok/s from the front, copy 1000 tok/s from the back:
    # 3000 T + 1000 T = 1000 -> T = 0.25 s, 750 recomputed, 250 copied
    m = migration_time(1000, 3000.0, 1000.0)
    assert m.time_s == pytest.approx(0.25) and (m.recomputed_tokens, m.copied_tokens) == (750, 250)
    # a 0.1 s link latency delays the copy: 3000 T + 1000 (T - 0.1) = 1000 -> T = 0.275
    m = migration_time(1000, 3000.0, 1000.0, latency_s=0.1)
    assert m.time_s == pytest.approx(0.275) and m.recomputed_tokens == 825 and m.copied_tokens == 175
    # recomputation done before the copy starts
    m = migration_time(100, 3000.0, 1000.0, latency_s=0.1)
    assert m.time_s == pytest.approx(100 / 3000) and m.copied_tokens == 0
    assert migration_time(0, 1.0, 1.0).time_s == 0
    with pytest.raises(ClusterSimError):
        migration_time(10, 0.0, 1.0)


def test_one_variant_same_throughput_both_modes():
    _, pm = run(1, BlockSimConfig(mode="per-model"))
    _, blk = run(1, BlockSimConfig())
    assert blk.metrics["throughput_tok_s"] == pytest.approx(pm.metrics["throughput_tok_s"], rel=0.03)
    assert blk.metrics["weights_initial_gib"] == pytest.approx(pm.metrics["weights_initial_gib"])


def test_more_variants_than_gpus_swap_per_model():
    small = ClusterSpec(gpus_per_server=(2,))
    _, pm = run(5, BlockSimConfig(mode="per-model"), cluster=small, requests=40)
    _, blk = run(5, BlockSimConfig(), cluster=small, requests=40)
    assert pm.metrics["completed"] == blk.metrics["completed"] == 40
    assert pm.metrics["load_events"] > 0 and pm.metrics["evictions"] > 0
    assert blk.metrics["evictions"] == 0


def test_cli_table_and_json(capsys):
    assert blocks_main(["--variants", "1,2", "--requests", "30", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["simulated"] and [r["variants"] for r in rep["runs"]] == [1, 2]
    assert set(rep["runs"][1]["results"]) == {"per-model", "block"}
    assert interlace_main(["sim", "blocks", "--variants", "2", "--requests", "20", "--ablate"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "block/pm" in out and "block naive" in out and "least-loaded" in out


@pytest.mark.parametrize("argv,msg", [
    (["--rate", "-1"], "rate"),
    (["--rate", "0"], "rate"),
    (["--cluster", "{not json"], "malformed JSON"),
    (["--cluster", '{"gpus_per_server": [0, 0]}'], "zero GPUs"),
    (["--cluster", '{"gpus_per_server": []}'], "at least one server"),
    (["--cluster", '{"gpu_mem_gb": 80}'], "unknown fields"),
    (["--cluster", "/no/such/file.json"], "neither inline JSON"),
    (["--cluster", '{"gpu_mem_gib": 8}'], "does not fit"),
    (["--variants", "0"], "variants"),
    (["--variants", "x"], "variants"),
    (["--requests", "0"], "requests"),
    (["--surrogate-accuracy", "1.5"], "accuracy"),
])
def test_cli_bad_input(capsys, argv, msg):
    assert interlace_main(["sim", "blocks", "--variants", "1", "--requests", "10", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0]


def test_sim_trace_mode_still_works(capsys):
    assert interlace_main(["sim", "--trace", "qa", "--num-requests", "6", "--json"]) == 0
    assert "completed" in json.loads(capsys.readouterr().out)


def test_importable_without_torch():
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None; "
            "import interlace.engine_ext.sim.blocks, interlace.engine_ext.sim.block_cli; print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"
