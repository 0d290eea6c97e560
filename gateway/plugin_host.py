"""Loads plugins (built-in modules and ``interlace`` entry points) and runs their hooks.

One :class:`PluginHost` per gateway.  It owns the pluggy ``PluginManager``,
fails at load time on a hook name pluggy does not know (a misspelled
``register_tool`` would otherwise be silently ignored), collects tools and
parsers with per-plugin attribution (so a duplicate name says which two
plugins clash), gives each tool its validated settings, and adapts the
``before_tool_execution`` hook to the runtime's ``policy`` callable.

Every hook is called through pluggy (``pm.hook.<name>(...)``), so ``tryfirst``,
``trylast`` and hook wrappers behave as pluggy documents.  Attribution comes
from what the host registers: not the plugin object itself but a
:class:`_PluginView` of it, holding the same hook implementations (same
names, markers and signatures) each wrapped to run with the plugin's name in
a context variable and, for the policy hook, to check the plugin's answer.

How settings reach tools: the host is built with ``tool_settings``, a mapping
from tool name to that tool's settings dict (the ``tools:`` section of the
gateway config).  When a plugin calls ``register(tool)``, the host validates
the settings (``Tool.settings_schema`` plus :data:`COMMON_SETTINGS`; unknown
keys are rejected), calls ``tool.configure(settings)``, applies the common
settings and runs ``tool.check()``.

Built-in plugins are named once, in :data:`BUILTIN_PLUGINS`.  The host
registers them by import, as llm and datasette register their
``DEFAULT_PLUGINS``.  They are not ``interlace`` entry points in
pyproject.toml as well, for three reasons: a tuple in the code is right even
in a source checkout whose installed metadata is stale; a test can replace it
(``builtins=``); and the entry-point group then holds third-party plugins
only, so no built-in appears a second time under another name.
"""

from __future__ import annotations

import contextvars
import difflib
import functools
import importlib
import importlib.metadata
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pluggy

from ..parsers.formats import FormatError, check_format
from ..parsers.reasoning import check_reasoning
from .. import hookspecs
from ..hookspecs import PROJECT, Veto
from ..version import __version__
from .tools.base import COMMON_SETTINGS, Tool, ToolVetoed
from .tools.sandbox import unavailable_reason

__all__ = [
    "PluginHost",
    "PluginLoadError",
    "PluginHookError",
    "DuplicateRegistration",
    "BUILTIN_PLUGINS",
    "list_plugins",
    "validate_tool_settings",
    "configure_tool",
]

log = logging.getLogger(__name__)

#: The built-in plugins, named here only (see the module docstring), registered by import on every host.
BUILTIN_PLUGINS: tuple[str, ...] = ("interlace.plugins.builtin", "interlace.parsers.builtin")

#: The plugin whose hook implementation is running (set by :class:`_PluginView`).
_running_plugin: contextvars.ContextVar[str | None] = contextvars.ContextVar("interlace_running_plugin", default=None)


class PluginLoadError(RuntimeError):
    """A plugin could not be loaded or registered something invalid."""


class DuplicateRegistration(PluginLoadError):
    """Two registrations (tools or parsers) share a name."""


class PluginHookError(RuntimeError):
    """A plugin's hook broke its contract at call time (a bad answer or an exception)."""

    def __init__(self, plugin: str, hook: str, problem: str) -> None:
        self.plugin, self.hook, self.problem = plugin, hook, problem
        super().__init__(f"plugin {plugin!r}: {hook} {problem}")


# --------------------------------------------------------------------------- settings


def _path(parts: Iterable[Any]) -> str:
    return ".".join(str(p) for p in parts)


