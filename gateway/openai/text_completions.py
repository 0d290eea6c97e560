"""OpenAI's legacy text completions, ``POST /v1/completions``: a raw prompt
continued, what load generators (``vllm bench serve``'s ``openai`` backend)
and the official client's ``completions.create`` send.

The same engine loop as chat completions (completions.run_completion, with no
tool parsing and no server-side tools), the same sampling settings and limits
(gateway/sampling.py), the same first checks of a body (wire.check_fields /
wire.check_schema), the same byte bound before tokenizing
(gateway/prompt.py), the same per-key limits (gateway/key_limits.py counts
this path with chat's), the same streaming plumbing (streaming.py: an error
up to the first event is an HTTP error, a client that leaves frees the
context).  What differs is the prompt and the answer's shape.

Decisions:

* The prompt is raw text: no chat template.  Text is tokenized as vLLM's
  completions endpoint does (the tokenizer's own special tokens added, e.g.
  a BOS; special-token text such as ``<|im_start|>`` read as that token): the
  whole prompt is the client's, there is no template around it to break out
  of, and a client writing its own chat transcript gets the tokens it wrote.
  Token ids are taken as given, each checked against the model's vocabulary.
* One prompt per request.  OpenAI and vLLM take a batch of prompts and answer
  a choice per prompt; a batch is refused (400 naming ``prompt``) rather than
  merged into one stream here: a client sends one request per prompt, and each
  request is then a context of its own that the engine batches anyway.
* ``max_tokens`` defaults to OpenAI's 16 (or ``server.default_max_tokens``
  when that is lower, or the context left when that is less).
* ``logprobs`` (OpenAI: 0 to 5 alternatives per token) is supported at 0: the
  engine reports the sampled token's log-probability, not its alternatives;
  1 to 5 is refused.  ``echo`` is supported (the prompt's text leads the
  answer) but not with ``logprobs``: that needs the prompt's log-probabilities.
* ``ignore_eos`` (vLLM's extension, which ``vllm bench serve`` sends) and
  ``top_k`` are supported; ``repetition_penalty`` (vLLM's, which it sends at
  1.0), ``n``, ``best_of``, ``presence_penalty``, ``frequency_penalty``,
  ``logit_bias`` and ``suffix`` are accepted at their neutral value only.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Tuple

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...engine_ext.errors import EngineError
from .. import http_guard as guard_
from ..errors import APIError, InvalidInput, engine_error
from ..http_guard import until_disconnected
from ..metrics import Metrics
from ..prompt import prompt_bytes_bound
from ..sampling import PROPERTIES as SAMPLING_PROPERTIES, RequestValidator, sampling_params
from . import wire as api
from .completions import CompletionPlan, Content, Finish, TokenLogprob, run_completion
from .streaming import ClosingStreamingResponse, chain, first_event, stream_error

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ..models import ModelServer

PATH = "/v1/completions"
#: OpenAI's default ``max_tokens`` for text completions.
DEFAULT_MAX_TOKENS = 16
#: The most alternatives per token OpenAI's ``logprobs`` asks for; the engine gives none (0).
MAX_LOGPROBS = 5

_TOKEN = {"type": "integer", "minimum": 0}
PROMPT = {"oneOf": [
    {"type": "string"},
    {"type": "array", "minItems": 1, "items": {"type": "string"}},
    {"type": "array", "minItems": 1, "items": _TOKEN},
    {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": _TOKEN}},
], "description": "a string, a token-id array, or an array of exactly one of either (one prompt per request)"}

COMPLETION_REQUEST_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": {"type": "string"},
        "prompt": PROMPT,
        # max_tokens, temperature, top_p, top_k, seed, stop: the limits every API surface shares
        **SAMPLING_PROPERTIES,
        "stream": {"type": ["boolean", "null"]},
        "stream_options": api.CHAT_REQUEST_SCHEMA["properties"]["stream_options"],
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
        "echo": {"type": ["boolean", "null"]},
        "ignore_eos": {"type": ["boolean", "null"], "description": "vLLM's extension: decode past EOS"},
        # accepted and ignored: it does not change what is generated
        "user": {"type": ["string", "null"]},
    },
}

#: Accepted at their neutral value only (wire.UNSUPPORTED's rule: refused otherwise, never ignored).
UNSUPPORTED = {
    **{k: api.UNSUPPORTED[k] for k in ("n", "frequency_penalty", "presence_penalty", "logit_bias")},
    "best_of": (api.number_is(1), "only best_of=1 is supported"),
    "repetition_penalty": (api.number_is(1), "repetition_penalty is not supported (only 1)"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
}

KNOWN_FIELDS = frozenset(COMPLETION_REQUEST_SCHEMA["properties"]) | frozenset(UNSUPPORTED)

_validator = RequestValidator(COMPLETION_REQUEST_SCHEMA)


def validate_completion_request(body: Any) -> Dict[str, Any]:
    """Check a parsed ``/v1/completions`` body; :class:`APIError` 400 naming the field otherwise."""
    api.check_fields(body, KNOWN_FIELDS, UNSUPPORTED)
    api.check_schema(body, _validator)
    prompt = body["prompt"]
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) and len(prompt) > 1:
        raise APIError(400, f"prompt: one prompt per request (got a batch of {len(prompt)}); send one request "
                            "per prompt", param="prompt", code="unsupported_parameter")
    if body.get("logprobs"):
        raise APIError(400, f"logprobs={body['logprobs']} is not supported: only 0 (the sampled token's "
                            "log-probability, without alternatives)", param="logprobs", code="unsupported_parameter")
    if body.get("echo") and body.get("logprobs") is not None:
        raise APIError(400, "echo with logprobs is not supported (it needs the prompt's log-probabilities)",
                       param="echo", code="unsupported_parameter")
    return body


def prompt_tokens(model: ModelServer, prompt: Any) -> Tuple[List[int], str]:
    """The prompt's token ids, and its text (what ``echo`` shows): a validated ``prompt``, one prompt."""
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    n_ctx = model.max_model_len
    if isinstance(prompt, str):
        size, bound = len(prompt.encode("utf-8", "surrogatepass")), prompt_bytes_bound(model.tokenizer, n_ctx)
        if size > bound:  # cannot fit whatever its tokens: refused before it is tokenized
            raise InvalidInput(f"this model's maximum context length is {n_ctx} tokens; the prompt is {size} bytes "
                               f"of text, more than any {n_ctx} tokens stand for ({bound} bytes)", param="prompt",
                               code="context_length_exceeded")
        ids, text = model.tokenizer.encode(prompt, add_special_tokens=True), prompt
    else:
        vocab = model.engine.vocab_size
        bad = next((i for i, t in enumerate(prompt) if t >= vocab), None)
        if bad is not None:
            raise InvalidInput(f"prompt: token id {prompt[bad]} (at {bad}) is not in the model's vocabulary of "
                               f"{vocab}", param="prompt", code="invalid_value")
        ids, text = list(prompt), ""
    if not ids:
        raise InvalidInput("prompt: the prompt is empty (no tokens)", param="prompt", code="invalid_value")
    if len(ids) >= n_ctx:
        raise InvalidInput(f"this model's maximum context length is {n_ctx} tokens; the prompt takes {len(ids)}",
                           param="prompt", code="context_length_exceeded")
    return ids, text


