"""Quantized weights (engine_ext/native/quant.py): the int4/int8 matmuls against
their dequantized float references, GGUF loading of each supported type with
the Q/K permutation undone, a tiny Llama served ``weights: as-shipped``
against the dense model of the same dequantized weights, and the setting's
errors.

Tolerances.  A quantized matmul computes the same sum as ``x @ W_ref.T``
with ``W_ref`` the exactly dequantized weights, in float32 with another
accumulation order (blocked, FMA) and with aten recomputing each weight as
``(q - 8) * scale + zero`` (one or two float32 roundings of a value a GGUF
defines in fp16 arithmetic).  Each of the K products and partial sums is off
by at most a few float32 ulps, so the result is within
``c * K * eps32 * sum_k |x_k w_k|``; 1e-5 of ``sum_k |x_k w_k|`` (K <= 256
here: ~25x the bound for c = 1) leaves room for the order without hiding a
wrong mapping: a zero point off by ``8d`` (Q4_1) or a nibble misplaced moves
the result by a sizeable fraction of ``sum_k |x_k w_k|`` itself.
"""

import asyncio
import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as g_dequantize, quantize as g_quantize  # noqa: E402

from interlace.engine_ext.native import quant as Q  # noqa: E402
from interlace.engine_ext.native.engine import NativeEngine  # noqa: E402

RUNNABLE = [T.Q4_0, T.Q4_1, T.Q8_0]
TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2]


def run(coro):
    return asyncio.run(coro)


def quantized(w: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(g_quantize(w.astype(np.float32), qtype).copy())


def ref_matmul_bound(x: torch.Tensor, w: torch.Tensor, rel: float = 1e-5):
    """``x @ w.T`` in float64 and the tolerance ``rel * |x| @ |w|.T`` (see the module docstring)."""
    x64, w64 = x.double(), w.double()
    return x64 @ w64.T, rel * (x64.abs() @ w64.abs().T) + 1e-7


def assert_within(y: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor):
    err = (y.double() - ref).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} exceeds the tolerance (ratio {worst:.2f})"


# --------------------------------------------------------------------------- blocks and matmuls
@pytest.mark.parametrize("qtype", RUNNABLE, ids=lambda t: t.name)
def test_dequantize_rows_matches_gguf(qtype):
    w = np.random.default_rng(0).normal(0, 0.3, (24, 96)).astype(np.float32)
    raw = quantized(w, qtype)
    ours = Q.dequantize_rows(raw, int(qtype))
    np.testing.assert_array_equal(ours.numpy(), g_dequantize(raw.numpy(), qtype))


@pytest.mark.parametrize("qtype", RUNNABLE, ids=lambda t: t.name)
def test_int4_groups_reproduce_the_gguf_values(qtype):
    """aten's formula ``(q - 8) * scale + zero`` on the mapped groups gives the GGUF's values
    (Q4_1's zero ``m + 8d`` costs at most a float32 rounding)."""
    w = np.random.default_rng(1).normal(0.1, 0.3, (16, 128)).astype(np.float32)  # a mean: Q4_1's m matters
    raw = quantized(w, qtype)
    ref = torch.from_numpy(g_dequantize(raw.numpy(), qtype))
    g = Q.int4_groups(raw, int(qtype))
    assert g.doubled == (qtype == T.Q8_0)
    assert int(g.q.max()) <= 15 and int(g.q.min()) >= 0
    torch.testing.assert_close(g.dense(), ref, rtol=0, atol=2e-6 * ref.abs().max().item())
    if qtype != T.Q8_0:  # a 4-bit type in the doubled layout (sharing a module with Q8_0 parts)
        torch.testing.assert_close(Q.int4_groups(raw, int(qtype), doubled=True).dense(), ref, rtol=0,
                                   atol=2e-6 * ref.abs().max().item())


#: Per kernel, the tolerance in units of ``sum_k |x_k w_k|``: aten's int4 kernel computes the GGUF's values
#: exactly (float32 order only, see the module docstring); fp16 rounds each weight to fp16 first, a relative
#: error of at most 2^-11 per weight, so 2^-11 plus the float32 share.
#: ``gguf`` (engine_ext/native/cpu_matmul.py) rounds the activations per 32-group to int16 instead: its own
#: bound, ``tests/test_cpu_matmul.py``'s, on top of the float32 share.
KERNEL_TOL = {"aten": 1e-5, "fp16": 2 ** -11 + 1e-5, "gguf": 1e-5}
KERNELS = pytest.mark.parametrize("kernel", list(KERNEL_TOL))


