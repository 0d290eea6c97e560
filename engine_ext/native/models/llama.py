"""A Llama-family decoder reading and writing a paged KV cache.

Covers Llama (1-3.x), Mistral (sliding-window attention), Qwen2 / Qwen2.5
(q/k/v biases), Qwen3 (per-head q/k RMSNorm) and SmolLM2: they differ only in
the switches held by :class:`ModelConfig`.  Q/K/V and gate/up projections are fused into one matmul
each, which matters on a CPU where every op has a fixed cost.

The forward pass takes a flat batch: the new tokens of all scheduled contexts
concatenated (chunked prefills and single-token decodes mixed), with
:class:`AttentionMetadata` saying where their KV goes and carrying the
engine's attention backend with this step's arguments for it: each layer
stores its K/V and attends through that one object (``native/attention.py``:
torch, the CPU kernel or Triton), whichever it is.

With the fused ops (quantized float32 on the CPU, or Triton) the layers run
as one loop over a :class:`FusedPlan` that calls no module: each module call
with the reshapes and no-op dtype conversions around a quantized matmul cost
~10 us, ~1/3 of a 12 ms batch-1 step with the other per-step rebuilding
(docs/cpu-engine.md, issue 31).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "smollm2"}


class UnsupportedModel(ValueError):
    """The model directory holds an architecture this engine cannot run."""


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: Optional[dict] = None
    sliding_window: Optional[int] = None  # each position attends to itself and the window - 1 before it

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        mt = cfg.get("model_type", "")
        if mt not in SUPPORTED:
            raise UnsupportedModel(
                f"model_type {mt!r} is not supported by the native engine (supported: {sorted(SUPPORTED)})")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling and scaling.get("rope_type", scaling.get("type")) not in ("default", "linear", "llama3"):
            raise UnsupportedModel(f"rope scaling {scaling!r} is not supported")
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", mt == "qwen2"),
            qk_norm=(mt == "qwen3"),
            rope_scaling=scaling,
            sliding_window=_sliding_window(mt, cfg),
        )


def _sliding_window(model_type: str, cfg: dict) -> Optional[int]:
    """Mistral's window (the same in every layer, as transformers applies
    it), or None.  Models whose layers mix windowed and full attention
    (Qwen2/3 with ``use_sliding_window``, ``layer_types``) are refused rather
    than run with the wrong attention."""
    if model_type == "mistral":
        window = cfg.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise UnsupportedModel(f"sliding_window must be a positive integer, got {window!r}")
        return window
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ()):
        raise UnsupportedModel(f"{model_type} with sliding-window attention layers is not supported "
                               "by the native engine")
    return None


@dataclass
class AttentionMetadata:
    """What every layer of one step needs beyond its weights and the hidden states.

    ``slot_mapping[t]`` is the cache slot (block * block_size + offset) the
    t-th new token's K/V is written to.  ``attention`` is the engine's
    attention backend (``native/attention.py``), chosen once: each layer calls
    its ``store`` and ``attend``; ``attention_args`` is what its ``attend``
    reads, built once per step by the model runner (``step_args``: block
    tables, masks, lengths), not once per layer.
    """

    slot_mapping: torch.Tensor                    # [T] long
    attention: Any                                # the backend: store(k, v, ...) and attend(q, ...)
    attention_args: Any                           # its arguments for this step (from its step_args)
    # rows of several model variants (BlockLLM, ``native/block_sharing.py``): which weights each row uses
    variants: Optional[Any] = None                # a block_sharing.VariantBatch, or None: the base model only
    # the fused ops, or None: eager torch.  ``native/cpu_matmul.py``'s (float32, quantized weights on the CPU)
    # or ``native/kernels/fused.py``'s (Triton, with the Triton attention; float32, bfloat16, float16)
    fused: Optional[Any] = None
    cos: Optional[torch.Tensor] = None            # [T, head_dim] (activation dtype), for the fused rotary embedding
    sin: Optional[torch.Tensor] = None
    # one past the step's largest position, where the caller knows it (the model runner): cos and sin then
    # come from the model's table (:meth:`LlamaForCausalLM.rope`); 0: computed for the step's positions
    positions_end: int = 0
    fused_plan: Optional["FusedPlan"] = None      # what the fused layers read, built once (model runner)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normed(x)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The weight-free part (shared by every variant's weight)."""
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


def _linear(mod: nn.Linear, x: torch.Tensor, meta: "AttentionMetadata") -> torch.Tensor:
    """``mod(x)``, or per variant's weights (and LoRA) when the batch mixes variants."""
    return mod(x) if meta.variants is None else meta.variants.linear(mod, x)


def _norm(mod: "RMSNorm", x: torch.Tensor, meta: "AttentionMetadata") -> torch.Tensor:
    return mod(x) if meta.variants is None else meta.variants.norm(mod, x)


