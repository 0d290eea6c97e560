"""Find and load model weights: a local Hugging Face directory, or a GGUF file
converted once into a cached Hugging Face directory.

GGUF files hold quantized weights (the embedded SmolLM2 is Q4_1).  The native
engine runs dense weights, so the conversion dequantizes through transformers'
GGUF loader (which also undoes llama.cpp's Q/K row permutation and rebuilds the
tokenizer) and writes config.json + model.safetensors + tokenizer files into
``$INTERLACE_CACHE`` (default ``~/.cache/interlace``).  Later starts load the
cached directory directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Tuple

import torch
from safetensors.torch import load_file

from .models import LlamaForCausalLM, ModelConfig, UnsupportedModel
from .models.llama import rope_inv_freq

log = logging.getLogger(__name__)


class ModelNotFound(FileNotFoundError):
    """The model path does not exist or is not a model directory / GGUF file."""


def cache_root() -> Path:
    return Path(os.environ.get("INTERLACE_CACHE", Path.home() / ".cache" / "interlace"))


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """Return a Hugging Face-style directory for ``path`` (a directory, a
    ``.gguf`` file, or a directory holding exactly one GGUF file)."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            p = ggufs[0]
        else:
            raise ModelNotFound(f"{p} has no config.json and not exactly one .gguf file")
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p)
    raise ModelNotFound(f"model path {str(path)!r} is neither a model directory nor a .gguf file")


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF checkpoint into a cached HF directory (once)."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if (out / "model.safetensors").exists():
        return out
    log.warning("converting %s to %s (once)", gguf_path, out)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    cfg.pop("_name_or_path", None)
    tied = bool(cfg.get("tie_word_embeddings"))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        save_file(tensors, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic: a half-written directory is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_config(model_dir: Path) -> Tuple[dict, ModelConfig]:
    raw = json.loads((model_dir / "config.json").read_text())
    return raw, ModelConfig.from_hf(raw)


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LlamaForCausalLM:
    raw, _ = load_config(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{model_dir} holds no .safetensors weights")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return model_from_tensors(raw, tensors, dtype, device)


def model_from_tensors(config: dict, tensors: dict, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """The model of a Hugging Face ``config`` dict with ``tensors`` (HF
    names), e.g. a zoo base's memory-mapped blocks."""
    cfg = ModelConfig.from_hf(config)
    with torch.device("meta"):  # no time spent on random init of weights we overwrite
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.inv_freq = rope_inv_freq(cfg).to(device)  # a buffer: meta tensors hold no data
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.load_hf_state_dict(tensors)
    return model.eval()


__all__ = ["ModelNotFound", "UnsupportedModel", "resolve_model_dir", "convert_gguf", "load_config",
           "load_model", "model_from_tensors", "cache_root"]
