"""Hook module registering Interlace's built-in tools.

Built-ins go through the same ``register_tools`` hook as third-party
plugins.  Each tool is a fresh instance; the plugin host then calls its
``configure(settings)`` with the tool's section of the configuration, so
settings reach tools without this hook knowing about configuration at all.
"""

from __future__ import annotations

from interlace import hookimpl

from .calculator import CalculatorTool
from .format_tool import FormatTool
from .python_tool import PythonTool
from .search import SearchTool
from .sqlite_tool import SqliteTool

BUILTIN_TOOLS = (PythonTool, CalculatorTool, SqliteTool, SearchTool, FormatTool)


@hookimpl
def register_tools(register):
    for cls in BUILTIN_TOOLS:
        register(cls())
