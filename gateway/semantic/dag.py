"""The nodes of a session's DAG: Semantic Variables and the semantic calls
linking them (Parrot section 4).

A :class:`Variable` is a text value that may not exist yet; a :class:`Call`
reads variables (its inputs) and writes variables (its outputs).  A call is
either an LLM call -- a prompt template whose ``{{input:x}}`` placeholders
are filled with variables' values and whose ``{{output:y}}`` placeholders
are generated -- or a tool node running a registered plugin tool.

Only the data model lives here, with the template syntax (:data:`PLACEHOLDER`)
and the naming rule both sides of it read: ``submit.py`` builds these objects
from a request body, ``graph.py`` links and runs them.  Neither is imported
here, so the two never import each other.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple, Union

from ...engine_ext.protocol import RequestHint, SamplingParams
from .transforms import Transform

#: ``{{input:NAME}}`` / ``{{output:NAME}}`` in a template or a tool node's arguments.
PLACEHOLDER = re.compile(r"\{\{\s*(input|output)\s*:\s*([A-Za-z_][A-Za-z0-9_]{0,63})\s*\}\}")
#: A variable's name.
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
#: The application semantic calls' output lengths are learned under (per model: ModelServer.predictor).
SEMANTIC_APP = "semantic"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


@dataclass(eq=False)
class Variable:
    id: str
    name: Optional[str] = None
    value: Optional[str] = None
    error: Optional[Dict[str, Any]] = None  # {"message", "call", "code"} of a failed producer
    producer: Optional["Call"] = None
    consumers: List["Call"] = field(default_factory=list)
    criterion: Optional[str] = None
    chunks: List[str] = field(default_factory=list)  # raw text as generated, for streaming gets
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.value is not None or self.error is not None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def push(self, delta: str) -> None:
        if delta:
            self.chunks.append(delta)
            self._notify()

    async def wait(self) -> None:
        while not self.done:
            await self._changed.wait()

    async def deltas(self) -> AsyncIterator[str]:
        """The producer's raw text as it is generated (what was generated
        already first), until the variable is done."""
        i = 0
        while True:
            while i < len(self.chunks):
                i += 1
                yield self.chunks[i - 1]
            if self.done:
                return
            await self._changed.wait()

    def describe(self) -> Dict[str, Any]:
        return {"id": self.id, "name": self.name, "ready": self.value is not None, "failed": self.error is not None,
                "producer": self.producer.id if self.producer else None, "criterion": self.criterion}


@dataclass
class Output:
    var: Variable
    sampling: Optional[SamplingParams]  # None for a tool node
    transform: Optional[Transform]


@dataclass(eq=False)
class Call:
    id: str
    kind: str                                # "llm" or "tool"
    inputs: Dict[str, Union[Variable, str]]  # placeholder -> variable or constant text
    outputs: Dict[str, Output]               # placeholder -> output, in template order
    model: Optional[str] = None
    items: List[Tuple[str, str]] = field(default_factory=list)  # ("text", s) | ("input", n) | ("output", n)
    chat: bool = False
    # a chat prompt: (role, items) per message, rendered like /v1/chat/completions; ``items``
    # then starts at the first output (the assistant's reply)
    messages: Optional[List[Tuple[str, List[Tuple[str, str]]]]] = None
    tool: Optional[str] = None
    arguments: Any = None
    state: str = "pending"  # pending -> running -> done | failed
    error: Optional[Dict[str, Any]] = None
    objective: Optional[str] = None
    task_group: Optional[str] = None
    tenant: Optional[str] = None  # the session creator's key name: the engine is fair across tenants
    missing: int = 0
    task: Optional["asyncio.Task[None]"] = None
    nbytes: int = 0
    wanted: Any = None  # prefix keys it announced demand for and has not acquired yet
    # what the ranking is told of the output being generated and of the calls still to come
    # downstream (graph.py ``_predict``): (expected output tokens, later segments)
    predicted: Tuple[Optional[int], Tuple[Tuple[int, Optional[float], int], ...]] = (None, ())

    def input_vars(self) -> List[Variable]:
        return [v for v in self.inputs.values() if isinstance(v, Variable)]

    def hint(self) -> RequestHint:
        """Every ranking field the engine keeps for the call: a hint update
        (a criterion deduced later) replaces them all, so it carries the
        predictions too."""
        return RequestHint(app=SEMANTIC_APP, expected_output=self.predicted[0], future=self.predicted[1],
                           objective=self.objective, task_group=self.task_group, tenant=self.tenant)

    def describe(self) -> Dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "state": self.state, "error": self.error,
                "model": self.model, "tool": self.tool,
                "inputs": {k: (v.id if isinstance(v, Variable) else {"value": v}) for k, v in self.inputs.items()},
                "outputs": {k: o.var.id for k, o in self.outputs.items()},
                "objective": self.objective, "task_group": self.task_group}
