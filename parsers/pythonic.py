"""Parser for the pythonic tool-call format (Llama 3.2 / Llama 4, ToolACE).

The model writes a Python list of calls, ``[f(a=1, b="x"), g()]``, as its whole
output (optionally wrapped in ``<|python_start|>...<|python_end|>``).  Each
keyword argument is evaluated with :func:`ast.literal_eval` the moment its
``,`` or ``)`` arrives and emitted as ``FieldComplete``; ``ArgumentsDelta``
carries a JSON rendering of the arguments built field by field, so OpenAI
clients see JSON whatever the model wrote.

A leading ``[`` is tentative until ``[name(`` is seen: ``[1] See ...`` is text.
Positional arguments are not part of the format and make the call a
``ParserError``; after a broken call the rest of the list is discarded.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from .base import IdFactory, StreamingParser, quietly, split_text
from .events import ArgumentsDelta, FieldComplete, ParserError, ToolCallEnd

_WS = " \t\r\n"
_SPECIAL = re.compile(r"[\"'()\[\]{},]")
_STR_STOP = {q: re.compile(r"[\\" + q + "]") for q in ("'", '"')}
_CALL_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_HEAD = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")
_NAME = re.compile(r"[A-Za-z_][\w.]*\Z")
_KWARG = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)(.*)\Z", re.S)


class PythonicParser(StreamingParser):
    """``[f(a=1, b="x"), g()]`` tool-call lists; see the module docstring."""

    name = "pythonic"
    START = "<|python_start|>"
    END = "<|python_end|>"

    def __init__(self, *, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory=id_factory)
        self._state = "start"
        self._prefix = ""
        # list-scanner state, over self._s (the list's text)
        self._s = ""
        self._pos = 0
        self._depth = 0
        self._quote = ""  # current string delimiter ('', ', ", ''' or """)
        self._item_start = 0
        self._arg_start = 0
        self._index: int | None = None  # index of the call being read
        self._call_name = ""
        self._fields: dict[str, Any] = {}

    def _feed(self, final: bool = False) -> None:  # noqa: C901
        while True:
            st = self._state
            buf = self._buf
            if st == "start":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest.startswith(self.START):
                    self._buf = rest[len(self.START) :]
                    self._prefix = self.START
                    self._state = "open"
                elif self.START.startswith(rest) and not final:
                    return
                elif rest[0] == "[":
                    self._buf = rest
                    self._state = "cand"
                else:
                    self._state = "text"
            elif st == "text":
                end, marker = split_text(buf, (self.START,))
                if final and marker is None:
                    end = len(buf)
                self._emit_text(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                self._buf = buf[end + len(self.START) :]
                self._prefix = self.START
                self._state = "open"
            elif st == "open":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest[0] == "[":
                    self._buf = rest
                    self._state = "cand"
                else:  # not a call list after all: rescan the rest as text
                    self._emit_text(self._prefix)
                    self._state = "text"
            elif st == "cand":
                if _CALL_HEAD.match(buf):
                    self._s, self._buf = buf, ""
                    self._pos, self._depth, self._quote = 1, 1, ""
                    self._item_start = 1
                    self._state = "list"
                elif _MAYBE_HEAD.match(buf) and not final:
                    return
                else:
                    self._emit_text(self._prefix)
                    self._state = "text"
            elif st == "list":
                s, self._s = self._s, ""
                s += buf  # in place (refcount 1): no O(n^2) copying of long lists
                self._s, self._buf = s, ""
                del s
                self._scan(final)
                if self._state == "list":
                    return
            elif st == "post":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest.startswith(self.END):
                    self._buf = rest[len(self.END) :]
                    self._state = "text"
                elif self.END.startswith(rest) and not final:
                    return
                else:
                    self._state = "text"
            else:  # skip
                self._buf = ""
                return

    def _scan(self, final: bool) -> None:  # noqa: C901
        s = self._s
        n = len(s)
        i = self._pos
        depth = self._depth
        q = self._quote
        while i < n:
            if q:
                m = _STR_STOP[q[0]].search(s, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if s[i] == "\\":
                    if i + 1 >= n:
                        break
                    i += 2
                    continue
                if len(q) == 3:
                    if s.startswith(q, i):
                        i += 3
                        q = ""
                    elif i + 3 > n and not final:
                        break  # might be the closing triple quote
                    else:
                        i += 1
                else:
                    i += 1
                    q = ""
                continue
            m = _SPECIAL.search(s, i)
            if m is None:
                i = n
                break
            i = m.start()
            c = s[i]
            if c == '"' or c == "'":
                if i + 3 > n and not final:
                    break  # need two more characters to tell '' from '''
                if s.startswith(c * 3, i):
                    q = c * 3
                    i += 3
                else:
                    q = c
                    i += 1
                continue
            if c == "(" or c == "[" or c == "{":
                if depth == 1:
                    name = s[self._item_start : i].strip(_WS)
                    if c != "(" or not _NAME.match(name):
                        self._error(f"expected a function call, got {s[self._item_start : i + 1]!r}", i)
                        return
                    self._call_name = name
                    self._fields = {}
                    self._index = self._start_call(name)
                    self._arg_start = i + 1
                depth += 1
                i += 1
                continue
            if c == ")" or c == "]" or c == "}":
                depth -= 1
                if depth == 1:
                    if c != ")" or not self._arg(s[self._arg_start : i], i):
                        if self._state != "skip":
                            self._error(f"unexpected {c!r}", i)
                        return
                    self._end_call()
                    self._item_start = i + 1
                elif depth == 0:
                    if c != "]" or s[self._item_start : i].strip(_WS):
                        self._error("expected ']' to end the tool-call list", i)
                        return
                    self._buf = s[i + 1 :]
                    self._s = ""
                    self._state = "post"
                    return
                i += 1
                continue
            # c == ","
            if depth == 2:
                if not self._arg(s[self._arg_start : i], i):
                    return
                self._arg_start = i + 1
            elif depth == 1:
                if s[self._item_start : i].strip(_WS):
                    self._error("expected a function call", i)
                    return
                self._item_start = i + 1
            i += 1
        self._pos, self._depth, self._quote = i, depth, q

    def _arg(self, text: str, at: int) -> bool:
        """One ``key=value`` argument is complete: evaluate and emit it."""
        if not text.strip(_WS):
            return True  # f() or a trailing comma
        m = _KWARG.match(text)
        if not m:
            self._error(f"positional argument not supported: {text.strip()!r}", at)
            return False
        key = m.group(1)
        try:
            value = quietly(ast.literal_eval, m.group(2).strip(_WS))
            encoded = json.dumps(value)
            if not isinstance(value, (str, int, float, bool)) and value is not None:
                value = json.loads(encoded)  # tuples -> lists: what a JSON client would see
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self._error(f"bad value for {key!r}: not a literal: {m.group(2).strip(_WS)!r}", at)
            return False
        index = self._index
        assert index is not None
        sep = ", " if self._fields else "{"
        self._fields[key] = value
        self._out.append(ArgumentsDelta(index, f"{sep}{json.dumps(key)}: {encoded}"))
        self._out.append(FieldComplete(index, key, value))
        return True

    def _end_call(self) -> None:
        index = self._index
        assert index is not None
        self._out.append(ArgumentsDelta(index, "}" if self._fields else "{}"))
        self._out.append(ToolCallEnd(index, self._call_name, self._fields))
        self._index = None

    def _error(self, msg: str, at: int) -> None:
        self._out.append(ParserError(self._index, msg, self._s[: at + 1]))
        self._index = None
        self._s = ""
        self._state = "skip"

    def _finish(self) -> None:
        self._feed(final=True)
        st = self._state
        if st == "list":
            if self._index is not None or self._quote or self._depth != 1 or self._s[self._item_start :].strip(_WS):
                self._out.append(ParserError(self._index, "unterminated tool call", self._s))
        elif st == "open":
            self._out.append(ParserError(None, "unterminated tool call", self._buf))
        self._buf = ""
