"""Built-in parsers, registered through the same pluggy hook as third-party ones.

The gateway registers this module with its plugin manager and calls
``pm.hook.register_parsers(register=registry.register)``;
:func:`load_registry` does exactly that for callers without a plugin manager.
"""

from __future__ import annotations

import pluggy

from .. import hookspecs
from ..hookspecs import hookimpl
from .base import ParserFactory, ParserRegistry, StreamingParser
from .code import MarkdownCodeParser
from .json_formats import HermesParser, Llama3JsonParser, MistralParser
from .plan import PlanParser
from .pythonic import PythonicParser

BUILTIN_PARSERS: dict[str, ParserFactory] = {
    "hermes": HermesParser,
    "mistral": MistralParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "markdown": MarkdownCodeParser,
    "plan": PlanParser,
}


@hookimpl
def register_parsers(register) -> None:  # type: ignore[no-untyped-def]
    """Register every built-in parser under its config name."""
    for name, factory in BUILTIN_PARSERS.items():
        register(name, factory)


def load_registry(pm: pluggy.PluginManager | None = None) -> ParserRegistry:
    """A registry filled by every ``register_parsers`` implementation in ``pm``.

    Without ``pm``, a private plugin manager holding only the built-ins is used.
    """
    if pm is None:
        import sys

        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        pm.register(sys.modules[__name__], name="interlace.parsers.builtin")
    registry = ParserRegistry()
    pm.hook.register_parsers(register=registry.register)
    return registry


_default: ParserRegistry | None = None


def get_parser(name: str) -> StreamingParser:
    """A fresh built-in parser by name; raises ``UnknownParserError``."""
    global _default
    if _default is None:
        _default = load_registry()
    return _default.create(name)
