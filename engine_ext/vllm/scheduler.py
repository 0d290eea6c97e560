"""Interlace's ranking, and Parrot's capacity cap, inside vLLM's scheduler.

vLLM builds its scheduler from ``scheduler_config.scheduler_cls``; Interlace
names :class:`InterlaceScheduler` there (see :func:`engine_args`).  It runs
in vLLM's engine-core process, so the policy cannot be passed as an object:
the frontend puts its *configuration* (ranking name, starvation threshold,
refresh interval, the cost-model profile as a dict, the capacity caps) into
``VllmConfig.additional_config["interlace"]`` and this class builds the
**same policy objects** the native engine uses
(:func:`engine_ext.policies.make_ranking` wrapped in
:class:`~engine_ext.policies.ObjectiveRanking`, and
:class:`~engine_ext.policies.capacity.CapacityPolicy`), not a
reimplementation.

:class:`InterlaceAsyncScheduler` is the same over vLLM's ``AsyncScheduler``,
picked when vLLM enables asynchronous scheduling (never on the CPU build:
its platform turns asynchronous scheduling off).

Every step, before vLLM's own ``schedule()`` admits waiting requests from
the front of its FCFS queue, the waiting queue is put in the ranking's
order; after it, the ranking is told who was admitted (starvation
counting).  The ranked queue is then put in fair order across tenants
(``RequestHint.tenant``, the API key's name): the rule of
:mod:`engine_ext.policies.fairness`, the native scheduler's, with the
requests in ``running`` as each tenant's load.  What a ranking reads of
a request (:class:`SchedInfo`) comes from the request itself (context
length, tokens generated) and from the frontend's
:class:`~engine_ext.protocol.RequestHint`, carried in
``SamplingParams.extra_args["interlace"]``: every ranking field, the later
segments (``future``) included.  A request resumed after a tool call is a
new vLLM request that carries the hint given to ``resume`` (the next
segment's predictions) and keeps the arrival time of its job (the frontend
passes it), as InferCept's improved discard does.  The ranking's C_other
(``RankState.batch_context_tokens``) is the running requests' computed
tokens (:meth:`_Ranked.rank_state`).

Parrot's capacity regulation (issue 35; the caps come from
``PolicySpec.capacity()`` in ``additional_config["interlace"]["capacity"]``,
none: off).  Every step, over the requests with work -- ``running``, and
the queued ones (``waiting`` and ``kv_holding_waiting``; a session waiting
for its next input is not work) -- each with ``context_len`` =
``num_tokens``: the cap in force is the latency cap while any is
latency-critical, else the throughput cap; the running requests (ranked),
then the queued ones (ranked), go through ``CapacityPolicy.split`` (latency
ones always run and count first, the others first fit, starving ones first).  The
requests over the cap are *held* for this step:

* a held running request stays in ``running`` -- its KV, its model-runner
  slot (so vLLM does not admit past ``max_num_seqs``) and its place -- but
  its ``next_decode_eligible_step`` (vLLM's own per-request "not before
  step N", used for pipeline-parallel decode pacing) is set past this step
  around ``super().schedule()`` and restored after, so vLLM's running loop
  skips it.  It is not preempted; memory still can: vLLM's preemption of
  ``running[-1]`` may take a held request's KV, as it would any running
  request's;
* a held queued request is taken out of its queue around
  ``super().schedule()`` and put back in its place (requests vLLM
  preempted during the step first, as vLLM puts them).

Both undo in a ``finally`` within the one synchronous ``schedule()`` call,
so an abort (which vLLM handles between steps) always finds the request
where vLLM left it; the ids held (``_held``) are dropped when a request
finishes.  Held requests are passed to ``ranking.observe`` as passed over
(LAMPS' starvation count then bounds their wait, as on the native engine);
running ones that ran as scheduled.  Nothing is held when the ranking's
split leaves nothing running to gain (what the cap lets run is all queued
and ``running`` fills every slot), and a step that held some and scheduled
nothing (the latency request waiting for blocks or a slot the held ones
keep) makes the next step hold none -- the native engine's "the held ones
run rather than nothing".  Asynchronous scheduling: a step is scheduled
before the last one's tokens are back (``num_output_placeholders``).  vLLM
itself leaves such a request out of a step (a token budget spent on a
prefill chunk), so a hold may begin then; but a request that missed a step
is rebuilt by the model runner from the scheduler's token ids
(``gpu_model_runner._update_states``: ``all_token_ids[-num_output_tokens:]``,
``num_output_tokens`` counting the placeholders), which lack a token still
in flight -- so a held request is not released before its placeholders are
back (with one pipeline stage they always are by the next step).
Counters: ``capacity_limit`` (the cap at the last step), ``capacity_held``
(held at the last step), ``capacity_held_steps``; :meth:`_Ranked.capacity_stats`
answers the frontend's ``"capacity"`` utility call (vLLM's
``SchedulerStats`` has no field for them).  Measured in
tests/test_vllm_capacity.py on the CPU build: cap 512, three 300-token
members of a task group decoding, a 13-token latency request: one member
decodes beside it, the other two get no token for its 16 steps; with
regulation off all three decode beside it.

What it does not do: it does not reorder ``running`` (vLLM preempts from
its end, a latency request admitted last first) nor the queue of
preempted requests that still hold KV blocks (vLLM drains those first,
before any new request).  Held requests keep their speculative-decoding
draft tokens as vLLM leaves them for any request that misses a step
(speculative decoding with holds is not exercised here).  vLLM's
data-parallel prefill balancing counts the waiting queue during the step,
without the held requests.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from ..policies import ObjectiveRanking, Profile, make_ranking
from ..policies.capacity import NO_CAPACITY, CapacityPolicy, is_latency
from ..policies.fairness import fair_order
from ..policies.interception import make_interception
from ..policies.ranking import RankingPolicy, RankState, SchedInfo
from .pins import _Pinning, _pin_policy

log = logging.getLogger(__name__)

CONFIG_KEY = "interlace"


class _Item:
    """A waiting vLLM request as a ranking sees it (``arrival`` and ``sched``)."""

    __slots__ = ("req", "sp", "arrival", "sched")

    def __init__(self, req: Any, hint: Dict[str, Any]):
        self.req = req
        self.sp = req.sampling_params  # a session's next chunk brings new ones (and a new hint)
        self.arrival = float(hint.get("arrival") or req.arrival_time)
        self.sched = SchedInfo(expected_output=hint.get("expected_output"), expected_tool=hint.get("expected_tool"),
                               expected_tool_s=hint.get("expected_tool_s"),
                               future=tuple(tuple(seg) for seg in hint.get("future") or ()),
                               objective=hint.get("objective"), task_group=hint.get("task_group"),
                               tenant=hint.get("tenant"))

    def refresh(self) -> None:
        self.sched.context_len = self.req.num_tokens
        self.sched.segment_generated = self.req.num_output_tokens


def build_ranking(conf: Dict[str, Any]) -> RankingPolicy:
    """The ranking named in the frontend's configuration, built as the
    native engine's is (gateway/models.py ``load_engine``)."""
    profile = Profile.from_dict(conf["profile"]) if conf.get("profile") else None
    # LAMPS predicts the handling vLLM gives: the pins' policy (no swap), or discard where nothing is kept
    interception = (_pin_policy(conf) if conf.get("pins") else make_interception("discard", profile)) \
        if profile else None
    return ObjectiveRanking(make_ranking(conf.get("ranking", "fcfs"), profile, interception,
                                         starvation_threshold=int(conf.get("starvation_threshold", 100)),
                                         refresh_interval=int(conf.get("refresh_interval", 1)),
                                         horizon=conf.get("horizon", "job"),
                                         handling_at_call=bool(conf.get("handling_at_call", False))))


