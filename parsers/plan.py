"""Parser for plan-style outputs (Conveyor's planning workload, LLMCompiler).

The model writes a plan, one tool call per line, naming each result so later
steps can refer to it::

    Thought: I need both market caps.
    $1 = search("Nvidia market cap")
    $2 = search("AMD market cap")
    $3 = calculator("$1 / $2")
    4. join()

Both ``$N = tool(...)`` and LLMCompiler's ``N. tool(...)`` are accepted.  Each
call is emitted (``ToolCallStart``, one ``ArgumentsDelta``, ``ToolCallEnd``)
as soon as its line ends, so independent steps start while the model is still
planning the rest.  ``ToolCallEnd.arguments`` is::

    {"step": 3, "args": ["$1 / $2"], "kwargs": {}, "depends_on": [1, 2]}

``args``/``kwargs`` are the literal argument values; a bare reference
(``calculator($1)``) becomes the string ``"$1"``.  ``depends_on`` lists, sorted
and unique, every step number referenced as ``$N`` or ``${N}`` anywhere in the
arguments (inside strings too): the executor must wait for those steps and
substitute their results (:class:`~interlace.parsers.formats.PlanFormat`
says how: the format owns the ``$N`` syntax).  Other lines are ``Text``; a line that starts like a
step (``$N =``) but does not parse is a ``ParserError``.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from .base import IdFactory, StreamingParser, quietly
from .events import ArgumentsDelta, ParserError, ToolCallEnd
from .formats import PLAN

_STEP = re.compile(r"\s*(?:\$(\d+)\s*=|(\d+)\.)\s*(.*?)\s*;?\s*\Z", re.S)
_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\((.*)\)\Z", re.S)
_REF = PLAN.REFERENCE  # the $N syntax: the format's, which also resolves the references (PlanFormat)


def _quote_refs(args: str) -> str:
    """Turn bare ``$N`` references (outside string literals) into ``"$N"``."""
    if "$" not in args:
        return args
    out: list[str] = []
    i, n, q = 0, len(args), ""
    while i < n:
        c = args[i]
        if q:
            if c == "\\":
                out.append(args[i : i + 2])
                i += 2
                continue
            if c == q:
                q = ""
        elif c in "'\"":
            q = c
        elif c == "$":
            m = _REF.match(args, i)
            if m:
                out.append(json.dumps(m.group(0)))
                i = m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


def parse_step(line: str) -> tuple[int, str, dict[str, Any]] | str | None:
    """Parse one plan line: ``(step, tool, arguments)``, an error string, or None for text."""
    m = _STEP.match(line)
    if not m:
        return None
    dollar = m.group(1) is not None
    step = int(m.group(1) or m.group(2))
    call = _CALL.match(m.group(3))
    if not call:
        return f"step ${step} is not a tool call" if dollar else None
    name, argtext = call.group(1), call.group(2)
    try:
        node = quietly(ast.parse, f"f({_quote_refs(argtext)})", "<plan>", "eval").body
        assert isinstance(node, ast.Call)
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        if len(kwargs) != len(node.keywords):
            raise ValueError("**kwargs not supported")
    except (SyntaxError, ValueError, TypeError, AssertionError, RecursionError):
        return f"step {step}: arguments are not literals: {argtext!r}" if dollar or argtext.strip() else None
    try:  # JSON data only: no NaN/inf (1e999), sets or bytes, which OpenAI clients cannot read
        args, kwargs = json.loads(json.dumps([args, kwargs], allow_nan=False))
    except (TypeError, ValueError):
        return f"step {step}: arguments are not JSON data (finite numbers, strings, lists, dicts): {argtext!r}"
    deps = sorted({int(d) for d in _REF.findall(argtext)})
    return step, name, {"step": step, "args": args, "kwargs": kwargs, "depends_on": deps}


class PlanParser(StreamingParser):
    """One tool call per ``$N = tool(args)`` line; see the module docstring."""

    name = "plan"
    format = PLAN

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self._text_line = False  # the current line is known to be prose

    def _feed(self) -> None:
        buf = self._buf
        start = 0
        while True:
            nl = buf.find("\n", start)
            if nl == -1:
                break
            line = buf[start:nl]
            if self._text_line:
                self._emit_text(buf[start : nl + 1])
            else:
                self._line(line, buf[start : nl + 1])
            self._text_line = False
            start = nl + 1
        partial = buf[start:]
        if not self._text_line:
            head = partial.lstrip()
            if not head or head[0] == "$" or head[0].isdigit():
                self._buf = partial  # could still become a step
                return
            self._text_line = True
        self._emit_text(partial)
        self._buf = ""

    def _line(self, line: str, with_nl: str) -> None:
        parsed = parse_step(line)
        if parsed is None:
            self._emit_text(with_nl)
        elif isinstance(parsed, str):
            self._out.append(ParserError(None, parsed, line))
        else:
            _, name, arguments = parsed
            index = self._start_call(name)
            self._out.append(ArgumentsDelta(index, json.dumps(arguments)))
            self._out.append(ToolCallEnd(index, name, arguments))

    def _finish(self) -> None:
        if self._buf:
            if self._text_line:
                self._emit_text(self._buf)
            else:
                self._line(self._buf, self._buf)
        self._buf = ""
