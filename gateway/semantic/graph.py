"""Semantic Variables and semantic calls: one session's DAG and its executor
(Parrot sections 4 and 5.1).

A :class:`Variable` is a text value that may not exist yet; a :class:`Call`
reads variables (its inputs) and writes variables (its outputs).  A call is
either an LLM call -- a prompt template whose ``{{input:x}}`` placeholders
are filled with variables' values and whose ``{{output:y}}`` placeholders
are generated -- or a tool node running a registered plugin tool.  Linking
calls by variables gives the server the application's data flow, so:

* a call runs the moment its inputs have values (:meth:`SessionGraph._dispatch`),
  with no client round trip between dependent calls;
* the criteria of fetched variables are turned into each call's scheduling
  preference (:mod:`gateway.objectives`) and handed to the engine's ranking;
* calls whose prompts share a prefix fork one engine context
  (:mod:`gateway.prefix_share`);
* a failure travels with the data: a failed call fails its outputs, and
  every call reading them, so ``get`` on any variable downstream returns
  the original error.

Everything here runs on the gateway's event loop.  Submissions are checked
completely (unknown variables, cycles, templates, sampling, transforms,
limits) before anything is kept.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple, Union

from ...engine_ext.errors import EngineError, InvalidSampling
from ...engine_ext.policies.objectives import OBJECTIVES
from ...engine_ext.protocol import RequestHint, SamplingParams
from .objectives import CallNode, deduce
from ..openai.wire import APIError
from .prefix_share import Piece, PrefixStore, Shared, boundary_keys
from .prompt import prompt_pieces
from .transforms import Transform, TransformFailed, TransformSpecError

log = logging.getLogger(__name__)

PLACEHOLDER = re.compile(r"\{\{\s*(input|output)\s*:\s*([A-Za-z_][A-Za-z0-9_]{0,63})\s*\}\}")
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
OUTPUT_KEYS = {"variable", "name", "sampling", "transform", "criterion"}
LLM_KEYS = {"model", "template", "messages", "inputs", "outputs", "chat"}
ROLES = ("system", "developer", "user", "assistant")
TOOL_KEYS = {"tool", "arguments", "inputs", "outputs"}


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


# ================================================================= variables
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


# ===================================================================== calls
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
    missing: int = 0
    task: Optional["asyncio.Task[None]"] = None
    nbytes: int = 0
    wanted: Any = None  # prefix keys it announced demand for and has not acquired yet

    def input_vars(self) -> List[Variable]:
        return [v for v in self.inputs.values() if isinstance(v, Variable)]

    def hint(self) -> RequestHint:
        return RequestHint(app="semantic", objective=self.objective, task_group=self.task_group)

    def describe(self) -> Dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "state": self.state, "error": self.error,
                "model": self.model, "tool": self.tool,
                "inputs": {k: (v.id if isinstance(v, Variable) else {"value": v}) for k, v in self.inputs.items()},
                "outputs": {k: o.var.id for k, o in self.outputs.items()},
                "objective": self.objective, "task_group": self.task_group}


@dataclass
class Limits:
    max_variables: int = 1024
    max_pending_calls: int = 256
    max_bytes: int = 16 * 1024 * 1024

    def as_dict(self) -> Dict[str, int]:
        return {"max_variables": self.max_variables, "max_pending_calls": self.max_pending_calls,
                "max_bytes": self.max_bytes}


@dataclass
class Usage:
    prompt_tokens: int = 0      # prompt tokens of the session's LLM calls
    completion_tokens: int = 0
    filled_tokens: int = 0      # sent to the engine to fill (its block cache may skip some)
    forked_tokens: int = 0      # taken by forking a shared prefix context instead


class Services:
    """What a session's calls run on (the gateway's models, tools, prefix
    stores).  Built once by the gateway; shared by all sessions."""

    def __init__(self, models: Dict[str, Any], runtime: Any, default_max_tokens: int,
                 may_use_tool: Any = lambda caller, tool: False, metrics: Any = None):
        self.models, self.runtime, self.metrics = models, runtime, metrics
        self.default_max_tokens = default_max_tokens
        self.may_use_tool = may_use_tool
        self.prefixes: Dict[str, PrefixStore] = {}

    def prefix_store(self, model: str) -> PrefixStore:
        if model not in self.prefixes:
            m = self.models[model]
            self.prefixes[model] = PrefixStore(m.engine, m.name, min_tokens=getattr(m.engine, "block_size", 16))
        return self.prefixes[model]

    def close(self) -> None:
        for store in self.prefixes.values():
            store.clear()
        self.prefixes.clear()


# ===================================================================== graph
class SessionGraph:
    """The variables and calls of one session."""

    def __init__(self, session_id: str, services: Services, limits: Limits, caller: Any = None):
        self.session_id, self.services, self.limits, self.caller = session_id, services, limits, caller
        self.variables: Dict[str, Variable] = {}
        self.calls: Dict[str, Call] = {}
        self.usage = Usage()
        self.nbytes = 0
        self.closed = False
        self._ready: List[Call] = []
        self._dispatch_scheduled = False
        self._groups = itertools.count()
        self._batch: Optional[List[Call]] = None  # the calls of a batch being parsed

    # ----------------------------------------------------------- variables
    def variable(self, vid: Any, param: str = "variable") -> Variable:
        var = self.variables.get(vid) if isinstance(vid, str) else None
        if var is None:
            raise APIError(404, f"no variable {vid!r} in this session", param=param, code="variable_not_found")
        return var

    def _charge(self, n: int) -> None:
        if self.nbytes + n > self.limits.max_bytes:
            raise APIError(413, f"the session would hold {self.nbytes + n} bytes of text, over its limit of "
                                f"{self.limits.max_bytes}", param=None, code="session_bytes")
        self.nbytes += n

    def _check_count(self, new_vars: int, new_calls: int = 0) -> None:
        if len(self.variables) + new_vars > self.limits.max_variables:
            raise APIError(429, f"the session would hold {len(self.variables) + new_vars} variables, over its limit "
                                f"of {self.limits.max_variables}; delete the session or use another",
                           code="session_limit")
        pending = sum(c.state in ("pending", "running") for c in self.calls.values())
        if new_calls and pending + new_calls > self.limits.max_pending_calls:
            raise APIError(429, f"the session would have {pending + new_calls} calls pending or running, over its "
                                f"limit of {self.limits.max_pending_calls}; get some results first",
                           code="session_limit")

    def create_variable(self, name: Optional[str] = None, value: Optional[str] = None) -> Variable:
        self._check_open()
        if name is not None and (not isinstance(name, str) or not NAME.match(name)):
            raise _bad("name must be 1-64 letters, digits or _.:-", "name")
        if value is not None and not isinstance(value, str):
            raise _bad("value must be a string", "value")
        self._check_count(1)
        if value is not None:
            self._charge(len(value.encode()))
        var = Variable(_new_id("sv"), name, value)
        self.variables[var.id] = var
        return var

    def set_variable(self, vid: str, value: Any) -> Variable:
        self._check_open()
        var = self.variable(vid)
        if not isinstance(value, str):
            raise _bad("value must be a string", "value")
        if var.producer is not None:
            raise APIError(409, f"variable {vid} is produced by call {var.producer.id}; it cannot be set",
                           code="variable_has_producer")
        if var.done:
            raise APIError(409, f"variable {vid} already has a value; variables are set once",
                           code="variable_already_set")
        self._charge(len(value.encode()))
        self._resolve(var, value)
        return var

    def note_criterion(self, var: Variable, criterion: Optional[str]) -> None:
        """``get`` with a criterion: latency outranks throughput once said."""
        if criterion is None or var.criterion == criterion or var.criterion == "latency":
            return
        var.criterion = criterion
        self._deduce()

    # --------------------------------------------------------------- submit
    def submit(self, body: Any) -> Call:
        """Check a semantic call completely, then link it into the DAG (and
        dispatch it if its inputs are ready)."""
        return self.submit_many([body], batch=False)[0]

    def submit_many(self, bodies: Any, batch: bool = True) -> List[Call]:
        """Several calls at once (a whole DAG in one request): an input may
        name the output of an earlier call of the same batch as
        ``{"call": i, "output": name}``.  All or nothing: every call is
        checked (with its position in errors) before any is kept."""
        self._check_open()
        if not isinstance(bodies, list) or not bodies:
            raise _bad("calls must be a non-empty list of semantic calls", "calls")
        calls: List[Call] = []
        self._batch = calls if batch else None
        try:
            for i, body in enumerate(bodies):
                try:
                    if not isinstance(body, dict):
                        raise _bad("the body must be a JSON object")
                    if "tool" in body:
                        calls.append(self._parse_tool(body))
                    elif "template" in body or "messages" in body:
                        calls.append(self._parse_llm(body))
                    else:
                        raise _bad("a semantic call needs a 'template' or 'messages' (an LLM call) or a 'tool' "
                                   "(a tool node)")
                except APIError as e:
                    if batch:
                        e.message, e.param = f"calls.{i}: {e.message}", f"calls.{i}" + (f".{e.param}" if e.param
                                                                                        else "")
                    raise
        finally:
            self._batch = None
        new_vars = {o.var.id: o.var for c in calls for o in c.outputs.values() if o.var.id not in self.variables}
        self._check_count(len(new_vars), len(calls))
        linked: List[Call] = []
        try:  # link one by one, so a cycle through an earlier call of the batch is seen
            for i, call in enumerate(calls):
                try:
                    taken = next((o.var for o in call.outputs.values() if o.var.producer is not None), None)
                    if taken is not None:
                        raise APIError(409, f"the variable {taken.id} is already produced by another call",
                                       param="outputs", code="variable_has_producer")
                    self._check_cycle(call)
                except APIError as e:
                    if batch:
                        e.message, e.param = f"calls.{i}: {e.message}", f"calls.{i}.{e.param}"
                    raise
                for o in call.outputs.values():
                    o.var.producer = call
                linked.append(call)
            self._charge(sum(c.nbytes for c in calls))
        except APIError:
            for call in linked:
                for o in call.outputs.values():
                    o.var.producer = None
            raise
        # commit: nothing below raises
        self.variables.update(new_vars)
        for call in calls:
            for v in call.input_vars():
                v.consumers.append(call)
            self.calls[call.id] = call
        if any(v.criterion for v in self.variables.values()):
            self._deduce()
        for call in calls:
            failed = next((v for v in call.input_vars() if v.error is not None), None)
            call.missing = sum(v.value is None for v in call.input_vars())
            if failed is not None:
                self._fail(call, self._input_failed(call, failed))
            elif call.missing == 0:
                self._make_ready(call)
        return calls

    def _inputs(self, body: Dict[str, Any], names: List[str]) -> Dict[str, Union[Variable, str]]:
        raw = body.get("inputs", {})
        if not isinstance(raw, dict):
            raise _bad("inputs must be an object: placeholder name -> variable id or {\"value\": text}", "inputs")
        missing = [n for n in names if n not in raw]
        if missing:
            raise _bad(f"the template's input placeholder(s) {missing} have no binding in inputs", "inputs")
        extra = sorted(set(raw) - set(names))
        if extra:
            raise _bad(f"inputs {extra} have no {{{{input:...}}}} placeholder in the template", "inputs")
        out: Dict[str, Union[Variable, str]] = {}
        for n in names:
            b = raw[n]
            if isinstance(b, str):
                out[n] = self.variable(b, f"inputs.{n}")
            elif isinstance(b, dict) and set(b) == {"value"} and isinstance(b["value"], str):
                out[n] = b["value"]
            elif isinstance(b, dict) and set(b) == {"call", "output"} and self._batch is not None:
                out[n] = self._earlier_output(b, f"inputs.{n}")
            else:
                raise _bad(f"inputs.{n} must be a variable id or {{\"value\": text}}"
                           + (" or {\"call\": i, \"output\": name} (an earlier call of the batch)"
                              if self._batch is not None else ""), f"inputs.{n}")
        return out

    def _earlier_output(self, ref: Dict[str, Any], param: str) -> Variable:
        i, name = ref["call"], ref["output"]
        batch = self._batch or []
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(batch):
            raise _bad(f"{param}: call must be the index of an earlier call of the batch (0..{len(batch) - 1})",
                       param)
        if name not in batch[i].outputs:
            raise _bad(f"{param}: call {i} has no output {name!r} (it has {sorted(batch[i].outputs)})", param)
        return batch[i].outputs[name].var

    def _outputs(self, body: Dict[str, Any], names: List[str], llm: bool) -> Dict[str, Output]:
        raw = body.get("outputs", {} if llm else None)
        if not isinstance(raw, dict):
            raise _bad("outputs must be an object: placeholder name -> output settings", "outputs")
        if llm:
            missing = [n for n in names if n not in raw]
            extra = sorted(set(raw) - set(names))
            if extra:
                raise _bad(f"outputs {extra} have no {{{{output:...}}}} placeholder in the template", "outputs")
        else:
            missing = []
            names = list(raw)
            if len(names) != 1:
                raise _bad("a tool node has exactly one output (its result)", "outputs")
        out: Dict[str, Output] = {}
        claimed = set()
        for n in names:
            spec = raw.get(n) if n not in missing else {}
            where = f"outputs.{n}"
            if spec is None:
                spec = {}
            if not isinstance(spec, dict):
                raise _bad(f"{where} must be an object", where)
            unknown = sorted(set(spec) - OUTPUT_KEYS)
            if unknown:
                raise _bad(f"{where}: unknown key(s) {unknown}; expected some of {sorted(OUTPUT_KEYS)}", where)
            if "variable" in spec:
                var = self.variable(spec["variable"], f"{where}.variable")
                if var.producer is not None:
                    raise APIError(409, f"variable {var.id} is already produced by call {var.producer.id}",
                                   param=f"{where}.variable", code="variable_has_producer")
                if var.done:
                    raise APIError(409, f"variable {var.id} already has a value", param=f"{where}.variable",
                                   code="variable_already_set")
                if var.id in claimed:
                    raise _bad(f"variable {var.id} is named by two outputs", f"{where}.variable")
                claimed.add(var.id)
            else:
                name = spec.get("name", n)
                if not isinstance(name, str) or not NAME.match(name):
                    raise _bad(f"{where}.name must be 1-64 letters, digits or _.:-", f"{where}.name")
                var = Variable(_new_id("sv"), name)
            crit = spec.get("criterion")
            if crit is not None and crit not in OBJECTIVES:
                raise _bad(f"{where}.criterion must be one of {list(OBJECTIVES)}", f"{where}.criterion")
            try:
                transform = Transform.parse(spec.get("transform"), f"{where}.transform")
            except TransformSpecError as e:
                raise _bad(str(e), f"{where}.transform") from None
            sampling = self._sampling(spec.get("sampling"), f"{where}.sampling") if llm else None
            if "sampling" in spec and not llm:
                raise _bad(f"{where}.sampling: a tool node does not sample", f"{where}.sampling")
            if crit is not None and var.criterion != "latency":
                var.criterion = crit
            out[n] = Output(var, sampling, transform)
        return out

    def _sampling(self, spec: Any, where: str) -> SamplingParams:
        spec = {} if spec is None else spec
        if not isinstance(spec, dict):
            raise _bad(f"{where} must be an object", where)
        unknown = sorted(set(spec) - SAMPLING_KEYS)
        if unknown:
            raise _bad(f"{where}: unknown key(s) {unknown}; expected some of {sorted(SAMPLING_KEYS)}", where)
        args = dict(spec)
        args.setdefault("max_tokens", self.services.default_max_tokens)
        for k in ("max_tokens", "top_k", "seed"):
            if k in args and args[k] is not None and (isinstance(args[k], bool) or not isinstance(args[k], int)):
                raise _bad(f"{where}.{k} must be an integer", f"{where}.{k}")
        for k in ("temperature", "top_p"):
            if k in args and (isinstance(args[k], bool) or not isinstance(args[k], (int, float))):
                raise _bad(f"{where}.{k} must be a number", f"{where}.{k}")
        stop = args.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 8:
            raise _bad(f"{where}.stop must be a string or a list of at most 8 strings", f"{where}.stop")
        args["stop"] = tuple(stop)
        try:
            return SamplingParams(**args)
        except InvalidSampling as e:
            raise _bad(f"{where}: {e}", where) from None

    def _parse_llm(self, body: Dict[str, Any]) -> Call:
        unknown = sorted(set(body) - LLM_KEYS)
        if unknown:
            raise _bad(f"unknown key(s) {unknown} in an LLM call; expected some of {sorted(LLM_KEYS)}")
        model = body.get("model")
        if model is None:
            raise _bad(f"model is required (one of {', '.join(self.services.models)})", "model")
        if not isinstance(model, str) or model not in self.services.models:
            raise APIError(404, f"the model {model!r} does not exist (available: "
                                f"{', '.join(self.services.models)})", param="model", code="model_not_found")
        chat = body.get("chat", False)
        if not isinstance(chat, bool):
            raise _bad("chat must be a boolean", "chat")
        messages: Optional[List[Tuple[str, List[Tuple[str, str]]]]] = None
        if "messages" in body:
            if "template" in body or "chat" in body:
                raise _bad("give either messages or template (with chat), not both", "messages")
            messages, items, nbytes = self._parse_messages(body["messages"])
        else:
            template = body.get("template")
            if not isinstance(template, str) or not template:
                raise _bad("template must be a non-empty string", "template")
            items, nbytes = self._parse_template(template, "template"), len(template.encode())
            if chat:  # the text before the first output is a user turn; the outputs are the reply
                first = next((i for i, (k, _) in enumerate(items) if k == "output"), len(items))
                messages, items = [("user", items[:first])], items[first:]
        names = [n for _, its in (messages or []) for k, n in its if k == "input"] + \
            [n for k, n in items if k == "input"]
        in_names = list(dict.fromkeys(names))
        out_names = [n for k, n in items if k == "output"]
        if not out_names:
            raise _bad("the template has no {{output:name}} placeholder: nothing to generate", "template")
        return Call(_new_id("call"), "llm", self._inputs(body, in_names), self._outputs(body, out_names, True),
                    model=model, items=items, chat=chat, messages=messages, nbytes=nbytes)

    @staticmethod
    def _parse_template(template: str, param: str, seen: Optional[Dict[str, str]] = None) -> List[Tuple[str, str]]:
        items: List[Tuple[str, str]] = []
        last = 0
        seen = {} if seen is None else seen
        for m in PLACEHOLDER.finditer(template):
            if m.start() > last:
                items.append(("text", template[last:m.start()]))
            kind, name = m.group(1), m.group(2)
            if name in seen and (seen[name] != kind or kind == "output"):
                raise _bad(f"placeholder {name!r} appears twice as an output or as both input and output", param)
            seen[name] = kind
            items.append((kind, name))
            last = m.end()
        if last < len(template):
            items.append(("text", template[last:]))
        return items

    def _parse_messages(self, raw: Any) -> Tuple[List[Tuple[str, List[Tuple[str, str]]]], List[Tuple[str, str]], int]:
        """``[{"role", "content"}, ..., {"role": "assistant", "content": "{{output:NAME}}"}]``:
        the prompt as chat messages (input placeholders in any content), and the reply to generate."""
        if not isinstance(raw, list) or len(raw) < 2:
            raise _bad("messages must be a list of {role, content} objects, the last one "
                       "{\"role\": \"assistant\", \"content\": \"{{output:NAME}}\"}", "messages")
        out: List[Tuple[str, List[Tuple[str, str]]]] = []
        seen: Dict[str, str] = {}
        nbytes = 0
        for i, m in enumerate(raw):
            where = f"messages.{i}"
            if not isinstance(m, dict) or set(m) != {"role", "content"}:
                raise _bad(f"{where} must be an object with exactly 'role' and 'content'", where)
            if m["role"] not in ROLES:
                raise _bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
            if not isinstance(m["content"], str):
                raise _bad(f"{where}.content must be a string (a template)", f"{where}.content")
            nbytes += len(m["content"].encode())
            out.append((m["role"], self._parse_template(m["content"], f"{where}.content", seen)))
        role, reply = out.pop()
        if role != "assistant" or len(reply) != 1 or reply[0][0] != "output":
            raise _bad("the last message must be {\"role\": \"assistant\", \"content\": \"{{output:NAME}}\"}: "
                       "the reply to generate", f"messages.{len(raw) - 1}")
        for i, (_, items) in enumerate(out):
            if any(k == "output" for k, _ in items):
                raise _bad("an output placeholder may only be the last (assistant) message", f"messages.{i}.content")
        return out, reply, nbytes

    def _parse_tool(self, body: Dict[str, Any]) -> Call:
        unknown = sorted(set(body) - TOOL_KEYS)
        if unknown:
            raise _bad(f"unknown key(s) {unknown} in a tool node; expected some of {sorted(TOOL_KEYS)}")
        name = body["tool"]
        runtime = self.services.runtime
        tools = runtime.tools if runtime is not None else {}
        if not isinstance(name, str) or name not in tools or not tools[name].enabled:
            raise APIError(404, f"no enabled tool {name!r} (see GET /v1/plugins)", param="tool", code="unknown_tool")
        if not self.services.may_use_tool(self.caller, name):
            raise APIError(403, f"this session's API key may not run the server-side tool {name!r} (the "
                                "configuration grants tools per key: server.api_keys[].server_tools)",
                           "permission_error", param="tool", code="permission_denied")
        args = body.get("arguments", {})
        if not isinstance(args, dict):
            raise _bad("arguments must be a JSON object", "arguments")
        names: List[str] = []

        def scan(node: Any) -> None:
            if isinstance(node, str):
                for m in PLACEHOLDER.finditer(node):
                    if m.group(1) != "input":
                        raise _bad("a tool node's arguments may only hold {{input:...}} placeholders", "arguments")
                    names.append(m.group(2))
            elif isinstance(node, dict):
                for v in node.values():
                    scan(v)
            elif isinstance(node, list):
                for v in node:
                    scan(v)

        scan(args)
        return Call(_new_id("call"), "tool", self._inputs(body, list(dict.fromkeys(names))),
                    self._outputs(body, [], False), tool=name, arguments=args,
                    nbytes=len(json.dumps(args).encode()))

    def _check_cycle(self, call: Call) -> None:
        """The new call closes a cycle if one of its outputs is upstream of one of its inputs."""
        outs = {o.var.id for o in call.outputs.values()}
        seen = set()
        todo = list(call.input_vars())
        while todo:
            v = todo.pop()
            if v.id in outs:
                raise _bad(f"this call would close a cycle: its output variable {v.id} is upstream of its own "
                           "inputs", "outputs", code="cycle")
            if v.id in seen:
                continue
            seen.add(v.id)
            if v.producer is not None:
                todo += v.producer.input_vars()

    # ------------------------------------------------------------ execution
    def _make_ready(self, call: Call) -> None:
        self._ready.append(call)
        if not self._dispatch_scheduled:
            self._dispatch_scheduled = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        """Start every call made ready since the last dispatch, together: calls
        released by one event (a map stage) see each other's prefix demand."""
        self._dispatch_scheduled = False
        batch, self._ready = self._ready, []
        plans = []
        for call in batch:
            if self.closed or call.state != "pending":
                continue
            try:
                plans.append((call, self._plan(call)))
            except Exception as e:  # noqa: BLE001  (becomes the call's error, which get() reports)
                self._fail(call, {"message": f"could not prepare the prompt: {e}", "call": call.id,
                                  "code": "prepare_failed"})
        for call, plan in plans:
            call.state = "running"
            call.task = asyncio.ensure_future(self._run(call, plan))

    def _plan(self, call: Call) -> Any:
        if call.kind == "tool":
            return None
        model = self.services.models[call.model]
        first = next(i for i, (k, _) in enumerate(call.items) if k == "output")
        segments = [self._segment(call, kind, val) for kind, val in call.items[:first]]
        if call.messages is None:
            pieces = prompt_pieces(model.tokenizer, model.tool_format, segments)
        else:
            pieces = prompt_pieces(model.tokenizer, model.tool_format, messages=[
                (role, [self._segment(call, k, v) for k, v in items]) for role, items in call.messages])
        keys = boundary_keys(call.model, pieces)
        self.services.prefix_store(call.model).want(keys)
        call.wanted = keys
        return pieces, keys

    def _segment(self, call: Call, kind: str, val: str) -> Tuple[str, bool]:
        return (val, False) if kind == "text" else (self._value(call, val), True)

    async def _run(self, call: Call, plan: Any) -> None:
        try:
            if call.kind == "tool":
                await self._run_tool(call)
            else:
                await self._run_llm(call, *plan)
            call.state = "done"
            self._count(call, "ok")
        except asyncio.CancelledError:
            self._fail(call, {"message": "the session was closed while the call ran", "call": call.id,
                              "code": "session_closed"})
            raise
        except APIError as e:
            self._fail(call, {"message": e.message, "call": call.id, "code": e.code})
        except EngineError as e:
            self._fail(call, {"message": f"engine error: {e}", "call": call.id, "code": type(e).__name__})
        except TransformFailed as e:
            self._fail(call, {"message": f"transform failed: {e}", "call": call.id, "code": "transform_failed"})
        except Exception as e:  # noqa: BLE001  (logged; the client gets the call's error)
            log.exception("semantic call %s failed", call.id)
            self._fail(call, {"message": f"internal error ({type(e).__name__}): {e}", "call": call.id,
                              "code": "internal_error"})

    def _count(self, call: Call, outcome: str) -> None:
        if self.services.metrics is not None:
            self.services.metrics.semantic_calls.labels(call.kind, outcome).inc()

    def _value(self, call: Call, name: str) -> str:
        bound = call.inputs[name]
        return bound.value if isinstance(bound, Variable) else bound

    async def _run_llm(self, call: Call, pieces: List[Piece], keys: List[Any]) -> None:
        model = self.services.models[call.model]
        engine, tok = model.engine, model.tokenizer
        store = self.services.prefix_store(call.model)
        ctx = ("sv", self.session_id, call.id)
        shared: Optional[Shared] = None
        made = False
        try:
            call.wanted = None  # acquire drops the demand, whatever happens
            shared = await store.acquire(pieces, keys, call.hint())
            start = shared.next_piece if shared is not None else 0
            rest = [t for p in pieces[start:] for t in p.tokens]
            self.usage.prompt_tokens += sum(len(p.tokens) for p in pieces)
            await engine.fill(ctx, rest, parent_context_id=shared.entry.context_id if shared else None,
                              hint=call.hint())
            made = True
            filled = len(rest) + (shared.filled if shared else 0)
            forked = (shared.entry.tokens - shared.filled) if shared else 0
            self.usage.filled_tokens += filled
            self.usage.forked_tokens += forked
            if self.services.metrics is not None:
                self.services.metrics.semantic_tokens.labels(call.model, "filled").inc(filled)
                self.services.metrics.semantic_tokens.labels(call.model, "forked").inc(forked)
            first = next(i for i, (k, _) in enumerate(call.items) if k == "output")
            i = first
            while i < len(call.items):
                kind, name = call.items[i]
                if kind == "output":
                    await self._generate(call, engine, ctx, call.outputs[name])
                    i += 1
                    continue
                j = i
                while j < len(call.items) and call.items[j][0] != "output":
                    j += 1
                tail = tok.encode("".join(self._segment(call, k, v)[0] for k, v in call.items[i:j]),
                                  parse_special=False)
                if tail and j < len(call.items):  # text after the last output is not needed
                    self.usage.prompt_tokens += len(tail)
                    self.usage.filled_tokens += len(tail)
                    await engine.fill(ctx, tail, hint=call.hint())
                i = j
        finally:
            if made:
                engine.free_context_nowait(ctx)
            if shared is not None:
                store.release(shared)

    async def _generate(self, call: Call, engine: Any, ctx: Any, out: Output) -> None:
        text: List[str] = []
        async for ev in engine.generate(ctx, out.sampling, hint=call.hint()):
            if ev.token_id is not None:
                self.usage.completion_tokens += 1
            if ev.text:
                text.append(ev.text)
                out.var.push(ev.text)
        raw = "".join(text)
        value = out.transform.apply(raw) if out.transform is not None else raw
        self._charge(len(value.encode()))
        self._resolve(out.var, value)

    async def _run_tool(self, call: Call) -> None:
        def render(node: Any) -> Any:
            if isinstance(node, str):
                whole = PLACEHOLDER.fullmatch(node)
                if whole is not None:
                    return self._value(call, whole.group(2))
                return PLACEHOLDER.sub(lambda m: self._value(call, m.group(2)), node)
            if isinstance(node, dict):
                return {k: render(v) for k, v in node.items()}
            if isinstance(node, list):
                return [render(v) for v in node]
            return node

        result = await self.services.runtime.run(call.tool, render(call.arguments), call_id=call.id)
        if not result.ok:
            raise APIError(424, f"tool {call.tool!r} failed: {result.error_type}: {result.error}",
                           code="tool_failed")
        (out,) = call.outputs.values()
        raw = result.to_text()
        out.var.push(raw)
        value = out.transform.apply(raw) if out.transform is not None else raw
        self._charge(len(value.encode()))
        self._resolve(out.var, value)

    # ---------------------------------------------------------- data flow
    def _resolve(self, var: Variable, value: str) -> None:
        var.value = value
        var._notify()
        for c in var.consumers:
            if c.state == "pending":
                c.missing -= 1
                if c.missing == 0:
                    self._make_ready(c)

    def _input_failed(self, call: Call, var: Variable) -> Dict[str, Any]:
        name = next(k for k, v in call.inputs.items() if v is var)
        err = var.error or {}
        return {"message": f"input {name!r} ({var.id}) failed: {err.get('message')}",
                "call": err.get("call"), "code": err.get("code")}

    def _fail(self, call: Call, error: Dict[str, Any]) -> None:
        """Fail ``call`` and, through its outputs, everything downstream."""
        todo = [(call, error)]
        while todo:
            c, err = todo.pop()
            if c.state in ("done", "failed"):
                continue
            c.state, c.error = "failed", err
            self._count(c, "error")
            for o in c.outputs.values():
                if o.var.done:
                    continue
                o.var.error = err
                o.var._notify()
                for d in o.var.consumers:
                    if d.state == "pending":
                        todo.append((d, self._input_failed(d, o.var)))

    def _deduce(self) -> None:
        nodes = [CallNode(c.id, [v.id for v in c.input_vars()], [o.var.id for o in c.outputs.values()])
                 for c in self.calls.values()]
        criteria = {v.id: v.criterion for v in self.variables.values() if v.criterion}
        prefs = deduce(nodes, criteria, group_prefix=f"{self.session_id}:tg")
        for cid, p in prefs.items():
            c = self.calls[cid]
            if (c.objective, c.task_group) == (p.objective, p.task_group):
                continue
            c.objective, c.task_group = p.objective, p.task_group
            if c.state == "running" and c.kind == "llm":  # already in the engine: re-rank it there
                setter = getattr(self.services.models[c.model].engine, "set_request_hint", None)
                if setter is not None:
                    setter(("sv", self.session_id, c.id), c.hint())

    # -------------------------------------------------------------- closing
    def _check_open(self) -> None:
        if self.closed:
            raise APIError(404, "the session is closed", code="session_not_found")

    async def close(self) -> None:
        """Abort running calls (their contexts, and prefix contexts nobody
        else forks, are freed as they unwind) and fail everything pending."""
        self.closed = True
        tasks = [c.task for c in self.calls.values() if c.task is not None and not c.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for c in self.calls.values():
            if c.wanted is not None:  # cancelled before it ran at all
                self.services.prefix_store(c.model).unwant(c.wanted)
                c.wanted = None
            if c.state in ("pending", "running"):
                self._fail(c, {"message": "the session was closed", "call": c.id, "code": "session_closed"})
        for v in self.variables.values():
            if not v.done:
                v.error = {"message": "the session was closed", "call": None, "code": "session_closed"}
                v._notify()

    def describe(self) -> Dict[str, Any]:
        states = {"pending": 0, "running": 0, "done": 0, "failed": 0}
        for c in self.calls.values():
            states[c.state] += 1
        u = self.usage
        return {"variables": len(self.variables), "calls": states,
                "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                          "filled_tokens": u.filled_tokens, "forked_tokens": u.forked_tokens, "bytes": self.nbytes}}
