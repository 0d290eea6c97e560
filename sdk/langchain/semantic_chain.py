"""LCEL chains as Semantic Variables: ``to_semantic(chain).invoke(inputs)``.

A LangChain chain run step by step sends one request per model call and
waits for each answer before it can build the next prompt.  Converted, the
whole chain is submitted at once as a DAG of semantic calls (Parrot): the
server runs each call the moment its inputs exist, shares prompt prefixes,
and the client fetches only the final values.

How it works: the chain is *interpreted on symbolic values*.  Inputs are
known on the client; what a model call produces is a placeholder (a
:class:`_Text`) for a variable the server will fill.  Each runnable is
evaluated on those values:

* prompt templates (``PromptTemplate``, ``ChatPromptTemplate``; f-string,
  mustache, jinja2) are rendered by LangChain itself, with a marker string
  in place of each server value, then the markers become ``{{input:x}}``
  placeholders -- so the server's prompt is exactly LangChain's text;
* a ``ChatInterlace`` model (optionally ``.bind(...)``-ed sampling) after a
  prompt becomes a semantic call whose chat ``messages`` and sampling are
  what ``ChatInterlace._chat_body`` would send to ``/v1/chat/completions``
  (the server tokenizes them identically), so greedy results are equal;
* ``StrOutputParser`` is the text itself; other output parsers
  (``JsonOutputParser``, ``PydanticOutputParser``, ...) and
  ``RunnableLambda`` functions that read a server value's text run on the
  client at the end, on the fetched values; a lambda that only reshapes
  (``itemgetter``, building a dict) is applied to the placeholders at once;
* ``RunnableParallel`` (and dict literals), ``RunnablePassthrough``,
  ``.assign``, ``.pick``, ``.map()`` over a client list, ``with_config``
  bindings: structure, evaluated as LangChain would.

What cannot run without a client round trip -- a prompt filled with the
result of client-side code on a server value, a value the template would
transform (HTML escaping, a filter, a format spec) -- and every runnable it
does not know raise :class:`ConversionError` naming the runnable, before
anything is submitted.  Nothing falls back silently to step-by-step.

``invoke`` returns what ``chain.invoke`` returns; a chain ending at the
model returns an ``AIMessage`` with the generated content (no usage or
response metadata: the server's semantic calls do not report them).
"""

from __future__ import annotations

import asyncio
import json
import re
import string
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.output_parsers import BaseOutputParser, StrOutputParser
from langchain_core.prompt_values import PromptValue
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate, StringPromptTemplate
from langchain_core.runnables import (Runnable, RunnableBinding, RunnableConfig, RunnableLambda,
                                      RunnableParallel, RunnablePassthrough, RunnableSequence)
from langchain_core.runnables.base import RunnableEach
from langchain_core.runnables.passthrough import RunnableAssign, RunnablePick

from ..client import DEFAULT_TIMEOUT, AsyncClient, Client
from ..spec import Output
from .chat_model import ChatInterlace

__all__ = ["ConversionError", "SemanticChain", "to_semantic"]


class ConversionError(TypeError):
    """The chain (or this input to it) cannot run as one Semantic Variable DAG.
    ``runnable`` is the name of the runnable at fault."""

    def __init__(self, runnable: Any, why: str):
        self.runnable = _name(runnable)
        super().__init__(f"to_semantic: {self.runnable}: {why}")


def _name(r: Any) -> str:
    if isinstance(r, str):
        return r
    cls = type(r).__name__
    try:
        name = r.get_name() if isinstance(r, Runnable) else cls
    except Exception:  # noqa: BLE001  (a name for a message only)
        name = cls
    return cls if name == cls else f"{cls}({name!r})"


# ---------------------------------------------------------------- symbolic values
class _NeedsText(Exception):
    """Raised when code reads the text of a value the server has not produced yet."""


#: A server value inside client strings.  The characters between the private-use
#: delimiters are ones an escaping or case-changing template would alter.
MARK_RE = re.compile("\ue000<&\"'>sv([0-9]+)Zz\ue001")
#: The twin family (see :meth:`_Interpreter._lambda`): other length, case, whitespace at the ends.
TWIN_RE = re.compile(" \ue002\n\tSV-([0-9]+)-zz-\u00c4\u00f6 \ue003 ")


