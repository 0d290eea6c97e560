"""Loads plugins (built-in modules and ``interlace`` entry points) and runs their hooks.

One :class:`PluginHost` per gateway.  It owns the pluggy ``PluginManager``,
fails at load time on a hook name pluggy does not know (a misspelled
``register_tool`` would otherwise be silently ignored), collects tools and
parsers with per-plugin attribution (so a duplicate name says which two
plugins clash), and gives each tool its settings.

How settings reach tools: the host is built with ``tool_settings``, a mapping
from tool name to that tool's settings dict (the ``tools:`` section of the
gateway config).  Right after a plugin calls ``register(tool)``, the host
calls ``tool.configure(tool_settings.get(tool.name, {}))``.  Tools that need
a setting to work (a database path, a corpus) set ``enabled = False`` when it
is missing; they are listed but not served.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pluggy

from . import hookspecs
from .hookspecs import PROJECT
from .tools import Tool

__all__ = [
    "PluginHost",
    "PluginLoadError",
    "DuplicateRegistration",
    "BUILTIN_PLUGINS",
    "list_plugins",
]

log = logging.getLogger(__name__)

#: Modules registered as plugins on every host (unless already loaded as an entry point).
BUILTIN_PLUGINS: tuple[str, ...] = ("interlace.plugins.builtin", "interlace.parsers.builtin")


class PluginLoadError(RuntimeError):
    """A plugin could not be loaded or registered something invalid."""


class DuplicateRegistration(PluginLoadError):
    """Two registrations (tools or parsers) share a name."""


def _interlace_version() -> str:
    try:
        return importlib.metadata.version(PROJECT)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


#: Settings every tool takes, applied by the host after ``Tool.configure``.
COMMON_SETTINGS = {"workers": int, "timeout_s": float, "nice": int}


def _apply_common_settings(tool: Tool, settings: Mapping[str, Any]) -> None:
    """``workers`` (pool size), ``timeout_s`` and ``nice`` (worker CPU priority:
    on a CPU-only host a positive value keeps CPU-heavy tools from slowing
    decoding) work for every tool, whatever its own ``configure`` reads."""
    for key, kind in COMMON_SETTINGS.items():
        if key in settings:
            try:
                setattr(tool, key, kind(settings[key]))
            except (TypeError, ValueError) as exc:
                raise PluginLoadError(f"tool {tool.name!r}: setting {key!r} must be {kind.__name__}: {exc}") from exc


class PluginHost:
    """The gateway's plugin manager and the single place hooks are called from."""

    def __init__(
        self,
        tool_settings: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        builtins: Iterable[str] = BUILTIN_PLUGINS,
        entrypoints: bool = True,
        plugins: Iterable[object] = (),
    ) -> None:
        """``plugins`` registers extra plugin objects directly (tests, embedding)."""
        self.tool_settings: dict[str, Mapping[str, Any]] = dict(tool_settings or {})
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._builtin: set[str] = set()
        try:
            if entrypoints:
                try:
                    self.pm.load_setuptools_entrypoints(PROJECT)
                except pluggy.PluginValidationError:
                    raise
                except Exception as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                    raise PluginLoadError(f"loading {PROJECT!r} entry points failed: {reason}") from exc
            for modname in builtins:
                module = importlib.import_module(modname)
                if not self.pm.is_registered(module):
                    self.pm.register(module, name=modname)
                self._builtin.add(self.pm.get_name(module) or modname)
            for plugin in plugins:
                self.pm.register(plugin)
            self._check_hook_names()
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"invalid plugin {self._plugin_label(exc.plugin)}: {exc}") from exc
        self._tools: dict[str, Tool] | None = None
        self._tool_owner: dict[str, str] = {}
        self._parsers: dict[str, Callable[[], Any]] | None = None
        self._parser_owner: dict[str, str] = {}

    # -- loading -----------------------------------------------------------------------

    def _plugin_label(self, plugin: object) -> str:
        name = self.pm.get_name(plugin) if plugin is not None else None
        return repr(name or getattr(plugin, "__name__", None) or type(plugin).__name__)

    def _check_hook_names(self) -> None:
        """Like ``check_pending`` but says which plugin and what the name probably should be."""
        known = sorted(n for n in vars(self.pm.hook) if not n.startswith("_") and getattr(self.pm.hook, n).has_spec())
        problems = []
        for name, caller in sorted(vars(self.pm.hook).items()):
            if name.startswith("_") or caller.has_spec():
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                guess = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {guess[0]!r}?" if guess else f"; known hooks: {', '.join(known)}"
                problems.append(f"plugin {self._plugin_label(impl.plugin)} implements unknown hook {name!r}{hint}")
        if problems:
            raise PluginLoadError("\n".join(problems))

    # -- registrations ---------------------------------------------------------------

    def _call_each(self, hook_name: str, make_register: Callable[[str], Callable[..., None]]) -> None:
        """Call each implementation separately, so registrations can be attributed to a plugin."""
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            owner = self.pm.get_name(impl.plugin) or impl.plugin_name
            register = make_register(owner)
            impl.function(*[register for _ in impl.argnames])

    def tools(self, *, include_disabled: bool = False) -> dict[str, Tool]:
        """Tools by name, configured (collected on first use)."""
        if self._tools is None:
            collected: dict[str, Tool] = {}

            def make_register(owner: str) -> Callable[[Tool], None]:
                def register(tool: Tool) -> None:
                    if not isinstance(tool, Tool):
                        raise PluginLoadError(f"plugin {owner!r} registered {tool!r}, which is not an interlace Tool")
                    if tool.name in collected:
                        raise DuplicateRegistration(
                            f"tool {tool.name!r} is registered by both {self._tool_owner[tool.name]!r} and {owner!r}"
                        )
                    settings = dict(self.tool_settings.get(tool.name, {}))
                    tool.configure(settings)
                    _apply_common_settings(tool, settings)
                    try:
                        tool.check()
                    except Exception as exc:
                        raise PluginLoadError(f"plugin {owner!r}, tool {tool.name!r}: {exc}") from exc
                    collected[tool.name] = tool
                    self._tool_owner[tool.name] = owner

                return register

            self._call_each("register_tools", make_register)
            unknown = set(self.tool_settings) - set(collected)
            if unknown:  # a typo, or a plugin that is not installed: worth a loud line, not a crash
                log.warning("settings given for unknown tools: %s", ", ".join(sorted(unknown)))
            self._tools = collected
        return {n: t for n, t in self._tools.items() if include_disabled or t.enabled}

    def parsers(self) -> dict[str, Callable[[], Any]]:
        """Parser factories by name (the parsers themselves live in ``interlace.parsers``)."""
        if self._parsers is None:
            collected: dict[str, Callable[[], Any]] = {}

            def make_register(owner: str) -> Callable[[str, Callable[[], Any]], None]:
                def register(name: str, factory: Callable[[], Any]) -> None:
                    if not isinstance(name, str) or not name or not callable(factory):
                        raise PluginLoadError(f"plugin {owner!r}: register(name, factory) needs a name and a callable")
                    if name in collected:
                        raise DuplicateRegistration(
                            f"parser {name!r} is registered by both {self._parser_owner[name]!r} and {owner!r}"
                        )
                    collected[name] = factory
                    self._parser_owner[name] = owner

                return register

            self._call_each("register_parsers", make_register)
            self._parsers = collected
        return dict(self._parsers)

    # -- runtime hooks -------------------------------------------------------------------

    def before_tool_execution(self, tool_name: str, arguments: dict[str, Any], request: Any = None) -> str | None:
        """The first veto message any plugin returns, or ``None`` to allow the call.

        Matches :data:`interlace.gateway.tool_runtime.Policy`, so a runtime can
        take ``policy=host.before_tool_execution``.
        """
        results = self.pm.hook.before_tool_execution(tool_name=tool_name, arguments=arguments, request=request)
        for result in results:
            if result is not None:
                return str(result)
        return None

    def startup(self, app: Any) -> None:
        self.pm.hook.startup(app=app)

    def create_runtime(self, **kwargs: Any) -> Any:
        """A :class:`~interlace.gateway.tool_runtime.ToolRuntime` for the enabled tools, with this host's policy."""
        from .tool_runtime import ToolRuntime

        return ToolRuntime(self.tools(), policy=self.before_tool_execution, **kwargs)

    # -- introspection -------------------------------------------------------------------

    def list_plugins(self) -> list[dict[str, Any]]:
        """Installed plugins as plain dicts, for ``GET /v1/plugins`` and ``interlace plugins``."""
        tools = self.tools(include_disabled=True)
        parsers = self.parsers()
        dists = {id(plugin): dist for plugin, dist in self.pm.list_plugin_distinfo()}
        out = []
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:
                continue
            dist = dists.get(id(plugin))
            builtin = name in self._builtin
            out.append({
                "name": name,
                "module": getattr(plugin, "__name__", type(plugin).__qualname__),
                "package": dist.project_name if dist else (PROJECT if builtin else None),
                "version": dist.version if dist else (_interlace_version() if builtin else None),
                "builtin": builtin or (dist is not None and dist.project_name == PROJECT),
                "hooks": sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or ()),
                "tools": [
                    {
                        "name": tool.name,
                        "description": tool.description,
                        "granularity": tool.granularity.name,
                        "validate_early": tool.validate_early,
                        "timeout_s": tool.timeout_s,
                        "enabled": tool.enabled,
                    }
                    for tool_name, tool in tools.items()
                    if self._tool_owner.get(tool_name) == name
                ],
                "parsers": sorted(p for p in parsers if self._parser_owner.get(p) == name),
            })
        return out


def list_plugins(tool_settings: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Load plugins as the gateway would and describe them (for the CLI)."""
    return PluginHost(tool_settings).list_plugins()
