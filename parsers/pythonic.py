"""Parser for the pythonic tool-call format (Llama 3.2 / Llama 4, ToolACE).

The model writes a Python list of calls, ``[f(a=1, b="x"), g()]``, as its whole
output (optionally wrapped in ``<|python_start|>...<|python_end|>``).  Each
keyword argument is evaluated with :func:`ast.literal_eval` the moment its
``,`` or ``)`` arrives and emitted as ``FieldComplete``; ``ArgumentsDelta``
carries a JSON rendering of the arguments built field by field, so OpenAI
clients see JSON whatever the model wrote.

A ``[`` is tentative until ``[name(`` is seen: ``[1] See ...`` is text.  A
list may follow prose (``Sure: [f(x=1)]``) or another list, as SGLang's
pythonic detector reads them; the gateway drops calls to tools that were not
offered, so prose that merely looks like a call cannot run anything.
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
from .formats import PYTHONIC

_WS = " \t\r\n"
_SPECIAL = re.compile(r"[\"'()\[\]{},]")
_STR_STOP = {q: re.compile(r"[\\" + q + "]") for q in ("'", '"')}
_CALL_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_HEAD = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")
_NAME = re.compile(r"[A-Za-z_][\w.]*\Z")
_KWARG = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)(.*)\Z", re.S)
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(text: str) -> Any:
    """A Python literal; JSON's ``true``/``false``/``null`` are accepted too.

    Models trained on JSON tool calls write them inside pythonic calls, and the
    format's grammar writes JSON values; ``ast.literal_eval`` alone refuses them.
    """
    try:
        return quietly(ast.literal_eval, text)
    except ValueError:
        if not any(n in text for n in _JSON_NAMES):
            raise
    tree = quietly(ast.parse, text, "<arg>", "eval")

    class _Names(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in _JSON_NAMES:
                return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
            return node

    return ast.literal_eval(_Names().visit(tree).body)


class PythonicParser(StreamingParser):
    """``[f(a=1, b="x"), g()]`` tool-call lists; see the module docstring."""

    name = "pythonic"
    format = PYTHONIC
    START = "<|python_start|>"
    END = "<|python_end|>"

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
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
        self._broken = False  # the current call failed: skip to its ')' and read the next one

    @property
    def in_call(self) -> bool:
        return self._state in ("open", "cand", "list")

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
                end, marker = split_text(buf, (self.START, "["))
                if final and marker is None:
                    end = len(buf)
                if marker == "[":  # a call list after prose, as SGLang reads it: "Sure: [f(x=1)]"
                    head = _CALL_HEAD.match(buf, end)
                    if head or (not final and _MAYBE_HEAD.match(buf, end)):
                        self._emit_text(buf[:end])
                        self._buf = buf[end:]
                        if not head:
                            return  # wait: "[name" may still become "[name("
                        self._prefix = ""
                        self._state = "cand"
                    else:
                        self._emit_text(buf[: end + 1])
                        self._buf = buf[end + 1 :]
                    continue
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
                    self._broken = False
                    self._index = self._start_call(name)
                    self._arg_start = i + 1
                depth += 1
                i += 1
                continue
            if c == ")" or c == "]" or c == "}":
                depth -= 1
                if depth == 1:
                    if c != ")":
                        self._error(f"unexpected {c!r}", i)
                        return
                    if not self._broken:
                        self._arg(s[self._arg_start : i], i)
                    if not self._broken:
                        self._end_call()
                    self._broken = False
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
                if not self._broken:
                    self._arg(s[self._arg_start : i], i)
                self._arg_start = i + 1
            elif depth == 1:
                if s[self._item_start : i].strip(_WS):
                    self._error("expected a function call", i)
                    return
                self._item_start = i + 1
            i += 1
        self._pos, self._depth, self._quote = i, depth, q

    def _arg(self, text: str, at: int) -> None:
        """One ``key=value`` argument is complete: evaluate and emit it.

        A bad argument fails its call only (:meth:`_call_failed`); the scan goes
        on to the call's ``)`` and reads the sibling calls after it.
        """
        if not text.strip(_WS):
            return  # f() or a trailing comma
        m = _KWARG.match(text)
        if not m:
            self._call_failed(f"positional argument not supported: {text.strip()!r}", at)
            return
        key = m.group(1)
        try:
            value = _literal(m.group(2).strip(_WS))
            encoded = json.dumps(value, allow_nan=False)  # NaN / inf (1e999) are not JSON
            if not isinstance(value, (str, int, float, bool)) and value is not None:
                value = json.loads(encoded)  # tuples -> lists: what a JSON client would see
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self._call_failed(f"bad value for {key!r}: not a JSON-compatible literal (finite numbers, strings, "
                              f"booleans, None, lists, dicts): {m.group(2).strip(_WS)!r}", at)
            return
        index = self._index
        assert index is not None
        sep = ", " if self._fields else "{"
        self._fields[key] = value
        self._out.append(ArgumentsDelta(index, f"{sep}{json.dumps(key)}: {encoded}"))
        self._out.append(FieldComplete(index, key, value))

    def _call_failed(self, msg: str, at: int) -> None:
        self._out.append(ParserError(self._index, msg, self._s[self._item_start : at + 1].strip(_WS + ",")))
        self._index = None
        self._broken = True

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
        elif st == "start":  # an answer of whitespace only: it is the answer
            self._emit_text(self._buf)
        self._buf = ""
