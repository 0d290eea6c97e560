"""Partition a Llama-family checkpoint into BlockLLM blocks and hash them.

BlockLLM (§4.3) composes blocks only at clear architectural boundaries: the
finest units are the embedding, each layer's attention, each layer's FFN and
the LM head.  Norm weights are tiny, but they are kept as blocks of their own
(``layers.{i}.input_norm`` / ``layers.{i}.post_norm`` / ``norm``) rather than
folded into attention or FFN, so that a fine-tune that only touched a norm
does not make a whole attention block unique.

A block's hash covers its tensors under *block-relative* names
(``q_proj.weight``, not ``model.layers.3.self_attn.q_proj.weight``), their
dtype, shape and raw bytes: identical content at two layer positions or in
two models is one block, stored once.

This module needs torch only (no transformers), so the serving runtime can
import it cheaply.  The zoo's exception types live here, the lowest module of
the package, and are re-exported by :mod:`.store`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import torch


class ZooError(ValueError):
    """Base of all zoo errors: a mistake in the input the user can fix."""


class UnknownBase(ZooError):
    """A variant names a base that is not in the zoo."""


class UnknownVariant(ZooError):
    """No variant (or base) of that name is in the zoo."""


class DuplicateVariant(ZooError):
    """The name is already taken in the zoo."""


class ShapeMismatch(ZooError):
    """A variant's config or tensors do not fit its base."""


class CorruptAdapter(ZooError):
    """A PEFT adapter (or a checkpoint file) is unreadable, malformed or unsupported."""


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm)\.(.+)$")
_LAYER_PART = {"self_attn": "attn", "mlp": "mlp", "input_layernorm": "input_norm",
               "post_attention_layernorm": "post_norm"}
_PART_HF = {v: k for k, v in _LAYER_PART.items()}
_TOP = {"model.embed_tokens.": "embed", "lm_head.": "lm_head", "model.norm.": "norm"}
_TOP_HF = {v: k for k, v in _TOP.items()}


def is_ignored(hf_name: str) -> bool:
    """Buffers recomputed at load time (rotary ``inv_freq``): not weights, no block."""
    return hf_name.endswith("rotary_emb.inv_freq")


def split_name(hf_name: str) -> Tuple[str, str]:
    """``hf_name`` -> (block id, name relative to the block); :class:`ZooError` if unknown."""
    m = _LAYER.match(hf_name)
    if m:
        layer, part, rest = m.groups()
        if part in ("input_layernorm", "post_attention_layernorm") and rest != "weight":
            raise ZooError(f"unknown tensor name {hf_name!r}")
        return f"layers.{int(layer)}.{_LAYER_PART[part]}", rest
    for prefix, bid in _TOP.items():
        if hf_name == prefix + "weight":
            return bid, "weight"
    raise ZooError(f"unknown tensor name {hf_name!r} (not a Llama-family weight)")


def block_id(hf_name: str) -> str:
    """The block a Hugging Face Llama-family tensor belongs to, e.g.
    ``model.layers.3.self_attn.q_proj.weight`` -> ``layers.3.attn``."""
    return split_name(hf_name)[0]


def hf_name(block: str, rel: str) -> str:
    """Inverse of :func:`split_name`: the Hugging Face name of ``rel`` inside ``block``."""
    if block in _TOP_HF:
        return _TOP_HF[block] + rel
    parts = block.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _PART_HF:
        return f"model.layers.{parts[1]}.{_PART_HF[parts[2]]}.{rel}"
    raise ZooError(f"unknown block id {block!r}")


def layer_of(block: str) -> int | None:
    """The layer index of a ``layers.{i}.*`` block, None for embed / norm / lm_head."""
    parts = block.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


_ORDER = {"embed": 0, "input_norm": 0, "attn": 1, "post_norm": 2, "mlp": 3, "norm": 0, "lm_head": 1}


def sort_key(block: str) -> Tuple[int, int, int]:
    """Model order: embed, then layer by layer (input_norm, attn, post_norm, mlp), then norm, lm_head."""
    layer = layer_of(block)
    if layer is not None:
        return (1, layer, _ORDER[block.rsplit(".", 1)[1]])
    return (0 if block == "embed" else 2, 0, _ORDER.get(block, 9))


def partition(tensors: Mapping[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
    """Group a state dict by block: block id -> {hf_name: tensor} (the same
    tensor objects, nothing copied).  Rotary ``inv_freq`` buffers are skipped."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if is_ignored(name):
            continue
        out.setdefault(block_id(name), {})[name] = t
    return out


def relative(block: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A block's tensors keyed by block-relative names (accepts either naming)."""
    out = {}
    for name, t in block.items():
        out[split_name(name)[1] if name.startswith(("model.", "lm_head.")) else name] = t
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (row-major), without a copy when it is contiguous on the CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _update(h, name: str, t: torch.Tensor) -> None:
    head = f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0{t.numel() * t.element_size()}\0"
    h.update(len(head).to_bytes(8, "little"))
    h.update(head.encode())
    h.update(tensor_bytes(t))


def block_hash(block: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex) over the block's tensors in sorted block-relative name
    order: name, dtype, shape and raw bytes, each length-prefixed so that
    no two different blocks serialize to the same stream."""
    h = hashlib.sha256()
    for name, t in sorted(relative(block).items()):
        _update(h, name, t)
    return h.hexdigest()


def derived_hash(base_hash: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """The hash of a base block modified by extra tensors (a LoRA adapter's
    A/B of that block): sha256(base hash + the tensors, as in :func:`block_hash`)."""
    h = hashlib.sha256(base_hash.encode())
    for name, t in sorted(tensors.items()):
        _update(h, name, t)
    return h.hexdigest()


def read_json_object(f: Path, error: Optional[type] = None, what: str = "unreadable JSON") -> dict:
    """The JSON object in ``f``, or ``error`` (default :class:`ZooError`) naming the file."""
    error = error or ZooError
    try:
        raw = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{f}: {what}: {e}") from e
    if not isinstance(raw, dict):
        raise error(f"{f}: not a JSON object")
    return raw


__all__ = ["ZooError", "UnknownBase", "UnknownVariant", "DuplicateVariant", "ShapeMismatch", "CorruptAdapter",
           "block_id", "split_name", "hf_name", "layer_of", "sort_key", "partition", "relative", "block_hash",
           "derived_hash", "is_ignored", "tensor_bytes"]
