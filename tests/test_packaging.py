"""Packaging: both distributions build without a setuptools warning, each holds its own files, and
they agree on the version.

The server (pyproject.toml, distribution ``interlace``) and the client (sdk/pyproject.toml,
``interlace-client``: interlace.sdk and interlace.sdk.langchain) are built by setuptools' own
backend in a copy of the tree (a build folder left in the work tree would leak into the wheel).
Why: ``scripts/setup.sh`` printed about 40 lines of setuptools warnings (``interlace.bench.data``
absent from ``packages``, issue 30); and the client's version is written in sdk/pyproject.toml
as well, since setuptools reads no file outside a project's folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def source_copy(dest: Path) -> Path:
    """The files git would ship (tracked, and new ones not ignored) copied to ``dest``."""
    if not (REPO / ".git").exists():
        pytest.skip("needs the git work tree (git ls-files) to copy the sources")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


# setuptools' PEP 517 hook in a process of its own, as pip runs it: the UserWarnings it emits (what
# pip prints as "BuildBackendWarning") are recorded and printed with the wheel's name
HOOK = """
import json, sys, warnings
import setuptools.build_meta as backend
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    wheel = getattr(backend, sys.argv[1])(sys.argv[2])
print("RESULT=" + json.dumps({"wheel": wheel, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught
                                                         if issubclass(w.category, UserWarning)]}))
"""
# setuptools ends every editable install made with a meta path finder (our layouts map folders to
# packages) with this notice, whatever the configuration; scripts/setup.sh filters it out of pip's output
EDITABLE_NOTICE = "InformationOnly: Editable installation."


def build(project: Path, out: Path, hook: str) -> tuple[Path, list[str]]:
    """setuptools' ``hook`` (build_wheel, build_editable) run on ``project``: the wheel, and the
    warnings (emitted ones, and distutils' ``warning:`` lines in the output)."""
    out.mkdir(exist_ok=True)
    # PYTHONDONTWRITEBYTECODE (set in this environment) makes setuptools warn that it skips byte-compiling
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    run = subprocess.run([sys.executable, "-c", HOOK, hook, str(out)], cwd=project, capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(next(line[7:] for line in run.stdout.splitlines() if line.startswith("RESULT=")))
    logged = [line for line in (run.stdout + run.stderr).splitlines()
              if "warning" in line.lower() and not line.startswith("RESULT=")]
    emitted = [w for w in result["warnings"] if not w.startswith(EDITABLE_NOTICE)]
    return out / result["wheel"], emitted + logged


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return source_copy(tmp_path_factory.mktemp("src"))


@pytest.mark.parametrize("hook", ["build_wheel", "build_editable"])
def test_the_server_builds_without_setuptools_warnings(tree: Path, tmp_path: Path, hook: str) -> None:
    wheel, warnings = build(tree, tmp_path / "dist", hook)
    assert warnings == [], "\n".join(warnings)
    if hook == "build_wheel":
        names = set(zipfile.ZipFile(wheel).namelist())
        assert {"interlace/bench/data/declaration_lincoln.txt", "interlace/bench/data/README.md",
                "interlace/__init__.py", "interlace/gateway/app.py"} <= names
        assert not [n for n in names if n.startswith("interlace/sdk/")], "the client's files belong to interlace-client"


def test_the_client_builds_without_setuptools_warnings_and_holds_only_the_sdk(tree: Path, tmp_path: Path) -> None:
    wheel, warnings = build(tree / "sdk", tmp_path / "dist", "build_wheel")
    assert warnings == [], "\n".join(warnings)
    names = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("interlace_client-")}
    assert {"interlace/sdk/__init__.py", "interlace/sdk/client.py", "interlace/sdk/langchain/chat_model.py"} <= names
    # a portion of the namespace: no interlace/__init__.py (the server's), no pyproject or README as data
    assert all(n.startswith("interlace/sdk/") and n.endswith(".py") for n in names), sorted(names)


def test_the_client_is_the_servers_version_and_the_server_pins_it() -> None:
    server = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((REPO / "sdk" / "pyproject.toml").read_text())["project"]
    assert client["version"] == server["version"]
    assert f"interlace-client=={server['version']}" in server["dependencies"]
    assert "interlace-client[langchain]" in server["optional-dependencies"]["langchain"]
    # what the test extra installs beside the client's extra is the same langchain-core
    core = [d for d in client["optional-dependencies"]["langchain"] if d.startswith("langchain-core")]
    assert core and set(core) <= set(server["optional-dependencies"]["test"])
    assert client["dependencies"] == ["httpx>=0.27"]
