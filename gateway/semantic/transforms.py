"""Output transforms of semantic calls (Parrot section 5.1).

A call's output is often not what the next call should read: the JSON field
of a structured answer, the code inside a fence, the text without its
surrounding whitespace.  Parrot transforms a Semantic Variable's value on
its way between calls, as message queues transform messages.  A transform is
checked when the call is submitted (a bad regex is the client's 400) and
applied once the output is complete (no match is the producer's failure,
reported to whoever gets the variable).

    {"strip": true}
    {"json_field": "choices.0.text"}     dotted keys and list indices
    {"regex": "```python\\n(.*?)```", "group": 1}

Several keys apply in that order: strip, json_field, regex.

A transform runs on whatever a producer wrote, with a pattern a client
wrote, so neither may cost more than linear time.  Regexes are RE2's
(google-re2): matching is linear in the text whatever the pattern, where
Python's ``re`` backtracks -- ``(.?){20}.{20}\u0000`` took 1.3 s on 40
characters and doubled with each +1, holding the GIL (so a thread would not
have helped).  RE2 has no backreferences or lookaround, which are refused
at submit like any invalid pattern; the pattern's length and compiled
program size are bounded (the work of a match is at most the program size
times the text's length).  ``json_field`` measures the output's nesting
with a linear scan before parsing it, so a deeply nested output is the
producer's failure, never a RecursionError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import re2

from ..openai.wire import json_depth

KEYS = ("strip", "json_field", "regex", "group")
#: Characters of a client regex, at most.
MAX_PATTERN = 512
#: RE2 program size (instructions) of a client regex, at most: a match costs at most about this
#: many steps per byte of text.  ``a{1000}`` is 1004; everyday extraction patterns are under 100.
MAX_PROGRAM = 1000
#: Nesting an output may have for ``json_field`` (objects and arrays); deeper is the producer's failure.
MAX_JSON_DEPTH = 256

_OPTIONS = re2.Options()
_OPTIONS.dot_nl = True        # as re.DOTALL: "." spans lines (code fences)
_OPTIONS.log_errors = False   # a client's bad pattern is its 400, not a line in the server's log


class TransformSpecError(ValueError):
    """The transform as submitted is malformed (the client's mistake); ``param`` is the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class TransformFailed(ValueError):
    """The output does not fit the transform (the producer's failure)."""


@dataclass(frozen=True)
class Transform:
    strip: bool = False
    json_field: Optional[str] = None
    regex: Any = None  # a compiled RE2 pattern
    group: Any = 0

    @classmethod
    def parse(cls, spec: Any, where: str) -> Optional["Transform"]:
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise TransformSpecError(f"{where} must be an object, got {type(spec).__name__}", where)
        unknown = sorted(set(spec) - set(KEYS))
        if unknown:
            raise TransformSpecError(f"{where}: unknown key(s) {unknown}; expected some of {list(KEYS)}", where)
        strip = spec.get("strip", False)
        if not isinstance(strip, bool):
            raise TransformSpecError(f"{where}.strip must be a boolean", f"{where}.strip")
        field = spec.get("json_field")
        if field is not None and (not isinstance(field, str) or not field):
            raise TransformSpecError(f"{where}.json_field must be a non-empty string (a dotted path)", f"{where}.json_field")
        pattern, group = spec.get("regex"), spec.get("group", 0)
        regex = None
        if pattern is not None:
            if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN:
                raise TransformSpecError(f"{where}.regex must be a non-empty string of at most {MAX_PATTERN} "
                                         "characters", f"{where}.regex")
            regex = _compile(pattern, f"{where}.regex")
            if isinstance(group, bool) or not isinstance(group, (int, str)):
                raise TransformSpecError(f"{where}.group must be a group number or name", f"{where}.group")
            if isinstance(group, int) and not 0 <= group <= regex.groups:
                raise TransformSpecError(f"{where}.group {group} does not exist (the regex has {regex.groups})", f"{where}.group")
            if isinstance(group, str) and group not in regex.groupindex:
                raise TransformSpecError(f"{where}.group {group!r} is not a named group of the regex", f"{where}.group")
        elif "group" in spec:
            raise TransformSpecError(f"{where}.group needs a regex", f"{where}.group")
        return cls(strip=strip, json_field=field, regex=regex, group=group)

    def apply(self, text: str) -> str:
        if self.strip:
            text = text.strip()
        if self.json_field is not None:
            text = _json_field(text, self.json_field)
        if self.regex is not None:
            m = self.regex.search(text)
            if m is None:
                raise TransformFailed(f"the output does not match the regex {self.regex.pattern!r}: {_clip(text)}")
            got = m.group(self.group)
            if got is None:
                raise TransformFailed(f"the regex group {self.group!r} did not take part in the match: "
                                      f"{_clip(text)}")
            text = got
        return text


def _compile(pattern: str, where: str) -> Any:
    """``pattern`` as an RE2 program, refused when RE2 cannot run it (backreferences, lookaround,
    ``\\Z``: RE2's syntax) or its program is over :data:`MAX_PROGRAM`."""
    try:
        regex = re2.compile(pattern, _OPTIONS)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise TransformSpecError(f"{where} is not a regular expression RE2 accepts ({why}); RE2 syntax has no "
                                 "backreferences or lookaround (docs/semantic-variables.md)", where) from None
    if regex.programsize > MAX_PROGRAM:
        raise TransformSpecError(f"{where} is too complex: its RE2 program has {regex.programsize} instructions, "
                                 f"at most {MAX_PROGRAM} are allowed", where)
    return regex


def _json_field(text: str, path: str) -> str:
    depth = json_depth(text.encode("utf-8", "surrogatepass"))
    if depth > MAX_JSON_DEPTH:
        raise TransformFailed(f"json_field {path!r}: the output is JSON nested {depth} levels deep, over the "
                              f"{MAX_JSON_DEPTH} levels json_field reads: {_clip(text)}")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise TransformFailed(f"json_field {path!r}: the output is not JSON ({e}): {_clip(text)}") from None
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            raise TransformFailed(f"json_field {path!r}: no {part!r} in {_clip(json.dumps(value))}")
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _clip(text: str, n: int = 120) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")
