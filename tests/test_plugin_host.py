"""The plugin host: loading, hook-name checking, registrations, veto, listing, entry points."""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from interlace import (DuplicateRegistration, PluginHost, PluginLoadError, StreamingParser, Tool, ToolVetoed, Veto,
                       hookimpl)
from interlace.gateway.plugin_host import BUILTIN_PLUGINS
from interlace.parsers import HermesParser, MarkdownCodeParser

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "interlace-example-plugin"


def _installed_example_is_current() -> bool:
    try:
        importlib.metadata.distribution("interlace-example-plugin")
    except importlib.metadata.PackageNotFoundError:
        return False
    spec = importlib.util.find_spec("interlace_example_plugin")
    source = EXAMPLE / "interlace_example_plugin" / "__init__.py"
    return spec is not None and spec.origin is not None and Path(spec.origin).read_bytes() == source.read_bytes()


@pytest.fixture(scope="session")
def example_plugin_installed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Make sure the example plugin is installed and current (the setup script normally does it).

    Installed from a copy, non-editable, so the running interpreter can import
    it at once and the example directory gets no build artefacts.  A stale
    install (the source changed since) is replaced.
    """
    if _installed_example_is_current():
        return
    src = tmp_path_factory.mktemp("example") / "plugin"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--force-reinstall",
         str(src)],
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


# --------------------------------------------------------------------------- built-ins, named once


def _is_hookimpl(decorator: ast.expr) -> bool:
    """``@hookimpl``, ``@hookimpl(...)`` or ``@<module>.hookimpl``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)) == "hookimpl"


def _modules_with_hooks() -> set[str]:
    """The package's modules that implement a hook at module level (built-in plugin modules), by name.

    Not bench/: its tool plugin is loaded by the benchmark's own config (``plugin_modules``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = set()
    for package, folder in project["tool"]["setuptools"]["package-dir"].items():
        if package == "interlace.bench":
            continue
        for path in (ROOT / folder).rglob("*.py"):
            body = ast.parse(path.read_text()).body
            if any(isinstance(node, ast.FunctionDef) and any(map(_is_hookimpl, node.decorator_list))
                   for node in body):
                parts = path.relative_to(ROOT / folder).with_suffix("").parts
                found.add(".".join((package, *parts)).removesuffix(".__init__"))
    return found


def test_builtin_plugins_are_named_once_and_each_registered_once() -> None:
    """BUILTIN_PLUGINS is the one list of built-in plugins: every module of the package with a hook
    implementation is on it (else the gateway never registers it), pyproject declares none of them as an
    entry point too, and a host loading entry points as the gateway does registers each exactly once,
    under its module name, as a built-in."""
    assert _modules_with_hooks() == set(BUILTIN_PLUGINS)
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("entry-points", {})
    assert not set(entry_points.get("interlace", {}).values()) & set(BUILTIN_PLUGINS)
    listing = PluginHost().list_plugins()
    for module in BUILTIN_PLUGINS:
        (entry,) = [p for p in listing if p["module"] == module]
        assert entry["name"] == module and entry["builtin"] and entry["package"] == "interlace", entry


# --------------------------------------------------------------------------- loading


def test_builtin_tools_collected_and_configured(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    db.write_bytes(b"")
    host = PluginHost({"sqlite": {"database": str(db), "max_rows": 3}, "python": {"cpu_s": 2, "memory_mb": 512}},
                      entrypoints=False)
    tools = host.tools()
    assert {"python", "calculator", "format", "sqlite"} <= set(tools)
    assert "search" not in tools and "search" in host.tools(include_disabled=True)  # no corpus configured
    assert tools["sqlite"].max_rows == 3 and (tools["python"].cpu_s, tools["python"].memory_mb) == (2.0, 512)
    assert tools["python"].spec()["function"]["name"] == "python"


def test_builtin_tools_declare_their_settings() -> None:
    """Every built-in tool's own settings are in its settings_schema (else the host rejects them)."""
    tools = PluginHost(entrypoints=False).tools(include_disabled=True)
    declared = {name: set(tool.settings_schema.get("properties", {})) for name, tool in tools.items()}
    assert {"database", "max_rows"} <= declared["sqlite"] and {"corpus"} <= declared["search"]
    with pytest.raises(PluginLoadError, match="tool 'sqlite': unknown setting 'databse'"):
        PluginHost({"sqlite": {"databse": "x.db"}}, entrypoints=False).tools()


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
            register("hermes", HermesParser)

    class P2:
        @hookimpl
        def register_parsers(self, register):
            register("hermes", MarkdownCodeParser)

    assert PluginHost(entrypoints=False, builtins=(), plugins=[P1()]).parsers() == {"hermes": HermesParser}
    with pytest.raises(DuplicateRegistration, match="parser 'hermes'"):
        PluginHost(entrypoints=False, builtins=(), plugins=[P1(), P2()]).parsers()


