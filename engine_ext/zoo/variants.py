"""Seeded synthetic variants of a base, for tests and benchmarks of block sharing.

* :func:`make_full_variant` writes a "full fine-tune": the base with the
  attention and FFN tensors of chosen layers perturbed by Gaussian noise of
  ``scale`` x each tensor's standard deviation; every other tensor is
  bit-identical, so the zoo stores only 2 blocks per perturbed layer.
* :func:`make_lora_adapter` writes a PEFT-format LoRA adapter (loadable by
  ``peft.PeftModel.from_pretrained``) with random ``A`` and a *non-zero*
  random ``B`` (a freshly initialised PEFT adapter has ``B = 0`` and changes
  nothing, which would make every test of adapter application vacuous).

LoRA magnitude: ``A`` ~ N(0, 1/in) and ``B`` is scaled so that, per adapted
module, ``||scaling * B @ A||_F = strength * ||W||_F`` (independent of rank and
alpha, so ranks 8..64 change the model by a similar amount).  The default
``strength=0.02`` was measured on the embedded SmolLM2-135M-Instruct (all
seven projections of all 30 layers adapted; ranks 8 and 64, seeds 0 and 1;
8 short English prompts, transformers, float32): next-token distribution
cosine similarity to the base, mean 0.980-0.992 (min over prompts
0.956-0.984); the greedy 32-token continuation differs from the base's for 8
of 8 prompts; the text stays fluent ("The capital of France is" -> " Paris.
The city of Paris is a major global hub for finance, ...", base: " Paris.
The answer is: ...").  ``strength=0.08`` gives cosine 0.70-0.81 (min 0.23)
and visibly degraded text, so stronger adapters are not useful test data.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from .blocks import ZooError, block_id, layer_of
from .lora import TARGETS, projection_shape

DEFAULT_STRENGTH = 0.02
_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def resolve_base(base_dir: str | os.PathLike) -> Path:
    from interlace.engine_ext.native.loader import resolve_model_dir

    if str(base_dir) == "embedded":
        from interlace.engine_ext.embedded import embedded_model_dir

        return embedded_model_dir()
    return resolve_model_dir(base_dir)


def _tensors(model_dir: Path) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    if not out:
        raise ZooError(f"{model_dir}: no .safetensors weights")
    return out


def _copy_side_files(src: Path, dst: Path) -> None:
    """config.json, tokenizer and generation files: everything but weights."""
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHTS) and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)


def make_full_variant(base_dir: str | os.PathLike, out_dir: str | os.PathLike, layers: Sequence[int],
                      scale: float, seed: int) -> Path:
    """A full fine-tune HF directory: ``layers``' attention and FFN tensors get
    N(0, (scale * std)^2) noise (one seeded generator, tensors in sorted name
    order), all other tensors are bit-identical to the base."""
    src, out = resolve_base(base_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ZooError(f"layers {bad} out of range (the base has {n_layers})")
    tensors = _tensors(src)
    gen = torch.Generator().manual_seed(seed)
    chosen = set(layers)
    for name in sorted(tensors):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        bid = block_id(name)
        if layer_of(bid) in chosen and bid.endswith((".attn", ".mlp")):
            t = tensors[name]
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            std = t.float().std() if t.numel() > 1 else t.float().abs()
            tensors[name] = (t.float() + noise * (scale * std)).to(t.dtype)
    out.mkdir(parents=True, exist_ok=True)
    _copy_side_files(src, out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def make_lora_adapter(base_dir: str | os.PathLike, out_dir: str | os.PathLike, rank: int,
                      targets: Sequence[str] = TARGETS, alpha: Optional[float] = None, seed: int = 0,
                      strength: float = DEFAULT_STRENGTH) -> Path:
    """A PEFT LoRA adapter directory for every layer's ``targets`` projections,
    with random A and B such that each module's update has Frobenius norm
    ``strength`` x its base weight's (see the module docstring for the effect)."""
    from interlace.engine_ext.native.models import ModelConfig

    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ZooError(f"unsupported LoRA targets {unknown or list(targets)} (supported: {', '.join(TARGETS)})")
    if rank < 1:
        raise ZooError(f"rank must be >= 1, got {rank}")
    src, out = resolve_base(base_dir), Path(out_dir)
    cfg = ModelConfig.from_hf(json.loads((src / "config.json").read_text()))
    alpha = float(2 * rank if alpha is None else alpha)
    scaling = alpha / rank
    base = _tensors(src)
    gen = torch.Generator().manual_seed(seed)
    weights: Dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        for module in targets:
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"model.layers.{i}.{parent}.{module}"
            out_f, in_f = projection_shape(cfg, module)
            a = torch.randn(rank, in_f, generator=gen) / in_f ** 0.5
            b = torch.randn(out_f, rank, generator=gen)
            delta = scaling * torch.linalg.matrix_norm(b @ a)
            b *= strength * torch.linalg.matrix_norm(base[name + ".weight"].float()) / delta
            weights[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
            weights[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(src), "r": rank,
              "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(targets), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "init_lora_weights": True, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {},
              "layers_to_transform": None, "layers_pattern": None, "revision": None}
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(out / "adapter_model.safetensors"))
    return out


__all__ = ["make_full_variant", "make_lora_adapter", "resolve_base", "DEFAULT_STRENGTH"]
