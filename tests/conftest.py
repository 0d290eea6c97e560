"""The suite's shared fixtures (models, a block zoo, a loaded engine).  Modules the tests import
and programs they start live in the ``helpers`` package beside this file (tests/helpers/)."""

import os
import tempfile

import pytest

# What a gateway keeps across restarts (the Responses API's stored responses: server.responses.path)
# goes to a directory of this run, never to the user's ~/.local/state; gateways the tests start as
# subprocesses inherit it.
os.environ["INTERLACE_STATE_DIR"] = tempfile.mkdtemp(prefix="interlace-state-")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random Llama / Qwen2 / Qwen3 checkpoints and their HF reference models."""
    from helpers.tiny_models import CONFIGS, make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {k: (root / k, make_tiny_model(k, root / k, seed=i)) for i, k in enumerate(CONFIGS)}


@pytest.fixture(scope="session")
def smol_dir():
    from interlace.engine_ext.embedded import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def smol_zoo(smol_dir, tmp_path_factory):
    """A block zoo holding the embedded SmolLM2 (``smol``), a full fine-tune of
    two of its layers (``smol-ft``, source directory ``zoo.ft_dir``) and a
    rank-16 LoRA adapter (``smol-lora``)."""
    from interlace.engine_ext.zoo import Zoo
    from interlace.engine_ext.zoo.variants import make_full_variant, make_lora_adapter

    root = tmp_path_factory.mktemp("smolzoo")
    z = Zoo(root / "zoo")
    z.add("smol", str(smol_dir))
    z.ft_dir = make_full_variant(smol_dir, root / "ft", layers=[12, 13], scale=0.05, seed=3)
    z.add("smol-ft", str(z.ft_dir), base="smol")
    z.add("smol-lora", str(make_lora_adapter(smol_dir, root / "ad", rank=16, seed=4)), base="smol")
    return z


@pytest.fixture(scope="session")
def smol_engine(smol_dir):
    from interlace.engine_ext.native.engine import NativeEngine

    eng = NativeEngine.load(smol_dir, kv_cache_tokens=8192)
    yield eng
    eng.close()
