"""The fused Triton ops of engine_ext/native/kernels/fused.py (RMSNorm, residual add + RMSNorm,
SiLU * up, rotary embedding + KV store) against plain PyTorch, and the engine with and without them.

Without CUDA the kernels run under Triton's interpreter (slow: the shapes are tiny).  The op
references are the eager modules' own arithmetic (``models/llama.py``'s ``RMSNorm``, ``rotate``,
``F.silu(gate) * up``, the cache write by slot).  Tolerances: float32 1e-5; bfloat16, float16 two ulps
(the kernels round once where eager bfloat16 rounds after each op, and Triton's interpreter rounds
float32 -> bfloat16 toward zero where a GPU rounds to nearest).

The model-level checks run a tiny random Llama (GQA) through :class:`ModelRunner` with the Triton
attention, with and without the fused ops, eagerly and through the decode graphs' static-buffer
path (``cuda_graphs=True``: captured graphs on CUDA, their eager stand-in on a CPU).
"""

from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from interlace.engine_ext.native import kernels  # noqa: E402,F401  (sets TRITON_INTERPRET without CUDA)
from interlace.engine_ext.native.block_manager import BlockTable  # noqa: E402
from interlace.engine_ext.native.kernels import fused  # noqa: E402
from interlace.engine_ext.native.kernels.attention import TritonAttention  # noqa: E402
from interlace.engine_ext.native.model_runner import ModelRunner, _fused_ops  # noqa: E402
from interlace.engine_ext.native.models.llama import LlamaForCausalLM, ModelConfig, RMSNorm, rotate  # noqa: E402
from interlace.engine_ext.native.scheduler import Batch, ScheduledChunk  # noqa: E402
from interlace.engine_ext.native.sequence import Context  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TOL = {F32: 1e-5, BF16: 2 * 2 ** -7, F16: 2 * 2 ** -10}   # relative; absolute the same times ~1


def close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    out, expected = out.cpu().float(), expected.cpu().float()
    assert out.shape == expected.shape, (what, out.shape, expected.shape)
    tol = TOL[dtype]
    err = ((out - expected).abs() / (expected.abs() + 1.0)).max().item()
    assert err <= tol, f"{what}: error {err:.3g} > {tol:.3g}"


# ------------------------------------------------------------------------------------------------------ norms
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("T,N", [(5, 96), (1, 64), (3, 256)])
def test_rms_norm_and_add_rms_norm_match_the_module(T, N, dtype):
    g = torch.Generator().manual_seed(T * 1000 + N)
    x = (torch.randn(T, N, generator=g) * 3).to(dtype)
    y = torch.randn(T, N, generator=g).to(dtype)
    norm = RMSNorm(N, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    with torch.inference_mode():
        close(fused.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5), norm(x), dtype, "rms_norm")
        xd = x.clone().to(DEVICE)  # updated in place: x + y, in x's dtype
        out = fused.add_rms_norm_(xd, y.to(DEVICE), norm.weight.to(DEVICE), 1e-5)
        close(xd, x + y, dtype, "the residual stream")
        close(out, norm(x + y), dtype, "add_rms_norm_")


