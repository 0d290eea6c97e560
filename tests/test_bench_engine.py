"""``interlace bench engine`` runs end to end (tiny settings): every variant
in its own subprocess, the table, the JSON and the plot.  A smoke test; the
numbers themselves are recorded in docs/benchmarks.md, not asserted.  Also
the machine description every benchmark records (CPU model and ISA flags)."""

import json
import os

from interlace.engine_ext.machine import cpu_description, describe_cpu
from interlace.bench import engine as bench_engine

ZEN2_LSCPU = {"Model name": "AMD EPYC", "Vendor ID": "AuthenticAMD", "CPU family": "23", "Model": "49",
              "CPU(s)": "2", "Thread(s) per core": "1", "Hypervisor vendor": "KVM",
              "Flags": "fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c hypervisor avx2 bmi2 sha_ni"}
SPR_CPUINFO = {"model name": "Intel(R) Xeon(R) Platinum 8480+", "vendor_id": "GenuineIntel", "cpu family": "6",
               "model": "143", "flags": "sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 "
                                        "avx512_fp16 amx_bf16 amx_tile amx_int8"}


def test_cpu_description_records_present_and_absent_isa_flags():
    cpu = cpu_description(lscpu=ZEN2_LSCPU)
    assert cpu["model_name"] == "AMD EPYC" and (cpu["family"], cpu["model"]) == ("23", "49")
    assert cpu["cpus"] == 2 and cpu["hypervisor"] == "KVM" and cpu["source"] == "lscpu"
    assert cpu["isa"] == ["sse4_2", "avx", "avx2", "fma", "f16c"]
    assert {"avx512f", "avx512_bf16", "amx_bf16"} <= set(cpu["isa_absent"])
    line = describe_cpu(cpu)
    assert line.startswith("AMD EPYC (family 23 model 49), 2 CPUs, KVM guest; ISA sse4_2 avx avx2 fma f16c; no ")
    assert "avx512_bf16" in line.split("; no ")[1]


def test_cpu_description_from_proc_cpuinfo_when_lscpu_is_missing():
    cpu = cpu_description(lscpu={}, cpuinfo=SPR_CPUINFO)
    assert cpu["source"] == "/proc/cpuinfo" and cpu["model_name"].startswith("Intel(R) Xeon(R) Platinum")
    assert {"avx512f", "avx512_bf16", "amx_bf16", "amx_int8"} <= set(cpu["isa"]) and cpu["isa_absent"] == []
    assert "; no " not in describe_cpu(cpu)


def test_cpu_description_without_flags_says_so():
    cpu = cpu_description(lscpu={}, cpuinfo={})
    assert cpu["isa"] == [] and cpu["isa_absent"] == []
    assert describe_cpu(cpu).endswith("ISA flags unknown")


def test_bench_engine_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    png = tmp_path / "p.png"
    assert bench_engine.main(["--variants", "interlace float32", "transformers float32", "--batches", "1", "2",
                              "--prompt-lens", "6", "12", "--long", "40", "--new", "4", "--repeat", "1",
                              "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "| interlace float32 |" in text and "| transformers float32 |" in text
    res = json.loads(out.read_text())
    for variant in ("interlace float32", "transformers float32"):
        cells = res["best"][variant]
        assert set(cells) == {"1", "2", "long"} and all(c["decode"] > 0 and c["prefill"] > 0 for c in cells.values())
    assert "| b=1 | b=2 | b=1, 40-token prompt |" in text
    assert "interlace float32 " in text.split("over each peer's best")[1]  # the ratio lines
    # the machine is recorded with its ISA flags, and printed with the table
    mach = res["machine"]
    assert mach["cpu"]["model_name"] and (mach["cpu"]["isa"] or mach["cpu"]["isa_absent"])
    assert mach["torch"] and mach["torch_threads"] >= 1 and mach["torch_cpu_capability"]
    assert "machine: " + describe_cpu(mach["cpu"]) in text
    assert png.stat().st_size > 1000


def test_isa_class_names_the_matmul_isa():
    assert bench_engine.isa_class({"isa": cpu_description(lscpu=ZEN2_LSCPU)["isa"]}) == "AVX2"
    assert bench_engine.isa_class({"isa": cpu_description(lscpu={}, cpuinfo=SPR_CPUINFO)["isa"]}) == "AMX"
    assert bench_engine.isa_class({"isa": ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"]}) == "AVX-512 (VNNI, BF16)"
    assert bench_engine.isa_class({"isa": []}) == "other"
    assert bench_engine.isa_class(bench_engine.machine()) == bench_engine.isa_class(cpu_description())  # nested


def test_bench_engine_with_busy_neighbours(tmp_path, capsys):
    """--neighbour 0 1: a quiet row and a +1 row per variant, in one run, with the neighbour's own ratios;
    the neighbour processes are gone afterwards."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "r.json"
    assert bench_engine.main(["--variants", "interlace float32/fixed", "--batches", "1",
                              "--prompt-lens", "6", "12", "--long", "0", "--new", "4", "--repeat", "1",
                              "--neighbour", "0", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for row in ("interlace float32/fixed", "interlace float32/fixed +1"):
        assert f"| {row} |" in text
    assert "ISA class: " in text and "beside 1 busy neighbour(s) over the same variant's quiet speed" in text
    res = json.loads(out.read_text())
    assert res["neighbours"] == [0, 1] and res["isa_class"] == bench_engine.isa_class(cpu_description())
    assert res["best"]["interlace float32/fixed +1"]["1"]["decode"] > 0
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert bench_engine.engine_weights("as-shipped/torch/fixed") == {"attention": "torch", "adapt_threads": False,
                                                                     "weights": "as-shipped"}
    assert bench_engine.engine_weights("as-shipped/passive/spin=100") == {"attention": "auto",
                                                                          "weights": "as-shipped"}
    env = bench_engine.worker_env("interlace as-shipped/spin=100")
    assert env["GOMP_SPINCOUNT"] == "100" and bench_engine.worker_env("vllm float32") == dict(os.environ)
    assert bench_engine.worker_env("interlace float32/passive")["OMP_WAIT_POLICY"] == "PASSIVE"
