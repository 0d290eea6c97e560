"""Interlace's ranking inside vLLM's scheduler.

vLLM builds its scheduler from ``scheduler_config.scheduler_cls``; Interlace
names :class:`InterlaceScheduler` there (see :func:`engine_args`).  It runs
in vLLM's engine-core process, so the policy cannot be passed as an object:
the frontend puts its *configuration* (ranking name, starvation threshold,
refresh interval, the cost-model profile as a dict) into
``VllmConfig.additional_config["interlace"]`` and this class builds the
**same policy objects** the native engine uses
(:func:`engine_ext.policies.make_ranking` wrapped in
:class:`~engine_ext.policies.ObjectiveRanking`), not a reimplementation.

:class:`InterlaceAsyncScheduler` is the same over vLLM's ``AsyncScheduler``,
picked when vLLM enables asynchronous scheduling.

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

What it does not do: it does not reorder ``running`` (vLLM preempts from
its end) nor the queue of preempted requests that still hold KV blocks
(vLLM drains those first, before any new request).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Dict, List, Optional

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from ..policies import ObjectiveRanking, Profile, make_ranking
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


class _Ranked:
    """Interlace's ranking ordering a vLLM scheduler's waiting queue (a mixin
    for vLLM's ``Scheduler`` and its ``AsyncScheduler``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config
        conf = (extra.get(CONFIG_KEY) if isinstance(extra, dict) else None) or {}
        self.ranking: RankingPolicy = build_ranking(conf)
        self._items: Dict[str, _Item] = {}
        self._iteration = 0
        self.reordered_steps = 0  # steps whose waiting order the ranking changed (tests, logs)
        log.info("Interlace ranking in vLLM's scheduler: %r", self.ranking)

    # -------------------------------------------------------------- the queue
    def _item(self, req: Any) -> _Item:
        item = self._items.get(req.request_id)
        if item is None or item.req is not req or item.sp is not req.sampling_params:
            item = self._items[req.request_id] = _Item(req, request_hint(req))
        item.refresh()
        return item

    def _rank_waiting(self) -> List[_Item]:
        # a session waiting for its next input (its pin released: pins.py) is not work to rank
        idle = [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_STREAMING_REQ]
        items = [self._item(r) for r in self.waiting if r.status != RequestStatus.WAITING_FOR_STREAMING_REQ]
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

    def schedule(self, *args: Any, **kwargs: Any):
        self._iteration += 1
        waiting = self._rank_waiting()
        out = super().schedule(*args, **kwargs)
        if waiting:
            admitted = set(out.num_scheduled_tokens)
            self.ranking.observe([i for i in waiting if i.req.request_id in admitted],
                                 [i for i in waiting if i.req.request_id not in admitted])
        return out

    def finish_requests(self, request_ids: Any, finished_status: Any, *args: Any, **kwargs: Any):
        out = super().finish_requests(request_ids, finished_status, *args, **kwargs)
        for rid in ([request_ids] if isinstance(request_ids, str) else list(request_ids or ())):
            self._items.pop(rid, None)
        return out

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        self._items.pop(request.request_id, None)
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
                     handling_at_call: bool = False, pins: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    """What goes into ``additional_config["interlace"]`` (JSON-able: vLLM hashes it).  ``pins``:
    ``{"budget": fraction of the KV blocks, "ttl_s": seconds}`` where paused requests keep their KV
    (:mod:`.pins`), None where every pause discards."""
    return {"ranking": ranking, "interception": interception, "starvation_threshold": starvation_threshold,
            "refresh_interval": refresh_interval, "horizon": horizon, "handling_at_call": handling_at_call,
            "profile": profile.to_dict() if profile else None, "pins": pins}
