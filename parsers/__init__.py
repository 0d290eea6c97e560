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
from .json_formats import HermesParser, Llama3JsonParser, MistralParser
from .plan import PlanParser
from .pythonic import PythonicParser

__all__ = [
    "ArgumentsDelta",
    "DuplicateParserError",
    "Event",
    "FieldComplete",
    "FormatError",
    "HermesParser",
    "LineComplete",
    "Llama3JsonParser",
    "MarkdownCodeParser",
    "MistralParser",
    "ParserError",
    "ParserRegistry",
    "PlanParser",
    "PythonStatementSplitter",
    "PythonicParser",
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
