"""Preserve on vLLM: a paused (or finished, kept) request's KV stays
allocated inside vLLM until its resume or follow-up, chosen and bounded by
Interlace's policies.  This is the engine-core half, a mixin of
:class:`~engine_ext.vllm.scheduler.InterlaceScheduler`; the frontend half is
:class:`~engine_ext.vllm.engine.VLLMEngine`'s sessions.

The mechanism, chosen after reading vLLM 0.32 (``v1/core/sched/scheduler.py``)
--------------------------------------------------------------------------
vLLM 0.32 has *resumable* (streaming-input) requests: a request whose chunk
stops (``check_stop``: max_tokens or a stop token) goes to
``WAITING_FOR_STREAMING_REQ`` in ``_handle_stopped_request`` and **keeps
its blocks**; the next input chunk (a request with the same id, turned into
a ``StreamingUpdate``) continues it in ``_update_request_as_session`` on the
blocks it holds.  That is exactly a pin, with vLLM's own bookkeeping (the
model runner's request slot, block tables, async-scheduling placeholders),
so Interlace uses it rather than pinning blocks of finished requests through
the KV cache manager (Continuum's approach, which needs the block pool's
reference counts held from outside the request lifecycle).  What the
subclass adds:

* **The stop on the pause token, inside the scheduler.**
  ``_update_request_with_output`` runs the same ``pause_on`` rule as the
  frontend (:class:`~engine_ext.stream_text.PauseWatch`: Interlace's
  detokenizer over the same tokens) and stops the request on the very token
  that completes ``</tool_call>`` -- so the earlier objection (pause markers
  are text, seen only after detokenization in the frontend) does not hold:
  no token after the marker is computed.  A stop the frontend decides
  itself (a stop string, a consumer that left, an explicit ``pause``) asks
  the scheduler through a control call (below) and is applied at the
  request's next output.
* **Whole-context updates.**  Every chunk the frontend sends carries the
  context's whole token list; ``_update_request_as_session`` keeps the
  longest prefix the request already computed and appends the rest.  When
  the context was cut (a client's follow-up re-rendered differently from
  some token on, a frontend stop after run-ahead tokens) the request's KV is
  truncated there: blocks past the cut go back to the pool, and a block
  holding the cut is kept only if it was never hashed into the prefix cache
  (a hashed block's stale tail cannot be overwritten without lying to
  other requests), else recomputed from its start.
* **Grammars per chunk** (vLLM keeps the first chunk's): the update's
  compiled structured-output request replaces the session's.
* **Release** (the policy's discard, the TTL, the budget): the request's
  blocks are freed -- whole blocks keep their prefix-cache hashes, so the
  resume still finds whatever was not evicted (discard with prefix reuse) --
  and it waits for input without KV; its next chunk starts from a prefix
  lookup.  The session itself ends only when the frontend closes it (free,
  abort, shutdown), so there is one owner of its lifetime and no race
  between a release and a resume.
* **The policy**: at every pause the interception policy decides keep or
  release (InferCept's min-waste, eq. 2 against eq. 4, without swap: see
  the package docstring); before every step
  :func:`~engine_ext.policies.pin_budget.pins_to_release` applies the TTL,
  the pin budget and running requests' need.

Control calls.  The frontend reaches this scheduler through vLLM's utility
RPC: ``EngineCore`` looks the method name up with ``getattr(self, name)``
and calls the result, so ``call_utility_async("scheduler", op, payload)``
calls the scheduler object (:meth:`_Pinning.__call__`) in the engine-core
process, on its busy loop, between steps -- no fork, no second channel.

Sessions count towards vLLM's ``max_num_seqs`` while they wait (vLLM keeps
their model-runner slot), so an engine that keeps many contexts needs a
``max_num_seqs`` above its concurrent requests.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, deque
from typing import Any, Deque, Dict, Optional

from vllm.v1.request import RequestStatus

from ..policies.interception import BatchState, Handling, InterceptedContext
from ..policies.pin_budget import Pin, pins_to_release

log = logging.getLogger(__name__)

KEY = "interlace"
WAITING_INPUT = RequestStatus.WAITING_FOR_STREAMING_REQ


def _hint(req: Any) -> Dict[str, Any]:
    extra = getattr(getattr(req, "sampling_params", None), "extra_args", None) or {}
    return extra.get(KEY) or {}


class _Session:
    """What the scheduler keeps about one resumable request of Interlace's."""

    __slots__ = ("req", "watch", "stop_asked", "pinned_at", "expected_s", "ttl_s", "released", "grammars",
                 "paused")

    def __init__(self, req: Any, ttl_s: float):
        self.req = req
        self.watch: Any = None
        self.stop_asked = False
        self.pinned_at: Optional[float] = None  # when it began to wait with its KV (None: running or released)
        self.expected_s: Optional[float] = None
        self.ttl_s = ttl_s
        self.released = False
        self.grammars: Deque[Any] = deque()     # the structured-output requests of updates not applied yet
        self.paused = False                     # its last chunk stopped on a pause string (a tool call)


