"""One chat completion as a stream of high-level events, shared by the
streaming and non-streaming HTTP responses.

Client-side tools (standard OpenAI): the model's output is parsed as it
decodes; tool calls end the response with ``finish_reason="tool_calls"``.

Server-side tools (Interlace extension): the gateway runs plugin tools itself
and drives the agent loop inside one engine context (Conveyor + InferCept):

    decode -> the parser sees a call start   -> the tool's worker starts
           -> each completed field / line    -> fed to the tool at once
           -> a call-end marker of the format -> the engine pauses the context
           -> the results are appended        -> resume: decoding goes on

An argument that fails the tool's schema aborts decoding of that call at
once (the context is paused, the error becomes the call's result).

The tool-call format (markers, prompt rendering) belongs to the model's
parser (``model.tool_format``): the engine pauses on every marker in its
``call_end``.  The loop never asks which format it has: where calls use
earlier calls' results (the plan format's ``$N``), the format says which
call ends the calls, which calls a call waits for, the arguments its tool
gets and how its result reads back.

Client calls stream; a call that turns out malformed is withdrawn.  A client
call is passed on (``CallStart``) as soon as its name is known and is one of
the offered tools; a call to any other name is held and becomes ``Content``
at its end (its text as the format renders it).  Its arguments are released
(``CallArgs``) at member granularity: the parser's ``ArgumentsDelta``
fragments are buffered, and at each ``FieldComplete`` (the parser sends the
deltas covering a value before it) the buffer goes out if what the client
then holds is a JSON object once ``}`` is appended (checked, not assumed:
arguments that came as a JSON-encoded string are released at the end); the
rest goes out at ``ToolCallEnd``.  The markdown code tool has no member
boundary before its end (its ``LineComplete`` units are inside one JSON
string, ``{"code": "...``), so its arguments go out whole when the fence
closes.  So the client holds a valid JSON object
prefix at every moment: OpenAI's delta shape (the first delta carries id,
type and name, later ones argument fragments).  The released text is the
model's bytes for the JSON formats and the parser's JSON rendering for the
others (pythonic, markdown); where the arguments the client gets differ from
what the parser streamed (a plan step's positional arguments, named by the
tool's schema, have no ``FieldComplete``), nothing was released before the end
and the end releases ``json.dumps`` of the final arguments.  The non-streamed
answer is the same fragments joined: both carry the same string.

A passed-on call that then fails (broken JSON after some members, arguments
that are not an object, non-finite numbers, or a call still open when
``max_tokens`` or the end of the output cut it) is *withdrawn*: the loop
releases the closing text that makes what was sent a valid JSON object
(``}``, or ``{}`` when nothing was released), stops decoding there (nothing
after a broken call is worth decoding; the context is handled as on any
finish), and the completion ends with ``finish_reason="length"`` when a limit
cut the call, else ``"stop"`` -- never ``"tool_calls"``, so a client that
checks ``finish_reason`` (as OpenAI's documentation asks) does not run it.
``Finish.withdrawn`` lists the withdrawn call's index (the APIs show it: chat
completions' ``interlace.withdrawn_tool_calls``, a Responses ``function_call``
item with ``status: "incomplete"``, a Messages ``stop_reason`` other than
``tool_use``).  A malformed call that was never passed on (a tool that was
not offered, a failure before the name) becomes ``Content``: its raw text
when the parser has it.  A malformed *server-side* call becomes an error
result that the model sees (for an unknown tool, the error names the offered
tools).  In a round forced by ``tool_choice`` (``CompletionPlan.forced_calls``)
the grammar lets only calls through, so a call that fails there was cut
short by ``max_tokens``: withdrawn if it was passed on, else dropped
(``finish_reason="length"``, ``content`` null), never shown as content.
With ``parallel_tool_calls: false`` decoding stops once the first client call
is complete; with ``tool_choice: "none"`` no call is passed on (a format that
parses its calls anyway, because it carries the reasoning too, gets them back
as content).

Reasoning.  A model with a reasoning parser (``model.reasons``) has its output
parsed even when no tool call is (``parse_tools`` False: the parser is made
with ``calls=False``); the parser's ``Reasoning`` events become
``ReasoningText``, never ``Content`` (chat completions' ``reasoning_content``,
a Responses reasoning item, a Messages thinking block).

Numbering.  Client calls are numbered from 0 in the order they are passed on,
server calls separately from 0 (``CallStart.server`` / ``CallArgs.server`` say
which numbering an index belongs to).

Limits.  Server-side calls decoded after ``max_tool_rounds`` rounds are not
run: each gets an error result and the completion ends with
``finish_reason="length"`` (a limit cut the answer short; never ``"tool_calls"``
without calls).  Tool results that do not fit the context left (keeping a small
reserve for the answer) are truncated with a visible marker; the result record
says so in ``truncated``.

Placement.  A request with a ``prompt_cache_key`` (OpenAI's field, on chat
completions and, translated, the Responses API) puts a digest of it -- of
the caller's key name with it, so one caller's key never places another's
requests -- in the ``prefix_keys`` of the hint its new context is filled
with: on several replicas (:mod:`engine_ext.replicas`) requests sharing a
key land where the first one went, and find its prefix cached there (what
OpenAI says the key is for).  ``user`` is not used for it, though OpenAI
used it so before ``prompt_cache_key`` replaced it: it names an end user,
all of whose conversations would then pile onto one replica, and the turns
of one conversation find each other by their tokens' prefix anyway.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

from ...engine_ext.errors import EngineError

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ...engine_ext.policies import SegmentPrediction
    from ...engine_ext.protocol import ContextId, Engine
    from ...engine_ext.tokenizer import Tokenizer
    from ...parsers.formats import ToolFormat
    from ..metrics import Metrics
    from ..models import ModelServer
    from ..tools.base import Tool
    from ..tools.call import ToolCall
    from ..tools.runtime import ToolRuntime
from ...engine_ext.protocol import PauseHint, RequestHint, SamplingParams
from ...parsers.events import (ArgumentsDelta, FieldComplete, LineComplete, ParserError, Reasoning, Text, ToolCallEnd,
                               ToolCallStart)
from ...parsers.jsonscan import loads as strict_loads
from ..prompt import tool_results_turn
from ..tools.base import InvalidToolArguments, ToolError


log = logging.getLogger(__name__)

#: Tokens kept free for the model's answer when tool results are appended
#: (a result that fills the context to the last token leaves nothing to say).
ANSWER_RESERVE_TOKENS = 64


# ------------------------------------------------------------------ events out
@dataclass
class Content:
    text: str


@dataclass
class ReasoningText:
    """The model's reasoning (a reasoning parser's ``Reasoning``): never content, never a call."""

    text: str


@dataclass
class CallStart:
    index: int           # client calls and server calls are numbered separately, from 0
    id: str
    name: str
    server: bool = False


@dataclass
class CallArgs:
    index: int
    fragment: str
    server: bool = False  # which numbering ``index`` belongs to


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
    #: set when the result was cut to fit the context: {"shown_chars", "total_chars"}
    truncated: Optional[Dict[str, Any]] = None

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
    #: the stop string that ended the output (``reason == "stop"``); None when an end-of-sequence
    #: token or a limit ended it (Anthropic's ``stop_sequence`` needs to know which)
    stop_sequence: Optional[str] = None
    #: the client calls that were passed on and then withdrawn (their indices; see the module docstring)
    withdrawn: List[int] = field(default_factory=list)


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
    #: every function the request offers (client and server), name -> parameters schema;
    #: a call to any other name is malformed
    offered_tools: Dict[str, Any] = field(default_factory=dict)
    #: the first round is tool calls forced by a grammar (tool_choice "required" or a named function):
    #: a call that fails there can only have been cut short (max_tokens), and is not content
    forced_calls: bool = False
    #: keep the context for a follow-up when the completion ends by itself ("stop"), not only on
    #: client-side tool calls: a stored Responses-API response, which ``previous_response_id`` continues
    retain_at_stop: bool = False
    #: when the request arrived (``time.perf_counter()``; the route sets it as its handler starts):
    #: the time to first token is measured from it
    arrived_at: float = field(default_factory=time.perf_counter)
    #: tell a reasoning model's reasoning apart from its answer (False: the legacy text completions,
    #: whose raw prompt has no chat template, get the output as it is)
    parse_reasoning: bool = True
    #: the request's ``prompt_cache_key`` (None: none): requests sharing it are placed together
    #: (the module docstring, "Placement")
    cache_key: Optional[str] = None


class FirstRoundOnly:
    """Wraps a logits processor so it stops applying once server-side tool
    results have been appended (``tool_choice="required"`` forces the first
    call, not the final answer).  ``resumes`` counts the :meth:`on_resume`
    calls (a worker-process engine replays them on its copy)."""

    def __init__(self, proc: Any):
        self.proc = proc
        self.active = True
        self.resumes = 0

    def on_resume(self) -> None:
        self.active = False
        self.resumes += 1

    def __call__(self, generated: Any, logits: Any) -> Any:
        return self.proc(generated, logits) if self.active else logits

    def segment_grammar(self, n_generated: int) -> Any:
        return self.proc.segment_grammar(n_generated) if self.active else None


@dataclass
class _Call:
    index: int                                        # server: its number; client: set when passed on
    id: str
    name: str
    server: bool
    tool: Optional[Tool] = None                       # the Tool prototype (server calls)
    runtime_call: Optional[ToolCall] = None           # set by the driver once a worker is assigned
    events: Optional[asyncio.Queue] = None            # parser events for the tool, in order
    task: Optional[asyncio.Task] = None               # the driver: begin -> events -> finish -> ToolResult
    finishing: bool = False
    arguments: Any = None
    error: Optional[str] = None
    aborted_early: bool = False
    ignored: bool = False          # the end of the calls (the format's ends_calls: a plan's join()), runs nothing
    ended: bool = False            # the parser closed it (ToolCallEnd or ParserError)
    emitted: bool = False          # a client call passed on to the client
    withdrawn: bool = False        # a client call passed on, then withdrawn (it failed)
    released: str = ""             # a client call's arguments text passed on so far
    held: str = ""                 # a client call's argument fragments not passed on yet
    started_at: float = field(default_factory=time.time)


# ---------------------------------------------------------- call checks
def malformed(name: str, arguments: Any, offered: Dict[str, Any]) -> Optional[str]:
    """Why a decoded call cannot be passed on or run (None: it is well formed).

    OpenAI function calling requires the arguments to be a JSON object, and
    clients parse them with a strict JSON parser (no NaN/Infinity)."""
    if name not in offered:
        return unknown_tool(name, offered)
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object, not {_json_type(arguments)}"
    try:
        json.dumps(arguments, allow_nan=False)
    except (ValueError, TypeError) as e:
        return f"the arguments of {name!r} are not valid JSON: {e}"
    return None


def unknown_tool(name: str, offered: Dict[str, Any]) -> str:
    return (f"{name!r} is not one of the tools offered: "
            f"{', '.join(sorted(offered)) or '(none)'}")


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", str: "a string", list: "an array", int: "a number",
            float: "a number"}.get(type(v), type(v).__name__)


def _call_text(fmt: ToolFormat, name: str, arguments: Any) -> str:
    """A rejected call shown as content, as the format writes it."""
    try:
        return fmt.render_call(name, arguments)
    except Exception:  # a format that cannot render these arguments (they are malformed, after all)
        return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, default=str)


class _Turn:
    """What the parser's events mean for one completion: which calls are the
    client's, which run here, which are malformed.  ``handle`` maps one parser
    event to the events the HTTP layer sees."""

    def __init__(self, model: ModelServer, plan: CompletionPlan, runtime: Optional[ToolRuntime]):
        self.fmt = model.tool_format
        self.plan = plan
        self.runtime = runtime
        self.calls: List[_Call] = []       # every call of the completion
        self.round: List[_Call] = []       # the current parser's calls, by its index
        self.deferred: List[_Call] = []    # baseline mode: server calls start when the round's decoding ends
        self.n_client = 0
        self.n_server = 0
        self.abort_round = False           # an argument failed early: pause now
        self.stop_now = False              # parallel_tool_calls=false and a client call was passed on
        self.withdrawn: List[int] = []     # client calls passed on, then withdrawn (their indices)
        self.forced = plan.forced_calls    # this round's output is grammar-forced calls (the first round)

    @property
    def cut(self) -> bool:
        """A passed-on call was withdrawn: decoding stops here (the module docstring)."""
        return bool(self.withdrawn)

    # -- parser events -----------------------------------------------------
    def handle(self, pe: Any) -> List[Any]:
        if self.stop_now or self.withdrawn:
            return []  # decoding stops at this token: nothing after the last call is passed on
        if isinstance(pe, Text):
            return [Content(pe.text)] if pe.text else []
        if isinstance(pe, Reasoning):
            return [ReasoningText(pe.text)] if pe.text else []
        if isinstance(pe, ToolCallStart):
            return self._start(pe)
        call = self._current(getattr(pe, "index", None))
        if isinstance(pe, ParserError):
            if call is None:
                return [Content(pe.raw)] if pe.raw and not self.forced else []
            return self._failed(call, f"malformed tool call: {pe.message}", pe.raw)
        if call is None or call.ignored:
            return []
        if isinstance(pe, ArgumentsDelta):
            if call.server:
                return [CallArgs(call.index, pe.fragment, server=True)]
            if call.emitted:
                call.held += pe.fragment  # released member by member (see the module docstring)
            return []
        if isinstance(pe, (FieldComplete, LineComplete)):
            self._feed_tool(call, pe)
            if call.emitted and isinstance(pe, FieldComplete):
                return self._release(call)
            return []
        if isinstance(pe, ToolCallEnd):
            return self._end(call, pe.arguments)
        return []

    def end_of_output(self) -> List[Any]:
        """The output ended (after the parser's ``finish``): a passed-on call still open is withdrawn
        (every parser reports an unterminated call, so this is a safety net)."""
        for call in self.round:
            if call.emitted and not call.ended and not self.withdrawn:
                return self._withdraw(call)
        return []

    def _current(self, parser_index: Optional[int]) -> Optional[_Call]:
        """The call a parser index refers to (the parser restarts each round)."""
        if parser_index is None or parser_index >= len(self.round):
            return None
        return self.round[parser_index]

    def _start(self, pe: ToolCallStart) -> List[Any]:
        plan = self.plan
        if self.fmt.ends_calls(pe.name):  # the end of the calls, not a tool
            self.round.append(_Call(-1, pe.id, pe.name, True, ignored=True, ended=True))
            return []
        if not plan.parse_tools:  # a format that carries reasoning parses its calls anyway (harmony): content
            call = _Call(-1, pe.id, pe.name, False)
            self.calls.append(call)
            self.round.append(call)
            return []
        if pe.name in plan.server_tools or (plan.server_tools and pe.name not in plan.offered_tools):
            call = _Call(self.n_server, pe.id, pe.name, True, tool=plan.server_tools.get(pe.name))
            self.n_server += 1
            if call.tool is None:  # the loop runs here, so the model learns its mistake from the result
                call.error = unknown_tool(pe.name, plan.offered_tools)
            self.calls.append(call)
            self.round.append(call)
            if call.tool is not None and plan.partial_execution:
                _start(call, self.runtime, plan, self.calls, self.fmt)  # the tool starts now, decoding goes on
            return [CallStart(call.index, call.id, call.name, True)]
        call = _Call(-1, pe.id, pe.name, False)
        self.calls.append(call)
        self.round.append(call)
        if pe.name not in plan.offered_tools:
            return []  # a tool that was not offered: held, it becomes content at its end
        call.index, call.emitted = self.n_client, True  # passed on now; its arguments member by member
        self.n_client += 1
        return [CallStart(call.index, call.id, call.name, False)]

    def _feed_tool(self, call: _Call, pe: Any) -> None:
        if call.events is None or call.error:
            return  # client call, baseline mode (nothing early) or already failed
        if isinstance(pe, FieldComplete):
            try:
                if call.tool.validate_early:  # in-process, so a busy worker cannot delay it
                    call.tool.validate_field(pe.key, pe.value)
            except InvalidToolArguments as e:
                # Conveyor's early abort: stop decoding this call now.
                call.error, call.aborted_early = str(e), True
                call.events.put_nowait(("abandon",))
                self.abort_round = True
                return
            call.events.put_nowait(("field", pe.key, pe.value))
        else:
            call.events.put_nowait(("line", pe.line))

    def _release(self, call: _Call) -> List[Any]:
        """A top-level member of a passed-on call is complete: its buffered fragments go out if the
        client then holds a JSON object once ``}`` is appended (else they wait for the next member,
        or the end)."""
        if not call.held:
            return []
        text = call.released + call.held
        if not isinstance(_json_or_none(text + "}"), dict):
            return []
        fragment, call.released, call.held = call.held, text, ""
        return [CallArgs(call.index, fragment)]

    def _end(self, call: _Call, arguments: Any) -> List[Any]:
        call.ended = True
        plan = self.plan
        if not call.server and call.name in plan.offered_tools:
            # a client tool gets its arguments as its schema names them (a plan step's are positional)
            arguments = self.fmt.tool_arguments(arguments, plan.offered_tools[call.name], {})
        call.arguments = arguments
        if call.server:
            if call.error:
                return []
            problem = malformed(call.name, arguments, plan.offered_tools)
            if problem:
                call.error = problem
                if call.events is not None:
                    call.events.put_nowait(("abandon",))
            elif plan.partial_execution:
                call.events.put_nowait(("finish",))
            else:  # baseline: tools start only once decoding of the round is over
                self.deferred.append(call)
            return []
        problem = malformed(call.name, arguments, plan.offered_tools)
        if not call.emitted:  # held: a tool that was not offered, or no call is parsed (tool_choice none)
            call.error = problem or "tool calls are not parsed in this request"
            return [Content(_call_text(self.fmt, call.name, arguments))]
        if problem:
            call.error = problem
            return self._withdraw(call)
        fragment = call.held
        if _json_or_none(call.released + fragment) != arguments:
            # what the parser streamed is not the arguments the client gets (a plan step's): nothing
            # was released before the end (no FieldComplete), so the end gives them whole
            if call.released:
                log.warning("tool call %r: the streamed arguments differ from the parsed ones; withdrawn",
                            call.name)
                call.error = "the streamed arguments differ from the parsed ones"
                return self._withdraw(call)
            fragment = json.dumps(arguments, ensure_ascii=False)
        call.released, call.held = call.released + fragment, ""
        if not plan.parallel_tool_calls:
            self.stop_now = True  # one client call asked for: stop decoding here
        return [CallArgs(call.index, fragment)]

    def _failed(self, call: _Call, message: str, raw: str) -> List[Any]:
        call.ended = True
        call.error = call.error or message
        if call.server:
            if call.events is not None:
                call.events.put_nowait(("abandon",))
            return []
        if call.emitted:
            return self._withdraw(call)
        return [Content(raw)] if raw and not self.forced else []

    def _withdraw(self, call: _Call) -> List[Any]:
        """Take back a passed-on call: close what was sent so it is a valid JSON object, and stop."""
        call.ended = call.withdrawn = True
        self.withdrawn.append(call.index)
        closing = "}" if call.released else "{}"
        call.released, call.held = call.released + closing, ""
        return [CallArgs(call.index, closing)]

    # -- round bookkeeping ---------------------------------------------------
    def start_deferred(self) -> None:
        for call in self.deferred:
            _start(call, self.runtime, self.plan, self.calls, self.fmt)
            call.events.put_nowait(("finish",))
        self.deferred = []

    def pending(self) -> bool:
        """A call of this round has started and not closed: the pause marker
        was not its end (JSON formats' markers also occur inside arguments)."""
        return any(not c.ended and not c.error for c in self.round)

    def client_calls(self) -> List[_Call]:
        """The client calls of this round passed on whole (closed, not withdrawn)."""
        return [c for c in self.round if c.emitted and c.ended and not c.withdrawn]

    def server_calls(self) -> List[_Call]:
        return [c for c in self.round if c.server and not c.ignored]

    def new_round(self) -> None:
        self.round = []
        self.forced = False  # tool_choice forces the first round only (plan.py)


def _json_or_none(text: str) -> Any:
    """``text`` as strict JSON (finite numbers only), or None when it is not JSON."""
    try:
        return strict_loads(text)
    except (ValueError, RecursionError):
        return None


async def run_completion(model: ModelServer, plan: CompletionPlan, runtime: Optional[ToolRuntime] = None,
                         metrics: Optional[Metrics] = None) -> AsyncIterator[Any]:
    """Yield Content / CallStart / CallArgs / ServerToolResult / Finish."""
    engine = model.engine
    ctx: Any = None
    turn = _Turn(model, plan, runtime)
    fmt = turn.fmt
    sampling = plan.sampling
    if plan.server_tools:
        sampling = sampling.replace(pause_on=tuple(sampling.pause_on) + tuple(fmt.call_end))
    prompt_tokens = len(plan.prompt_ids)
    completion_tokens = 0
    rounds = 0
    aborting = False  # we paused the context to abort a call early
    finish_reason = "stop"
    parser = _new_parser(model, plan, plan.prompt_ids)
    owner = plan.request_info.get("key")
    app = f"{model.name}:{owner or ''}"  # LAMPS' output-length predictor learns per model and caller
    store = model.retention
    # LAMPS' inputs, per segment (to the next tool call or the end), learned per app: hints.py
    predictor = model.predictor
    segment = 0        # segments done (each server-tool round ends one)
    paused_at = 0.0    # when the current round's pause came (the call's wall time runs to its resume)
    retained = False   # the retention store owns the context now
    held = 0           # prompt tokens a retained context already held (adopted: not prefilled again)
    engine_cached: Dict[str, int] = {}  # the engine's latest TokenEvent.cached_tokens, by mechanism
    # the last tokens, to tell which stop string ended the output (a character is at most 4 tokens)
    tail = collections.deque(maxlen=4 * max(map(len, sampling.stop)) + 8) if sampling.stop else None
    segment_start, segment_tokens = prompt_tokens, 0  # the current segment (to the next tool call or the end)
    # the key's name is the tenant the engine's queue is fair across (its prefill and its decoding)
    hint = _segment_hint(app, owner, predictor.predict(app, prompt_tokens, 0, may_call=_may_call(plan, 0)))
    try:
        adopted = store.claim(owner, plan.prompt_ids) if store is not None else None
        if adopted is not None:
            ctx = adopted.ctx
            try:
                if adopted.matched < len(adopted.tokens):  # the reply re-rendered differently from there on
                    await engine.truncate(ctx, adopted.matched)
                kept = await engine.computed_tokens(ctx)
                await engine.fill(ctx, plan.prompt_ids[adopted.matched:], hint=hint)
                held = kept
                store.adopted(held)
            except EngineError as e:  # never fail the follow-up for it: prefill as a new request
                log.warning("retained context %r could not be adopted, prefilling anew: %s", ctx, e)
                engine.free_context_nowait(ctx)
                ctx = None
        if ctx is None:
            ctx = f"chat-{uuid.uuid4().hex}"
            placed = hint  # the new context's first fill says where it belongs (several replicas)
            if plan.cache_key:
                placed = dataclasses.replace(hint, prefix_keys=(cache_key_digest(owner, plan.cache_key),))
            await engine.fill(ctx, plan.prompt_ids, hint=placed)
        stream = engine.generate(ctx, sampling, hint=hint)
        async with contextlib.aclosing(stream):
            async for ev in stream:
                if ev.cached_tokens is not None:
                    engine_cached = ev.cached_tokens
                if ev.token_id is not None:
                    completion_tokens += 1
                    segment_tokens += 1
                    if tail is not None:
                        tail.append(ev.token_id)
                    if ev.logprob is not None:
                        yield TokenLogprob(ev.token_id, ev.text, ev.logprob)
                events = parser.feed(ev.text) if parser is not None else ([Text(ev.text)] if ev.text else [])
                outs = [out for pe in events for out in turn.handle(pe)]
                cut_at_end = False  # a passed-on call was withdrawn because the output ended inside it
                if ev.finish_reason is not None and not turn.cut:
                    ending = parser.finish() if parser is not None else []
                    outs += [out for pe in ending for out in turn.handle(pe)]
                    outs += turn.end_of_output()
                    cut_at_end = turn.cut
                for out in outs:
                    if isinstance(out, CallStart) and out.server:
                        _hint_call(engine, ctx, model, app, owner, segment_start, segment, out.name,
                                   plan.server_tools.get(out.name))
                    yield out
                if turn.cut:  # a call was withdrawn: stop here ("length" when a limit cut it)
                    finish_reason = "length" if cut_at_end and ev.finish_reason == "length" else "stop"
                    break
                if turn.stop_now and ev.finish_reason is None:
                    finish_reason = "tool_calls"
                    break
                if turn.abort_round and not ev.paused and ev.finish_reason is None:
                    turn.abort_round, aborting = False, True
                    try:
                        name = turn.round[-1].name
                        await engine.pause(ctx, PauseHint(tool=name, expected_duration_s=_tool_seconds(
                            model, name, plan.server_tools.get(name))))
                        continue  # the paused event follows on the stream
                    except EngineError:
                        pass  # it paused or finished by itself meanwhile
                if ev.paused or ev.finish_reason is not None:
                    turn.start_deferred()
                if ev.paused:
                    paused_at = time.monotonic()
                    # an early abort pauses inside the call on purpose: the parser is still in it
                    spurious = not (aborting or turn.abort_round) and (turn.pending()
                                                                      or getattr(parser, "in_call", False))
                    turn.abort_round = aborting = False
                    if turn.client_calls() and not spurious:  # (a marker inside a later call: it goes on)
                        finish_reason = "tool_calls"
                        break
                    server = turn.server_calls()
                    if spurious or not server:
                        # a marker inside a call, in prose, or after a call that became content:
                        # nothing to run, decoding goes on
                        await engine.resume(ctx, [])
                        continue
                    if rounds >= plan.max_tool_rounds:
                        for call in server:
                            yield _not_run(call, f"not run: this request's max_tool_rounds "
                                                 f"({plan.max_tool_rounds}) was reached")
                        finish_reason = "length"
                        break
                    rounds += 1
                    results = [await _result(call, metrics) for call in server]
                    texts = [fmt.named_result(call.arguments, _result_text(res)) for call, res in zip(server, results)]
                    room = (model.max_model_len - (prompt_tokens + completion_tokens) - 1
                            - min(ANSWER_RESERVE_TOKENS, max(0, sampling.max_tokens - completion_tokens)))
                    appended, cuts = fit_results(model.tokenizer, fmt, texts, room, [c.name for c in server])
                    for res, cut in zip(results, cuts):
                        res.truncated = cut
                        yield res
                    if appended is None:  # not even the results' envelope fits: the context is full
                        finish_reason = "length"
                        break
                    prompt_tokens += len(appended)
                    predictor.observe_segment(app, segment_start, segment_tokens)  # a segment ended in tool calls
                    # the call's time as the engine waits for it (pause to resume); per tool only where the
                    # engine does not learn it itself into the same object (ModelServer.engine_times_calls)
                    predictor.observe_call(app, server[-1].name, time.monotonic() - paused_at, len(appended),
                                           tool_durations=not model.engine_times_calls)
                    segment += 1
                    segment_start, segment_tokens = prompt_tokens + completion_tokens, 0
                    turn.new_round()
                    parser = _new_parser(model, plan, appended)
                    for proc in sampling.logits_processors:  # e.g. forced replay moves to its next piece
                        if hasattr(proc, "on_resume"):
                            proc.on_resume()
                    # the next segment's predictions replace this one's in the engine's ranking
                    await engine.resume(ctx, appended, hint=_segment_hint(app, owner, predictor.predict(
                        app, segment_start, segment, may_call=_may_call(plan, rounds))))
                    continue
                if ev.finish_reason is not None:
                    finish_reason = ev.finish_reason
                    if turn.n_client and finish_reason == "stop":
                        finish_reason = "tool_calls"
                    server = turn.server_calls()
                    if server and not turn.client_calls():
                        for call in server:  # calls that ended with the stream (no pause marker)
                            yield await _result(call, metrics)
        if finish_reason in ("stop", "tool_calls") and not turn.cut:  # ended by itself, not cut short
            predictor.observe_segment(app, segment_start, segment_tokens)
        if finish_reason == "stop" and not turn.cut:
            # the job's segment count (client tool calls: unknown here -- the follow-up is another request)
            predictor.observe_finish(app, segment + 1)
        client_calls = turn.client_calls() if finish_reason == "tool_calls" else []
        if store is not None and (client_calls or (plan.retain_at_stop and finish_reason in ("stop", "length"))):
            # the client runs the tools (or, for a stored response, says its next turn) and comes back
            # with the whole conversation: keep the context
            entry = store.retain(owner, ctx, await engine.context_tokens(ctx),
                                 client_calls[0].name if client_calls else None, prompt_len=len(plan.prompt_ids))
            retained = entry is not None
            if entry is not None:
                await store.park(entry)
        # cached: every prompt token served from KV that existed (the adopted context's, the prefix cache's)
        cached = min(prompt_tokens, held + sum(engine_cached.values()))
        yield Finish(finish_reason, {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                     "total_tokens": prompt_tokens + completion_tokens,
                                     "prompt_tokens_details": {"cached_tokens": cached}},
                     stop_sequence=(stop_string(model, sampling.stop, tail)
                                    if finish_reason == "stop" and not turn.cut else None),
                     withdrawn=list(turn.withdrawn))
    finally:
        # Runs on success, error and client disconnect alike.  Nothing here
        # awaits: a cancelled request's cleanup must not be cancelled too.
        for call in turn.calls:
            if call.task is not None and not call.task.done():
                if call.finishing:
                    call.task.cancel()  # a running tool: the runtime kills and replaces its worker
                else:
                    call.events.put_nowait(("abandon",))  # the driver cancels the call and returns
        if ctx is not None and not retained:
            engine.free_context_nowait(ctx)
        if metrics is not None:  # saved however the request ended (the retention's own: store.adopted)
            metrics.prefill_saved(model.name, engine_cached)


def _new_parser(model: ModelServer, plan: CompletionPlan, prompt_tail: Sequence[int]) -> Any:
    """The parser of one output segment (None: the output is all content).  Tool calls are parsed
    when the plan asks; a reasoning model's output is parsed for its reasoning in any case (then
    ``calls=False`` when no call is to be parsed).  ``prompt_tail``: the tokens before the segment
    (the prompt, or the appended tool results), whose end tells a reasoning parser whether the
    generation prompt opened the reasoning."""
    reasons = plan.parse_reasoning and bool(getattr(model, "reasons", False))
    if not (plan.parse_tools or reasons):
        return None
    if not reasons:
        return model.new_parser(plan.offered_tools, calls=True)
    tail = model.tokenizer.decode(list(prompt_tail[-8:]), skip_special_tokens=False)
    return model.new_parser(plan.offered_tools, calls=plan.parse_tools, prompt_tail=tail)


def stop_string(model: ModelServer, stops: Sequence[str], tail: Optional[Sequence[int]]) -> Optional[str]:
    """Which of ``stops`` ended an output whose last tokens are ``tail`` (None: an end-of-sequence
    token did, or there are no stop strings).  The engine stops on the token that completes a stop
    string and drops the string from the text, so the raw tail ends with it; of several, the one
    that ends last (then the longest) completed first."""
    if not stops or not tail or tail[-1] in model.tokenizer.eos_token_ids:
        return None
    text = model.tokenizer.decode(list(tail))
    found = [(text.rfind(s) + len(s), len(s), s) for s in stops if s and s in text]
    return max(found)[2] if found else None


def _may_call(plan: CompletionPlan, rounds: int) -> bool:
    """Whether the request's current segment may end in a tool call: it
    offers tools the model's calls are parsed for, and they are client
    tools or server tools with rounds left (``max_tool_rounds``)."""
    if not plan.parse_tools:
        return False
    client = any(n not in plan.server_tools for n in plan.offered_tools)
    return client or (bool(plan.server_tools) and rounds < plan.max_tool_rounds)


def cache_key_digest(owner: Optional[str], key: str) -> str:
    """The prefix key (``RequestHint.prefix_keys``) of a request's ``prompt_cache_key``:
    a digest of it under the caller's key name (None: the anonymous caller)."""
    h = hashlib.blake2b(digest_size=16, person=b"interlace-pck")
    h.update((owner or "").encode("utf-8", "surrogatepass") + b"\0" + key.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _segment_hint(app: str, owner: Optional[str], pred: SegmentPrediction) -> RequestHint:
    """The engine's hint for a segment: the predictor's figures, the caller as tenant."""
    return RequestHint(app=app, expected_output=pred.expected_output, expected_tool=pred.expected_tool,
                       expected_tool_s=pred.expected_tool_s, future=pred.future, tenant=owner)


def _tool_seconds(model: ModelServer, name: str, tool: Optional[Tool]) -> Optional[float]:
    """A call's expected time: the tool's learned time, else what the tool
    declares (``Tool.expected_s``), else None."""
    learned = model.durations.estimate(name)
    return learned if learned is not None else getattr(tool, "expected_s", None)


def _hint_call(engine: Engine, ctx: ContextId, model: ModelServer, app: str, owner: Optional[str],
               segment_start: int, segment: int, name: str, tool: Optional[Tool]) -> None:
    """The model has named a server tool: tell the engine which tool the
    coming pause waits for and how long it is expected to take (the engine
    pauses by itself at the call's end marker, before the gateway could say
    so; it learns the actual time itself), and give the ranking the
    segment's prediction with this call in it (LAMPS' call term)."""
    seconds = _tool_seconds(model, name, tool)
    engine.set_pause_hint(ctx, PauseHint(tool=name, expected_duration_s=seconds))
    pred = model.predictor.predict(app, segment_start, segment, tool=name)
    if seconds is not None:
        pred = dataclasses.replace(pred, expected_tool_s=seconds)
    engine.set_request_hint(ctx, _segment_hint(app, owner, pred))


def fit_results(tokenizer: Tokenizer, fmt: ToolFormat, texts: List[str], room: int,
                names: Optional[List[str]] = None) -> Tuple[Optional[List[int]], List[Optional[Dict[str, Any]]]]:
    """The tokens appending ``texts`` as tool results, within ``room`` tokens.

    Results that do not fit are cut to a common length with a visible marker
    (the longest ones lose the most), found by bisection on that length.
    Returns the tokens (None when not even empty results fit) and, per
    result, None or ``{"shown_chars", "total_chars"}``."""
    def render(limit: Optional[int]) -> List[int]:
        return tool_results_turn(tokenizer, fmt, _cut(texts, limit), names)

    ids = render(None)
    if len(ids) <= room:
        return ids, [None] * len(texts)
    lo, hi = 0, max(len(t) for t in texts)
    if len(render(0)) > room:
        return None, [{"shown_chars": 0, "total_chars": len(t)} for t in texts]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(render(mid)) <= room:
            lo = mid
        else:
            hi = mid - 1
    return render(lo), [{"shown_chars": lo, "total_chars": len(t)} if len(t) > lo else None for t in texts]


def _cut(texts: List[str], limit: Optional[int]) -> List[str]:
    if limit is None:
        return texts
    return [t if len(t) <= limit else
            f"{t[:limit]}\n[... truncated by the gateway: {len(t) - limit} of {len(t)} characters "
            f"omitted to fit the context]" for t in texts]


def _not_run(call: _Call, why: str) -> ServerToolResult:
    """The failed result of a call that produced none (``call.error``, else ``why``)."""
    now = time.time()
    return ServerToolResult(call.index, call.id, call.name, call.arguments, False, None, call.error or why,
                            call.started_at, None, None, now, call.runtime_call is not None
                            and bool(call.runtime_call.partial), call.aborted_early)


def _start(call: _Call, runtime: ToolRuntime, plan: CompletionPlan, calls: List[_Call], fmt: ToolFormat) -> None:
    call.events = asyncio.Queue()
    call.task = asyncio.ensure_future(_drive(call, runtime, plan, calls, fmt))


async def _drive(call: _Call, runtime: ToolRuntime, plan: CompletionPlan, calls: List[_Call], fmt: ToolFormat) -> Any:
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
                return await _execute(call, calls, fmt)
            else:  # abandon
                await rc.cancel()
                return None
    except ToolError as e:  # e.g. a veto, or a failure surfaced by field/line
        call.error = call.error or str(e)
        if rc is not None:
            await _quiet(rc.cancel())
        return None


async def _execute(call: _Call, calls: List[_Call], fmt: ToolFormat) -> Any:
    """Finish a call.  A call that uses earlier calls' results (the format
    says which: a plan step's ``$N``) first waits for them; the format then
    gives the tool its arguments, the results substituted."""
    values: Dict[int, str] = {}
    deps = fmt.depends_on(call.arguments)
    if deps:
        by_step = {fmt.step(c.arguments): c for c in calls if c is not call and fmt.step(c.arguments) is not None}
        for n in deps:
            dep = by_step.get(n)
            res = await asyncio.shield(dep.task) if dep is not None and dep.task is not None else None
            if res is None:
                call.error = f"step {fmt.reference(n)} has no result"
                return None
            values[n] = _reference_value(dep, res)
    return await call.runtime_call.finish(fmt.tool_arguments(call.arguments, call.tool.parameters, values))


def _reference_value(dep: "_Call", res: Any) -> str:
    """A finished step's result as a later step's ``$N`` reads it: the tool says how."""
    if not res.ok:
        return f"(error: {res.error})"
    return dep.tool.result_text(res.content)


async def _result(call: _Call, metrics: Optional[Metrics]) -> ServerToolResult:
    r = None
    if call.task is not None:
        if call.error and not call.task.done():
            call.events.put_nowait(("abandon",))
        r = await call.task
    if r is None:
        res = _not_run(call, "the tool call was not completed")
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
