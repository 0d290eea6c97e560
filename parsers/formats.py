"""Tool-call formats: everything the gateway must know about one format, in one place.

A parser reads a format; its ``format`` class attribute (a :class:`ToolFormat`)
says how that same format is *written*: the system-prompt instructions for
models whose chat template has no tools section, how an assistant call and a
tool result look in the transcript, the markers after which a call is complete
(the engine's ``pause_on`` for server-side tools), the special tokens the
parser must see in the decoded text, and the grammar that forces calls for
``tool_choice: "required"`` / a named function.  This is the one definition of
each format: the prompt renderer (``gateway/prompt.py``) and constrained
decoding (``engine_ext/constraints/grammar.py``) only ever ask the format.

A third-party parser plugin supplies the same: a parser class with a
``format`` attribute implementing :class:`ToolFormat`'s methods (subclassing it
is the easy way).  :meth:`ParserRegistry.register` refuses a factory without
one, so a misconfigured plugin fails at gateway start-up, not on a request.

``call_end`` markers are *candidate* pause points: plain strings the engine
can match in the decoded text.  JSON formats have no marker that cannot also
occur inside arguments (``}]`` closes a nested list too), so the parser is the
authority: a pause where :attr:`StreamingParser.in_call` is still true is
spurious and decoding should simply go on.  Where a format's calls end only at
EOS (Mistral v11 ``[TOOL_CALLS]f[ARGS]{...}``, Llama's ``<|eom_id|>``), the
stream finishes there and the gateway runs the calls it parsed.

Forcing calls.  ``grammar`` is handed a :class:`GrammarBuilder`: the building
blocks of the constrained-decoding side (``engine_ext/constraints/grammar.py``
implements them with llguidance).  This module only declares what it calls, so
the parsers import nothing from the engine or the gateway.  A format that
cannot force the requested calls raises :class:`CannotForce`; the builder
raises its own error for an invalid tool list.  Both messages are meant for
the API client.

Calls that use earlier results.  In one format, a call can use the results of
earlier calls of the same turn: the plan format (``$2 = f($1)``).  The agent
loop asks every format the same questions and never asks which format it has:
:meth:`ToolFormat.ends_calls`, :meth:`~ToolFormat.step`,
:meth:`~ToolFormat.depends_on`, :meth:`~ToolFormat.reference`,
:meth:`~ToolFormat.tool_arguments` and :meth:`~ToolFormat.named_result`.  The base class answers for formats without
such references, so only :class:`PlanFormat` overrides them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol


class FormatError(TypeError):
    """A parser was registered without a usable ``format`` (contract 4)."""


class CannotForce(ValueError):
    """The format cannot force the calls asked for (``tool_choice`` "required" or a named function).

    Raised by :meth:`ToolFormat.grammar`.  The message is meant for the API client:
    the HTTP layer answers 400 with it, as for the grammar builder's own errors.
    """


class GrammarBuilder(Protocol):
    """The grammar building blocks that :meth:`ToolFormat.grammar` is handed.

    ``GrammarCompiler`` in ``engine_ext/constraints/grammar.py`` implements them.  The
    grammars it returns are opaque here: a format passes them back to the caller as they are.
    Expressions and rules are in llguidance's Lark dialect.  Every method may raise the
    builder's own error for an invalid tool list (a client error, like :class:`CannotForce`).
    """

    def functions(self, tools: Sequence[Mapping[str, Any]], force: str | None = None) -> dict[str, dict[str, Any]]:
        """``{name: parameters schema}`` of the function tools (only ``force`` when given), validated."""

    def json_rule(self, schema: Mapping[str, Any]) -> str:
        """The Lark right-hand side matching JSON valid against ``schema``."""

    def literal(self, text: str) -> str:
        """A Lark string literal for ``text``."""

    def marker(self, text: str) -> str:
        """A Lark expression for a format marker: the special token when the vocabulary has one, else the text."""

    def envelope(self, tools: Sequence[Mapping[str, Any]], *, force: str | None, parallel: bool,
                 call: Callable[[str, str], str], open: str = '""', sep: str = '""', close: str = '""') -> Any:
        """The grammar of calls laid out as ``open call (sep call)* close`` (without ``parallel``:
        ``open call close``)."""

    def tool_grammar(self, lark: str, functions: Mapping[str, Mapping[str, Any]]) -> Any:
        """Compile a whole tool-call Lark grammar over ``functions`` (from :meth:`functions`)."""


def _functions_json(functions: Iterable[Mapping[str, Any]]) -> str:
    """One ``{"type": "function", "function": ...}`` line per tool, as Hermes/Qwen prompts list them."""
    return "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)


class ToolFormat:
    """How one tool-call format is written; see the module docstring.

    Subclasses set ``name``, ``call_end`` and ``special_tokens`` and implement
    the methods.  ``render_calls`` / ``render_results`` group several calls or
    results of one turn (a list format writes one list, not one list per
    call); the defaults join the single renderings with ``call_separator``.

    The agent loop asks the format about calls that use earlier results (see
    the module docstring).  The defaults describe a format with no such calls,
    and a subclass overrides them only if its calls can refer to each other:

    * :meth:`ends_calls` is False: every decoded call names a tool;
    * :meth:`step` is None: a call's result cannot be referred to;
    * :meth:`depends_on` is empty: a call waits for nothing;
    * :meth:`reference` writes a step as its number (only messages use it);
    * :meth:`tool_arguments` returns the decoded arguments as they are;
    * :meth:`named_result` returns the result text as it is.
    """

    name: str = ""
    #: markers after which a call (or call list) may be complete: the engine's pause_on
    call_end: tuple[str, ...] = ()
    #: special tokens the parser must see in the decoded text (decode with skip_special_tokens=False)
    special_tokens: tuple[str, ...] = ()
    #: markers that open a call (or call list): the triggers from which ``strict`` tools' arguments are
    #: constrained under ``tool_choice: "auto"`` (each must be where :meth:`grammar`'s text begins); empty:
    #: the format has no such marker (a bare JSON object, a Python list) and cannot constrain calls lazily
    call_start: tuple[str, ...] = ()
    call_separator: str = "\n"

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        """System-prompt text describing ``functions`` (OpenAI function objects)."""
        raise NotImplementedError

    def render_call(self, name: str, arguments: Any) -> str:
        """One assistant tool call, exactly as this format's parser reads it back."""
        raise NotImplementedError

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """All the calls of one assistant turn."""
        return self.call_separator.join(self.render_call(n, a) for n, a in calls)

    def render_result(self, content: str) -> str:
        """One tool result, as the user-side turn that answers a call."""
        raise NotImplementedError

    def render_results(self, contents: Sequence[str]) -> str:
        return "\n".join(self.render_result(c) for c in contents)

    def grammar(self, compiler: GrammarBuilder, tools: list[dict[str, Any]], force: str | None,
                parallel: bool) -> Any:
        """A grammar forcing calls of ``tools`` (only ``force`` when given), then EOS, built with ``compiler``.

        Raises :class:`CannotForce` when the format cannot force these calls.
        """
        raise CannotForce(f"tool_choice cannot be enforced for the {self.name!r} tool-call format")

    # -- calls that use earlier results (the defaults: a format without such calls)
    def ends_calls(self, name: str) -> bool:
        """True if a decoded call named ``name`` is not a tool call but the end of the calls (a plan's
        ``join()``). The loop runs nothing for it."""
        return False

    def step(self, arguments: Any) -> int | None:
        """The number that later calls use to refer to this call's result (the ``N`` of a plan's ``$N``),
        or None if they cannot refer to it."""
        return None

    def depends_on(self, arguments: Any) -> Sequence[int]:
        """The steps (see :meth:`step`) whose results this call's arguments refer to. The loop runs the
        call after those results are there."""
        return ()

    def reference(self, step: int) -> str:
        """How this format's text refers to the result of ``step`` (for messages about that result)."""
        return str(step)

    def tool_arguments(self, arguments: Any, parameters: Mapping[str, Any] | None,
                       results: Mapping[int, str]) -> Any:
        """A decoded call's arguments in the form the tool takes them. ``parameters`` is the tool's JSON
        schema. ``results`` maps each step this call depends on to that step's result as text. A reference
        that has no result stays as written."""
        return arguments

    def named_result(self, arguments: Any, text: str) -> str:
        """The result of the call with ``arguments`` as the model reads it back (before
        :meth:`render_results` wraps the turn)."""
        return text

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


