"""The AMX path of quantized matmuls (engine_ext/native/amx.py, quant.Int4Linear): which CPUs
take it and for how many rows, its numerics (forced with ``INTERLACE_AMX=on``, so they are
checked on any CPU: bfloat16 matmuls run everywhere, emulated where there is no AMX), and on a
CPU with AMX the embedded model's greedy tokens and logits against the GGUF kernel's.

Tolerances.  The path rounds the activations and the weights to bfloat16 (8 significant
bits: at most 2^-9 relative each, half a unit in the last place) and returns oneDNN's
bfloat16 output (another 2^-9 of the result), accumulating in float32.  Against the float64
product of the same bfloat16 operands the error is then within ``2^-8 |y| + 1e-5 sum|x w|``
(the output's rounding, with room for the accumulation); against the GGUF kernel (float32
weights, int16 activations) within ``2^-7 sum|x w| + 2^-8 |y|`` (both operands' roundings).
A wrong weight mapping (a zero point off by 8d, a misplaced nibble) moves a result by a
sizeable fraction of ``sum|x w|`` and is caught by the weights' own check below (within
bfloat16's rounding of the GGUF's exact values).
"""

import asyncio

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as g_dequantize, quantize as g_quantize  # noqa: E402

from interlace.engine_ext.native import amx as A  # noqa: E402
from interlace.engine_ext.native import cpu_matmul  # noqa: E402
from interlace.engine_ext.native import quant as Q  # noqa: E402

