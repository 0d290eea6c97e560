"""Parsers for the JSON tool-call formats: hermes, mistral, llama3_json.

All three wrap ``{"name": ..., "arguments"|"parameters": {...}}`` objects in a
model-specific envelope; the objects themselves are scanned incrementally by
:class:`~interlace.parsers.jsonscan.JsonCall`.  Each parser here is only the
envelope state machine around it.
"""

from __future__ import annotations

import re
from typing import Any

from .base import IdFactory, StreamingParser, split_text
from .events import ParserError
from .formats import HERMES, LLAMA3_JSON, MISTRAL
from .jsonscan import JsonCall

_WS = " \t\r\n"
_RESYNC = re.compile(r'["\\{}\[\]]')
_NAME_CHARS = re.compile(r"[\w.\-]*")


class _JsonEnvelopeParser(StreamingParser):
    """Shared plumbing: run the current :class:`JsonCall`, handle its outcome."""

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self._state = "text"
        self._call: JsonCall | None = None
        # An error outside any call (bad envelope) is reported once the text it
        # swallowed is known, at recovery or end of stream, so its ``raw`` does
        # not depend on how the deltas were split.
        self._skip_msg: str | None = None
        self._skip_raw = ""

    def _envelope_error(self, msg: str) -> None:
        self._skip_msg = msg
        self._skip_raw = ""
        self._state = "skip"

    def _skipped(self, raw: str) -> None:
        if self._skip_msg is not None:
            self._skip_raw += raw

    def _end_skip(self) -> None:
        if self._skip_msg is not None:
            self._out.append(ParserError(None, self._skip_msg, self._skip_raw))
            self._skip_msg = None
            self._skip_raw = ""

    def _run_call(self) -> str:
        """Feed ``_buf`` to the current call; return 'done', 'error' or 'wait'.

        On 'done' and 'error', ``_buf`` holds the input after the object / after
        the point of failure respectively.
        """
        call = self._call
        assert call is not None
        chunk, self._buf = self._buf, ""
        call.feed(chunk)
        if call.done:
            self._buf = call.text[call.end :]
            return "done"
        if call.error is not None:
            self._buf = call.text[call.pos :]
            return "error"
        return "wait"

    def _call_error(self) -> None:
        call = self._call
        assert call is not None and call.error is not None
        self._out.append(ParserError(call.index, call.error, call.text[: call.pos]))

    def _start_resync(self, after: str) -> None:
        """After a malformed call, skip to the end of its object, then go to state ``after``.

        The broken object's brackets and strings are tracked from the point of
        failure on, so valid sibling calls after it are still read (as vLLM and
        SGLang salvage them).  A call broken so that its object never closes
        (an unterminated string) swallows the rest of the stream, as before.
        """
        call = self._call
        assert call is not None
        self._rs_depth = len(call.stack)
        self._rs_str = call.in_str
        self._rs_after = after
        self._state = "resync" if self._rs_depth else after

    def _resync(self) -> bool:
        """Consume ``_buf`` up to the end of the broken object; True once there."""
        buf = self._buf
        i, n = 0, len(buf)
        depth, in_str = self._rs_depth, self._rs_str
        while i < n:
            m = _RESYNC.search(buf, i)
            if m is None:
                i = n
                break
            i = m.start()
            c = buf[i]
            if in_str:
                if c == "\\":
                    if i + 1 >= n:
                        break
                    i += 2
                    continue
                if c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    self._buf = buf[i + 1 :]
                    self._state = self._rs_after
                    return True
            i += 1
        self._rs_depth, self._rs_str = depth, in_str
        self._buf = buf[i:]
        return False

    def _unterminated(self) -> None:
        call = self._call
        assert call is not None
        self._out.append(ParserError(call.index, "unterminated tool call", call.text))

    #: states in which a call (or call list) has begun and is not complete
    _CALL_STATES: frozenset[str] = frozenset()

    @property
    def in_call(self) -> bool:
        return self._state in self._CALL_STATES


