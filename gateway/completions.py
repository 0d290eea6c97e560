"""One chat completion as a stream of high-level events, shared by the
streaming and non-streaming HTTP responses.

Client-side tools (standard OpenAI): the model's output is parsed as it
decodes; tool calls end the response with ``finish_reason="tool_calls"``.

Server-side tools (Interlace extension): the gateway runs plugin tools itself
and drives the agent loop inside one engine context (Conveyor + InferCept):

    decode -> the parser sees a call start   -> the tool's worker starts
           -> each completed field / line    -> fed to the tool at once
           -> the call's end marker          -> the engine pauses the context
           -> the result is appended          -> resume: decoding goes on

An argument that fails the tool's schema aborts decoding of that call at
once (the context is paused, the error becomes the call's result).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional

from ..engine_ext.errors import EngineError
from ..engine_ext.protocol import PauseHint, SamplingParams
from ..parsers.events import ArgumentsDelta, FieldComplete, LineComplete, ParserError, Text, ToolCallEnd, ToolCallStart
from .chat import ToolFormat, tool_results_turn
from .tools import InvalidToolArguments, ToolError


_REF = re.compile(r"\$\{?(\d+)\}?")


# ------------------------------------------------------------------ events out
@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str
    server: bool = False


@dataclass
class CallArgs:
    index: int
    fragment: str


@dataclass
class ServerToolResult:
    """A server-side call that ran (the extension clients see)."""

    index: int
    id: str
    name: str
    arguments: Any
    ok: bool
    content: Any
    error: Optional[str]
    started_at: float                     # the call's name was decoded
    tool_started_at: Optional[float]      # the tool began work (at started_at with partial execution)
    arguments_done_at: Optional[float]    # the arguments were complete
    finished_at: float                    # the result was there
    partial_execution: bool
    aborted_early: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TokenLogprob:
    """One sampled token's text and logprob (only when the request asks for logprobs)."""

    token_id: int
    text: str
    logprob: float


@dataclass
class Finish:
    reason: str
    usage: Dict[str, int]


@dataclass
class CompletionPlan:
    """Everything the HTTP layer decided about a request."""

    prompt_ids: List[int]
    sampling: SamplingParams
    parse_tools: bool                       # run the tool-call parser on the output
    server_tools: Dict[str, Any] = field(default_factory=dict)  # name -> Tool (runs here)
    partial_execution: bool = True
    max_tool_rounds: int = 8
    parallel_tool_calls: bool = True        # False: stop after the first client-side call
    request_info: Dict[str, Any] = field(default_factory=dict)


class FirstRoundOnly:
    """Wraps a logits processor so it stops applying once server-side tool
    results have been appended (``tool_choice="required"`` forces the first
    call, not the final answer)."""

    def __init__(self, proc: Any):
        self.proc = proc
        self.active = True

    def on_resume(self) -> None:
        self.active = False

    def __call__(self, generated: Any, logits: Any) -> Any:
        return self.proc(generated, logits) if self.active else logits


@dataclass
class _Call:
    index: int
    id: str
    name: str
    server: bool
    tool: Any = None                                  # the Tool prototype (server calls)
    runtime_call: Any = None                          # set by the driver once a worker is assigned
    events: Optional[asyncio.Queue] = None            # parser events for the tool, in order
    task: Optional[asyncio.Task] = None               # the driver: begin -> events -> finish -> ToolResult
    finishing: bool = False
    arguments: Any = None
    error: Optional[str] = None
    aborted_early: bool = False
    ignored: bool = False          # a plan's join(): ends the plan, runs nothing
    started_at: float = field(default_factory=time.time)