#: what the agent loop asks every format about calls that use earlier results (ToolFormat has the defaults)
_REFERENCE_METHODS = ("ends_calls", "step", "depends_on", "reference", "tool_arguments", "named_result")


def check_format(fmt: Any, owner: str) -> ToolFormat:
    """``fmt`` if it implements contract 4, else a :class:`FormatError` naming ``owner``."""
    if fmt is None:
        raise FormatError(
            f"parser {owner} has no `format` attribute: a tool-call parser must declare how its format is "
            "written (prompt instructions, call rendering, call-end markers, grammar); give the parser class "
            "a `format = MyFormat()` attribute (see interlace.parsers.formats.ToolFormat) and register the class")
    problems = []
    if not isinstance(getattr(fmt, "name", None), str) or not fmt.name:
        problems.append("`name` must be a non-empty string")
    for attr in ("call_end", "special_tokens"):
        v = getattr(fmt, attr, None)
        if not isinstance(v, tuple) or not all(isinstance(s, str) and s for s in v):
            problems.append(f"`{attr}` must be a tuple of non-empty strings")
    for meth in ("instructions", "render_call", "render_result", "grammar", *_REFERENCE_METHODS):
        if not callable(getattr(fmt, meth, None)):
            problems.append(f"`{meth}` must be a method")
    if problems:
        raise FormatError(f"parser {owner}: its `format` is not a tool-call format: " + "; ".join(problems))
    return fmt  # type: ignore[no-any-return]


