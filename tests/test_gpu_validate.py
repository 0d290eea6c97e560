"""The prepared GPU run (``scripts/gpu_first_run.sh``, ``interlace.bench.gpu_validate``) rehearsed on the CPU.

The GPU runs are rare and short; these tests keep the script from rotting between them: the whole
dry run (every phase, the wheel install, the summary), and the parts that decide what a GPU run
reports -- a failed check is a FAIL, a phase that dies keeps its file and is a FAIL, one phase's
failure does not stop the next.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from interlace.bench import gpu_validate as gv

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_of_the_gpu_script_runs_every_phase_from_an_installed_wheel(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env.pop("PHASES", None)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_first_run.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=1200)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    # at most 8 files come back from a GPU machine: one per phase and the log, nothing else
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{p}.json" for p in gv.PHASES] + ["run.log"])
    for phase in gv.PHASES:
        data = json.loads((out / f"{phase}.json").read_text())
        assert data["finished"] and data["dry_run"], (phase, data.get("error"))
        assert data["checks"] and all(c["ok"] is not False for c in data["checks"]), (phase, data["checks"])
    pre = json.loads((out / "preflight.json").read_text())
    assert "/site/interlace" in pre["interlace_from"] and pre["pythonsafepath"] == "1"
    assert "0 FAIL" in log and "| bench8b | decode batch 1 of the bandwidth limit" in log
    assert not list(tmp_path.glob("interlace-gpu-run.*"))  # its scratch folder (wheel, site, caches) is gone


def test_a_failed_check_or_a_phase_that_died_is_a_fail_and_the_summary_says_so(tmp_path, capsys):
    ok = gv.Phase(tmp_path, "preflight", dry_run=False)
    ok.check("fine", True, 1)
    ok.record(finished=True)
    bad = gv.Phase(tmp_path, "ceilings", dry_run=False)
    bad.check("copy bandwidth", False, "0 GB/s")
    bad.record(finished=True)
    gv.Phase(tmp_path, "kernel_tests", dry_run=False)  # started, then killed by its timeout: no finished
    assert gv.summary(tmp_path, ["preflight", "ceilings", "kernel_tests", "correctness"]) == 1
    text = capsys.readouterr().out
    assert "| preflight | fine | 1 |  | PASS |" in text
    assert "| ceilings | copy bandwidth | 0 GB/s |  | FAIL |" in text
    assert "| kernel_tests | phase did not finish |" in text
    assert "| correctness | (phase wrote nothing) |" in text
    assert "1 PASS, 3 FAIL" in text
    assert gv.summary(tmp_path, ["preflight"]) == 0


def test_an_exception_in_one_part_is_a_fail_and_the_phase_goes_on(tmp_path):
    ph = gv.Phase(tmp_path, "correctness", dry_run=True)

    def boom():
        raise RuntimeError("no kernel image for this device")
    assert ph.attempt("decode", boom) is None
    ph.check("next part", True, "ran")
    data = json.loads((tmp_path / "correctness.json").read_text())  # on disk at once
    assert [(c["name"], c["ok"]) for c in data["checks"]] == [("decode", False), ("next part", True)]
    assert "no kernel image" in data["checks"][0]["value"] and "RuntimeError" in data["errors"]["decode"]


def test_the_correctness_phase_catches_a_wrong_kernel(tmp_path, monkeypatch):
    """A decode kernel off by a little (a wrong scale) fails its check against the float64 reference;
    the other kernels' checks still run and pass."""
    from interlace.engine_ext.native.kernels import paged_attention

    real = paged_attention.paged_decode_attention
    monkeypatch.setattr(paged_attention, "paged_decode_attention",
                        lambda q, k, v, bt, sl, scale, **kw: real(q, k, v, bt, sl, scale * 1.05, **kw))
    ph = gv.Phase(tmp_path, "correctness", dry_run=True)
    gv.kernel_correctness(ph, dry_run=True)
    got = {c["name"].split(" H=")[0]: c["ok"] for c in ph.data["checks"]}
    assert got["decode tiny"] is False
    assert got["prefill tiny"] and got["store_kv tiny"] and got["cascade tiny 3 forks"]


@pytest.mark.parametrize("name,cls", [("ampere_bf16_s16816gemm_bf16_128x64", "matmul"),
                                      ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "matmul"),
                                      ("_decode_kernel", "attention"), ("_add_rms_norm_kernel", "norm / rope / silu (fused)"),
                                      ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise / other"),
                                      ("Memcpy HtoD (Pinned -> Device)", "copy")])
def test_kernels_are_classed_by_name(name, cls):
    assert gv.classify(name) == cls


def test_a_kernel_test_run_killed_before_its_report_is_counted_from_its_progress():
    """The first GPU run's kernel tests hit their limit before pytest wrote its report: the phase
    said "0 passed" and lost what had run.  Now the progress characters are counted."""
    tail = "timed out after 90 s\nb'....................sF...FFFFF.F..F.............Fs'"
    assert gv.progress_counts(tail) == {"passed": 39, "failed": 9, "errors": 0, "skipped": 2}
    assert gv.progress_counts("..F.s                 [ 50%]\nE.                [100%]\nFAILED x::y\n") == \
        {"passed": 4, "failed": 1, "errors": 1, "skipped": 1}
