"""A discrete-event, iteration-level simulator of a paged-KV engine serving
intercepted (tool-calling) requests, driven by the *same* policy objects as
the engines (``engine_ext.policies``) and a cost model (:class:`Profile`).

One loop turn is one engine iteration at a boundary ``now``:

1. arrivals and call returns up to ``now`` join (a resumed request with
   ``keeps_arrival = False`` ranks with arrival = resume time, as vLLM did);
2. swaps: a budgeted swap moves at most ``profile.swap_limit_tokens(last
   iteration's time)`` tokens (whole blocks; at least one) this iteration,
   the one rule of every engine: swap-outs first (they free device memory),
   then swap-ins in *original* arrival order (``arrival0``, InferCept 4.3's
   FCFS swap queue; not the re-queued arrival of a policy that resets it);
   moved blocks are freed / usable in this same iteration (InferCept pipelines the copy layer by layer
   behind the forward pass); the rest waits and holds its device memory.
   ``swap-sync`` moves everything at once and stalls the iteration by
   ``profile.t_swap(moved tokens)``.  A context the host pool can't take is
   discarded instead; a swap-in first reserves device blocks for the whole
   context (partly swapped-in contexts waiting on each other's memory would
   deadlock);
3. the batch (decode-first, like ``engine_ext/native/scheduler.py``): every
   running decode (one token each), ordered by the ranking when memory, the
   token budget (``max_batched_tokens``) or ``max_batch_requests`` binds,
   then prefill / recompute chunks in rank order.  A decode that finds no
   free block evicts prefix-cache blocks, then drops the KV of a preserved
   paused context, then preempts (recompute) the lowest-ranked unscheduled
   running request, else itself.  A waiting request (new, discarded and
   resumed, preempted) is admitted only if its chunk fits in free memory
   (``admission="greedy"``) -- or, with ``admission="peak"``, if all the
   memory it will add until its next call or its end fits -- and the first
   one that does not fit stops admission (head of line, as vLLM) --
   unless nothing else runs this iteration: then, rather than idle, it
   takes preserved paused contexts' KV (latest call first), as the native
   engine does (a paused call may never return; not with ``peak``, the
   worked example's rule, where a preserved context is kept).
   With ``rank_preempt=True`` (LAMPS' Algorithm 1 rebuilds the running
   batch from the ranked queue each iteration) the best-ranked waiting
   request that does not fit first preempts running requests ranked below
   it, lowest first, when they hold enough memory.  Rankings see C_other
   with its one meaning (``engine_ext.policies.ranking``):
   ``RankState.batch_context_tokens`` = the device KV tokens of the
   RUNNING requests (not paused, not swapping), as the native engine and
   the vLLM scheduler pass it.  ``rank_c_other="full-cache"`` passes None
   instead (LAMPS then assumes a full cache around the request, the
   paper's "estimation of the context size for batched requests according
   to the setup"): only the worked example of LAMPS' Figure 3 needs it --
   there nothing else runs when the requests are ranked, so under the
   engines' meaning R2's discard costs nothing and LAMPS orders as SJF.
   The iteration's waiting work -- new prompt and tool-result tokens and
   recomputation alike -- gets ``profile.prefill_budget(decodes,
   chunked_recompute)`` tokens beside the decodes: with
   ``chunked_recompute`` up to the saturation point S (InferCept 4.3 fills
   the iteration "until the GPU saturation point is reached"), else the
   token budget, where a context's whole recomputation goes in one
   iteration;
4. the iteration takes ``profile.t_fwd(batched tokens, attended context
   tokens)`` (+ a sync swap's stall); an idle engine jumps to the next event;
5. requests that finish their segment are intercepted: the ranking's
   ``handling_at_call`` is asked first (LAMPS with ``handling_at_call=True``
   returns the handling it predicted for the segment, Algorithm 1 lines
   35-42: applied as is -- a swap still subject to the host pool -- and,
   like the paper's preserve/discard/swap queues, never reconsidered while
   the call runs; only memory pressure may still drop a preserved context's
   KV), then its ``on_interception``, then ``interception.plan`` for the
   others *and* for every still-preserved context the policy decided (its
   dynamic estimate grows; a preserved context may later be discarded or
   swapped), with the batch around them (``BatchState``, C_other = the
   RUNNING requests' device KV, the intercepted ones no longer among
   them, and the decodes and batched tokens of the iteration about to
   run, :meth:`Simulator.next_step`, as the native engine gives them);
   ``ranking.observe`` gets what ran and what waited.

Token model: a request's KV covers every token of its sequence.  A decode
computes one token and adds it (+1 token of memory).  A prefill of new
tokens (prompt, tool result, next turn) computes them in chunks, and the
chunk that completes them also samples the segment's next token (as real
engines do).  A pure recomputation (a discarded or preempted context with no
new tokens) restores KV only: the next token takes a decode.  With prefix
caching, the full blocks of a discarded or preempted context stay cached
(LRU, evicted when memory is needed) and its recomputation starts after the
cached prefix still present; finished requests' blocks are not kept (no
later request shares them in these traces).

Predictions.  By default (``oracle=False``, the served product's
condition) each segment's SchedInfo fields come from a
:class:`SegmentPredictor` learned online per application (the trace's
``app``, which is also the tool's name), fed exactly as the gateway feeds
it: ``observe_segment`` when a segment ends, ``observe_call`` at the resume
(the call's time and the tokens it adds: its result plus the next turn's
prompt; the predictor's ``durations`` *is* the interception policy's, so a
tool's time is observed once), ``observe_finish`` when a request finishes.
Whether a call follows, its time and (with LAMPS' ``horizon="job"``) the
later segments are predictions too, unknown (None / ``()``) until requests
of the app have finished; the interception policy gets the predicted call
time as the hint (None: InferCept's dynamic estimate).  ``oracle=True``
reads the trace instead -- true segment lengths, call times and later
segments, the true call time as the hint -- the *upper bound* of what
predictions can give, never the product's condition.

KV memory waste (GB*s = token-seconds * kv_bytes_per_token / 1e9), as
InferCept counts it: (a) device KV held by intercepted contexts while their
call runs (preserved, or still draining out / filling back in by a swap),
and by resumed contexts waiting for the rest of their swap-in; (b) for each
iteration that recomputes, the memory of the contexts being recomputed for
that iteration's time, plus the context of the other scheduled requests for
the extra time the recomputed tokens add to the iteration; (c) a sync swap's
stall times the context of the scheduled requests.

Unit model (LAMPS' Table 1 / Figure 3, reproduced by
``tests/test_simulator.py``): ``unit_profile(kv_capacity_tokens=6)`` (1
token = 1 unit of memory, every iteration 1 unit of time, swaps free and
budget unlimited), ``max_batch_requests=1`` and ``admission="peak"``.  The
rules that give FCFS 35/3, SJF 31/3, SJF-by-total 33/3 and LAMPS 30/3 are
exactly the general ones above: decode-first (a request that holds its KV
and needs no compute -- running, preserved and resumed, or swapped back in
-- is served before any waiting one, and among those the ranking decides,
so a resumed request that ranks strictly higher takes the one slot from the
running one: SJF-by-total's R3 at t=3), a waiting request is admitted only
when its memory up to its next call or end fits beside everyone's held
memory (FCFS's R3 at t=6, LAMPS' R2 at t=10, SJF's R2 at t=9), a swap
out/in completes at the boundary where it is queued, a discarded context's
recomputation takes one iteration (S is unbounded) and its next token
another (R2's "recompute + 1 token"), and ties in rank keep arrival then
request order.  Free of torch.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..policies.costmodel import Profile
from ..policies.hints import SegmentPredictor
from ..policies.interception import (BatchState, Discard, Fixed, Handling, InterceptedContext, InterceptionPolicy,
                                     Preserve, Swap)
from ..policies.predictors import OutputLengths
from ..policies.ranking import RankingPolicy, RankState, SchedInfo
from .metrics import RequestRecord, summarize
from .traces import Trace, TraceRequest, validate_request

WAITING, RUNNING, PAUSED, SWAPIN, DONE, FUTURE = "waiting", "running", "paused", "swapin", "done", "future"


class SimulationError(RuntimeError):
    """The simulated engine cannot make progress (a request can never fit)."""


class SimRequest:
    """The simulator's request: what rankings read (``arrival``, ``sched``)
    plus the KV state."""

    __slots__ = ("id", "trace", "arrival", "arrival0", "sched", "tool", "seg", "seg_gen", "seq", "kv", "fresh",
                 "hb", "out_left", "state", "handling", "call_start", "call_end", "tool_s", "out_tokens",
                 "first_token", "finish", "mark", "waited", "seg_prompt", "resv", "pinned")

    def __init__(self, tr: TraceRequest):
        self.id, self.trace = tr.id, tr
        self.arrival = self.arrival0 = tr.arrival
        self.sched = SchedInfo()
        self.tool = tr.app or "tool"
        self.seg = 0
        self.seg_gen = 0
        self.seq = tr.segments[0].prompt_tokens   # tokens of the sequence
        self.kv = 0                               # of them, tokens with KV (device or host)
        self.fresh = self.seq                     # tail tokens never computed yet
        self.hb = 0                               # blocks of KV in the host pool
        self.out_left = 0                         # blocks still queued to swap out
        self.state = FUTURE
        self.handling: Optional[Handling] = None
        self.call_start = self.call_end = 0.0
        self.tool_s = 0.0
        self.out_tokens = 0
        self.first_token: Optional[float] = None
        self.finish: Optional[float] = None
        self.mark = 0.0                           # waste accounting: since when its idle KV is counted
        self.waited = 0                           # iterations passed over in a row
        self.seg_prompt = self.seq
        self.resv = 0                             # device blocks reserved for its swap-in
        self.pinned = False                       # its call's handling was fixed at the call (not replanned)

    @property
    def pending(self) -> int:
        return self.seq - self.kv

    def __repr__(self) -> str:
        return f"<SimRequest {self.id} {self.state} seq={self.seq} kv={self.kv}>"


@dataclass
class IterationStat:
    start: float
    seconds: float
    batched_tokens: int
    requests: int
    swap_out_tokens: int
    swap_in_tokens: int
    swap_limit_tokens: Optional[int]   # None: unlimited (sync swap)
    used_blocks: int
    decode_tokens: int = 0             # of batched_tokens, one-token steps (the rest: prefill / recompute chunks)


@dataclass
class SimResult:
    records: List[RequestRecord]
    metrics: Dict[str, Any]
    timeline: Optional[List[IterationStat]] = None
    stats: Dict[str, Any] = field(default_factory=dict)
    starvation_events: List[tuple] = field(default_factory=list)  # (iteration, request id, iterations waited)


def _static(policy: InterceptionPolicy) -> bool:
    """Policies whose answer cannot change while a context stays preserved
    (re-planning them each iteration would be a no-op)."""
    return isinstance(policy, (Preserve, Discard, Swap, Fixed))


class Simulator:
    def __init__(self, trace: Trace, profile: Profile, interception: InterceptionPolicy, ranking: RankingPolicy, *,
                 prefix_caching: bool = True, max_iterations: int = 5_000_000,
                 max_batch_requests: Optional[int] = None, admission: str = "greedy", oracle: bool = False,
                 lengths: Optional[OutputLengths] = None, timeline: bool = False, rank_preempt: bool = False,
                 rank_c_other: str = "running"):
        if admission not in ("greedy", "peak"):
            raise ValueError(f"unknown admission {admission!r}; choose greedy or peak")
        if rank_c_other not in ("running", "full-cache"):
            raise ValueError(f"unknown rank_c_other {rank_c_other!r}; choose running or full-cache")
        self.rank_c_other = rank_c_other
        if max_batch_requests is not None and (not isinstance(max_batch_requests, int) or max_batch_requests < 1):
            raise ValueError(f"max_batch_requests must be a positive integer, got {max_batch_requests!r}")
        if not isinstance(interception, InterceptionPolicy):
            raise TypeError(f"interception must be an InterceptionPolicy, got {type(interception).__name__}")
        if not isinstance(ranking, RankingPolicy):
            raise TypeError(f"ranking must be a RankingPolicy, got {type(ranking).__name__}")
        ids = set()
        for tr in trace.requests:
            validate_request(tr)
            if tr.id in ids:
                raise ValueError(f"request {tr.id!r}: field 'id' is duplicated")
            ids.add(tr.id)
        self.p, self.policy, self.ranking = profile, interception, ranking
        self.bs = profile.block_size
        self.cap = profile.kv_capacity_tokens // self.bs
        self.host_cap = (profile.host_capacity_tokens or profile.kv_capacity_tokens) // self.bs
        self.prefix_caching, self.max_iterations = prefix_caching, max_iterations
        self.slots = max_batch_requests or (1 << 30)
        self.peak = admission == "peak"
        self.oracle = oracle
        self.rank_preempt = rank_preempt
        # the product's online predictions; its durations are the policy's (a tool's time observed once)
        self.predictor = SegmentPredictor(lengths=lengths, durations=interception.durations)
        self.lengths = self.predictor.lengths
        self.horizon = getattr(ranking, "horizon", "segment") == "job"
        self.handling_at_call = ranking.handling_at_call
        self.reqs = [SimRequest(tr) for tr in sorted(trace.requests, key=lambda r: r.arrival)]
        self.static = _static(interception)
        self.fixed = isinstance(interception, Fixed)
        self.on_interception = getattr(ranking, "on_interception", None)
        # device / host pools (blocks)
        self.used = 0
        self.cache: "OrderedDict[str, int]" = OrderedDict()
        self.cached = 0
        self.host_used = 0
        self.host_reserved = 0
        self.out_queue: List[SimRequest] = []
        self.swapin: List[SimRequest] = []
        self.returns: list = []                      # heap of (call_end, n, request)
        self.ready: Dict[SimRequest, None] = {}      # RUNNING or WAITING, insertion-ordered
        self.preserved: Dict[SimRequest, None] = {}  # paused with their KV kept on the device
        self.now = 0.0
        self.last_iter_s = profile.t_fwd(1)
        self.waste_tok_s = 0.0
        self.timeline: Optional[List[IterationStat]] = [] if timeline else None
        self.starvation_events: List[tuple] = []
        self.stats: Dict[str, Any] = {"iterations": 0, "preemptions": 0, "recomputed_tokens": 0,
                                      "swap_out_blocks": 0, "swap_in_blocks": 0, "cache_hit_tokens": 0,
                                      "paused_dropped": 0, "rank_preemptions": 0,
                                      "swap_dropped_blocks": 0,
                                      "handling": {h.value: 0 for h in Handling},
                                      "replanned": {h.value: 0 for h in Handling}}
        self._n = 0

    # ------------------------------------------------------------- memory
    def nb(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def dev_blocks(self, r: SimRequest) -> int:
        return self.nb(r.kv) - r.hb

    def dev_tokens(self, r: SimRequest) -> int:
        return r.kv - min(r.kv, r.hb * self.bs)

    def available(self) -> int:
        """Blocks that can be allocated now (free plus evictable cache)."""
        return self.cap - self.used

    def alloc(self, n: int) -> bool:
        if n <= 0:
            return True
        if n > self.cap - self.used:
            return False
        short = n - (self.cap - self.used - self.cached)
        while short > 0:
            rid, cnt = next(iter(self.cache.items()))
            take = min(cnt, short)
            if take == cnt:
                del self.cache[rid]
            else:
                self.cache[rid] = cnt - take
            self.cached -= take
            short -= take
        self.used += n
        return True

    def drop_kv(self, r: SimRequest) -> None:
        """Free a device-resident context's KV (discard / preemption); its
        full blocks stay in the prefix cache when caching is on."""
        assert r.hb == 0 and r.out_left == 0
        self.used -= self.nb(r.kv)
        full = r.kv // self.bs
        if self.prefix_caching and full:
            self.cache[r.id] = self.cache.pop(r.id, 0) + full
            self.cached += full
        r.kv = 0
        r.fresh = min(r.fresh, r.seq)

    def take_cache(self, r: SimRequest) -> None:
        hit = self.cache.pop(r.id, 0)
        if hit:
            self.cached -= hit
            self.used += hit
            r.kv = min(hit * self.bs, r.seq)
            self.stats["cache_hit_tokens"] += r.kv

    # ---------------------------------------------------------- accounting
    def account(self, r: SimRequest) -> None:
        """Add the idle KV a paused / swapping-in context held since ``mark``."""
        self.waste_tok_s += self.dev_tokens(r) * (self.now - r.mark)
        r.mark = self.now

    # ---------------------------------------------------------- segments
    def start_segment(self, r: SimRequest) -> None:
        segs = r.trace.segments
        seg = segs[r.seg]
        s = r.sched
        s.segment_generated = r.seg_gen = 0
        s.context_len = r.seq
        last = r.seg == len(segs) - 1
        r.seg_prompt = r.seq
        # a new segment: a new prediction (the ranking's cached score and handling go with the old one)
        s.score = s.predicted_handling = s.future_score = None
        if self.oracle:
            s.expected_output = seg.completion_tokens
            s.expected_tool_s = None if last else seg.api_time
            s.expected_tool = None if last else r.tool
            s.future = tuple((segs[j].completion_tokens, None if j == len(segs) - 1 else segs[j].api_time,
                              segs[j - 1].api_token_length + segs[j].prompt_tokens)
                             for j in range(r.seg + 1, len(segs)))
        else:
            pred = self.predictor.predict(r.tool, r.seq, r.seg, horizon=self.horizon)
            s.expected_output, s.expected_tool = pred.expected_output, pred.expected_tool
            s.expected_tool_s, s.future = pred.expected_tool_s, pred.future
        if self.fixed:
            s.handling = self.policy.decide(InterceptedContext(r.seq, id=r.id, tool=r.tool), BatchState(), self.now)

    def arrive(self, r: SimRequest) -> None:
        r.state = WAITING
        self.ready[r] = None
        self.start_segment(r)

    def resume(self, r: SimRequest) -> None:
        """The call of ``r`` returned: append its result and the next prompt."""
        tr = r.trace
        api = tr.segments[r.seg]
        r.tool_s += api.api_time
        r.seg += 1
        add = api.api_token_length + tr.segments[r.seg].prompt_tokens
        # as the gateway observes a call: its time (the per-tool time, once) and the tokens it adds
        self.predictor.observe_call(r.tool, r.tool, api.api_time, add)
        r.pinned = False
        r.seq += add
        r.fresh += add
        if not self.policy.keeps_arrival:
            r.arrival = self.now
        self.account(r)
        self.preserved.pop(r, None)
        if r.out_left:  # cancel what has not moved out yet
            self.host_reserved -= r.out_left
            r.out_left = 0
            self.out_queue.remove(r)
        if r.hb:
            r.state = SWAPIN
            self.swapin.append(r)
        else:
            r.state = RUNNING if r.kv else WAITING
            self.ready[r] = None
        self.start_segment(r)

    def apply(self, r: SimRequest, h: Handling, replan: bool) -> None:
        key = "replanned" if replan else "handling"
        if h is Handling.PRESERVE:
            r.handling = h
            self.preserved[r] = None
            if not replan:
                self.stats[key][h.value] += 1
            return
        self.account(r)
        self.preserved.pop(r, None)
        if h is Handling.SWAP:
            need = self.nb(r.kv)
            if need and self.host_used + self.host_reserved + need <= self.host_cap:
                r.handling = h
                r.out_left = need
                self.host_reserved += need
                self.out_queue.append(r)
                self.stats[key][h.value] += 1
                return
            h = Handling.DISCARD  # the host pool is full: discard instead
        r.handling = h
        self.stats[key][h.value] += 1
        if r.kv:
            self.drop_kv(r)

    # -------------------------------------------------------------- swaps
    def swap_limit(self) -> int:
        """Blocks a budgeted swap moves this iteration (at least one, or a
        swap could never finish)."""
        return max(1, self.p.swap_limit_tokens(self.last_iter_s) // self.bs)

    def do_swaps(self) -> tuple:
        budgeted = self.policy.budgeted_swap
        limit = self.swap_limit() if budgeted else 1 << 60
        left = limit
        out_b = in_b = 0
        for r in list(self.out_queue):
            if left <= 0:
                break
            k = min(r.out_left, left)
            self.account(r)
            r.out_left -= k
            r.hb += k
            self.used -= k
            self.host_used += k
            self.host_reserved -= k
            left -= k
            out_b += k
            if not r.out_left:
                self.out_queue.remove(r)
        if self.swapin:
            order = sorted(self.swapin, key=lambda x: x.arrival0)  # original arrival (module doc, 2.)
            for r in order:
                if left <= 0:
                    break
                if r.resv < r.hb:
                    # reserve the device blocks of the whole context before
                    # moving any: partly swapped-in contexts each waiting for
                    # memory another holds would deadlock
                    if not self.alloc(r.hb - r.resv):
                        continue
                    r.resv = r.hb
                k = min(r.hb, left)
                self.account(r)
                r.resv -= k
                r.hb -= k
                self.host_used -= k
                left -= k
                in_b += k
                if not r.hb:
                    r.state = RUNNING
                    self.ready[r] = None
                    self.swapin.remove(r)
        self.stats["swap_out_blocks"] += out_b
        self.stats["swap_in_blocks"] += in_b
        return out_b, in_b, (limit * self.bs if budgeted else None)

    # -------------------------------------------------------------- batch
    def preempt(self, v: SimRequest) -> None:
        self.drop_kv(v)
        v.state = WAITING
        self.stats["preemptions"] += 1

    def blocked_swapins(self) -> List[SimRequest]:
        """Resumed contexts still waiting for the device blocks of their swap-in."""
        return [x for x in self.swapin if x.resv < x.hb]

    def drop_swapin(self, v: SimRequest) -> None:
        """A resumed context that cannot get device memory for its swap-in
        gives it up and recomputes (vLLM's preemption by recompute): its
        device part, host part and reservation are freed.  Without this a
        context whose swap-out was cancelled half-way (part on the device,
        part on the host) and a running request needing memory would wait
        on each other for ever.  Only when nothing else can run (``run``):
        the host blocks it drops are counted in ``swap_dropped_blocks``."""
        self.account(v)
        self.used -= self.dev_blocks(v) + v.resv
        self.host_used -= v.hb
        self.stats["swap_dropped_blocks"] += v.hb
        v.hb = v.resv = v.kv = 0
        v.fresh = min(v.fresh, v.seq)
        self.swapin.remove(v)
        v.state = WAITING
        self.ready[v] = None
        self.stats["preemptions"] += 1

    def make_room(self, need: int, protect: SimRequest, ranked: Optional[List[SimRequest]],
                  scheduled: set) -> bool:
        """Free ``need`` blocks: preserved paused contexts first (latest call
        first), then the lowest-ranked unscheduled running request."""
        while self.available() < need:
            paused = [x for x in self.preserved if x.kv]
            if paused:
                v = max(paused, key=lambda x: x.call_start)
                del self.preserved[v]
                self.account(v)
                self.drop_kv(v)
                v.handling = Handling.DISCARD
                self.stats["paused_dropped"] += 1
                continue
            victims = [x for x in (ranked or []) if x is not protect and x not in scheduled
                       and x.state == RUNNING and x.kv]
            if not victims:
                return False
            self.preempt(victims[-1])
        return True

    def running_kv(self) -> int:
        """C_other's one meaning: device KV tokens of the RUNNING requests
        (decoding or prefilling; paused, swapping and waiting ones hold
        none on the device or are not in the batch)."""
        return sum(self.dev_tokens(r) for r in self.ready if r.state == RUNNING)

    def rank_state(self, it: int) -> RankState:
        c_other = self.running_kv() if self.rank_c_other == "running" else None
        return RankState(iteration=it, iteration_s=self.last_iter_s, batch_context_tokens=c_other)

    def form_batch(self, it: int):
        bs = self.bs
        decodes, prefills, waiting = [], [], []
        for r in self.ready:
            if r.state == WAITING:
                waiting.append(r)
            elif r.kv == r.seq:
                decodes.append(r)
            else:
                prefills.append(r)
        state = None
        if self.rank_preempt and waiting and (decodes or prefills):
            state = self.rank_state(it)
            if self.preempt_for_head(decodes + prefills, waiting, state):
                decodes = [r for r in decodes if r.state == RUNNING]
                prefills = [r for r in prefills if r.state == RUNNING]
                waiting = [r for r in self.ready if r.state == WAITING]
        budget, slots = self.p.max_batched_tokens, self.slots
        sched: List[tuple] = []  # (request, chunk, new, emit, recompute)
        scheduled = set()
        need = sum(1 for r in decodes if r.kv % bs == 0)
        if len(decodes) <= min(slots, budget) and need <= self.available():
            ranked_dec = None
            if need:
                self.alloc(need)
            for r in decodes:
                sched.append((r, 0, 0, True, 0))
            scheduled.update(decodes)
            budget -= len(decodes)
            slots -= len(decodes)
        else:
            state = self.rank_state(it)
            ranked_dec = self.ranking.order(decodes, state)
            for r in ranked_dec:
                if slots <= 0 or budget <= 0:
                    break
                if r.state != RUNNING:
                    continue  # preempted for a better-ranked one
                if r.kv % bs == 0:
                    if not self.make_room(1, r, ranked_dec + self._ranked_prefills(prefills, state), scheduled):
                        self.preempt(r)
                        continue
                    self.alloc(1)
                sched.append((r, 0, 0, True, 0))
                scheduled.add(r)
                budget -= 1
                slots -= 1
        # the waiting work (new prompt and tool-result tokens, recomputation alike) gets what an
        # iteration gives it beside the decodes: up to S under chunked recomputation (module doc, 3.)
        budget = min(budget, self.p.prefill_budget(len(sched), self.policy.chunked_recompute))
        cands = [r for r in prefills if r.state == RUNNING]
        if self.available() > 0 or (not sched and self.preserved and not self.peak):
            cands += waiting  # (else none can be admitted: not ranked)
        if cands and slots > 0 and budget > 0:
            if state is None:
                state = self.rank_state(it)
            ranked = self.ranking.order(cands, state)
            admit = True
            n_prefills = 0
            for r in ranked:
                if slots <= 0 or budget <= 0:
                    break
                if r.state == WAITING and not admit:
                    continue
                if r.state == WAITING and r.kv == 0 and r.id in self.cache:
                    hit = self.cache[r.id] * bs
                else:
                    hit = None
                kv0 = min(hit, r.seq) if hit is not None else r.kv
                pend = r.seq - kv0
                fresh = min(r.fresh, pend)
                rec = pend - fresh
                if rec > 0:
                    if self.policy.chunked_recompute:
                        n_rec = min(rec, budget)
                    else:
                        n_rec = rec if (rec <= budget or n_prefills == 0) else 0
                    if n_rec <= 0:
                        if r.state == WAITING:
                            admit = False
                        continue
                else:
                    n_rec = 0
                n_new = min(fresh, budget - n_rec) if n_rec == rec else 0
                chunk = n_rec + n_new
                seg = r.trace.segments[r.seg]
                emit = chunk == pend and (fresh > 0 or pend == 0) and r.seg_gen < seg.completion_tokens
                held = self.nb(kv0) if r.state == WAITING else self.dev_blocks(r)
                grow = self.nb(kv0 + chunk + (1 if emit else 0)) - held
                if r.state == WAITING:
                    peak_grow = grow
                    if self.peak:
                        peak_grow = self.nb(r.seq + seg.completion_tokens - r.seg_gen) - held
                    # a cache hit re-uses blocks counted in available(): they must not be evicted for itself
                    avail = self.available() - (held if hit is not None else 0)
                    if peak_grow > avail and not sched and self.preserved and not self.peak:
                        # nothing else runs this iteration: rather than idle, it takes preserved paused
                        # contexts' KV (a paused call may never return), as the native engine does
                        self.make_room(peak_grow + (held if hit is not None else 0), r, None, scheduled)
                        avail = self.available() - (held if hit is not None else 0)
                    if peak_grow > avail:
                        admit = False
                        continue
                    self.take_cache(r)
                    self.alloc(grow)
                    r.state = RUNNING
                else:
                    if grow > self.available():
                        if not self.make_room(grow, r, (ranked_dec or []) + ranked, scheduled):
                            continue
                    self.alloc(grow)
                sched.append((r, chunk, n_new, emit, n_rec))
                scheduled.add(r)
                budget -= max(chunk, 1 if emit else 0)
                slots -= 1
                n_prefills += 1
        return sched, decodes, prefills, waiting

    def preempt_for_head(self, running: List[SimRequest], waiting: List[SimRequest], state: RankState) -> bool:
        """``rank_preempt``: LAMPS' Algorithm 1 rebuilds the running batch
        from the ranked queue every iteration, so the best-ranked waiting
        request that does not fit takes memory from running requests ranked
        below it (lowest first, preempted by recompute) -- when they hold
        enough.  Returns whether anything was preempted."""
        order = self.ranking.order(running + waiting, state)
        head = next(r for r in order if r.state == WAITING)
        hit = self.cache.get(head.id, 0) if head.kv == 0 else 0
        kv0 = min(hit * self.bs, head.seq)
        seg = head.trace.segments[head.seg]
        if self.peak:
            need = self.nb(head.seq + seg.completion_tokens - head.seg_gen) - self.nb(kv0)
        else:
            need = self.nb(kv0 + min(head.seq - kv0, self.p.max_batched_tokens) + 1) - self.nb(kv0)
        avail = self.available() - (self.nb(kv0) if hit else 0)
        if need <= avail:
            return False
        below = [r for r in order[order.index(head) + 1:] if r.state == RUNNING and r.kv]
        freed, victims = 0, []
        for v in reversed(below):
            if avail + freed >= need:
                break
            victims.append(v)
            freed += self.dev_blocks(v)
        if avail + freed < need:
            return False
        for v in victims:
            self.preempt(v)
        self.stats["rank_preemptions"] += len(victims)
        return True

    def _ranked_prefills(self, prefills, state):
        return self.ranking.order(prefills, state) if prefills else []

    # --------------------------------------------------------------- run
    def run(self) -> SimResult:
        p = self.p
        reqs = self.reqs
        nxt = 0
        done = 0
        it = 0
        t0 = reqs[0].arrival if reqs else 0.0
        self.now = t0
        while done < len(reqs):
            # 1. arrivals and returns
            while nxt < len(reqs) and reqs[nxt].arrival <= self.now:
                self.arrive(reqs[nxt])
                nxt += 1
            while self.returns and self.returns[0][0] <= self.now:
                self.resume(heapq.heappop(self.returns)[2])
            # 2. swaps
            out_b = in_b = 0
            if self.out_queue or self.swapin:
                out_b, in_b, limit = self.do_swaps()
            else:
                limit = self.swap_limit() * self.bs if self.policy.budgeted_swap else None
            stall = 0.0 if self.policy.budgeted_swap else p.t_swap((out_b + in_b) * self.bs)
            # 3. batch
            sched, decodes, prefills, waiting = self.form_batch(it)
            if not sched:
                if stall or out_b or in_b:
                    self.now += stall if stall else p.t_swap((out_b + in_b) * self.bs)
                    continue
                blocked = self.blocked_swapins()
                if blocked and not self.preserved:
                    # nothing runs and no preserved context will resume and free memory: one recomputes
                    self.drop_swapin(max(blocked, key=lambda x: x.arrival0))
                    continue
                t_next = [self.returns[0][0]] if self.returns else []
                if nxt < len(reqs):
                    t_next.append(reqs[nxt].arrival)
                if not t_next:
                    stuck = [r for r in reqs if r.state != DONE]
                    raise SimulationError(
                        f"no progress possible: request {stuck[0].id!r} needs more KV memory than the device "
                        f"can give it ({self.cap} blocks of {self.bs} tokens)" if stuck else "no progress")
                self.now = max(self.now, min(t_next))
                continue
            it += 1
            if it > self.max_iterations:
                raise SimulationError(f"more than max_iterations={self.max_iterations} iterations")
            # 4. execute
            batched = 0
            ctx = 0
            rec_tokens = 0
            rec_mem = 0
            steps = 0
            for r, chunk, n_new, emit, n_rec in sched:
                batched += chunk if chunk else (1 if emit else 0)
                steps += 0 if chunk else (1 if emit else 0)
                r.kv += chunk
                r.fresh -= n_new
                if n_rec:
                    rec_tokens += n_rec
                    rec_mem += r.kv
                if emit:
                    r.seq += 1
                    r.kv += 1
                    r.seg_gen += 1
                    r.out_tokens += 1
                    s = r.sched
                    s.segment_generated = r.seg_gen
                ctx += r.kv
                r.sched.context_len = r.seq
            dt = p.t_fwd(batched, ctx)
            if rec_tokens:
                # the other requests wait the time the recomputed tokens *add* to the iteration: the
                # same Profile.added_time eq. 4 charges (the objective and its judge agree)
                extra = p.added_time(rec_tokens, batched - rec_tokens)
                self.waste_tok_s += rec_mem * dt + (ctx - rec_mem) * extra
                self.stats["recomputed_tokens"] += rec_tokens
            if stall:
                self.waste_tok_s += ctx * stall
            if self.timeline is not None:
                self.timeline.append(IterationStat(self.now, dt + stall, batched, len(sched), out_b * self.bs,
                                                   in_b * self.bs, limit, self.used, steps))
            self.now += dt + stall
            self.last_iter_s = dt
            # 5. finishes and interceptions
            newly = []
            at_call: Dict[SimRequest, Handling] = {}
            for r, chunk, n_new, emit, n_rec in sched:
                if emit and r.first_token is None:
                    r.first_token = self.now
                seg = r.trace.segments[r.seg]
                if r.kv == r.seq and r.seg_gen >= seg.completion_tokens:
                    self.predictor.observe_segment(r.tool, r.seg_prompt, r.seg_gen)
                    if r.seg == len(r.trace.segments) - 1:
                        r.state = DONE
                        del self.ready[r]
                        r.finish = self.now
                        self.used -= self.nb(r.kv)
                        r.kv = 0
                        done += 1
                        self.predictor.observe_finish(r.tool, len(r.trace.segments))
                        continue
                    r.state = PAUSED
                    del self.ready[r]
                    r.call_start = r.mark = self.now
                    r.call_end = self.now + seg.api_time
                    self._n += 1
                    heapq.heappush(self.returns, (r.call_end, self._n, r))
                    h = self.handling_at_call(r)  # before on_interception starts the next prediction
                    if h is not None:
                        at_call[r] = h
                    if self.on_interception is not None:
                        self.on_interception(r)
                    newly.append(r)
            self.intercept(newly, at_call)
            # 6. ranking bookkeeping
            scheduled = [x[0] for x in sched]
            sset = set(scheduled)
            passed = [r for r in decodes + prefills + waiting if r not in sset and r.state in (RUNNING, WAITING)]
            before = [r.sched.starving for r in passed]
            self.ranking.observe(scheduled, passed)
            for r in scheduled:
                r.waited = 0
            for r, was in zip(passed, before):
                r.waited += 1
                if r.sched.starving and not was:
                    self.starvation_events.append((it, r.id, r.waited))
        self.stats["iterations"] = it
        return self.result(t0)

    def next_step(self) -> tuple:
        """(decodes, batched tokens) of the iteration about to run, as the
        native engine describes it to the interception policy: every
        running decode plus the waiting work its prefill budget lets in
        (the iteration that just ran would describe the past: after a long
        prefill the next one may be all decodes, whose much shorter time
        decides whether a swap can hide behind it)."""
        decodes = sum(1 for r in self.ready if r.state == RUNNING and r.kv == r.seq)
        waiting = sum(r.seq - r.kv for r in self.ready if r.kv < r.seq)
        cap = self.p.prefill_budget(decodes, self.policy.chunked_recompute)
        return decodes, max(1, min(self.p.max_batched_tokens, decodes + min(waiting, cap)))

    def intercept(self, newly: List[SimRequest], at_call: Dict[SimRequest, Handling]) -> None:
        """Handle the calls reached this iteration (module doc, 5.)."""
        for r, h in at_call.items():  # LAMPS' handling for the segment, as predicted (Algorithm 1)
            r.pinned = True
            self.apply(r, h, False)
        ctxs = [r for r in newly if r not in at_call]
        if not self.static:
            ctxs += [r for r in self.preserved if r.kv and r.state == PAUSED and r.call_start < self.now
                     and not r.pinned]
        if not ctxs:
            return
        backlog = sum(r.out_left for r in self.out_queue) * self.bs
        decodes, batched = self.next_step()
        batch = BatchState(context_tokens=self.running_kv(), decode_tokens=decodes, batched_tokens=batched,
                           swap_backlog_tokens=backlog)
        ics = [InterceptedContext(r.kv, self.dev_blocks(r),
                                  r.trace.segments[r.seg].api_time if self.oracle
                                  else self.predictor.call_seconds(r.tool, r.tool),
                                  r.tool, r.id, r.call_start) for r in ctxs]
        plan = self.policy.plan(ics, batch, self.now)
        new_ids = {r.id for r in newly}
        for r in ctxs:
            h = Handling(plan[r.id])
            replan = r.id not in new_ids
            if replan and h is Handling.PRESERVE:
                continue
            self.apply(r, h, replan)

    def result(self, t0: float) -> SimResult:
        for r in self.reqs:
            if r.state in (PAUSED, SWAPIN):
                self.account(r)
        records = [RequestRecord(r.id, r.arrival0, r.first_token if r.first_token is not None else r.finish,
                                 r.finish, r.tool_s, r.out_tokens) for r in self.reqs]
        wall = max((r.finish for r in self.reqs), default=t0) - t0
        waste = self.waste_tok_s * self.p.kv_bytes_per_token / 1e9
        self.stats.update(leaked_blocks=self.used, cached_blocks=self.cached, host_blocks=self.host_used,
                          host_reserved=self.host_reserved, sim_time_s=wall)
        extra = {"policy": getattr(self.policy, "name", type(self.policy).__name__),
                 "ranking": getattr(self.ranking, "name", type(self.ranking).__name__),
                 "profile": self.p.model, "profile_source": self.p.source,
                 "iterations": self.stats["iterations"], "preemptions": self.stats["preemptions"],
                 "paused_dropped": self.stats["paused_dropped"],
                 "recomputed_tokens": self.stats["recomputed_tokens"],
                 "swap_out_blocks": self.stats["swap_out_blocks"], "swap_in_blocks": self.stats["swap_in_blocks"],
                 "handling": dict(self.stats["handling"])}
        metrics = summarize(records, wall, waste, extra)
        return SimResult(records, metrics, self.timeline, self.stats, self.starvation_events)


def simulate(trace: Trace, profile: Profile, interception: InterceptionPolicy, ranking: RankingPolicy, *,
             prefix_caching: bool = True, max_iterations: int = 5_000_000, max_batch_requests: Optional[int] = None,
             admission: str = "greedy", oracle: bool = False, lengths: Optional[OutputLengths] = None,
             timeline: bool = False, rank_preempt: bool = False, rank_c_other: str = "running") -> SimResult:
    """Replay ``trace`` on a simulated engine of ``profile`` under these
    policies (module doc).  Predictions are learned online as the product
    does; ``oracle=True`` reads them from the trace (the upper bound).
    Policy objects are used as given (their learned predictors carry over
    between calls: build fresh ones per run)."""
    return Simulator(trace, profile, interception, ranking, prefix_caching=prefix_caching,
                     max_iterations=max_iterations, max_batch_requests=max_batch_requests, admission=admission,
                     oracle=oracle, lengths=lengths, timeline=timeline, rank_preempt=rank_preempt,
                     rank_c_other=rank_c_other).run()


__all__ = ["simulate", "Simulator", "SimResult", "SimRequest", "IterationStat", "SimulationError"]
