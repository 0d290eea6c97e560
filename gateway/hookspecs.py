"""The hooks a plugin can implement.

Interlace is extended the way `llm` and `datasette` are: a plugin is a Python
module (usually a package with an ``interlace`` entry point) holding functions
marked with :data:`hookimpl`.  Built-in tools and parsers are registered through
these same hooks, so nothing a third party writes is a second-class citizen.

Hooks are synchronous: pluggy does not await.  A hook that needs to do async
work at start-up should schedule it from :func:`startup`.

Example::

    from interlace.gateway.hookspecs import hookimpl

    @hookimpl
    def register_tools(register):
        register(MyTool())
"""

from __future__ import annotations

import pluggy

PROJECT = "interlace"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_tools(register):
    """Register tools the gateway can run server-side.

    ``register(tool)`` takes a tool object (see ``interlace.gateway.tools``):
    its name, JSON Schema, partial-execution granularity and the code that runs
    in a worker process.  Registering two tools under one name is an error.

    Register a fresh, unconfigured instance: right after ``register`` returns,
    the plugin host calls ``tool.configure(settings)`` with the settings the
    gateway configuration holds under the tool's name (an empty dict if none),
    so a hook never reads configuration itself.  A tool that cannot work
    without a setting (a database path) sets ``enabled = False`` there; it is
    then listed but not served.  Instances are pickled into worker processes,
    so tool classes must be importable (module level, not in ``__main__``).
    """


@hookspec
def register_parsers(register):
    """Register streaming output parsers by name.

    ``register(name, factory)`` takes the name that model configurations use
    (``hermes``, ``mistral``, ...) and a zero-argument callable returning a new
    parser for one output stream.  One parser per stream serves every tool.
    """


@hookspec
def before_tool_execution(tool_name, arguments, request):
    """A policy hook called before a server-side tool call starts.

    Return a string to veto the call: the string becomes the call's error
    result and the model sees it.  Return ``None`` to allow it; the first
    non-``None`` answer wins.  ``arguments`` may be partial when the tool runs
    on partial arguments: the runtime asks once when the call begins (``{}``),
    again before each field or code line is handed to the tool (the arguments
    so far; code lines joined under the tool's ``line_field``), and once with
    the complete arguments before the call finishes.  Keep it cheap.
    """


@hookspec
def startup(app):
    """Called once when the gateway's Starlette app starts, after config load."""
