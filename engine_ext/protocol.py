"""The engine protocol: Fill / Generate / FreeContext, fork and pause / resume.

This is Parrot's "universal engine abstraction" (section 7): a context is a
named KV-cache state.  ``fill`` appends prompt tokens to it, ``generate``
appends sampled tokens to it, ``free_context`` drops it.  Passing a
``parent_context_id`` forks: the new context starts as a copy of the parent
and shares the parent's KV blocks instead of recomputing them.

``pause`` / ``resume`` is the interception hook of InferCept: a context whose
generation is waiting for a tool leaves the running batch but keeps its
identity (and, by the interception policy's choice, its KV); ``resume``
appends the tool's output and decoding continues on the same stream.  The
:class:`RequestHint` given to ``fill``, ``generate``, ``resume`` and
``set_request_hint`` is what the ranking (LAMPS) knows of the segment that
starts there: its expected output, the call that ends it and the later
segments (the gateway learns them per application:
:mod:`engine_ext.policies.hints`).

The native engine, a vLLM-backed engine and the simulator implement this
protocol; the gateway only ever talks to it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import (Any, AsyncIterator, Callable, Dict, Hashable, List, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

from .errors import InvalidSampling

ContextId = Hashable

#: ``processor(generated_token_ids, logits) -> logits``, called once per decode
#: step for the request that carries it, on the engine's thread, with the
#: engine's own tensor type (a 1-D float tensor over the vocabulary).  The
#: gateway uses it for constrained decoding (grammar masks).
LogitsProcessor = Callable[[Sequence[int], Any], Any]


@dataclass
class SamplingParams:
    """How ``generate`` picks tokens and when it stops.

    ``temperature == 0`` means greedy.  ``seed`` makes sampling reproducible
    per request whatever else is in the batch.  ``stop`` strings are matched on
    the detokenized text and are not included in it; ``stop_token_ids`` and the
    model's EOS ids end generation and are included in the context (not in
    the text).  ``pause_on`` strings pause the context (as :meth:`Engine.pause`
    would) right after the token that completes one, so no token is decoded
    past a tool call's end.  ``skip_special_tokens`` (as in vLLM) leaves the
    text of special tokens out of the stream; set it False when a parser must
    see them (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``).  The
    EOS or stop token that ends generation is never part of the text.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    logits_processors: Sequence[LogitsProcessor] = ()
    pause_on: Sequence[str] = ()
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if isinstance(self.pause_on, str):
            self.pause_on = (self.pause_on,)
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSampling(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidSampling(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSampling(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidSampling(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if any((not isinstance(s, str)) or s == "" for s in list(self.stop) + list(self.pause_on)):
            raise InvalidSampling("stop and pause_on strings must be non-empty strings")
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidSampling(f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TokenEvent:
    """One step of a ``generate`` stream.

    ``text`` is the printable text this token adds (may be empty while a
    multi-byte character or a possible stop string is held back).  The last
    event of a stream has ``finish_reason`` set: ``"stop"`` (EOS, stop token or
    stop string), ``"length"`` (max_tokens or context limit) or ``"abort"``.
    An event with ``paused=True`` says the context has just been paused (its
    token, if any, is the one that completed a ``pause_on`` string); the stream
    continues after :meth:`Engine.resume`.

    ``cached_tokens`` is set on the first event of a stream, on each paused
    event and on the last (None on the others): the context's prompt tokens
    whose KV the engine found already computed instead of computing them,
    by mechanism (``"prefix_cache"``: blocks another context computed;
    ``"fork"``: the parent's KV a fork started with), counted from the
    context's creation or the end of its previous generation, whichever is
    later (so the fills before a ``generate`` count toward it), each token
    at most once (KV recomputed after a preemption or a discard is not a
    saving).  Tokens a context computed itself in an earlier request are
    not counted here: :meth:`Engine.computed_tokens` gives them (the
    gateway adds them for an adopted context).  An engine whose backend
    reports its prefix-cache hits only at a request's end (an OpenAI
    server) reports them on the last event; the latest value is the one
    that counts.
    """

    token_id: Optional[int]
    text: str
    logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    paused: bool = False
    cached_tokens: Optional[Dict[str, int]] = field(default=None, hash=False)


@dataclass(frozen=True)
class PauseHint:
    """What the caller knows about the interception (InferCept, LAMPS).

    ``expected_duration_s`` is the predicted tool time (None if unknown);
    ``tool`` names the tool.  Policies use it to choose preserve / discard / swap.
    """

    tool: Optional[str] = None
    expected_duration_s: Optional[float] = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RequestHint:
    """What the caller predicts of a ``generate`` request, for the ranking
    (LAMPS): ``expected_output`` tokens before the next tool call or the end,
    the ``expected_tool`` that call makes and its ``expected_tool_s``
    seconds (None: unknown / no call).  ``app`` names the application the
    prediction was learned for.  ``objective`` (``"latency"``,
    ``"throughput"`` or None) and ``task_group`` are Parrot's deduced
    scheduling preference (:mod:`engine_ext.policies.objectives`).
    ``tenant`` names whose request it is (the gateway passes the API key's
    name; None: the one anonymous caller): the engine's queue is served
    fairly across tenants (:mod:`engine_ext.policies.fairness`).
    ``future``: the segments predicted after this one, each ``(output
    tokens, seconds of the call that ends it or None, tokens the previous
    call's result adds)`` (LAMPS' job horizon; at most
    :data:`MAX_FUTURE_SEGMENTS`).  Seeds the request's ``SchedInfo``; a
    hint given to ``resume`` or ``set_request_hint`` replaces its ranking
    fields (all but ``tenant``, which stays the request's).

    ``prefix_keys``: where the prompt may share KV with other requests,
    for placement only (Parrot's FindEngine, :mod:`engine_ext.replicas`),
    never for ranking: lowercase hex digests of the prompt's prefix hashes
    at its variable boundaries (:func:`gateway.semantic.prefix_share.
    boundary_keys`), shortest prefix first, or of a chat request's
    session / cache key; at most :data:`MAX_PREFIX_KEYS`, each 1 to
    :data:`MAX_PREFIX_KEY_CHARS` characters.  Only the first fill of a
    new context needs them."""

    app: Optional[str] = None
    expected_output: Optional[int] = None
    expected_tool: Optional[str] = None
    expected_tool_s: Optional[float] = None
    objective: Optional[str] = None
    task_group: Optional[str] = None
    tenant: Optional[str] = None
    future: Tuple[Tuple[int, Optional[float], int], ...] = ()
    prefix_keys: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.future, list):  # e.g. from JSON: kept as the (hashable) tuples the field says
            object.__setattr__(self, "future", tuple(tuple(s) if isinstance(s, list) else s for s in self.future))
        if isinstance(self.prefix_keys, list):
            object.__setattr__(self, "prefix_keys", tuple(self.prefix_keys))

    def validate(self) -> None:
        self._validate_future()
        self._validate_prefix_keys()
        eo, ts = self.expected_output, self.expected_tool_s
        if eo is not None and (not isinstance(eo, int) or isinstance(eo, bool) or eo < 0):
            raise InvalidSampling(f"hint.expected_output must be a non-negative integer or None, got {eo!r}")
        if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0
                               or ts == float("inf")):
            raise InvalidSampling(f"hint.expected_tool_s must be a finite number >= 0 or None, got {ts!r}")
        if self.objective not in (None, "latency", "throughput"):
            raise InvalidSampling(f"hint.objective must be 'latency', 'throughput' or None, got {self.objective!r}")
        if self.task_group is not None and not isinstance(self.task_group, str):
            raise InvalidSampling(f"hint.task_group must be a string or None, got {self.task_group!r}")
        if self.tenant is not None and (not isinstance(self.tenant, str) or not 0 < len(self.tenant) <= 128):
            raise InvalidSampling(f"hint.tenant must be a string of 1-128 characters or None, got {self.tenant!r}")

    def _validate_future(self) -> None:
        fut = self.future
        if not isinstance(fut, (tuple, list)) or len(fut) > MAX_FUTURE_SEGMENTS:
            raise InvalidSampling(f"hint.future must be a sequence of at most {MAX_FUTURE_SEGMENTS} segments, "
                                  f"got {fut!r}"[:300])

        def count(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        for i, seg in enumerate(fut):
            ok = isinstance(seg, (tuple, list)) and len(seg) == 3
            if ok:
                out, call_s, result = seg
                ok = count(out) and count(result) and (call_s is None or (
                    isinstance(call_s, (int, float)) and not isinstance(call_s, bool) and math.isfinite(call_s)
                    and call_s >= 0))
            if not ok:
                raise InvalidSampling(f"hint.future[{i}] must be (output tokens >= 0, call seconds >= 0 or None, "
                                      f"result tokens >= 0), got {seg!r}"[:300])

    def _validate_prefix_keys(self) -> None:
        keys = self.prefix_keys
        if not isinstance(keys, (tuple, list)) or len(keys) > MAX_PREFIX_KEYS:
            raise InvalidSampling(f"hint.prefix_keys must be a sequence of at most {MAX_PREFIX_KEYS} hex digests, "
                                  f"got {keys!r}"[:300])
        for i, k in enumerate(keys):
            if not (isinstance(k, str) and 0 < len(k) <= MAX_PREFIX_KEY_CHARS and _HEX.fullmatch(k)):
                raise InvalidSampling(f"hint.prefix_keys[{i}] must be a lowercase hex string of 1-"
                                      f"{MAX_PREFIX_KEY_CHARS} characters, got {k!r}"[:300])

    def ranking(self) -> Dict[str, Any]:
        """The fields a ranking reads (every ``SchedInfo`` field a hint sets but ``tenant``;
        ``prefix_keys`` place a request, they never rank it)."""
        return {"expected_output": self.expected_output, "expected_tool": self.expected_tool,
                "expected_tool_s": self.expected_tool_s, "future": tuple(tuple(s) for s in self.future),
                "objective": self.objective, "task_group": self.task_group}


#: the most later segments a :class:`RequestHint` may carry (a job horizon, not a transcript)
MAX_FUTURE_SEGMENTS = 64
#: the most prefix keys a :class:`RequestHint` may carry (a prompt's variable boundaries; the
#: gateway keeps the shortest prefixes when a prompt has more)
MAX_PREFIX_KEYS = 64
#: the longest prefix key: a 64-byte digest in hex (BLAKE2b's largest; the gateway's are 16 bytes)
MAX_PREFIX_KEY_CHARS = 128
_HEX = re.compile(r"[0-9a-f]+")


@runtime_checkable
class Engine(Protocol):
    """Everything the gateway needs from an engine, and nothing else: the
    gateway's seams are typed with it, so a member it calls is listed here.
    The commands are coroutines (``generate`` returns an async iterator) and
    are safe to call concurrently from one event loop; the few plain methods
    say why they need not wait."""

    #: the model's tokenizer (:class:`~interlace.engine_ext.tokenizer.Tokenizer`): the gateway
    #: renders prompts and counts tokens with it
    tokenizer: Any
    #: the longest context the engine holds (prompt and generated tokens)
    max_model_len: int
    #: logits' width (the grammar masks are built for it)
    vocab_size: int

    async def fill(self, context_id: ContextId, token_ids: Sequence[int],
                   parent_context_id: Optional[ContextId] = None, hint: Optional[RequestHint] = None) -> int:
        """Create (or fork from ``parent_context_id``) or extend a context and
        compute KV for the new tokens.  Returns the context's length.  If the
        caller is cancelled, the fill is undone (safe to retry).  ``hint``
        seeds the context's ranking fields as ``generate``'s does (its
        objective and task group rank the fill's prefill chunks; its
        predictions are what the ranking sees until ``generate`` brings its
        own)."""
        ...

    def generate(self, context_id: ContextId, sampling: SamplingParams,
                 parent_context_id: Optional[ContextId] = None,
                 hint: Optional[RequestHint] = None) -> AsyncIterator[TokenEvent]:
        """Decode into the context (forking it from the parent first if
        given), yielding one :class:`TokenEvent` per token.  ``hint``: the
        caller's predictions for the ranking."""
        ...

    async def free_context(self, context_id: ContextId) -> None:
        """Release the context's KV.  Refused while it has live children."""
        ...

    async def pause(self, context_id: ContextId, hint: Optional[PauseHint] = None) -> None:
        """Take a generating context out of the running batch (interception)."""
        ...

    async def resume(self, context_id: ContextId, token_ids: Sequence[int] = (),
                     hint: Optional[RequestHint] = None) -> None:
        """Append ``token_ids`` (a tool's result) to a paused context and let
        its generation continue.  ``hint``: the caller's predictions for the
        segment this resume starts -- ``expected_output`` tokens to the next
        tool call (or the end), that call's ``expected_tool`` and
        ``expected_tool_s``, and the ``future`` segments after it -- plus the
        objective and task group; they replace the context's ranking fields
        and its cached score (the tenant stays).  None: the ranking keeps
        what it had (the first segment's prediction)."""
        ...

    def set_pause_hint(self, context_id: ContextId, hint: PauseHint) -> None:
        """Say what the coming (or current) pause of a generating context
        waits for: the engine pauses by itself on ``pause_on``, before the
        caller has parsed the call, so the tool name and its expected time
        come separately.  Non-blocking; ignored if the context is gone."""
        ...

    def set_request_hint(self, context_id: ContextId, hint: RequestHint) -> None:
        """Update every ranking field of a live context (expected output,
        tool and its time, future segments, objective, task group; not the
        tenant) and drop its cached score, e.g. when the model has named the
        tool its call goes to, or a criterion is deduced after the call
        started.  Non-blocking; ignored if the context is gone."""
        ...

    async def park(self, context_id: ContextId, hint: Optional[PauseHint] = None) -> None:
        """Put an idle context under the interception policy, as if a tool
        call intercepted it (a client-side tool call); a later fill,
        generate, fork or free of it ends the interception."""
        ...

    async def truncate(self, context_id: ContextId, num_tokens: int) -> int:
        """Cut an idle context back to its first ``num_tokens`` tokens,
        keeping what KV it can; returns the tokens whose KV is kept."""
        ...

    async def computed_tokens(self, context_id: ContextId) -> int:
        """Tokens of the context whose KV is kept (on the device or swapped
        out): what a follow-up extending it would not prefill again.  An
        engine that keeps KV in a prefix cache of whole blocks only (the
        vLLM engines: ``whole_blocks_only = True``) counts its whole blocks."""
        ...

    async def context_tokens(self, context_id: ContextId) -> List[int]:
        """The context's token ids (prompt and generated), e.g. for a
        follow-up to find how much of a new prompt the context already holds."""
        ...

    def free_context_nowait(self, context_id: ContextId) -> None:
        """:meth:`free_context` without waiting for it: for cleanup paths
        (a cancelled request, a session's end) that must not block or fail.
        Ignored if the context is gone."""
        ...

    def load_stats(self) -> Dict[str, Any]:
        """The engine's load now, read without waiting: ``kv_blocks_used``,
        ``kv_blocks_total``, ``queued_tokens``, ``running``, ``waiting`` and
        ``contexts`` (metrics, replica routing)."""
        ...

    def close(self) -> None:
        """Stop the engine and release what it holds (threads, processes,
        device memory); commands after it raise ``EngineClosed``."""
        ...