def kernel_bound(kernel: str, x: torch.Tensor, w: torch.Tensor):
    ref, tol = ref_matmul_bound(x, w, KERNEL_TOL[kernel])
    if kernel == "gguf":
        step = x.double().abs().view(x.shape[0], -1, 32).amax(-1) / 32767 / 2
        tol = tol + step.repeat_interleave(32, dim=1) @ w.double().abs().T
    return ref, tol


@KERNELS
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("qtype", RUNNABLE, ids=lambda t: t.name)
def test_int4_linear_matches_dequantized_reference(qtype, rows, kernel):
    rng = np.random.default_rng(2)
    w = rng.normal(0.05, 0.3, (40, 256)).astype(np.float32)  # 40 rows: aten's padding to sixteens
    raw = quantized(w, qtype)
    ref_w = torch.from_numpy(g_dequantize(raw.numpy(), qtype))
    bias = torch.randn(40)
    lin = Q.Int4Linear(Q.int4_groups(raw, int(qtype)), bias, kernel=kernel)
    x = torch.randn(rows, 256)
    ref, tol = kernel_bound(kernel, x, ref_w)
    assert_within(lin(x), ref + bias.double(), tol)
    # bfloat16 activations: computed in float32 (exact scales), returned in bfloat16
    xb = x.bfloat16()
    yb = lin(xb)
    assert yb.dtype == torch.bfloat16 and yb.shape == (rows, 40)
    ref_b, tol_b = kernel_bound(kernel, xb.float(), ref_w)
    assert_within(yb.float(), ref_b + bias.double(), tol_b + 2 ** -8 * (ref_b + bias.double()).abs())
    assert lin(torch.zeros(0, 256)).shape == (0, 40)


def test_int4_kernel_choice(monkeypatch):
    monkeypatch.setenv("INTERLACE_INT4_KERNEL", "aten")
    assert Q.int4_kernel() == "aten"
    monkeypatch.setenv("INTERLACE_INT4_KERNEL", "avx9")
    with pytest.raises(ValueError, match="INTERLACE_INT4_KERNEL must be one of"):
        Q.int4_kernel()
    monkeypatch.delenv("INTERLACE_INT4_KERNEL")
    from interlace.engine_ext.native import cpu_matmul

    # aten's int4 kernel is never the default: 20x slower than float32 at one row even on AVX-512
    gguf, fp16 = cpu_matmul.load() is not None, Q._has_fbgemm()
    default = "gguf" if gguf else "fp16" if fp16 else "aten"
    assert Q.int4_kernel() == default
    monkeypatch.setenv("INTERLACE_INT4_KERNEL", "auto")  # the same as unset
    assert Q.int4_kernel() == default


@KERNELS
def test_fused_parts_stay_one_matmul(kernel, monkeypatch):
    """q/k/v of mixed types: Q4_0 + Q4_1 share the plain layout, a Q8_0 part puts all in the doubled one."""
    monkeypatch.setenv("INTERLACE_INT4_KERNEL", kernel)
    rng = np.random.default_rng(3)
    ws = [rng.normal(0, 0.3, (n, 64)).astype(np.float32) for n in (32, 16, 16)]
    x = torch.randn(3, 64)
    for types in ([T.Q4_0, T.Q4_1, T.Q4_1], [T.Q4_1, T.Q8_0, T.Q4_0]):
        parts = [Q.GGUFTensor(f"p{i}", int(t), w.shape, quantized(w, t)) for i, (w, t) in enumerate(zip(ws, types))]
        lin = Q._quantized_linear(parts, None)
        assert lin.kernel == kernel and lin.doubled == (T.Q8_0 in types) and lin.out_features == 64
        ref_w = torch.cat([p.dequantize() for p in parts])
        ref, tol = kernel_bound(kernel, x, ref_w)
        assert_within(lin(x), ref, tol)
    dense = Q.GGUFTensor("d", Q.F32, (16, 64), torch.randn(16, 64))
    assert Q._quantized_linear([parts[0], dense], None) is None  # a dense part: the module is dense


