"""An example Interlace plugin: a ``word_count`` tool.

Everything a tool plugin needs is here: a :class:`interlace.Tool` subclass
and a ``register_tools`` hook, found by Interlace through the ``interlace``
entry point in ``pyproject.toml``.  It imports only the public ``interlace``
package (never ``interlace.gateway.*``), which does not pull in torch.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from interlace import Granularity, Tool, hookimpl

__version__ = "0.1.0"

_WORD = re.compile(r"[\w']+", re.UNICODE)


class WordCountTool(Tool):
    """Counts words, optionally listing the most frequent ones.

    ``ON_FIELD``: the counting starts as soon as ``text`` is complete, while
    the model may still be writing ``top``.  Settings (``settings_schema``):
    ``lowercase`` (default true) folds case before counting; ``min_length``
    (default 1) ignores shorter words.  Both take effect in the worker, so the
    result shows whether the configured instance is the one that ran.
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
    settings_schema = {
        "type": "object",
        "properties": {
            "lowercase": {"type": "boolean", "description": "Fold case before counting."},
            "min_length": {"type": "integer", "minimum": 1, "description": "Ignore words shorter than this."},
        },
    }

    def __init__(self) -> None:
        self.lowercase = True
        self.min_length = 1

    def configure(self, settings: Mapping[str, Any]) -> None:
        # Already validated against settings_schema by the host: no type checks needed here.
        self.lowercase = settings.get("lowercase", True)
        self.min_length = settings.get("min_length", 1)

    def info(self) -> dict[str, Any]:
        return {"lowercase": self.lowercase, "min_length": self.min_length}

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
        return Counter(w for w in words if len(w) >= self.min_length)


@hookimpl
def register_tools(register):
    register(WordCountTool())
