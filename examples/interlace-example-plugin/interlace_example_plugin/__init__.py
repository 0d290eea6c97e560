"""An example Interlace plugin: a ``word_count`` tool.

Everything a tool plugin needs is here: a :class:`~interlace.gateway.tools.Tool`
subclass and a ``register_tools`` hook, found by Interlace through the
``interlace`` entry point in ``pyproject.toml``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from interlace.gateway.hookspecs import hookimpl
from interlace.gateway.tools import Granularity, Tool

__version__ = "0.1.0"

_WORD = re.compile(r"[\w']+", re.UNICODE)


class WordCountTool(Tool):
    """Counts words, optionally listing the most frequent ones.

    ``ON_FIELD``: the counting starts as soon as ``text`` is complete, while
    the model may still be writing ``top``.  Settings: ``lowercase`` (default
    true) folds case before counting.
    """

    name = "word_count"
    description = "Count the words in a text and optionally list the most frequent ones."
    parameters = {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "top": {"type": "integer", "minimum": 0, "maximum": 50, "description": "How many frequent words to list."},
        },
        "required": ["text"],
        "additionalProperties": False,
    }
    granularity = Granularity.ON_FIELD
    timeout_s = 5.0

    def __init__(self) -> None:
        self.lowercase = True

    def configure(self, settings: Mapping[str, Any]) -> None:
        self.lowercase = bool(settings.get("lowercase", True))

    def on_start(self) -> None:
        self._counts: Counter[str] | None = None

    def on_field(self, key: str, value: Any) -> None:
        if key == "text":
            self._counts = self.count(value)

    def on_finish(self, arguments: dict[str, Any]) -> dict[str, Any]:
        counts = self._counts if self._counts is not None else self.count(arguments["text"])
        return {
            "words": sum(counts.values()),
            "distinct": len(counts),
            "top": [[w, n] for w, n in counts.most_common(arguments.get("top", 0))] if arguments.get("top") else [],
        }

    def count(self, text: str) -> Counter[str]:
        words = _WORD.findall(text.lower() if self.lowercase else text)
        return Counter(words)


@hookimpl
def register_tools(register):
    register(WordCountTool())