async def run_completion(model: Any, plan: CompletionPlan, runtime: Any = None,
                         metrics: Any = None) -> AsyncIterator[Any]:
    """Yield Content / CallStart / CallArgs / ServerToolResult / Finish."""
    engine = model.engine
    ctx = f"chat-{uuid.uuid4().hex}"
    fmt: ToolFormat = model.tool_format
    server_mode = bool(plan.server_tools)
    sampling = plan.sampling
    if server_mode:
        sampling = sampling.replace(pause_on=tuple(sampling.pause_on) + (fmt.call_end,))
    prompt_tokens = len(plan.prompt_ids)
    completion_tokens = 0
    calls: List[_Call] = []
    round_calls: List[_Call] = []
    rounds = 0
    deferred: List[_Call] = []
    finish_reason = "stop"
    parser = model.new_parser() if plan.parse_tools else None
    try:
        await engine.fill(ctx, plan.prompt_ids)
        stream = engine.generate(ctx, sampling)
        async with contextlib.aclosing(stream):
            async for ev in stream:
                if ev.token_id is not None:
                    completion_tokens += 1
                    if ev.logprob is not None:
                        yield TokenLogprob(ev.token_id, ev.text, ev.logprob)
                events = parser.feed(ev.text) if parser is not None else ([Text(ev.text)] if ev.text else [])
                if ev.finish_reason is not None and parser is not None:
                    events += parser.finish()
                abort_round = False
                stop_now = False
                for pe in events:
                    if isinstance(pe, Text):
                        if pe.text:
                            yield Content(pe.text)
                    elif isinstance(pe, ToolCallStart):
                        if fmt.name == "plan" and pe.name == "join":  # end of plan, not a tool
                            round_calls.append(_Call(-1, pe.id, pe.name, True, ignored=True))
                            continue
                        is_server = pe.name in plan.server_tools
                        call = _Call(len(calls), pe.id, pe.name, is_server, tool=plan.server_tools.get(pe.name))
                        calls.append(call)
                        round_calls.append(call)
                        yield CallStart(call.index, call.id, call.name, is_server)
                        if is_server and plan.partial_execution:
                            _start(call, runtime, plan, calls)  # the tool starts now, decoding goes on
                    elif isinstance(pe, ArgumentsDelta):
                        call = _current(calls, pe.index, round_calls)
                        if call is not None and not call.ignored:
                            yield CallArgs(call.index, pe.fragment)
                    elif isinstance(pe, (FieldComplete, LineComplete)):
                        call = _current(calls, pe.index, round_calls)
                        if call is None or call.events is None or call.error:
                            continue  # client call, baseline mode (nothing early) or already failed
                        if isinstance(pe, FieldComplete):
                            try:
                                if call.tool.validate_early:  # in-process, so a busy worker cannot delay it
                                    call.tool.validate_field(pe.key, pe.value)
                            except InvalidToolArguments as e:
                                # Conveyor's early abort: stop decoding this call now.
                                call.error, call.aborted_early = str(e), True
                                call.events.put_nowait(("abandon",))
                                abort_round = True
                                continue
                            call.events.put_nowait(("field", pe.key, pe.value))
                        else:
                            call.events.put_nowait(("line", pe.line))
                    elif isinstance(pe, ToolCallEnd):
                        call = _current(calls, pe.index, round_calls)
                        if call is None:
                            continue
                        call.arguments = pe.arguments
                        if not call.server and not plan.parallel_tool_calls:
                            stop_now = True  # one client call asked for: stop decoding here
                        if call.server and not call.error:
                            if plan.partial_execution:
                                call.events.put_nowait(("finish",))
                            else:  # baseline: tools start only once decoding of the round is over
                                deferred.append(call)
                    elif isinstance(pe, ParserError):
                        if pe.index is None and pe.raw:
                            yield Content(pe.raw)
                        elif pe.index is not None:
                            call = _current(calls, pe.index, round_calls)
                            if call is not None:
                                call.error = call.error or f"malformed tool call: {pe.message}"
                                if call.events is not None:
                                    call.events.put_nowait(("abandon",))
                if stop_now and ev.finish_reason is None:
                    finish_reason = "tool_calls"
                    break
                if abort_round and not ev.paused and ev.finish_reason is None:
                    try:
                        await engine.pause(ctx, PauseHint(tool=round_calls[-1].name))
                        continue  # the paused event follows on the stream
                    except EngineError:
                        pass  # it paused or finished by itself meanwhile
                if ev.paused or ev.finish_reason is not None:
                    for call in deferred:
                        _start(call, runtime, plan, calls)
                        call.events.put_nowait(("finish",))
                    deferred = []
                    round_calls = [c for c in round_calls if not c.ignored]
                if ev.paused:
                    client_calls = [c for c in round_calls if not c.server]
                    if client_calls or not round_calls or rounds >= plan.max_tool_rounds:
                        finish_reason = "tool_calls" if client_calls or round_calls else "stop"
                        break
                    rounds += 1
                    results = []
                    for call in round_calls:
                        res = await _result(call, metrics)
                        yield res
                        text = _result_text(res)
                        if fmt.name == "plan" and isinstance(call.arguments, dict):
                            text = f"${call.arguments.get('step')} = {text}"
                        results.append(text)
                    appended = model.tokenizer.encode(tool_results_turn(model.tokenizer, fmt, results))
                    prompt_tokens += len(appended)
                    round_calls = []
                    parser = model.new_parser()
                    for proc in sampling.logits_processors:  # e.g. forced replay moves to its next piece
                        if hasattr(proc, "on_resume"):
                            proc.on_resume()
                    await engine.resume(ctx, appended)
                    continue
                if ev.finish_reason is not None:
                    finish_reason = ev.finish_reason
                    if any(not c.server for c in calls) and finish_reason == "stop":
                        finish_reason = "tool_calls"
                    elif round_calls and all(c.server for c in round_calls):
                        for call in round_calls:  # calls that ended with the stream (no pause marker)
                            yield await _result(call, metrics)
        yield Finish(finish_reason, {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                     "total_tokens": prompt_tokens + completion_tokens})
    finally:
        # Runs on success, error and client disconnect alike.  Nothing here
        # awaits: a cancelled request's cleanup must not be cancelled too.
        for call in calls:
            if call.task is not None and not call.task.done():
                if call.finishing:
                    call.task.cancel()  # a running tool: the runtime kills and replaces its worker
                else:
                    call.events.put_nowait(("abandon",))  # the driver cancels the call and returns
        engine.free_context_nowait(ctx)