def _common_prefix(a: Any, b: Any, limit: int) -> int:
    n = min(limit, len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Pinning:
    """Interlace's sessions and pins in a vLLM scheduler (mix in before
    :class:`~engine_ext.vllm.scheduler._Ranked`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config
        conf = (extra.get(KEY) if isinstance(extra, dict) else None) or {}
        pins = conf.get("pins") or {}
        self.pin_budget = float(pins.get("budget", 0.5))
        self.pin_ttl_s = float(pins.get("ttl_s", 120.0))
        self.pin_policy = _pin_policy(conf)
        self._sessions: Dict[str, _Session] = {}  # by vLLM's (internal) request id
        self._by_sid: Dict[str, str] = {}         # the frontend's session id -> request id
        self.pin_counts: Counter = Counter()
        self._tokenizer: Any = None  # loaded at the first session that pauses on text (False: unavailable)

    def __bool__(self) -> bool:  # EngineCore's utility dispatch tests the looked-up attribute's truth
        return True

    # ------------------------------------------------------------ control
    def __call__(self, op: str, payload: Optional[Dict[str, Any]] = None) -> Any:
        """A control call from the frontend (module docstring)."""
        payload = payload or {}
        if op == "stats":
            return self.pin_stats()
        st = self._sessions.get(self._by_sid.get(str(payload.get("id")), ""))
        if op == "stop":
            if st is None:
                return "gone"
            if st.req.status == WAITING_INPUT:
                return "waiting"
            st.stop_asked = True
            return "stopping"
        if op == "hint":
            if st is not None:
                if payload.get("expected_s") is not None:
                    st.expected_s = float(payload["expected_s"])
                if payload.get("ttl_s") is not None:
                    st.ttl_s = float(payload["ttl_s"])
            return st is not None
        if op == "release":
            if st is not None and st.pinned_at is not None:
                self._release(st, "dropped")
            return st is not None
        nxt = getattr(super(), "__call__", None)  # the ranking's calls (scheduler.py: "capacity")
        if nxt is not None:
            return nxt(op, payload)
        raise ValueError(f"unknown Interlace scheduler call {op!r}")

    def pin_stats(self) -> Dict[str, int]:
        held = [st for st in self._sessions.values() if st.pinned_at is not None]
        return {"sessions": len(self._sessions), "pinned": len(held),
                "pinned_blocks": sum(self._blocks(st.req) for st in held),
                **{k: int(self.pin_counts[k]) for k in ("hits", "expired", "dropped", "discarded", "misses")}}

    # ---------------------------------------------------------- requests
    def add_request(self, request: Any) -> None:
        hint = _hint(request)
        rid, sid = request.request_id, hint.get("session")
        st = self._sessions.get(rid) if sid else None
        if st is not None and self.requests.get(rid) is st.req:  # the next chunk of a live session
            st.grammars.append(request.structured_output_request)
        super().add_request(request)
        if sid and st is None and self.requests.get(rid) is request:
            st = self._sessions[rid] = _Session(request, float(hint.get("ttl_s") or self.pin_ttl_s))
            self._by_sid[str(sid)] = rid
            st.watch = self._watch(request, hint)

    def _update_request_as_session(self, session: Any, update: Any) -> None:
        st = self._sessions.get(session.request_id)
        if st is None:
            return super()._update_request_as_session(session, update)
        new = list(update.prompt_token_ids or ())
        if st.released or session.num_computed_tokens == 0:
            keep = 0
        else:
            # the context's last token is always computed again: its logits sample the chunk's first token
            common = _common_prefix(session.all_token_ids, new, min(session.num_computed_tokens, len(new) - 1))
            keep = self._truncate(session, common)
        if st.pinned_at is not None:
            self.pin_counts["hits"] += 1
        elif st.released:
            self.pin_counts["misses"] += 1
        if keep < session.num_prompt_tokens:
            del session.prompt_token_ids[keep:]
            session.num_prompt_tokens = keep
        session.num_computed_tokens = keep
        super()._update_request_as_session(session, dataclasses.replace(update, prompt_token_ids=new[keep:]))
        # the chunk's grammar (vLLM would keep the first chunk's)
        so = st.grammars.popleft() if st.grammars else None
        session.structured_output_request = so
        if so is not None:
            session.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        # the tokens the kept KV serves count as cached (the chunk's usage), as a prefix-cache hit would
        from vllm.v1.metrics.stats import PrefillStats

        session.prefill_stats = PrefillStats()
        if keep:
            session.prefill_stats.set(num_prompt_tokens=session.num_prompt_tokens, num_local_cached_tokens=keep,
                                      num_external_cached_tokens=0)
        st.watch = self._watch(session, _hint(session))
        st.stop_asked = st.released = st.paused = False
        st.pinned_at = st.expected_s = None

    def _update_request_with_output(self, request: Any, new_token_ids: Any, *args: Any, **kwargs: Any):
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids, *args, **kwargs)
        st = self._sessions.get(request.request_id)
        if st is None or stopped or not new_token_ids:
            return new_token_ids, stopped
        paused = False
        if st.watch is not None:
            for tok in new_token_ids:
                paused = st.watch.add(int(tok)) or paused
        if paused or st.stop_asked:
            request.status = RequestStatus.FINISHED_STOPPED
            st.paused, stopped = paused, True
        return new_token_ids, stopped

    def _handle_stopped_request(self, request: Any) -> bool:
        finished = super()._handle_stopped_request(request)
        st = self._sessions.get(request.request_id)
        if st is None or finished or request.status != WAITING_INPUT:
            return finished
        now = time.monotonic()
        st.pinned_at, st.stop_asked, st.released = now, False, False
        hint = _hint(request)
        if st.paused:
            st.expected_s = hint.get("expected_tool_s")
            if self.pin_policy is not None:
                c_other = sum(int(r.num_computed_tokens) for r in self.running if r is not request)
                ctx = InterceptedContext(context_len=int(request.num_computed_tokens),
                                         num_blocks=self._blocks(request), expected_duration_s=st.expected_s,
                                         tool=hint.get("expected_tool"), id=request.request_id, call_time=now)
                batch = BatchState(context_tokens=c_other, decode_tokens=len(self.running))
                if self.pin_policy.decide(ctx, batch, now) is Handling.DISCARD:
                    self._release(st, "discarded")
        return finished

    def finish_requests(self, request_ids: Any, finished_status: Any, *args: Any, **kwargs: Any):
        out = super().finish_requests(request_ids, finished_status, *args, **kwargs)
        for rid in ([request_ids] if isinstance(request_ids, str) else list(request_ids or ())):
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                self._forget(rid)
        return out

    def _free_request(self, request: Any, *args: Any, **kwargs: Any):
        self._forget(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def _forget(self, rid: str) -> None:
        st = self._sessions.pop(rid, None)
        if st is not None:
            sid = _hint(st.req).get("session")
            if self._by_sid.get(str(sid)) == rid:
                del self._by_sid[str(sid)]

    # --------------------------------------------------------------- step
    def schedule(self, *args: Any, **kwargs: Any):
        if self._sessions:
            self._enforce_pins()
        return super().schedule(*args, **kwargs)

    def _enforce_pins(self) -> None:
        now = time.monotonic()
        held = {rid: st for rid, st in self._sessions.items() if st.pinned_at is not None}
        if not held:
            return
        pins = [Pin(rid, self._blocks(st.req), int(st.req.num_computed_tokens), st.pinned_at, st.ttl_s,
                    st.expected_s) for rid, st in held.items()]
        pool = self.kv_cache_manager.block_pool
        total = max(1, pool.num_gpu_blocks - 1)  # block 0 is vLLM's null block
        for rid, why in pins_to_release(pins, now=now, budget_blocks=int(self.pin_budget * total),
                                        free_blocks=pool.get_num_free_blocks(), need_blocks=self._need_blocks()):
            self._release(held[rid], why)

    def _need_blocks(self) -> int:
        """Blocks the next step needs beyond what requests hold: a new block
        for each running request at a block boundary (its next token) and
        the rest of each running prefill; with nothing running, the head
        of the queue's prompt (so pins cannot block an idle engine)."""
        bs = self.block_size
        need = 0
        for r in self.running:
            left = max(1, int(r.num_tokens) - int(r.num_computed_tokens))
            have = math.ceil(int(r.num_computed_tokens) / bs) * bs - int(r.num_computed_tokens)
            need += max(0, math.ceil((left - have) / bs))
        if not self.running:
            for r in self.waiting:
                if r.status not in (WAITING_INPUT,):
                    need += math.ceil(max(1, int(r.num_tokens) - int(r.num_computed_tokens)) / bs)
                    break
        return need

    # ------------------------------------------------------------ helpers
    def _blocks(self, req: Any) -> int:
        try:
            return sum(len(b) for b in self.kv_cache_manager.get_block_ids(req.request_id))
        except (KeyError, AttributeError):
            return 0

    def _release(self, st: _Session, outcome: str) -> None:
        """Free a waiting session's KV (discard with prefix reuse); it keeps
        waiting for its next chunk, which starts from a prefix lookup."""
        req = st.req
        if st.released or req.status != WAITING_INPUT:
            return
        holding = self._holds_kv_blocks(req)
        self._free_request_blocks(req)
        req.num_computed_tokens = 0
        if holding:
            self.kv_holding_waiting.remove_request(req)
            self.waiting.add_request(req)
        st.released, st.pinned_at = True, None
        self.pin_counts[outcome] += 1

    def _truncate(self, req: Any, common: int) -> int:
        """Cut ``req``'s KV to its first ``common`` tokens (module docstring);
        returns the tokens kept, which may be less (a hashed boundary block)."""
        computed = int(req.num_computed_tokens)
        if common >= computed:
            return computed
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1:  # hybrid models: several block tables to cut alike -- start over instead
            self._free_request_blocks(req)
            return 0
        m, bs, rid = managers[0], self.block_size, req.request_id
        blocks = m.req_to_blocks.get(rid, [])
        cached = m.num_cached_block.get(rid, 0)
        if common % bs and common // bs < cached:
            common -= common % bs  # its block is in the prefix cache: recompute that block's part
        first = -(-common // bs)
        dropped = blocks[first:]
        del blocks[first:]
        if rid in m.num_cached_block:
            m.num_cached_block[rid] = min(cached, first)
        if dropped:
            if self._request_blocks_can_be_freed(req):
                self.kv_cache_manager.block_pool.free_blocks(reversed(dropped))
            else:
                self.deferred_frees.append((self.sched_step_seq, dropped))
        return common

    def _watch(self, req: Any, hint: Dict[str, Any]) -> Any:
        pause_on = hint.get("pause_on")
        if not pause_on:
            return None
        if self._tokenizer is None:
            from ..tokenizer import Tokenizer

            try:
                self._tokenizer = Tokenizer.from_model_dir(self.vllm_config.model_config.model) or False
            except Exception as e:  # noqa: BLE001  (the frontend's stop call still pauses: one step later)
                log.warning("Interlace pins: no tokenizer in the engine core (%s); pauses stop one step late", e)
                self._tokenizer = False
        if self._tokenizer is False:
            return None
        from ..stream_text import PauseWatch

        return PauseWatch(self._tokenizer, list(req.all_token_ids), pause_on,
                          bool(hint.get("skip_special", True)), hint.get("eos") or ())


def _pin_policy(conf: Dict[str, Any]) -> Any:
    """The interception policy that decides, at each pause, whether the
    request's KV stays pinned: InferCept's min-waste without swap (vLLM
    cannot move one request's blocks to host memory: package docstring)
    where a cost-model profile is configured; else keep, bounded by the
    budget and the TTL."""
    from ..policies import Profile
    from ..policies.interception import MinWaste, Preserve

    name = conf.get("interception") or "infercept"
    profile = Profile.from_dict(conf["profile"]) if conf.get("profile") else None
    if name in ("infercept", "heuristic") and profile is not None:
        return MinWaste(profile, swap=False, mode="min-waste" if name == "infercept" else "heuristic")
    return Preserve()