def _marker(i: int, twin: bool = False) -> str:
    return f" \ue002\n\tSV-{i}-zz-\u00c4\u00f6 \ue003 " if twin else f"\ue000<&\"'>sv{i}Zz\ue001"


def _reads(self: Any, *_: Any, **__: Any) -> Any:
    raise _NeedsText(self)


class _Text(str):
    """The text of a planned call's output: a ``str`` whose characters are a
    marker, so client code may join, concatenate and format it (the result
    holds the marker, which becomes an ``{{input:..}}`` placeholder), while
    every method that would read the text raises :class:`_NeedsText`."""

    index: int
    marker: str

    def __new__(cls, index: int, twin: bool = False) -> "_Text":
        marker = _marker(index, twin)
        obj = super().__new__(cls, marker)
        obj.index, obj.marker = index, marker
        return obj

    def __str__(self) -> str:
        return self.marker

    def __format__(self, spec: str) -> str:
        if spec:
            raise _NeedsText(self)
        return self.marker

    def __add__(self, other: Any) -> str:
        return self.marker + other

    def __radd__(self, other: Any) -> str:
        return other + self.marker

    def __repr__(self) -> str:
        return f"<server text #{self.index}>"

    __hash__ = str.__hash__


for _m in [m for m in vars(str) if not m.startswith("__")] + [
        "__len__", "__getitem__", "__iter__", "__contains__", "__mul__", "__rmul__", "__mod__", "__rmod__",
        "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"]:
    if _m not in ("__hash__",):
        setattr(_Text, _m, _reads)
_Text.__hash__ = str.__hash__  # type: ignore[assignment]


class _Symbol:
    """A value only the server (or the end of the run) will know; reading it raises."""

    __str__ = __format__ = __len__ = __iter__ = __contains__ = __bool__ = _reads
    __add__ = __radd__ = __mul__ = __mod__ = __lt__ = __gt__ = __le__ = __ge__ = _reads

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise _NeedsText(self)

    def __getitem__(self, key: Any) -> Any:
        raise _NeedsText(self)


class _Reply(_Symbol):
    """The AIMessage a model step returns: its ``content`` is a :class:`_Text`."""

    def __init__(self, text: _Text):
        object.__setattr__(self, "_text", text)

    def __getattr__(self, name: str) -> Any:
        if name in ("content", "text"):
            return object.__getattribute__(self, "_text")
        return _Symbol.__getattr__(self, name)

    def __repr__(self) -> str:
        return f"<server reply #{object.__getattribute__(self, '_text').index}>"


def _reply_text(r: _Reply) -> _Text:
    return object.__getattribute__(r, "_text")


class _Later(_Symbol):
    """Client code to run at the end, on the fetched values (a parser, a lambda
    that reads a server value's text)."""

    def __init__(self, fn: Callable[[Any], Any], arg: Any, what: Any):
        object.__setattr__(self, "_parts", (fn, arg, what))

    def __repr__(self) -> str:
        return f"<later: {_name(object.__getattribute__(self, '_parts')[2])}>"


def _later(v: _Later) -> Tuple[Callable[[Any], Any], Any, Any]:
    return object.__getattribute__(v, "_parts")


@dataclass(eq=False)
class _Prompt:
    """A rendered prompt that still has server values in it (as markers)."""

    value: PromptValue
    template: Any
    values: Dict[str, Any]


@dataclass(eq=False)
class _PlannedCall:
    name: str                             # the output variable's name: the assign/parallel keys leading to it
    model: ChatInterlace
    messages: List[Dict[str, str]]        # contents in the server's template syntax
    inputs: Dict[str, Any]                # placeholder -> _Text or a constant string
    sampling: Dict[str, Any]
    output: _Text


