"""The state machine of the marker-section tool-call formats (DeepSeek-V3.1, Kimi-K2).

Their calls of a turn form one *section* between two markers; each call is a header
(a name, or Kimi's call id), a marker, its JSON arguments object and a closing marker.
:class:`MarkerSectionParser` reads that shape once for both; each format's module
(:mod:`.deepseek`, :mod:`.kimi_k2`) names its markers, says what its header means
and how its format is written.  The decisions they share are in :mod:`.deepseek`'s
docstring (markers bound everything; noise is reported, never dropped silently;
``call_end`` is the section end).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .base import IdFactory, split_text
from .events import ParserError
from .formats import CannotForce
from .json_formats import _JsonEnvelopeParser
from .jsonscan import JsonCall

_WS = " \t\r\n"


def _marker_at(rest: str, markers: Sequence[str]) -> tuple[str | None, bool]:
    """``(marker, False)`` if ``rest`` starts with one of ``markers``; ``(None, True)`` if it is a
    proper prefix of one (wait for more); ``(None, False)`` otherwise."""
    partial = False
    for m in markers:
        if rest.startswith(m):
            return m, False
        if m.startswith(rest):
            partial = True
    return None, partial


def forced_name(name_lit: str, markers: Sequence[str], what: str) -> str:
    """The function name behind ``envelope``'s JSON-encoded Lark literal, if the format can write it so
    that its parser reads it back (no surrounding whitespace, no marker inside)."""
    name = json.loads(json.loads(name_lit))
    if not name or name != name.strip(_WS) or any(m in name for m in markers):
        raise CannotForce(f"tools: function name {name!r} cannot be written in the {what} format")
    return name


class MarkerSectionParser(_JsonEnvelopeParser):
    """``SECTION_BEGIN (CALL_BEGIN header HEAD_END {json} CALL_END)* SECTION_END``, see the module docstring.

    Subclasses set the markers and implement :meth:`_header` (header text -> function name).  States:
    ``text``; ``sec`` (inside a section, between calls: whitespace, then a marker); ``head`` (a call's
    header, up to ``HEAD_END``); ``args`` (whitespace, then the object's ``{``); ``call`` (the object);
    ``post`` (after the object: ``CALL_END``); ``skip`` (a broken call or noise, up to the next marker).
    """

    SECTION_BEGIN: tuple[str, ...] = ()
    SECTION_END: tuple[str, ...] = ()
    CALL_BEGIN = ""
    HEAD_END = ""
    CALL_END = ""

    def __init__(self, *, id_factory: IdFactory | None = None, **kw: Any) -> None:
        super().__init__(id_factory=id_factory, **kw)
        cls = type(self)
        self._markers = (*cls.SECTION_BEGIN, *cls.SECTION_END, cls.CALL_BEGIN, cls.HEAD_END, cls.CALL_END)
        self._section = False  # inside a section (else: a lone call, or text)
        self._head = ""        # the current call's header text
        self._name = ""        # the current call's function name
        self._after = "post"   # the state after a call's object closes

    @property
    def in_call(self) -> bool:
        st = self._state
        return st != "text" and (self._section or st != "post")

    # -- for subclasses ---------------------------------------------------
    def _header(self, head: str) -> str | None:
        """The function name a call's (stripped) header gives, or None with an envelope error set."""
        raise NotImplementedError

    def _no_object(self, rest: str) -> None:
        """After ``HEAD_END``, ``rest`` does not start with ``{``."""
        self._fail_envelope(f"expected a JSON object after {self.HEAD_END}", rest)

    def _head_raw(self) -> str:
        return self.CALL_BEGIN + self._head + self.HEAD_END

    def _fail_envelope(self, message: str, rest: str, raw: str | None = None) -> None:
        """A call that never started is broken: report it, with what it swallowed, at the next marker."""
        self._envelope_error(message)
        self._skip_raw = self._head_raw() if raw is None else raw
        self._buf = rest

    # -- the state machine --------------------------------------------------
    def _feed(self) -> None:  # noqa: C901 - one state machine
        markers = self._markers
        while True:
            st = self._state
            buf = self._buf
            if st == "text":
                end, m = split_text(buf, markers)
                self._emit_text(buf[:end])
                if m is None:
                    self._buf = buf[end:]
                    return
                self._buf = buf[end + len(m) :]
                if m in self.SECTION_BEGIN:
                    self._section = True
                    self._state = "sec"
                elif m == self.CALL_BEGIN:
                    self._section = False
                    self._head = ""
                    self._state = "head"
                # else: a stray closing marker in text, dropped
            elif st == "sec":
                rest = buf.lstrip(_WS)
                if not rest:
                    self._buf = ""  # whitespace between calls is layout
                    return
                m, partial = _marker_at(rest, markers)
                if m is None:
                    if partial:
                        self._buf = rest
                        return
                    self._envelope_error(f"expected {self.CALL_BEGIN} or {self.SECTION_END[0]}")
                    self._buf = rest
                    continue
                self._buf = rest[len(m) :]
                if m in self.SECTION_BEGIN:
                    self._section = True
                elif m in self.SECTION_END:
                    self._section = False
                    self._state = "text"
                elif m == self.CALL_BEGIN:
                    self._head = ""
                    self._state = "head"
                elif m == self.CALL_END:  # after a broken call, or a call with no object: its end
                    self._state = "sec" if self._section else "text"
                else:  # HEAD_END with no call begun
                    self._envelope_error(f"unexpected {m}")
                    self._skip_raw = m
            elif st == "head":
                end, m = split_text(buf, markers)
                self._head += buf[:end]
                if m is None:
                    self._buf = buf[end:]
                    return
                if m != self.HEAD_END:  # a call that ends before its arguments
                    self._fail_envelope(f"tool call without {self.HEAD_END}", buf[end:], self.CALL_BEGIN + self._head)
                    self._end_skip()
                    self._state = "sec"  # the marker is read there
                    continue
                self._buf = buf[end + len(m) :]
                name = self._header(self._head.strip(_WS))
                if name is None:
                    self._skip_raw = self._head_raw()
                    continue
                self._name = name
                self._state = "args"
            elif st == "args":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest[0] == "{":
                    self._call = JsonCall(self, name=self._name)
                    self._buf = rest
                    self._state = "call"
                else:
                    self._no_object(rest)
            elif st == "call":
                r = self._run_args()
                if r == "wait":
                    return
                if r == "done":
                    self._state = self._after
                elif r == "error":
                    self._call_error()
                    self._state = "skip"  # the rest of the broken call, silently (its error is out)
                else:  # a marker before the object closed
                    call = self._call
                    assert call is not None
                    self._out.append(ParserError(call.index, "unterminated tool-call arguments", call.text))
                    self._state = "sec"
            elif st == "post":
                rest = buf.lstrip(_WS)
                if not rest:
                    return
                if rest.startswith(self.CALL_END):
                    self._buf = rest[len(self.CALL_END) :]
                    self._state = "sec" if self._section else "text"
                elif self.CALL_END.startswith(rest):
                    return
                elif self._section:  # no call end: read on as between calls
                    self._buf = rest
                    self._state = "sec"
                else:  # a lone call without its end: what follows is text
                    self._state = "text"
            elif st == "skip":
                end, m = split_text(buf, markers)
                self._skipped(buf[:end])
                if m is None:
                    self._buf = buf[end:]
                    return
                if m == self.HEAD_END:  # inside the broken call
                    self._skipped(m)
                    self._buf = buf[end + len(m) :]
                    continue
                self._end_skip()
                self._buf = buf[end:]
                self._state = "sec"  # the marker is read there
            elif not self._feed_more(st):
                return

    def _feed_more(self, state: str) -> bool:
        """Subclass states; return False to wait for more input."""
        raise AssertionError(f"unknown state {state!r}")

    def _run_args(self) -> str:
        """Feed the current call the input up to the next marker: 'done', 'error', 'cut' (a marker came
        first) or 'wait'.  On 'done'/'error' ``_buf`` holds the input after the object / the failure."""
        call = self._call
        assert call is not None
        buf = self._buf
        end, m = split_text(buf, self._markers)
        if end:
            call.feed(buf[:end])
        if call.done:
            self._buf = call.text[call.end :] + buf[end:]
            return "done"
        if call.error is not None:
            self._buf = call.text[call.pos :] + buf[end:]
            return "error"
        self._buf = buf[end:]
        return "wait" if m is None else "cut"

    def _finish(self) -> None:
        st, buf = self._state, self._buf
        if st == "text":
            self._emit_text(buf)
        elif st in ("sec", "post") or st in self._CLOSING:
            rest = buf.strip(_WS)  # only a partial marker can be left here
            if not self._section:
                self._emit_text(buf)
            elif rest and not any(m.startswith(rest) for m in self._closers()):
                self._out.append(ParserError(None, "unterminated tool-call section", rest))
            # else: the calls are complete, the output stopped in (or before) a closing marker
        elif st == "head":
            self._out.append(ParserError(None, "unterminated tool call", self.CALL_BEGIN + self._head + buf))
        elif st == "call":
            call = self._call
            assert call is not None
            self._out.append(ParserError(call.index, "unterminated tool call", call.text + buf))
        elif st == "skip":
            self._skipped(buf)
            self._end_skip()
        else:  # after the header, before the object: nothing started
            self._out.append(ParserError(None, "unterminated tool call", self._pending_raw() + buf))
        self._buf = ""

    #: subclass states after a call's object, finished like ``post``
    _CLOSING: frozenset[str] = frozenset()

    def _closers(self) -> tuple[str, ...]:
        """What may follow complete calls: an output cut inside one of these has lost nothing."""
        return (*self.SECTION_END, self.CALL_END)

    def _pending_raw(self) -> str:
        """The text of a call whose header is read but whose object has not begun."""
        return self._head_raw()
