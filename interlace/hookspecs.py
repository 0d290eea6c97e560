"""The hooks a plugin can implement, and the :class:`Veto` answer of the policy hook.

Interlace is extended the way `llm` and `datasette` are: a plugin is a Python
module (usually a package with an ``interlace`` entry point) holding functions
marked with :data:`hookimpl`.  Built-in tools and parsers are registered through
these same hooks, so nothing a third party writes is a second-class citizen.
Plugins import all of this from the public package (``from interlace import
hookimpl, Veto``), never from this module; docs/plugins.md is the reference.

Hooks are synchronous: pluggy does not await.  They are called through pluggy,
so ``@hookimpl(tryfirst=True)``, ``trylast`` and hook wrappers
(``@hookimpl(wrapper=True)``) work as pluggy documents them.

Example::

    from interlace import hookimpl

    @hookimpl
    def register_tools(register):
        register(MyTool())
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec", "Veto"]

PROJECT = "interlace"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class Veto:
    """The one answer of ``before_tool_execution`` that refuses a tool call.

    ``reason`` becomes the call's error result, so the model reads it.  There
    is deliberately no "allow" object and no boolean: ``None`` allows, a
    ``Veto`` refuses, and anything else (``True``, ``False``, a bare string) is
    a plugin bug that refuses the call with an error naming the plugin.
    ``plugin`` is filled in by the host (the plugin that answered); leave it out.
    """

    reason: str
    plugin: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise TypeError(f"Veto(reason) needs a non-empty string reason, not {self.reason!r}")


@hookspec
def register_tools(register):
    """Register tools the gateway can run server-side.

    ``register(tool)`` takes an instance of a :class:`interlace.Tool` subclass:
    its name, JSON Schema, partial-execution granularity and the code that runs
    in a worker process.  Registering two tools under one name is an error that
    names both plugins.

    Register a fresh, unconfigured instance: during ``register``, the plugin
    host validates the settings the gateway configuration holds under the
    tool's name against ``Tool.settings_schema`` plus the common settings
    (an unknown key is an error naming it), calls ``tool.configure(settings)``
    and applies the common settings (``workers``, ``timeout_s``, ``nice``,
    ``memory_mb``, ``cpu_s``, ``env``), so a hook never reads configuration
    itself.  A tool that cannot work without a setting (a database path) sets
    ``enabled = False`` there; it is then listed but not served.  Instances are
    pickled into worker processes, so tool classes must be importable (module
    level, not in ``__main__``).  Call ``register`` only while the hook runs.
    """


@hookspec
def register_parsers(register):
    """Register streaming output parsers by name.

    ``register(name, factory)`` takes the name that model configurations use
    (``hermes``, ``mistral``, ...) and a zero-argument callable returning a new
    parser for one output stream (normally the parser class, a subclass of
    :class:`interlace.StreamingParser`).  One parser per stream serves every
    tool.  The factory carries the tool-call format as its ``format`` attribute
    (how calls are prompted, rendered, ended and forced; see docs/plugins.md).
    """


@hookspec(firstresult=True)
def before_tool_execution(tool_name, arguments, request):
    """A policy hook called before a server-side tool call starts and as it grows.

    Answer ``None`` to allow (no opinion).  To refuse, ``return Veto("reason")``
    or ``raise ToolVetoed("reason")`` (the same thing); the reason becomes the
    call's error result and the model sees it.  The first veto in pluggy's call
    order (``tryfirst`` first) wins and ends the round.  Any other return value
    (``True`` as `llm`'s hook of the same name uses for "allow", ``False``, a
    string) or any other exception is a plugin bug: the call is refused with an
    error naming the plugin, and the host logs it (fail closed).

    ``request`` describes the HTTP request: ``{"model": ..., "user": ...,
    "key": ...}`` where ``key`` is the name of the caller's API key (``None``
    when the gateway has no keys); a call from an MCP client (``interlace mcp
    serve``) adds ``"via": "mcp"``, with ``model`` ``None``.  ``arguments`` may be partial when the tool
    runs on partial arguments: the runtime asks once when the call begins
    (``{}``), again before each field or code line is handed to the tool (the
    arguments so far; code lines joined under the tool's ``line_field``), and
    once with the complete arguments before the call finishes.  Keep it cheap.
    """


@hookspec
def startup(app):
    """Called once when the gateway's Starlette app starts, after config load.

    Tools are registered and their workers are running; ``app`` is the
    ``starlette.applications.Starlette`` instance, already serving its
    lifespan (use ``app.state``, start background work; middleware can no
    longer be added).  Return value ignored; an exception aborts start-up.
    """
