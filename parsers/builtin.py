"""Built-in parsers, registered through the same pluggy hook as third-party ones.

This module is one of the gateway's built-in plugins (``BUILTIN_PLUGINS`` in
``gateway/plugin_host.py``, the one list of them): the plugin host registers
it and calls ``register_parsers(register=...)``.  Callers that want the
parsers as the gateway has them ask a ``PluginHost`` (``host.parsers()``);
there is no second plugin manager here.

The hook marker comes from the package root's ``hookspecs`` (what
``interlace.hookimpl`` re-exports), not from the public ``interlace``
package itself: that package imports the gateway's plugin host, and the
parsers import nothing from the gateway, not even through it.
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from .base import ParserFactory
from .code import MarkdownCodeParser
from .deepseek import DeepSeekV31Parser
from .glm45 import Glm45Parser
from .harmony import HarmonyParser
from .json_formats import HermesParser, Llama3JsonParser, MistralParser
from .kimi_k2 import KimiK2Parser
from .plan import PlanParser
from .pythonic import PythonicParser
from .qwen3_coder import Qwen3CoderParser
from .reasoning import REASONING_PARSERS

BUILTIN_PARSERS: dict[str, ParserFactory] = {
    "hermes": HermesParser,
    "mistral": MistralParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "markdown": MarkdownCodeParser,
    "plan": PlanParser,
    "qwen3_coder": Qwen3CoderParser,
    "glm45": Glm45Parser,
    "harmony": HarmonyParser,
    "deepseek_v31": DeepSeekV31Parser,
    "kimi_k2": KimiK2Parser,
}


@hookimpl
def register_parsers(register) -> None:  # type: ignore[no-untyped-def]
    """Register every built-in parser under its config name: the tool-call parsers, then the
    reasoning parsers (a namespace of their own: ``reasoning_parser:`` in a model config)."""
    for name, factory in BUILTIN_PARSERS.items():
        register(name, factory)
    for name, factory in REASONING_PARSERS.items():
        register(name, factory)