def build_text_plan(model: ModelServer, body: Dict[str, Any], *, default_max_tokens: int,
                    caller: Optional[str]) -> Tuple[CompletionPlan, str]:
    """The plan of a validated body, and the text ``echo`` puts before the completion ('' without echo)."""
    ids, text = prompt_tokens(model, body["prompt"])
    room = model.max_model_len - len(ids)
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and max_tokens > room:
        raise InvalidInput(f"this model's maximum context length is {model.max_model_len} tokens; the prompt "
                           f"takes {len(ids)} and max_tokens asks for {max_tokens} more", param="max_tokens",
                           code="context_length_exceeded")
    spec = {k: body.get(k) for k in SAMPLING_PROPERTIES}
    spec["max_tokens"] = max_tokens or min(DEFAULT_MAX_TOKENS, default_max_tokens, room)
    sampling = sampling_params(spec, temperature=1.0, top_p=1.0, ignore_eos=bool(body.get("ignore_eos")),
                               logprobs=body.get("logprobs") is not None)
    plan = CompletionPlan(prompt_ids=ids, sampling=sampling, parse_tools=False, parse_reasoning=False,
                          request_info={"model": model.name, "user": body.get("user"), "key": caller})
    echo = (text or model.tokenizer.decode(ids, skip_special_tokens=False)) if body.get("echo") else ""
    return plan, echo


