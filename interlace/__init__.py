"""Interlace's public, stable API for plugin authors and embedders.

Plugins import from here, never from ``interlace.gateway.*`` (those modules
may change between releases)::

    from interlace import hookimpl, Tool, ToolError, Granularity, Veto

Everything a plugin needs is here: the hook marker, the tool base class and
its errors, what a tool's worker process offers its handlers (the CPU
budget's exception, a limit setter), the policy hook's :class:`Veto`, the
streaming parser base class and the events a parser emits, and
:class:`PluginHost` to load and run a plugin in its own tests exactly as the
gateway does.  docs/plugins.md is the reference for each name and hook.

Importing this package does not import torch (nor the engine): a plugin
package's own tests need only ``interlace`` and its light dependencies.
"""

from .version import __version__
from .hookspecs import Veto, hookimpl
from .gateway.tools.base import (COMMON_SETTINGS, AsyncTool, Granularity, InvalidToolArguments, Tool, ToolCancelled,
                            ToolConfigError, ToolCrashed, ToolError, ToolTimeout, ToolUnavailable, ToolVetoed,
                            UnknownTool)
from .gateway.tools.worker import CPUTimeExceeded, set_hard_limit
from .gateway.plugin_host import DuplicateRegistration, PluginHookError, PluginHost, PluginLoadError
from .parsers.base import StreamingParser
from .parsers.formats import CannotForce, FormatError, ToolFormat
from .parsers.events import (ArgumentsDelta, Event, FieldComplete, LineComplete, ParserError, Text, ToolCallEnd,
                             ToolCallStart)

__all__ = [
    # hooks
    "__version__",
    "hookimpl", "Veto",
    # tools
    "Tool", "AsyncTool", "Granularity", "COMMON_SETTINGS",
    "ToolError", "InvalidToolArguments", "ToolCancelled", "ToolConfigError", "ToolCrashed", "ToolTimeout",
    "ToolUnavailable", "ToolVetoed", "UnknownTool",
    # inside a tool's worker process
    "CPUTimeExceeded", "set_hard_limit",
    # parsers
    "StreamingParser", "ToolFormat", "FormatError", "CannotForce", "Event", "Text", "ToolCallStart", "ArgumentsDelta", "FieldComplete", "LineComplete",
    "ToolCallEnd", "ParserError",
    # loading and testing plugins
    "PluginHost", "PluginLoadError", "DuplicateRegistration", "PluginHookError",
]