def validate_tool_settings(tool: Tool, settings: Mapping[str, Any]) -> None:
    """Check one tool's settings; raise :class:`PluginLoadError` naming the tool and key.

    Common keys are checked against :data:`COMMON_SETTINGS`, the rest against
    ``tool.settings_schema``.  A key in neither is rejected, unless the tool's
    schema accepts extra keys explicitly (``additionalProperties`` given as a
    schema or ``true``, or a matching ``patternProperties``).
    """
    from jsonschema import validators
    from jsonschema.exceptions import SchemaError, best_match

    schema = tool.settings_schema
    if not isinstance(settings, Mapping):
        raise PluginLoadError(f"tool {tool.name!r}: settings must be a mapping, not {type(settings).__name__}")
    try:
        own_cls = validators.validator_for(schema)
        own_cls.check_schema(schema)
    except (SchemaError, AttributeError, TypeError) as exc:
        raise PluginLoadError(f"tool {tool.name!r}: settings_schema is not a valid JSON Schema: {exc}") from exc
    declared = schema.get("properties", {})
    extra = schema.get("additionalProperties", False)
    patterns = list(schema.get("patternProperties", {}))
    unknown = [
        key for key in settings
        if key not in declared and key not in COMMON_SETTINGS
        and not (extra is not False and extra is not None)
        and not any(re.search(p, str(key)) for p in patterns)
    ]
    if unknown:
        known = sorted({*declared, *COMMON_SETTINGS})
        guess = difflib.get_close_matches(str(unknown[0]), known, n=1)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise PluginLoadError(
            f"tool {tool.name!r}: unknown setting {unknown[0]!r}{hint} (known settings: {', '.join(known)})"
        )
    common = {k: v for k, v in settings.items() if k in COMMON_SETTINGS}
    own = {k: v for k, v in settings.items() if k not in COMMON_SETTINGS or k in declared}
    checks = (
        (validators.Draft202012Validator({"type": "object", "properties": COMMON_SETTINGS}), common),
        (own_cls(schema), own),
    )
    for validator, instance in checks:
        error = best_match(validator.iter_errors(instance))
        if error is not None:
            where = f"setting {_path(error.absolute_path)!r}" if error.absolute_path else "settings"
            raise PluginLoadError(f"tool {tool.name!r}: {where}: {error.message}")


def configure_tool(tool: Tool, settings: Mapping[str, Any]) -> None:
    """Give ``tool`` its settings, as the host does at ``register``: the one place they are applied.

    Validates them (:func:`validate_tool_settings`), calls
    ``tool.configure(settings)``, sets the common settings as the attributes of
    the same name (so a tool's ``configure`` reads only its own keys) and runs
    ``tool.check()``.
    """
    validate_tool_settings(tool, settings)
    tool.configure(settings)
    kinds: dict[str, Callable[[Any], Any]] = {"timeout_s": float, "cpu_s": float, "env": dict}
    for key in COMMON_SETTINGS:
        if key in settings:
            setattr(tool, key, kinds.get(key, int)(settings[key]))
    tool.check()


# --------------------------------------------------------------------------- attribution


def _check_verdict(plugin: str, answer: Any) -> Veto | None:
    """A ``before_tool_execution`` answer, checked: ``None`` or a :class:`Veto` from ``plugin``."""
    if answer is None:
        return None
    if isinstance(answer, Veto):
        return Veto(answer.reason, plugin=plugin)
    raise PluginHookError(
        plugin, "before_tool_execution",
        f"returned {answer!r}; return None to allow the call, Veto('reason') or raise ToolVetoed('reason') to refuse it",
    )


