"""Client-side tool calls as interceptions: keep a chat's context for its follow-up.

A chat completion that ends with ``finish_reason="tool_calls"`` is, from the
engine's point of view, a request intercepted by a tool -- only the tool runs
at the client, and the "resume" arrives as a new request that repeats the
whole conversation plus the tool results.  Freeing the context would make
that request prefill everything again.  Instead the context is *retained*:
kept here, keyed by the caller's API key name, and *parked* in the engine
(``engine.park``), where the interception policy preserves, swaps or discards
its KV like any paused context's, with the expected gap learned per model and
tool name (by the engine, from park to adoption).  A later request of the same caller whose prompt tokens start with
a retained context's tokens *adopts* it: only the rest of the prompt is
filled in, and the tokens not recomputed are reported as OpenAI's
``usage.prompt_tokens_details.cached_tokens`` (with the prefix cache's hits
on the rest of the prompt, which the engine reports) and counted in
``interlace_prefill_tokens_saved{mechanism="retention"}``.  Standard clients
benefit with no extension.

Tenants never adopt each other's contexts (the owner must match), a context
is adopted at most once (it leaves the store), and retained contexts are
evicted -- freed in the engine -- past ``ttl_s``, beyond ``max_contexts`` or
``max_tokens`` (least recently retained first), and at shutdown.

Matching is on token ids: the retained tokens are the prompt, the model's
reply and the end-of-turn token it generated.  With the Hermes format and a
chat template such as SmolLM2's, the follow-up renders the assistant turn
exactly as the model wrote it when the model writes the call in the format's
canonical JSON (``{"name": ..., "arguments": {...}}`` with ``", "`` and
``": "`` separators), which is what its instructions show.  A reply written
or tokenized differently (other spacing, key order, another split of the
same text) re-renders differently from some token on: the context is then
truncated to the whole blocks before that token (``engine.truncate``) and
adopted, so the prompt is still not prefilled again.
All bookkeeping runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

from ..engine_ext.errors import EngineError
from ..engine_ext.policies import ToolDurations
from ..engine_ext.protocol import PauseHint

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ..engine_ext.protocol import Engine
    from .config import RetentionSpec
    from .metrics import Metrics

log = logging.getLogger(__name__)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``
    (by bisection on slice equality: a few C-speed compares, not a Python
    loop over thousands of tokens per retained context and request)."""
    a, b = tuple(a[:max(0, limit)]), tuple(b[:max(0, limit)])
    if a == b:
        return len(a)
    lo, hi = 0, len(a)  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def client_tool(name: Optional[str]) -> str:
    """The name a client-side call's gap is learned under."""
    return f"client:{name or ''}"


@dataclass(eq=False)
class Retained:
    """One retained context: whose it is, its tokens, and the tool it waits for."""

    ctx: Any
    owner: Optional[str]        # the caller's API key name (None without authentication)
    tokens: Tuple[int, ...]
    tool: Optional[str]         # the first client-side call's name
    retained_at: float          # the store's clock
    prompt_len: int = 0         # tokens of the request's prompt (the rest is the model's reply)
    matched: int = 0            # set by claim: the tokens the follow-up shares with it


