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
import re
from json.encoder import encode_basestring_ascii as _escape  # C speed, same output as json.dumps
from collections.abc import Iterable
from typing import Any

from .base import IdFactory, StreamingParser, quietly
from .events import ArgumentsDelta, LineComplete, ParserError, ToolCallEnd
from .formats import MARKDOWN

_BLOCK_WORDS = frozenset(("def", "class", "if", "for", "while", "with", "try", "async", "match"))
_CONTINUATIONS = frozenset(("else", "elif", "except", "finally"))


def _first_word(line: str) -> str:
    word = line.split(None, 1)[0] if line.strip() else ""
    return word.split(":", 1)[0].split("(", 1)[0]


_LEX = re.compile(r"""[\\'"#()\[\]{}]""")
_STR_END = {q: re.compile(r"\\.|" + q) for q in ("'", '"', "'''", '"""')}
_OPEN = frozenset("([{")


class PythonStatementSplitter:
    """Group source lines into complete top-level Python statements.

    Fed one full line at a time.  A cheap lexical scan (brackets, strings
    including triple-quoted ones, comments, backslash continuations) tells when a
    logical line is closed, exactly as Python's tokenizer ends a logical line, so
    a simple statement is released the moment it closes (``x = f(1,`` waits for
    the ``)`` line).  A compound statement (``def``, ``for``, ``if``, decorators,
    ...) is released when the next top-level line that cannot continue it
    arrives (not ``else:``/``except:``/``finally:``) and :func:`ast.parse`
    confirms the block is complete, or at :meth:`flush`.  ``ast`` runs once per
    block boundary, never per token.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._block = False  # pending statement opened a block (or is a decorator)
        self._decorator = False  # last top-level line was a decorator
        self._depth = 0  # open brackets
        self._quote = ""  # open string delimiter
        self._cont = False  # last line ended in a backslash continuation

    def push(self, line: str) -> list[str]:
        """Add one line (without its newline); return statements now complete."""
        done: list[str] = []
        stripped = line.strip()
        closed = not (self._depth > 0 or self._quote or self._cont)
        if not self._lines:
            if not stripped or stripped.startswith("#"):
                return done
            self._block = stripped[0] == "@" or _first_word(stripped) in _BLOCK_WORDS
        elif (
            self._block
            and closed
            and stripped
            and not line[0].isspace()
            and not stripped.startswith("#")
            and not self._decorator
            and _first_word(stripped) not in _CONTINUATIONS
            and self._parses()
        ):
            done.append(self._take())
            self._block = stripped[0] == "@" or _first_word(stripped) in _BLOCK_WORDS
        if closed and stripped and not line[0].isspace() and not stripped.startswith("#"):
            self._decorator = stripped[0] == "@"
        self._lines.append(line)
        self._scan(line)
        if not self._block and not (self._depth > 0 or self._quote or self._cont):
            done.append(self._take())
        return done

    def flush(self) -> list[str]:
        """End of code: whatever is pending is the last statement."""
        return [self._take()] if self._lines else []

    def _scan(self, line: str) -> None:
        depth, q = self._depth, self._quote
        i, n = 0, len(line)
        cont = False
        while i < n:
            if q:
                m = _STR_END[q].search(line, i)
                if m is None:
                    if len(q) == 1 and not line.endswith("\\"):
                        q = ""  # unterminated one-line string: a syntax error, not our problem
                    break
                i = m.end()
                if m.group() == q:
                    q = ""
                continue
            m = _LEX.search(line, i)
            if m is None:
                break
            c = m.group()
            i = m.end()
            if c == "#":
                break
            if c == "\\":
                cont = i == n
            elif c == "'" or c == '"':
                if line.startswith(c * 3, i - 1):
                    q = c * 3
                    i += 2
                else:
                    q = c
            elif c in _OPEN:
                depth += 1
            else:
                depth -= 1
        self._depth, self._quote, self._cont = depth, q, cont

    def _parses(self) -> bool:
        try:
            quietly(ast.parse, "\n".join(self._lines) + "\n")
        except SyntaxError:
            return False
        return True

    def _take(self) -> str:
        text = "\n".join(self._lines).rstrip()
        self._lines = []
        self._block = self._decorator = self._cont = False
        self._depth, self._quote = 0, ""
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
    format = MARKDOWN
    FENCE = "```"

    def __init__(
        self,
        *,
        tool_name: str = "python",
        languages: Iterable[str] = ("python", "py", "python3"),
        python_statements: bool = True,
        id_factory: IdFactory | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self.tool_name = tool_name
        self.languages = frozenset(lang.lower() for lang in languages)
        self.python_statements = python_statements
        self._state = "text"  # text | code | other (a fence we pass through)
        self._index = -1
        self._code: list[str] = []
        self._sent = 0  # characters of the current partial line already in a delta
        self._splitter: PythonStatementSplitter | None = None

    @property
    def in_call(self) -> bool:
        return self._state == "code"

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
            out.append(ArgumentsDelta(index, _escape(rest)[1:-1]))
            self._code.append(line)
            self._line(line)
        partial = buf[start:]
        self._buf = partial
        head = partial.lstrip(" ")
        if not (head.startswith(self.FENCE) or self.FENCE.startswith(head)) and len(partial) > self._sent:
            out.append(ArgumentsDelta(index, _escape(partial[self._sent :])[1:-1]))
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
        if self._state == "code" and self._buf.strip() == self.FENCE:
            self._buf = ""  # a closing fence at the very end of the stream (no newline after it)
            self._close()
        elif self._state == "code":
            partial = self._buf
            if partial and partial.strip() != self.FENCE:
                self._code.append(partial)
            code = "\n".join(self._code)
            self._out.append(ParserError(self._index, "unterminated code block", code))
        else:
            self._emit_text(self._buf)
        self._buf = ""