# ======================================================================= JSON
class _JsonEnvelope(ToolFormat):
    """Formats whose calls are ``{"name": ..., <args_key>: {...}}`` objects."""

    args_key = "arguments"

    def call_json(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False)

    def _call_lark(self, name_lit: str, args_rule: str) -> str:
        """The Lark expression of one call object (``name_lit`` = the JSON-encoded name as a Lark literal)."""
        key = json.dumps(self.args_key)
        return f'"{{\\"name\\": " {name_lit} ", " {json.dumps(key)} ": " {args_rule} "}}"'


class HermesFormat(_JsonEnvelope):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen, SmolLM2)."""

    name = "hermes"
    call_end = ("</tool_call>",)
    call_start = ("<tool_call>",)
    special_tokens = ("<tool_call>", "</tool_call>")

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{_functions_json(functions)}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_call(self, name: str, arguments: Any) -> str:
        return f"<tool_call>\n{self.call_json(name, arguments)}\n</tool_call>"

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        open_, close = compiler.marker("<tool_call>"), compiler.marker("</tool_call>")
        return compiler.envelope(
            tools, force=force, parallel=parallel, sep=compiler.literal("\n"),
            call=lambda n, a: f'{open_} "\\n" {self._call_lark(n, a)} "\\n" {close}')


class MistralFormat(_JsonEnvelope):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; results in ``[TOOL_RESULTS]...[/TOOL_RESULTS]``.

    The parser also reads the v11 form ``[TOOL_CALLS]f[ARGS]{...}`` (and
    ``[TOOL_CALLS]f{...}``), which has no closing marker: those calls end at
    EOS.  The list form this format writes and forces ends with ``}]``.
    """

    name = "mistral"
    call_end = ("}]",)
    call_start = ("[TOOL_CALLS]",)
    special_tokens = ("[TOOL_CALLS]", "[ARGS]")

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        tools = json.dumps([{"type": "function", "function": f} for f in functions], ensure_ascii=False)
        return (f"[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS]\n\n"
                "To call functions, answer with [TOOL_CALLS] followed by a JSON list of calls and nothing else:\n"
                '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}, ...]')

    def render_call(self, name: str, arguments: Any) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "[TOOL_CALLS][" + ", ".join(self.call_json(n, a) for n, a in calls) + "]"

    def render_result(self, content: str) -> str:
        return "[TOOL_RESULTS]" + json.dumps({"content": content}, ensure_ascii=False) + "[/TOOL_RESULTS]"

    def render_results(self, contents: Sequence[str]) -> str:
        return "".join(self.render_result(c) for c in contents)

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        return compiler.envelope(
            tools, force=force, parallel=parallel, open=f'{compiler.marker("[TOOL_CALLS]")} "["',
            sep=compiler.literal(", "), close='"]"', call=self._call_lark)


