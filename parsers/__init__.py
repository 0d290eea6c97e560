"""Streaming tool-call parsers: model text deltas in, tool-call events out.

One parser per output stream serves every tool; see :mod:`.events` for the
event types and their ordering guarantees and :mod:`.base` for the error policy.
"""

from .base import (
    DuplicateParserError,
    ParserRegistry,
    StreamingParser,
    UnknownParserError,
    counting_ids,
    random_call_id,
)
from .code import MarkdownCodeParser, PythonStatementSplitter
from .deepseek import DeepSeekV31Parser
from .events import (
    ArgumentsDelta,
    Event,
    FieldComplete,
    LineComplete,
    ParserError,
    Text,
    ToolCallEnd,
    ToolCallStart,
)
from .formats import FormatError, ToolFormat, check_format
from .glm45 import Glm45Parser
from .harmony import HarmonyParser
from .json_formats import HermesParser, Llama3JsonParser, MistralParser
from .kimi_k2 import KimiK2Parser
from .plan import PlanParser
from .pythonic import PythonicParser
from .qwen3_coder import Qwen3CoderParser

__all__ = [
    "ArgumentsDelta",
    "DeepSeekV31Parser",
    "DuplicateParserError",
    "Event",
    "FieldComplete",
    "FormatError",
    "Glm45Parser",
    "HarmonyParser",
    "HermesParser",
    "KimiK2Parser",
    "LineComplete",
    "Llama3JsonParser",
    "MarkdownCodeParser",
    "MistralParser",
    "ParserError",
    "ParserRegistry",
    "PlanParser",
    "PythonStatementSplitter",
    "PythonicParser",
    "Qwen3CoderParser",
    "StreamingParser",
    "Text",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolFormat",
    "UnknownParserError",
    "check_format",
    "counting_ids",
    "random_call_id",
]
