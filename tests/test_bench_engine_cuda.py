"""``interlace bench engine --device ...`` (bench/engine_cuda.py): the GPU
benchmark's code run end to end on the CPU with a tiny model (``--device cpu
--shapes tiny``): the engine's decode cells with their bandwidth limit, the
prefill TFLOP/s, transformers beside it, the cascade kernels (under Triton's
interpreter) against plain paged decode, the table, the JSON and the plot;
a cell whose KV does not fit is reported as such; without a GPU ``--device
cuda`` is a one-line error, exit status 2.  The numbers are not asserted
beyond being finite and consistent: they mean nothing on a CPU."""

import json
import math

import pytest
import torch

from interlace.bench import engine as bench_engine

TINY = ["--device", "cpu", "--shapes", "tiny", "--batches", "1", "2", "--contexts", "16", "--new", "3",
        "--forks", "2", "--prefix", "32", "--suffix", "8"]


def finite_positive(*xs):
    return all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in xs)


def test_bench_engine_device_smoke(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    assert bench_engine.main(TINY + ["--json", str(out), "--plot", str(png), "--profile-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| batch | context | interlace decode tok/s | bandwidth limit tok/s | fraction |" in text
    assert "| forks | prefix | suffix | paged decode ms | cascade ms | speed-up |" in text
    res = json.loads(out.read_text())
    assert {"torch", "triton", "transformers"} <= set(res["versions"]) and res["machine"]["cpu"]["model_name"]
    assert finite_positive(res["copy_bandwidth_gb_s"], res["matmul_tflops"])
    bw = res["copy_bandwidth_gb_s"] * 1e9
    tiny = res["shapes"]["tiny"]
    assert [(c["batch"], c["context"]) for c in tiny["decode"]] == [(1, 16), (2, 16)]
    for c in tiny["decode"]:
        assert finite_positive(c["decode_tok_s"], c["bound_tok_s"], c["fraction"], c["prefill_tflops"], c["hf_tok_s"])
        assert c["weight_bytes"] > 0 and c["kv_bytes_read"] == c["batch"] * (16 + 3 / 2) * tiny["kv_bytes_per_token"]
        assert c["bound_tok_s"] == pytest.approx(c["batch"] * bw / (c["weight_bytes"] + c["kv_bytes_read"]))
        assert c["fraction"] == pytest.approx(c["decode_tok_s"] / c["bound_tok_s"])
        assert f"| {c['batch']} | 16 | {c['decode_tok_s']:.1f} | {c['bound_tok_s']:.1f} |" in text
    (casc,) = tiny["cascade"]
    assert casc["forks"] == 2 and casc["prefix"] == 32 and finite_positive(casc["plain_s"], casc["cascade_s"])
    assert casc["speedup"] == pytest.approx(casc["plain_s"] / casc["cascade_s"])
    assert casc["max_abs_diff"] < 1e-4  # the two kernels compute the same attention
    assert png.stat().st_size > 1000
    from interlace.engine_ext.policies.costmodel import Profile

    prof = Profile.load(tmp_path / "tiny.json")  # the simulator reads it
    assert prof.source == "measured" and prof.model == "tiny"


def test_a_cell_that_does_not_fit_is_skipped_and_says_so(capsys):
    # tiny: 512 bytes of KV per token; b=1 takes 3 blocks of 16 tokens (2 + 1 of slack: 24 KiB), b=2 twice that
    assert bench_engine.main(TINY + ["--kv-budget-mib", str(32 / 1024), "--no-hf", "--forks", "2"]) == 0
    text = capsys.readouterr().out
    assert "| 2 | 16 | does not fit: " in text
    assert "| 1 | 16 | " in text and "| 1 | 16 | does not fit" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the benchmark would run")
def test_device_cuda_without_a_gpu_is_a_one_line_error(capsys):
    assert bench_engine.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no CUDA device" in err and "Traceback" not in err