# ------------------------------------------------------------------------------------------------- SiLU * up
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("T,I", [(5, 80), (2, fused.SILU_BLOCK + 76)])  # the second: two tiles per row
def test_silu_mul_matches_eager(T, I, dtype):
    g = torch.Generator().manual_seed(I)
    gate_up = (torch.randn(T, 2 * I, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(I, dim=-1)
    close(fused.silu_mul(gate_up.to(DEVICE)), F.silu(gate) * up, dtype, "silu_mul")


# ------------------------------------------------------------------------------------------- RoPE + KV store
ROPE_CASES = [  # T, H, Hkv, D, block_size, qkv dtype, cache dtype
    (5, 4, 2, 64, 4, F32, F32),
    (7, 6, 2, 128, 8, BF16, BF16),
    (3, 4, 4, 64, 4, BF16, F32),   # no GQA; a bfloat16 model over a float32 cache
    (3, 8, 2, 64, 4, F16, F16),
]


def _cos_sin(T: int, d: int, dtype: torch.dtype, g: torch.Generator):
    pos = torch.randint(0, 300, (T,), generator=g).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("T,h,hkv,d,bs,dtype,kv_dtype", ROPE_CASES)
def test_rope_store_matches_rotate_and_the_slot_write(T, h, hkv, d, bs, dtype, kv_dtype):
    g = torch.Generator().manual_seed(T * 100 + d)
    nb = 6
    qkv = torch.randn(T, (h + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = _cos_sin(T, d, dtype, g)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[1] = -1            # padded rows (CUDA graphs): nothing written
    slots[-1] = -1
    # the caches sit behind a guard head, so a stray write to slot -1 lands in memory we check
    guarded = [torch.full((hkv + 1, nb, bs, d), float("nan"), dtype=kv_dtype, device=DEVICE) for _ in range(2)]
    kc, vc = guarded[0][1:], guarded[1][1:]
    q = fused.rope_store(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), h, hkv, kc, vc, slots.to(DEVICE))

    rq, rk, rv = qkv.float().split([h * d, hkv * d, hkv * d], dim=-1)
    c, s = cos.float()[:, None], sin.float()[:, None]
    rq, rk, rv = rotate(rq.view(T, h, d), c, s), rotate(rk.view(T, hkv, d), c, s), rv.view(T, hkv, d)
    assert q.dtype == dtype
    close(q, rq, dtype, "q")
    written = slots >= 0
    for cache, expected, name in ((kc, rk, "k"), (vc, rv, "v")):
        flat = cache.cpu().view(hkv, nb * bs, d)
        close(flat[:, slots[written]].transpose(0, 1), expected[written], kv_dtype if name == "v" else dtype, name)
        others = torch.ones(nb * bs, dtype=torch.bool)
        others[slots[written]] = False
        assert flat[:, others].isnan().all(), f"{name}: a slot outside slot_mapping was written"
    assert all(gd[0].isnan().all() for gd in guarded), "a slot of -1 was written"


def test_rope_store_with_int32_slots_and_an_empty_batch():
    """The decode graphs' slots are int32 (their static buffer); a step with no rows launches nothing."""
    h, hkv, d, bs = 2, 1, 64, 4
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, (h + 2 * hkv) * d, generator=g)
    cos, sin = _cos_sin(3, d, F32, g)
    k64, v64, k32, v32 = (torch.zeros(hkv, 4, bs, d, device=DEVICE) for _ in range(4))
    slots = torch.tensor([9, -1, 2])
    a = fused.rope_store(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), h, hkv, k64, v64, slots.to(DEVICE))
    b = fused.rope_store(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), h, hkv, k32, v32,
                         slots.to(torch.int32).to(DEVICE))
    assert torch.equal(a, b) and torch.equal(k64, k32) and torch.equal(v64, v32) and k64.any()
    empty = fused.rope_store(qkv[:0].to(DEVICE), cos[:0].to(DEVICE), sin[:0].to(DEVICE), h, hkv, k64, v64,
                             slots[:0].to(DEVICE))
    assert empty.shape == (0, h, d)


# --------------------------------------------------------------------------------------- which ops a runner gets
def tiny_model(dtype=F32, qk_norm=False, device="cpu") -> LlamaForCausalLM:
    cfg = ModelConfig(model_type="qwen3" if qk_norm else "llama", vocab_size=320, hidden_size=64,
                      intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                      tie_word_embeddings=False, attention_bias=False, qk_norm=qk_norm)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    return model.eval().to(device=device, dtype=dtype)


def test_fused_ops_are_chosen_for_the_triton_attention_only_where_asked_on_a_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    model = tiny_model()
    assert _fused_ops(model, cuda, triton=True) is fused           # CUDA: by default
    assert _fused_ops(model, cpu, triton=True) is None             # the CPU default is unchanged
    assert _fused_ops(model, cpu, triton=True, asked=True) is fused
    assert _fused_ops(model, cpu) is None                          # dense float32 on the CPU: the reference
    assert _fused_ops(model.to(BF16), cuda, triton=True) is fused
    assert _fused_ops(model.to(torch.float64), cuda, triton=True) is None
    assert _fused_ops(tiny_model(qk_norm=True), cuda, triton=True) is None   # q/k norm: not fused
    r = ModelRunner(tiny_model(), 8, 4, F32, cpu, None, TritonAttention(), cuda_graphs=True, fused_ops=True)
    assert r.fused is fused and r.graphs.fused is fused
    r = ModelRunner(tiny_model(), 8, 4, F32, cpu, None, TritonAttention(), cuda_graphs=True)
    assert r.fused is None and r.graphs.fused is None


# ------------------------------------------------------------------------------------------------- the model
BS, NUM_BLOCKS, MAX_LEN = 4, 40, 128