@dataclass
class _Plan:
    calls: List[_PlannedCall] = field(default_factory=list)
    model: Optional[ChatInterlace] = None
    result: Any = None  # the chain's result, with placeholders for what the server produces

    def new_text(self) -> _Text:
        return _Text(len(self.calls))


# ---------------------------------------------------------------- interpretation
def _server_parts(value: Any) -> List[Any]:
    """The server values in ``value``: marker indices in strings, and symbols."""
    out: List[Any] = []

    def walk(v: Any) -> None:
        if isinstance(v, str):
            out.extend(int(i) for i in MARK_RE.findall(v))
        elif isinstance(v, _Symbol):
            out.append(v)
        elif isinstance(v, _Prompt):
            walk(v.values)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(value)
    return out


def _has_symbol(value: Any) -> bool:
    return bool(_server_parts(value))


def _swap(v: Any, twin: bool, memo: Dict[int, Any]) -> Any:
    """``v`` with every server text in the twin family (``twin``), or as plain
    comparable data (not ``twin``: markers stay, symbols become tags)."""
    if isinstance(v, _Text):
        return _Text(v.index, True) if twin else str.__str__(v)
    if isinstance(v, str):
        return MARK_RE.sub(lambda m: _marker(int(m.group(1)), True), v) if twin else v
    if isinstance(v, _Reply):
        i = _reply_text(v).index
        if not twin:
            return ("reply", i)
        return memo.setdefault(i, _Reply(_Text(i, True)))
    if isinstance(v, dict):
        return {k: _swap(x, twin, memo) for k, x in v.items()}
    if isinstance(v, list):
        return [_swap(x, twin, memo) for x in v]
    if isinstance(v, tuple):
        return tuple(_swap(x, twin, memo) for x in v)
    return v


