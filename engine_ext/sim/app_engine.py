"""Parrot's applications on a simulated engine: request-centric clients against Semantic Variables.

``interlace bench apps`` measures the four applications of ``apps`` on the
native engine on this CPU, where one LLM call costs 10-15x the network
delay and the targets' causes (round trips, capacity-capped batches) barely
show.  This module runs the same DAGs on an iteration-level engine priced
by a :class:`Profile` (a GPU's, by default the derived H100 roofline), with
the same clients, network and modes, so the targets can be judged at GPU
speed -- a cost model, not a measurement.

Why not ``simulator.Simulator``: it replays a trace whose requests all
exist up front (sorted arrivals, no injection while it runs), shares KV only
within one request (its prefix cache is keyed by request), and has no
capacity regulation; its interception/swap machinery has nothing to do
here.  Making it DAG-driven would have touched every part of a module whose
worked examples (LAMPS' Figure 3) its tests pin.  This engine is small and
keeps the rules that matter, the same ones: ``Profile.t_fwd(batched tokens,
attended context tokens)`` per iteration, continuous batching decode-first
with chunked prefill under ``max_batched_tokens``, paged KV in blocks of
``block_size`` with ``kv_capacity_tokens``, head-of-line admission when
memory is short, preemption by recompute, and the policy objects themselves:
:class:`~..policies.objectives.ObjectiveRanking` around FCFS and
:class:`~..policies.capacity.CapacityPolicy` (``split`` each iteration over
the requests with work, in rank order; a request's tokens are its context
length).

The engine (:class:`AppEngine`):

* *block-hash prefix cache* (vLLM's automatic prefix caching, the native
  engine's ``prefix_caching``): a full block is keyed by the hash of every
  token up to its end (here: the pieces' identities, ``apps.Piece.key``); a
  request starting looks up its prompt's blocks in order and references the
  hits (at least one token of a generating request is computed); a block is
  cached once computed (a request admitted in the same iteration as another
  with the same prompt computes it too, as in vLLM), and a freed keyed block
  stays cached (LRU) until memory is needed;
* *forks* (Parrot's context fork, Semantic Variables only): a request may
  name a parent context; it starts once the parent is filled, references
  its full blocks and copies its partial last block (no compute), then
  continues with the cache like any request (``BlockManager.extend_prefix``);
* *capacity*: the requests with work (running, and arrived ones whose
  parent is filled) are ranked, ``CapacityPolicy.split`` gives the ones that
  may run this iteration; a request alone larger than the cap runs alone
  (``split``'s rule; without it such a request would wait for ever: Parrot's
  6,000-token system prompt under a 4,096-token baseline cap);
* the iteration takes ``t_fwd(tokens computed, context tokens the scheduled
  requests attend)``; a shared prefix is read once per request (PagedAttention's
  kernel, as the native engine; Parrot's shared-prefix kernel is not modelled).

The network and the clients (one seeded ``random.Random`` per run, seeded
as ``bench apps`` seeds it, so the i-th HTTP request of every variant draws
the same delay, uniform in ``delay``; half of it before the request reaches
the server, half after the answer left it):

* ``a-seq``: each call a ``chat/completions`` request, in program order, each
  sent when the previous answer arrived;
* ``a-par``: a stage's calls sent together, the next stage when the last
  answer of this one arrived (bench's ``asyncio.gather``);
* ``b``: Semantic Variables.  ``protocol="parrot"`` (the default; Parrot's
  client): every call of a client submitted at once (one request each,
  answered on arrival), then, when those answers arrived, its final
  variables fetched (one request each, answered when the value exists).
  ``protocol="sdk"`` mirrors ``bench apps``' SDK client request for
  request: a session, then the first stage's submits with the later
  variables' declarations, then the later submits, then the fetches, a
  blocking get re-asked after :data:`POLL_S` (the SDK's poll).  On the
  server a call enters the engine when it was submitted and its inputs are
  done -- at the iteration its last input finished, no round trip -- with
  the objective deduced from the DAG (``apps.deduce_objectives``: latency
  for the finals' producers and single-call stages, a task group for a
  parallel stage) and, with forks, the prefix context the gateway's
  ``PrefixStore`` would give it (ported: the longest piece boundary of at
  least ``min_prefix_tokens`` that has a context, or that another call
  dispatched with it wants too, or that is static; a context is filled
  once, lives while a fork does, and its blocks stay cached after).

Capacities (the issue's rule, stated in every report): the request-centric
engine treats every call alike under Parrot's baseline threshold
(:data:`BASELINE_CAP_TOKENS`, 4,096 aggregate tokens: "limited token capacity
(4096 tokens)", section 8.2), i.e. ``CapacityPolicy(latency_tokens=None,
throughput_tokens=4096)`` over requests without objective; ``*-nocap``
removes it (vLLM filling its memory, the strongest request-centric
baseline); ``b`` runs ``CapacityPolicy(latency_tokens=2048)`` (PolicySpec's
default) with the deduced objectives.  Free of torch.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..policies.capacity import DEFAULT_LATENCY_TOKENS, NO_CAPACITY, CapacityPolicy
from ..policies.costmodel import Profile
from ..policies.objectives import LATENCY, ObjectiveRanking
from ..policies.ranking import FCFS, RankingPolicy, RankState, SchedInfo
from .apps import AppDAG, Piece, SimCall, deduce_objectives

#: Parrot's baseline engine capacity for latency-sensitive requests (section 8.2), tokens
BASELINE_CAP_TOKENS = 4096
#: the latency cap of Semantic Variables' engine (PolicySpec.latency_capacity_tokens' default)
LATENCY_CAP_TOKENS = DEFAULT_LATENCY_TOKENS
#: the SDK's longest single blocking get (sdk/client.py POLL_S): a longer wait asks again
POLL_S = 30.0
PROTOCOLS = ("parrot", "sdk")

WAITING, RUNNING, KEPT, DONE = "waiting", "running", "kept", "done"


class AppSimError(RuntimeError):
    """The simulated engine cannot make progress (a request can never fit in memory)."""


# =========================================================================== the engine
class _Block:
    __slots__ = ("key", "ref")

    def __init__(self) -> None:
        self.key: Optional[int] = None
        self.ref = 1


class _Pool:
    """Paged KV blocks; with ``caching`` a block-hash index of computed full blocks (LRU when unreferenced)."""

    def __init__(self, cap_blocks: int, caching: bool):
        self.cap, self.caching = cap_blocks, caching
        self.used = 0                                   # blocks referenced by a request or a context
        self.index: Dict[int, _Block] = {}
        self.lru: "OrderedDict[int, _Block]" = OrderedDict()
        self.peak = 0

    def available(self) -> int:
        return self.cap - self.used                     # free plus evictable cached blocks

    def new(self) -> _Block:
        if self.used >= self.cap:
            raise AppSimError("out of KV blocks")       # callers check available() first
        if self.used + len(self.lru) >= self.cap:
            key, old = self.lru.popitem(last=False)
            del self.index[key]
            old.key = None
        self.used += 1
        self.peak = max(self.peak, self.used)
        return _Block()

    def ref(self, b: _Block) -> None:
        if b.ref == 0:
            del self.lru[b.key]
            self.used += 1
            self.peak = max(self.peak, self.used)
        b.ref += 1

    def release(self, b: _Block) -> None:
        b.ref -= 1
        if b.ref == 0:
            self.used -= 1
            if b.key is not None:
                self.lru[b.key] = b

    def register(self, b: _Block, key: int) -> None:
        if self.caching and b.key is None and key not in self.index:
            b.key = key
            self.index[key] = b

    def lookup(self, key: int) -> Optional[_Block]:
        return self.index.get(key) if self.caching else None


class EngineRequest:
    """A request (or a prefix context's fill, ``max_tokens == 0``) on the simulated engine."""

    __slots__ = ("id", "pieces", "prompt", "max_tokens", "arrival", "sched", "kv", "gen", "blocks", "state",
                 "parent", "on_done", "_keys", "reg", "first_token", "finish", "label")

    def __init__(self, rid: int, pieces: Sequence[Piece], max_tokens: int, arrival: float,
                 on_done: Callable[[float], None], objective: Optional[str], task_group: Optional[str],
                 parent: Optional["EngineRequest"], label: str):
        self.id = rid
        self.pieces = [(p.key, p.tokens) for p in pieces if p.tokens > 0]
        if max_tokens > 0:
            self.pieces.append((("gen", rid), max_tokens))
        self.prompt = sum(p.tokens for p in pieces)
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.sched = SchedInfo(context_len=self.prompt, expected_output=max_tokens, objective=objective,
                               task_group=task_group)
        self.kv = 0              # tokens with KV
        self.gen = 0             # tokens generated
        self.blocks: List[_Block] = []
        self.state = WAITING
        self.parent = parent
        self.on_done = on_done
        self._keys: List[int] = []
        self.reg = 0             # blocks registered in the cache so far
        self.first_token: Optional[float] = None
        self.finish: Optional[float] = None
        self.label = label

    @property
    def seq(self) -> int:
        return self.prompt + self.gen

    def key(self, i: int, bs: int) -> int:
        """The hash of every token up to the end of block ``i`` (pieces' identities and offsets)."""
        keys = self._keys
        if i < len(keys):
            return keys[i]
        # walk the pieces from the end of the last keyed block
        pos = len(keys) * bs
        h = keys[-1] if keys else 0
        starts, acc = [], 0
        for key, n in self.pieces:
            starts.append(acc)
            acc += n
        pi = 0
        while pi + 1 < len(self.pieces) and starts[pi + 1] <= pos:
            pi += 1
        while len(keys) <= i:
            end = pos + bs
            content = []
            while pos < end:
                key, n = self.pieces[pi]
                off = pos - starts[pi]
                take = min(n - off, end - pos)
                content.append((key, off, off + take))
                pos += take
                if off + take == n:
                    pi += 1
            h = hash((h, tuple(content)))
            keys.append(h)
        return keys[i]

    def __repr__(self) -> str:
        return f"<EngineRequest {self.id} {self.label} {self.state} kv={self.kv}/{self.seq}>"


@dataclass
class StepStat:
    """One iteration: what ran and the capacity in force (for tests and ``--timeline``)."""

    start: float
    seconds: float
    batched_tokens: int
    scheduled: int
    run_tokens: int            # context tokens of the requests CapacityPolicy let run
    limit: Optional[int]       # the cap in force (None: memory only)
    latency_in_run: int        # latency-critical requests among them
    other_tokens: int          # context tokens of the others (the ones the cap bounds)
    held: int                  # requests with work held back by the cap
    labels: Tuple[str, ...] = ()


class AppEngine:
    """The iteration-level engine (module doc)."""

    def __init__(self, profile: Profile, capacity: CapacityPolicy = NO_CAPACITY, *, prefix_caching: bool = True,
                 ranking: Optional[RankingPolicy] = None, timeline: bool = False):
        self.p = profile
        self.bs = profile.block_size
        self.pool = _Pool(profile.kv_capacity_tokens // self.bs, prefix_caching)
        self.capacity = capacity
        self.ranking = ranking if ranking is not None else ObjectiveRanking(FCFS())
        self.active: Dict[EngineRequest, None] = {}    # waiting or running, in arrival order
        self.it = 0
        self.last_s = profile.t_fwd(1)
        self._ids = 0
        self.timeline: Optional[List[StepStat]] = [] if timeline else None
        self.stats: Dict[str, Any] = {"prefill_tokens": 0, "decode_tokens": 0, "recomputed_tokens": 0,
                                      "cache_hit_tokens": 0, "forked_tokens": 0, "copied_tokens": 0,
                                      "iterations": 0, "preemptions": 0, "held_steps": 0, "alone_steps": 0,
                                      "max_run_tokens": 0, "requests": 0}

    # ------------------------------------------------------------------ API
    def submit(self, pieces: Sequence[Piece], max_tokens: int, now: float, on_done: Callable[[float], None], *,
               objective: Optional[str] = None, task_group: Optional[str] = None,
               parent: Optional[EngineRequest] = None, label: str = "") -> EngineRequest:
        """A request arriving at ``now``; ``on_done(t)`` when it finishes (a fill: when filled)."""
        r = EngineRequest(self._ids, pieces, max_tokens, now, on_done, objective, task_group, parent, label)
        self._ids += 1
        if parent is not None and parent.state == DONE:
            raise AppSimError(f"request {label!r}: its parent context was freed")
        if r.prompt + max_tokens > self.pool.cap * self.bs:
            raise AppSimError(f"request {label!r}: {r.prompt + max_tokens} tokens never fit in the KV cache "
                              f"({self.pool.cap * self.bs} tokens)")
        self.active[r] = None
        self.stats["requests"] += 1
        return r

    def free(self, r: EngineRequest) -> None:
        """Free a filled context (its keyed blocks stay cached)."""
        if r.state != KEPT:
            raise AppSimError(f"context {r.label!r} freed while {r.state}")
        for b in r.blocks:
            self.pool.release(b)
        r.blocks = []
        r.state = DONE

    def busy(self) -> bool:
        return bool(self.active)

    # ------------------------------------------------------------------ one iteration
    def _eligible(self, r: EngineRequest) -> bool:
        return r.parent is None or r.parent.state == KEPT or r.state == RUNNING

    def _preempt(self, v: EngineRequest) -> None:
        for b in v.blocks:
            self.pool.release(b)
        v.blocks, v.kv, v.reg = [], 0, 0
        v.state = WAITING
        self.stats["preemptions"] += 1

    def _room(self, need: int, victims: Sequence[EngineRequest], protect: EngineRequest, scheduled: set) -> bool:
        """Free ``need`` blocks by preempting (recompute) running requests from the end of ``victims``."""
        for v in reversed(victims):
            if self.pool.available() >= need:
                break
            if v is not protect and v not in scheduled and v.state == RUNNING:
                self._preempt(v)
        return self.pool.available() >= need

    def _start(self, r: EngineRequest) -> Tuple[int, int, int, int]:
        """Reference the blocks a starting request finds (parent's, then cached ones): ``(kv, forked, hit,
        copied)`` tokens; the partial block of the parent is counted in ``copied`` (a new block, no compute)."""
        bs, pool = self.bs, self.pool
        kv = forked = hit = copied = 0
        par = r.parent
        if par is not None:
            full = par.kv // bs
            for b in par.blocks[:full]:
                pool.ref(b)
                r.blocks.append(b)
            kv = forked = full * bs
        limit = (r.prompt if r.max_tokens == 0 else r.seq - 1) // bs
        i = len(r.blocks)
        while i < limit:
            b = pool.lookup(r.key(i, bs))
            if b is None:
                break
            pool.ref(b)
            r.blocks.append(b)
            i += 1
        if i * bs > kv:
            hit = i * bs - kv
            kv = i * bs
        if par is not None and par.kv > kv:
            copied = par.kv - kv
            kv = par.kv
        return kv, forked, hit, copied

    def _unstart(self, r: EngineRequest) -> None:
        for b in r.blocks:
            self.pool.release(b)
        r.blocks = []

    def iterate(self, now: float) -> Optional[float]:
        """Run one iteration at ``now``: its duration, or None if nothing can run."""
        bs, p, pool = self.bs, self.p, self.pool
        items = [r for r in self.active if self._eligible(r)]
        if not items:
            return None
        for r in items:
            r.sched.context_len = r.seq
        state = RankState(iteration=self.it, iteration_s=self.last_s,
                          batch_context_tokens=sum(r.kv for r in items if r.state == RUNNING))
        ordered = self.ranking.order(items, state)
        limit = self.capacity.limit(ordered)
        run, held = self.capacity.split(ordered, limit)
        if not run:  # one request larger than the cap: it runs alone (else it would wait for ever)
            run, held = ordered[:1], ordered[1:]
        alone = limit is not None and len(run) == 1 and run[0].sched.objective != LATENCY \
            and run[0].sched.context_len > limit
        budget = p.max_batched_tokens
        sched: List[Tuple[EngineRequest, int, bool]] = []   # (request, tokens computed from the prompt side, emits)
        scheduled: set = set()
        victims = ordered  # preemption takes the lowest-ranked running request first
        # 1. decodes
        for r in run:
            if r.state != RUNNING or r.kv < r.seq:
                continue
            if budget <= 0:
                break
            if r.kv % bs == 0:
                if not self._room(1, victims, r, scheduled):
                    self._preempt(r)
                    continue
                r.blocks.append(pool.new())
            sched.append((r, 0, True))
            scheduled.add(r)
            budget -= 1
        # 2. prefill chunks (new prompts, the rest of started ones, recomputation) in rank order
        admit = True
        new_stats = []
        for r in run:
            if budget <= 0:
                break
            if r in scheduled or r.state not in (WAITING, RUNNING):
                continue
            if r.state == WAITING:
                if not admit:
                    continue
                kv0, forked, hit, copied = self._start(r)
            else:
                kv0, forked, hit, copied = r.kv, 0, 0, 0
            pend = r.seq - kv0
            chunk = min(pend, budget)
            emit = chunk == pend and r.gen < r.max_tokens
            grow = -(-(kv0 + chunk + (1 if emit else 0)) // bs) - len(r.blocks)
            if r.state == WAITING:
                if grow > pool.available():
                    self._unstart(r)
                    admit = False  # head of line, as vLLM
                    continue
                r.state = RUNNING
                r.kv = kv0
                new_stats.append((forked, hit, copied))
            elif grow > pool.available() and not self._room(grow, victims, r, scheduled):
                continue
            for _ in range(grow):
                r.blocks.append(pool.new())
            sched.append((r, chunk, emit))
            scheduled.add(r)
            budget -= chunk
        if not sched:
            return None  # waits for memory to be freed (the caller fails if nothing else can happen)
        for forked, hit, copied in new_stats:
            self.stats["forked_tokens"] += forked
            self.stats["cache_hit_tokens"] += hit
            self.stats["copied_tokens"] += copied
        # 3. execute
        batched = ctx = 0
        for r, chunk, emit in sched:
            if chunk:
                in_prompt = max(0, min(r.kv + chunk, r.prompt) - r.kv)
                self.stats["prefill_tokens"] += in_prompt
                self.stats["recomputed_tokens"] += chunk - in_prompt
                r.kv += chunk
                batched += chunk
            else:
                batched += 1
                self.stats["decode_tokens"] += 1
            if emit:
                r.kv += 1
                r.gen += 1
            ctx += r.kv
        dt = p.t_fwd(batched, ctx)
        self.it += 1
        self.last_s = dt
        self.stats["iterations"] += 1
        run_tokens = sum(r.sched.context_len for r in run)
        self.stats["max_run_tokens"] = max(self.stats["max_run_tokens"], run_tokens)
        self.stats["held_steps"] += bool(held)
        self.stats["alone_steps"] += alone
        if self.timeline is not None:
            self.timeline.append(StepStat(now, dt, batched, len(sched), run_tokens, limit,
                                          sum(r.sched.objective == LATENCY for r in run),
                                          sum(r.sched.context_len for r in run if r.sched.objective != LATENCY),
                                          len(held),
                                          tuple(r.label for r, _, _ in sched)))
        end = now + dt
        # 4. cache the computed prompt blocks; finishes
        done = []
        for r, chunk, emit in sched:
            full = min(r.kv, r.prompt) // bs
            while r.reg < full:
                pool.register(r.blocks[r.reg], r.key(r.reg, bs))
                r.reg += 1
            if emit and r.first_token is None:
                r.first_token = end
            if r.max_tokens == 0 and r.kv >= r.prompt:
                r.state = KEPT
                done.append(r)
            elif r.gen >= r.max_tokens and r.kv >= r.seq:
                r.state = DONE
                for b in r.blocks:
                    pool.release(b)
                r.blocks = []
                done.append(r)
        for r in done:
            del self.active[r]
            r.finish = end
        for r in done:
            r.on_done(end)
        return dt


# =========================================================================== the run
class _Events:
    def __init__(self) -> None:
        self.heap: list = []
        self.n = 0

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self.n += 1
        heapq.heappush(self.heap, (t, self.n, fn))


class _Net:
    """Each request: a delay drawn when it is sent, half before the server sees it, half after its answer."""

    def __init__(self, ev: _Events, rng: random.Random, lo: float, hi: float):
        self.ev, self.rng, self.lo, self.hi = ev, rng, lo, hi
        self.requests = 0
        self.delay_s = 0.0

    def request(self, t: float, server: Callable[[float, Callable[[float], None]], None],
                reply: Callable[[float], None]) -> None:
        d = self.rng.uniform(self.lo, self.hi) if self.hi > 0 else 0.0
        self.requests += 1
        self.delay_s += d
        self.ev.at(t + d / 2, lambda ta: server(ta, lambda tans: self.ev.at(tans + d / 2, reply)))


class _PrefixEntry:
    __slots__ = ("key", "req", "tokens", "parent", "children")

    def __init__(self, key, req, tokens, parent):
        self.key, self.req, self.tokens, self.parent, self.children = key, req, tokens, parent, 0


class _PrefixStore:
    """The gateway's ``PrefixStore`` (gateway/semantic/prefix_share.py) on the simulated engine."""

    def __init__(self, engine: AppEngine, min_tokens: int):
        self.engine, self.min_tokens = engine, min_tokens
        self.entries: Dict[int, _PrefixEntry] = {}
        self.demand: Counter = Counter()
        self.filled_tokens = 0

    @staticmethod
    def keys(pieces: Sequence[Piece]) -> List[Tuple[int, int, bool]]:
        out, h, n, static = [], 0, 0, True
        for pc in pieces:
            h = hash((h, pc.key))
            n += pc.tokens
            static = static and pc.static
            out.append((h, n, static))
        return out

    def want(self, keys) -> None:
        for k, _, _ in keys:
            self.demand[k] += 1

    def unwant(self, keys) -> None:
        for k, _, _ in keys:
            self.demand[k] -= 1
            if self.demand[k] <= 0:
                del self.demand[k]

    def _worth(self, key, n, static) -> bool:
        return n >= self.min_tokens and (key in self.entries or self.demand[key] >= 2 or static)

    def acquire(self, pieces, keys, now, objective, task_group) -> Optional[_PrefixEntry]:
        # the last boundary is the whole prompt: a call always computes something of its own
        k = max((i for i, (key, n, st) in enumerate(keys[:-1]) if self._worth(key, n, st)), default=None)
        entry = self._ensure(k, pieces, keys, now, objective, task_group) if k is not None else None
        self.unwant(keys)
        if entry is not None:
            entry.children += 1
        return entry

    def _ensure(self, k, pieces, keys, now, objective, task_group) -> _PrefixEntry:
        key, n, _ = keys[k]
        entry = self.entries.get(key)
        if entry is not None:
            return entry
        j = max((i for i in range(k) if keys[i][0] in self.entries
                 or (keys[i][1] >= self.min_tokens and self.demand[keys[i][0]] > max(1, self.demand[key]))),
                default=None)
        parent = self._ensure(j, pieces, keys, now, objective, task_group) if j is not None else None
        req = self.engine.submit(pieces[:k + 1], 0, now, lambda t: None, objective=objective, task_group=task_group,
                                 parent=parent.req if parent else None, label=f"prefix{len(self.entries)}:{n}")
        entry = _PrefixEntry(key, req, n, parent)
        self.entries[key] = entry
        self.filled_tokens += n - (parent.tokens if parent else 0)
        if parent is not None:
            parent.children += 1
        return entry

    def release(self, entry: _PrefixEntry) -> None:
        entry.children -= 1
        if entry.children == 0:
            if self.entries.get(entry.key) is entry:
                del self.entries[entry.key]
            self.engine.free(entry.req)
            if entry.parent is not None:
                self.release(entry.parent)


class _Gateway:
    """Semantic Variables on the server: calls enter the engine when submitted and their inputs are done."""

    def __init__(self, app: AppDAG, engine: AppEngine, fork: bool, min_prefix_tokens: int):
        self.app, self.engine = app, engine
        self.objectives = deduce_objectives(app)
        self.store = _PrefixStore(engine, min_prefix_tokens) if fork else None
        self.submitted: set = set()
        self.dispatched: set = set()
        self.done: Dict[str, float] = {}
        self.waiters: Dict[str, List[Callable[[float], None]]] = defaultdict(list)
        self.consumers: Dict[str, List[SimCall]] = defaultdict(list)
        self.dispatch_at: Dict[str, float] = {}
        for c in app.calls:
            for v in dict.fromkeys(c.inputs):
                self.consumers[v].append(c)

    def _ready(self, c: SimCall) -> bool:
        return c.out in self.submitted and c.out not in self.dispatched and all(v in self.done for v in c.inputs)

    def submit(self, c: SimCall, t: float) -> None:
        self.submitted.add(c.out)
        self._dispatch([c], t)

    def _dispatch(self, calls: Sequence[SimCall], t: float) -> None:
        calls = [c for c in calls if self._ready(c)]
        keys = {}
        if self.store is not None:
            for c in calls:  # calls dispatched together count as demand for their common prefixes
                keys[c.out] = self.store.keys(c.pieces)
                self.store.want(keys[c.out])
        for c in calls:
            self.dispatched.add(c.out)
            self.dispatch_at[c.out] = t
            obj, group = self.objectives[c.out]
            entry = self.store.acquire(c.pieces, keys[c.out], t, obj, group) if self.store is not None else None
            self.engine.submit(c.pieces, c.max_tokens, t, lambda tf, c=c, e=entry: self._finished(c, e, tf),
                               objective=obj, task_group=group, parent=entry.req if entry else None, label=c.out)

    def _finished(self, c: SimCall, entry: Optional[_PrefixEntry], t: float) -> None:
        self.done[c.out] = t
        if entry is not None:
            self.store.release(entry)
        for respond in self.waiters.pop(c.out, []):
            respond(t)
        self._dispatch(self.consumers.get(c.out, []), t)

    def get(self, var: str, t: float, respond: Callable[[float], None], ev: _Events,
            poll_s: Optional[float], pending: Callable[[float], None]) -> None:
        """A blocking get: answered when ``var`` is done, or (``poll_s``) after that long, not done yet."""
        if var in self.done:
            respond(t)
            return
        box = [False]

        def answer(tans: float) -> None:
            if not box[0]:
                box[0] = True
                respond(tans)

        self.waiters[var].append(answer)
        if poll_s is not None:
            def timeout(tt: float) -> None:
                if not box[0]:
                    box[0] = True
                    pending(tt)
            ev.at(t + poll_s, timeout)


@dataclass(frozen=True)
class Variant:
    """A way of running an app: the client, the engine's capacity rule, its prefix cache, forks."""

    name: str
    client: str                    # "seq", "par" or "dag" (Semantic Variables)
    capacity: CapacityPolicy
    prefix_caching: bool = True
    fork: bool = False

    @property
    def semantic(self) -> bool:
        return self.client == "dag"


VARIANT_ORDER = ("a-seq", "a-par", "a-par-nocap", "a-par-nocache", "a-par-nocap-nocache", "b", "b-nofork",
                 "b-nocache")
VARIANT_ABOUT = {
    "a-seq": "request-centric, each call after the previous answer; engine capped at the baseline capacity",
    "a-par": "request-centric, a stage's calls together; engine capped at the baseline capacity",
    "a-par-nocap": "a-par on an engine without the cap (vLLM filling its memory: the strongest baseline)",
    "a-par-nocache": "a-par without the block-hash prefix cache (Parrot's baseline without sharing)",
    "a-par-nocap-nocache": "a-par with neither the cap nor the prefix cache (sharing's gain without the cap's)",
    "b": "Semantic Variables: DAG submitted up front, objectives deduced, latency cap, forks + prefix cache",
    "b-nofork": "b without forking prefix contexts (the block-hash cache alone shares prefixes)",
    "b-nocache": "b without the block-hash prefix cache (forks alone share prefixes)",
}


def make_variant(name: str, baseline_cap: Optional[int] = BASELINE_CAP_TOKENS,
                 latency_cap: Optional[int] = LATENCY_CAP_TOKENS) -> Variant:
    base = CapacityPolicy(latency_tokens=None, throughput_tokens=baseline_cap) if baseline_cap else NO_CAPACITY
    sv = CapacityPolicy(latency_tokens=latency_cap, throughput_tokens=None) if latency_cap else NO_CAPACITY
    table = {
        "a-seq": Variant("a-seq", "seq", base),
        "a-par": Variant("a-par", "par", base),
        "a-par-nocap": Variant("a-par-nocap", "par", NO_CAPACITY),
        "a-par-nocache": Variant("a-par-nocache", "par", base, prefix_caching=False),
        "a-par-nocap-nocache": Variant("a-par-nocap-nocache", "par", NO_CAPACITY, prefix_caching=False),
        "b": Variant("b", "dag", sv, fork=True),
        "b-nofork": Variant("b-nofork", "dag", sv, fork=False),
        "b-nocache": Variant("b-nocache", "dag", sv, prefix_caching=False, fork=True),
    }
    if name not in table:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANT_ORDER)}")
    return table[name]


def variants_for(app: AppDAG) -> Tuple[List[str], Dict[str, str]]:
    """The variants run for ``app`` and ``{variant: what it equals}`` for those not run (as bench apps)."""
    if app.clients > 1:  # separate clients arriving together: no program order across them
        return ["a-par", "a-par-nocap", "a-par-nocache", "a-par-nocap-nocache", "b", "b-nofork", "b-nocache"], \
            {"a-seq": "n/a: separate clients"}
    if all(len(s) == 1 for s in app.stages()):  # one call per stage: a-par is a-seq, and no cap binds alone
        return ["a-seq", "b", "b-nofork"], {"a-par": "a-seq", "a-par-nocap": "a-seq"}
    return ["a-seq", "a-par", "a-par-nocap", "b", "b-nofork"], {}


def run_variant(app: AppDAG, variant: Variant, profile: Profile, *, seed: int = 0, repeat: int = 0,
                delay: Tuple[float, float] = (0.2, 0.3), protocol: str = "parrot", min_prefix_tokens: int = 16,
                poll_s: float = POLL_S, timeline: bool = False) -> Dict[str, Any]:
    """One run of ``app`` as ``variant`` on a fresh simulated engine: the row of the table."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    lo, hi = delay
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi):
        raise ValueError(f"delay must be 0 <= lo <= hi seconds, got {delay!r}")
    eng = AppEngine(profile, variant.capacity, prefix_caching=variant.prefix_caching, timeline=timeline)
    ev = _Events()
    net = _Net(ev, random.Random(f"bench-apps:{seed}:{app.name}:{repeat}"), lo, hi)
    client_s: Dict[int, float] = {}
    arrivals: Dict[str, float] = {}   # when each call's request reached the server (b: its submit)
    done_at: Dict[str, float] = {}    # when each call finished on the engine

    def record(cid: int, t: float) -> None:
        client_s[cid] = max(client_s.get(cid, 0.0), t)

    gw: Optional[_Gateway] = None
    if not variant.semantic:
        def serve(c: SimCall, ta: float, respond: Callable[[float], None]) -> None:
            arrivals[c.out] = ta

            def finished(tf: float) -> None:
                done_at[c.out] = tf
                respond(tf)

            eng.submit(c.pieces, c.max_tokens, ta, finished, label=c.out)

        stages = app.stages()
        if variant.client == "seq":
            order = [c for st in stages for c in st]

            def send(i: int, t: float) -> None:
                c = order[i]

                def reply(tr: float) -> None:
                    record(c.client, tr)
                    if i + 1 < len(order):
                        send(i + 1, tr)

                net.request(t, lambda ta, respond: serve(c, ta, respond), reply)

            ev.at(0.0, lambda t: send(0, t))
        else:
            def stage(s: int, t: float) -> None:
                left = [len(stages[s])]

                def reply(tr: float, c: SimCall) -> None:
                    record(c.client, tr)
                    left[0] -= 1
                    if left[0] == 0 and s + 1 < len(stages):
                        stage(s + 1, tr)

                for c in stages[s]:
                    net.request(t, lambda ta, respond, c=c: serve(c, ta, respond), lambda tr, c=c: reply(tr, c))

            ev.at(0.0, lambda t: stage(0, t))
    else:
        gw = _Gateway(app, eng, variant.fork, min_prefix_tokens)
        poll = poll_s if protocol == "sdk" else None

        def submit_req(c: SimCall) -> Callable[[float, Callable[[float], None]], None]:
            def server(ta: float, respond: Callable[[float], None]) -> None:
                arrivals[c.out] = ta
                gw.submit(c, ta)
                respond(ta)
            return server

        def ack(ta: float, respond: Callable[[float], None]) -> None:  # session, declaration: answered at once
            respond(ta)

        def wave(t: float, servers: List[Callable], then: Callable[[float], None]) -> None:
            left = [len(servers)]

            def reply(tr: float) -> None:
                left[0] -= 1
                if left[0] == 0:
                    then(tr)

            for srv in servers:
                net.request(t, srv, reply)

        def fetch(cid: int, var: str, t: float) -> None:
            again = [False]

            def server(ta: float, respond: Callable[[float], None]) -> None:
                def pending(tt: float) -> None:  # the poll ran out: "not yet", and the client asks again
                    again[0] = True
                    respond(tt)
                gw.get(var, ta, respond, ev, poll, pending)

            def reply(tr: float) -> None:
                if again[0]:
                    fetch(cid, var, tr)
                else:
                    record(cid, tr)

            net.request(t, server, reply)

        def client(cid: int, t0: float) -> None:
            calls = [c for c in app.calls if c.client == cid]
            finals = [f for f in app.finals if app.call(f).client == cid]

            def fetches(t: float) -> None:
                for f in finals:
                    fetch(cid, f, t)

            if protocol == "parrot":
                wave(t0, [submit_req(c) for c in calls], fetches)
            else:
                first = min(c.stage for c in calls)
                later = [c for c in calls if c.stage != first]
                wave1 = [submit_req(c) for c in calls if c.stage == first] + [ack for _ in later]

                def after_session(t: float) -> None:
                    wave(t, wave1, lambda t1: wave(t1, [submit_req(c) for c in later], fetches) if later
                         else fetches(t1))

                wave(t0, [ack], after_session)

        def start(t: float) -> None:
            for cid in range(app.clients):
                client(cid, t)

        ev.at(0.0, start)

    # the loop: client/network events by their own times, engine iterations in between
    now = 0.0
    while True:
        while ev.heap and ev.heap[0][0] <= now:
            t, _, fn = heapq.heappop(ev.heap)
            fn(t)
        dt = eng.iterate(now) if eng.busy() else None
        if dt is not None:
            now += dt
            continue
        if ev.heap:
            now = max(now, ev.heap[0][0])
            continue
        break
    if eng.busy():
        raise AppSimError(f"{app.name} {variant.name}: {len(eng.active)} requests never ran")
    if len(client_s) != app.clients:
        raise AppSimError(f"{app.name} {variant.name}: {app.clients - len(client_s)} clients got no answer")
    e2e = max(client_s.values())
    st = eng.stats
    row = {"app": app.name, "variant": variant.name, "repeat": repeat, "e2e_s": e2e,
           "prefill_tokens": st["prefill_tokens"], "decode_tokens": st["decode_tokens"],
           "recomputed_tokens": st["recomputed_tokens"], "cache_hit_tokens": st["cache_hit_tokens"],
           "forked_tokens": st["forked_tokens"], "peak_blocks": eng.pool.peak,
           "output_tokens": sum(c.max_tokens for c in app.calls), "prompt_tokens": sum(c.prompt_tokens for c in app.calls),
           "calls": len(app.calls), "calls_per_s": len(app.calls) / e2e if e2e > 0 else None,
           "http_requests": net.requests, "network_s_sum": net.delay_s,
           "client_mean_s": statistics.fmean(client_s.values()), "iterations": st["iterations"],
           "preemptions": st["preemptions"], "held_steps": st["held_steps"], "alone_steps": st["alone_steps"],
           "max_run_tokens": st["max_run_tokens"], "arrivals": arrivals}
    row["done_at"] = dict(gw.done) if gw is not None else done_at
    if gw is not None:
        row["dispatch_at"] = dict(gw.dispatch_at)
        if gw.store is not None:
            row["prefix_filled_tokens"] = gw.store.filled_tokens
    if timeline:
        row["timeline"] = eng.timeline
    return row


__all__ = ["AppEngine", "AppSimError", "BASELINE_CAP_TOKENS", "EngineRequest", "LATENCY_CAP_TOKENS", "POLL_S",
           "PROTOCOLS", "StepStat", "VARIANT_ABOUT", "VARIANT_ORDER", "Variant", "make_variant", "run_variant",
           "variants_for"]