class RetentionStore:
    """The retained contexts of one served model (see the module docstring).

    ``spec`` has ``max_contexts``, ``max_tokens`` and ``ttl_s``.  ``gaps`` is
    the engine's tool-duration predictor: the engine learns the time from
    park to adoption itself (as from pause to resume), under the tool name
    ``client:<name>`` so the client's round trips never blend into the times
    of a server-side tool of the same name; the store reads it to give the
    engine its expectation when parking."""

    def __init__(self, engine: Engine, model: str, spec: RetentionSpec, metrics: Optional[Metrics] = None,
                 gaps: Optional[ToolDurations] = None, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.model = model
        self.spec = spec
        self.metrics = metrics
        self.gaps = gaps if gaps is not None else ToolDurations()
        self.clock = clock
        self.entries: "OrderedDict[Any, Retained]" = OrderedDict()  # oldest first
        self.tokens = 0
        self._sweeper: Optional[asyncio.Task] = None
        self._closed = False

    def __len__(self) -> int:
        return len(self.entries)

    # ------------------------------------------------------------ adoption
    def claim(self, owner: Optional[str], prompt_ids: Sequence[int]) -> Optional[Retained]:
        """Take out the caller's retained context that shares the longest
        prefix with ``prompt_ids`` (None if there is none) and set its
        ``matched`` tokens.  A context matches when the prompt starts with
        all of its tokens, or with all of its own prompt's and then part of
        the reply (the client rendered the reply differently from some
        token on: the caller truncates the context to ``matched``).  At
        least one prompt token is always left to fill.  The caller then
        owns the context: it fills the rest of the prompt into it, or frees it."""
        self.expire()
        best: Optional[Retained] = None
        n = len(prompt_ids)
        for e in self.entries.values():
            if e.owner != owner:
                continue
            k = _common_prefix(e.tokens, prompt_ids, min(len(e.tokens), n - 1))
            if (k == len(e.tokens) or 0 < e.prompt_len <= k) and k > (best.matched if best else 0):
                best, e.matched = e, k
        self._drop_stale(owner, prompt_ids, best)
        if best is None:
            if self.metrics is not None:
                self.metrics.retention_lookup(self.model, hit=False)
            return None
        self._remove(best)
        if self.metrics is not None:
            self.metrics.retention_lookup(self.model, hit=True)
        return best

    def _drop_stale(self, owner: Optional[str], prompt_ids: Sequence[int], chosen: Optional[Retained]) -> None:
        """Another retained context of this conversation (its whole prompt
        repeated, then a different reply) that the follow-up did not adopt
        can never be adopted later: free it now rather than at its TTL.
        Its full blocks stay in the engine's prefix cache."""
        for e in [e for e in self.entries.values() if e is not chosen and e.owner == owner
                  and 0 < e.prompt_len < len(prompt_ids)]:
            k = _common_prefix(e.tokens, prompt_ids, min(len(e.tokens), len(prompt_ids)))
            if e.prompt_len <= k < len(e.tokens):
                log.debug("retained context %r: the follow-up differs from the reply at token %d of %d",
                          e.ctx, k - e.prompt_len, len(e.tokens) - e.prompt_len)
                self._evict(e, "mismatch")

    def adopted(self, saved_tokens: int) -> None:
        """An adoption went through: ``saved_tokens`` were not prefilled again."""
        if self.metrics is not None:
            self.metrics.prefill_saved(self.model, {"retention": saved_tokens})

    # ----------------------------------------------------------- retention
    def retain(self, owner: Optional[str], ctx: Any, tokens: Sequence[int], tool: Optional[str],
               prompt_len: int = 0) -> Optional[Retained]:
        """Take ownership of the idle context ``ctx`` for a follow-up (then
        :meth:`park` it).  None -- the caller still owns ``ctx`` and frees
        it -- when the store cannot hold it at all.  Synchronous, so a
        cancelled caller never leaves a context owned by both or neither."""
        if self._closed or len(tokens) > self.spec.max_tokens or self.spec.max_contexts < 1:
            return None
        entry = Retained(ctx, owner, tuple(tokens), tool, self.clock(), prompt_len)
        self.entries[ctx] = entry
        self.tokens += len(entry.tokens)
        self._enforce_limits()
        self._held()
        self._start_sweeper()
        return entry

    async def park(self, entry: Retained) -> None:
        """Put the retained context under the engine's interception policy,
        as a paused one, expected back after the learned gap for its tool."""
        try:
            tool = client_tool(entry.tool)
            await self.engine.park(entry.ctx, PauseHint(tool=tool, expected_duration_s=self.gaps.estimate(tool),
                                                        extra={"client_side": True, "ttl_s": self.spec.ttl_s}))
        except EngineError as e:  # the context is not usable: never keep a broken one
            log.warning("could not park retained context %r: %s", entry.ctx, e)
            if self.entries.get(entry.ctx) is entry:
                self._evict(entry, "error")

    def expire(self) -> None:
        """Evict what has outlived the TTL."""
        now = self.clock()
        for e in [e for e in self.entries.values() if now - e.retained_at >= self.spec.ttl_s]:
            self._evict(e, "ttl")

    def _enforce_limits(self) -> None:
        self.expire()
        while len(self.entries) > self.spec.max_contexts:
            self._evict(next(iter(self.entries.values())), "max_contexts")
        while self.tokens > self.spec.max_tokens:
            self._evict(next(iter(self.entries.values())), "max_tokens")

    def _remove(self, e: Retained) -> None:
        del self.entries[e.ctx]
        self.tokens -= len(e.tokens)
        self._held()

    def _held(self) -> None:
        if self.metrics is not None:
            self.metrics.retention_held(self.model, len(self.entries), self.tokens)

    def _evict(self, e: Retained, reason: str) -> None:
        self._remove(e)
        self.engine.free_context_nowait(e.ctx)
        if self.metrics is not None:
            self.metrics.retention_evicted(self.model, reason)

    # ------------------------------------------------------------ lifetime
    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        """Evict by TTL even when no request comes to do it (waking at least
        once a second, so a changed TTL takes effect)."""
        while self.entries and not self._closed:
            oldest = next(iter(self.entries.values()))
            await asyncio.sleep(min(1.0, max(0.0, oldest.retained_at + self.spec.ttl_s - self.clock()) + 0.01))
            self.expire()

    def clear(self) -> None:
        """Free every retained context now (an operator's or a test's reset)."""
        for e in list(self.entries.values()):
            self._evict(e, "cleared")

    async def close(self) -> None:
        """Free every retained context (shutdown)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        entries: List[Retained] = list(self.entries.values())
        for e in entries:
            self._remove(e)
            try:
                await self.engine.free_context(e.ctx)
            except EngineError:
                pass  # gone with the engine already
