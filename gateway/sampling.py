"""Sampling settings taken from a request body, and their limits, stated once.

Two surfaces take the same settings from JSON: the chat route's top-level
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed`` and ``stop``,
and a semantic call's per-output ``sampling`` object.  They are one concept,
so they get one set of limits -- OpenAI's: temperature in [0, 2], top_p in
(0, 1], at most 16 stop strings, a seed within int64 -- written once, here,
as the JSON Schema fragment :data:`PROPERTIES`.  The chat request schema
embeds it; :func:`sampling_params` checks a semantic call's ``sampling``
object against it and builds the engine's :class:`SamplingParams`.
(``SamplingParams`` keeps wider bounds of its own, temperature up to 100: the
engine's last check, for callers that are not HTTP requests.)

A null means "not given", as in the chat route.  Torch-free, like the rest of
the gateway's request checks.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import jsonschema

from ..engine_ext.errors import InvalidSampling
from ..engine_ext.protocol import SamplingParams
from .errors import InvalidInput

INT32_MAX = 2 ** 31 - 1
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1

#: The sampling settings a request may give, with their limits.
PROPERTIES: Dict[str, Any] = {
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": INT32_MAX},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": 0, "maximum": INT32_MAX},
    "seed": {"type": ["integer", "null"], "minimum": INT64_MIN, "maximum": INT64_MAX},
    "stop": {"oneOf": [{"type": "string"}, {"type": "null"},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]},
}


def _is_integer(checker: Any, instance: Any) -> bool:
    """JSON Schema's "integer" accepts 3.0; a parameter that must be an int must be sent as one."""
    return isinstance(instance, int) and not isinstance(instance, bool)


#: JSON Schema 2020-12 as request bodies are checked: an "integer" is an int.
RequestValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))
_validator = RequestValidator({"type": "object", "properties": PROPERTIES})


def sampling_params(spec: Any, where: Optional[str] = None, **base: Any) -> SamplingParams:
    """The engine's :class:`SamplingParams` for the settings a request gives in ``spec`` (keys of
    :data:`PROPERTIES`; null is not given) over ``base`` (the server's defaults, and what a request
    cannot set: logits processors, ...).  Out of its limits, :class:`InvalidInput` naming the field,
    under ``where`` (``outputs.out.sampling``) when the settings are an object inside the body."""
    spec = {} if spec is None else spec
    if not isinstance(spec, dict):
        raise InvalidInput(f"{where or 'sampling'} must be an object", param=where)
    unknown = sorted(set(spec) - set(PROPERTIES))
    if unknown:
        raise InvalidInput(f"{where or 'sampling'}: unknown key(s) {unknown}; expected some of "
                           f"{sorted(PROPERTIES)}", param=where)
    err = jsonschema.exceptions.best_match(_validator.iter_errors(spec))
    if err is not None:
        param = ".".join(([where] if where else []) + [str(p) for p in err.absolute_path]) or None
        raise InvalidInput(f"{param}: {err.message}", param=param, code="invalid_value")
    given = {k: v for k, v in spec.items() if v is not None}
    if "stop" in given:
        given["stop"] = (given["stop"],) if isinstance(given["stop"], str) else tuple(given["stop"])
    try:
        return SamplingParams(**{**base, **given})
    except InvalidSampling as e:
        raise InvalidInput(f"{where}: {e}" if where else str(e), param=where, code="invalid_value") from None
