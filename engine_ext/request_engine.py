"""The engine protocol over an engine that only knows *requests* (vLLM's
``AsyncLLM`` in process, or an OpenAI-compatible server over HTTP).

Contexts are kept here: a token list per context id, its parent and
children, and the generation running in it.  Every fill, decode and resume
is a request over the context's whole token list, and the backend's
automatic prefix cache finds the KV an earlier request computed.  Text is
Interlace's: this class detokenizes with the model's tokenizer and applies
the native engine's per-token rules (EOS, stop strings held back,
``pause_on``, max_tokens), so streams read the same on every engine.  A
pause ends the backend request (Discard with prefix reuse); ``resume``
starts a new one over context + tool result.  Subclasses say how to open a
request stream (:meth:`RequestEngine._open`), how to pass a grammar and how
to shut down.

Threading.  ``AsyncLLM`` binds its output handler to the event loop it
first runs in, while the gateway, tests and benchmarks may call an engine
from several loops (one per ``asyncio.run``).  So, like the native engine's
thread, this engine owns one loop in a thread of its own: every context
lives there, public coroutines hand their work to it
(``run_coroutine_threadsafe``) and streams come back through the caller's
loop.  That also makes every state change single-threaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, Hashable, List, Optional, Sequence, Set

from . import errors as E
from .channel import Channel
from .protocol import PauseHint, RequestHint, SamplingParams, TokenEvent
from .stream_text import token_text

log = logging.getLogger(__name__)

_ids = itertools.count()


def _unavailable(msg: str) -> E.EngineError:
    cls = getattr(E, "EngineUnavailable", E.EngineClosed)
    return cls(msg)


def _keep_tenant(hint: RequestHint, old: Optional[RequestHint]) -> RequestHint:
    """``hint`` with the tenant the context's request already had (a resume or
    a hint update replaces the ranking fields, not whose request it is)."""
    return dataclasses.replace(hint, tenant=old.tenant) if old is not None else hint


@dataclass(eq=False)
class _Gen:
    """One ``generate`` stream: its sampling, text state and the vLLM request
    decoding it now (a new one after every resume)."""

    sampling: SamplingParams
    emit: Any                              # thread-safe: a TokenEvent or an exception to the consumer
    detok: Any
    hint: Optional[RequestHint]
    generated: List[int] = field(default_factory=list)
    held: str = ""
    tail: str = ""
    paused: bool = False
    done: bool = False
    task: Optional[asyncio.Task] = None    # the segment decoding now (None while paused)
    pause_hint: Optional[PauseHint] = None
    grammar: Any = None                    # the backend's form of the gateway's grammar processor
    resumed_len: int = 0                   # a resumed stream: the paused context's length (recompute counting)


@dataclass(eq=False)
class _Context:
    id: Hashable
    token_ids: List[int]
    parent: Optional["_Context"] = None
    children: Set["_Context"] = field(default_factory=set)
    computed: int = 0                      # tokens a vLLM request has computed KV for (prefix-cache candidates)
    hits: int = 0                          # tokens the backend's prefix cache served it (TokenEvent.cached_tokens)
    forked: int = 0                        # computed tokens it was forked with
    gen: Optional[_Gen] = None
    busy: int = 0                          # fills in flight
    arrival: float = field(default_factory=time.time)
    hint: Optional[RequestHint] = None
    parked: Optional[PauseHint] = None
    backend: Any = None                    # what the backend keeps for the context (vLLM: its session)
    paused_at: Optional[float] = None

    @property
    def state(self) -> str:
        if self.gen is None:
            return "idle"
        return "paused" if self.gen.paused else "generating"


@dataclass(frozen=True)
class Chunk:
    """What a backend request stream yields: the tokens decoded since the
    last chunk (with their logprobs when asked), and whether the backend
    ended the request itself (``finish_reason`` "length" or "stop").
    ``cached_tokens``: the request's prompt tokens the backend's prefix
    cache served (vLLM's ``num_cached_tokens``), where the backend says."""

    token_ids: Sequence[int]
    logprobs: Sequence[Optional[float]] = ()
    finished: bool = False
    finish_reason: Optional[str] = None
    cached_tokens: Optional[int] = None


class RequestEngine:
    """:class:`~engine_ext.protocol.Engine` over a request-level backend.

    Subclasses implement :meth:`_open` (and :meth:`_grammar`,
    :meth:`_shutdown`, :meth:`_backend_failed`) and set ``max_model_len``,
    ``vocab_size``, ``block_size`` and ``num_blocks`` once started."""

    max_model_len: int
    vocab_size: int
    block_size: int = 16
    num_blocks: int = 0
    #: KV lives in the backend's prefix cache, which keeps whole blocks only (see ``computed_tokens``)
    whole_blocks_only = True

    def __init__(self, tokenizer: Any, *, name: str, interception: Any = None):
        self.name = name
        self.tokenizer = tokenizer
        self.interception = interception
        self.contexts: Dict[Hashable, _Context] = {}
        self._closed = False
        self._dead: Optional[str] = None
        self._stats: Dict[str, Any] = {}
        #: resumes after a pause, the paused contexts' tokens, and those of them computed again
        self.resume_counts: Dict[str, int] = {"resumes": 0, "paused_context_tokens": 0,
                                              "recomputed_after_resume": 0}
        self._loop = asyncio.new_event_loop()
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run_loop, args=(started,), name=f"interlace-{name}",
                                        daemon=True)
        self._thread.start()
        started.result()

        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)

    # ================================================================ plumbing
    def _run_loop(self, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(started.set_result, None)
        self._loop.run_forever()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _check_open(self) -> None:
        if self._closed:
            raise E.EngineClosed(f"the {self.name} engine is closed")
        if self._dead is not None or self._backend_failed():
            raise _unavailable(f"the {self.name} engine is gone: {self._dead or 'its backend failed'}")

    async def _call(self, coro: Any) -> Any:
        """Run ``coro`` on the engine loop; a cancelled caller cancels it there."""
        try:
            self._check_open()
        except BaseException:
            coro.close()
            raise
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise

    async def _command(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` (no awaits) on the engine loop, in the order the
        calls were made.  A caller cancelled before it ran keeps it from
        running; one cancelled after cannot, and whatever the caller posts
        next (an abort) runs after it -- which a coroutine handed to
        ``run_coroutine_threadsafe`` does not guarantee (its cancellation
        is posted behind its first step)."""
        self._check_open()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001  (delivered to the caller)
                fut.set_exception(e)
        self._soon(run)
        return await asyncio.wrap_future(fut)

    def _post(self, fn: Any) -> None:
        if not self._closed and self._loop.is_running():
            self._soon(fn)

    def _soon(self, fn: Any) -> None:
        """Run ``fn`` on the engine loop after everything posted before it.
        A coroutine handed to ``run_coroutine_threadsafe`` takes its first
        step two hops later (a callback that creates its task, then the
        step), so plain callbacks take two hops too: a fill's first step
        (which creates the context) runs before the generate posted right
        behind it."""
        self._loop.call_soon_threadsafe(self._loop.call_soon, fn)

    @property
    def alive(self) -> bool:
        return not self._closed and self._dead is None and not self._backend_failed()

    # ================================================================ public API
    async def fill(self, context_id: Hashable, token_ids: Sequence[int],
                   parent_context_id: Optional[Hashable] = None, hint: Optional[RequestHint] = None) -> int:
        return await self._call(self._fill(context_id, list(token_ids), parent_context_id, hint))

    async def generate(self, context_id: Hashable, sampling: Optional[SamplingParams] = None,
                       parent_context_id: Optional[Hashable] = None,
                       hint: Optional[RequestHint] = None) -> AsyncIterator[TokenEvent]:
        sampling = sampling or SamplingParams()
        ch = Channel()
        emit = ch.emit  # one object: the stream's _Gen keeps it, _abort finds the stream by it
        events = ch.events(self._command(self._start, context_id, sampling, parent_context_id, hint, emit),
                           lambda: self._post(lambda: self._abort(context_id, emit)))
        async with contextlib.aclosing(events):  # a consumer that leaves early stops the decoding at once
            async for ev in events:
                yield ev

    async def free_context(self, context_id: Hashable) -> None:
        await self._call(self._free(context_id))

    def free_context_nowait(self, context_id: Hashable) -> None:
        async def free():
            with contextlib.suppress(E.EngineError):
                await self._free(context_id)
        self._post(lambda: self._loop.create_task(free()))

    async def pause(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        await self._call(self._pause_cmd(context_id, hint))

    async def resume(self, context_id: Hashable, token_ids: Sequence[int] = (),
                     hint: Optional[RequestHint] = None) -> None:
        """The backend request that continues the stream carries ``hint``
        (the predictions for the segment it starts) instead of the first
        segment's."""
        await self._call(self._resume(context_id, list(token_ids), hint))

    def set_pause_hint(self, context_id: Hashable, hint: PauseHint) -> None:
        if not isinstance(hint, PauseHint):
            raise TypeError(f"hint must be a PauseHint, got {type(hint).__name__}")

        def apply() -> None:
            ctx = self.contexts.get(context_id)
            if ctx is not None and ctx.gen is not None:
                ctx.gen.pause_hint = hint
        self._post(apply)

    def set_request_hint(self, context_id: Hashable, hint: RequestHint) -> None:
        """Replaces every ranking field the context's backend requests carry
        (not the tenant), from its next backend request on: one already
        queued keeps the hint it was submitted with (vLLM takes no update
        of a request's ``extra_args``)."""
        if not isinstance(hint, RequestHint):
            raise TypeError(f"hint must be a RequestHint, got {type(hint).__name__}")
        hint.validate()

        def apply() -> None:
            ctx = self.contexts.get(context_id)
            if ctx is not None:
                ctx.hint = _keep_tenant(hint, ctx.hint)
        self._post(apply)

    async def park(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        async def park() -> None:
            ctx = self._get(context_id)
            self._require_idle(ctx, "park")
            ctx.parked = hint or PauseHint()
        await self._call(park())

    async def truncate(self, context_id: Hashable, num_tokens: int) -> int:
        async def truncate() -> int:
            ctx = self._get(context_id)
            n = num_tokens
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(ctx.token_ids):
                raise ValueError(f"num_tokens must be an integer in [0, {len(ctx.token_ids)}], got {n!r}")
            self._require_idle(ctx, "truncate")
            ctx.parked = None
            del ctx.token_ids[n:]
            ctx.computed = self._kept(min(ctx.computed, n))
            return ctx.computed
        return await self._call(truncate())

    async def computed_tokens(self, context_id: Hashable) -> int:
        """Whole blocks of the context some backend request computed: what
        its prefix cache can give a follow-up, unless evicted since (the
        backend does not say which blocks it still holds)."""
        async def computed() -> int:
            return self._get(context_id).computed
        return await self._call(computed())

    async def context_tokens(self, context_id: Hashable) -> List[int]:
        async def tokens() -> List[int]:
            return list(self._get(context_id).token_ids)
        return await self._call(tokens())

    async def context_length(self, context_id: Hashable) -> int:
        return len(await self.context_tokens(context_id))

    def load_stats(self) -> Dict[str, Any]:
        """KV usage and queue lengths from the backend's last stats, and the
        tokens this frontend has asked for that are not decoded yet."""
        s = dict(self._stats)
        total = self.num_blocks
        queued = 0
        for ctx in list(self.contexts.values()):
            gen = ctx.gen
            if gen is not None and not gen.paused and not gen.done:
                queued += max(0, gen.sampling.max_tokens - len(gen.generated))
        return {"kv_blocks_used": int(round(s.get("kv_cache_usage", 0.0) * total)), "kv_blocks_total": total,
                "queued_tokens": queued, "running": s.get("running", 0), "waiting": s.get("waiting", 0),
                "contexts": len(self.contexts)}

    async def check_invariants(self) -> Dict[str, Any]:
        async def check() -> Dict[str, Any]:
            for c in self.contexts.values():
                assert all(ch.parent is c and self.contexts.get(ch.id) is ch for ch in c.children)
                assert c.computed <= len(c.token_ids)
                assert c.gen is None or not c.gen.done
            running = sum(1 for c in self.contexts.values() if c.gen is not None and c.gen.task is not None)
            return {"contexts": len(self.contexts), "segments_running": running}
        return await self._call(check())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            for ctx in list(self.contexts.values()):  # running streams end with "abort", as on the native engine
                gen = ctx.gen
                if gen is not None and not gen.done:
                    task, gen.task = gen.task, None
                    self._finish(ctx, gen, "abort")
                    if task is not None:
                        task.cancel()
            await self._shutdown()
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=60)
        except Exception as e:  # the engine core may be dead already: still stop our loop
            log.warning("shutting down vLLM: %s", e)
        self._stop_loop()

    def __enter__(self) -> "RequestEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ============================================================== on the loop
    def _get(self, cid: Hashable) -> _Context:
        ctx = self.contexts.get(cid)
        if ctx is None:
            raise E.ContextNotFound(cid)
        return ctx

    def _require_idle(self, ctx: _Context, what: str) -> None:
        if ctx.state != "idle" or ctx.busy:
            raise E.ContextBusy(f"context {ctx.id!r} is busy ({ctx.state}); {what} only idle contexts")

    def _check_tokens(self, tokens: List[int], allow_empty: bool) -> None:
        if not tokens and not allow_empty:
            raise E.InvalidTokens("token_ids must not be empty")
        bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise E.InvalidTokens(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]!r}")

    def _check_len(self, n: int) -> None:
        if n > self.max_model_len:
            raise E.ContextTooLong(f"context of {n} tokens exceeds the model's limit of {self.max_model_len}")

    def _new_context(self, cid: Hashable, parent_id: Optional[Hashable]) -> Optional[_Context]:
        if parent_id is None:
            return None
        if cid in self.contexts:
            raise E.ContextExists(f"context {cid!r} already exists; fork into a new id")
        return self._get(parent_id)  # a generating parent forks as it is now, as on the native engine

    def _fork(self, cid: Hashable, parent: _Context) -> _Context:
        parent.parked = None
        shared = parent.computed // self.block_size * self.block_size  # the child finds the parent's whole blocks
        child = _Context(cid, list(parent.token_ids), parent=parent, computed=shared, forked=shared)
        parent.children.add(child)
        self.contexts[cid] = child
        return child

    def _drop(self, ctx: _Context) -> None:
        if ctx.parent is not None:
            ctx.parent.children.discard(ctx)
        self.contexts.pop(ctx.id, None)
        self._forget(ctx)

    def _forget(self, ctx: _Context) -> None:
        """The context is gone: whatever the backend keeps for it goes too (vLLM's sessions)."""

    # ----------------------------------------------------------- the backend
    def _run(self, coro: Any, timeout: Optional[float] = None) -> Any:
        """Run ``coro`` on the engine loop from another thread (start-up)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _open(self, rid: str, prompt: List[int], sampling: SamplingParams, max_tokens: int,
              extra: Dict[str, Any], grammar: Any) -> AsyncIterator[Chunk]:
        """Start a request decoding up to ``max_tokens`` after ``prompt``;
        closing the returned iterator aborts it.  ``extra`` is what the
        backend's scheduler may read (the job's arrival, the RequestHint)."""
        raise NotImplementedError

    def _stream(self, ctx: _Context, rid: str, prompt: List[int], sampling: SamplingParams, max_tokens: int,
                extra: Dict[str, Any], grammar: Any) -> Any:
        """The async context manager a segment (or a fill) decodes in: a
        request over ``prompt`` whose chunks it iterates; leaving it ends the
        request (here: aborts it; vLLM's sessions keep its KV instead)."""
        return contextlib.aclosing(self._open(rid, prompt, sampling, max_tokens, extra, grammar))

    def _grammar(self, parts: Dict[str, Any]) -> Any:
        """The backend's form of a grammar given as ``{"json": schema}`` or
        ``{"grammar": lark}`` (llguidance's Lark dialect)."""
        raise E.InvalidSampling(f"the {self.name} engine cannot run grammars")

    async def _shutdown(self) -> None:
        pass

    def _backend_failed(self) -> bool:
        return False

    def _backend_error(self, e: BaseException) -> Optional[E.EngineError]:
        """A typed error for a backend exception (None: not a known kind)."""
        return None

    @staticmethod
    def _check_processors(sampling: SamplingParams) -> Optional[Any]:
        """The one logits processor of a request, if any.  A backend that
        samples by itself cannot call Python per token: a processor must
        say what it constrains as a grammar, per request it starts
        (``segment_grammar(n_generated)``: the gateway's grammars, forced
        replays)."""
        procs = list(sampling.logits_processors)
        if not procs:
            return None
        if len(procs) > 1 or not callable(getattr(procs[0], "segment_grammar", None)):
            raise E.InvalidSampling("this engine takes logits processors only as grammars (the gateway's "
                                    "constrained decoding, forced replays); arbitrary Python processors "
                                    "cannot run in it")
        return procs[0]

    def _segment_grammar(self, gen: "_Gen") -> Any:
        """The backend grammar of the request that decodes from here on."""
        proc = self._check_processors(gen.sampling)
        if proc is None:
            return None
        try:
            parts = proc.segment_grammar(len(gen.generated))
        except Exception as e:  # noqa: BLE001  (the processor's own refusal, e.g. a grammar cut by a pause)
            raise E.InvalidSampling(str(e)) from e
        return None if parts is None else self._grammar(parts)

    @staticmethod
    def _extra(ctx: "_Context", hint: Optional[RequestHint]) -> Dict[str, Any]:
        extra: Dict[str, Any] = {"arrival": ctx.arrival}
        h = ctx.hint or hint
        if h is not None:
            extra.update(h.ranking(), tenant=h.tenant)
            extra["future"] = [list(seg) for seg in h.future]  # JSON-able (vLLM's extra_args travel msgpack'd)
            if h.prefix_keys:  # placement only (replicas.py): carried along, never ranked
                extra["prefix_keys"] = list(h.prefix_keys)
        return extra

    async def _prefill(self, ctx: _Context, hint: Optional[RequestHint]) -> None:
        """Compute the context's KV with a one-token request; vLLM's prefix
        cache keeps its whole blocks for the forks and follow-ups that
        extend it (Parrot's Fill, as a prefix-cache warm-up)."""
        if self._kept(len(ctx.token_ids)) <= ctx.computed:
            return  # no whole block to compute (the cache keeps whole blocks only)
        rid = f"{self.name}-fill-{next(_ids)}"
        tokens = list(ctx.token_ids)
        counted = ctx.computed
        async with self._stream(ctx, rid, tokens, SamplingParams(max_tokens=1), 1, self._extra(ctx, hint),
                                None) as stream:
            async for chunk in stream:
                counted = self._count_hits(ctx, chunk, len(tokens), counted)
        if ctx.token_ids[:len(tokens)] == tokens:
            ctx.computed = max(ctx.computed, self._kept(len(tokens)))

    async def _fill(self, cid: Hashable, tokens: List[int], parent_id: Optional[Hashable],
                    hint: Optional[RequestHint]) -> int:
        if hint is not None:
            if not isinstance(hint, RequestHint):
                raise E.InvalidSampling(f"hint must be a RequestHint, got {type(hint).__name__}")
            hint.validate()
        ctx = self.contexts.get(cid)
        created = parent_id is not None or ctx is None
        if created:
            parent = self._new_context(cid, parent_id)
            self._check_tokens(tokens, allow_empty=parent is not None)
            self._check_len((len(parent.token_ids) if parent else 0) + len(tokens))
            ctx = self._fork(cid, parent) if parent else _Context(cid, [])
            self.contexts[cid] = ctx
        else:
            if ctx.state != "idle":
                raise E.ContextBusy(f"context {cid!r} is {ctx.state}; fill it when idle (or resume it)")
            self._check_tokens(tokens, allow_empty=True)
            self._check_len(len(ctx.token_ids) + len(tokens))
        ctx.parked = None
        if hint is not None:
            ctx.hint = hint
        start = len(ctx.token_ids)
        ctx.token_ids += tokens
        ctx.busy += 1

        def undo() -> None:  # unless something built on it meanwhile
            if self.contexts.get(cid) is ctx and ctx.gen is None and len(ctx.token_ids) == start + len(tokens):
                if created and not ctx.children:
                    self._drop(ctx)
                else:
                    del ctx.token_ids[start:]
                    ctx.computed = min(ctx.computed, start)
        try:
            await self._prefill(ctx, hint)
        except asyncio.CancelledError:  # the caller may retry
            undo()
            raise
        except Exception as e:  # a typed error leaves the engine as before the call
            undo()
            raise self._translate(e) from e
        finally:
            ctx.busy -= 1
        return len(ctx.token_ids)

    def _start(self, cid: Hashable, sampling: SamplingParams, parent_id: Optional[Hashable],
                     hint: Optional[RequestHint], emit: Any) -> _Gen:
        sampling.validate()
        if hint is not None:
            if not isinstance(hint, RequestHint):
                raise E.InvalidSampling(f"hint must be a RequestHint, got {type(hint).__name__}")
            hint.validate()
        self._check_processors(sampling)
        if parent_id is not None:
            parent = self._new_context(cid, parent_id)
            if not parent.token_ids:
                raise E.InvalidContextState(f"context {parent_id!r} is empty")
            ctx = None
        else:
            ctx = self._get(cid)
            if ctx.state != "idle":
                raise E.ContextBusy(f"context {cid!r} is already {ctx.state}")
            # a fill still in flight is fine: its tokens are in the context, and this request computes them too
            parent = None
        n = len((parent or ctx).token_ids)
        if n >= self.max_model_len:
            raise E.ContextTooLong(f"context of {n} tokens leaves no room to generate (limit {self.max_model_len})")
        from .tokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.tokenizer, (parent or ctx).token_ids, sampling.skip_special_tokens)
        gen = _Gen(sampling, emit, detok, hint)
        gen.grammar = self._segment_grammar(gen)  # refused here, before any state changes, if it cannot run
        if ctx is None:
            ctx = self._fork(cid, parent)
        ctx.parked = None
        if hint is not None:
            ctx.hint = hint
        ctx.gen = gen
        gen.task = self._loop.create_task(self._segment(ctx, gen))
        return gen

    async def _segment(self, ctx: _Context, gen: _Gen) -> None:
        """Decode with one backend request until the stream finishes or pauses."""
        sp = gen.sampling
        room = self.max_model_len - len(ctx.token_ids)
        max_tokens = min(sp.max_tokens - len(gen.generated), room)
        rid = f"{self.name}-{next(_ids)}"
        prompt = list(ctx.token_ids)
        counted = ctx.computed  # what earlier requests of this context computed is not this one's saving
        try:
            if gen.generated:  # a resumed stream: what its processor constrains from here on
                gen.grammar = self._segment_grammar(gen)
            async with self._stream(ctx, rid, prompt, sp, max_tokens, self._extra(ctx, gen.hint),
                                    gen.grammar) as stream:
                async for chunk in stream:
                    if gen.resumed_len and chunk.cached_tokens is not None:
                        # what of the paused context this request computed again (its KV was not kept)
                        rc = self.resume_counts
                        rc["resumes"] += 1
                        rc["paused_context_tokens"] += gen.resumed_len
                        rc["recomputed_after_resume"] += max(0, gen.resumed_len - int(chunk.cached_tokens))
                        gen.resumed_len = 0
                    counted = self._count_hits(ctx, chunk, len(prompt), counted)
                    ctx.computed = max(ctx.computed, self._kept(len(prompt)))
                    lps = chunk.logprobs
                    for i, tok in enumerate(chunk.token_ids):
                        lp = lps[i] if sp.logprobs and i < len(lps) else None
                        if self._on_token(ctx, gen, int(tok), lp):
                            return  # finished or paused: aclosing aborts the backend request
                    if chunk.finished and not gen.done and not gen.paused:
                        # the backend ended it (its length limit) before our own rules did
                        self._finish(ctx, gen, "length" if chunk.finish_reason == "length" else "stop")
                        return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not gen.done:
                self._fail(ctx, self._translate(e))
        finally:
            if gen.task is asyncio.current_task():
                gen.task = None
            if gen.generated:  # the tokens decoded before the last one were computed too
                ctx.computed = max(ctx.computed, self._kept(len(ctx.token_ids) - 1))

    def _kept(self, n: int) -> int:
        """Of ``n`` computed tokens, those a later request can reuse: whole
        blocks where only the backend's prefix cache keeps them."""
        return n // self.block_size * self.block_size if self.whole_blocks_only else n

    @staticmethod
    def _count_hits(ctx: _Context, chunk: Chunk, prompt_len: int, counted: int) -> int:
        """Book the prefix-cache hits a backend request reports (its chunks
        may repeat the number): only the tokens past ``counted``, which
        starts at what the context's own earlier requests computed.
        Returns the new ``counted``."""
        if chunk.cached_tokens is None:
            return counted
        c = min(int(chunk.cached_tokens), prompt_len)
        if c > counted:
            ctx.hits += c - counted
            return c
        return counted

    @staticmethod
    def _cached(ctx: _Context) -> Dict[str, int]:
        return {"prefix_cache": ctx.hits, "fork": ctx.forked}

    def _translate(self, e: BaseException) -> BaseException:
        if isinstance(e, E.EngineError):
            return e
        typed = self._backend_error(e)
        if typed is not None:
            return typed
        if self._backend_failed():
            self._dead = f"{type(e).__name__}: {e}"
            return _unavailable(f"the {self.name} engine failed: {type(e).__name__}: {e}")
        return E.EngineError(f"{self.name}: {type(e).__name__}: {e}")

    def _on_token(self, ctx: _Context, gen: _Gen, tok: int, lp: Optional[float]) -> bool:
        """The native engine's per-token rules (:mod:`engine_ext.stream_text`);
        True when this stream segment ends (finished or paused)."""
        sp = gen.sampling
        ctx.token_ids.append(tok)
        gen.generated.append(tok)
        is_eos = (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids
        text, finish, pause = token_text(gen, tok, is_eos=is_eos, at_limit=len(ctx.token_ids) >= self.max_model_len)
        if finish is not None:
            self._finish(ctx, gen, finish, TokenEvent(tok, text, lp, finish))
            return True
        if pause:
            hint, gen.pause_hint = gen.pause_hint or PauseHint(), None
            self._pause(ctx, gen, hint, TokenEvent(tok, text, lp))
            return True
        gen.emit(TokenEvent(tok, text, lp, cached_tokens=self._cached(ctx) if len(gen.generated) == 1 else None))
        return False

    def _finish(self, ctx: _Context, gen: _Gen, reason: str, event: Optional[TokenEvent] = None,
                emit: bool = True) -> None:
        gen.done = True
        if ctx.gen is gen:
            ctx.gen = None
        if gen.paused and ctx.paused_at is not None:
            self._observe_tool(ctx, gen)
        if emit:
            gen.emit(dataclasses.replace(event or TokenEvent(None, "", None, reason), cached_tokens=self._cached(ctx)))
        ctx.hits = ctx.forked = 0  # reported: the next request counts its own

    def _fail(self, ctx: _Context, err: BaseException) -> None:
        gen = ctx.gen
        if gen is None or gen.done:
            return
        gen.done = True
        ctx.gen = None
        ctx.hits = ctx.forked = 0
        if gen.task is not None and gen.task is not asyncio.current_task():
            gen.task.cancel()
        gen.emit(err)

    def _pause(self, ctx: _Context, gen: _Gen, hint: PauseHint, event: Optional[TokenEvent] = None) -> None:
        """Intercept: the backend request ends (aborted, its blocks go back
        to the pool with their prefix-cache hashes) and the stream waits."""
        gen.paused = True
        gen.pause_hint = hint
        ctx.paused_at = time.monotonic()
        ev = event or TokenEvent(None, "")
        text, gen.held = ev.text + gen.held, ""
        gen.emit(TokenEvent(ev.token_id, text, ev.logprob, None, paused=True, cached_tokens=self._cached(ctx)))

    def _observe_tool(self, ctx: _Context, gen: _Gen) -> None:
        durations = getattr(self.interception, "durations", None)
        if durations is not None and ctx.paused_at is not None:
            durations.observe((gen.pause_hint or PauseHint()).tool, time.monotonic() - ctx.paused_at)
        ctx.paused_at = None

    async def _pause_cmd(self, cid: Hashable, hint: Optional[PauseHint]) -> None:
        ctx = self._get(cid)
        gen = ctx.gen
        if gen is None or gen.paused:
            raise E.InvalidContextState(f"context {cid!r} is {ctx.state}, not generating")
        task, gen.task = gen.task, None
        self._pause(ctx, gen, hint or PauseHint())
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _resume(self, cid: Hashable, tokens: List[int], hint: Optional[RequestHint] = None) -> None:
        if hint is not None:
            if not isinstance(hint, RequestHint):
                raise E.InvalidSampling(f"hint must be a RequestHint, got {type(hint).__name__}")
            hint.validate()
        ctx = self._get(cid)
        gen = ctx.gen
        if gen is None or not gen.paused:
            raise E.InvalidContextState(f"context {cid!r} is {ctx.state}, not paused")
        self._check_tokens(tokens, allow_empty=True)
        self._check_len(len(ctx.token_ids) + len(tokens) + 1)
        self._observe_tool(ctx, gen)
        if hint is not None:  # the next segment's request carries it (_extra reads ctx.hint first)
            ctx.hint = gen.hint = _keep_tenant(hint, ctx.hint)
        gen.resumed_len = len(ctx.token_ids) - 1  # its last token was sampled, never computed (every engine)
        ctx.token_ids += tokens
        gen.paused = False
        gen.detok.reset_context(ctx.token_ids)
        gen.tail = gen.held = ""
        gen.task = self._loop.create_task(self._segment(ctx, gen))

    def _abort(self, cid: Hashable, emit: Any) -> None:
        """Stop the stream that owns ``emit``, if it still runs."""
        ctx = self.contexts.get(cid)
        gen = ctx.gen if ctx is not None else None
        if gen is None or gen.emit is not emit or gen.done:
            return
        task, gen.task = gen.task, None
        self._finish(ctx, gen, "abort", emit=False)
        if task is not None:
            task.cancel()

    async def _free(self, cid: Hashable) -> None:
        ctx = self._get(cid)
        live = [c.id for c in ctx.children]
        if live:
            raise E.ContextHasChildren(f"context {cid!r} has live forked children {live[:5]!r}; free them first")
        gen = ctx.gen
        if gen is not None:
            task, gen.task = gen.task, None
            self._finish(ctx, gen, "abort")
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._drop(ctx)
