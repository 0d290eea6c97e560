"""Find and load model weights: a local Hugging Face directory, or a GGUF file
converted once into a cached Hugging Face directory; and the settings that say
how they are loaded (``dtype``, ``weights``: :func:`resolve_weights`).

GGUF files hold quantized weights (the embedded SmolLM2 is Q4_1).  The native
engine runs dense weights, so the conversion dequantizes through transformers'
GGUF loader (which also undoes llama.cpp's Q/K row permutation and rebuilds the
tokenizer) and writes config.json + model.safetensors + tokenizer files into
``$INTERLACE_CACHE`` (default ``~/.cache/interlace``).  Later starts load the
cached directory directly.

:func:`load_for_engine` is what :meth:`NativeEngine.load
<interlace.engine_ext.native.engine.NativeEngine.load>` builds the engine from (model, tokenizer,
name), kept apart from the engine so that loading and serving are separate
rooms; it runs on a thread that ends (:func:`in_passing_thread`, which the
other loaders of weights use too).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from safetensors.torch import load_file

from ..tokenizer import Tokenizer
from .models import LlamaForCausalLM, ModelConfig, UnsupportedModel
from .models.llama import rope_inv_freq
from .options import DTYPE_ALIASES, DTYPES, WEIGHTS

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
        try:
            os.replace(tmp, out)  # atomic: a half-written directory is never used
        except OSError:
            # another process converted the same file meanwhile (two test workers, two gateways
            # starting at once): its directory is complete, so ours is dropped
            if not (out / "model.safetensors").exists():
                raise
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


# ------------------------------------------------------------------ dtype and weights
#: the concrete ``dtype`` names (options.DTYPES without auto, and their aliases) as torch dtypes
TORCH_DTYPES: Dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES if name != "auto"}
TORCH_DTYPES.update({alias: TORCH_DTYPES[name] for alias, name in DTYPE_ALIASES.items()})


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helpers; absent on some builds and platforms
        return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Map a configured dtype name to a torch dtype.

    ``auto`` picks the fastest dtype that keeps float32's exponent range:
    bfloat16 on CUDA devices that support it and on CPUs with native
    bfloat16 dot products (AVX512-BF16 or AMX), where the weight matmuls run
    about twice as fast as in float32 (``interlace bench engine``); float32
    on other CPUs, where bfloat16 is emulated and slower.
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(TORCH_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]


def resolve_weights(weights: Optional[str], dtype: Optional[str], device: torch.device) -> torch.dtype:
    """Check the ``weights`` setting against ``dtype`` and return the compute dtype.

    ``dtype`` is the compute dtype: activations, KV cache, norms, the
    embedding, and dense weights.  ``weights`` is how the weight matmuls are
    stored: unset, dense in ``dtype`` (the default); ``float32`` /
    ``bfloat16``, dense in that dtype, which is then the compute dtype too
    (``dtype`` unset or ``auto``; another ``dtype`` is a contradiction, an
    error); ``int8`` / ``as-shipped``, quantized (:mod:`.quant`), with compute
    in ``dtype`` (default float32), on the CPU only.  ``auto`` with quantized
    weights is float32: their matmuls run on float32 activations whatever
    the dtype, so bfloat16 compute only adds conversions and loses the fused
    decode ops (measured on an AVX512-BF16 CPU: 72 against 98 tokens/s at
    batch 1, docs/benchmarks.md).

    On a GPU the default compute dtype is ``auto`` (bfloat16 where the GPU
    has it): float32 there halves the bandwidth a decode step can use and
    the Triton prefill and cascade kernels spill their float32 tiles.  The
    quantized formats' matmuls are CPU kernels: ``as-shipped`` on a GPU
    loads the GGUF dequantized (dense in the compute dtype, see
    :func:`load_for_engine`), so the shipped config starts there too;
    ``int8`` (made from float weights, only to save CPU memory) is refused."""
    if weights is None:
        return resolve_dtype(dtype or ("float32" if device.type == "cpu" else "auto"), device)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {list(WEIGHTS)}, got {weights!r}")
    if weights in ("float32", "bfloat16"):
        if dtype not in (None, "auto") and TORCH_DTYPES.get(dtype) is not TORCH_DTYPES[weights]:
            raise ValueError(f"weights: {weights} with dtype: {dtype}: dense weights compute in their own dtype; "
                             f"drop one of the two settings")
        return TORCH_DTYPES[weights]
    if device.type != "cpu":
        if weights == "as-shipped":  # dequantized: dense in the compute dtype
            return resolve_dtype(dtype or "auto", device)
        raise ValueError(f"weights: {weights} runs on the CPU only (its matmuls are CPU kernels); on "
                         f"{device.type} leave weights unset (dense, dtype auto: bfloat16)")
    return resolve_dtype("float32" if dtype in (None, "auto") else dtype, device)


# ------------------------------------------------------------------ loading for an engine
def in_passing_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a short-lived thread and return its result.

    Why: with the OpenMP runtime PyTorch uses, every thread that runs a
    parallel op keeps its own pool of worker threads for the life of the
    thread.  Once the pools together hold more threads than there are CPUs,
    the runtime stops letting idle workers spin between ops, and the many
    small ops of a decode step then pay a wake-up each: a bfloat16 decode
    step of SmolLM2 at batch 32 took ~92 ms instead of ~68 ms on 2 cores.
    Loading (a parallel copy of every weight) on the caller's thread, usually
    the main thread that serves HTTP, would leave such a pool behind; a
    thread that ends takes its pool with it, so the engine thread's is the
    only one.
    """
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="interlace-load")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def load_for_engine(model_path: str | os.PathLike, *, dtype: Optional[str] = None,
                    weights: Optional[str] = None,
                    device: torch.device) -> Tuple[LlamaForCausalLM, Optional[Tokenizer], str]:
    """The model, tokenizer (None without a tokenizer.json) and name a native engine serves
    ``model_path`` with (a model directory, or with ``weights: as-shipped`` a GGUF file), loaded
    on a thread that ends (:func:`in_passing_thread`); ``dtype`` and ``weights`` as
    :func:`resolve_weights` takes them."""
    torch_dtype = resolve_weights(weights, dtype, device)
    if weights == "as-shipped" and device.type != "cpu":
        log.warning("weights: as-shipped on %s: the GGUF's quantized matmuls are CPU kernels; loading it "
                    "dequantized, dense in %s", device, str(torch_dtype).removeprefix("torch."))
        weights = None

    def build():
        if weights == "as-shipped":
            from .quant import gguf_file, gguf_key, gguf_meta_dir, model_from_gguf

            gguf = gguf_file(model_path)
            meta = gguf_meta_dir(gguf)
            raw, _ = load_config(meta)
            model = model_from_gguf(gguf, raw, torch_dtype, device)
            # named as its converted directory would be
            return model, Tokenizer.from_model_dir(meta, raw), f"{gguf.stem}-{gguf_key(gguf)}"
        model_dir = resolve_model_dir(model_path)
        raw, _ = load_config(model_dir)
        if weights == "int8":
            from .quant import quantize_int8

            model = quantize_int8(load_model(model_dir, torch.float32, device), torch_dtype)
        else:
            model = load_model(model_dir, torch_dtype, device)
        return model, Tokenizer.from_model_dir(model_dir, raw), Path(model_dir).name

    return in_passing_thread(build)


__all__ = ["ModelNotFound", "UnsupportedModel", "resolve_model_dir", "convert_gguf", "load_config",
           "load_model", "model_from_tensors", "cache_root", "TORCH_DTYPES", "cpu_has_native_bf16",
           "resolve_dtype", "resolve_weights", "in_passing_thread", "load_for_engine"]
