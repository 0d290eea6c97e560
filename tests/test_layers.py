"""The layers, held: import-linter checks pyproject's ``[tool.importlinter]`` contracts on every run.

The contracts say what each room may import (docs/design.md, "Layers"): parsers and engine_ext import
neither the gateway nor bench, plugins import only the public API, the policies never import torch,
the SDK imports neither the gateway nor an engine, no import circles join the rooms, and the gateway
has none at all.  A change that breaks one fails here with import-linter's report, which names the
offending import lines.

Why the graph is built here, not by the ``lint-imports`` command: grimp (import-linter's graph
builder) walks a root package's own folder, and interlace's subpackages live in folders of their own
(pyproject's ``package-dir``: ``interlace.gateway`` is gateway/), so the command would see only
interlace/.  :class:`PackageDirGraph` walks each mapped folder under its package's name, giving the
modules and imports a wheel's single folder gives.

The last test runs the same contracts on a small tree of the same shape, clean and then with one
upward import at a time, so that a contract which could never break (a misspelt module, a builder
that saw nothing) cannot pass unnoticed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 11):  # import-linter needs 3.11; the test extra installs it from there on
    pytest.skip("import-linter needs Python 3.11", allow_module_level=True)

import tomllib

import importlinter.configuration
from grimp.adaptors.modulefinder import ModuleFinder
from grimp.application.config import settings as grimp_settings
from grimp.application.ports.packagefinder import AbstractPackageFinder
from importlinter.adapters.building import GraphBuilder
from importlinter.application import use_cases
from importlinter.application.app_config import settings as importlinter_settings
from importlinter.application.output import console

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"


class PackageDirGraph(GraphBuilder, AbstractPackageFinder, ModuleFinder):
    """import-linter's graph builder for a package whose subpackages live in folders of their own.

    ``package_dirs`` maps a package to its folder, as setuptools' ``package-dir`` does.  grimp asks
    its package finder for the root package's folders (here: every mapped folder under the root)
    and names each folder's modules by the package its module finder reports (here: the package
    that folder is mapped to)."""

    def __init__(self, package_dirs: dict[str, Path]):
        self.packages = {str(folder): name for name, folder in package_dirs.items()}

    def determine_package_directories(self, package_name, file_system):
        return {folder for folder, name in self.packages.items()
                if name == package_name or name.startswith(package_name + ".")}

    def find_package(self, package_name, package_directory, file_system):
        return super().find_package(self.packages[package_directory], package_directory, file_system)

    def build(self, root_package_names, cache_dir, include_external_packages=False,
              exclude_type_checking_imports=False):
        before = {"PACKAGE_FINDER": grimp_settings.PACKAGE_FINDER, "MODULE_FINDER": grimp_settings.MODULE_FINDER}
        grimp_settings.configure(PACKAGE_FINDER=self, MODULE_FINDER=self)
        try:
            return super().build(root_package_names, cache_dir=None,  # no cache folders in the tree
                                 include_external_packages=include_external_packages,
                                 exclude_type_checking_imports=exclude_type_checking_imports)
        finally:
            grimp_settings.configure(**before)


def lint(package_dirs: dict[str, Path], contract: str | None = None) -> tuple[bool, str]:
    """Check the contracts of pyproject.toml (only ``contract``, an id, when given) on the package
    in ``package_dirs``: (whether all were kept, import-linter's report)."""
    importlinter.configuration.configure()
    importlinter_settings.configure(GRAPH_BUILDER=PackageDirGraph(package_dirs))
    with console.capture() as report:
        kept = use_cases.lint_imports(str(PYPROJECT), limit_to_contracts=(contract,) if contract else (),
                                      cache_dir=None, no_logo=True)
    return kept, report.get()


def interlace_package_dirs() -> dict[str, Path]:
    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in setuptools["package-dir"].items()}


def test_the_layers_hold():
    kept, report = lint(interlace_package_dirs())
    assert kept, "an import runs up the layers (docs/design.md, \"Layers\"):\n" + report


def test_the_graph_holds_every_package():
    """Every package pyproject installs is in the graph the contracts are checked on (the builder
    saw the gateway, the engine, ...: a contract on a module it missed would hold vacuously)."""
    graph = PackageDirGraph(interlace_package_dirs()).build(["interlace"], cache_dir=None,
                                                            include_external_packages=True)
    packages = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["packages"]
    assert set(packages) <= graph.modules, set(packages) - graph.modules
    assert "torch" in graph.modules  # external packages are in it: the policies' contract needs them


