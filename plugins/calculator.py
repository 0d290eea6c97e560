"""The ``calculator`` tool: arithmetic on an ``ast`` whitelist, never ``eval``.

The expression is parsed with :func:`ast.parse` and walked by a tiny
interpreter that knows numbers, ``+ - * / // % **``, unary signs,
parentheses and a fixed table of :mod:`math` functions and constants.
Anything else (names, attributes, calls of other things, strings,
comprehensions...) is rejected before evaluation, so ``__import__('os')``
never gets near a runtime.  Integer results are capped in size, and ``**``
and ``round``'s ``ndigits`` are checked *before* anything is computed,
because ``9**9**9`` or ``round(1, -10**8)`` would otherwise pin a worker for
minutes (the runtime's CPU and wall-time limits are the backstop).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from interlace import Granularity, InvalidToolArguments, Tool, ToolError

__all__ = ["CalculatorTool", "evaluate", "CalculatorError"]

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4096  # ~1233 decimal digits
MAX_FACTORIAL = 1000
MAX_NDIGITS = 1000  # round(x, n): |n| beyond this would build 10**|n| (round(1, -10**8) ran for minutes)

Number = int | float


class CalculatorError(ToolError):
    """The expression is not allowed or cannot be evaluated."""


def _factorial(n: Number) -> int:
    if not isinstance(n, int) or n < 0:
        raise CalculatorError("factorial() needs a non-negative integer")
    if n > MAX_FACTORIAL:
        raise CalculatorError(f"factorial() argument above {MAX_FACTORIAL}")
    return math.factorial(n)


def _round(number: Number, ndigits: Number | None = None) -> Number:
    """``round`` with ``ndigits`` bounded: CPython computes ``10 ** -ndigits`` for an int."""
    if ndigits is not None:
        if not isinstance(ndigits, int):
            raise CalculatorError("round() ndigits must be an integer")
        if abs(ndigits) > MAX_NDIGITS:
            raise CalculatorError(f"round() ndigits beyond ±{MAX_NDIGITS}")
        return round(number, ndigits)
    return round(number)


FUNCTIONS: dict[str, Callable[..., Number]] = {
    **{name: getattr(math, name) for name in (
        "sqrt", "exp", "log", "log10", "log2", "sin", "cos", "tan", "asin", "acos", "atan", "atan2",
        "sinh", "cosh", "tanh", "hypot", "degrees", "radians", "floor", "ceil", "fabs", "gcd", "trunc")},
    "abs": abs,
    "round": _round,
    "min": min,
    "max": max,
    "factorial": _factorial,
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf}

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _check_size(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    return value


def _power(base: Number, exp: Number) -> Number:
    """``base ** exp`` refused up front when the result could not fit the size cap."""
    if isinstance(base, int) and isinstance(exp, int) and abs(base) > 1 and exp > 0:
        if exp * math.log2(abs(base)) > MAX_INT_BITS:
            raise CalculatorError(f"exponent too large: {base}**{exp} exceeds {MAX_INT_BITS} bits")
    result = base**exp
    if isinstance(result, complex):
        raise CalculatorError("complex result (negative number to a fractional power)")
    return result


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise CalculatorError(f"unknown name {node.id!r}")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise CalculatorError(f"function not allowed: {ast.unparse(node.func)!r}")
        if node.keywords:
            raise CalculatorError("keyword arguments are not allowed")
        if len(node.args) > 16:
            raise CalculatorError("too many arguments")
        return _check_size(FUNCTIONS[node.func.id](*(_eval(arg) for arg in node.args)))
    raise CalculatorError(f"not allowed in an expression: {type(node).__name__}")


def evaluate(expression: str) -> Number:
    """Evaluate an arithmetic expression safely; raise :class:`CalculatorError`."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"syntax error: {exc.msg}") from None
    try:
        return _eval(tree)
    except CalculatorError:
        raise
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as exc:
        raise CalculatorError(f"{type(exc).__name__}: {exc}") from None
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


class CalculatorTool(Tool):
    """Evaluates arithmetic.  ``ON_FIELD``: the value is computed as soon as
    ``expression`` is complete (an invalid expression aborts the call early)."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses and the functions "
        + ", ".join(sorted(FUNCTIONS)) + "; constants " + ", ".join(sorted(CONSTANTS)) + "."
    )
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "minLength": 1, "maxLength": MAX_EXPRESSION_CHARS}},
        "required": ["expression"],
        "additionalProperties": False,
    }
    settings_schema: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
    granularity = Granularity.ON_FIELD
    timeout_s = 5.0
    workers = 2
    memory_mb = 256

    def info(self) -> dict[str, Any]:
        """What the tool can reach: nothing but arithmetic on bounded numbers."""
        return {"reaches": "nothing: arithmetic on an AST whitelist, no eval",
                "max_int_bits": MAX_INT_BITS, "max_expression_chars": MAX_EXPRESSION_CHARS}

    def on_start(self) -> None:
        self._early: tuple[str, Number] | None = None

    def on_field(self, key: str, value: Any) -> None:
        if key == "expression" and isinstance(value, str):
            try:
                self._early = (value, evaluate(value))
            except CalculatorError as exc:
                raise InvalidToolArguments("expression", str(exc)) from None

    def result_text(self, content: Any) -> str:
        """A later step that refers to a calculation wants the value alone."""
        return super().result_text(content["result"] if isinstance(content, dict) and "result" in content else content)

    def on_finish(self, arguments: dict[str, Any]) -> dict[str, Any]:
        expression = arguments["expression"]
        if self._early is not None and self._early[0] == expression:
            value = self._early[1]
        else:
            try:
                value = evaluate(expression)
            except CalculatorError as exc:
                raise InvalidToolArguments("expression", str(exc)) from None
        if isinstance(value, float) and not math.isfinite(value):
            return {"expression": expression, "result": str(value)}
        return {"expression": expression, "result": value}