class Llama3JsonFormat(_JsonEnvelope):
    """Llama 3.1+ JSON calls: ``{"name": ..., "parameters": {...}}``, several separated by ``; ``.

    ``<|python_tag|>`` in front is optional (the parser accepts both).  A call
    object ends with ``}}`` (its parameters, then itself), the candidate pause
    point; on real Llama models the turn then ends with ``<|eom_id|>``/EOS.
    """

    name = "llama3_json"
    args_key = "parameters"
    call_end = ("}}",)
    #: none: the grammar's calls begin with a bare ``{"name": `` (after prose only ``<|python_tag|>``, which the
    #: grammar does not write, opens a call), so no marker opens every call and nothing else
    call_start = ()
    special_tokens = ("<|python_tag|>",)
    call_separator = "; "

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        return ("You have access to the following functions. To call a function, respond with only a JSON object "
                'of the form {"name": <function-name>, "parameters": <args-json-object>}; separate several '
                "calls with \"; \". Do not use variables.\n\n" + _functions_json(functions))

    def render_call(self, name: str, arguments: Any) -> str:
        return self.call_json(name, arguments)

    def render_result(self, content: str) -> str:
        return content

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        return compiler.envelope(tools, force=force, parallel=parallel, sep=compiler.literal("; "),
                                 call=self._call_lark)


