"""The ``format`` tool: fill a ``str.format``-style template with earlier results.

The last stage of the Conveyor Planning workload ("output the ratio using a
given format").  :class:`string.Formatter` is used with two restrictions,
because ``"{x.__class__.__init__.__globals__}"`` is a classic leak and
``"{:>999999999}"`` a memory bomb: field names must be plain names or
positions (no ``.attr`` / ``[index]``), and widths/precisions are capped.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

from interlace import Granularity, Tool, ToolError

__all__ = ["FormatTool", "safe_format", "FormatError"]

MAX_WIDTH = 1000
MAX_OUTPUT_CHARS = 100_000
_FIELD_RE = re.compile(r"\w*")
# [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_SPEC_RE = re.compile(r"^(?:.?[<>=^])?[+\- ]?z?#?0?(?P<width>\d*)[,_]?(?:\.(?P<precision>\d+))?[a-zA-Z%]?$", re.S)


class FormatError(ToolError):
    """The template is malformed, refers to a missing value or uses a forbidden construct."""


class _SafeFormatter(string.Formatter):
    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if not _FIELD_RE.fullmatch(field_name):
            raise FormatError(f"attribute or index access is not allowed: {{{field_name}}}")
        return super().get_field(field_name, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        match = _SPEC_RE.match(format_spec)
        if match is None:
            raise FormatError(f"unsupported format spec {format_spec!r}")
        for part in ("width", "precision"):
            if match.group(part) and int(match.group(part)) > MAX_WIDTH:
                raise FormatError(f"{part} above {MAX_WIDTH} in {format_spec!r}")
        return super().format_field(value, format_spec)


def safe_format(template: str, values: Mapping[str, Any] | Sequence[Any] | None) -> str:
    """Format ``template`` with named (mapping) or positional (list) values; raise :class:`FormatError`."""
    args: Sequence[Any] = values if isinstance(values, Sequence) and not isinstance(values, str) else ()
    kwargs: Mapping[str, Any] = values if isinstance(values, Mapping) else {}
    try:
        text = _SafeFormatter().vformat(template, args, kwargs)
    except FormatError:
        raise
    except KeyError as exc:
        raise FormatError(f"no value named {exc.args[0]!r}") from None
    except IndexError:
        raise FormatError("not enough positional values") from None
    except (ValueError, TypeError) as exc:
        raise FormatError(str(exc)) from None
    if len(text) > MAX_OUTPUT_CHARS:
        raise FormatError(f"result longer than {MAX_OUTPUT_CHARS} characters")
    return text


class FormatTool(Tool):
    """Formats a template; the result is the formatted string."""

    name = "format"
    description = (
        "Format text from a template with {name} or {0} placeholders (Python format specs such as "
        "{ratio:.2f} allowed) and a 'values' object or list."
    )
    parameters = {
        "type": "object",
        "properties": {
            "template": {"type": "string", "maxLength": MAX_OUTPUT_CHARS},
            "values": {"type": ["object", "array"]},
        },
        "required": ["template"],
        "additionalProperties": False,
    }
    settings_schema: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
    granularity = Granularity.ON_FINISH
    timeout_s = 5.0
    workers = 2
    memory_mb = 256

    def info(self) -> dict[str, Any]:
        """What the tool can reach: only the values passed in the call."""
        return {"reaches": "nothing: str.format on the call's own values, no attribute or index access",
                "max_output_chars": MAX_OUTPUT_CHARS}

    def on_finish(self, arguments: dict[str, Any]) -> str:
        return safe_format(arguments["template"], arguments.get("values") or {})