def test_parser_without_a_format_is_a_load_error_naming_the_plugin() -> None:
    class NoFormat(StreamingParser):
        pass

    class Plugin:
        @hookimpl
        def register_parsers(self, register):
            register("bare", NoFormat)

    host = PluginHost(entrypoints=False, builtins=(), plugins=[Plugin()])
    with pytest.raises(PluginLoadError, match=r"parser 'bare' of plugin '.*' has no `format`"):
        host.parsers()


# --------------------------------------------------------------------------- the policy hook


def policy_plugin(answer: Any = None, *, raises: BaseException | None = None, **opts: Any) -> object:
    """A plugin whose before_tool_execution answers ``answer`` (or raises) for ``echo`` calls."""

    class Policy:
        @hookimpl(**opts)
        def before_tool_execution(self, tool_name, arguments, request):
            if tool_name != "echo":
                return None
            if raises is not None:
                raise raises
            return answer

    return Policy()


def test_veto_returned_or_raised_refuses_and_none_allows() -> None:
    host = PluginHost(entrypoints=False, builtins=(), plugins=[policy_plugin(Veto("no echo for you"))])
    assert host.before_tool_execution("echo", {}, None) == "no echo for you"
    host = PluginHost(entrypoints=False, builtins=(), plugins=[policy_plugin(raises=ToolVetoed("raised no"))])
    assert host.before_tool_execution("echo", {}, None) == "raised no"
    host = PluginHost(entrypoints=False, builtins=(), plugins=[policy_plugin(None)])
    assert host.before_tool_execution("echo", {}, None) is None
    with pytest.raises(TypeError):
        Veto("")  # a veto always says why


