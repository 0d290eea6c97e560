"""The client alone (issue 30): ``pip install ./sdk[langchain]`` (distribution interlace-client,
sdk/pyproject.toml) into a fresh venv gives ``interlace.sdk`` and ``ChatInterlace`` without torch,
transformers or the server's dependencies, and ChatInterlace from there talks to a live gateway.
Before, a client program had to install the whole server (torch included) to get them.

The venv is made with ``python -m venv`` (no system site packages) and filled from PyPI through
pip's cache; the test skips, saying so, only when PyPI cannot be reached.  Also here: in this
project's .venv, where scripts/setup.sh installs both projects editable, ``interlace`` is the
server's regular package and ``interlace.sdk`` the client's, from any folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.gateway_server import LiveGateway

REPO = Path(__file__).resolve().parent.parent
PYPI = ("pypi.org", 443)
# what a client-only install must not bring along (the server's stack), nor load
SERVER_SIDE = ["torch", "transformers", "starlette", "uvicorn", "interlace.gateway", "interlace.engine_ext"]

# run in the client's venv: imports, one ChatInterlace request, and what ended up loaded/importable
CLIENT = """
import importlib.metadata, importlib.util, json, sys
from interlace.sdk import AsyncClient, Client, Input, Output, semantic_function
from interlace.sdk.langchain import ChatInterlace, to_semantic
import interlace.sdk

llm = ChatInterlace(base_url=sys.argv[1], model="smollm2", api_key="unused", temperature=0, max_tokens=8,
                    max_retries=0)
reply = llm.invoke("Hi!")
heavy = json.loads(sys.argv[2])
print(json.dumps({"content": reply.content, "usage": reply.usage_metadata, "sdk": interlace.sdk.__file__,
                  "loaded": [m for m in heavy if m in sys.modules],
                  "importable": [m for m in heavy if importlib.util.find_spec(m) is not None],
                  "dists": sorted(d.metadata["Name"].lower() for d in importlib.metadata.distributions())}))
"""


def pypi_reachable() -> bool:
    try:
        socket.create_connection(PYPI, timeout=5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding interlace-client[langchain] and its dependencies: its python.  The
    client's wheel is built from a copy of sdk/ (no build folder left in the work tree); this
    venv's pip installs it into the new one (``--python``: the new venv needs no pip of its own,
    which saves the ~15 s of ensurepip; ``--no-compile``: ~15 s of byte-compiling langchain)."""
    root = tmp_path_factory.mktemp("client_only")
    shutil.copytree(REPO / "sdk", root / "sdk", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
                            str(root / "sdk")], cwd=root, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next((root / "dist").glob("interlace_client-*.whl"))
    run = subprocess.run([*pip, "--python", str(python), "install", "-q", "--no-compile", f"{wheel}[langchain]"],
                         cwd=root, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        if not pypi_reachable():
            pytest.skip(f"PyPI ({PYPI[0]}) is unreachable: the client's dependencies cannot be installed")
        pytest.fail(f"pip install interlace-client[langchain] failed:\n{run.stdout}\n{run.stderr}")
    return python


@pytest.fixture(scope="module")
def gateway():
    with LiveGateway({"models": {"smollm2": {"path": "embedded", "kv_cache_tokens": 2048, "dtype": "float32"}}}) as gw:
        yield gw


def test_the_client_alone_needs_no_server_and_talks_to_one(client_python: Path, gateway: LiveGateway,
                                                           tmp_path: Path) -> None:
    # -I: neither this checkout (cwd, PYTHONPATH) nor the user's site: only what the venv installed
    run = subprocess.run([str(client_python), "-I", "-c", CLIENT, gateway.url + "/v1", json.dumps(SERVER_SIDE)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(out["sdk"]).is_relative_to(client_python.parent.parent), out["sdk"]  # the installed copy
    assert out["importable"] == [] and out["loaded"] == [], out
    assert isinstance(out["content"], str) and out["usage"]["output_tokens"] > 0, out
    # the venv holds the client's distribution, not the server's
    assert "interlace-client" in out["dists"] and "interlace" not in out["dists"] and "torch" not in out["dists"]


def test_server_and_client_import_as_one_package_in_the_project_venv(tmp_path: Path) -> None:
    """Installed editable side by side (scripts/setup.sh), the client's portion must not turn
    ``interlace`` into an empty namespace package: checked from a folder outside the checkout."""
    code = ("import interlace, interlace.sdk.langchain; from interlace import Tool, hookimpl, __version__; "
            "print(interlace.__file__); print(interlace.sdk.__file__)")
    run = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(REPO / "interlace" / "__init__.py"), str(REPO / "sdk" / "__init__.py")]