class Contexts:
    def __init__(self, lens: List[int]):
        g = torch.Generator().manual_seed(1)
        self.next_block = 1
        self.ctxs = [Context(f"c{i}", torch.randint(1, 320, (n,), generator=g).tolist(), BlockTable())
                     for i, n in enumerate(lens)]

    def grow(self, ctx: Context) -> None:
        while len(ctx.table.blocks) * BS < len(ctx.token_ids):
            ctx.table.blocks.append(self.next_block)
            self.next_block += 1

    def prefill(self) -> Batch:
        for c in self.ctxs:
            self.grow(c)
        return Batch(chunks=[ScheduledChunk(c, 0, len(c.token_ids)) for c in self.ctxs])

    def decode(self, tokens: List[int]) -> Batch:
        for c, t in zip(self.ctxs, tokens):
            c.token_ids.append(t)
            self.grow(c)
        return Batch(chunks=[ScheduledChunk(c, len(c.token_ids) - 1, 1) for c in self.ctxs])


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_model_with_fused_ops_gives_the_unfused_logits_and_greedy_tokens(dtype, monkeypatch):
    """Three contexts prefill together, then decode greedily for two steps (padded to four rows
    in the graph path, whose padded row has slot -1): the unfused eager runner, the fused eager
    runner and the fused graph path agree on the logits and the greedy tokens (bfloat16: up to
    near-ties of the rounded logits)."""
    calls = {}
    for name in ("rms_norm", "add_rms_norm_", "silu_mul", "rope_store"):
        def counted(*args, _f=getattr(fused, name), _n=name):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*args)
        monkeypatch.setattr(fused, name, counted)
    model = tiny_model(dtype, device=DEVICE)
    dev = torch.device(DEVICE)

    def runner(fused_ops: bool, graphs: bool) -> ModelRunner:
        r = ModelRunner(model, NUM_BLOCKS, BS, dtype, dev, None, TritonAttention(), max_seqs=4,
                        max_model_len=MAX_LEN, cuda_graphs=graphs, fused_ops=fused_ops)
        assert (r.fused is fused) == fused_ops
        r.kv.fill_(float("nan"))  # a slot nobody writes stays NaN: a padded row writing shows
        return r

    plain, eager, graphed = runner(False, False), runner(True, False), runner(True, True)
    # bfloat16: the float32 model through the torch attention is the reference both paths are held to
    exact = ModelRunner(tiny_model(device=DEVICE), NUM_BLOCKS, BS, F32, dev, None, None) if dtype != F32 else None
    # logits of magnitude ~4.  bfloat16: an ulp of a logit is 2^-6..2^-5, and the residual stream is rounded
    # each layer (under the interpreter toward zero, which biases it): observed 0.13 between the paths
    tol = 1e-4 if dtype == F32 else 0.25
    cs = Contexts([3, 9, 6])
    batch = cs.prefill()
    for step in range(3):
        (lp, _), (le, _), (lg, _) = plain.run(batch), eager.run(batch), graphed.run(batch)
        for got, name in ((le, "fused eager"), (lg, "fused graph path")):
            assert not got.isnan().any(), f"{name}: NaN logits"
            err = (got - lp).abs().max().item()
            assert err <= tol, f"step {step}: {name} logits differ from the unfused by {err}"
        if exact is not None:  # no further from the float32 model than the unfused bfloat16 path (observed 1.5x)
            lx = exact.run(batch)[0]
            err_plain, err_fused = (lp - lx).abs().max().item(), (le - lx).abs().max().item()
            assert err_fused <= 2 * err_plain + 0.02, f"step {step}: fused {err_fused} vs unfused {err_plain}"
        tokens = lp.argmax(-1).tolist()
        for got, name in ((le, "fused eager"), (lg, "fused graph path")):
            if dtype == F32:
                assert got.argmax(-1).tolist() == tokens, f"step {step}: {name}: greedy tokens"
            else:  # bfloat16 logits tie within their rounding: the fused pick is within tol of the unfused best
                picked = lp.gather(1, got.argmax(-1, keepdim=True))[:, 0]
                assert (picked >= lp.max(-1).values - tol).all(), f"step {step}: {name}: greedy tokens"
        batch = cs.decode(tokens)
    assert graphed.graphs.replays == 2
    # per forward pass: one rms_norm, then per layer two add_rms_norm_, one silu_mul, one rope_store
    layers, passes = model.cfg.num_layers, 3 + 3   # eager: 3 steps; graphed: its prefill and 2 replays
    assert calls == {"rms_norm": passes, "add_rms_norm_": 2 * layers * passes, "silu_mul": layers * passes,
                     "rope_store": layers * passes}, calls
    used = plain.kv.isnan() == graphed.kv.isnan()
    assert used.all(), "the fused runner wrote other slots than the unfused one (a padded row's slot -1?)"
