"""The plugin host: loading, hook-name checking, registrations, veto, listing, entry points."""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from interlace.gateway.hookspecs import hookimpl
from interlace.gateway.plugin_host import DuplicateRegistration, PluginHost, PluginLoadError
from interlace.gateway.tools import Tool

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "interlace-example-plugin"


@pytest.fixture(scope="session")
def example_plugin_installed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Make sure the example plugin is installed (the setup script normally does it).

    Installed from a copy, non-editable, so the running interpreter can import
    it at once and the example directory gets no build artefacts.
    """
    try:
        importlib.metadata.distribution("interlace-example-plugin")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    src = tmp_path_factory.mktemp("example") / "plugin"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(src)],
        check=True, capture_output=True, timeout=120,
    )
    importlib.invalidate_caches()


class Echo(Tool):
    name = "echo"

    def on_finish(self, arguments: dict[str, Any]) -> Any:
        return arguments


class EchoPlugin:
    @hookimpl
    def register_tools(self, register):
        register(Echo())


# --------------------------------------------------------------------------- loading


def test_builtin_tools_collected_and_configured(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    db.write_bytes(b"")
    host = PluginHost({"sqlite": {"database": str(db), "max_rows": 3}, "python": {"cpu_time_s": 2}},
                      entrypoints=False)
    tools = host.tools()
    assert {"python", "calculator", "format", "sqlite"} <= set(tools)
    assert "search" not in tools and "search" in host.tools(include_disabled=True)  # no corpus configured
    assert tools["sqlite"].max_rows == 3 and tools["python"].cpu_time_s == 2
    assert tools["python"].spec()["function"]["name"] == "python"


def test_misspelled_hook_fails_at_load_with_suggestion() -> None:
    class Typo:
        @hookimpl
        def register_tool(self, register):  # missing "s"
            pass

    with pytest.raises(PluginLoadError, match=r"unknown hook 'register_tool'.*did you mean 'register_tools'"):
        PluginHost(entrypoints=False, plugins=[Typo()])


def test_misspelled_hook_argument_fails_at_load() -> None:
    class BadArg:
        @hookimpl
        def before_tool_execution(self, tool, arguments):  # "tool" is not a hookspec argument
            return None

    with pytest.raises(PluginLoadError, match="tool"):
        PluginHost(entrypoints=False, plugins=[BadArg()])


def test_duplicate_tool_name_names_both_plugins() -> None:
    class Other:
        @hookimpl
        def register_tools(self, register):
            register(Echo())

    host = PluginHost(entrypoints=False, plugins=[EchoPlugin(), Other()])
    with pytest.raises(DuplicateRegistration, match="'echo' is registered by both"):
        host.tools()

    class Shadow:  # a plugin may not replace a built-in either
        @hookimpl
        def register_tools(self, register):
            tool = Echo()
            tool.name = "python"
            register(tool)

    with pytest.raises(DuplicateRegistration, match="'python'"):
        PluginHost(entrypoints=False, plugins=[Shadow()]).tools()


def test_non_tool_registration_rejected() -> None:
    class Wrong:
        @hookimpl
        def register_tools(self, register):
            register(lambda: None)

    with pytest.raises(PluginLoadError, match="not an interlace Tool"):
        PluginHost(entrypoints=False, plugins=[Wrong()]).tools()


def test_parsers_collected_and_duplicates_rejected() -> None:
    class P1:
        @hookimpl
        def register_parsers(self, register):
            register("hermes", dict)

    class P2:
        @hookimpl
        def register_parsers(self, register):
            register("hermes", list)

    assert PluginHost(entrypoints=False, builtins=(), plugins=[P1()]).parsers() == {"hermes": dict}
    with pytest.raises(DuplicateRegistration, match="parser 'hermes'"):
        PluginHost(entrypoints=False, builtins=(), plugins=[P1(), P2()]).parsers()


# --------------------------------------------------------------------------- runtime hooks


class Allow:
    @hookimpl
    def before_tool_execution(self, tool_name, arguments, request):
        return None


class DenyEcho:
    @hookimpl
    def before_tool_execution(self, tool_name, arguments, request):
        if tool_name == "echo" and arguments.get("secret"):
            return f"no secrets for {request}"
        return None


def test_veto_first_non_none_wins() -> None:
    host = PluginHost(entrypoints=False, builtins=(), plugins=[EchoPlugin(), DenyEcho(), Allow()])
    assert host.before_tool_execution("echo", {"secret": 1}, "bob") == "no secrets for bob"
    assert host.before_tool_execution("echo", {}, "bob") is None

    async def main() -> tuple[Any, Any]:
        runtime = host.create_runtime()
        await runtime.start()
        try:
            vetoed = await runtime.run("echo", {"secret": 1}, request="eve")
            allowed = await runtime.run("echo", {"x": 1}, request="eve")
            return vetoed, allowed
        finally:
            await runtime.close()

    vetoed, allowed = asyncio.run(main())
    assert not vetoed.ok and vetoed.error_type == "ToolVetoed" and vetoed.error == "no secrets for eve"
    assert allowed.ok and allowed.content == {"x": 1}


def test_startup_hook_receives_app() -> None:
    seen = []

    class Starter:
        @hookimpl
        def startup(self, app):
            seen.append(app)

    PluginHost(entrypoints=False, builtins=(), plugins=[Starter()]).startup("the-app")
    assert seen == ["the-app"]


# --------------------------------------------------------------------------- entry points and listing


def test_example_plugin_discovered_through_entry_point(example_plugin_installed: None) -> None:
    host = PluginHost({"word_count": {"lowercase": False}})
    assert "word_count" in host.tools() and host.tools()["word_count"].lowercase is False
    listing = {p["name"]: p for p in host.list_plugins()}
    example = listing["word_count"]
    assert example["package"] == "interlace-example-plugin" and example["version"] == "0.1.0"
    assert not example["builtin"] and example["hooks"] == ["register_tools"]
    assert [t["name"] for t in example["tools"]] == ["word_count"] and example["tools"][0]["granularity"] == "ON_FIELD"
    builtins = [p for p in listing.values() if p["builtin"]]  # built-in tools and built-in parsers
    assert all(p["package"] == "interlace" and p["version"] for p in builtins)
    tools = [t for p in builtins for t in p["tools"]]
    assert {t["name"] for t in tools} >= {"python", "calculator", "sqlite", "search", "format"}
    assert next(t for t in tools if t["name"] == "sqlite")["enabled"] is False
    assert {n for p in builtins for n in p["parsers"]} >= {"hermes", "markdown", "plan"}
    import json

    json.dumps(host.list_plugins())  # plain data, ready for GET /v1/plugins


def test_entry_points_can_be_skipped(example_plugin_installed: None) -> None:
    assert "word_count" not in PluginHost(entrypoints=False).tools()


def test_common_tool_settings_apply_to_every_tool() -> None:
    import asyncio

    import psutil

    host = PluginHost({"calculator": {"workers": 2, "timeout_s": 3, "nice": 5}}, builtins=(), entrypoints=False,
                      plugins=[_OnlyCalculator()])
    calc = host.tools()["calculator"]
    assert (calc.workers, calc.timeout_s, calc.nice) == (2, 3.0, 5)

    async def main():
        runtime = host.create_runtime()
        await runtime.start()
        try:
            pids = runtime.worker_pids()
            return [psutil.Process(p).nice() for p in pids]
        finally:
            await runtime.close()

    nices = asyncio.run(main())
    assert len(nices) == 2 and all(n >= 5 for n in nices)
    with pytest.raises(PluginLoadError):
        PluginHost({"calculator": {"workers": "many"}}).tools()


class _OnlyCalculator:
    """A plugin registering just the built-in calculator (so the runtime starts one pool)."""

    @hookimpl
    def register_tools(self, register):
        from interlace.plugins.calculator import CalculatorTool

        register(CalculatorTool())
