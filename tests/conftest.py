import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random Llama / Qwen2 / Qwen3 checkpoints and their HF reference models."""
    from tiny_models import CONFIGS, make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {k: (root / k, make_tiny_model(k, root / k, seed=i)) for i, k in enumerate(CONFIGS)}


@pytest.fixture(scope="session")
def smol_dir():
    from interlace.engine_ext.embedded import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def smol_engine(smol_dir):
    from interlace.engine_ext.native.engine import NativeEngine

    eng = NativeEngine.load(smol_dir, kv_cache_tokens=8192)
    yield eng
    eng.close()


def run(coro):
    return asyncio.run(coro)