def request_hint(req: Any) -> Dict[str, Any]:
    sp = getattr(req, "sampling_params", None)
    extra = getattr(sp, "extra_args", None) or {}
    return extra.get(CONFIG_KEY) or {}


WAITING_INPUT = RequestStatus.WAITING_FOR_STREAMING_REQ


def build_capacity(conf: Dict[str, Any]) -> CapacityPolicy:
    """The capacity policy of the frontend's configuration (none: regulation off)."""
    cap = conf.get("capacity") or {}
    if not cap:
        return NO_CAPACITY
    return CapacityPolicy(latency_tokens=cap.get("latency_tokens"), throughput_tokens=cap.get("throughput_tokens"))


class _Ranked:
    """Interlace's ranking ordering a vLLM scheduler's waiting queue, and
    Parrot's capacity cap over its running and waiting requests (a mixin for
    vLLM's ``Scheduler`` and its ``AsyncScheduler``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config
        conf = (extra.get(CONFIG_KEY) if isinstance(extra, dict) else None) or {}
        self.ranking: RankingPolicy = build_ranking(conf)
        self.capacity: CapacityPolicy = build_capacity(conf)
        self._items: Dict[str, _Item] = {}
        self._iteration = 0
        self.reordered_steps = 0  # steps whose waiting order the ranking changed (tests, logs)
        self.capacity_limit: Optional[int] = None  # the cap in force at the last step (None: memory only)
        self.capacity_held = 0        # requests held back by the cap at the last step
        self.capacity_held_steps = 0  # steps that held some request back
        self._held: Set[str] = set()  # request ids held at the last step
        self._unhold = False          # the last step held some and scheduled nothing: this one holds none
        log.info("Interlace ranking in vLLM's scheduler: %r, capacity %r", self.ranking, self.capacity)

    # -------------------------------------------------------------- the queue
    def _item(self, req: Any) -> _Item:
        item = self._items.get(req.request_id)
        if item is None or item.req is not req or item.sp is not req.sampling_params:
            item = self._items[req.request_id] = _Item(req, request_hint(req))
        item.refresh()
        return item

    def _rank_waiting(self) -> List[_Item]:
        # a session waiting for its next input (its pin released: pins.py) is not work to rank
        idle = [r for r in self.waiting if r.status == WAITING_INPUT]
        items = [self._item(r) for r in self.waiting if r.status != WAITING_INPUT]
        if self.policy.value != "fcfs" or len(items) < 2:
            return items
        running = Counter(request_hint(r).get("tenant") for r in self.running)
        ordered = fair_order(self.ranking.order(items, self.rank_state()), running)
        if [i.req for i in ordered] + idle != list(self.waiting):
            self.reordered_steps += 1
            self.waiting.clear()
            self.waiting.extend([i.req for i in ordered] + idle)
        return ordered

    def rank_state(self) -> RankState:
        """The ranking's view of the engine: C_other (``batch_context_tokens``)
        is the KV tokens of the requests running now (their computed tokens;
        waiting and preempted ones hold none on the device), as in the
        native engine and the simulator (the policies' docstrings)."""
        return RankState(iteration=self._iteration,
                         batch_context_tokens=sum(int(r.num_computed_tokens) for r in self.running))

    # ----------------------------------------------------------- the capacity
    def _work(self) -> Tuple[List[_Item], List[_Item]]:
        """The requests with work now, as the ranking sees them: running, and
        waiting to run (queued with or without KV; a session waiting for its
        next input is not work)."""
        running = [self._item(r) for r in self.running]
        queued = [self._item(r) for q in (self.kv_holding_waiting, self.waiting) for r in q
                  if r.status != WAITING_INPUT]
        return running, queued

    def _split(self, running: List[_Item], queued: List[_Item]) -> List[_Item]:
        """The requests held back this step (module doc): those over the
        cap, and those held at the last step whose output is still in flight."""
        held = self._over_cap(running, queued)
        if self._held:
            # vLLM's model runner restores a request that missed a step from the scheduler's token ids,
            # which lack in-flight output (async scheduling): a held request resumes once it has none
            known = {id(i) for i in held}
            held += [i for i in running if id(i) not in known and i.req.request_id in self._held
                     and getattr(i.req, "num_output_placeholders", 0) > 0]
        return held

    def _over_cap(self, running: List[_Item], queued: List[_Item]) -> List[_Item]:
        if not self.capacity.enabled:
            self.capacity_limit = None
            return []
        self.capacity_limit = self.capacity.limit(running + queued)
        if self.capacity_limit is None:
            return []
        # the running requests first (their KV is in place: holding one to admit a waiting one of the same
        # standing would only swap which one idles), each part in the ranking's order
        state = self.rank_state()
        ordered = self.ranking.order(running, state) + self.ranking.order(queued, state)
        run, held = self.capacity.split(ordered, self.capacity_limit)
        if not held or self._unhold:
            return []  # _unhold: the last step held some and scheduled nothing (memory, slots): they run
        slots = getattr(self, "max_num_active_reqs", self.max_num_running_reqs)
        if not any(i.req.status == RequestStatus.RUNNING for i in run) \
                and len(self.running) + self.num_waiting_for_streaming_input >= slots:
            return []  # what the cap lets run waits for a slot the held ones occupy: holding them gains nothing
        return held

    def _hold(self, held: List[_Item]) -> Callable[[], None]:
        """Keep ``held`` out of this step's scheduling, without preempting
        anyone; returns what puts everything back (module doc)."""
        running = [i.req for i in held if i.req.status == RequestStatus.RUNNING]
        waiting = {id(i.req) for i in held if i.req.status != RequestStatus.RUNNING}
        # vLLM skips a running request until ``next_decode_eligible_step`` (its step counter is
        # incremented first thing in schedule()); the request keeps its KV, its slot and its place
        step = int(self.current_step) + 2
        saved = [(r, r.next_decode_eligible_step) for r in running]
        for r, old in saved:
            r.next_decode_eligible_step = max(int(old), step)
        moved: List[Tuple[Any, List[Any], List[Any]]] = []
        for q in (self.kv_holding_waiting, self.waiting):
            before = list(q)
            out = [r for r in before if id(r) in waiting]
            if out:
                q.remove_requests(out)
                moved.append((q, before, out))

        def restore() -> None:
            for r, old in saved:
                r.next_decode_eligible_step = old
            for q, before, out in moved:
                pos = {id(r): n for n, r in enumerate(before)}
                now = list(q)
                # what the step put in the queue (preempted requests) stays first; the rest in its order
                head = [r for r in now if id(r) not in pos]
                tail = sorted([r for r in now if id(r) in pos] + out, key=lambda r: pos[id(r)])
                q.remove_requests(now)
                for r in head + tail:
                    q.add_request(r)
        return restore

    def capacity_stats(self) -> Dict[str, int]:
        """The cap now (``capacity_tokens``: in force over the requests with
        work now; 0: none but memory), ``active_tokens`` and
        ``latency_running`` of those requests, ``capacity_held`` (held at the
        last step; 0 with no work left), ``capacity_held_steps`` and the
        configured caps (0: none): the native engine's ``load_stats`` keys."""
        running, queued = self._work()
        work = running + queued
        cap = self.capacity
        return {"capacity_tokens": (cap.limit(work) if cap.enabled else None) or 0,
                "active_tokens": sum(int(i.sched.context_len) for i in work),
                "latency_running": sum(1 for i in work if is_latency(i)),
                "capacity_held": self.capacity_held if work else 0,
                "capacity_held_steps": self.capacity_held_steps,
                "capacity_latency_tokens": cap.latency_tokens or 0,
                "capacity_throughput_tokens": cap.throughput_tokens or 0}

    def __call__(self, op: str, payload: Optional[Dict[str, Any]] = None) -> Any:
        """A control call from the frontend (vLLM's utility RPC, :mod:`.pins`):
        ``"capacity"`` answers :meth:`capacity_stats`."""
        if op == "capacity":
            return self.capacity_stats()
        raise ValueError(f"unknown Interlace scheduler call {op!r}")

    # ------------------------------------------------------------------ step
    def schedule(self, *args: Any, **kwargs: Any):
        self._iteration += 1
        waiting = self._rank_waiting()
        running: List[_Item] = []
        held: List[_Item] = []
        if self.capacity.enabled:
            running, queued = self._work()
            held = self._split(running, queued)
            seen = {id(i) for i in waiting}
            waiting = waiting + [i for i in queued if id(i) not in seen]  # those queued with KV too
        restore = self._hold(held) if held else None
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            if restore is not None:
                restore()
        self._held = {i.req.request_id for i in held}
        self.capacity_held = len(held)
        if held:
            self.capacity_held_steps += 1
        # a step that held some and scheduled nothing may wait on memory or slots the held ones keep
        self._unhold = bool(held) and not out.num_scheduled_tokens
        ranked = running + waiting
        if ranked:
            # what ran and what was passed over (held ones included: the ranking's starvation guarantee
            # bounds their wait, as on the native engine)
            done = set(out.num_scheduled_tokens)
            self.ranking.observe([i for i in ranked if i.req.request_id in done],
                                 [i for i in ranked if i.req.request_id not in done])
        return out

    def finish_requests(self, request_ids: Any, finished_status: Any, *args: Any, **kwargs: Any):
        out = super().finish_requests(request_ids, finished_status, *args, **kwargs)
        for rid in ([request_ids] if isinstance(request_ids, str) else list(request_ids or ())):
            self._items.pop(rid, None)
            self._held.discard(rid)
        return out

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        self._items.pop(request.request_id, None)
        self._held.discard(request.request_id)
        return super()._free_request(request, *args, **kwargs)


class InterlaceScheduler(_Pinning, _Ranked, Scheduler):
    """vLLM's scheduler with Interlace's ranking and pins (:mod:`.pins`)."""


class InterlaceAsyncScheduler(_Pinning, _Ranked, AsyncScheduler):
    """vLLM's asynchronous scheduler (overlapping scheduling with the
    forward pass; vLLM's default where the executor supports it) with
    Interlace's ranking."""


SYNC = f"{__name__}.InterlaceScheduler"
ASYNC = f"{__name__}.InterlaceAsyncScheduler"


def interlace_config(ranking: str = "fcfs", profile: Optional[Profile] = None, interception: str = "preserve",
                     starvation_threshold: int = 100, refresh_interval: int = 1, horizon: str = "job",
                     handling_at_call: bool = False, pins: Optional[Dict[str, float]] = None,
                     capacity: Optional[CapacityPolicy] = None) -> Dict[str, Any]:
    """What goes into ``additional_config["interlace"]`` (JSON-able: vLLM hashes it).  ``pins``:
    ``{"budget": fraction of the KV blocks, "ttl_s": seconds}`` where paused requests keep their KV
    (:mod:`.pins`), None where every pause discards.  ``capacity``: Parrot's caps
    (``PolicySpec.capacity()``), None or one that is not enabled: regulation off."""
    cap = None
    if capacity is not None and capacity.enabled:
        cap = {"latency_tokens": capacity.latency_tokens, "throughput_tokens": capacity.throughput_tokens}
    return {"ranking": ranking, "interception": interception, "starvation_threshold": starvation_threshold,
            "refresh_interval": refresh_interval, "horizon": horizon, "handling_at_call": handling_at_call,
            "profile": profile.to_dict() if profile else None, "pins": pins, "capacity": cap}
