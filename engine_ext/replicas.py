"""Several replicas of one model behind one engine (issue #11).

A :class:`ReplicaSet` implements the engine protocol over several engines of
the same model (native in-process or in a worker process, vLLM-backed,
remote): the gateway talks to it as to one engine.  Each replica keeps its
own scheduler and policies; the set only decides where a *new* context goes
and remembers it, since a context's KV lives on exactly one replica.  The
rule is Parrot's FindEngine (section 5.4, Algorithm 1: a task group first,
then a shared prefix, then the request on its own), read from the
:class:`~interlace.engine_ext.protocol.RequestHint` of the call that creates
the context (a ``fill``, or a ``generate`` that forks), first match wins;
the reason is counted per replica (``replica_states()["routed"]``,
:data:`ROUTE_REASONS`):

* a fork goes to its parent's replica ("affinity");
* a call of a task group (``hint.task_group``: the calls of one parallel
  stage, :mod:`engine_ext.policies.deduction`) goes where the group's first
  call went, if that replica lives and the call fits its capacity
  (``active_tokens`` plus the call's tokens within ``capacity_tokens``,
  when the replica reports them); a group's first call goes to the replica
  with the most capacity left (then the least loaded), so the whole group
  can run there in one batch ("group").  A member that no longer fits is
  placed by the rules below, and the group keeps its replica;
* a new context whose prompt shares a prefix with one placed before goes
  where that one went ("prefix"): first the longest of ``hint.prefix_keys``
  already seen -- the prefix hashes at a semantic call's variable
  boundaries (:func:`gateway.semantic.prefix_share.boundary_keys`), or the
  digest of a chat request's ``prompt_cache_key`` -- then its first 16, 64
  or 256 tokens (longest first).  Turns of one conversation, calls of one
  semantic session and requests sharing a system prompt land where their
  prefix is cached (Parrot: "assign them to the same LLM engine" to share
  the context by forks);
* a latency-critical call (``hint.objective == "latency"``) goes to a
  replica already running latency work whose cap still takes the call
  (``latency_running > 0`` and ``active_tokens`` plus the call's tokens
  within ``capacity_tokens``: the capacity is reduced there already, so
  adding it costs the throughput work nothing -- Parrot's example), else to
  the replica with the fewest active tokens, where reducing the capacity to
  the latency cap holds back the least throughput work ("latency");
* otherwise the least loaded replica ("load"): fewest tokens queued and
  contexts running (:func:`engine_stats`, plus what the set has sent and not
  yet seen answered), then most free KV blocks, then the first.

Prefix keys (the hint's and the token levels) and task groups are
remembered for the replica a context went to, in bounded tables (oldest
forgotten first).  The capacity figures (``capacity_tokens``,
``active_tokens``, ``latency_running``) are what the native engine's
``load_stats`` reports; an engine without them (a remote server, an older
engine) counts as fitting anything, with its queued tokens standing in for
its active ones.  Prefix affinity is not bounded by capacity, as Parrot's
is not: a call that forks a shared prefix saves its prefill wherever the
replica's queue stands, and the engine's own capacity regulation decides
when it runs.  The prefix keys never change a replica's ranking: they only
place.

A replica is *dead* once one of its calls raises
:class:`~interlace.engine_ext.errors.EngineClosed` or
:class:`~interlace.engine_ext.errors.EngineUnavailable`, or its ``alive``
property (engines that have one) is False.  It is taken out for good: new
contexts go to the others; every call for a context it held, a stream
running on it included, raises :class:`EngineUnavailable` (streams are woken
at once, never left hanging); with no replica left, new contexts raise it too.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, Hashable, Iterable, List, Optional, Sequence, Set, Tuple

from .errors import ContextExists, ContextNotFound, EngineClosed, EngineUnavailable, InvalidSampling, UnknownVariant
from .protocol import PauseHint, RequestHint, SamplingParams, TokenEvent

log = logging.getLogger(__name__)

#: The prefix lengths (tokens, block-aligned) a new context is keyed by for prefix affinity.
PREFIX_LEVELS = (16, 64, 256)
#: How often replicas with an ``alive`` property are polled while streams run on them (seconds).
HEALTH_INTERVAL_S = 0.5
#: A probe after an ``abort`` (is the replica gone?) gives up after this long: gone.
PROBE_TIMEOUT_S = 5.0

#: the load figures :meth:`ReplicaSet.load_stats` sums over the live replicas
STATS_KEYS = ("kv_blocks_used", "kv_blocks_total", "queued_tokens", "running", "waiting", "threads",
              "active_tokens", "latency_running", "capacity_held")
#: why a new context went where it went (``replica_states()["routed"]``), in the order the rules apply
ROUTE_REASONS = ("affinity", "group", "prefix", "latency", "load")


def _stat(st: Dict[str, Any], key: str, default: int = 0) -> int:
    try:
        return int(st.get(key, default) or 0)
    except (TypeError, ValueError):
        return default


def engine_stats(engine: Any) -> Optional[Dict[str, int]]:
    """An engine's load now (``kv_blocks_used``, ``kv_blocks_total``,
    ``queued_tokens``, ``running``, ``waiting``, maybe more), read without
    waiting: its :meth:`~interlace.engine_ext.protocol.Engine.load_stats`;
    None for an object without it, or whose method fails."""
    fn = getattr(engine, "load_stats", None)
    if not callable(fn):
        return None
    try:
        return dict(fn())
    except Exception:  # noqa: BLE001  (a dying engine: no numbers, not an error)
        return None


def _check_hint(hint: Any) -> None:
    """A hint the set routes by is checked first, as the engines check it."""
    if hint is None:
        return
    if not isinstance(hint, RequestHint):
        raise InvalidSampling(f"hint must be a RequestHint, got {type(hint).__name__}")
    hint.validate()


def _variants(engine: Any) -> frozenset:
    """The model variants an engine serves (``variant_names``; an engine
    without them serves only requests that name none)."""
    return getattr(engine, "variant_names", None) or frozenset()


def _has_alive(engine: Any) -> bool:
    return hasattr(engine, "alive")


def _alive(engine: Any) -> bool:
    try:
        return bool(getattr(engine, "alive", True))
    except Exception:  # noqa: BLE001
        return False


@dataclass(eq=False)
class _Replica:
    index: int
    name: str
    engine: Any
    alive: bool = True
    contexts: Set[Hashable] = field(default_factory=set)
    pending_tokens: int = 0  # tokens of fills sent to it and not answered yet
    streams: Set["_Stream"] = field(default_factory=set)
    routed: Counter = field(default_factory=Counter)  # new contexts placed here, by reason


@dataclass(eq=False)
class _Route:
    replica: _Replica
    parent: Optional[Hashable] = None
    settled: bool = False  # a call on it succeeded: the context exists on the replica
    inflight: int = 0      # calls on it under way
    children: int = 0      # forks of it the set knows of


@dataclass(eq=False)
class _Stream:
    """A generate stream on a replica: the task waiting in it, to wake it
    if the replica dies meanwhile."""

    task: Optional[asyncio.Task] = None
    waiting: bool = False  # the task is suspended in the replica's stream
    killed: bool = False   # the replica is gone
    woken: bool = False    # the set cancelled the task to wake it (and takes that cancellation back)

    def kill(self) -> None:
        self.killed = True
        task = self.task
        if task is None or task.done():
            return

        def wake() -> None:
            if self.waiting and not self.woken and not task.done():
                self.woken = True
                task.cancel(msg=_KILL)
        try:
            same_loop = asyncio.get_running_loop() is task.get_loop()
        except RuntimeError:
            same_loop = False
        if same_loop:
            wake()
        else:  # marked dead from another thread
            task.get_loop().call_soon_threadsafe(wake)


_KILL = "interlace: replica gone"


class ReplicaSet:
    """One engine over ``engines``, replicas of the same model (same
    tokenizer and vocabulary).  ``names`` label them in metrics and logs
    (default ``"0"``, ``"1"``, ...).  Attributes the gateway reads
    (``tokenizer``, ``vocab_size``, ``name``, ``interception``) are the
    first replica's; ``max_model_len`` is the smallest."""

    def __init__(self, engines: Sequence[Any], names: Optional[Sequence[str]] = None, *,
                 prefix_levels: Iterable[int] = PREFIX_LEVELS, max_prefixes: int = 65536,
                 max_gone: int = 65536, max_groups: int = 4096):
        engines = list(engines)
        if not engines:
            raise ValueError("a ReplicaSet needs at least one engine")
        names = [str(i) for i in range(len(engines))] if names is None else [str(n) for n in names]
        if len(names) != len(engines) or len(set(names)) != len(names):
            raise ValueError(f"need one distinct name per replica, got {names!r}")
        self.replicas = [_Replica(i, n, e) for i, (n, e) in enumerate(zip(names, engines))]
        first = engines[0]
        self.tokenizer = getattr(first, "tokenizer", None)
        self.vocab_size = getattr(first, "vocab_size", None)
        self.max_model_len = min(e.max_model_len for e in engines)
        self.name = getattr(first, "name", "model")
        self.interception = getattr(first, "interception", None)
        self.prefix_levels = tuple(sorted(set(int(n) for n in prefix_levels)))
        self.max_prefixes, self.max_gone, self.max_groups = max_prefixes, max_gone, max_groups
        self._routes: Dict[Hashable, _Route] = {}
        self._gone: "OrderedDict[Hashable, str]" = OrderedDict()  # contexts of dead replicas -> replica
        # prefix keys -> replica: bytes of the token levels, str of the hints' keys (never equal)
        self._prefixes: "OrderedDict[Any, _Replica]" = OrderedDict()
        self._groups: "OrderedDict[Tuple[Optional[str], str], _Replica]" = OrderedDict()  # (variant, group)
        self._closed = False
        self._monitor: Optional[asyncio.Task] = None

    # ============================================================ the protocol
    async def fill(self, context_id: Hashable, token_ids: Sequence[int],
                   parent_context_id: Optional[Hashable] = None, hint: Optional[RequestHint] = None,
                   variant: Optional[str] = None) -> int:
        """A new context whose replica turns out to be gone at this very call
        is placed again on another (nothing of it was anywhere yet).  A new
        context of a model ``variant`` (BlockLLM) goes to a replica that
        holds that variant's blocks."""
        token_ids = list(token_ids)
        _check_hint(hint)  # before it places anything (its prefix keys are remembered)
        extra = {"variant": variant} if variant is not None else {}
        for _ in self.replicas:
            route, created = self._route(context_id, parent_context_id, token_ids, variant, hint)
            r = route.replica
            route.inflight += 1
            r.pending_tokens += len(token_ids)
            ok = False
            try:
                n = await self._call(r, r.engine.fill, context_id, token_ids, parent_context_id=parent_context_id,
                                     hint=hint, **extra)
                ok = route.settled = True
                return n
            except EngineUnavailable:
                if not (created and parent_context_id is None and not r.alive and not self._closed):
                    raise
                self._gone.pop(context_id, None)  # it never was there: place it anew
            finally:
                route.inflight -= 1
                r.pending_tokens -= len(token_ids)
                if not ok and created:
                    self._undo_route(context_id, route)
        raise EngineUnavailable(f"no replica of {self.name} is available; retry later")

    async def generate(self, context_id: Hashable, sampling: Optional[SamplingParams] = None,
                       parent_context_id: Optional[Hashable] = None,
                       hint: Optional[RequestHint] = None) -> AsyncIterator[TokenEvent]:
        """The replica's stream; if the replica dies under it, the stream
        ends with :class:`EngineUnavailable` (not ``abort``)."""
        sampling = sampling or SamplingParams()
        _check_hint(hint)
        route, created = self._route(context_id, parent_context_id, None, hint=hint)
        r = route.replica
        stream = _Stream()
        route.inflight += 1
        r.streams.add(stream)
        self._ensure_monitor()
        inner = r.engine.generate(context_id, sampling, parent_context_id=parent_context_id, hint=hint)
        try:
            while True:
                if stream.killed or not self._check(r):
                    raise self._unavailable(r)
                stream.task, stream.waiting = asyncio.current_task(), True
                try:
                    ev = await inner.__anext__()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if stream.woken:  # the set's own wake-up, not the caller's cancellation
                        stream.woken = False
                        if stream.task.uncancel() == 0:
                            raise self._unavailable(r) from None
                    raise
                except (EngineClosed, EngineUnavailable) as e:
                    self._mark_dead(r, e)
                    raise self._unavailable(r) from e
                finally:
                    stream.waiting = False
                route.settled = True
                if ev.finish_reason == "abort" and not self._closed and await self._gone_now(r, context_id):
                    raise self._unavailable(r)
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            r.streams.discard(stream)
            route.inflight -= 1
            if created and not route.settled:
                self._undo_route(context_id, route)
            await inner.aclose()

    async def free_context(self, context_id: Hashable) -> None:
        route = self._existing(context_id, forget_gone=True)
        r = route.replica
        try:
            await self._call(r, r.engine.free_context, context_id)
        except ContextNotFound:
            self._unroute(context_id, route)
            raise
        self._unroute(context_id, route)

    def free_context_nowait(self, context_id: Hashable) -> None:
        """Queue the free on the context's replica without waiting; an
        unknown context (or one of a dead replica) is ignored, as the native
        engine ignores a context that is gone already."""
        route = self._routes.get(context_id)
        if route is None:
            self._gone.pop(context_id, None)
            return
        r = route.replica
        if route.children == 0:  # a parent with children is refused by the engine: it stays
            self._unroute(context_id, route)
        if r.alive:
            try:
                r.engine.free_context_nowait(context_id)
            except Exception as e:  # noqa: BLE001  (cleanup: never raises)
                if isinstance(e, (EngineClosed, EngineUnavailable)):
                    self._mark_dead(r, e)

    async def pause(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        await self._on_context(context_id, "pause", hint)

    async def resume(self, context_id: Hashable, token_ids: Sequence[int] = (),
                     hint: Optional[RequestHint] = None) -> None:
        """On the replica holding the context, with the caller's ``hint``."""
        await self._on_context(context_id, "resume", list(token_ids), hint)

    def set_pause_hint(self, context_id: Hashable, hint: PauseHint) -> None:
        if not isinstance(hint, PauseHint):
            raise TypeError(f"hint must be a PauseHint, got {type(hint).__name__}")
        self._hint(context_id, "set_pause_hint", hint)

    def set_request_hint(self, context_id: Hashable, hint: RequestHint) -> None:
        if not isinstance(hint, RequestHint):
            raise TypeError(f"hint must be a RequestHint, got {type(hint).__name__}")
        hint.validate()
        self._hint(context_id, "set_request_hint", hint)

    async def park(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        await self._on_context(context_id, "park", hint)

    async def truncate(self, context_id: Hashable, num_tokens: int) -> int:
        return await self._on_context(context_id, "truncate", num_tokens)

    async def computed_tokens(self, context_id: Hashable) -> int:
        return await self._on_context(context_id, "computed_tokens")

    async def context_tokens(self, context_id: Hashable) -> List[int]:
        return await self._on_context(context_id, "context_tokens")

    async def context_length(self, context_id: Hashable) -> int:
        return await self._on_context(context_id, "context_length")

    # ================================================================ the set
    def close(self) -> None:
        """Close every replica; later calls raise :class:`EngineClosed`."""
        self._closed = True
        for r in self.replicas:
            try:
                r.engine.close()
            except Exception:  # noqa: BLE001  (close the others anyway)
                log.exception("closing replica %s of %s failed", r.name, self.name)

    def __enter__(self) -> "ReplicaSet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether any replica may take new contexts."""
        return not self._closed and any(self._check(r) for r in self.replicas)

    def load_stats(self) -> Dict[str, int]:
        """:func:`engine_stats` summed over the live replicas (a dead one's
        KV no longer counts, in use or in all; :data:`STATS_KEYS`, the
        capacity figures included: active tokens, latency requests
        running, requests held by a cap); ``contexts`` counts the contexts
        the set routes.  ``capacity_tokens`` is the sum of the replicas'
        caps in force -- the tokens the set may run now -- when every live
        replica has one, else 0 (as on one engine: no cap but memory),
        since a replica without a cap takes what a sum would say is over."""
        out = dict.fromkeys(STATS_KEYS, 0)
        caps: List[int] = []
        for r in self.replicas:
            if self._check(r):
                st = engine_stats(r.engine) or {}
                for k in STATS_KEYS:
                    out[k] += _stat(st, k)
                caps.append(_stat(st, "capacity_tokens"))
        out["capacity_tokens"] = sum(caps) if caps and all(c > 0 for c in caps) else 0
        out["contexts"] = len(self._routes)
        return out

    def replica_states(self) -> List[Dict[str, Any]]:
        """Per replica: ``name``, ``alive``, ``contexts`` (routed to it now),
        ``stats`` (:func:`engine_stats`; None once dead) and ``routed`` (new
        contexts placed on it, by reason: :data:`ROUTE_REASONS`)."""
        out = []
        for r in self.replicas:
            alive = self._check(r)
            out.append({"name": r.name, "alive": alive, "contexts": len(r.contexts),
                        "stats": engine_stats(r.engine) if alive else None, "routed": dict(r.routed)})
        return out

    @property
    def variant_names(self) -> frozenset:
        """The model variants some replica serves."""
        return frozenset().union(*(_variants(r.engine) for r in self.replicas))

    def replica_of(self, context_id: Hashable) -> Optional[str]:
        """The name of the replica holding ``context_id`` (None: unknown)."""
        route = self._routes.get(context_id)
        return route.replica.name if route is not None else None

    async def check_invariants(self) -> Dict[str, Any]:
        """Each live replica's ``check_invariants()`` (engines that have it),
        numbers summed; the set's own books are checked too."""
        for cid, route in self._routes.items():
            assert cid in route.replica.contexts and route.replica.alive, f"{cid!r}: routing books"
        assert sum(len(r.contexts) for r in self.replicas) == len(self._routes), "routing books"
        total: Dict[str, Any] = {}
        for r in self.replicas:
            fn = getattr(r.engine, "check_invariants", None)
            if r.alive and fn is not None:
                for k, v in (await self._call(r, fn)).items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        total[k] = total.get(k, 0) + v
        return total

    # =============================================================== routing
    def _route(self, cid: Hashable, parent: Optional[Hashable], tokens: Optional[List[int]],
               variant: Optional[str] = None, hint: Optional[RequestHint] = None) -> Tuple[_Route, bool]:
        """The route of ``cid`` and whether this call creates it."""
        if self._closed:
            raise EngineClosed("the engine is closed")
        self._ensure_monitor()
        if cid in self._gone:
            raise self._unavailable_name(self._gone[cid])
        route = self._routes.get(cid)
        if route is not None:
            if parent is not None:
                raise ContextExists(f"context {cid!r} already exists; fork into a new id")
            return route, False
        if parent is not None:
            proute = self._existing(parent)
            r = proute.replica
            if not self._check(r):
                raise self._unavailable(r)
            reason = "affinity"
            proute.children += 1
            self._remember(self._hint_keys(hint, variant), r)  # the fork holds those prefixes too
        else:
            r, reason = self._place(tokens or [], variant, hint)
        route = _Route(r, parent)
        self._routes[cid] = route
        r.contexts.add(cid)
        r.routed[reason] += 1
        return route, True

    def _place(self, tokens: List[int], variant: Optional[str] = None,
               hint: Optional[RequestHint] = None) -> Tuple[_Replica, str]:
        """FindEngine (the module docstring): the replica of a new context, and why."""
        holders = self.replicas if variant is None else [r for r in self.replicas if variant in _variants(r.engine)]
        if not holders:
            raise UnknownVariant(f"no replica of {self.name} serves the model variant {variant!r}")
        live = [r for r in holders if self._check(r)]
        if not live:
            raise EngineUnavailable(f"no replica of {self.name}{'' if variant is None else ' holding ' + variant} "
                                    f"is available; retry later")
        n = len(tokens)
        stats = {r.index: engine_stats(r.engine) or {} for r in live}
        keys: List[Any] = self._prefix_keys(tokens, variant)
        hint_keys = self._hint_keys(hint, variant)
        r, reason = self._by_group(live, stats, n, hint, variant), "group"
        if r is None:
            reason = "prefix"
            for key in [*reversed(hint_keys), *reversed(keys)]:  # the hint's, then the token levels; longest first
                r = self._prefixes.get(key)
                if r is not None and r in live:
                    break
                r = None
        if r is None and hint is not None and hint.objective == "latency":
            reason = "latency"
            shared = [x for x in live if _stat(stats[x.index], "latency_running") > 0
                      and self._fits(x, stats[x.index], n, unknown=False)]
            r = min(shared or live, key=lambda x: (self._active(x, stats[x.index]), self._load(x, stats[x.index])))
        if r is None:
            reason = "load"
            r = min(live, key=lambda x: self._load(x, stats[x.index]))
        self._remember(hint_keys + keys, r)
        return r, reason

    def _by_group(self, live: List[_Replica], stats: Dict[int, Dict[str, Any]], n: int,
                  hint: Optional[RequestHint], variant: Optional[str]) -> Optional[_Replica]:
        """A task group's replica: where its first call went, if the call fits
        there (None: it does not, place it otherwise); for a group not seen
        (or whose replica is gone), the replica with the most capacity left,
        remembered."""
        if hint is None or hint.task_group is None:
            return None
        key = (variant, hint.task_group)
        r = self._groups.get(key)
        if r is not None and r in live:
            self._groups.move_to_end(key)
            return r if self._fits(r, stats[r.index], n) else None
        r = min(live, key=lambda x: (-self._room(x, stats[x.index]), self._load(x, stats[x.index])))
        self._groups[key] = r
        self._groups.move_to_end(key)
        while len(self._groups) > self.max_groups:
            self._groups.popitem(last=False)
        return r

    @staticmethod
    def _active(r: _Replica, st: Dict[str, Any]) -> int:
        """Tokens of the replica's contexts with work (its queued tokens where
        it does not say), and at least what the set sent it unanswered."""
        active = _stat(st, "active_tokens") if "active_tokens" in st else _stat(st, "queued_tokens")
        return max(active, r.pending_tokens)

    def _room(self, r: _Replica, st: Dict[str, Any]) -> float:
        """Tokens the replica's cap in force leaves (infinite: no cap but memory)."""
        cap = _stat(st, "capacity_tokens")
        return cap - self._active(r, st) if cap > 0 else float("inf")

    def _fits(self, r: _Replica, st: Dict[str, Any], n: int, unknown: bool = True) -> bool:
        """Whether ``n`` more tokens fit the replica's cap; ``unknown``: the
        answer for a replica that reports no cap."""
        if _stat(st, "capacity_tokens") <= 0:
            return unknown
        return self._room(r, st) >= n

    def _load(self, r: _Replica, st: Optional[Dict[str, Any]] = None) -> Tuple[int, int, int]:
        if st is None:
            st = engine_stats(r.engine) or {}
        # the fills sent and not answered are (or will soon be) among the tokens the replica has queued
        busy = max(_stat(st, "queued_tokens"), r.pending_tokens) + _stat(st, "running")
        free = _stat(st, "kv_blocks_total") - _stat(st, "kv_blocks_used")
        return busy, -free, r.index

    @staticmethod
    def _hint_keys(hint: Optional[RequestHint], variant: Optional[str] = None) -> List[str]:
        """The hint's prefix keys as keys of the prefix table (str, so never
        equal to a token level's bytes; a variant's apart, as there)."""
        keys = list(hint.prefix_keys) if hint is not None else []
        return keys if variant is None else [f"{variant}\0{k}" for k in keys]

    def _prefix_keys(self, tokens: List[int], variant: Optional[str] = None) -> List[bytes]:
        """Keys of the prefix-affinity table; a variant's KV is its own
        (``native/block_sharing.py``), so its prefixes are keyed apart."""
        keys, h, done = [], hashlib.blake2b(digest_size=16), 0
        if variant is not None:
            h.update(variant.encode() + b"\0")
        for n in self.prefix_levels:
            if len(tokens) < n:
                break
            h.update(array("q", tokens[done:n]).tobytes())
            done = n
            keys.append(h.copy().digest())
        return keys

    def _remember(self, keys: List[Any], r: _Replica) -> None:
        for key in keys:
            self._prefixes[key] = r
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.max_prefixes:
            self._prefixes.popitem(last=False)

    def _existing(self, cid: Hashable, forget_gone: bool = False) -> _Route:
        if self._closed:
            raise EngineClosed("the engine is closed")
        if cid in self._gone:
            name = self._gone.pop(cid) if forget_gone else self._gone[cid]
            raise self._unavailable_name(name)
        route = self._routes.get(cid)
        if route is None:
            raise ContextNotFound(cid)
        if not self._check(route.replica):  # it died just now: the route went with it
            raise self._unavailable(route.replica)
        return route

    def _unroute(self, cid: Hashable, route: _Route) -> None:
        if self._routes.get(cid) is not route:
            return
        del self._routes[cid]
        route.replica.contexts.discard(cid)
        if route.parent is not None:
            parent = self._routes.get(route.parent)
            if parent is not None and parent.children > 0:
                parent.children -= 1

    def _undo_route(self, cid: Hashable, route: _Route) -> None:
        """A call that would have created the context failed: forget it,
        unless another call on it got through or is under way."""
        if not route.settled and route.inflight == 0:
            self._unroute(cid, route)

    # ================================================================= calls
    async def _call(self, r: _Replica, fn: Any, *args: Any, **kw: Any) -> Any:
        if not self._check(r):
            raise self._unavailable(r)
        try:
            return await fn(*args, **kw)
        except (EngineClosed, EngineUnavailable) as e:
            if self._closed:
                raise
            self._mark_dead(r, e)
            raise self._unavailable(r) from e

    async def _on_context(self, cid: Hashable, method: str, *args: Any) -> Any:
        route = self._existing(cid)
        r = route.replica
        route.inflight += 1
        try:
            return await self._call(r, getattr(r.engine, method), cid, *args)
        finally:
            route.inflight -= 1

    def _hint(self, cid: Hashable, method: str, hint: Any) -> None:
        route = self._routes.get(cid)
        if route is None or not self._check(route.replica):
            return  # ignored if the context is gone, as on one engine
        try:
            getattr(route.replica.engine, method)(cid, hint)
        except (EngineClosed, EngineUnavailable) as e:
            self._mark_dead(route.replica, e)

    async def _gone_now(self, r: _Replica, cid: Hashable) -> bool:
        """After an ``abort`` the set did not ask for: is the replica gone
        (an engine closed under a stream ends it with ``abort``)?"""
        if not self._check(r):
            return True
        try:
            await asyncio.wait_for(r.engine.computed_tokens(cid), PROBE_TIMEOUT_S)
        except (EngineClosed, EngineUnavailable, asyncio.TimeoutError) as e:
            if self._closed:
                return False
            self._mark_dead(r, e)
            return True
        except Exception:  # noqa: BLE001  (any other answer: it is alive)
            return False
        return False

    # ================================================================ health
    def _check(self, r: _Replica) -> bool:
        """Whether ``r`` is alive (its ``alive`` property is read now)."""
        if r.alive and not _alive(r.engine):
            self._mark_dead(r, None)
        return r.alive

    def _mark_dead(self, r: _Replica, why: Optional[BaseException]) -> None:
        if not r.alive:
            return
        r.alive = False
        lost = list(r.contexts)
        log.warning("replica %s of %s is gone (%s): taken out, %d context(s) lost; %d replica(s) left", r.name,
                    self.name, f"{type(why).__name__}: {why}" if why is not None else "not alive", len(lost),
                    sum(1 for x in self.replicas if x.alive))
        for cid in lost:
            route = self._routes.get(cid)
            if route is not None:
                self._unroute(cid, route)
            self._gone[cid] = r.name
        r.contexts.clear()
        while len(self._gone) > self.max_gone:
            self._gone.popitem(last=False)
        for key in [k for k, v in self._prefixes.items() if v is r]:
            del self._prefixes[key]
        for key in [k for k, v in self._groups.items() if v is r]:
            del self._groups[key]
        for s in list(r.streams):
            s.kill()

    def _unavailable(self, r: _Replica) -> EngineUnavailable:
        return self._unavailable_name(r.name)

    def _unavailable_name(self, name: str) -> EngineUnavailable:
        return EngineUnavailable(f"replica {name} of {self.name}, which held this context, is gone; retry")

    def _ensure_monitor(self) -> None:
        """Poll the ``alive`` property of replicas that have one while the set
        is used, so a stream on a replica that died silently is woken."""
        if not any(_has_alive(r.engine) and r.alive for r in self.replicas):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._monitor is not None and not self._monitor.done() and self._monitor.get_loop() is loop:
            return
        self._monitor = loop.create_task(self._watch())

    async def _watch(self) -> None:
        while not self._closed and any(r.alive for r in self.replicas if _has_alive(r.engine)):
            for r in self.replicas:
                self._check(r)
            await asyncio.sleep(HEALTH_INTERVAL_S)