def test_int8_linear_is_per_channel_int8():
    torch.manual_seed(4)
    w = torch.randn(40, 96) * torch.linspace(0.1, 2, 40)[:, None]  # very different row ranges
    lin = Q.Int8Linear(w)
    assert lin.qweight.dtype == torch.int8 and lin.scales.shape == (40,)
    # the quantization itself: round to nearest on each row's scale
    assert ((lin.dense() - w).abs() <= lin.scales[:, None] / 2 + 1e-6).all()
    x = torch.randn(7, 96)
    ref, tol = ref_matmul_bound(x, lin.dense())
    assert_within(lin(x), ref, tol)
    assert "out_features=40, per-channel int8" in repr(lin)  # printed models say how each linear is stored


def test_unpermute_matches_transformers_and_inverts_llama_cpp():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    theirs = LlamaTensorProcessor()._reverse_permute_weights(w, 8, 2)
    np.testing.assert_array_equal(Q.unpermute_rows(torch.from_numpy(w), 2).numpy(), theirs)
    t = torch.randn(64, 5)
    assert torch.equal(Q.unpermute_rows(Q.permute_rows(t, 4), 4), t)
    assert not torch.equal(Q.permute_rows(t, 4), t)


# --------------------------------------------------------------------------- GGUF files
#: Per GGUF tensor suffix and layer: its type in the test file, covering every runnable type, a fused
#: module mixing 4-bit types, one mixing in Q8_0 (doubled), types without an int4 mapping (Q5_0) and dense ones.
TYPES = {0: {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q4_1,
             "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0},
         1: {"attn_q": T.Q4_1, "attn_k": T.Q4_1, "attn_v": T.Q4_0, "attn_output": T.BF16,
             "ffn_gate": T.Q5_0, "ffn_up": T.Q4_1, "ffn_down": T.F16}}
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def write_gguf(path, hf_dir, embed_type=T.Q4_1, head_type=T.Q8_0):
    """The tiny HF Llama in ``hf_dir`` as a llama.cpp-style GGUF (Q/K rows permuted as llama.cpp's
    converter does), tensor types from :data:`TYPES`.  Returns the expected dequantized tensors by HF name."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    expected = {}

    def add(name, hf, qtype, permute_heads=None):
        t = sd[hf].float()
        arr = (Q.permute_rows(t, permute_heads) if permute_heads else t).numpy()
        if qtype == T.F32:
            w.add_tensor(name, arr)
            expected[hf] = t
            return
        if qtype == T.F16:
            w.add_tensor(name, arr.astype(np.float16))
            expected[hf] = t.half().float()
            return
        raw = g_quantize(arr, qtype)
        w.add_tensor(name, raw, raw_dtype=qtype)
        back = torch.from_numpy(g_dequantize(raw, qtype).reshape(arr.shape))
        expected[hf] = Q.unpermute_rows(back, permute_heads) if permute_heads else back

    add("token_embd.weight", "model.embed_tokens.weight", embed_type)
    add("output_norm.weight", "model.norm.weight", T.F32)
    add("output.weight", "lm_head.weight", head_type)
    for i in range(cfg["num_hidden_layers"]):
        for short, hf in HF.items():
            qtype = TYPES[i].get(short, T.F32)
            perm = heads if short == "attn_q" else kv if short == "attn_k" else None
            add(f"blk.{i}.{short}.weight", f"model.layers.{i}.{hf}.weight", qtype, perm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg, expected


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from helpers.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("qgguf")
    make_tiny_model("llama", root / "hf", seed=5)
    cfg, expected = write_gguf(root / "tiny.gguf", root / "hf")
    return root / "tiny.gguf", cfg, expected


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERLACE_CACHE", str(tmp_path / "cache"))


def test_gguf_tensors_load_quantized_with_qk_unpermuted(tiny_gguf, caplog):
    path, cfg, expected = tiny_gguf
    with caplog.at_level("WARNING"):
        arch, tensors = Q.read_gguf_tensors(path, cfg)
    assert arch == "llama" and set(tensors) == set(expected)
    for name, t in tensors.items():
        # bit for bit what gguf dequantizes, in Hugging Face row order: the permutation round trip is exact
        torch.testing.assert_close(t.dequantize(), expected[name], rtol=0, atol=0, msg=name)
    q0 = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q0.quantized and q0.data.dtype == torch.uint8 and q0.data.shape == (64, 64 // 32 * 18)
    assert tensors["model.layers.1.mlp.gate_proj.weight"].type == int(T.Q5_0)  # dequantized, type kept
    assert not tensors["model.layers.1.mlp.gate_proj.weight"].quantized
    assert "Q5_0" in caplog.text and "dequantized" in caplog.text  # the one log line naming the type


def test_as_shipped_model_modules(tiny_gguf):
    path, cfg, _ = tiny_gguf
    model = Q.model_from_gguf(path, json.loads((Q.gguf_meta_dir(path) / "config.json").read_text()))
    l0, l1 = model.layers
    assert isinstance(l0.attn.qkv, Q.Int4Linear) and l0.attn.qkv.doubled          # Q4_0 + Q4_1 + Q8_0
    assert isinstance(l0.mlp.gate_up, Q.Int4Linear) and not l0.mlp.gate_up.doubled  # Q4_0 + Q4_1
    assert isinstance(l1.attn.qkv, Q.Int4Linear) and not l1.attn.qkv.doubled
    assert isinstance(l1.mlp.gate_up, torch.nn.Linear)   # a Q5_0 part: dense
    assert isinstance(l1.mlp.down, torch.nn.Linear) and isinstance(l1.attn.o, torch.nn.Linear)
    assert isinstance(model.embed, Q.QuantEmbedding) and isinstance(model.lm_head, Q.Int4Linear)
    assert model.lm_head.doubled


def _dense_reference(cfg, expected):
    from interlace.engine_ext.native.loader import model_from_tensors

    return model_from_tensors(cfg, expected)


async def _logits(eng, steps=4):
    await eng.fill("a", TOKENS)
    out = [await eng.last_logits("a")]
    for t in (9, 77, 301, 4)[:steps]:  # decode steps: the KV written by the quantized projections is read back
        await eng.fill("a", [t])
        out.append(await eng.last_logits("a"))
    await eng.fill("b", TOKENS[:5])  # a second context in the same engine
    out.append(await eng.last_logits("b"))
    return torch.stack(out)


@KERNELS
def test_as_shipped_logits_match_dense_model_of_same_weights(tiny_gguf, kernel, monkeypatch):
    """Tolerance: 2e-4 of the largest logit through two layers with aten's exact kernel; the fp16
    kernel's weight rounding (<= 2^-11 relative) adds ~1e-3."""
    monkeypatch.setenv("INTERLACE_INT4_KERNEL", kernel)
    path, _, expected = tiny_gguf
    with NativeEngine.load(path, weights="as-shipped", block_size=4, kv_cache_tokens=256) as eng:
        assert isinstance(eng.model.layers[0].attn.qkv, Q.Int4Linear)
        assert eng.model.layers[0].attn.qkv.kernel == kernel
        got = run(_logits(eng))
        cfg = json.loads((Q.gguf_meta_dir(path) / "config.json").read_text())
    with NativeEngine(_dense_reference(cfg, expected), block_size=4, kv_cache_tokens=256) as ref_eng:
        ref = run(_logits(ref_eng))
    scale = ref.abs().max().item()
    assert scale > 1  # logits far from uniform: a wrong weight would show
    # gguf rounds each matmul's activations to int16 per 32-group (1/32767 of the group's largest):
    # below the fp16 kernel's weight rounding
    atol = {"aten": 2e-4, "fp16": 2e-3, "gguf": 2e-3}[kernel] * scale
    torch.testing.assert_close(got, ref, rtol=0, atol=atol)
    # and transformers' own GGUF loader (its dequantization and un-permutation) agrees on the prefill
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_last = hf(torch.tensor([TOKENS])).logits[0, -1]
    torch.testing.assert_close(got[0], hf_last, rtol=0, atol=atol)


@pytest.mark.parametrize("kernel", ["gguf", "fp16"])
def test_fused_decode_ops_compute_what_the_eager_layers_do(tiny_gguf, kernel, monkeypatch):
    """Quantized float32 engines run each layer's residual adds, norms, rotary embedding, cache
    write and SiLU as fused ops (engine_ext/native/cpu_matmul.py); the same engine with them off
    runs the eager torch layers on the same weights: only float32 rounding apart."""
    from interlace.engine_ext.native import cpu_matmul

    if cpu_matmul.load() is None:
        pytest.skip("no C++ compiler: no fused ops (the eager layers run)")
    monkeypatch.setenv("INTERLACE_INT4_KERNEL", kernel)
    path, _, _ = tiny_gguf
    with NativeEngine.load(path, weights="as-shipped", block_size=4, kv_cache_tokens=256) as eng:
        assert eng.runner.fused is not None
        fused = run(_logits(eng))
    # a fresh engine (the same prompts in the first one would hit its prefix cache)
    with NativeEngine.load(path, weights="as-shipped", block_size=4, kv_cache_tokens=256) as eng:
        eng.runner.fused = None
        eager = run(_logits(eng))
    scale = eager.abs().max().item()
    assert scale > 1
    # float32 rounding apart, which can flip a gguf activation's int16 rounding (one step is 1/32767 of its
    # group's largest value): 1e-3 of the largest logit; a wrong fused op moves them by its own size
    torch.testing.assert_close(fused, eager, rtol=0, atol=1e-3 * scale)
    with NativeEngine.load(path, weights="as-shipped", dtype="bfloat16", block_size=4, kv_cache_tokens=256) as eb:
        assert eb.runner.fused is None  # float32 only: bfloat16 compute keeps the eager layers


def test_as_shipped_bfloat16_compute_tracks_float32(tiny_gguf, monkeypatch):
    # the fp16 kernel: exact activations, so the difference is bfloat16 compute's alone
    monkeypatch.setenv("INTERLACE_INT4_KERNEL", "fp16")
    path, _, _ = tiny_gguf
    with NativeEngine.load(path, weights="as-shipped", dtype="float32", block_size=4, kv_cache_tokens=256) as e32:
        ref = run(_logits(e32, steps=2))
    with NativeEngine.load(path, weights="as-shipped", dtype="bfloat16", block_size=4, kv_cache_tokens=256) as eb:
        assert eb.model.norm.weight.dtype == torch.bfloat16 and eb.runner.kv.dtype == torch.bfloat16
        got = run(_logits(eb, steps=2))
    assert (got - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


def test_int8_weights_match_dense_model_of_their_values(tiny_dirs):
    """``weights: int8`` against the dense model whose projections hold the int8 values times their
    scales (the float embedding kept, also under a tied head), and against the float model."""
    from interlace.engine_ext.native.loader import load_model

    d, _ = tiny_dirs["qwen2"]  # tied embeddings and q/k/v biases
    with NativeEngine.load(d, weights="int8", block_size=4, kv_cache_tokens=256) as eng:
        assert isinstance(eng.model.lm_head, Q.Int8Linear) and isinstance(eng.model.embed, torch.nn.Embedding)
        assert isinstance(eng.model.layers[0].attn.qkv, Q.Int8Linear)
        assert eng.model.layers[0].attn.qkv.bias is not None
        got = run(_logits(eng))
    dense = load_model(d)
    with torch.no_grad():
        for mod in Q.linear_modules(dense):
            mod.weight = torch.nn.Parameter(Q.Int8Linear(mod.weight).dense())  # unties the head
    with NativeEngine(dense, block_size=4, kv_cache_tokens=256) as ref_eng:
        ref = run(_logits(ref_eng))
    scale = ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-4 * scale)
    with NativeEngine.load(d, block_size=4, kv_cache_tokens=256) as f_eng:
        float_ref = run(_logits(f_eng))
    err = (got - float_ref).abs().max().item()
    assert 1e-3 * scale < err <= 0.1 * scale  # quantized (not the float model), and near it


def test_default_weights_stay_dense_float32(tiny_dirs):
    d, _ = tiny_dirs["llama"]
    with NativeEngine.load(d, block_size=4, kv_cache_tokens=64) as eng:
        assert type(eng.model.layers[0].attn.qkv) is torch.nn.Linear
        assert eng.model.layers[0].attn.qkv.weight.dtype == torch.float32
        assert getattr(eng.model, "weights_format", None) is None
    with NativeEngine.load(d, weights="bfloat16", dtype="auto", block_size=4, kv_cache_tokens=64) as eng:
        assert eng.model.layers[0].attn.qkv.weight.dtype == torch.bfloat16


# --------------------------------------------------------------------------- the setting and its errors
def test_bad_weights_values_are_clear_errors(tiny_dirs, tiny_gguf):
    d, _ = tiny_dirs["llama"]
    with pytest.raises(ValueError, match=r"weights must be one of .*'int4'"):
        NativeEngine.load(d, weights="int4")
    with pytest.raises(ValueError, match="is not a .gguf file.*weights: int8"):
        NativeEngine.load(d, weights="as-shipped")
    with pytest.raises(ValueError, match="weights: bfloat16 with dtype: float32"):
        NativeEngine.load(d, weights="bfloat16", dtype="float32")
    with pytest.raises(ValueError, match="CPU only"):  # (as-shipped loads dequantized off the CPU: below)
        NativeEngine.load(d, weights="int8", device="meta")
    from interlace.engine_ext.native.setup import build_native_engine, load_zoo_engine

    with pytest.raises(ValueError, match="not supported for zoo variants"):
        load_zoo_engine(["anything"], "/nonexistent", weights="as-shipped")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        build_native_engine(str(d), {"weights": "as-shipped"})


def test_config_accepts_weights_and_rejects_unknown_values():
    from interlace.gateway.config import ConfigError, parse_config

    cfg = parse_config({"models": {"m": {"path": "embedded", "weights": "as-shipped"}}})
    assert cfg.models["m"].engine_args["weights"] == "as-shipped"
    assert cfg.models["m"].replicas[0]["weights"] == "as-shipped"
    assert "weights" not in parse_config({"models": {"m": {"path": "embedded"}}}).models["m"].engine_args
    with pytest.raises(ConfigError, match=r"models\.m\.weights: 'q4' is not one of"):
        parse_config({"models": {"m": {"path": "embedded", "weights": "q4"}}})
    from interlace.engine_ext.native.options import LOAD_KEYS

    assert "weights" in LOAD_KEYS  # reaches NativeEngine.load


def test_cli_generate_takes_weights():
    from interlace.cli import build_parser

    assert build_parser().parse_args(["generate", "hi", "--weights", "as-shipped"]).weights == "as-shipped"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--weights", "q4"])


def test_auto_dtype_with_quantized_weights_computes_in_float32(monkeypatch):
    """Quantized matmuls take float32 activations whatever the dtype: ``auto`` stays float32 for
    them even where it would pick bfloat16 for dense weights (a CPU with native bfloat16)."""
    from interlace.engine_ext.native import loader as E

    monkeypatch.setattr(E, "cpu_has_native_bf16", lambda: True)
    cpu = torch.device("cpu")
    assert E.resolve_weights(None, "auto", cpu) == torch.bfloat16  # dense: bfloat16 where it is native
    for w in ("as-shipped", "int8"):
        assert E.resolve_weights(w, "auto", cpu) == torch.float32
        assert E.resolve_weights(w, None, cpu) == torch.float32
        assert E.resolve_weights(w, "bfloat16", cpu) == torch.bfloat16  # asked for explicitly


def test_on_a_gpu_the_default_is_bfloat16_and_as_shipped_loads_dequantized(monkeypatch, tmp_path):
    """Issue 36: float32 on a GPU halves a decode step's usable bandwidth (and the Triton prefill
    kernels spill), so a GPU's default compute dtype is bfloat16; the shipped config's ``weights:
    as-shipped`` (CPU matmul kernels) loads the GGUF dequantized there instead of refusing to start;
    ``int8`` is refused with one line.  (Device objects only: no CUDA needed.)"""
    from interlace.engine_ext.native import loader as E

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert E.resolve_weights(None, None, gpu) == torch.bfloat16
    assert E.resolve_weights(None, None, cpu) == torch.float32  # the CPU keeps the reference numerics
    assert E.resolve_weights(None, "float32", gpu) == torch.float32  # asked for explicitly
    assert E.resolve_weights("as-shipped", None, gpu) == torch.bfloat16
    with pytest.raises(ValueError, match="weights: int8 runs on the CPU only"):
        E.resolve_weights("int8", None, gpu)

    loaded = {}

    class Probe(NativeEngine):  # the load path without starting an engine
        def __init__(self, model, tok=None, **kw):
            self.model, self.kw = model, kw

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(E, "resolve_model_dir", lambda p: loaded.setdefault("dequantized_from", p) and tmp_path)
    monkeypatch.setattr(E, "load_config", lambda d: ({}, None))
    monkeypatch.setattr(E, "load_model", lambda d, dtype, dev: loaded.setdefault("dense", (dtype, dev)))
    eng = Probe.load(gguf, weights="as-shipped", device="cuda")
    assert loaded["dequantized_from"] == gguf and loaded["dense"] == (torch.bfloat16, gpu)
    assert eng.model == (torch.bfloat16, gpu)