def _untwin(v: Any) -> Any:
    """A twin-family result as plain comparable data in the first family."""
    if isinstance(v, _Text):
        return _marker(v.index)
    if isinstance(v, str):
        return TWIN_RE.sub(lambda m: _marker(int(m.group(1))), v)
    if isinstance(v, _Reply):
        return ("reply", _reply_text(v).index)
    if isinstance(v, dict):
        return {k: _untwin(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_untwin(x) for x in v)
    return v


class _Interpreter:
    def __init__(self, plan: _Plan):
        self.plan = plan
        self.keys: List[str] = []  # the assign / parallel keys of the branch being evaluated

    def _branch(self, key: Any, r: Any, value: Any) -> Any:
        self.keys.append(str(key))
        try:
            return self.run(r, value)
        finally:
            self.keys.pop()

    def _call_name(self) -> str:
        """LangChain's graph names nothing; a call is named by the keys that lead to it
        (``summary_1``, ``notes.s0``), else by its position, unique in the plan."""
        base = re.sub(r"[^A-Za-z0-9_.:-]", "_", ".".join(self.keys))[-48:].lstrip(".") or "call"
        taken = {c.name for c in self.plan.calls}
        name = base if base != "call" and base not in taken else f"{base}_{len(self.plan.calls)}"
        return name

    def run(self, r: Any, value: Any) -> Any:
        if isinstance(r, RunnableSequence):
            for step in r.steps:
                value = self.run(step, value)
            return value
        if isinstance(r, RunnableAssign):
            if not isinstance(value, dict):
                raise ConversionError(r, f"assign() needs a dict input, got {type(value).__name__}")
            return {**value, **{k: self._branch(k, b, value) for k, b in r.mapper.steps__.items()}}
        if isinstance(r, RunnableParallel):
            return {k: self._branch(k, branch, value) for k, branch in r.steps__.items()}
        if isinstance(r, RunnablePick):
            if not isinstance(value, dict):
                raise ConversionError(r, f"pick() needs a dict input, got {type(value).__name__}")
            if isinstance(r.keys, str):
                return value.get(r.keys)
            return {k: value[k] for k in r.keys if k in value}
        if isinstance(r, RunnablePassthrough):
            if r.func is not None or r.afunc is not None:
                raise ConversionError(r, "a passthrough with a side-effect function is not converted")
            return value
        if isinstance(r, RunnableEach):
            if isinstance(value, _Symbol) or not isinstance(value, (list, tuple)):
                raise ConversionError(r, "map() runs over a list known on the client; this input is "
                                         + ("produced on the server" if isinstance(value, _Symbol)
                                            else f"a {type(value).__name__}"))
            return [self._branch(i, r.bound, item) for i, item in enumerate(value)]
        if isinstance(r, RunnableBinding):
            return self._binding(r, value)
        if isinstance(r, BaseChatModel):
            return self._model(r, {}, r, value)
        if isinstance(r, BasePromptTemplate):
            return self._prompt(r, value)
        if isinstance(r, StrOutputParser):
            return self._text_of(r, value)
        if isinstance(r, BaseOutputParser):
            return self._parser(r, value)
        if isinstance(r, RunnableLambda):
            return self._lambda(r, value)
        raise ConversionError(r, UNSUPPORTED.format(type(r).__name__))

    # ------------------------------------------------------------ steps
    def _binding(self, r: RunnableBinding, value: Any) -> Any:
        bound = r.bound
        while isinstance(bound, RunnableBinding) and not bound.kwargs:
            bound = bound.bound
        if isinstance(bound, BaseChatModel):
            kwargs: Dict[str, Any] = {}
            b: Any = r
            while isinstance(b, RunnableBinding):
                kwargs = {**b.kwargs, **kwargs}
                b = b.bound
            return self._model(r, kwargs, bound, value)
        if r.kwargs:
            raise ConversionError(r, f"arguments bound to {_name(bound)} ({sorted(r.kwargs)}) are not converted")
        return self.run(bound, value)

    def _model(self, step: Any, kwargs: Dict[str, Any], model: BaseChatModel, value: Any) -> Any:
        if not isinstance(model, ChatInterlace):
            raise ConversionError(step, f"the model is a {type(model).__name__}; only ChatInterlace models run "
                                        "on an Interlace server")
        if self.plan.model is None:
            self.plan.model = model
        elif (model.server_root, _secret(model)) != (self.plan.model.server_root, _secret(self.plan.model)):
            raise ConversionError(step, "every model of the chain must be served by the same Interlace server "
                                        "(one session runs the whole DAG)")
        if isinstance(value, _Prompt):
            messages = value.value.to_messages()
        elif isinstance(value, PromptValue):
            messages = value.to_messages()
        elif isinstance(value, str):
            messages = [HumanMessage(str.__str__(value))]
        elif isinstance(value, (list, tuple)) and all(isinstance(m, BaseMessage) for m in value):
            messages = list(value)
        elif isinstance(value, _Symbol):
            raise ConversionError(step, f"its input is {_describe(value)}; a model reads a prompt, a string "
                                        "or messages (parse a reply with StrOutputParser before feeding it on)")
        else:
            raise ConversionError(step, f"a model cannot read a {type(value).__name__}")
        bad = sorted(set(kwargs) - SAMPLING_KWARGS)
        if bad:
            raise ConversionError(step, f"bound {bad}: tools and structured output are not converted "
                                        "(a semantic call generates plain text)")
        body = model._chat_body(messages, **kwargs)
        extra = sorted(set(body) - {"model", "messages"} - set(SAMPLING_KEYS))
        if extra:
            raise ConversionError(step, f"the model sends {extra}; a semantic call generates plain text")
        inputs: Dict[str, Any] = {}
        out_messages: List[Dict[str, str]] = []
        for i, m in enumerate(body["messages"]):
            if set(m) - {"role", "content"} or m.get("role") not in ROLES:
                raise ConversionError(step, f"message {i} ({m.get('role')}, {sorted(m)}) is not converted: only "
                                            "system, user and assistant messages with text content")
            if not isinstance(m["content"], str):
                raise ConversionError(step, f"message {i} has non-text content")
            out_messages.append({"role": m["role"], "content": self._to_template(step, m["content"], inputs)})
        out = self.plan.new_text()
        out_messages.append({"role": "assistant", "content": "{{output:out}}"})
        sampling = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
        # the chat endpoint samples at temperature 1 when none is given; a semantic call is greedy by default
        sampling.setdefault("temperature", 1.0)
        self.plan.calls.append(_PlannedCall(self._call_name(), model, out_messages, inputs, sampling, out))
        return _Reply(out)

    def _to_template(self, step: Any, content: str, inputs: Dict[str, Any]) -> str:
        """A message's text in the server's syntax: each marker becomes ``{{input:vN}}``;
        constant text that looks like a placeholder is bound as a constant input."""
        out: List[str] = []
        last = 0
        for m in list(MARK_RE.finditer(content)) + [None]:
            lit = content[last:m.start() if m else len(content)]
            if "\ue000" in lit or "\ue001" in lit:
                raise ConversionError(step, "a value produced on the server was changed on its way into the "
                                            "prompt (cut, escaped or re-cased)")
            if "{{" in lit or "}}" in lit:  # never parsed as a placeholder: sent as a constant value
                name = f"c{len(inputs)}"
                inputs[name] = lit
                out.append("{{input:" + name + "}}")
            else:
                out.append(lit)
            if m is None:
                break
            i = int(m.group(1))
            inputs[f"v{i}"] = self.plan.calls[i].output
            out.append("{{input:v" + str(i) + "}}")
            last = m.end()
        return "".join(out)

    def _prompt(self, prompt: BasePromptTemplate, value: Any) -> Any:
        if not isinstance(value, dict):
            names = prompt.input_variables
            if len(names) != 1:
                raise ConversionError(prompt, f"needs a dict of {names}, got {type(value).__name__}")
            value = {names[0]: value}
        if not _has_symbol(value):
            return prompt.invoke(value)
        used = set(prompt.input_variables) | set(getattr(prompt, "optional_variables", []) or [])
        marked: Dict[str, Any] = {}
        server_vars = set()
        for k, v in value.items():
            if k not in used or not _has_symbol(v):
                marked[k] = v
            elif isinstance(v, str):
                marked[k] = str.__str__(v)
                server_vars.add(k)
            elif isinstance(v, _Symbol):
                raise ConversionError(prompt, f"the variable {k!r} is {_describe(v)}: filling the prompt with "
                                              "it would need a client round trip (parse model replies with "
                                              "StrOutputParser; move client code after the last model call)")
            else:
                raise ConversionError(prompt, f"the variable {k!r} is a {type(v).__name__} holding values "
                                              "produced on the server: only text can be filled in (join it into "
                                              "one string first)")
        for template, fmt in _string_templates(prompt):
            _check_template(prompt, template, fmt, server_vars)
        rendered = prompt.invoke(marked)
        for m in rendered.to_messages():
            text = m.content if isinstance(m.content, str) else json.dumps(m.content)
            if ("\ue000" in text or "\ue001" in text) and MARK_RE.sub("", text).count("\ue000") + \
                    MARK_RE.sub("", text).count("\ue001"):
                raise ConversionError(prompt, "the template changes a value produced on the server (escaping, "
                                              "a filter); such a value must be inserted as is")
        return _Prompt(rendered, prompt, value)

    def _text_of(self, parser: Any, value: Any) -> Any:
        if isinstance(value, _Reply):
            return _reply_text(value)
        if isinstance(value, str):
            return value
        return self._parser(parser, value)

    def _parser(self, parser: BaseOutputParser, value: Any) -> Any:
        if not _has_symbol(value):
            return parser.invoke(value)
        return _Later(parser.invoke, value, parser)

    def _lambda(self, lam: RunnableLambda, value: Any) -> Any:
        """Run the function on the placeholders, twice, with two families of
        markers: if both runs agree once the markers are swapped, it only moved
        or joined the values (a dict, an itemgetter, a join, an f-string) and its
        result stands; if it read a value's text (or ran into a symbol), it is
        run at the end on the fetched values instead."""
        func = getattr(lam, "func", None)
        if func is None:
            raise ConversionError(lam, "an async-only lambda is not converted")
        if not _has_symbol(value):
            return lam.invoke(value)
        try:
            first = func(value)
            twin = func(_swap(value, True, {}))
        except (_NeedsText, TypeError, AttributeError, KeyError, ValueError, IndexError):
            return _Later(lam.invoke, value, lam)
        if isinstance(first, Runnable):
            raise ConversionError(lam, "it returns a runnable (a chain chosen at run time)")
        if _swap(first, False, {}) != _untwin(twin):
            return _Later(lam.invoke, value, lam)
        return first


def _describe(v: Any) -> str:
    if isinstance(v, _Reply):
        return "a model's reply (an AIMessage) produced on the server"
    if isinstance(v, _Later):
        return f"the result of {_name(_later(v)[2])} on a value produced on the server (client code)"
    return "a value produced on the server"


def _timeout(model: ChatInterlace) -> float:
    return model.timeout if model.timeout is not None else DEFAULT_TIMEOUT


def _secret(model: ChatInterlace) -> Optional[str]:
    return model.api_key.get_secret_value() if model.api_key is not None else None


UNSUPPORTED = ("{} is not converted (supported: prompt templates, ChatInterlace, output parsers, "
               "RunnableParallel, RunnablePassthrough, assign, pick, map, RunnableLambda)")
SAMPLING_KEYS = ("temperature", "max_tokens", "top_p", "top_k", "seed", "stop")
SAMPLING_KWARGS = set(SAMPLING_KEYS) | {"model"}
ROLES = ("system", "developer", "user", "assistant")


def _string_templates(prompt: BasePromptTemplate) -> List[Tuple[str, str]]:
    """Every string template of a prompt, with its format."""
    if isinstance(prompt, StringPromptTemplate) and hasattr(prompt, "template"):
        return [(prompt.template, prompt.template_format)]
    if isinstance(prompt, ChatPromptTemplate):
        out: List[Tuple[str, str]] = []
        for m in prompt.messages:
            inner = getattr(m, "prompt", None)
            for p in inner if isinstance(inner, list) else [inner] if inner is not None else []:
                if isinstance(p, StringPromptTemplate) and hasattr(p, "template"):
                    out.append((p.template, p.template_format))
                elif isinstance(p, BasePromptTemplate):
                    raise ConversionError(prompt, f"a {type(p).__name__} inside a chat prompt is not converted")
        return out
    raise ConversionError(prompt, f"{type(prompt).__name__} with values produced on the server is not converted "
                                  "(PromptTemplate and ChatPromptTemplate are)")


def _check_template(prompt: Any, template: str, fmt: str, server_vars: set) -> None:
    """A server value must be inserted verbatim: no format spec, conversion,
    attribute access, escaping, filter or control flow on it."""
    if fmt == "f-string":
        for _, fname, spec, conv in string.Formatter().parse(template):
            if fname is None:
                continue
            root = fname.split(".")[0].split("[")[0]
            if root in server_vars and (fname != root or spec or conv):
                raise ConversionError(prompt, f"{{{fname}{'!' + conv if conv else ''}{':' + spec if spec else ''}}} "
                                              "transforms a value produced on the server; write {" + root + "}")
    elif fmt == "mustache":
        from langchain_core.utils.mustache import tokenize

        for tag, key in tokenize(template):
            root = key.split(".")[0] if isinstance(key, str) else key
            if root in server_vars and (tag != "no escape" or key != root):
                hint = ("{{" + root + "}} HTML-escapes the value; write {{{" + root + "}}}" if tag == "variable"
                        else f"a {tag} on it")
                raise ConversionError(prompt, f"mustache: {hint} (a value produced on the server is inserted as is)")
    elif fmt == "jinja2":
        _check_jinja2(prompt, template, server_vars)
    else:
        raise ConversionError(prompt, f"template format {fmt!r} is not converted")


_SANDBOXED: Optional[bool] = None


def _jinja2_is_sandboxed() -> bool:
    """LangChain renders jinja2 templates in jinja2's SandboxedEnvironment
    (since langchain-core 0.0.329): checked by behaviour, not version."""
    global _SANDBOXED
    if _SANDBOXED is None:
        from langchain_core.prompts.string import jinja2_formatter

        try:
            _SANDBOXED = "str" not in jinja2_formatter("{{ x.__class__.__name__ }}", x="")
        except Exception:  # noqa: BLE001  (a SecurityError is what a sandbox raises)
            _SANDBOXED = True
    return _SANDBOXED


def _check_jinja2(prompt: Any, template: str, server_vars: set) -> None:
    import jinja2
    from jinja2 import nodes

    if not _jinja2_is_sandboxed():
        raise ConversionError(prompt, "jinja2 templates are converted only when LangChain renders them sandboxed")
    tree = jinja2.Environment().parse(template)
    bare = {id(n) for out in tree.find_all(nodes.Output) for n in out.nodes if isinstance(n, nodes.Name)}
    for n in tree.find_all(nodes.Name):
        if n.name in server_vars and id(n) not in bare:
            raise ConversionError(prompt, f"jinja2: {n.name!r} is used in an expression, filter or statement; a "
                                          "value produced on the server can only be inserted as {{ " + n.name + " }}")


# ---------------------------------------------------------------- the converted chain
class SemanticChain(Runnable[Any, Any]):
    """An LCEL chain run as one Semantic Variable DAG (see the module docstring).
    Build it with :func:`to_semantic`; ``invoke`` / ``ainvoke`` (and so
    ``batch`` / ``abatch``) return what the chain returns."""

    def __init__(self, chain: Runnable, *, criterion: str = "latency", session_ttl_s: Optional[float] = None):
        self.chain = chain
        self.criterion = criterion
        self.session_ttl_s = session_ttl_s
        _check_structure(chain)

    def plan(self, input: Any) -> _Plan:
        """The calls ``input`` makes the server run, and the result with placeholders
        (``plan.result``); nothing is sent.  Raises :class:`ConversionError`."""
        if any(ch in text for text in _strings(input) for ch in _DELIMITERS):
            raise ConversionError(self.chain, "the input holds private-use characters (U+E000-U+E003) that "
                                              "to_semantic uses to mark server values")
        plan = _Plan()
        plan.result = _Interpreter(plan).run(self.chain, input)
        if not plan.calls:
            raise ConversionError(self.chain, "the chain calls no model: nothing to run on the server")
        return plan

    def invoke(self, input: Any, config: Optional[RunnableConfig] = None, **kwargs: Any) -> Any:
        plan = self.plan(input)
        model = plan.model
        assert model is not None
        finals = _final_texts(plan.result)
        with Client(model.server_root, api_key=_secret(model), model=model.model_name,
                    timeout=_timeout(model)) as client, \
                client.session(self.session_ttl_s, calls=self._bodies(plan, finals)) as session:
            made = [c.output for c in session.calls]  # the whole DAG went with the session: one round trip
            if len(finals) == 1:
                values = [made[finals[0]].get(criterion=self.criterion)]
            else:
                with ThreadPoolExecutor(max_workers=min(16, len(finals))) as pool:
                    values = list(pool.map(lambda i: made[i].get(criterion=self.criterion), finals))
        return _materialize(plan.result, dict(zip(finals, values)))

    async def ainvoke(self, input: Any, config: Optional[RunnableConfig] = None, **kwargs: Any) -> Any:
        plan = self.plan(input)
        model = plan.model
        assert model is not None
        finals = _final_texts(plan.result)
        async with AsyncClient(model.server_root, api_key=_secret(model), model=model.model_name,
                               timeout=_timeout(model)) as client:
            async with client.session(self.session_ttl_s, calls=self._bodies(plan, finals)) as session:
                made = [c.output for c in session.calls]
                values = await asyncio.gather(*(made[i].aget(criterion=self.criterion) for i in finals))
        return _materialize(plan.result, dict(zip(finals, values)))

    def _bodies(self, plan: _Plan, finals: List[int]) -> List[Dict[str, Any]]:
        """The plan as one batch of call bodies (the whole DAG in one request); a final
        value's producer gets the criterion up front."""
        bodies = []
        for c in plan.calls:
            out = Output(**c.sampling, criterion=self.criterion if c.output.index in finals else None).to_json()
            out["name"] = c.name
            bodies.append({"model": c.model.model_name, "messages": c.messages, "outputs": {"out": out},
                           "inputs": {k: ({"call": v.index, "output": "out"} if isinstance(v, _Text)
                                          else {"value": v}) for k, v in c.inputs.items()}})
        return bodies


_DELIMITERS = ("\ue000", "\ue001", "\ue002", "\ue003")


def _strings(v: Any) -> Iterator[str]:
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from _strings(k)
            yield from _strings(x)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _strings(x)
    elif isinstance(v, BaseMessage) and isinstance(v.content, str):
        yield v.content


def _check_structure(r: Any) -> None:
    """Refuse unknown runnables at conversion time (inputs can only be checked at ``invoke``)."""
    if isinstance(r, RunnableSequence):
        children: Sequence[Any] = r.steps
    elif isinstance(r, RunnableAssign):
        children = [r.mapper]
    elif isinstance(r, RunnableParallel):
        children = list(r.steps__.values())
    elif isinstance(r, (RunnableEach, RunnableBinding)):
        children = [r.bound]
    elif isinstance(r, BaseChatModel) and not isinstance(r, ChatInterlace):
        raise ConversionError(r, f"the model is a {type(r).__name__}; only ChatInterlace models run on an "
                                 "Interlace server")
    elif isinstance(r, RunnablePassthrough) and (r.func is not None or r.afunc is not None):
        raise ConversionError(r, "a passthrough with a side-effect function is not converted")
    elif isinstance(r, RunnableLambda) and getattr(r, "func", None) is None:
        raise ConversionError(r, "an async-only lambda is not converted")
    elif isinstance(r, (BasePromptTemplate, BaseOutputParser, RunnablePick, RunnablePassthrough,
                        RunnableLambda, ChatInterlace)):
        children = []
    else:
        raise ConversionError(r, UNSUPPORTED.format(type(r).__name__))
    for c in children:
        _check_structure(c)


def _final_texts(result: Any) -> List[int]:
    """The calls whose outputs the result needs (the others feed only the server)."""
    out: Dict[int, None] = {}
    for part in _server_parts(result):
        if isinstance(part, int):
            out[part] = None
        elif isinstance(part, _Reply):
            out[_reply_text(part).index] = None
        elif isinstance(part, _Later):
            out.update(dict.fromkeys(_final_texts(_later(part)[1])))
    return list(out)


def _materialize(v: Any, texts: Dict[int, str]) -> Any:
    """The result with the fetched texts in place of their placeholders, and the
    client code deferred to the end run on them."""
    if isinstance(v, str):
        return MARK_RE.sub(lambda m: texts[int(m.group(1))], v)
    if isinstance(v, _Reply):
        return AIMessage(content=texts[_reply_text(v).index])
    if isinstance(v, _Later):
        fn, arg, _ = _later(v)
        return fn(_materialize(arg, texts))
    if isinstance(v, _Prompt):
        return v.template.invoke(_materialize(v.values, texts))
    if isinstance(v, dict):
        return {k: _materialize(x, texts) for k, x in v.items()}
    if isinstance(v, list):
        return [_materialize(x, texts) for x in v]
    if isinstance(v, tuple):
        return tuple(_materialize(x, texts) for x in v)
    return v


def to_semantic(chain: Runnable, *, criterion: str = "latency", session_ttl_s: Optional[float] = None
                ) -> SemanticChain:
    """``chain`` (an LCEL runnable whose models are :class:`ChatInterlace`) as one
    Semantic Variable DAG: ``to_semantic(chain).invoke(inputs)`` submits every
    model call at once and returns what ``chain.invoke(inputs)`` returns.
    ``criterion`` is how the final values are fetched (``latency`` or
    ``throughput``: the server deduces the calls' scheduling from it).
    Raises :class:`ConversionError` for a runnable it cannot convert."""
    return SemanticChain(chain, criterion=criterion, session_ttl_s=session_ttl_s)
