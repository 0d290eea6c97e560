"""Markdown code fences as tool calls, and Python statement splitting.

A model that answers with a fenced ```` ```python ```` block is treated as
calling a code tool (default name ``python``) with arguments
``{"code": <block>}``.  While the block streams, each complete top-level
statement is emitted as ``LineComplete`` so an interpreter can run it while
the model is still writing the next one (Conveyor's line-granular partial
execution).  Fences in other languages are passed through as ``Text``.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable

from .base import IdFactory, StreamingParser
from .events import ArgumentsDelta, LineComplete, ParserError, ToolCallEnd

_COMPOUND = (
    ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try,
    ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match,
)  # fmt: skip
try:  # Python 3.11+
    _COMPOUND += (ast.TryStar,)
except AttributeError:  # pragma: no cover
    pass
_BLOCK_WORDS = frozenset(("def", "class", "if", "for", "while", "with", "try", "async", "match"))
_CONTINUATIONS = frozenset(("else", "elif", "except", "finally"))


def _first_word(line: str) -> str:
    word = line.split(None, 1)[0] if line.strip() else ""
    return word.split(":", 1)[0].split("(", 1)[0]


class PythonStatementSplitter:
    """Group source lines into complete top-level Python statements.

    Fed one full line at a time.  A simple statement is released as soon as it
    parses (``x = f(1,\\n 2)`` once the ``)`` line arrives); a compound statement
    (``def``, ``for``, ``if``, decorators, ...) is released when the next
    top-level line that cannot continue it starts, or at :meth:`flush`, because
    until then more indented lines, ``else:`` or ``except:`` may follow.
    Parsing is attempted only at those decision points, not on every token.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._block = False  # pending statement opened a block (or a decorator)

    def push(self, line: str) -> list[str]:
        """Add one line (without its newline); return statements now complete."""
        done: list[str] = []
        stripped = line.strip()
        if not self._lines:
            if not stripped or stripped.startswith("#"):
                return done
            self._block = stripped[0] == "@" or _first_word(stripped) in _BLOCK_WORDS
        elif self._block and stripped and not line[0].isspace() and not stripped.startswith("#"):
            if _first_word(stripped) not in _CONTINUATIONS and self._complete():
                done.append(self._take())
                self._block = stripped[0] == "@" or _first_word(stripped) in _BLOCK_WORDS
        self._lines.append(line)
        if not self._block and self._complete():
            done.append(self._take())
        return done

    def flush(self) -> list[str]:
        """End of code: whatever is pending is the last statement."""
        return [self._take()] if self._lines else []

    def _complete(self) -> bool:
        try:
            ast.parse("\n".join(self._lines) + "\n")
        except SyntaxError:
            return False
        return True

    def _take(self) -> str:
        text = "\n".join(self._lines).rstrip()
        self._lines = []
        self._block = False
        return text


class MarkdownCodeParser(StreamingParser):
    """```` ```python ```` fences become calls to a code tool.

    ``ArgumentsDelta`` streams ``{"code": "...`` JSON-escaped as the code
    arrives (a partial line is held only while it could be the closing fence);
    ``LineComplete`` carries each complete statement (or each non-blank line
    when ``python_statements`` is false, for non-Python code tools).  A fence
    still open at end of stream is a ``ParserError`` (truncated code should
    not run as if complete; its statements were already streamed).
    """

    name = "markdown"
    FENCE = "```"

    def __init__(
        self,
        *,
        tool_name: str = "python",
        languages: Iterable[str] = ("python", "py", "python3"),
        python_statements: bool = True,
        id_factory: IdFactory | None = None,
    ) -> None:
        super().__init__(id_factory=id_factory)
        self.tool_name = tool_name
        self.languages = frozenset(lang.lower() for lang in languages)
        self.python_statements = python_statements
        self._state = "text"  # text | code | other (a fence we pass through)
        self._index = -1
        self._code: list[str] = []
        self._sent = 0  # characters of the current partial line already in a delta
        self._splitter: PythonStatementSplitter | None = None

    def _feed(self) -> None:  # noqa: C901
        while True:
            buf = self._buf
            if self._state == "code":
                self._code_lines()
                return
            k = buf.find(self.FENCE)
            if k == -1:
                hold = len(buf)
                if buf.endswith("`"):
                    hold = len(buf) - (2 if buf.endswith("``") else 1)
                self._emit_text(buf[:hold])
                self._buf = buf[hold:]
                return
            nl = buf.find("\n", k)
            if nl == -1:  # need the info string of this fence
                self._emit_text(buf[:k])
                self._buf = buf[k:]
                return
            info = buf[k + 3 : nl].strip().lower()
            if self._state == "other":  # a closing fence of a passed-through block
                self._emit_text(buf[: nl + 1])
                self._buf = buf[nl + 1 :]
                self._state = "text"
            elif info in self.languages:
                self._emit_text(buf[:k])
                self._buf = buf[nl + 1 :]
                self._open()
            else:
                self._emit_text(buf[: nl + 1])
                self._buf = buf[nl + 1 :]
                self._state = "other"

    def _open(self) -> None:
        self._state = "code"
        self._index = self._start_call(self.tool_name)
        self._code = []
        self._sent = 0
        self._splitter = PythonStatementSplitter() if self.python_statements else None
        self._out.append(ArgumentsDelta(self._index, '{"code": "'))

    def _code_lines(self) -> None:
        buf = self._buf
        start = 0
        out = self._out
        index = self._index
        while True:
            nl = buf.find("\n", start)
            if nl == -1:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.strip() == self.FENCE:
                self._buf = buf[start:]
                self._close()
                self._feed()
                return
            rest = buf[start - 1 - len(line) + self._sent : start]
            self._sent = 0
            out.append(ArgumentsDelta(index, json.dumps(rest)[1:-1]))
            self._code.append(line)
            self._line(line)
        partial = buf[start:]
        self._buf = partial
        head = partial.lstrip(" ")
        if not (head.startswith(self.FENCE) or self.FENCE.startswith(head)) and len(partial) > self._sent:
            out.append(ArgumentsDelta(index, json.dumps(partial[self._sent :])[1:-1]))
            self._sent = len(partial)

    def _line(self, line: str) -> None:
        if self._splitter is not None:
            for stmt in self._splitter.push(line):
                self._out.append(LineComplete(self._index, stmt))
        elif line.strip():
            self._out.append(LineComplete(self._index, line))

    def _close(self) -> None:
        if self._splitter is not None:
            for stmt in self._splitter.flush():
                self._out.append(LineComplete(self._index, stmt))
        self._out.append(ArgumentsDelta(self._index, '"}'))
        code = "\n".join(self._code) + "\n" if self._code else ""
        self._out.append(ToolCallEnd(self._index, self.tool_name, {"code": code}))
        self._state = "text"

    def _finish(self) -> None:
        if self._state == "code":
            partial = self._buf
            if partial and partial.strip() != self.FENCE:
                self._code.append(partial)
            code = "\n".join(self._code)
            self._out.append(ParserError(self._index, "unterminated code block", code))
        else:
            self._emit_text(self._buf)
        self._buf = ""
