"""What a semantic call is made of, without any I/O: the ``Input`` / ``Output``
markers, an output's settings, and the translation of ``{{name}}`` templates
into the server's ``{{input:name}}`` / ``{{output:name}}`` syntax.

Kept apart from the clients so that a semantic function is checked (unknown
placeholders, a parameter missing from the prompt) when it is *defined*, not
when its first call reaches the server.
"""

from __future__ import annotations

import re
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Union

#: ``{{name}}``, ``{{input:name}}`` or ``{{output:name}}`` (spaces inside the braces allowed).
PLACEHOLDER = re.compile(r"\{\{\s*(?:(input|output)\s*:\s*)?([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")

CRITERIA = ("latency", "throughput")


class Input:
    """Marks a semantic function's parameter as an input: ``task: Input``.

    The argument is a :class:`SemanticVariable` (its value flows in on the
    server, with no client round trip) or a ``str`` constant."""

    def __repr__(self) -> str:
        return "Input"


class Output:
    """Marks a parameter as an output and says how to generate it:
    ``code: Output`` (defaults: greedy, the server's max_tokens) or
    ``code: Output(max_tokens=128, temperature=0, stop=["\\n\\n"], transform={"strip": True})``.

    ``transform`` is applied by the server once the text is complete
    (``strip``, ``json_field``, ``regex``/``group``); ``criterion``
    (``"latency"`` / ``"throughput"``) tells the scheduler up front what the
    value is wanted for, as if it were fetched with that criterion."""

    def __init__(self, *, max_tokens: Optional[int] = None, temperature: Optional[float] = None,
                 top_p: Optional[float] = None, top_k: Optional[int] = None, seed: Optional[int] = None,
                 stop: Union[str, Sequence[str], None] = None, transform: Optional[Mapping[str, Any]] = None,
                 criterion: Optional[str] = None):
        if criterion is not None and criterion not in CRITERIA:
            raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
        self.sampling: Dict[str, Any] = {
            k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                              ("top_k", top_k), ("seed", seed),
                              ("stop", [stop] if isinstance(stop, str) else None if stop is None else list(stop)))
            if v is not None}
        self.transform = dict(transform) if transform is not None else None
        self.criterion = criterion

    def to_json(self, variable: Optional[str] = None) -> Dict[str, Any]:
        """The output's entry in a call's ``outputs``; ``variable`` names a declared variable to fill."""
        out: Dict[str, Any] = {}
        if self.sampling:
            out["sampling"] = dict(self.sampling)
        if self.transform is not None:
            out["transform"] = dict(self.transform)
        if self.criterion is not None:
            out["criterion"] = self.criterion
        if variable is not None:
            out["variable"] = variable
        return out

    def __repr__(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self.sampling.items()]
        parts += [f"{k}={v!r}" for k, v in (("transform", self.transform), ("criterion", self.criterion))
                  if v is not None]
        return f"Output({', '.join(parts)})"


def marker(annotation: Any) -> Union[Input, Output, None]:
    """The ``Input`` / ``Output`` an annotation stands for: the bare class, an instance, or
    ``Annotated[str, Output(...)]`` (for type checkers); None for anything else."""
    if annotation is Input:
        return Input()
    if annotation is Output:
        return Output()
    if isinstance(annotation, (Input, Output)):
        return annotation
    for meta in getattr(annotation, "__metadata__", ()):  # typing.Annotated
        found = marker(meta)
        if found is not None:
            return found
    return None


def to_server_template(template: str, inputs: Collection[str], outputs: Collection[str]) -> str:
    """``template`` with every placeholder in the server's syntax.

    ``{{name}}`` becomes ``{{input:name}}`` or ``{{output:name}}`` by which
    collection holds the name; placeholders already written in the server's
    syntax are kept (and checked against the same collections).  Every name
    must be bound and every binding used -- the same rule the server enforces
    (400), caught here before a request is made."""
    both = set(inputs) & set(outputs)
    if both:
        raise ValueError(f"{sorted(both)} named both as input and output")
    used: List[str] = []

    def convert(m: "re.Match[str]") -> str:
        kind, name = m.group(1), m.group(2)
        actual = "input" if name in inputs else "output" if name in outputs else None
        if actual is None:
            raise ValueError(f"the template's placeholder {m.group(0)} names no input or output "
                             f"(inputs: {sorted(inputs)}, outputs: {sorted(outputs)})")
        if kind is not None and kind != actual:
            raise ValueError(f"the template's placeholder {m.group(0)} names the {actual} {name!r}")
        if actual == "output" and name in used:
            raise ValueError(f"the output {name!r} appears twice in the template")
        used.append(name)
        return "{{" + actual + ":" + name + "}}"

    out = PLACEHOLDER.sub(convert, template)
    missing = [n for n in list(inputs) + list(outputs) if n not in used]
    if missing:
        raise ValueError(f"{missing} not used in the template (write {{{{{missing[0]}}}}} where it goes)")
    return out


def convert_arguments(arguments: Any, inputs: Collection[str]) -> Any:
    """A tool node's arguments with ``{{name}}`` in string leaves written as ``{{input:name}}``."""
    if isinstance(arguments, str):
        def convert(m: "re.Match[str]") -> str:
            if m.group(1) is None and m.group(2) in inputs:
                return "{{input:" + m.group(2) + "}}"
            return m.group(0)
        return PLACEHOLDER.sub(convert, arguments)
    if isinstance(arguments, Mapping):
        return {k: convert_arguments(v, inputs) for k, v in arguments.items()}
    if isinstance(arguments, (list, tuple)):
        return [convert_arguments(v, inputs) for v in arguments]
    return arguments
