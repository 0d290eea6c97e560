"""A decode step's fixed costs removed (issue 31; ``native/model_runner.py``, ``models/llama.py``,
``attention.py``), each computing the same numbers as before: the fused layers read a plan gathered
once (no module is called inside a step), a step whose every row wants logits passes no row index,
decode-only steps attend without gathering and scattering rows, and cos/sin come from a table."""

from __future__ import annotations

import asyncio

import pytest
import torch

from interlace.engine_ext.native import cpu_attention, cpu_matmul
from interlace.engine_ext.native.attention import KernelAttention
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.native.models.llama import AttentionMetadata, LlamaForCausalLM, ModelConfig

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize as g_quantize  # noqa: E402

from interlace.engine_ext.native import quant as Q  # noqa: E402

PROMPT = [5, 17, 300, 42, 7, 99, 250, 3, 11, 64, 128, 77]


def _model(quantized: bool) -> LlamaForCausalLM:
    """A random 2-layer llama (GQA); ``quantized``: its projections Q4_0 as the GGUF loader holds them."""
    cfg = ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=1024, tie_word_embeddings=False, attention_bias=False, qk_norm=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    if quantized:
        for layer in model.layers:
            for parent, name in ((layer.attn, "qkv"), (layer.attn, "o"), (layer.mlp, "gate_up"), (layer.mlp, "down")):
                raw = g_quantize(getattr(parent, name).weight.detach().numpy(), gguf.GGMLQuantizationType.Q4_0)
                setattr(parent, name, Q.Int4Linear(Q.int4_groups(torch.from_numpy(raw), Q.Q4_0)))
        model.weights_format = "as-shipped"
    return model.eval()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERLACE_CACHE", str(tmp_path / "cache"))


def _needs_kernels():
    if cpu_matmul.load() is None or cpu_attention.load() is None:
        pytest.skip("no C++ compiler: no fused ops or attention kernel")


def test_fused_decode_steps_call_no_module_and_match_the_eager_layers():
    """The quantized float32 engine's steps run the fused loop over ``ModelRunner.fused_plan``: none of
    the layers' modules is called (their hooks never fire), and the logits are the eager layers' up to
    float32 rounding."""
    _needs_kernels()
    calls = []

    async def logits(eng):
        await eng.fill("a", PROMPT)
        out = [await eng.last_logits("a")]
        for t in (9, 77, 301):  # decode-shaped steps (one token after the prompt's KV)
            await eng.fill("a", [t])
            out.append(await eng.last_logits("a"))
        return torch.stack(out)

    model = _model(quantized=True)
    hooks = [m.register_forward_pre_hook(lambda mod, args: calls.append(type(mod).__name__))
             for m in model.layers.modules()]
    with NativeEngine(model, attention="auto", kv_cache_tokens=256) as eng:
        assert eng.runner.fused is not None
        fused = asyncio.run(logits(eng))
    assert calls == []
    assert eng.runner.fused_plan is not None
    for h in hooks:
        h.remove()
    with NativeEngine(_model(quantized=True), attention="auto", kv_cache_tokens=256) as eng:
        eng.runner.fused = eng.runner.fused_plan = None  # the eager layers on the same weights
        eager = asyncio.run(logits(eng))
    scale = eager.abs().max().item()
    torch.testing.assert_close(fused, eager, rtol=0, atol=1e-3 * scale)


@pytest.mark.parametrize("quantized", [False, True])
def test_no_logit_rows_means_every_row(quantized):
    """``logits_rows=None`` (what the model runner passes when every row wants logits, a decode-only step)
    gives what every row's index gives, bit for bit, fused and eager."""
    if quantized:
        _needs_kernels()
    from interlace.engine_ext.native.model_runner import ModelRunner

    model = _model(quantized)
    runner = ModelRunner(model, num_blocks=8, block_size=4, kv_dtype=torch.float32, device=torch.device("cpu"))
    assert (runner.fused is not None) == quantized
    T = 6
    ids, pos = torch.tensor(PROMPT[:T]), torch.arange(T)

    def run(rows):
        meta = AttentionMetadata(slot_mapping=torch.arange(T), attention=runner.attention,
                                 attention_args=runner.attention.step_args([(0, T, 0, [0, 1])], [], 4, 0, runner.device),
                                 fused=runner.fused)  # no plan: the model gathers one itself
        return model(ids, pos, runner.kv, meta, rows)

    every = run(None)
    assert every.shape == (T, 512)
    assert torch.equal(every, run(torch.arange(T)))


def test_rope_table_holds_the_computed_values():
    """cos/sin read from the model's table (grown as positions pass its end) are the values computed
    for the positions themselves, bit for bit, in the activation dtype."""
    model = _model(quantized=False)
    for positions, end in (([0, 1, 2, 3], 4), ([255], 256), ([256, 3, 700], 701), ([5000], 5001)):
        p = torch.tensor(positions)
        for dtype in (torch.float32, torch.bfloat16):
            got, want = model.rope(p, end, dtype), model.rope(p, 0, dtype)
            assert all(torch.equal(g, w) and g.dtype == dtype and g.is_contiguous() for g, w in zip(got, want))
    assert model._rope_table[0].shape[0] >= 5001


def test_decode_only_steps_attend_every_row_without_a_gather():
    """A step of decode rows only is marked ``decode_only``, and attending it directly gives what the
    general path (rows gathered from q, scattered into an output) gives; a step with a prefill is not."""
    kernel = cpu_attention.load()
    if kernel is None:
        pytest.skip("no C++ compiler: no attention kernel")
    att = KernelAttention(kernel)
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(2, 8, 4, 16, generator=g), torch.randn(2, 8, 4, 16, generator=g)
    decodes = [(0, 7, [0, 1]), (1, 3, [2]), (2, 12, [3, 4, 5])]
    args = att.step_args([], decodes, 4, 0, torch.device("cpu"))
    assert args.decode_only
    q = torch.randn(3, 4, 16, generator=g)
    direct = att.attend(q, kc, vc, args, 0.25)
    args.decode_only = False
    assert torch.equal(direct, att.attend(q, kc, vc, args, 0.25))
    assert not att.step_args([(0, 2, 0, [6])], [(2, 5, [0, 1])], 4, 0, torch.device("cpu")).decode_only
