"""A session's graph of Semantic Variables and semantic calls, and its executor
(Parrot sections 4 and 5.1).

Linking calls by variables (the nodes are in :mod:`.dag`) gives the server
the application's data flow, so:

* a call runs the moment its inputs have values (:meth:`SessionGraph._dispatch`),
  with no client round trip between dependent calls;
* the criteria of fetched variables are turned into each call's scheduling
  preference (:mod:`.objectives`) and handed to the engine's ranking;
* calls whose prompts share a prefix fork one engine context
  (:mod:`.prefix_share`);
* a failure travels with the data: a failed call fails its outputs, and
  every call reading them, so ``get`` on any variable downstream returns
  the original error.

Submitted bodies are read and checked completely by :mod:`.submit`
(unknown variables, cycles, templates, sampling, transforms) and the
session's limits here, before anything is kept.  Everything here runs on
the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from ...engine_ext.errors import EngineError
from ..errors import DependencyFailed, GatewayError, InvalidInput, NotFound, TooLarge, LimitReached, Conflict, engine_error
from ...engine_ext.protocol import MAX_FUTURE_SEGMENTS
from .dag import NAME, PLACEHOLDER, SEMANTIC_APP, Call, Output, Variable, new_id
from ...engine_ext.policies.deduction import CallNode, deduce
from .prefix_share import Piece, PrefixStore, Shared, boundary_keys, hint_keys, with_prefix_keys
from ..prompt import prompt_bytes_bound
from .prompt import prompt_pieces
from .submit import CallReader, link, unlink
from .transforms import TransformFailed

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ...engine_ext.protocol import ContextId, Engine
    from ..metrics import Metrics
    from ..models import ModelServer
    from ..tools.runtime import ToolRuntime

log = logging.getLogger(__name__)


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
    cached_tokens: int = 0      # served from KV that existed (the engine's prefix cache, the fork's parent)


class Services:
    """What a session's calls run on (the gateway's models, tools, prefix
    stores).  Built once by the gateway; shared by all sessions."""

    def __init__(self, models: Dict[str, ModelServer], runtime: Optional[ToolRuntime], default_max_tokens: int,
                 may_use_tool: Any = lambda caller, tool: False, metrics: Optional[Metrics] = None):
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

    def __init__(self, session_id: str, services: Services, limits: Limits, caller: Any = None,
                 key_check: Optional[Callable[[int], None]] = None):
        self.session_id, self.services, self.limits, self.caller = session_id, services, limits, caller
        # the caller's key's name: its calls' tenant, which the engine's queue is fair across
        self.tenant: Optional[str] = caller.name if caller is not None else None
        # raises LimitReached when the key's sessions cannot take that many more pending calls (key_limits.py)
        self.key_check = key_check
        self.variables: Dict[str, Variable] = {}
        self.calls: Dict[str, Call] = {}
        self.usage = Usage()
        self.nbytes = 0
        self.closed = False
        self._ready: List[Call] = []
        self._dispatch_scheduled = False
        self._template_sizes: Dict[str, int] = {}  # call id -> its template's own tokens (_template_tokens)

    # ----------------------------------------------------------- variables
    def variable(self, vid: Any, param: str = "variable") -> Variable:
        var = self.variables.get(vid) if isinstance(vid, str) else None
        if var is None:
            raise NotFound(f"no variable {vid!r} in this session", param=param, code="variable_not_found")
        return var

    def _charge(self, n: int) -> None:
        if self.nbytes + n > self.limits.max_bytes:
            raise TooLarge(f"the session would hold {self.nbytes + n} bytes of text, over its limit of "
                                f"{self.limits.max_bytes}", param=None, code="session_bytes")
        self.nbytes += n

    def _check_count(self, new_vars: int, new_calls: int = 0) -> None:
        if len(self.variables) + new_vars > self.limits.max_variables:
            raise LimitReached(f"the session would hold {len(self.variables) + new_vars} variables, over its limit "
                                f"of {self.limits.max_variables}; delete the session or use another",
                           code="session_limit")
        pending = self.pending_calls()
        if new_calls and pending + new_calls > self.limits.max_pending_calls:
            raise LimitReached(f"the session would have {pending + new_calls} calls pending or running, over its "
                                f"limit of {self.limits.max_pending_calls}; get some results first",
                           code="session_limit")
        if new_calls and self.key_check is not None:
            self.key_check(new_calls)

    def pending_calls(self) -> int:
        """Calls pending or running."""
        return sum(c.state in ("pending", "running") for c in self.calls.values())

    def create_variable(self, name: Optional[str] = None, value: Optional[str] = None) -> Variable:
        self._check_open()
        if name is not None and (not isinstance(name, str) or not NAME.match(name)):
            raise InvalidInput("name must be 1-64 letters, digits or _.:-", param="name")
        if value is not None and not isinstance(value, str):
            raise InvalidInput("value must be a string", param="value")
        self._check_count(1)
        if value is not None:
            self._charge(len(value.encode()))
        var = Variable(new_id("sv"), name, value)
        self.variables[var.id] = var
        return var

    def set_variable(self, vid: str, value: Any) -> Variable:
        self._check_open()
        var = self.variable(vid)
        if not isinstance(value, str):
            raise InvalidInput("value must be a string", param="value")
        if var.producer is not None:
            raise Conflict(f"variable {vid} is produced by call {var.producer.id}; it cannot be set",
                           code="variable_has_producer")
        if var.done:
            raise Conflict(f"variable {vid} already has a value; variables are set once",
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
        calls = CallReader(self.variable, self.services, self.caller).read(bodies, batch)
        for call in calls:
            call.tenant = self.tenant
        new_vars = {o.var.id: o.var for c in calls for o in c.outputs.values() if o.var.id not in self.variables}
        self._check_count(len(new_vars), len(calls))
        link(calls, batch)
        try:
            self._charge(sum(c.nbytes for c in calls))
        except GatewayError:
            unlink(calls)
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
        # values that arrived after submit (producers' outputs) are counted again, before any text is joined
        bound = prompt_bytes_bound(model.tokenizer, model.max_model_len)
        if call.messages is None:
            pieces = prompt_pieces(model.tokenizer, model.tool_format, segments, max_bytes=bound)
        else:
            pieces = prompt_pieces(model.tokenizer, model.tool_format, messages=[
                (role, [self._segment(call, k, v) for k, v in items]) for role, items in call.messages],
                max_bytes=bound)
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
        except GatewayError as e:
            self._fail(call, {"message": e.message, "call": call.id, "code": e.code})
        except EngineError as e:  # mapped as the chat route maps it; the call's error keeps message and code
            err = engine_error(e)
            self._fail(call, {"message": err.message, "call": call.id, "code": err.code})
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
            length = sum(len(p.tokens) for p in pieces)  # the context's tokens (what the next output follows)
            self.usage.prompt_tokens += length
            first_out = next(name for k, name in call.items if k == "output")
            self._predict(call, model, call.outputs[first_out], length)
            # the first fill places the context: on several replicas, where its prefix is (replicas.py)
            await engine.fill(ctx, rest, parent_context_id=shared.entry.context_id if shared else None,
                              hint=with_prefix_keys(call.hint(), hint_keys(keys, store.min_tokens)))
            made = True
            filled = len(rest) + (shared.filled if shared else 0)
            forked = (shared.entry.tokens - shared.filled) if shared else 0
            self.usage.filled_tokens += filled
            self.usage.forked_tokens += forked
            self.usage.cached_tokens += forked
            if self.services.metrics is not None:
                self.services.metrics.prefill_saved(call.model, {"fork": forked})
                self.services.metrics.semantic_tokens.labels(call.model, "filled").inc(filled)
                self.services.metrics.semantic_tokens.labels(call.model, "forked").inc(forked)
            first = next(i for i, (k, _) in enumerate(call.items) if k == "output")
            i = first
            while i < len(call.items):
                kind, name = call.items[i]
                if kind == "output":
                    self._predict(call, model, call.outputs[name], length)
                    generated = await self._generate(call, engine, ctx, call.outputs[name])
                    model.predictor.observe_segment(SEMANTIC_APP, length, generated)
                    length += generated
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
                    length += len(tail)
                    await engine.fill(ctx, tail, hint=call.hint())
                i = j
        finally:
            if made:
                engine.free_context_nowait(ctx)
            if shared is not None:
                store.release(shared)

    def _predict(self, call: Call, model: ModelServer, out: Output, context_tokens: int) -> None:
        """Set what the ranking is told of ``call`` (LAMPS, issue 32): the
        tokens the output ``out`` is expected to produce (learned per model
        for the app ``"semantic"``, at most its ``max_tokens``; before
        anything is learned, its ``max_tokens``) and, as the later segments,
        the LLM calls still to come downstream of it in the session, known
        from the DAG rather than predicted (:meth:`_downstream`)."""
        call.predicted = (self._expected_output(model, out, context_tokens), self._downstream(call, model))

    @staticmethod
    def _expected_output(model: ModelServer, out: Output, context_tokens: int) -> Optional[int]:
        cap = out.sampling.max_tokens if out.sampling is not None else None
        learned = model.lengths.estimate(SEMANTIC_APP, context_tokens)
        if learned is None:
            return cap
        return learned if cap is None else min(learned, cap)

    def _downstream(self, call: Call, model: ModelServer) -> Tuple[Tuple[int, Optional[float], int], ...]:
        """The pending LLM calls that read ``call``'s outputs, directly or
        through other calls, breadth first: each ``(its expected output,
        None, its template's own tokens)``.  Kept simple on purpose: they run
        in other contexts, not as this one's continuation, so the "result"
        is the new prompt text the session brings (its inputs' values are
        left out: not known yet), no call time is charged between them (a
        tool node between LLM calls holds no KV), and parallel branches are
        put in a row.  What it says: a call whose session has much left is
        part of a longer job (LAMPS' ``job`` horizon)."""
        seen, queue, later = {call.id}, [call], []
        while queue and len(later) < MAX_FUTURE_SEGMENTS:
            for o in queue.pop(0).outputs.values():
                for d in o.var.consumers:
                    if d.id in seen or d.state != "pending":
                        continue
                    seen.add(d.id)
                    queue.append(d)
                    if d.kind == "llm" and len(later) < MAX_FUTURE_SEGMENTS:
                        later.append(d)
        segs = []
        for d in later:
            dm = self.services.models.get(d.model, model)
            outs = [self._expected_output(dm, o, 0) for o in d.outputs.values()]
            segs.append((sum(n or 0 for n in outs), None, self._template_tokens(d, dm)))
        return tuple(segs)

    def _template_tokens(self, call: Call, model: ModelServer) -> int:
        """Tokens of a call's own prompt text (its template without the inputs' values), counted once."""
        n = self._template_sizes.get(call.id)
        if n is None:
            texts = [v for k, v in call.items if k == "text"]
            for _, items in call.messages or ():
                texts += [v for k, v in items if k == "text"]
            n = self._template_sizes[call.id] = len(model.tokenizer.encode("".join(texts), parse_special=False))
        return n

    async def _generate(self, call: Call, engine: Engine, ctx: ContextId, out: Output) -> int:
        """Decode ``out``; returns the tokens generated."""
        text: List[str] = []
        cached: Dict[str, int] = {}
        n = 0
        async for ev in engine.generate(ctx, out.sampling, hint=call.hint()):
            if ev.cached_tokens is not None:
                cached = ev.cached_tokens  # the fills' since the last output (the engine counts, then resets)
            if ev.token_id is not None:
                n += 1
                self.usage.completion_tokens += 1
            if ev.text:
                text.append(ev.text)
                out.var.push(ev.text)
        # the prefix cache's hits; a fork's are counted as forked_tokens (the engine cannot tell the
        # shared prefix the call itself filled first from one another call filled)
        hits = cached.get("prefix_cache", 0)
        self.usage.cached_tokens += hits
        if self.services.metrics is not None:
            self.services.metrics.prefill_saved(call.model, {"prefix_cache": hits})
        raw = "".join(text)
        # RE2 releases the GIL: a long output's transform runs beside the loop, not on it
        value = await asyncio.to_thread(out.transform.apply, raw) if out.transform is not None else raw
        self._charge(len(value.encode()))
        self._resolve(out.var, value)
        return n

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
            raise DependencyFailed(f"tool {call.tool!r} failed: {result.error_type}: {result.error}",
                                   code="tool_failed")
        (out,) = call.outputs.values()
        raw = result.to_text()
        out.var.push(raw)
        # RE2 releases the GIL: a long output's transform runs beside the loop, not on it
        value = await asyncio.to_thread(out.transform.apply, raw) if out.transform is not None else raw
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
            raise NotFound("the session is closed", code="session_not_found")

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
                          "filled_tokens": u.filled_tokens, "forked_tokens": u.forked_tokens,
                          "cached_tokens": u.cached_tokens, "bytes": self.nbytes}}
