"""Read PEFT LoRA adapters for Llama-family bases, and merge them (reference).

BlockLLM (§4.3) keeps a parameter-efficient model as two parts: the
foundation model and its adapter.  The zoo stores the adapter files as they
came and reads them here into a :class:`LoraAdapter`: per adapted module its
``A`` [r, in] and ``B`` [out, r] in float32, with ``scaling`` kept separate
(``B`` is *not* pre-scaled), so a runtime can apply ``x @ A.T @ B.T * scaling``
or merge.

Everything the adapter could mean that this reader does not implement is
refused with a typed error naming the file and, where there is one, the tensor:
DoRA, LoRA biases, ``fan_in_fan_out``, ``modules_to_save``, per-module ranks
or alphas (``rank_pattern`` / ``alpha_pattern``), adapters on anything but
the seven Llama projections.  A wrong adapter must fail at ``zoo add``, not
produce wrong text at serving time.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Mapping, Tuple

import torch
from safetensors import SafetensorError, safe_open

from .blocks import CorruptAdapter, ShapeMismatch, block_id, read_json_object

if TYPE_CHECKING:
    from interlace.engine_ext.native.models import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_PREFIX = "base_model.model."
_NAME = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
# PEFT options whose non-empty / true value changes what the adapter computes
_REFUSED = {"use_dora": "DoRA (use_dora)", "lora_bias": "LoRA biases (lora_bias)",
            "fan_in_fan_out": "fan_in_fan_out", "modules_to_save": "modules_to_save",
            "target_parameters": "target_parameters", "layer_replication": "layer_replication",
            "trainable_token_indices": "trainable_token_indices",
            "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)"}


@dataclass
class LoraAdapter:
    """A LoRA adapter ready to apply: ``W' = W + scaling * B @ A`` per module."""

    name: str
    rank: int
    alpha: float
    scaling: float  # alpha/rank, or alpha/sqrt(rank) with use_rslora
    # HF module name ("model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r]), float32
    weights: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def blocks(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """Block id -> the adapter's tensors in that block, keyed by
        ``<module>.lora_A`` / ``<module>.lora_B`` (block-relative, e.g. ``q_proj.lora_A``)."""
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        for module, (a, b) in self.weights.items():
            bid = block_id(module + ".weight")
            short = module.rsplit(".", 1)[1]
            out.setdefault(bid, {}).update({f"{short}.lora_A": a, f"{short}.lora_B": b})
        return out

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def projection_shape(cfg: "ModelConfig", module: str) -> Tuple[int, int]:
    """(out_features, in_features) of a Llama projection under ``cfg``."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[module]


def read_adapter_config(path: Path) -> dict:
    """The adapter's JSON config, checked for everything this reader cannot apply."""
    f = path / CONFIG_FILE
    if not f.is_file():
        raise CorruptAdapter(f"{f}: missing (not a PEFT adapter directory)")
    cfg = read_json_object(f, CorruptAdapter)
    if cfg.get("peft_type") != "LORA":
        raise CorruptAdapter(f"{f}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise CorruptAdapter(f"{f}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise CorruptAdapter(f"{f}: bias {cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise CorruptAdapter(f"{f}: per-module ranks or alphas (rank_pattern / alpha_pattern) are not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise CorruptAdapter(f"{f}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise CorruptAdapter(f"{f}: lora_alpha must be a finite number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise CorruptAdapter(f"{f}: target module(s) {unknown} not supported (supported: {', '.join(TARGETS)})")
    elif not isinstance(targets, str):  # a regex or "all-linear": the tensors below say what it matched
        raise CorruptAdapter(f"{f}: target_modules must be a list or a string, got {targets!r}")
    return cfg


def _read_tensors(f: Path) -> Dict[str, torch.Tensor]:
    if not f.is_file():
        raise CorruptAdapter(f"{f}: missing (only safetensors adapters are supported)")
    try:
        with safe_open(str(f), framework="pt") as st:
            return {k: st.get_tensor(k) for k in st.keys()}
    except (SafetensorError, OSError, RuntimeError) as e:  # truncated, bad header, unreadable
        raise CorruptAdapter(f"{f}: unreadable safetensors: {e}") from e


def load_peft_adapter(path: str | os.PathLike, cfg: "ModelConfig", name: str = "") -> LoraAdapter:
    """Read and check a PEFT LoRA adapter directory against the base ``cfg``.

    Every A/B pair must fit its projection's (in, out) features, the layer
    must exist, both halves must be present and finite."""
    path = Path(path)
    conf = read_adapter_config(path)
    f = path / WEIGHTS_FILE
    raw = _read_tensors(f)
    if not raw:
        raise CorruptAdapter(f"{f}: holds no tensors")
    rank, alpha = conf["r"], float(conf["lora_alpha"])
    halves: Dict[str, Dict[str, torch.Tensor]] = {}
    for tname, t in raw.items():
        m = _NAME.match(tname.removeprefix(_PREFIX)) if tname.startswith(_PREFIX) else None
        if m is None:
            raise CorruptAdapter(f"{f}: tensor {tname!r} is not a LoRA A/B of a supported module "
                                 f"({', '.join(TARGETS)})")
        layer, parent, module, half = m.groups()
        if _PARENT.get(module) != parent:
            raise CorruptAdapter(f"{f}: tensor {tname!r}: target module {module!r} is not supported")
        if int(layer) >= cfg.num_layers:
            raise ShapeMismatch(f"{f}: tensor {tname!r}: layer {layer} is out of range "
                                f"(the base has {cfg.num_layers} layers)")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise CorruptAdapter(f"{f}: tensor {tname!r} holds NaN/Inf or is not floating point")
        out_f, in_f = projection_shape(cfg, module)
        want = (rank, in_f) if half == "A" else (out_f, rank)
        if tuple(t.shape) != want:
            raise ShapeMismatch(f"{f}: tensor {tname!r} has shape {tuple(t.shape)}, the base needs {want}")
        halves.setdefault(f"model.layers.{int(layer)}.{parent}.{module}", {})[half] = t.to(torch.float32)
    weights = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise CorruptAdapter(f"{f}: {_PREFIX}{module}.lora_{missing}.weight is missing")
        weights[module] = (ab["A"].contiguous(), ab["B"].contiguous())
    scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    return LoraAdapter(name=name or path.name, rank=rank, alpha=alpha, scaling=scaling, weights=weights)


def merge_into(tensors: Mapping[str, torch.Tensor], adapter: LoraAdapter) -> Dict[str, torch.Tensor]:
    """A new state dict with ``W + scaling * B @ A`` for each adapted module
    (computed in float32, stored in W's dtype); ``tensors`` is not modified
    and unadapted tensors are the same objects."""
    out = dict(tensors)
    for module, (a, b) in adapter.weights.items():
        key = module + ".weight"
        if key not in out:
            raise ShapeMismatch(f"adapter {adapter.name!r}: the base has no tensor {key!r}")
        w = out[key]
        out[key] = (w.to(torch.float32) + adapter.scaling * (b @ a)).to(w.dtype)
    return out


__all__ = ["LoraAdapter", "load_peft_adapter", "merge_into", "read_adapter_config", "projection_shape",
           "ADAPTER_FILES", "TARGETS"]