def build_routes(gw: Any, config: Any) -> List[Route]:
    """The route, bound to the gateway ``gw`` (its models are made at start-up)."""

    def prepare(raw: bytes, caller: Any) -> Tuple[Dict[str, Any], ModelServer, CompletionPlan, str]:
        """The body checked and planned (in a worker thread: tokenizing grows with the prompt)."""
        body = validate_completion_request(api.parse_json(raw))
        model = gw.models.get(body["model"])
        if model is None:
            raise APIError(404, f"the model {body['model']!r} does not exist (available: {', '.join(gw.models)})",
                           param="model", code="model_not_found")
        plan, echo = build_text_plan(model, body, default_max_tokens=config.default_max_tokens,
                                     caller=caller.name if caller else None)
        return body, model, plan, echo

    async def completions(request: Request) -> Response:
        arrived = time.perf_counter()  # the time to first token counts from here, as chat's
        caller = guard_.authenticate(config, request)
        guard_.require_json(request)
        raw = await guard_.read_body(request, config.max_request_bytes)
        body, model, plan, echo = await anyio.to_thread.run_sync(prepare, raw, caller)
        plan.arrived_at = arrived
        answer = _Answer(gw.metrics, model, plan, echo)
        events = run_completion(model, plan, None, gw.metrics)
        if not body.get("stream"):
            return JSONResponse(await until_disconnected(request, answer.collect(events)))
        try:  # an error up to the first event is still an HTTP error
            first = await until_disconnected(request, first_event(events))
        except BaseException:
            await events.aclose()
            raise
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return ClosingStreamingResponse(answer.stream(events, first, include_usage), on_close=events.aclose,
                                        media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return [Route(PATH, completions, methods=["POST"])]


class _Answer:
    """One completion's events as ``text_completion`` objects: whole (:meth:`collect`) or streamed."""

    def __init__(self, metrics: Metrics, model: ModelServer, plan: CompletionPlan, echo: str):
        self.metrics, self.model, self.echo, self.arrived = metrics, model, echo, plan.arrived_at
        self.logprobs = plan.sampling.logprobs
        self.id, self.created = "cmpl-" + uuid.uuid4().hex, api.now()
        self.offset = len(echo)  # logprobs' text_offset: where the next token starts in the answer's text
        self.first = True

    def _object(self, choices: List[Dict[str, Any]], **extra: Any) -> Dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model.name,
                "choices": choices, **extra}

    def _choice(self, text: str, tokens: List[TokenLogprob], finish: Optional[str]) -> Dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(tokens) if self.logprobs else None,
                "finish_reason": finish}

    def _logprobs(self, tokens: List[TokenLogprob]) -> Dict[str, Any]:
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t.text)
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{t.text: t.logprob} for t in tokens], "text_offset": offsets}

    def _observe(self, ev: Any) -> None:
        if self.first and isinstance(ev, Content):
            self.metrics.ttft.labels(self.model.name).observe(time.perf_counter() - self.arrived)
            self.first = False

    def _finished(self, finish: Finish) -> None:
        self.metrics.request(PATH, self.model.name, 200)
        self.metrics.usage(self.model.name, finish.usage)

    async def collect(self, events: Any) -> Dict[str, Any]:
        text: List[str] = [self.echo]
        tokens: List[TokenLogprob] = []
        finish: Optional[Finish] = None
        try:
            async with contextlib.aclosing(events):
                async for ev in events:
                    self._observe(ev)
                    if isinstance(ev, Content):
                        text.append(ev.text)
                    elif isinstance(ev, TokenLogprob):
                        tokens.append(ev)
                    elif isinstance(ev, Finish):
                        finish = ev
        except EngineError as e:
            raise engine_error(e) from e
        if finish is None:
            raise APIError(500, "the completion ended without a finish event", "server_error", code="internal_error")
        self._finished(finish)
        return self._object([self._choice("".join(text), tokens, finish.reason)], usage=finish.usage)

    async def stream(self, events: Any, first: Any, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent ``text_completion`` chunks of one completion whose first event is known; an
        error after the first byte is an error event in OpenAI's shape, then ``[DONE]`` (as chat's)."""
        pending: List[TokenLogprob] = []
        if self.echo:
            yield api.sse(self._object([self._choice(self.echo, [], None)]))
        try:
            async with contextlib.aclosing(events):
                async for ev in chain(first, events):
                    self._observe(ev)
                    if isinstance(ev, TokenLogprob):
                        pending.append(ev)
                    elif isinstance(ev, Content):
                        yield api.sse(self._object([self._choice(ev.text, pending, None)]))
                        pending = []
                    elif isinstance(ev, Finish):
                        self._finished(ev)
                        yield api.sse(self._object([self._choice("", pending, ev.reason)]))
                        if include_usage:
                            yield api.sse(self._object([], usage=ev.usage))
        except Exception as e:  # noqa: BLE001  (reported to the client, logged with its traceback)
            err = stream_error(e)
            self.metrics.request(PATH, self.model.name, err.status)
            yield api.sse(err.body())
        yield b"data: [DONE]\n\n"