class FusedPlan(NamedTuple):
    """What :meth:`LlamaForCausalLM._fused_forward` reads, gathered once per KV cache rather than once
    per step (:meth:`LlamaForCausalLM.fused_plan`): per layer ``(qkv, o, gate_up, down, k_cache,
    v_cache, post_norm weight, next norm weight)`` -- the four projections as :func:`rows_fn`'s
    callables, the layer's cache views -- then the first norm's weight and the head's callable.
    Rebuilding it each step (a ModuleList slice, 60 cache selects, ~480 module calls and attribute
    lookups) was ~1 ms of a 12 ms batch-1 step on a Zen 3 machine (docs/cpu-engine.md)."""

    layers: List[tuple]
    first_norm: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor]


def rows_fn(mod: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A callable equal to ``mod(x)`` for ``x`` a contiguous ``[rows >= 1, in_features]`` matrix of
    ``dtype``: a quantized linear's own matmul (``quant.Int4Linear._matmul``, which picks its kernel
    per call, the AMX path included) where the module has no bias and ``dtype`` is float32 -- without
    the module call and the reshapes and dtype conversions around it (no-ops here, ~10 us a call) --
    else the module itself."""
    matmul = getattr(mod, "_matmul", None)
    if matmul is not None and getattr(mod, "bias", None) is None and dtype == torch.float32:
        return matmul
    return mod


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "llama3":  # Llama 3.1 frequency-dependent scaling
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(is_mid, mid, scaled)
    return inv


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE; x [T, H, D], cos/sin [T, 1, D]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.d ** -0.5

    def forward(self, x, cos, sin, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        k_blocks, v_blocks = kv[0], kv[1]  # [Hkv, num_blocks, block_size, D]
        if meta.fused is not None:  # one call: rotary embedding of q and k, k and v into the cache
            q = meta.fused.rope_store(_linear(self.qkv, x, meta), meta.cos, meta.sin, self.h, self.hkv,
                                      k_blocks, v_blocks, meta.slot_mapping)
        else:
            q, k, v = _linear(self.qkv, x, meta).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
            q, k, v = q.view(T, self.h, self.d), k.view(T, self.hkv, self.d), v.view(T, self.hkv, self.d)
            if self.q_norm is not None:
                q, k = _norm(self.q_norm, q, meta), _norm(self.k_norm, k, meta)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            meta.attention.store(k, v, k_blocks, v_blocks, meta.slot_mapping)
        out = meta.attention.attend(q, k_blocks, v_blocks, meta.attention_args, self.scale)
        return _linear(self.o, out.reshape(T, self.h * self.d), meta)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down = nn.Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, meta: Optional[AttentionMetadata] = None) -> torch.Tensor:
        if meta is None or meta.variants is None:
            gate, up = self.gate_up(x).split(self.inter, dim=-1)
            return self.down(F.silu(gate) * up)
        gate, up = meta.variants.linear(self.gate_up, x).split(self.inter, dim=-1)
        return meta.variants.linear(self.down, F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv, meta):
        x = x + self.attn(_norm(self.input_norm, x, meta), cos, sin, kv, meta)
        return x + self.mlp(_norm(self.post_norm, x, meta), meta)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._rope_table: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # cos, sin [n, head_dim] (rope)

    def rope(self, positions: torch.Tensor, end: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, head_dim]`` (contiguous, ``dtype``) of ``positions``.  With ``end`` (one past
        the largest position) they are rows of a table of positions ``[0, n)`` kept with the model (grown
        to a power of two >= ``end``): two index_selects instead of the ~10 ops that compute them (at
        batch 1 ~0.1 ms of a step).  The table's rows are computed by the same ops as the direct path,
        so they are the same numbers."""
        if not end:
            return self._cos_sin(positions, dtype)
        table = self._rope_table
        if table is None or table[0].shape[0] < end or table[0].dtype != dtype or table[0].device != positions.device:
            n = 1 << max(end - 1, 255).bit_length()
            table = self._rope_table = self._cos_sin(torch.arange(n, device=positions.device), dtype)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, logits_rows: Optional[torch.Tensor]) -> torch.Tensor:
        """Run the flat batch, write its KV, and return float32 logits for
        ``logits_rows`` only (the last new token of contexts that need one; None: every row, in order)."""
        x = self.embed(input_ids) if meta.variants is None else meta.variants.embed(self.embed, input_ids)
        cos, sin = self.rope(positions, meta.positions_end, x.dtype)
        if meta.fused is not None:
            return self._fused_forward(x, cos, sin, kv_caches, meta, logits_rows)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_caches[i], meta)
        if logits_rows is not None:
            x = x[logits_rows]
        if meta.variants is None:
            return self.lm_head(self.norm(x)).float()
        if logits_rows is None:
            logits_rows = torch.arange(x.shape[0], device=x.device)
        rows = meta.variants.select(logits_rows)  # the logit rows' variants
        return rows.linear(self.lm_head, rows.norm(self.norm, x)).float()

    def fused_plan(self, kv_caches: torch.Tensor) -> FusedPlan:
        """:class:`FusedPlan` for this model's current modules and the cache ``kv_caches``."""
        dtype = self.norm.weight.dtype
        following = [layer.input_norm.weight for layer in self.layers][1:] + [self.norm.weight]
        layers = []
        for i, layer in enumerate(self.layers):
            a, m = layer.attn, layer.mlp
            layers.append((rows_fn(a.qkv, dtype), rows_fn(a.o, dtype), rows_fn(m.gate_up, dtype),
                           rows_fn(m.down, dtype), kv_caches[i, 0], kv_caches[i, 1], layer.post_norm.weight,
                           following[i]))
        return FusedPlan(layers, self.layers[0].input_norm.weight, rows_fn(self.lm_head, dtype))

    def _fused_forward(self, x, cos, sin, kv_caches, meta: AttentionMetadata, logits_rows) -> torch.Tensor:
        """The same layers with the residual add and the next RMSNorm as one op, SiLU-times-up as
        one, the rotary embedding and the cache write as one (``meta.fused``: the C++ ops in
        float32, or the Triton ops in float32/bfloat16/float16), no variants, no q/k norm (the
        model runner checks).  The residual stream ``x`` is updated in place, in its dtype.  The
        loop reads ``meta.fused_plan`` (built here when the caller has none) and calls no module."""
        ops, eps, T = meta.fused, self.cfg.rms_norm_eps, x.shape[0]
        plan = meta.fused_plan or self.fused_plan(kv_caches)
        meta.cos, meta.sin = cos, sin
        attend, args, slots = meta.attention.attend, meta.attention_args, meta.slot_mapping
        a0 = self.layers[0].attn
        H, Hkv, scale = a0.h, a0.hkv, a0.scale
        x = x.contiguous()  # the residual stream, updated in place
        h = ops.rms_norm(x, plan.first_norm, eps)
        for qkv, o, gate_up, down, k_cache, v_cache, post, following in plan.layers:
            q = ops.rope_store(qkv(h), cos, sin, H, Hkv, k_cache, v_cache, slots)
            h = ops.add_rms_norm_(x, o(attend(q, k_cache, v_cache, args, scale).reshape(T, -1)), post, eps)
            h = ops.add_rms_norm_(x, down(ops.silu_mul(gate_up(h))), following, eps)
        return plan.head(h if logits_rows is None else h[logits_rows]).float()

    # ------------------------------------------------------------- weights
    def hf_weight_map(self) -> List[tuple]:
        """``(module, HF tensor names)`` for every weight: the names are
        concatenated in this order into the module's (fused) weight, and a
        module with a bias takes the same names with ``.bias``.  The one place
        that knows how checkpoint tensors map onto this model (loading and
        block sharing read it); a tied head is not listed (it is the embedding)."""
        cfg = self.cfg
        out: List[tuple] = [(self.embed, ("model.embed_tokens.weight",))]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            out += [(layer.attn.qkv, tuple(a + f"{n}_proj.weight" for n in "qkv")),
                    (layer.attn.o, (a + "o_proj.weight",))]
            if cfg.qk_norm:
                out += [(layer.attn.q_norm, (a + "q_norm.weight",)), (layer.attn.k_norm, (a + "k_norm.weight",))]
            out += [(layer.mlp.gate_up, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                    (layer.mlp.down, (p + "mlp.down_proj.weight",)),
                    (layer.input_norm, (p + "input_layernorm.weight",)),
                    (layer.post_norm, (p + "post_attention_layernorm.weight",))]
        out.append((self.norm, ("model.norm.weight",)))
        if not cfg.tie_word_embeddings:
            out.append((self.lm_head, ("lm_head.weight",)))
        return out

    def load_hf_state_dict(self, tensors: dict) -> None:
        """Load weights named as in Hugging Face checkpoints, fusing q/k/v and
        gate/up.  Missing or unexpected tensors are an error, not a silence."""
        used = set()

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise UnsupportedModel(f"checkpoint lacks tensor {name!r}")
            used.add(name)
            return tensors[name]

        def fused(names) -> torch.Tensor:
            return torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0])

        with torch.no_grad():
            for mod, names in self.hf_weight_map():
                mod.weight.copy_(fused(names))
                if getattr(mod, "bias", None) is not None:
                    mod.bias.copy_(fused([n.replace(".weight", ".bias") for n in names]))
        extra = set(tensors) - used - {"lm_head.weight"}
        extra = {n for n in extra if not n.endswith("rotary_emb.inv_freq")}
        if extra:
            raise UnsupportedModel(f"checkpoint has tensors this model does not use: {sorted(extra)[:5]}")
