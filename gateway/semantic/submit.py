"""From a submitted body to semantic calls: everything checked before anything is kept.

``POST .../calls`` takes one semantic call or a batch (a whole DAG, whose
inputs may name an earlier call's output as ``{"call": i, "output": name}``).
:class:`CallReader` reads each body into a :class:`~.dag.Call` and the new
:class:`~.dag.Variable` objects of its outputs -- templates and chat messages,
input bindings, output settings, sampling (limits from
:mod:`gateway.sampling`, the chat route's), transforms, tool permissions --
and :func:`link` makes the calls their outputs' producers one by one, so a
cycle through an earlier call of the batch is refused too.  A prompt that
cannot fit its model's context is refused here, counting each input as
many times as its placeholder appears (413, before any text is built).  A refusal names
the field (``calls.2.outputs.out.sampling.temperature``) and leaves the
session as it was; the graph (``graph.py``) only adds what passed.

Kept apart from the executor because it is a different job with its own
reader: a body's shape and the client's mistakes (HTTP-neutral
:class:`InvalidInput`, mapped to 400 by the HTTP layer), against how a
linked call runs.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ...engine_ext.policies.objectives import OBJECTIVES
from ..errors import Conflict, GatewayError, InvalidInput, NotAllowed, NotFound, TooLarge
from ..prompt import prompt_bytes_bound
from ..sampling import sampling_params
from .dag import NAME, PLACEHOLDER, Call, Output, Variable, new_id
from .transforms import Transform, TransformSpecError

OUTPUT_KEYS = {"variable", "name", "sampling", "transform", "criterion"}
LLM_KEYS = {"model", "template", "messages", "inputs", "outputs", "chat"}
ROLES = ("system", "developer", "user", "assistant")
TOOL_KEYS = {"tool", "arguments", "inputs", "outputs"}

#: What refuses a body: the client's mistakes, and the 404 / 403 / 409 answers (an unknown
#: variable, model or tool; a tool the key may not run; a variable already produced or set).
REFUSED = GatewayError


def _at(e: Any, i: int) -> None:
    """Say which call of a batch a refusal is about."""
    e.message, e.param = f"calls.{i}: {e.message}", f"calls.{i}" + (f".{e.param}" if e.param else "")


class CallReader:
    """Reads one request's semantic calls against a session: its variables (``lookup``, which
    refuses an unknown id), what its calls may run on (``services``: models, tools, the default
    ``max_tokens``) and who asks (``caller``, whose key grants tools)."""

    def __init__(self, lookup: Callable[[Any, str], Variable], services: Any, caller: Any) -> None:
        self.lookup, self.services, self.caller = lookup, services, caller
        self._batch: Optional[List[Call]] = None  # the calls of a batch read so far

    def read(self, bodies: Any, batch: bool) -> List[Call]:
        """Every body read, or the first refusal (with the call's position in a batch)."""
        if not isinstance(bodies, list) or not bodies:
            raise InvalidInput("calls must be a non-empty list of semantic calls", param="calls")
        calls: List[Call] = []
        self._batch = calls if batch else None
        for i, body in enumerate(bodies):
            try:
                calls.append(self._call(body))
            except REFUSED as e:
                if batch:
                    _at(e, i)
                raise
        return calls

    def _call(self, body: Any) -> Call:
        if not isinstance(body, dict):
            raise InvalidInput("the body must be a JSON object")
        if "tool" in body:
            return self._tool(body)
        if "template" in body or "messages" in body:
            return self._llm(body)
        raise InvalidInput("a semantic call needs a 'template' or 'messages' (an LLM call) or a 'tool' "
                           "(a tool node)")

    # ----------------------------------------------------------- LLM calls
    def _llm(self, body: Dict[str, Any]) -> Call:
        unknown = sorted(set(body) - LLM_KEYS)
        if unknown:
            raise InvalidInput(f"unknown key(s) {unknown} in an LLM call; expected some of {sorted(LLM_KEYS)}")
        model = body.get("model")
        if model is None:
            raise InvalidInput(f"model is required (one of {', '.join(self.services.models)})", param="model")
        if not isinstance(model, str) or model not in self.services.models:
            raise NotFound(f"the model {model!r} does not exist (available: "
                                f"{', '.join(self.services.models)})", param="model", code="model_not_found")
        chat = body.get("chat", False)
        if not isinstance(chat, bool):
            raise InvalidInput("chat must be a boolean", param="chat")
        messages: Optional[List[Tuple[str, List[Tuple[str, str]]]]] = None
        if "messages" in body:
            if "template" in body or "chat" in body:
                raise InvalidInput("give either messages or template (with chat), not both", param="messages")
            messages, items, nbytes = self._messages(body["messages"])
        else:
            template = body.get("template")
            if not isinstance(template, str) or not template:
                raise InvalidInput("template must be a non-empty string", param="template")
            items, nbytes = _template(template, "template"), len(template.encode())
            if chat:  # the text before the first output is a user turn; the outputs are the reply
                first = next((i for i, (k, _) in enumerate(items) if k == "output"), len(items))
                messages, items = [("user", items[:first])], items[first:]
        names = [n for _, its in (messages or []) for k, n in its if k == "input"] + \
            [n for k, n in items if k == "input"]
        in_names = list(dict.fromkeys(names))
        out_names = [n for k, n in items if k == "output"]
        if not out_names:
            raise InvalidInput("the template has no {{output:name}} placeholder: nothing to generate",
                               param="template")
        inputs = self._inputs(body, in_names)
        self._check_prompt_size(model, [i for _, its in (messages or []) for i in its] + items, inputs)
        return Call(new_id("call"), "llm", inputs, self._outputs(body, out_names, True),
                    model=model, items=items, chat=chat, messages=messages, nbytes=nbytes)

    def _check_prompt_size(self, model: str, items: List[Tuple[str, str]],
                           inputs: Dict[str, Union[Variable, str]]) -> None:
        """Refuse (413) a prompt that cannot fit the model's context, counted before anything is
        rendered: the template's text, and each input's value (those known now) as many times as
        its placeholder appears.  A 1 KB template repeating ``{{input:x}}`` over a 100 KB variable
        would otherwise render 10 MB.  Values that arrive later are counted again when the prompt
        is rendered (:func:`.prompt.prompt_pieces`)."""
        served = self.services.models[model]
        bound = prompt_bytes_bound(served.tokenizer, served.max_model_len)
        text = sum(len(v.encode("utf-8", "surrogatepass")) for k, v in items if k == "text")
        per_input: Dict[str, int] = {}
        for k, name in items:
            bound_to = inputs.get(name) if k == "input" else None
            value = bound_to.value if isinstance(bound_to, Variable) else bound_to
            if isinstance(value, str):
                per_input[name] = per_input.get(name, 0) + len(value.encode("utf-8", "surrogatepass"))
        total = text + sum(per_input.values())
        if total > bound:
            worst = max(per_input, key=per_input.__getitem__, default=None)
            raise TooLarge(f"the prompt would hold {total} bytes of text (each input counted once per "
                           f"placeholder), more than the {served.max_model_len} tokens of {model!r}'s context can "
                           f"hold ({bound} bytes)", param=f"inputs.{worst}" if worst else "template",
                           code="context_length_exceeded")

    def _messages(self, raw: Any) -> Tuple[List[Tuple[str, List[Tuple[str, str]]]], List[Tuple[str, str]], int]:
        """``[{"role", "content"}, ..., {"role": "assistant", "content": "{{output:NAME}}"}]``:
        the prompt as chat messages (input placeholders in any content), and the reply to generate."""
        if not isinstance(raw, list) or len(raw) < 2:
            raise InvalidInput("messages must be a list of {role, content} objects, the last one "
                               "{\"role\": \"assistant\", \"content\": \"{{output:NAME}}\"}", param="messages")
        out: List[Tuple[str, List[Tuple[str, str]]]] = []
        seen: Dict[str, str] = {}
        nbytes = 0
        for i, m in enumerate(raw):
            where = f"messages.{i}"
            if not isinstance(m, dict) or set(m) != {"role", "content"}:
                raise InvalidInput(f"{where} must be an object with exactly 'role' and 'content'", param=where)
            if m["role"] not in ROLES:
                raise InvalidInput(f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role")
            if not isinstance(m["content"], str):
                raise InvalidInput(f"{where}.content must be a string (a template)", param=f"{where}.content")
            nbytes += len(m["content"].encode())
            out.append((m["role"], _template(m["content"], f"{where}.content", seen)))
        role, reply = out.pop()
        if role != "assistant" or len(reply) != 1 or reply[0][0] != "output":
            raise InvalidInput("the last message must be {\"role\": \"assistant\", \"content\": "
                               "\"{{output:NAME}}\"}: the reply to generate", param=f"messages.{len(raw) - 1}")
        for i, (_, items) in enumerate(out):
            if any(k == "output" for k, _ in items):
                raise InvalidInput("an output placeholder may only be the last (assistant) message",
                                   param=f"messages.{i}.content")
        return out, reply, nbytes

    # ---------------------------------------------------------- tool nodes
    def _tool(self, body: Dict[str, Any]) -> Call:
        unknown = sorted(set(body) - TOOL_KEYS)
        if unknown:
            raise InvalidInput(f"unknown key(s) {unknown} in a tool node; expected some of {sorted(TOOL_KEYS)}")
        name = body["tool"]
        runtime = self.services.runtime
        tools = runtime.tools if runtime is not None else {}
        if not isinstance(name, str) or name not in tools or not tools[name].enabled:
            raise NotFound(f"no enabled tool {name!r} (see GET /v1/plugins)", param="tool", code="unknown_tool")
        if not self.services.may_use_tool(self.caller, name):
            raise NotAllowed(f"this session's API key may not run the server-side tool {name!r} (the "
                                "configuration grants tools per key: server.api_keys[].server_tools)",
                             param="tool", code="permission_denied")
        args = body.get("arguments", {})
        if not isinstance(args, dict):
            raise InvalidInput("arguments must be a JSON object", param="arguments")
        names: List[str] = []

        def scan(node: Any) -> None:
            if isinstance(node, str):
                for m in PLACEHOLDER.finditer(node):
                    if m.group(1) != "input":
                        raise InvalidInput("a tool node's arguments may only hold {{input:...}} placeholders",
                                           param="arguments")
                    names.append(m.group(2))
            elif isinstance(node, dict):
                for v in node.values():
                    scan(v)
            elif isinstance(node, list):
                for v in node:
                    scan(v)

        scan(args)
        return Call(new_id("call"), "tool", self._inputs(body, list(dict.fromkeys(names))),
                    self._outputs(body, [], False), tool=name, arguments=args,
                    nbytes=len(json.dumps(args).encode()))

    # -------------------------------------------------- inputs and outputs
    def _inputs(self, body: Dict[str, Any], names: List[str]) -> Dict[str, Union[Variable, str]]:
        raw = body.get("inputs", {})
        if not isinstance(raw, dict):
            raise InvalidInput("inputs must be an object: placeholder name -> variable id or {\"value\": text}",
                               param="inputs")
        missing = [n for n in names if n not in raw]
        if missing:
            raise InvalidInput(f"the template's input placeholder(s) {missing} have no binding in inputs",
                               param="inputs")
        extra = sorted(set(raw) - set(names))
        if extra:
            raise InvalidInput(f"inputs {extra} have no {{{{input:...}}}} placeholder in the template",
                               param="inputs")
        out: Dict[str, Union[Variable, str]] = {}
        for n in names:
            b = raw[n]
            if isinstance(b, str):
                out[n] = self.lookup(b, f"inputs.{n}")
            elif isinstance(b, dict) and set(b) == {"value"} and isinstance(b["value"], str):
                out[n] = b["value"]
            elif isinstance(b, dict) and set(b) == {"call", "output"} and self._batch is not None:
                out[n] = self._earlier_output(b, f"inputs.{n}")
            else:
                raise InvalidInput(f"inputs.{n} must be a variable id or {{\"value\": text}}"
                                   + (" or {\"call\": i, \"output\": name} (an earlier call of the batch)"
                                      if self._batch is not None else ""), param=f"inputs.{n}")
        return out

    def _earlier_output(self, ref: Dict[str, Any], param: str) -> Variable:
        i, name = ref["call"], ref["output"]
        batch = self._batch or []
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(batch):
            raise InvalidInput(f"{param}: call must be the index of an earlier call of the batch "
                               f"(0..{len(batch) - 1})", param=param)
        if name not in batch[i].outputs:
            raise InvalidInput(f"{param}: call {i} has no output {name!r} (it has {sorted(batch[i].outputs)})",
                               param=param)
        return batch[i].outputs[name].var

    def _outputs(self, body: Dict[str, Any], names: List[str], llm: bool) -> Dict[str, Output]:
        raw = body.get("outputs", {} if llm else None)
        if not isinstance(raw, dict):
            raise InvalidInput("outputs must be an object: placeholder name -> output settings", param="outputs")
        if llm:
            missing = [n for n in names if n not in raw]
            extra = sorted(set(raw) - set(names))
            if extra:
                raise InvalidInput(f"outputs {extra} have no {{{{output:...}}}} placeholder in the template",
                                   param="outputs")
        else:
            missing = []
            names = list(raw)
            if len(names) != 1:
                raise InvalidInput("a tool node has exactly one output (its result)", param="outputs")
        out: Dict[str, Output] = {}
        claimed = set()
        for n in names:
            spec = raw.get(n) if n not in missing else {}
            where = f"outputs.{n}"
            if spec is None:
                spec = {}
            if not isinstance(spec, dict):
                raise InvalidInput(f"{where} must be an object", param=where)
            unknown = sorted(set(spec) - OUTPUT_KEYS)
            if unknown:
                raise InvalidInput(f"{where}: unknown key(s) {unknown}; expected some of {sorted(OUTPUT_KEYS)}",
                                   param=where)
            if "variable" in spec:
                var = self.lookup(spec["variable"], f"{where}.variable")
                if var.producer is not None:
                    raise Conflict(f"variable {var.id} is already produced by call {var.producer.id}",
                                   param=f"{where}.variable", code="variable_has_producer")
                if var.done:
                    raise Conflict(f"variable {var.id} already has a value", param=f"{where}.variable",
                                   code="variable_already_set")
                if var.id in claimed:
                    raise InvalidInput(f"variable {var.id} is named by two outputs", param=f"{where}.variable")
                claimed.add(var.id)
            else:
                name = spec.get("name", n)
                if not isinstance(name, str) or not NAME.match(name):
                    raise InvalidInput(f"{where}.name must be 1-64 letters, digits or _.:-", param=f"{where}.name")
                var = Variable(new_id("sv"), name)
            crit = spec.get("criterion")
            if crit is not None and crit not in OBJECTIVES:
                raise InvalidInput(f"{where}.criterion must be one of {list(OBJECTIVES)}", param=f"{where}.criterion")
            try:
                transform = Transform.parse(spec.get("transform"), f"{where}.transform")
            except TransformSpecError as e:
                raise InvalidInput(str(e), param=e.param) from None
            sampling = sampling_params(spec.get("sampling"), f"{where}.sampling",
                                       max_tokens=self.services.default_max_tokens) if llm else None
            if "sampling" in spec and not llm:
                raise InvalidInput(f"{where}.sampling: a tool node does not sample", param=f"{where}.sampling")
            if crit is not None and var.criterion != "latency":
                var.criterion = crit
            out[n] = Output(var, sampling, transform)
        return out


def _template(template: str, param: str, seen: Optional[Dict[str, str]] = None) -> List[Tuple[str, str]]:
    """A template as ("text", s) / ("input", name) / ("output", name) items; ``seen`` carries the
    placeholders across the messages of one chat prompt."""
    items: List[Tuple[str, str]] = []
    last = 0
    seen = {} if seen is None else seen
    for m in PLACEHOLDER.finditer(template):
        if m.start() > last:
            items.append(("text", template[last:m.start()]))
        kind, name = m.group(1), m.group(2)
        if name in seen and (seen[name] != kind or kind == "output"):
            raise InvalidInput(f"placeholder {name!r} appears twice as an output or as both input and output",
                               param=param)
        seen[name] = kind
        items.append((kind, name))
        last = m.end()
    if last < len(template):
        items.append(("text", template[last:]))
    return items


# ------------------------------------------------------------------ linking
def link(calls: List[Call], batch: bool) -> None:
    """Make each call the producer of its outputs, in order, so that a cycle through an earlier
    call of the batch is seen.  All or nothing: a refusal undoes the links made."""
    for i, call in enumerate(calls):
        try:
            taken = next((o.var for o in call.outputs.values() if o.var.producer is not None), None)
            if taken is not None:
                raise Conflict(f"the variable {taken.id} is already produced by another call",
                               param="outputs", code="variable_has_producer")
            _check_cycle(call)
        except REFUSED as e:
            unlink(calls[:i])
            if batch:
                _at(e, i)
            raise
        for o in call.outputs.values():
            o.var.producer = call


def unlink(calls: List[Call]) -> None:
    for call in calls:
        for o in call.outputs.values():
            o.var.producer = None


def _check_cycle(call: Call) -> None:
    """The new call closes a cycle if one of its outputs is upstream of one of its inputs."""
    outs = {o.var.id for o in call.outputs.values()}
    seen = set()
    todo = list(call.input_vars())
    while todo:
        v = todo.pop()
        if v.id in outs:
            raise InvalidInput(f"this call would close a cycle: its output variable {v.id} is upstream of its "
                               "own inputs", param="outputs", code="cycle")
        if v.id in seen:
            continue
        seen.add(v.id)
        if v.producer is not None:
            todo += v.producer.input_vars()