class HermesParser(_JsonEnvelopeParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated.

    Used by Hermes 2/3, Qwen2.5/Qwen3 and SmolLM2.  Text between calls is
    ``Text``.  ``ToolCallEnd`` is emitted when the JSON object closes, not at
    ``</tool_call>`` (some models omit the closing tag at end of stream).  A
    malformed call emits ``ParserError`` at the first bad character and the
    rest up to ``</tool_call>`` is discarded.
    """

    name = "hermes"
    format = HERMES
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    _CALL_STATES = frozenset(("pre", "call"))

    def _feed(self) -> None:  # noqa: C901
        while True:
            st = self._state
            buf = self._buf
            if st == "text":
                end, marker = split_text(buf, (self.OPEN,))
                self._emit_text(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                self._buf = buf[end + len(self.OPEN) :]
                self._state = "pre"
            elif st == "pre":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest[0] != "{":
                    self._envelope_error("expected '{' after <tool_call>")
                    self._buf = rest
                    continue
                self._call = JsonCall(self)
                self._buf = rest
                self._state = "call"
            elif st == "call":
                r = self._run_call()
                if r == "wait":
                    return
                if r == "error":
                    self._call_error()
                    self._state = "skip"
                else:
                    self._state = "post"
            elif st == "post":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest.startswith(self.CLOSE):
                    self._buf = rest[len(self.CLOSE) :]
                    self._state = "text"
                elif self.CLOSE.startswith(rest):
                    return
                else:  # no closing tag: treat what follows as text
                    self._state = "text"
            else:  # skip: discard up to the closing tag
                k = buf.find(self.CLOSE)
                if k == -1:
                    end, _ = split_text(buf, (self.CLOSE,))
                    self._skipped(buf[:end])
                    self._buf = buf[end:]
                    return
                self._skipped(buf[:k])
                self._end_skip()
                self._buf = buf[k + len(self.CLOSE) :]
                self._state = "text"

    def _finish(self) -> None:
        st = self._state
        if st == "text":
            self._emit_text(self._buf)
        elif st == "pre":
            self._out.append(ParserError(None, "unterminated tool call", self._buf))
        elif st == "call":
            self._unterminated()
        elif st == "skip":
            self._skipped(self._buf)
            self._end_skip()
        self._buf = ""


class MistralParser(_JsonEnvelopeParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

    Also accepts a single object instead of a list, and the v11 tokenizer
    format of Mistral Small 3.2 / Magistral / Devstral,
    ``[TOOL_CALLS]name[ARGS]{...}`` (one marker per call), including the way
    it decodes when ``[ARGS]`` is skipped as a special token,
    ``[TOOL_CALLS]name{...}`` (vLLM's and SGLang's test outputs).  A malformed
    call fails (``ParserError`` with its index) and is skipped to the end of
    its object, so valid sibling calls after it are still read; a broken
    envelope (no call started) discards the rest of the stream and is reported
    at its end with everything it swallowed as ``raw``.
    """

    name = "mistral"
    format = MISTRAL
    MARK = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    _CALL_STATES = frozenset(("open", "v11name", "elem", "call", "sep", "resync"))

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self._single = False

    def _feed(self) -> None:  # noqa: C901
        while True:
            st = self._state
            buf = self._buf
            if st == "text":
                end, marker = split_text(buf, (self.MARK,))
                self._emit_text(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                self._buf = buf[end + len(self.MARK) :]
                self._state = "open"
            elif st == "open":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                c = rest[0]
                if c == "[":
                    self._buf = rest[1:]
                    self._single = False
                    self._state = "elem"
                elif c == "{":
                    self._buf = rest
                    self._single = True
                    self._state = "elem"
                elif c.isalpha() or c == "_":
                    self._buf = rest
                    self._state = "v11name"
                else:
                    self._envelope_error("expected '[' after [TOOL_CALLS]")
            elif st == "v11name":
                k = _NAME_CHARS.match(buf).end()  # type: ignore[union-attr]
                rest = buf[k:].lstrip(_WS)
                if not rest:
                    return  # the name may go on (it is re-read next time)
                if rest.startswith(self.ARGS):
                    rest = rest[len(self.ARGS) :].lstrip(_WS)
                    if not rest:
                        return
                elif self.ARGS.startswith(rest):
                    return
                if rest[0] != "{":
                    self._envelope_error("expected [ARGS] or '{' after the function name")
                    continue
                self._call = JsonCall(self, name=buf[:k])
                self._buf = rest
                self._single = True
                self._state = "call"
            elif st == "elem":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest[0] == "{":
                    self._call = JsonCall(self)
                    self._buf = rest
                    self._state = "call"
                elif rest[0] == "]" and not self._single:
                    self._buf = rest[1:]
                    self._state = "text"
                else:
                    self._envelope_error("expected a tool-call object")
            elif st == "call":
                r = self._run_call()
                if r == "wait":
                    return
                after = "text" if self._single else "sep"
                if r == "error":
                    self._call_error()
                    self._start_resync(after)
                else:
                    self._state = after
            elif st == "sep":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest[0] == ",":
                    self._buf = rest[1:]
                    self._state = "elem"
                elif rest[0] == "]":
                    self._buf = rest[1:]
                    self._state = "text"
                else:
                    self._envelope_error("expected ',' or ']' between tool calls")
            elif st == "resync":
                if not self._resync():
                    return
            else:  # skip: everything after a broken envelope is discarded
                self._skipped(buf)
                self._buf = ""
                return

    def _finish(self) -> None:
        st = self._state
        if st == "text":
            self._emit_text(self._buf)
        elif st == "call":
            self._unterminated()
        elif st in ("open", "elem", "sep", "v11name") and (st != "sep" or self._buf.strip(_WS)):
            self._out.append(ParserError(None, "unterminated tool-call list", self._buf))
        elif st == "skip":
            self._end_skip()
        self._buf = ""


class Llama3JsonParser(_JsonEnvelopeParser):
    """Llama 3.1/3.2/3.3 JSON tool calls.

    ``<|python_tag|>{"name": ..., "parameters": {...}}``, or a bare
    ``{"name": ...}`` object at the very start of the output; text before
    ``<|python_tag|>`` is ``Text``.  Several calls are separated by ``;`` or
    just whitespace (a newline), as vLLM and SGLang accept.  A bare ``{`` (at
    the start, or after a call without ``;``) is *tentative*: if its object
    turns out not to be a call (a non-call key, no name, invalid JSON before
    the name), the text is returned as ``Text``, so JSON answers pass through.
    Anything after ``<|python_tag|>`` that is not a JSON object (Llama's
    built-in ``brave_search.call(...)`` syntax) is also returned as ``Text``.
    A malformed call is skipped to the end of its object; later calls are read.
    """

    name = "llama3_json"
    format = LLAMA3_JSON
    MARK = "<|python_tag|>"
    _CALL_STATES = frozenset(("pre", "call", "resync"))

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        self._state = "start"
        self._tentative = False
        self._prefix = ""  # what introduced the pending call, re-emitted if it is not one

    def _feed(self) -> None:  # noqa: C901
        while True:
            st = self._state
            buf = self._buf
            if st == "start":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest.startswith(self.MARK):
                    self._buf = rest[len(self.MARK) :]
                    self._tentative = False
                    self._prefix = self.MARK
                    self._state = "pre"
                elif self.MARK.startswith(rest):
                    return
                elif rest[0] == "{":
                    self._prefix = buf[: len(buf) - len(rest)]  # leading whitespace, kept if not a call
                    self._buf = rest
                    self._tentative = True
                    self._state = "pre"
                else:
                    self._state = "text"
            elif st == "text":
                end, marker = split_text(buf, (self.MARK,))
                self._emit_text(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                self._buf = buf[end + len(self.MARK) :]
                self._tentative = False
                self._prefix = self.MARK
                self._state = "pre"
            elif st == "pre":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest[0] != "{":  # not JSON: give the marker back as text, rescan the rest
                    self._emit_text(self._prefix)
                    self._state = "text"
                    continue
                self._call = JsonCall(self, tentative=self._tentative)
                self._buf = rest
                self._state = "call"
            elif st == "call":
                r = self._run_call()
                if r == "wait":
                    return
                if r == "done":
                    self._state = "sep"
                    continue
                call = self._call
                assert call is not None
                if call.index is None and self._tentative:
                    self._emit_text(self._prefix + call.text[: call.pos])
                    self._state = "text"
                else:
                    self._call_error()
                    self._start_resync("sep")
            elif st == "sep":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest[0] == ";":
                    self._buf = rest[1:]
                    self._tentative = False
                    self._prefix = ""
                    self._state = "pre"
                elif rest[0] == "{":  # newline-separated calls
                    self._prefix = buf[: len(buf) - len(rest)]
                    self._buf = rest
                    self._tentative = True
                    self._state = "pre"
                else:
                    self._state = "text"
            else:  # resync
                if not self._resync():
                    return

    def _finish(self) -> None:
        st = self._state
        if st in ("start", "text"):
            self._emit_text(self._buf)
        elif st == "pre" and self._prefix and not self._tentative:
            self._out.append(ParserError(None, "unterminated tool call", self._buf))
        elif st == "call":
            call = self._call
            assert call is not None
            if call.index is None and self._tentative:
                self._emit_text(self._prefix + call.text)
            else:
                self._unterminated()
        self._buf = ""
