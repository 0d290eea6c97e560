"""The native engine's settings are declared once (``engine_ext/native/options.py``), torch-free,
and the engine takes exactly what they declare: every named dtype, weights format and attention
backend is accepted (or refused only for this machine's reasons), anything else is refused with
the declared names, and every load key reaches :meth:`NativeEngine.load`."""

import inspect
import subprocess
import sys

import pytest
import torch

from interlace.engine_ext.native import options
from interlace.engine_ext.native.attention import choose_backend
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.native.loader import TORCH_DTYPES, resolve_dtype, resolve_weights

CPU = torch.device("cpu")


def test_options_import_without_torch():
    """The gateway's config schema reads them: importing them must not need torch."""
    code = ("import sys; sys.modules['torch'] = None  # any import of torch fails\n"
            "from interlace.engine_ext.native import options\n"
            "print(options.one_of(options.ATTENTION))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "'auto', 'kernel', 'triton' or 'torch'"


def test_every_declared_dtype_and_weights_format_is_taken():
    for name in (*options.DTYPES, *options.DTYPE_ALIASES):
        assert isinstance(resolve_dtype(name, CPU), torch.dtype)
    assert set(TORCH_DTYPES) == {*options.DTYPES, *options.DTYPE_ALIASES} - {"auto"}
    for alias, name in options.DTYPE_ALIASES.items():
        assert TORCH_DTYPES[alias] is TORCH_DTYPES[name]
    with pytest.raises(ValueError, match=r"dtype must be 'auto' or one of \['bf16', 'bfloat16', 'float16'"):
        resolve_dtype("fp64", CPU)
    for weights in options.WEIGHTS:
        assert isinstance(resolve_weights(weights, None, CPU), torch.dtype)
    with pytest.raises(ValueError, match=r"weights must be one of \['as-shipped', 'float32', 'bfloat16', 'int8'\]"):
        resolve_weights("int4", None, CPU)


def test_every_declared_attention_backend_is_known():
    """Each name gives a backend of that name (``auto``: another declared one) or is refused for
    a reason of this machine, never as an unknown name."""
    for name in options.ATTENTION:
        try:
            backend = choose_backend(name, CPU)
        except ValueError as e:
            assert "attention must be" not in str(e) and name in ("kernel", "triton"), e
            continue
        assert backend.name in options.ATTENTION and (backend.name == name or name == "auto")
    with pytest.raises(ValueError, match="attention must be 'auto', 'kernel', 'triton' or 'torch', not 'flash'"):
        choose_backend("flash", CPU)


def test_every_load_key_reaches_the_engine(tiny_dirs):
    """Each declared key is a keyword of NativeEngine.load (or of the constructor it passes the
    rest to), and a load given all of them at once starts (the CUDA ones are ignored on a CPU)."""
    load = set(inspect.signature(NativeEngine.load).parameters)
    init = set(inspect.signature(NativeEngine.__init__).parameters)
    assert set(options.LOAD_KEYS) <= (load | init) - {"self", "cls", "model_path", "kw"}
    values = {"dtype": "float32", "weights": "float32", "device": "cpu", "block_size": 4, "kv_cache_tokens": 64,
              "max_batched_tokens": 16, "max_seqs": 4, "max_model_len": 32, "attention": "torch",
              "cuda_graphs": False, "gpu_memory_utilization": 0.5, "adapt_threads": False}
    assert set(values) == set(options.LOAD_KEYS)
    with NativeEngine.load(tiny_dirs["llama"][0], **values) as eng:
        assert (eng.blocks.num_blocks, eng.max_model_len, eng.runner.attention.name) == (16, 32, "torch")
        assert eng.threads is None  # adapt_threads reached it
