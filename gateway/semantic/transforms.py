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
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

KEYS = ("strip", "json_field", "regex", "group")
#: A bound on client regexes: Python's re backtracks, so the pattern's size is kept small.
MAX_PATTERN = 512


class TransformSpecError(ValueError):
    """The transform as submitted is malformed (the client's mistake)."""


class TransformFailed(ValueError):
    """The output does not fit the transform (the producer's failure)."""


@dataclass(frozen=True)
class Transform:
    strip: bool = False
    json_field: Optional[str] = None
    regex: Optional["re.Pattern[str]"] = None
    group: Any = 0

    @classmethod
    def parse(cls, spec: Any, where: str) -> Optional["Transform"]:
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise TransformSpecError(f"{where} must be an object, got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(KEYS))
        if unknown:
            raise TransformSpecError(f"{where}: unknown key(s) {unknown}; expected some of {list(KEYS)}")
        strip = spec.get("strip", False)
        if not isinstance(strip, bool):
            raise TransformSpecError(f"{where}.strip must be a boolean")
        field = spec.get("json_field")
        if field is not None and (not isinstance(field, str) or not field):
            raise TransformSpecError(f"{where}.json_field must be a non-empty string (a dotted path)")
        pattern, group = spec.get("regex"), spec.get("group", 0)
        regex = None
        if pattern is not None:
            if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN:
                raise TransformSpecError(f"{where}.regex must be a non-empty string of at most {MAX_PATTERN} "
                                         "characters")
            try:
                regex = re.compile(pattern, re.DOTALL)
            except re.error as e:
                raise TransformSpecError(f"{where}.regex is not a valid regular expression: {e}") from None
            if isinstance(group, bool) or not isinstance(group, (int, str)):
                raise TransformSpecError(f"{where}.group must be a group number or name")
            if isinstance(group, int) and not 0 <= group <= regex.groups:
                raise TransformSpecError(f"{where}.group {group} does not exist (the regex has {regex.groups})")
            if isinstance(group, str) and group not in regex.groupindex:
                raise TransformSpecError(f"{where}.group {group!r} is not a named group of the regex")
        elif "group" in spec:
            raise TransformSpecError(f"{where}.group needs a regex")
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


def _json_field(text: str, path: str) -> str:
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