# A tree of interlace's shape: each module's imports, clean (every contract kept).  The public API
# re-exports from the gateway as the real one does, and a plugin imports it: allowed.
TREE = {
    "interlace/__init__.py": "from interlace.gateway.tools.base import Tool\n",
    "interlace/hookspecs.py": "import pluggy\n",
    "interlace/cli.py": "from .gateway import app\n",
    "gateway/__init__.py": "",
    "gateway/app.py": "from .openai import routes\nfrom .tools import base\nfrom .. import hookspecs\n",
    "gateway/openai/__init__.py": "",
    "gateway/openai/routes.py": "from . import completions\nfrom ..tools import base\n",
    "gateway/openai/completions.py": "from ...parsers import base\nfrom ...engine_ext import protocol\n",
    "gateway/tools/__init__.py": "",
    "gateway/tools/base.py": "",
    "gateway/tools/worker.py": "import resource\n",
    "engine_ext/__init__.py": "",
    "engine_ext/protocol.py": "from .policies import spec\n",
    "engine_ext/engine.py": "import torch\nfrom . import protocol\n",
    "engine_ext/policies/__init__.py": "",
    "engine_ext/policies/spec.py": "import math\n",
    "parsers/__init__.py": "",
    "parsers/base.py": "import json\nfrom .. import hookspecs\n",
    "plugins/__init__.py": "",
    "plugins/calculator.py": "from interlace import Tool\n",
    "sdk/__init__.py": "",
    "sdk/client.py": "import httpx\n",
    "bench/__init__.py": "",
    "bench/engine.py": "from ..engine_ext import engine\nfrom ..gateway import app\n",
}
PACKAGE_DIRS = {"interlace": "interlace", "interlace.gateway": "gateway", "interlace.engine_ext": "engine_ext",
                "interlace.parsers": "parsers", "interlace.plugins": "plugins", "interlace.sdk": "sdk",
                "interlace.bench": "bench"}

# (contract id, module, the line added to it): each breaks that contract, directly or through
# another module's imports.
VIOLATIONS = [
    ("below-the-gateway", "parsers/base.py", "from ..gateway.tools import worker\n"),
    ("below-the-gateway", "engine_ext/protocol.py", "from ..bench import engine\n"),
    ("below-the-gateway", "parsers/base.py", "from interlace import Tool\n"),  # the public API imports the gateway
    ("plugins-public-api", "plugins/calculator.py", "from interlace.gateway.tools.worker import set_hard_limit\n"),
    ("plugins-public-api", "plugins/calculator.py", "from ..parsers import base\n"),
    ("plugins-public-api", "plugins/calculator.py", "from interlace.hookspecs import hookimpl\n"),
    ("policies-torch-free", "engine_ext/policies/spec.py", "import torch\n"),
    ("policies-torch-free", "engine_ext/policies/spec.py", "from .. import engine\n"),  # engine imports torch
    ("sdk-http-only", "sdk/client.py", "from ..engine_ext import protocol\n"),
    ("sdk-http-only", "sdk/client.py", "from interlace.gateway import app\n"),
    ("rooms-acyclic", "gateway/app.py", "from ..bench import engine\n"),  # bench imports the gateway
    ("gateway-acyclic", "gateway/tools/base.py", "from .. import app\n"),  # a circle between wing and root
    ("gateway-acyclic", "gateway/openai/completions.py", "from . import routes\n"),  # within one wing
]


def write_tree(root: Path, extra: tuple[str, str] | None = None) -> dict[str, Path]:
    for rel, text in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + (extra[1] if extra and extra[0] == rel else ""))
    return {name: root / folder for name, folder in PACKAGE_DIRS.items()}


def test_the_contracts_catch_upward_imports(tmp_path):
    kept, report = lint(write_tree(tmp_path / "clean"))
    assert kept, report
    assert {c["id"] for c in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]} \
        == {contract for contract, _, _ in VIOLATIONS}  # every contract has a case that breaks it
    for i, (contract, module, line) in enumerate(VIOLATIONS):
        kept, report = lint(write_tree(tmp_path / str(i), (module, line)), contract)
        assert not kept, f"{contract} kept with {line.strip()!r} in {module}:\n{report}"
        assert "BROKEN" in report, report


def test_the_engine_protocol_lists_what_the_gateway_calls():
    """Every ``engine.X`` / ``<model>.engine.X`` the gateway reads is a member of the Engine protocol
    (engine_ext/protocol.py), so the protocol is the whole seam and the gateway's seams can be typed
    with it.  ``inner`` is read only after ``isinstance(engine, VariantEngine)``."""
    import ast

    from interlace.engine_ext.protocol import Engine

    members = {n for n in dir(Engine) if not n.startswith("_")} | set(Engine.__annotations__)
    narrowed = {"inner"}
    outside = []
    for path in sorted((REPO / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            owner = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
            if owner == "engine" and node.attr not in members | narrowed:
                outside.append(f"{path.relative_to(REPO)}:{node.lineno}: engine.{node.attr}")
    assert not outside, "the gateway calls engine members the Engine protocol does not list:\n" + "\n".join(outside)
    # and the protocol names what the gateway needs beyond the commands
    assert {"tokenizer", "max_model_len", "vocab_size", "free_context_nowait", "context_tokens", "load_stats",
            "close"} <= members