@pytest.mark.parametrize("answer", [True, False, "a bare string", 0, {"allow": True}])
def test_any_other_answer_is_a_plugin_error_that_refuses(answer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """`llm`'s hook returns True to allow: here that is neither an allow nor a veto but a loud,
    fail-closed error naming the plugin (and so is a legacy string veto)."""
    host = PluginHost(entrypoints=False, builtins=(), plugins=[policy_plugin(answer)])
    (listing,) = host.list_plugins()
    name = listing["name"]
    with caplog.at_level(logging.ERROR, logger="interlace.gateway.plugin_host"):
        message = host.before_tool_execution("echo", {}, None)
    assert message is not None and f"plugin {name!r}" in message and repr(answer) in message
    assert "return None to allow" in message
    assert any(f"plugin {name!r}" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert host.before_tool_execution("other", {}, None) is None  # only the answer it gave was wrong


def test_a_raising_policy_refuses_and_names_the_plugin() -> None:
    host = PluginHost(entrypoints=False, builtins=(), plugins=[policy_plugin(raises=KeyError("user"))])
    message = host.before_tool_execution("echo", {}, None)
    assert message is not None and "raised KeyError" in message and "plugin '" in message


class DenySecrets:
    @hookimpl
    def before_tool_execution(self, tool_name, arguments, request):
        if tool_name == "echo" and arguments.get("secret"):
            return Veto(f"no secrets for {request['key']}")
        return None


def test_runtime_applies_the_policy_with_the_request() -> None:
    host = PluginHost(entrypoints=False, builtins=(), plugins=[EchoPlugin(), DenySecrets(), policy_plugin(None)])
    request = {"model": "m", "user": None, "key": "eve"}

    async def main() -> tuple[Any, Any]:
        runtime = host.create_runtime()
        await runtime.start()
        try:
            vetoed = await runtime.run("echo", {"secret": 1}, request=request)
            allowed = await runtime.run("echo", {"x": 1}, request=request)
            return vetoed, allowed
        finally:
            await runtime.close()

    vetoed, allowed = asyncio.run(main())
    assert not vetoed.ok and vetoed.error_type == "ToolVetoed" and vetoed.error == "no secrets for eve"
    assert allowed.ok and allowed.content == {"x": 1}


def test_llm_style_true_refuses_through_the_runtime() -> None:
    host = PluginHost(entrypoints=False, builtins=(), plugins=[EchoPlugin(), policy_plugin(True)])

    async def main() -> Any:
        async with host.create_runtime() as runtime:
            return await runtime.run("echo", {"x": 1})

    result = asyncio.run(main())
    assert not result.ok and result.error_type == "ToolVetoed" and "returned True" in result.error


def test_policy_order_honours_tryfirst_and_trylast() -> None:
    """Registered last-first, pluggy calls ``late``, ``plain``, then ``early``; tryfirst/trylast reorder."""
    last = policy_plugin(Veto("last"), trylast=True)
    first = policy_plugin(Veto("first"), tryfirst=True)
    plain = policy_plugin(Veto("plain"))
    host = PluginHost(entrypoints=False, builtins=(), plugins=[first, plain, last])
    assert host.before_tool_execution("echo", {}, None) == "first"
    host = PluginHost(entrypoints=False, builtins=(), plugins=[last, plain])
    assert host.before_tool_execution("echo", {}, None) == "plain"


def test_hook_wrappers_see_and_may_change_the_verdict() -> None:
    seen: list[Any] = []

    class Audit:  # new-style wrapper: sees the verdict and may replace it
        @hookimpl(wrapper=True)
        def before_tool_execution(self, tool_name, arguments, request):
            verdict = yield
            seen.append(("new", verdict))
            return None if request == "admin" else verdict

    class OldAudit:  # old-style hookwrapper: sees the outcome
        @hookimpl(hookwrapper=True)
        def before_tool_execution(self, tool_name, arguments, request):
            outcome = yield
            seen.append(("old", outcome.get_result()))

    host = PluginHost(entrypoints=False, builtins=(), plugins=[policy_plugin(Veto("no")), Audit(), OldAudit()])
    assert host.before_tool_execution("echo", {}, "user") == "no"
    assert [kind for kind, _ in seen] == ["new", "old"]
    assert all(isinstance(v, Veto) and v.reason == "no" and v.plugin for _, v in seen)
    assert host.before_tool_execution("echo", {}, "admin") is None  # the wrapper overrode the veto


def test_startup_hook_receives_app() -> None:
    seen = []

    class Starter:
        @hookimpl
        def startup(self, app):
            seen.append(app)

    PluginHost(entrypoints=False, builtins=(), plugins=[Starter()]).startup("the-app")
    assert seen == ["the-app"]


# --------------------------------------------------------------------------- registration order and attribution


def test_register_tools_order_honours_tryfirst_and_trylast() -> None:
    def tool_plugin(tool_name: str, **opts: Any) -> object:
        class Plugin:
            @hookimpl(**opts)
            def register_tools(self, register):
                tool = Echo()
                tool.name = tool_name
                register(tool)

        return Plugin()

    host = PluginHost(entrypoints=False, builtins=(), plugins=[
        tool_plugin("a_first", tryfirst=True), tool_plugin("b_last", trylast=True), tool_plugin("c"), tool_plugin("d"),
    ])
    assert list(host.tools()) == ["a_first", "d", "c", "b_last"]
    owners = {t["name"]: p["name"] for p in host.list_plugins() for t in p["tools"]}
    assert len(set(owners.values())) == 4  # each tool attributed to the plugin that registered it


def test_register_hook_wrapper_runs_around_all_registrations() -> None:
    events: list[str] = []

    class Wrap:
        @hookimpl(wrapper=True)
        def register_tools(self, register):
            events.append("before")
            yield
            events.append("after")

    class Plugin:
        @hookimpl
        def register_tools(self, register):
            events.append("register")
            register(Echo())

    assert "echo" in PluginHost(entrypoints=False, builtins=(), plugins=[Plugin(), Wrap()]).tools()
    assert events == ["before", "register", "after"]


def test_register_outside_the_hook_and_raising_hooks_are_load_errors() -> None:
    kept: list[Any] = []

    class Keeper:
        @hookimpl
        def register_tools(self, register):
            kept.append(register)

    PluginHost(entrypoints=False, builtins=(), plugins=[Keeper()]).tools()
    with pytest.raises(PluginLoadError, match="outside a register hook"):
        kept[0](Echo())

    class Broken:
        @hookimpl
        def register_tools(self, register):
            raise RuntimeError("boom")

    with pytest.raises(PluginLoadError, match=r"register_tools raised RuntimeError: boom"):
        PluginHost(entrypoints=False, builtins=(), plugins=[Broken()]).tools()


# --------------------------------------------------------------------------- tool settings


class Configurable(Tool):
    name = "configurable"
    settings_schema = {
        "type": "object",
        "properties": {
            "depth": {"type": "integer", "minimum": 1},
            "nested": {"type": "object", "properties": {"size": {"type": "integer"}}},
        },
    }

    def configure(self, settings):
        self.depth = settings.get("depth", 1)

    def on_finish(self, arguments: dict[str, Any]) -> Any:
        return {"depth": self.depth, "env": os.environ.get("EXAMPLE_SETTING")}


class ConfigurablePlugin:
    @hookimpl
    def register_tools(self, register):
        register(Configurable())


def configurable_host(settings: dict[str, Any]) -> PluginHost:
    return PluginHost({"configurable": settings}, entrypoints=False, builtins=(), plugins=[ConfigurablePlugin()])


@pytest.mark.parametrize(("settings", "message"), [
    ({"detph": 2}, r"tool 'configurable': unknown setting 'detph'; did you mean 'depth'"),
    ({"worker": 2}, r"tool 'configurable': unknown setting 'worker'; did you mean 'workers'"),
    ({"depth": "2"}, r"tool 'configurable': setting 'depth': '2' is not of type 'integer'"),
    ({"depth": 0}, r"setting 'depth': 0 is less than the minimum of 1"),
    ({"nested": {"size": "big"}}, r"setting 'nested\.size': 'big' is not of type 'integer'"),
    ({"workers": "many"}, r"setting 'workers': 'many' is not of type 'integer'"),
    ({"memory_mb": 1.5}, r"setting 'memory_mb'"),
    ({"env": {"A": 1}}, r"setting 'env\.A': 1 is not of type 'string'"),
])
def test_bad_settings_name_the_tool_and_key(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginLoadError, match=message):
        configurable_host(settings).tools()


def test_common_settings_become_attributes() -> None:
    tool = configurable_host({"depth": 3, "memory_mb": 256, "cpu_s": 2, "env": {"EXAMPLE_SETTING": "x"},
                              "timeout_s": 4, "nice": 1, "workers": 2}).tools()["configurable"]
    assert (tool.depth, tool.memory_mb, tool.cpu_s, tool.timeout_s, tool.nice, tool.workers) == (3, 256, 2.0, 4.0, 1, 2)
    assert tool.env == {"EXAMPLE_SETTING": "x"} and Tool.env == {}
    defaults = configurable_host({}).tools()["configurable"]
    assert (defaults.memory_mb, defaults.cpu_s, defaults.env) == (1024, 30.0, {})


def test_free_form_settings_when_the_schema_says_so() -> None:
    class FreeForm(Configurable):
        settings_schema = {"type": "object", "additionalProperties": {"type": "string"}}

    class Plugin:
        @hookimpl
        def register_tools(self, register):
            register(FreeForm())

    host = PluginHost({"configurable": {"anything": "goes"}}, entrypoints=False, builtins=(), plugins=[Plugin()])
    assert "configurable" in host.tools()
    host = PluginHost({"configurable": {"anything": 1}}, entrypoints=False, builtins=(), plugins=[Plugin()])
    with pytest.raises(PluginLoadError, match=r"setting 'anything': 1 is not of type 'string'"):
        host.tools()


def test_tool_info_is_listed_and_a_failing_info_is_reported() -> None:
    class Informative(Echo):
        name = "informative"

        def info(self):
            return {"isolation": "none"}

    class Failing(Echo):
        name = "failing"

        def info(self):
            raise OSError("cannot tell")

    class Plugin:
        @hookimpl
        def register_tools(self, register):
            register(Informative())
            register(Failing())

    (plugin,) = PluginHost(entrypoints=False, builtins=(), plugins=[Plugin()]).list_plugins()
    infos = {t["name"]: t["info"] for t in plugin["tools"]}
    assert infos == {"informative": {"isolation": "none"}, "failing": {"error": "OSError: cannot tell"}}


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