def _attributed(plugin: str, hook: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run with ``plugin`` as the running plugin; errors name the plugin."""

    @functools.wraps(function)  # keeps the hookimpl marker and, via __wrapped__, the signature
    def run(*args: Any, **kwargs: Any) -> Any:
        token = _running_plugin.set(plugin)
        try:
            answer = function(*args, **kwargs)
        except ToolVetoed as exc:
            if hook != "before_tool_execution":
                raise
            answer = Veto(str(exc) or "vetoed", plugin=plugin)
        except (PluginLoadError, PluginHookError):
            raise
        except Exception as exc:
            if hook in ("register_tools", "register_parsers"):
                raise PluginLoadError(f"plugin {plugin!r}: {hook} raised {type(exc).__name__}: {exc}") from exc
            raise PluginHookError(plugin, hook, f"raised {type(exc).__name__}: {exc}") from exc
        finally:
            _running_plugin.reset(token)
        return _check_verdict(plugin, answer) if hook == "before_tool_execution" else answer

    return run


class _PluginView:
    """What the host registers with pluggy for a plugin: its hook implementations, attributed.

    Same attribute names and ``@hookimpl`` options as the plugin (pluggy orders
    and validates them as usual); plain implementations are wrapped by
    :func:`_attributed`, hook wrappers (generators) are passed through as they are.
    """

    def __init__(self, plugin: object, name: str, pm: pluggy.PluginManager) -> None:
        self.__name__ = name
        for attr in dir(plugin):
            opts = pm.parse_hookimpl_opts(plugin, attr)
            if opts is None:
                continue
            function = getattr(plugin, attr)
            if not (opts.get("wrapper") or opts.get("hookwrapper")):
                function = _attributed(name, opts.get("specname") or attr, function)  # wraps() keeps the marker
            setattr(self, attr, function)

    def __repr__(self) -> str:
        return f"<plugin {self.__name__}>"


# --------------------------------------------------------------------------- the host


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
        """``plugins`` registers extra plugin objects directly (tests, embedding);
        one already loaded (as an entry point or built-in) is not registered twice."""
        self.tool_settings: dict[str, Mapping[str, Any]] = dict(tool_settings or {})
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._plugins: dict[str, object] = {}  # name -> the plugin object (module, instance)
        self._dists: dict[str, importlib.metadata.Distribution] = {}
        self._builtin: set[str] = set()
        try:
            if entrypoints:
                self._load_entrypoints()
            for modname in builtins:
                name = self._register(importlib.import_module(modname), modname)
                self._builtin.add(name)
            for plugin in plugins:
                self._register(plugin, None)
            self._check_hook_names()
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"invalid plugin {self._plugin_label(exc.plugin)}: {exc}") from exc
        self._tools: dict[str, Tool] | None = None
        self._tool_owner: dict[str, str] = {}
        self._parsers: dict[str, Callable[[], Any]] | None = None
        self._reasoning: dict[str, Callable[[], Any]] = {}
        self._parser_owner: dict[str, str] = {}
        self._reasoning_owner: dict[str, str] = {}

    # -- loading -----------------------------------------------------------------------

    def _register(self, plugin: object, name: str | None) -> str:
        """Register ``plugin`` (through its view) unless already there; return its name."""
        for known, obj in self._plugins.items():
            if obj is plugin:
                return known
        name = name or getattr(plugin, "__name__", None) or f"{type(plugin).__qualname__}_{id(plugin):x}"
        if name in self._plugins:
            raise PluginLoadError(f"two plugins are named {name!r}")
        self._plugins[name] = plugin
        self.pm.register(_PluginView(plugin, name, self.pm), name=name)
        return name

    def _load_entrypoints(self) -> None:
        """Every installed ``interlace`` entry point, as pluggy's loader would, through views."""
        seen: set[str] = set()
        for dist in importlib.metadata.distributions():
            for ep in dist.entry_points:
                if ep.group != PROJECT or ep.name in seen:
                    continue
                seen.add(ep.name)
                try:
                    plugin = ep.load()
                except Exception as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                    raise PluginLoadError(f"loading {PROJECT!r} entry point {ep.name!r} ({ep.value}) failed: {reason}"
                                          ) from exc
                self._dists[self._register(plugin, ep.name)] = dist

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

    @staticmethod
    def _registering_plugin(what: str) -> str:
        owner = _running_plugin.get()
        if owner is None:
            raise PluginLoadError(f"register() for {what} was called outside a register hook")
        return owner

    def tools(self, *, include_disabled: bool = False) -> dict[str, Tool]:
        """Tools by name, configured (collected on first use, in pluggy's call order)."""
        if self._tools is None:
            collected: dict[str, Tool] = {}

            def register(tool: Tool) -> None:
                owner = self._registering_plugin("a tool")
                if not isinstance(tool, Tool):
                    raise PluginLoadError(f"plugin {owner!r} registered {tool!r}, which is not an interlace Tool")
                if tool.name in collected:
                    raise DuplicateRegistration(
                        f"tool {tool.name!r} is registered by both {self._tool_owner[tool.name]!r} and {owner!r}"
                    )
                settings = dict(self.tool_settings.get(tool.name, {}))
                try:
                    configure_tool(tool, settings)
                except PluginLoadError:
                    raise
                except Exception as exc:
                    raise PluginLoadError(f"plugin {owner!r}, tool {tool.name!r}: {exc}") from exc
                collected[tool.name] = tool
                self._tool_owner[tool.name] = owner

            self.pm.hook.register_tools(register=register)
            unknown = set(self.tool_settings) - set(collected)
            if unknown:  # a typo, or a plugin that is not installed: worth a loud line, not a crash
                log.warning("settings given for unknown tools: %s", ", ".join(sorted(unknown)))
            self._tools = collected
        return {n: t for n, t in self._tools.items() if include_disabled or t.enabled}

    def replace_tools(self, owner: str, tools: Iterable[Tool]) -> list[Tool]:
        """Replace the tools plugin ``owner`` registered, while the gateway runs (an MCP
        server that restarted with other tools); return the ones now registered.

        Each new tool gets its settings as at ``register``; one whose settings
        fail, or whose name another plugin holds, is left out with a log line
        (the rest are served)."""
        current = self.tools(include_disabled=True)
        if owner not in self._plugins:
            raise PluginLoadError(f"no plugin named {owner!r}")
        kept: list[Tool] = []
        for tool in tools:
            other = self._tool_owner.get(tool.name)
            if tool.name in current and other != owner:
                log.error("tool %r of %r left out: the plugin %r registers that name", tool.name, owner, other)
                continue
            try:
                configure_tool(tool, dict(self.tool_settings.get(tool.name, {})))
            except Exception as exc:  # noqa: BLE001 - one tool's settings must not drop the others
                log.error("tool %r of %r left out: %s", tool.name, owner, exc)
                continue
            kept.append(tool)
        assert self._tools is not None
        for name in self.tool_names(owner):
            del self._tools[name], self._tool_owner[name]
        for tool in kept:
            self._tools[tool.name] = tool
            self._tool_owner[tool.name] = owner
        return kept

    def tool_names(self, owner: str) -> list[str]:
        """The names of the tools plugin ``owner`` registered."""
        self.tools(include_disabled=True)
        return [name for name, who in self._tool_owner.items() if who == owner]

    def parsers(self) -> dict[str, Callable[[], Any]]:
        """Tool-call parser factories by name (the parsers themselves live in ``interlace.parsers``).

        Each factory must carry a valid ``format`` (``interlace.ToolFormat``,
        contract 4); one without is a :class:`PluginLoadError` naming the plugin.
        """
        return dict(self._collect_parsers()[0])

    def reasoning_parsers(self) -> dict[str, Callable[[], Any]]:
        """Reasoning parser factories by name (``reasoning_parser:`` in a model config): registered
        through the same ``register_parsers`` hook, told apart by their ``reasoning`` attribute."""
        return dict(self._collect_parsers()[1])

    def _collect_parsers(self) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
        if self._parsers is None:
            collected: dict[str, Callable[[], Any]] = {}
            reasoning: dict[str, Callable[[], Any]] = {}

            def register(name: str, factory: Callable[[], Any]) -> None:
                owner = self._registering_plugin(f"parser {name!r}")
                if not isinstance(name, str) or not name or not callable(factory):
                    raise PluginLoadError(f"plugin {owner!r}: register(name, factory) needs a name and a callable")
                kind, into, owners = ("parser", collected, self._parser_owner)
                try:  # contract 4: the parser says how its format (or its reasoning) is written
                    if getattr(factory, "reasoning", None) is not None:
                        kind, into, owners = ("reasoning parser", reasoning, self._reasoning_owner)
                        check_reasoning(factory.reasoning, f"{name!r} of plugin {owner!r}")
                    else:
                        check_format(getattr(factory, "format", None), f"{name!r} of plugin {owner!r}")
                except FormatError as exc:
                    raise PluginLoadError(str(exc)) from exc
                if name in into:
                    raise DuplicateRegistration(
                        f"{kind} {name!r} is registered by both {owners[name]!r} and {owner!r}"
                    )
                into[name] = factory
                owners[name] = owner

            self.pm.hook.register_parsers(register=register)
            self._parsers = collected
            self._reasoning = reasoning
        return self._parsers, self._reasoning

    # -- runtime hooks -------------------------------------------------------------------

    def before_tool_execution(self, tool_name: str, arguments: dict[str, Any], request: Any = None) -> str | None:
        """The runtime's policy: ``None`` to allow the call, else the message that refuses it.

        Matches :data:`interlace.gateway.tools.settings.Policy`, so a runtime can
        take ``policy=host.before_tool_execution``.  A plugin that breaks the
        hook's contract refuses the call (fail closed) with an error naming it.
        """
        try:
            verdict = self.pm.hook.before_tool_execution(tool_name=tool_name, arguments=arguments, request=request)
        except PluginHookError as exc:
            log.error("tool call %r refused: %s", tool_name, exc)
            return f"refused because of a broken policy plugin: {exc}"
        except ToolVetoed as exc:  # raised by a hook wrapper: a veto all the same
            return str(exc) or "vetoed"
        except Exception as exc:  # raised by a hook wrapper, which is not attributed
            log.error("tool call %r refused: a before_tool_execution hook wrapper raised", tool_name, exc_info=True)
            return f"refused because a before_tool_execution hook wrapper raised {type(exc).__name__}: {exc}"
        if verdict is None:
            return None
        if isinstance(verdict, Veto):
            log.info("tool call %r vetoed by plugin %r: %s", tool_name, verdict.plugin, verdict.reason)
            return verdict.reason
        log.error("tool call %r refused: a before_tool_execution hook wrapper returned %r", tool_name, verdict)
        return f"refused because a before_tool_execution hook wrapper returned {verdict!r}, not None or a Veto"

    def startup(self, app: Any) -> None:
        self.pm.hook.startup(app=app)

    def create_runtime(self, **kwargs: Any) -> Any:
        """A :class:`~interlace.gateway.tools.runtime.ToolRuntime` for the enabled tools, with this host's policy."""
        from .tools.runtime import ToolRuntime

        return ToolRuntime(self.tools(), policy=self.before_tool_execution, **kwargs)

    # -- introspection -------------------------------------------------------------------

    def list_plugins(self) -> list[dict[str, Any]]:
        """Installed plugins as plain dicts, for ``GET /v1/plugins`` and ``interlace plugins``.

        Each: ``name``, ``module``, ``package``, ``version``, ``builtin``,
        ``hooks`` (names it implements), ``tools`` (each with its ``info()``,
        or ``{"error": ...}`` when ``info()`` raised) and ``parsers`` (names);
        plus ``status`` for a plugin that reports one (an MCP server's state).
        """
        tools = self.tools(include_disabled=True)
        parsers = self.parsers()
        reasoning = self.reasoning_parsers()
        out = []
        for name, plugin in self._plugins.items():
            dist = self._dists.get(name)
            builtin = name in self._builtin
            view = self.pm.get_plugin(name)
            out.append({
                "name": name,
                "module": getattr(plugin, "__name__", type(plugin).__qualname__),
                "package": dist.metadata["Name"] if dist else (PROJECT if builtin else None),
                "version": dist.version if dist else (__version__ if builtin else None),
                "builtin": builtin,
                "hooks": sorted(caller.name for caller in self.pm.get_hookcallers(view) or ()),
                "tools": [_describe_tool(tool) for tool_name, tool in tools.items()
                          if self._tool_owner.get(tool_name) == name],
                "parsers": sorted(p for p in parsers if self._parser_owner.get(p) == name),
                "reasoning_parsers": sorted(p for p in reasoning if self._reasoning_owner.get(p) == name),
            })
            status = getattr(plugin, "plugin_status", None)
            if callable(status):
                out[-1]["status"] = status()
        return out


def _tool_info(tool: Tool) -> dict[str, Any]:
    """``tool.info()`` as JSON-able data; a failure is reported in place, not raised,
    so one broken tool does not hide the others from the listing."""
    try:
        info = tool.info()
        if not isinstance(info, dict):
            raise TypeError(f"info() returned {type(info).__name__}, not a dict")
        json.dumps(info)
        return info
    except Exception as exc:
        log.warning("tool %r: info() failed", tool.name, exc_info=True)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _describe_tool(tool: Tool) -> dict[str, Any]:
    info = _tool_info(tool)
    in_force = getattr(tool, "sandbox_in_force", None) or {}
    unavailable = ({"available": False, "unavailable_because": in_force.get("reason")}
                   if in_force.get("sandbox") == "unavailable" else {})  # left out: no sandbox here
    return {
        "name": tool.name,
        "description": tool.description,
        "granularity": tool.granularity.name,
        "validate_early": tool.validate_early,
        "timeout_s": tool.timeout_s,
        "workers": tool.workers,
        "enabled": tool.enabled,
        **unavailable,
        "info": info,
    }


def list_plugins(tool_settings: Mapping[str, Mapping[str, Any]] | None = None, **host_kwargs: Any
                 ) -> list[dict[str, Any]]:
    """Load plugins as the gateway would and describe them (for the CLI).

    ``host_kwargs`` go to :class:`PluginHost` (``builtins``, ``entrypoints``,
    ``plugins``), so the CLI can list what a config's ``plugins:`` section loads.
    """
    host = PluginHost(tool_settings, **host_kwargs)
    for tool in host.tools().values():  # not started here: say which cannot be, and why (as serve would)
        reason = None if getattr(tool, "allow_unisolated", False) else unavailable_reason(tool)
        if reason is not None:
            tool.sandbox_in_force = {"sandbox": "unavailable", "reason": reason}
    return host.list_plugins()
