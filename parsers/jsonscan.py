"""Incremental scanner for one JSON tool-call object.

The JSON formats (hermes, mistral, llama3_json) all embed calls shaped like
``{"name": "f", "arguments": {"a": 1, "b": [2, 3]}}``.  :class:`JsonCall` is fed
the text of one such object in arbitrary pieces and emits, as early as the
bytes allow:

* ``ToolCallStart`` when the ``name`` string closes,
* ``ArgumentsDelta`` with the raw text of the arguments object,
* ``FieldComplete`` when a top-level argument's value closes,
* ``ToolCallEnd`` (or a failure) when the object closes.

Why a hand-written scanner rather than a partial-JSON library: those re-parse
the whole buffer on every token (O(n^2) per call), while this keeps a small
state (container stack, string/escape flag, per-level member state for the two
levels that matter) and looks at each character once, jumping over string
bodies with a regex.  Structure is tracked, not fully validated: each completed
field is validated by ``json.loads`` of its span, and the whole object once
more when it closes, so malformed JSON is still caught.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from .events import ArgumentsDelta, FieldComplete, ToolCallEnd

if TYPE_CHECKING:
    from .base import StreamingParser

_STR_STOP = re.compile(r'["\\]')
_WS = " \t\r\n"
_SCALAR_END = ",}] \t\r\n"

# Member state of an object frame at a reported depth (1 = call, 2 = arguments).
_ARRAY = -1  # frame is an array: its elements are not reported
_KEY = 0  # expecting a key (or '}')
_COLON = 1  # key read, expecting ':'
_VALUE = 2  # expecting a value (or inside a string value)
_SCALAR = 3  # inside a number / true / false / null
_NESTED = 4  # inside an object / array value
_AFTER = 5  # value done, expecting ',' or '}'

ARGS_KEYS = frozenset(("arguments", "parameters"))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text} is out of range")
    return value


#: ``json.loads`` that rejects ``NaN``/``Infinity`` and overflowing numbers
#: (``1e999``): Python accepts them, but they are not JSON and an OpenAI client
#: would fail on the arguments, so a call holding them is malformed.
loads = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float).decode
#: Keys a real call object may start with; used to give up early on a bare JSON
#: answer that merely starts with ``{`` (llama3_json's tentative mode).
CALL_KEYS = frozenset(("name", "arguments", "parameters", "type", "id", "function"))


class JsonCall:
    """Scan one ``{"name": ..., "arguments": {...}}`` object fed in pieces.

    After each :meth:`feed`, check :attr:`done` (object closed; ``text[end:]``
    is input past the object) or :attr:`error` (``text[pos:]`` is the input
    not consumed).  With ``name`` given, the object *is* the arguments (Mistral
    v11 ``[TOOL_CALLS]f[ARGS]{...}``) and the call starts immediately.
    """

    __slots__ = (
        "p", "text", "pos", "stack", "modes", "keys", "vstart", "in_str", "str_start",
        "done", "end", "error", "index", "name", "pending", "args_from", "bare", "tentative", "args_sent",
        "sc",
    )

    def __init__(self, parser: StreamingParser, *, name: str | None = None, tentative: bool = False) -> None:
        self.p = parser
        self.text = ""
        self.pos = 1  # the caller guarantees text[0] == '{'
        self.stack = ["{"]
        self.modes = [0, _KEY, 0]
        self.keys: list[str | None] = [None, None, None]
        self.vstart = [0, 0, 0]
        self.in_str = False
        self.str_start = 0
        self.done = False
        self.end = 0
        self.error: str | None = None
        self.index: int | None = None
        self.name: str | None = None
        self.pending: list[tuple[str, Any]] | None = []  # events held until the name is known
        self.args_from = -1  # start of the not-yet-emitted arguments text, -1 when not streaming
        self.bare = name is not None
        self.tentative = tentative
        self.args_sent = False  # whether any ArgumentsDelta went out
        self.sc = -1  # start of a scalar inside an array or deeper than the arguments' fields
        if name is not None:
            self._begin(name)
            self.args_from = 0

    # -- feeding ------------------------------------------------------------
    def feed(self, chunk: str) -> None:
        # Detach before appending so CPython can grow the string in place
        # (its refcount is 1): ``self.text += chunk`` would copy the whole call
        # on every token, O(n^2) for long arguments.
        text = self.text
        self.text = ""
        text += chunk
        self.text = text
        del text
        self._scan()
        if not self.done and self.error is None and self.args_from >= 0:
            # A number or literal still being written is held back until it is
            # known to be JSON (``NaN``, ``1e999`` are not), so clients never get one.
            upto = self.pos
            d = len(self.stack)
            if self.sc >= 0:
                upto = self.sc
            elif d <= 2 and self.modes[d] == _SCALAR:
                upto = self.vstart[d]
            if upto > self.args_from:
                self._delta(self.text[self.args_from : upto])
                self.args_from = upto

    def _fail(self, msg: str, at: int, emit_to: int | None = None) -> bool:
        # Deltas up to the failure point go out first, so the events do not
        # depend on whether earlier deltas were flushed at a feed boundary;
        # a bad scalar itself (``emit_to``: its start) is never sent.
        cut = at if emit_to is None else emit_to
        if self.args_from >= 0 and cut > self.args_from:
            self._delta(self.text[self.args_from : cut])
        self.args_from = -1
        self.error = msg
        self.pos = at
        return False

    def _scan(self) -> None:  # noqa: C901 - one tight loop on purpose
        s = self.text
        n = len(s)
        i = self.pos
        stack = self.stack
        modes = self.modes
        while i < n:
            if self.in_str:
                m = _STR_STOP.search(s, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if s[i] == "\\":
                    if i + 1 >= n:
                        break  # the escaped character is in the next delta
                    i += 2
                    continue
                i += 1
                self.in_str = False
                d = len(stack)
                if d <= 2:
                    mode = modes[d]
                    if mode == _KEY:
                        try:
                            key = loads(s[self.str_start : i])
                        except ValueError as e:
                            self._fail(f"bad key string: {e}", i)
                            return
                        self.keys[d] = key
                        modes[d] = _COLON
                        if d == 1 and self.tentative and key not in CALL_KEYS:
                            self._fail(f"not a tool call: unexpected key {key!r}", i)
                            return
                    elif mode == _VALUE:
                        modes[d] = _AFTER
                        if not self._member(d, self.vstart[d], i):
                            return
                continue
            c = s[i]
            d = len(stack)
            if self.sc >= 0:  # an untracked scalar (in an array, or deeper): validate it as it ends
                if c not in _SCALAR_END:
                    i += 1
                    continue
                try:
                    loads(s[self.sc : i])
                except ValueError as e:
                    self._fail(f"bad value: {e}", i, self.sc)
                    return
                self.sc = -1
            if d <= 2 and modes[d] == _SCALAR:
                if c in _SCALAR_END:
                    modes[d] = _AFTER
                    if not self._member(d, self.vstart[d], i):
                        return
                else:
                    i += 1
                    continue
            if c in _WS:
                i += 1
                continue
            if c == '"':
                self.in_str = True
                self.str_start = i
                if d <= 2:
                    mode = modes[d]
                    if mode == _VALUE:
                        self.vstart[d] = i
                    elif mode != _KEY and mode != _ARRAY:
                        self._fail("unexpected '\"'", i)
                        return
                i += 1
                continue
            if c == "{" or c == "[":
                if d <= 2:
                    mode = modes[d]
                    if mode == _VALUE:
                        self.vstart[d] = i
                        modes[d] = _NESTED
                        if d == 1 and c == "{" and self.keys[1] in ARGS_KEYS and not self.bare:
                            self.args_from = i
                    elif mode != _ARRAY:
                        self._fail(f"unexpected {c!r}", i)
                        return
                    if d < 2:
                        modes[d + 1] = _KEY if c == "{" else _ARRAY
                stack.append(c)
                i += 1
                continue
            if c == "}" or c == "]":
                if (stack[-1] == "{") != (c == "}"):
                    self._fail(f"mismatched {c!r}", i)
                    return
                if d <= 2 and modes[d] != _ARRAY and modes[d] != _AFTER and modes[d] != _KEY:
                    self._fail(f"unexpected {c!r}", i)
                    return
                stack.pop()
                i += 1
                if d == 1:
                    self.pos = i
                    self._close(i)
                    return
                d -= 1
                if d <= 2 and modes[d] == _NESTED:
                    modes[d] = _AFTER
                    if not self._member(d, self.vstart[d], i):
                        return
                continue
            if c == ":":
                if d <= 2 and modes[d] != _ARRAY:
                    if modes[d] != _COLON:
                        self._fail("unexpected ':'", i)
                        return
                    modes[d] = _VALUE
                i += 1
                continue
            if c == ",":
                if d <= 2 and modes[d] != _ARRAY:
                    if modes[d] != _AFTER:
                        self._fail("unexpected ','", i)
                        return
                    modes[d] = _KEY
                i += 1
                continue
            if d <= 2 and modes[d] != _ARRAY:  # first character of a scalar
                if modes[d] != _VALUE:
                    self._fail(f"unexpected {c!r}", i)
                    return
                modes[d] = _SCALAR
                self.vstart[d] = i
            else:
                self.sc = i
            i += 1
        self.pos = i

    # -- members and events ---------------------------------------------------
    def _member(self, d: int, start: int, end: int) -> bool:
        """A member value at depth ``d`` spans ``text[start:end]``; act on it."""
        key = self.keys[d]
        span = self.text[start:end]
        if self.bare:
            if d != 1:
                return True
            return self._field(key, span, end)  # type: ignore[arg-type]
        if d == 1:
            if key == "name":
                try:
                    name = loads(span)
                except ValueError as e:
                    return self._fail(f"bad name: {e}", end)
                if not isinstance(name, str) or not name:
                    return self._fail(f"name must be a non-empty string, got {span}", end)
                if self.name is None:
                    self._begin(name)
            elif key in ARGS_KEYS:
                if self.args_from >= 0:
                    self._delta(self.text[self.args_from : end])
                    self.args_from = -1
                elif span[0] == '"':  # arguments given as a JSON-encoded string
                    try:
                        encoded = loads(span)
                        args = loads(encoded)
                    except ValueError as e:
                        return self._fail(f"bad arguments string: {e}", end)
                    if not isinstance(args, dict):
                        return self._fail("arguments must be an object", end)
                    self._delta(encoded)
                    for k, v in args.items():
                        self._emit_field(k, v)
            return True
        if self.keys[1] in ARGS_KEYS:
            return self._field(key, span, end)  # type: ignore[arg-type]
        return True

    def _field(self, key: str, span: str, end: int) -> bool:
        try:
            value = loads(span)
        except ValueError as e:
            # a bad number/literal was held back whole and is not sent; a string or container
            # may have been streamed in part already, so the cut stays where it failed
            scalar = span[:1] not in ('"', "{", "[")
            return self._fail(f"bad value for {key!r}: {e}", end, end - len(span) if scalar else None)
        if self.args_from >= 0 and end > self.args_from:
            self._delta(self.text[self.args_from : end])
            self.args_from = end
        self._emit_field(key, value)
        return True

    def _close(self, end: int) -> None:
        raw = self.text[:end]
        try:
            obj = loads(raw)
        except ValueError as e:
            self._fail(f"invalid JSON: {e}", end)
            return
        if self.bare:
            args: Any = obj
        else:
            args = {}
            for k in ARGS_KEYS:
                if k in obj:
                    args = obj[k]
                    break
            if isinstance(args, str):
                args = loads(args)  # validated in _member
        if self.name is None:
            self._fail("tool call has no name", end)
            return
        if not isinstance(args, dict):
            self._fail("arguments must be an object", end)
            return
        if self.args_from >= 0:  # bare mode: the object itself is the arguments
            self._delta(self.text[self.args_from : end])
            self.args_from = -1
        elif not self.args_sent:  # no arguments key: clients still get "{}"
            self._delta("{}")
        self.done = True
        self.end = end
        self.p._out.append(ToolCallEnd(self.index, self.name, args))  # type: ignore[arg-type]

    def _begin(self, name: str) -> None:
        self.name = name
        self.index = index = self.p._start_call(name)
        out = self.p._out
        for kind, payload in self.pending or ():
            if kind == "d":
                out.append(ArgumentsDelta(index, payload))
            else:
                out.append(FieldComplete(index, payload[0], payload[1]))
        self.pending = None

    def _delta(self, fragment: str) -> None:
        self.args_sent = True
        if self.index is None:
            self.pending.append(("d", fragment))  # type: ignore[union-attr]
        else:
            self.p._out.append(ArgumentsDelta(self.index, fragment))

    def _emit_field(self, key: str, value: Any) -> None:
        if self.index is None:
            self.pending.append(("f", (key, value)))  # type: ignore[union-attr]
        else:
            self.p._out.append(FieldComplete(self.index, key, value))