# =================================================================== pythonic
def python_literal(value: Any) -> str:
    """``value`` (JSON data) as a Python literal that :func:`ast.literal_eval` reads back."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"non-finite number {value!r} has no JSON form")
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {python_literal(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    raise TypeError(f"not JSON data: {type(value).__name__}")


class PythonicFormat(ToolFormat):
    """``[f(a=1, b="x"), g()]`` (Llama 3.2 / Llama 4 pythonic, ToolACE).

    The list closes with ``)]``, the candidate pause point (``x=[(1, 2)]``
    inside arguments is a spurious one, which the parser's ``in_call`` tells).
    The grammar writes each keyword value as JSON, which the parser accepts
    (``true``/``false``/``null`` included), keyword arguments in the schema's
    property order, required ones mandatory.
    """

    name = "pythonic"
    call_end = (")]",)
    call_start = ()  # none: a call list opens with "[", which prose writes too
    special_tokens = ("<|python_start|>", "<|python_end|>")

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        return ("You can call functions. To call them, respond with only a Python list of calls, "
                "[func_name1(param1=value1, param2=value2), func_name2(param=value)], using keyword "
                "arguments with literal values, and nothing else.\n\nFunctions:\n" + _functions_json(functions))

    def render_call(self, name: str, arguments: Any) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in (a or {}).items()) + ")"
                               for n, a in calls) + "]"

    def render_result(self, content: str) -> str:
        return content

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        functions = compiler.functions(tools, force)
        rules: list[str] = []
        alts: list[str] = []
        for i, (name, params) in enumerate(functions.items()):
            if not all(ch.isalnum() or ch in "_." for ch in name) or name[0].isdigit():
                raise CannotForce(f"tools: function name {name!r} is not a Python identifier, "
                                  "which the pythonic format cannot write")
            props = params.get("properties") or {}
            required = set(params.get("required") or ())
            defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
            items: list[tuple[str, bool]] = []
            for j, (key, sub) in enumerate(props.items()):
                if not key.isidentifier():
                    raise CannotForce(f"tools: parameter {key!r} of {name!r} is not a Python identifier")
                sub = dict(sub) if isinstance(sub, Mapping) else {}
                sub.update(defs)
                rules.append(f"v_{i}_{j}: {compiler.json_rule(sub)}")
                items.append((f'"{key}=" v_{i}_{j}', key in required))
            rules += _ordered_kwargs(f"a_{i}", items)
            alts.append(f'{compiler.literal(name + "(")} a_{i}_0 ")"')
        more = ' (", " call)*' if parallel else ""
        lark = "\n".join([f'start: "[" call{more} "]"', "call: " + "\n    | ".join(alts)] + rules) + "\n"
        return compiler.tool_grammar(lark, functions)


def _ordered_kwargs(prefix: str, items: list[tuple[str, bool]]) -> list[str]:
    """Lark rules for comma-separated ``items`` in order, optional ones skippable.

    ``{prefix}_0`` matches the whole list.  ``first_k`` matches items k.. with
    no leading comma, ``rest_k`` the same with a leading ``", "`` per item.
    """
    n = len(items)
    rules = [f"{prefix}_f{n}: \"\"", f"{prefix}_r{n}: \"\""]
    for k in range(n - 1, -1, -1):
        expr, req = items[k]
        first = f"{expr} {prefix}_r{k + 1}"
        rest = f'", " {expr} {prefix}_r{k + 1}'
        rules.append(f"{prefix}_f{k}: {first}" + ("" if req else f" | {prefix}_f{k + 1}"))
        rules.append(f"{prefix}_r{k}: {rest}" + ("" if req else f" | {prefix}_r{k + 1}"))
    rules.append(f"{prefix}_0: {prefix}_f0")
    return rules


# =========================================================== markdown / plan
class MarkdownFormat(ToolFormat):
    """Code in a fenced ```` ```python ```` block is run by the code tool (Conveyor's CodeGen).

    The parser closes a call at a line that is just ```` ``` ````, so the
    pause marker is ``\\n```\\n`` (an opening fence is followed by a language).
    Forcing a call is supported for the code tool only: a grammar for one
    fenced block whose body never contains a fence.
    """

    name = "markdown"
    call_end = ("\n```\n",)
    call_start = ("```python\n",)
    tool_name = "python"

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        return ("You can run Python code: write it in one ```python code block. It is executed and you "
                "will see its output.\n\nAvailable tools (for reference):\n" + _functions_json(functions))

    def render_call(self, name: str, arguments: Any) -> str:
        code = str((arguments or {}).get("code", ""))
        return f"```python\n{code}{'' if code.endswith(chr(10)) or not code else chr(10)}```\n"

    def render_result(self, content: str) -> str:
        return f"Output:\n```\n{content}\n```"

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        functions = compiler.functions(tools, force)
        if force is not None and force != self.tool_name or self.tool_name not in functions:
            raise CannotForce(f"tool_choice can only force the {self.tool_name!r} code tool with the "
                              "markdown format (its calls are code blocks, not named calls)")
        # code lines holding no ``` at all (so none can close the block), then the closing fence
        lark = ('start: "```python\\n" LINE* "```" "\\n"?\n'
                'LINE: /([^`\\n]|`[^`\\n]|``[^`\\n])*(`|``)?\\n/\n')
        return compiler.tool_grammar(lark, functions)


class PlanFormat(ToolFormat):
    """LLMCompiler-style plans: one call per line, ``$N`` names results, ``join()`` ends the plan.

    This class is the one place that knows the plan's syntax: the ``$N``
    reference (:data:`REFERENCE`, which the parser reads with), the ``join``
    that ends a plan, and how a step reads.  A step's arguments, as
    :class:`~interlace.parsers.plan.PlanParser` emits them, are
    ``{"step": N, "args": [...], "kwargs": {...}, "depends_on": [...]}``.  To
    give a tool its arguments (:meth:`tool_arguments`), the positional ones
    are named after the order of the tool's ``parameters`` schema, and every
    ``$N`` is replaced by step N's result.  A result reads back as
    ``$N = <result>``.

    Forcing is not supported: a plan's arguments are positional and may refer
    to earlier results (``$1``), which the tools' JSON schemas cannot describe,
    so no grammar derived from ``tools`` would be faithful.
    """

    name = "plan"
    call_end = ("join()",)
    call_start = ()  # none: a plan cannot be forced (see grammar), so neither can it be constrained lazily
    #: a reference to an earlier step's result, ``$N`` or ``${N}``, anywhere in the arguments (strings too)
    REFERENCE = re.compile(r"\$\{?(\d+)\}?")

    def instructions(self, functions: list[dict[str, Any]]) -> str:
        return ("Answer by writing a plan, one tool call per line, each naming its result:\n"
                '$1 = tool("argument")\n$2 = other_tool("uses $1")\n'
                "then a final line `join()`. The calls run; you then see every result and answer.\n\n"
                "Tools:\n" + _functions_json(functions))

    def render_call(self, name: str, arguments: Any) -> str:
        arguments = arguments or {}
        args = [python_literal(a) for a in arguments.get("args", [])]
        args += [f"{k}={python_literal(v)}" for k, v in (arguments.get("kwargs") or {}).items()]
        return f"${arguments.get('step', 1)} = {name}({', '.join(args)})"

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """The plan's steps, then the ``join()`` line that ends a plan."""
        return "".join(self.render_call(n, a) + "\n" for n, a in calls) + "join()"

    def render_result(self, content: str) -> str:
        return content

    def grammar(self, compiler, tools, force, parallel):  # type: ignore[no-untyped-def]
        raise CannotForce("tool_choice cannot be enforced for the 'plan' tool-call format: plan steps take "
                          "positional arguments that may refer to earlier results ($1), which the tools' "
                          "JSON schemas do not describe; use tool_choice \"auto\"")

    def ends_calls(self, name: str) -> bool:
        return name == "join"

    def step(self, arguments: Any) -> int | None:
        return arguments.get("step") if isinstance(arguments, Mapping) and "step" in arguments else None

    def depends_on(self, arguments: Any) -> Sequence[int]:
        return list(arguments.get("depends_on") or ()) if isinstance(arguments, Mapping) else ()

    def reference(self, step: int) -> str:
        return f"${step}"

    def tool_arguments(self, arguments: Any, parameters: Mapping[str, Any] | None,
                       results: Mapping[int, str]) -> Any:
        if not isinstance(arguments, Mapping) or "args" not in arguments:
            return arguments
        ref = self.REFERENCE

        def sub(v: Any) -> Any:
            if isinstance(v, str):
                whole = ref.fullmatch(v)
                if whole and int(whole.group(1)) in results:
                    return results[int(whole.group(1))]
                return ref.sub(lambda m: results.get(int(m.group(1)), m.group(0)), v)
            if isinstance(v, list):
                return [sub(x) for x in v]
            if isinstance(v, dict):
                return {k: sub(x) for k, x in v.items()}
            return v

        names = list((parameters or {}).get("properties", {}))
        out = {names[i]: sub(v) for i, v in enumerate(arguments.get("args", [])) if i < len(names)}
        out.update({k: sub(v) for k, v in (arguments.get("kwargs") or {}).items()})
        return out

    def named_result(self, arguments: Any, text: str) -> str:
        return f"{self.reference(arguments.get('step'))} = {text}" if isinstance(arguments, Mapping) else text


HERMES = HermesFormat()
MISTRAL = MistralFormat()
LLAMA3_JSON = Llama3JsonFormat()
PYTHONIC = PythonicFormat()
MARKDOWN = MarkdownFormat()
PLAN = PlanFormat()

__all__ = ["FormatError", "CannotForce", "GrammarBuilder", "ToolFormat", "HermesFormat", "MistralFormat",
           "Llama3JsonFormat", "PythonicFormat", "MarkdownFormat", "PlanFormat", "HERMES", "MISTRAL", "LLAMA3_JSON",
           "PYTHONIC", "MARKDOWN", "PLAN", "check_format", "python_literal"]