def _start(call: _Call, runtime: Any, plan: CompletionPlan, calls: List[_Call]) -> None:
    call.events = asyncio.Queue()
    call.task = asyncio.ensure_future(_drive(call, runtime, plan, calls))


async def _drive(call: _Call, runtime: Any, plan: CompletionPlan, calls: List[_Call]) -> Any:
    """One server-side call: get a worker, pass on the parser's events in
    order, finish.  It runs beside the token loop, so waiting for a free
    worker or a slow tool never holds up decoding or streaming."""
    rc = None
    try:
        rc = await runtime.begin(call.name, call.id, partial=plan.partial_execution, request=plan.request_info)
        call.runtime_call = rc
        while True:
            item = await call.events.get()
            if item[0] == "field":
                await rc.field(item[1], item[2])
            elif item[0] == "line":
                await rc.line(item[1])
            elif item[0] == "finish":
                call.finishing = True
                return await _execute(call, calls)
            else:  # abandon
                await rc.cancel()
                return None
    except ToolError as e:  # e.g. a veto, or a failure surfaced by field/line
        call.error = call.error or str(e)
        if rc is not None:
            await _quiet(rc.cancel())
        return None


async def _execute(call: _Call, calls: List[_Call]) -> Any:
    """Finish a call.  A plan step first waits for the steps it references
    and substitutes their results (LLMCompiler-style ``$N``)."""
    args = call.arguments
    if isinstance(args, dict) and "step" in args and "depends_on" in args:
        by_step = {c.arguments.get("step"): c for c in calls
                   if isinstance(c.arguments, dict) and "step" in c.arguments and c is not call}
        values = {}
        for n in args["depends_on"]:
            dep = by_step.get(n)
            res = await asyncio.shield(dep.task) if dep is not None and dep.task is not None else None
            if res is None:
                call.error = f"step ${n} has no result"
                return None
            values[n] = _reference_value(res)
        args = _plan_arguments(call.tool, args, values)
    return await call.runtime_call.finish(args)


def _reference_value(res: Any) -> str:
    if not res.ok:
        return f"(error: {res.error})"
    c = res.content
    if isinstance(c, dict) and "result" in c:  # calculator, python: the value itself
        c = c["result"]
    elif isinstance(c, dict) and isinstance(c.get("results"), list) and c["results"]:  # search: best hit
        top = c["results"][0]
        c = top.get("snippet") or top.get("text") or top if isinstance(top, dict) else top
    if isinstance(c, str):
        return c.strip()
    return json.dumps(c, ensure_ascii=False)


def _plan_arguments(tool: Any, step: Dict[str, Any], values: Dict[int, str]) -> Dict[str, Any]:
    """Positional plan arguments -> the tool's named parameters (schema
    order), with ``$N`` references replaced by earlier results."""
    def sub(v: Any) -> Any:
        if isinstance(v, str):
            whole = _REF.fullmatch(v)
            if whole and int(whole.group(1)) in values:
                return values[int(whole.group(1))]
            return _REF.sub(lambda m: values.get(int(m.group(1)), m.group(0)), v)
        if isinstance(v, list):
            return [sub(x) for x in v]
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        return v
    names = list((tool.parameters or {}).get("properties", {}))
    out = {names[i]: sub(v) for i, v in enumerate(step.get("args", [])) if i < len(names)}
    out.update({k: sub(v) for k, v in (step.get("kwargs") or {}).items()})
    return out


def _current(calls: List[_Call], parser_index: Optional[int], round_calls: List[_Call]) -> Optional[_Call]:
    """Map a parser's per-stream call index to our call (the parser restarts each round)."""
    if parser_index is None or parser_index >= len(round_calls):
        return None
    return round_calls[parser_index]


async def _result(call: _Call, metrics: Any) -> ServerToolResult:
    r = None
    if call.task is not None:
        if call.error and not call.task.done():
            call.events.put_nowait(("abandon",))
        r = await call.task
    now = time.time()
    if r is None:
        res = ServerToolResult(call.index, call.id, call.name, call.arguments, False, None,
                               call.error or "the tool call was not completed", call.started_at, None, None, now,
                               bool(call.runtime_call is not None and call.runtime_call.partial), call.aborted_early)
    else:
        # the tool began work at the call's start with partial execution, at the arguments' end without
        began = r.started_at if r.partial else r.finish_called_at
        res = ServerToolResult(call.index, call.id, call.name, call.arguments, r.ok, r.content,
                               None if r.ok else f"{r.error_type}: {r.error}", call.started_at, began,
                               r.finish_called_at, r.finished_at, r.partial)
    if metrics is not None:
        metrics.tool_call(res.name, res.ok, res.finished_at - (res.tool_started_at or res.started_at))
    return res


def _result_text(res: ServerToolResult) -> str:
    if not res.ok:
        return json.dumps({"error": res.error}, ensure_ascii=False)
    return res.content if isinstance(res.content, str) else json.dumps(res.content, ensure_ascii=False)


async def _quiet(aw: Any) -> None:
    try:
        await aw
    except Exception:
        pass
