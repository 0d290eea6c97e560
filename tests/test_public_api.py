"""The public plugin API: ``interlace`` exports what a plugin needs and never imports torch.

A plugin package's own tests must run where torch is not installed.  These
tests start a fresh interpreter in which ``import torch`` fails (a meta-path
hook), so an import of torch anywhere under ``interlace`` — or in the example
plugin and its tests — fails loudly instead of passing unnoticed.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import interlace

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "interlace-example-plugin"

#: Prepended to the code run in the subprocess: any import of torch raises.
BLOCK_TORCH = textwrap.dedent("""
    import importlib.abc, sys

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (import of {name!r})")
            return None

    sys.meta_path.insert(0, _NoTorch())
    sys.modules.pop("torch", None)
""")


def run_without_torch(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_the_blocker_blocks() -> None:
    """The hook works (otherwise the tests below prove nothing)."""
    proc = run_without_torch("import torch")
    assert proc.returncode != 0 and "torch is blocked" in proc.stderr


def test_import_interlace_does_not_import_torch() -> None:
    proc = run_without_torch("""
        import interlace
        from interlace import *
        import interlace.parsers
        host = interlace.PluginHost()  # built-in plugins and installed entry points
        host.tools(include_disabled=True); host.parsers(); host.list_plugins()
        assert "torch" not in sys.modules
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_public_names_are_exported() -> None:
    expected = {"hookimpl", "Veto", "Tool", "Granularity", "ToolError", "InvalidToolArguments", "ToolVetoed",
                "ToolTimeout", "ToolCrashed", "ToolCancelled", "UnknownTool", "ToolConfigError", "COMMON_SETTINGS",
                "StreamingParser", "Text", "ToolCallStart", "ArgumentsDelta", "FieldComplete", "LineComplete",
                "ToolCallEnd", "ParserError", "PluginHost", "PluginLoadError", "CPUTimeExceeded", "set_hard_limit",
                "ToolFormat", "FormatError", "CannotForce", "__version__"}
    assert expected <= set(interlace.__all__)
    assert all(hasattr(interlace, name) for name in interlace.__all__)


def test_example_plugin_uses_only_the_public_package() -> None:
    """The plugin and its tests import ``interlace`` itself, never its submodules."""
    sources = [*EXAMPLE.glob("interlace_example_plugin/*.py"), *EXAMPLE.glob("tests/*.py")]
    imported: set[str] = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    assert "interlace" in imported
    assert not {m for m in imported if m.startswith("interlace.")}


def interlace_imports(path: Path, package: str) -> set[str]:
    """The ``interlace`` modules a module of ``package`` imports (relative imports resolved), anywhere in it."""
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            if node.module:
                imported.add(f"{base}.{node.module}" if base else node.module)
            elif base == "interlace":  # from .. import X: the public API's names, or a subpackage
                imported.update(base if alias.name in interlace.__all__ else f"{base}.{alias.name}"
                                for alias in node.names)
            else:
                imported.add(base)
    return {m for m in imported if m == "interlace" or m.startswith("interlace.")}


def test_builtin_plugins_use_only_the_public_package() -> None:
    """The built-in plugins are written as any plugin is: of interlace they import ``interlace`` itself
    (and each other), never the gateway's internals (the python tool's CPU budget and limits included)."""
    modules = sorted((ROOT / "plugins").glob("*.py"))
    assert any(path.name == "python_tool.py" for path in modules)
    internal = {f"{path.name}: {m}" for path in modules for m in interlace_imports(path, "interlace.plugins")
                if m != "interlace" and m != "interlace.plugins" and not m.startswith("interlace.plugins.")}
    assert not internal


def test_the_plugin_import_check_sees_internal_imports(tmp_path: Path) -> None:
    """The check above is not vacuous: absolute, relative and lazy imports of internals are all caught."""
    source = tmp_path / "bad.py"
    source.write_text(textwrap.dedent("""
        from interlace import Tool
        from interlace.gateway.tools.worker import set_hard_limit
        from ..parsers import formats
        from .. import Veto, gateway
        from .calculator import CalculatorTool
        def later():
            import interlace.engine_ext.machine
    """))
    assert interlace_imports(source, "interlace.plugins") == {
        "interlace", "interlace.gateway.tools.worker", "interlace.parsers", "interlace.gateway",
        "interlace.plugins.calculator", "interlace.engine_ext.machine"}


def test_example_plugin_tests_pass_without_torch() -> None:
    """The example plugin's own suite, run as its author would, in an interpreter without torch."""
    proc = run_without_torch(f"""
        import pytest
        code = pytest.main(["-o", "addopts=", "-q", "-p", "no:cacheprovider", "--rootdir", {str(EXAMPLE)!r}, {str(EXAMPLE / "tests")!r}])
        assert "torch" not in sys.modules
        sys.exit(int(code))
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\b[1-9]\d* passed", proc.stdout) and not re.search(r"skipped|xfail|deselected", proc.stdout)