AMX_FLAGS = ["fpu", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
AVX2_FLAGS = ["fpu", "avx", "avx2", "fma", "f16c"]
#: the kernel that runs below the AMX path's rows (the gguf one where a compiler builds it)
KERNEL = "gguf" if cpu_matmul.load() is not None else "fp16"


# --------------------------------------------------------------------------- selection
def test_amx_cpu_takes_the_bf16_path_from_min_rows():
    p = A.amx_path(flags=AMX_FLAGS, detector=True, onednn=True, env="auto")
    assert p.enabled and "AMX on this CPU" in p.reason
    assert p.min_rows == A.AMX_MIN_ROWS == 8
    assert [p.takes(r) for r in (1, 7, 8, 32)] == [False, False, True, True]  # batch-1 decode stays on gguf
    assert "bf16 (oneDNN) for >= 8 rows" in p.describe()


@pytest.mark.parametrize("flags, detector, onednn, why", [
    (AVX2_FLAGS, None, True, "no amx_tile amx_bf16 avx512_bf16"),
    (AVX2_FLAGS, True, True, "no amx_tile amx_bf16 avx512_bf16"),        # the flags must say so too
    ([f for f in AMX_FLAGS if f != "avx512_bf16"], True, True, "no avx512_bf16"),
    (AMX_FLAGS, False, True, "torch's detector says no"),
    (AMX_FLAGS, True, False, "oneDNN is not built into this torch"),
])
def test_without_amx_the_gguf_kernel_runs_every_size(flags, detector, onednn, why):
    p = A.amx_path(flags=flags, detector=detector, onednn=onednn, env="auto")
    assert not p.enabled and why in p.reason
    assert not any(p.takes(r) for r in (1, 8, 512))
    assert p.describe().startswith("off: ")


def test_a_torch_without_a_detector_relies_on_the_flags():
    assert A.amx_path(flags=AMX_FLAGS, detector=None, onednn=True, env="auto").enabled


def test_env_forces_the_path_on_or_off(monkeypatch):
    off = A.amx_path(flags=AMX_FLAGS, detector=True, onednn=True, env="off")
    assert not off.enabled and "INTERLACE_AMX=off" in off.reason
    on = A.amx_path(flags=AVX2_FLAGS, detector=False, onednn=True, env="on")
    assert on.enabled and "forced by INTERLACE_AMX=on" in on.reason and "emulated" in on.reason
    monkeypatch.setenv("INTERLACE_AMX", "OFF")  # read from the environment, any case
    assert not A.amx_path(flags=AMX_FLAGS, detector=True, onednn=True).enabled
    monkeypatch.setenv("INTERLACE_AMX", "")     # empty: auto
    assert A.amx_path(flags=AMX_FLAGS, detector=True, onednn=True).enabled


@pytest.mark.parametrize("value", ["yes", "1", "amx"])
def test_an_unknown_env_value_is_a_quant_error(value, monkeypatch):
    monkeypatch.setenv("INTERLACE_AMX", value)
    with pytest.raises(Q.QuantError, match=r"INTERLACE_AMX must be one of \['auto', 'on', 'off'\]"):
        A.amx_path()
    with pytest.raises(Q.QuantError, match="INTERLACE_AMX"):  # a module is never built with a bad value
        Q.Int4Linear(_groups(np.zeros((16, 64), np.float32), T.Q4_0)[0])


def test_this_machine_is_described():
    """The real machine's answer, whatever it is, with its reason (the start-up log line)."""
    has, why = A.cpu_has_amx()
    p = A.amx_path(env="auto")
    assert p.enabled == has and p.reason == why and why


# --------------------------------------------------------------------------- the module
def _groups(w: np.ndarray, qtype):
    raw = torch.from_numpy(g_quantize(w.astype(np.float32), qtype).copy())
    return Q.int4_groups(raw, int(qtype)), torch.from_numpy(g_dequantize(raw.numpy(), qtype))


def test_int4_linear_reads_the_setting(monkeypatch):
    g, _ = _groups(np.random.default_rng(0).normal(0, 0.3, (16, 64)), T.Q4_1)
    monkeypatch.setenv("INTERLACE_AMX", "on")
    on = Q.Int4Linear(g, kernel=KERNEL)
    assert on._bf16 is not None and on._bf16.dtype == torch.bfloat16 and on._bf16.shape == (16, 64)
    assert "amx=bf16 (oneDNN) for >= 8 rows: forced by INTERLACE_AMX=on" in repr(on)
    monkeypatch.setenv("INTERLACE_AMX", "off")
    off = Q.Int4Linear(g, kernel=KERNEL)
    assert off._bf16 is None and "amx=off: INTERLACE_AMX=off" in repr(off)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_bf16_path_numerics(qtype, monkeypatch):
    monkeypatch.setenv("INTERLACE_AMX", "on")
    rng = np.random.default_rng(1)
    g, ref_w = _groups(rng.normal(0.05, 0.3, (40, 256)), qtype)
    bias = torch.randn(40)
    lin = Q.Int4Linear(g, bias, kernel=KERNEL)
    gguf_only = Q.Int4Linear(g, bias, kernel=KERNEL, amx=A.amx_path(env="off"))
    # the bfloat16 weights: the GGUF's exact values (a Q8_0 module's doubled layout summed), rounded once
    torch.testing.assert_close(lin._bf16.float(), ref_w, rtol=2 ** -8, atol=1e-12)
    x = torch.randn(A.AMX_MIN_ROWS + 5, 256)
    y = lin(x)
    xb, wb = x.bfloat16().double(), lin._bf16.double()
    prod = xb @ wb.T  # the bias is added in float32 after the bfloat16 output's rounding
    mag = xb.abs() @ wb.abs().T
    err = (y.double() - (prod + bias.double())).abs()
    assert (err <= 2 ** -8 * prod.abs() + 1e-5 * mag + 1e-6).all(), f"worst {err.max().item():.3g}"
    # and the GGUF kernel's result, within both operands' bfloat16 rounding
    y_gguf = gguf_only(x)
    mag_exact = x.double().abs() @ ref_w.double().abs().T
    assert ((y.double() - y_gguf.double()).abs() <= 2 ** -7 * mag_exact + 2 ** -8 * y_gguf.double().abs()).all()
    assert not torch.equal(y, y_gguf)  # it did take the bf16 path
    # fewer rows than AMX_MIN_ROWS: the GGUF kernel itself, bit for bit (batch-1 decode)
    small = x[: A.AMX_MIN_ROWS - 1]
    assert torch.equal(lin(small), gguf_only(small))
    # bfloat16 activations in, bfloat16 out; no rows
    yb = lin(x.bfloat16())
    assert yb.dtype == torch.bfloat16 and yb.shape == (x.shape[0], 40)
    assert lin(torch.zeros(0, 256)).shape == (0, 40)


def test_weight_bytes_count_the_bf16_copy(monkeypatch):
    g, _ = _groups(np.random.default_rng(2).normal(0, 0.3, (32, 128)), T.Q4_0)
    off = Q.Int4Linear(g, kernel=KERNEL, amx=A.amx_path(env="off"))
    on = Q.Int4Linear(g, kernel=KERNEL, amx=A.amx_path(env="on"))
    assert Q.weight_bytes(on) - Q.weight_bytes(off) == 2 * 32 * 128


# --------------------------------------------------------------------------- on a CPU with AMX
#: the first step's logits may differ from the GGUF kernel's by this fraction of their largest
#: value: twice the worst measured over 20 chat prompts with the path forced on (1.4%,
#: docs/quantization.md "AMX path"): bfloat16 activations, weights and outputs in every matmul
LOGITS_TOL = 0.03
PROMPTS = 8  # = AMX_MIN_ROWS decoded together, so the decode steps take the path too
NEW = 16


@pytest.fixture(scope="module")
def amx_cpu():
    has, why = A.cpu_has_amx()
    if not has:
        pytest.skip(f"{why}: oneDNN's AMX kernels run only on such a CPU (the path's numerics are checked "
                    f"above with INTERLACE_AMX=on)")


async def _logits_after(eng, ids):
    await eng.fill("probe", ids)
    out = await eng.last_logits("probe")
    await eng.free_context("probe")
    return out


def _run(mode: str, prompts_text, monkeypatch, probes=()):
    """Greedy runs of the embedded model with ``INTERLACE_AMX=mode``: (first logits, tokens) per
    prompt, and the logits after each token list of ``probes``."""
    from interlace.bench.quant_quality import greedy
    from interlace.engine_ext.embedded import embedded_gguf
    from interlace.engine_ext.native.engine import NativeEngine

    monkeypatch.setenv("INTERLACE_AMX", mode)
    with NativeEngine.load(embedded_gguf(), weights="as-shipped", dtype="float32", kv_cache_tokens=4096) as eng:
        assert eng.model.lm_head.amx.enabled == (mode != "off")
        prompts = [eng.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts_text]
        runs = asyncio.run(greedy(eng, prompts, NEW))
        probed = [asyncio.run(_logits_after(eng, ids)) for ids in probes]
    return prompts, runs, probed


def compare_with_gguf_kernel(mode: str, monkeypatch):
    """The AMX path (``mode``) against the GGUF kernel on the embedded model: the first step's logits
    within LOGITS_TOL, and greedy tokens equal up to the first position where the GGUF kernel's
    own choice is a near tie (its top token and the path's within twice LOGITS_TOL): bfloat16
    rounding can flip a near tie, a wrong matmul would diverge where the choice is clear."""
    from interlace.bench.quant_quality import PROMPTS as TEXTS

    texts = TEXTS[:PROMPTS]
    prompts, ref, _ = _run("off", texts, monkeypatch)
    _, got, _ = _run(mode, texts, monkeypatch)
    for (l_ref, _), (l_got, _) in zip(ref, got):
        scale = l_ref.abs().max().item()
        assert (l_got - l_ref).abs().max().item() <= LOGITS_TOL * scale
    diverged = [(i, next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), None))
                for i, ((_, r), (_, g)) in enumerate(zip(ref, got))]
    diverged = [(i, j) for i, j in diverged if j is not None]
    probes = [prompts[i] + ref[i][1][:j] for i, j in diverged]
    _, _, probe_ref = _run("off", [], monkeypatch, probes)
    for (i, j), lg in zip(diverged, probe_ref):
        mine, theirs = ref[i][1][j], got[i][1][j]
        margin = (lg[mine] - lg[theirs]).item()
        assert 0 <= margin <= 2 * LOGITS_TOL * lg.abs().max().item(), (
            f"prompt {i} diverged at token {j} where the GGUF kernel's choice is clear (margin {margin:.3f})")
    return diverged


def test_embedded_model_on_amx_matches_the_gguf_kernel(amx_cpu, monkeypatch):
    compare_with_gguf_kernel("auto", monkeypatch)
