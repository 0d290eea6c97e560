"""The engine protocol on vLLM's ``AsyncLLM`` in process (see the package
docstring for which vLLM mechanism implements each call and what it
cannot do).  The context bookkeeping, text rules and pause/resume are
:class:`~engine_ext.request_engine.RequestEngine`'s; this module opens
vLLM requests, passes grammars as structured outputs and reads vLLM's
scheduler stats."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Tuple

from .. import errors as E
from ..protocol import SamplingParams
from ..request_engine import Chunk, RequestEngine, _unavailable

log = logging.getLogger(__name__)

_IPC_ENV = "VLLM_RPC_BASE_PATH"
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_ipc_lock = threading.Lock()  # the environment is the process's: one engine start-up sets it at a time


@contextlib.contextmanager
def _own_ipc_dir() -> Any:
    """vLLM binds its ZMQ IPC sockets (front end, engine core, workers) as
    uuid-named files in ``$VLLM_RPC_BASE_PATH`` (default: the temp dir) and
    leaves them there when it shuts down (several per engine).  While an engine
    starts (its processes inherit the environment then), the variable names
    a directory of its own, which :meth:`VLLMEngine.close` removes; yields
    None, changing nothing, where the operator set the variable, where vLLM
    already reads its environment from a cache, or where the temp dir's path
    is too long for a socket address one level further down."""
    with _ipc_lock:
        if os.environ.get(_IPC_ENV) or _envs_cached():
            yield None
            return
        path = _new_dir()
        if len(path) + 37 > _SUN_PATH_MAX:  # '/' + a uuid must fit a Unix socket's address
            os.rmdir(path)
            yield None
            return
        os.environ[_IPC_ENV] = path
        try:
            yield path
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        finally:
            os.environ.pop(_IPC_ENV, None)


def _new_dir() -> str:
    return tempfile.mkdtemp(prefix="interlace-")


def server_env(env: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
    """``env`` for a ``vllm serve`` process, with its socket files and temp
    files in a new directory of their own; returns it too, to remove once the
    process is gone (a killed server also leaves its rendezvous file)."""
    path = _new_dir()
    return {**env, _IPC_ENV: path, "TMPDIR": path}, path


def _envs_cached() -> bool:
    """Whether this process's vLLM caches its environment (an engine core
    run in process turns that on): a path set then is kept for every later
    engine, so its directory must stay."""
    from vllm import envs

    return bool(getattr(envs, "_is_envs_cache_enabled", lambda: False)())


class VLLMEngine(RequestEngine):
    """:class:`~engine_ext.protocol.Engine` over ``vllm.v1.engine.async_llm.AsyncLLM``."""

    def __init__(self, engine_args: Any, tokenizer: Any, *, name: str = "vllm", interception: Any = None,
                 keep_kv: bool = False):
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        super().__init__(tokenizer, name=name, interception=interception)
        engine = self
        #: contexts keep their KV in vLLM between segments (sessions: engine_ext/vllm/sessions.py); else
        #: every pause aborts the request (discard with prefix reuse)
        self.keep_kv = bool(keep_kv)
        self.whole_blocks_only = not self.keep_kv  # a session keeps partial blocks too
        self._pins: Dict[str, int] = {}

        class InterlaceStats(StatLoggerBase):
            """Keeps vLLM's last scheduler stats for stats() (routing, metrics)."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any = None, iteration_stats: Any = None, *a: Any, **k: Any) -> None:
                if scheduler_stats is not None:
                    engine._stats = {"kv_cache_usage": float(scheduler_stats.kv_cache_usage),
                                     "running": int(scheduler_stats.num_running_reqs),
                                     "waiting": int(scheduler_stats.num_waiting_reqs)}

            def log_engine_initialized(self) -> None:
                pass

        from . import scheduler

        async def build() -> Any:
            config = engine_config(engine_args)
            sc = config.scheduler_config
            if sc.scheduler_cls in (scheduler.SYNC, scheduler.ASYNC):  # ours: match vLLM's async scheduling choice
                sc.scheduler_cls = scheduler.ASYNC if sc.async_scheduling else scheduler.SYNC
            return AsyncLLM.from_vllm_config(config, stat_loggers=[InterlaceStats])
        try:
            with _own_ipc_dir() as self._ipc_dir:
                self.llm = self._run(build())
            if self._ipc_dir is not None and _envs_cached():
                self._ipc_dir = None  # cached for later engines now: not ours to remove
        except BaseException:
            self._stop_loop()
            raise
        cfg = self.llm.vllm_config
        self.max_model_len = int(cfg.model_config.max_model_len)
        self.vocab_size = int(cfg.model_config.get_vocab_size())
        self.block_size = int(cfg.cache_config.block_size)
        self.num_blocks = int(getattr(cfg.cache_config, "num_gpu_blocks", 0) or 0)
        self.max_batched_tokens = int(cfg.scheduler_config.max_num_batched_tokens)
        #: sessions hold a vLLM request slot while they wait: at most half of max_num_seqs, so new work
        #: always finds slots (the least recently used idle context's session ends first; else a plain request)
        self.max_sessions = max(1, int(cfg.scheduler_config.max_num_seqs) // 2)
        #: Parrot's caps, as the scheduler in the engine core applies them (scheduler.py)
        self.capacity = scheduler.build_capacity((cfg.additional_config or {}).get(scheduler.CONFIG_KEY) or {})
        self._capacity_core: Dict[str, int] = {}  # the scheduler's last capacity numbers (capacity_held, ...)
        self._capacity_asking = False
        self._sessions_lru: "OrderedDict[Any, Any]" = OrderedDict()
        mc = cfg.model_config
        self.kv_bytes_per_token = (2 * mc.get_num_layers(cfg.parallel_config) * mc.get_total_num_kv_heads()
                                   * mc.get_head_size() * mc.dtype.itemsize)

    @staticmethod
    def _params(sampling: SamplingParams, max_tokens: int, extra: Dict[str, Any], grammar: Any) -> Any:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        kw: Dict[str, Any] = dict(
            max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k or 0, seed=sampling.seed, ignore_eos=sampling.ignore_eos,
            stop_token_ids=list(sampling.stop_token_ids), logprobs=0 if sampling.logprobs else None,
            detokenize=False, skip_special_tokens=sampling.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA, extra_args={"interlace": extra})
        if grammar is not None:
            kw["structured_outputs"] = grammar
        return VSP(**kw)

    def _stream(self, ctx: Any, rid: str, prompt: List[int], sampling: SamplingParams, max_tokens: int,
                extra: Dict[str, Any], grammar: Any) -> Any:
        """With ``keep_kv``, the segment is the next chunk of the context's
        session, which keeps the KV when the segment ends; the scheduler
        stops it on the same pause strings (``extra``: what it reads)."""
        if not self.keep_kv or sampling.seed is not None:
            # vLLM 0.32's model runner keeps a session's first chunk's random generator
            # (GPUModelRunner._update_streaming_request): a seeded segment runs as a request of its own
            self._forget(ctx)
            return super()._stream(ctx, rid, prompt, sampling, max_tokens, extra, grammar)
        from .sessions import Segment

        if not self._session_slot(ctx):
            return super()._stream(ctx, rid, prompt, sampling, max_tokens, extra, grammar)
        stops = set() if sampling.ignore_eos else set(self.eos_token_ids)
        stops |= set(sampling.stop_token_ids)

        def params(sid: str) -> Any:
            chunk = {**extra, "session": sid, "pause_on": list(sampling.pause_on),
                     "skip_special": sampling.skip_special_tokens, "eos": sorted(stops)}
            return self._params(sampling, max_tokens, chunk, grammar)
        return Segment(self, ctx, prompt, params, bool(sampling.logprobs))

    def _session_slot(self, ctx: Any) -> bool:
        """Whether ``ctx`` may decode in a session: it has one, or one is free
        or can be freed (the least recently used idle context's ends)."""
        lru = self._sessions_lru
        if ctx.backend is not None and ctx.backend.state != "ended":
            lru[ctx.id] = ctx
            lru.move_to_end(ctx.id)
            return True
        lru.pop(ctx.id, None)
        while len(lru) >= self.max_sessions:
            idle = next((c for c in lru.values() if c.gen is None and not c.busy), None)
            if idle is None:
                return False
            self._forget(idle)
        lru[ctx.id] = ctx
        return True

    def _forget(self, ctx: Any) -> None:
        if self._sessions_lru.get(ctx.id) is ctx:
            del self._sessions_lru[ctx.id]
        if ctx.backend is not None:
            ctx.backend.end()
            ctx.backend = None

    def _pause(self, ctx: Any, gen: Any, hint: Any, event: Any = None) -> None:
        super()._pause(ctx, gen, hint, event)
        if ctx.backend is not None and hint is not None and hint.expected_duration_s is not None:
            self._control("hint", {"id": ctx.backend.sid, "expected_s": hint.expected_duration_s})

    async def park(self, context_id: Any, hint: Any = None) -> None:
        """Also tells the scheduler how long the kept context is expected to
        wait (the hint's duration) and how long it may (``extra["ttl_s"]``:
        the retention store's TTL for a client-side call)."""
        await super().park(context_id, hint)

        def send() -> None:
            ctx = self.contexts.get(context_id)
            if ctx is not None and ctx.backend is not None and hint is not None:
                self._control("hint", {"id": ctx.backend.sid, "expected_s": hint.expected_duration_s,
                                       "ttl_s": (hint.extra or {}).get("ttl_s")})
        self._post(send)

    async def release_kv(self, context_id: Any) -> bool:
        """Drop the context's kept KV now (its whole blocks stay in vLLM's
        prefix cache); the context stays usable and its next segment
        recomputes what was evicted.  False where nothing was kept."""
        return bool(await self._session_call("release", context_id))

    async def pin_hint(self, context_id: Any, *, expected_s: Optional[float] = None,
                       ttl_s: Optional[float] = None) -> bool:
        """Tell the scheduler how long the context's kept KV is expected to
        wait (the pin budget's order) and may wait (its TTL)."""
        return bool(await self._session_call("hint", context_id, expected_s=expected_s, ttl_s=ttl_s))

    async def _session_call(self, op: str, context_id: Any, **payload: Any) -> Any:
        async def call() -> Any:
            ctx = self._get(context_id)
            if not self.keep_kv or ctx.backend is None or ctx.backend.state == "ended":
                return False
            return await self.llm.engine_core.call_utility_async("scheduler", op, {"id": ctx.backend.sid,
                                                                                   **payload})
        return await self._call(call())

    def _control(self, op: str, payload: Dict[str, Any]) -> None:
        """A control call to the scheduler (``pins``), in the background; a failure is logged."""
        async def call() -> None:
            try:
                await self.llm.engine_core.call_utility_async("scheduler", op, payload)
            except Exception as e:  # noqa: BLE001  (a hint or a release that did not land changes no result)
                log.warning("vLLM scheduler call %s failed: %s", op, e)
        self._loop.create_task(call())

    async def fetch_pin_stats(self) -> Dict[str, int]:
        """The scheduler's pins now (sessions, pinned blocks, hits, expired,
        dropped, discarded, misses) with the frontend's resume counts."""
        async def fetch() -> Dict[str, int]:
            if self.keep_kv:
                self._pins = dict(await self.llm.engine_core.call_utility_async("scheduler", "stats"))
            return self.pin_stats()
        return await self._call(fetch())

    def pin_stats(self) -> Dict[str, int]:
        """The last pin counts fetched (:meth:`fetch_pin_stats`) and the resume counts; with the engine
        core gone, no pins (its blocks went with it)."""
        out = {**self._pins, **self.resume_counts}
        if not self.alive:
            out.update(sessions=0, pinned=0, pinned_blocks=0)
        elif self.keep_kv:  # the next read sees fresher counts (a scrape never waits on the engine core)
            self._post(lambda: self._loop.create_task(self._refresh_pins()))
        return out

    def load_stats(self) -> Dict[str, Any]:
        """The request engine's load, with kept KV the pins (``pinned_blocks``, ``pinned``,
        ``pin_<outcome>``, ``recomputed_after_resume``: gateway/metrics.py), and Parrot's capacity
        regulation under the native engine's keys.

        ``capacity_tokens`` (the cap in force now; 0: none but memory), ``active_tokens`` and
        ``latency_running`` are this frontend's view, current at once (routing reads them right
        after placing work): its contexts generating or filling, their token lists and their hints'
        objectives -- what the scheduler in the engine core sees a step later.  ``capacity_held``
        (requests the cap held back at the scheduler's last step) and ``capacity_held_steps``
        exist only in the engine core: vLLM's ``SchedulerStats`` has no field to carry them, so they
        are the last numbers fetched through the utility RPC (:meth:`fetch_capacity_stats`; each
        read asks for fresher ones in the background, as the pins do) -- 0 before the first
        answer and once the engine core is gone."""
        out = super().load_stats()
        if self.keep_kv:
            pins = self.pin_stats()
            out.update(pinned_blocks=pins.get("pinned_blocks", 0), pinned=pins.get("pinned", 0),
                       recomputed_after_resume=pins.get("recomputed_after_resume", 0),
                       **{f"pin_{k}": pins.get(k, 0) for k in ("hits", "expired", "dropped", "discarded", "misses")})
        out.update(self._capacity_view())
        core = self._capacity_core if self.alive else {}
        out["capacity_held"] = int(core.get("capacity_held", 0)) if out["active_tokens"] else 0
        out["capacity_held_steps"] = int(core.get("capacity_held_steps", 0))
        if self.capacity.enabled and not self._capacity_asking and self.alive and self._loop.is_running():
            self._capacity_asking = True
            self._post(lambda: self._loop.create_task(self._refresh_capacity()))
        return out

    def _capacity_view(self) -> Dict[str, int]:
        from types import SimpleNamespace

        from ..policies.capacity import is_latency

        work = []
        for ctx in list(self.contexts.values()):
            gen = ctx.gen
            if ctx.busy or (gen is not None and not gen.paused and not gen.done):
                h = ctx.hint or (gen.hint if gen is not None else None)
                work.append(SimpleNamespace(sched=SimpleNamespace(objective=getattr(h, "objective", None)),
                                            n=len(ctx.token_ids)))
        cap = self.capacity
        return {"capacity_tokens": (cap.limit(work) if cap.enabled else None) or 0,
                "active_tokens": sum(w.n for w in work),
                "latency_running": sum(1 for w in work if is_latency(w)),
                "capacity_latency_tokens": cap.latency_tokens or 0,
                "capacity_throughput_tokens": cap.throughput_tokens or 0}

    async def fetch_capacity_stats(self) -> Dict[str, int]:
        """The scheduler's capacity numbers now, as the engine core sees them
        (``capacity_tokens``, ``active_tokens``, ``latency_running``,
        ``capacity_held``, ``capacity_held_steps``, the configured caps)."""
        async def fetch() -> Dict[str, int]:
            self._capacity_core = dict(await self.llm.engine_core.call_utility_async("scheduler", "capacity"))
            return dict(self._capacity_core)
        return await self._call(fetch())

    async def _refresh_capacity(self) -> None:
        try:
            self._capacity_core = dict(await self.llm.engine_core.call_utility_async("scheduler", "capacity"))
        except Exception as e:  # noqa: BLE001  (metrics keep the last counts)
            log.debug("capacity stats: %s", e)
        finally:
            self._capacity_asking = False

    async def _refresh_pins(self) -> None:
        try:
            self._pins = dict(await self.llm.engine_core.call_utility_async("scheduler", "stats"))
        except Exception as e:  # noqa: BLE001  (metrics keep the last counts)
            log.debug("pin stats: %s", e)

    async def _open(self, rid: str, prompt: List[int], sampling: SamplingParams, max_tokens: int,
                    extra: Dict[str, Any], grammar: Any) -> AsyncIterator[Chunk]:
        # arrival_time: a request resumed after a tool call keeps its job's place (InferCept's improved discard)
        stream = self.llm.generate({"prompt_token_ids": prompt}, self._params(sampling, max_tokens, extra, grammar),
                                   request_id=rid)
        try:
            async for out in stream:
                o = out.outputs[0]
                lps: List[Optional[float]] = []
                if sampling.logprobs:
                    for tok, entry in zip(o.token_ids, o.logprobs or []):
                        lp = entry.get(tok) if entry else None
                        lps.append(float(lp.logprob) if lp is not None else None)
                # num_cached_tokens: the prompt's prefix-cache hits, in whole blocks (None before scheduling)
                yield Chunk(list(o.token_ids), lps, out.finished, o.finish_reason,
                            getattr(out, "num_cached_tokens", None))
        finally:
            await stream.aclose()  # aborts the vLLM request if it is still running

    def _grammar(self, parts: Dict[str, Any]) -> Any:
        """vLLM runs grammars itself (structured outputs, llguidance backend)."""
        from vllm.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams(**parts)

    async def _shutdown(self) -> None:
        for ctx in list(self.contexts.values()):
            self._forget(ctx)
        try:
            self.llm.shutdown()
        finally:
            if self._ipc_dir is not None:  # its processes are gone: their sockets go too
                shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _backend_failed(self) -> bool:
        return bool(self.llm.errored)

    def _backend_error(self, e: BaseException) -> Optional[E.EngineError]:
        name = type(e).__name__
        if name in ("EngineDeadError",) or self.llm.errored:
            self._dead = f"{name}: {e}"
            return _unavailable(f"the {self.name} engine failed: {name}: {e}")
        if name in ("VLLMValidationError",) or isinstance(e, ValueError):
            return E.InvalidSampling(f"vLLM refused the request: {e}")
        return None


def _resolve_model(model: str) -> str:
    if model == "embedded":
        from ..embedded import embedded_model_dir

        return str(embedded_model_dir())
    return model


#: vLLM's scheduler with Interlace's ranking (its async twin is picked when vLLM schedules asynchronously)
SCHEDULER = "interlace.engine_ext.vllm.scheduler.InterlaceScheduler"


def engine_args(engine: Dict[str, Any], model_path: str, policy: Any = None, profile: Any = None,
                pins: Optional[Dict[str, float]] = None) -> Any:
    """vLLM's ``AsyncEngineArgs`` for an ``engine: {kind: vllm, ...}`` block."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from .scheduler import interlace_config

    model = _resolve_model(str(engine.get("model") or model_path))
    kw: Dict[str, Any] = {"model": model, "enable_prefix_caching": bool(getattr(policy, "prefix_caching", True)),
                          "scheduler_cls": SCHEDULER,
                          "structured_outputs_config": {"backend": "guidance"}}
    for key in ("dtype", "tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend",
                "gpu_memory_utilization", "max_model_len", "enforce_eager", "max_num_seqs",
                "max_num_batched_tokens"):
        if engine.get(key) is not None:
            kw[key] = engine[key]
    if kw.get("dtype") == "auto":
        del kw["dtype"]
    conf = interlace_config(ranking=getattr(policy, "ranking", "fcfs") if policy else "fcfs", profile=profile,
                            interception=getattr(policy, "interception", "preserve") if policy else "preserve",
                            starvation_threshold=getattr(policy, "starvation_threshold", 100) if policy else 100,
                            refresh_interval=getattr(policy, "refresh_interval", 1) if policy else 1,
                            horizon=getattr(policy, "horizon", "job") if policy else "job",
                            handling_at_call=bool(getattr(policy, "handling_at_call", False)) if policy else False,
                            pins=pins, capacity=_capacity(policy))
    kw["additional_config"] = {"interlace": conf}
    extra = dict(engine.get("args") or {})
    clash = sorted(set(extra) & {"model", "scheduler_cls", "additional_config"})
    if clash:
        raise ValueError(f"engine.args may not set {', '.join(clash)} (Interlace sets them)")
    kw.update(extra)
    try:
        return AsyncEngineArgs(**kw)
    except TypeError as e:  # an unknown vLLM argument in engine.args
        raise ValueError(f"engine.args: {e} (see `vllm serve --help` for vLLM {_version()}'s engine arguments)") \
            from None


def _capacity(policy: Any) -> Any:
    """The policy's capacity caps (``PolicySpec.capacity()``); none for a
    policy without them (the engine library's default: regulation off, as
    on the native engine)."""
    from ..policies.capacity import NO_CAPACITY

    make = getattr(policy, "capacity", None)
    return make() if callable(make) else NO_CAPACITY


def engine_config(args: Any) -> Any:
    """vLLM's whole engine configuration for ``args`` -- where vLLM checks
    the arguments against the model (heads divisible by the tensor-parallel
    size, the length fitting the model, ...) -- with its refusal as one
    ValueError line instead of a pydantic report."""
    try:
        return args.create_engine_config()
    except Exception as e:  # noqa: BLE001  (pydantic's ValidationError, vLLM's ValueError...)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        msg = next((ln for ln in lines if ln.startswith("Value error,")), lines[-1] if lines else repr(e))
        msg = msg.removeprefix("Value error,").split(" [type=")[0].strip()
        raise ValueError(f"vLLM refuses this engine: {msg}") from None


def _version() -> str:
    import vllm

    return str(vllm.__version__)


def load_vllm_engine(engine: Dict[str, Any], model_path: str, policy: Any = None, *, name: str = "vllm") -> VLLMEngine:
    """A :class:`VLLMEngine` for the gateway's ``engine: {kind: vllm, ...}``.

    ``policy`` (the model's PolicySpec) names the ranking that runs inside
    vLLM's scheduler, and its capacity caps (``PolicySpec.capacity()``; none
    without a policy).  Its interception policy is always *discard* here
    (the only handling vLLM can do, see the package docstring): LAMPS
    predicts that handling, and the policy's tool-duration predictor is
    shared with the gateway.  Rankings that need a cost model get the
    configured profile file, or with ``profile: auto`` one measured through
    this engine (:mod:`engine_ext.vllm.profile`), cached so only the first
    start-up pays: that start-up runs vLLM twice, once to measure."""
    from ..tokenizer import Tokenizer
    from ..policies import ToolDurations, make_interception
    from ..policies.costmodel import Profile

    if engine.get("kv_cache_space_gb") is not None:  # the CPU build sizes its KV cache from the environment
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(engine["kv_cache_space_gb"])
    ranking = getattr(policy, "ranking", "fcfs") if policy else "fcfs"
    asked = getattr(policy, "interception", "discard") if policy else "discard"
    keep_kv = asked not in ("discard", "vllm")
    if asked.startswith("swap"):
        log.info("vLLM 0.32 cannot swap one request's KV to host memory (engine_ext/vllm docstring): "
                 "interception %s keeps or releases pins by min-waste instead", asked)
    policy = _replace_policy(policy, ranking=ranking, interception=asked)
    profile = None
    pname = getattr(policy, "profile", "auto")
    if ranking == "lamps" or (keep_kv and asked in ("infercept", "heuristic") and pname != "auto"):
        profile = Profile.load(pname) if pname != "auto" else _auto_profile(engine, model_path, policy, name)
        blocks = (engine.get("args") or {}).get("num_gpu_blocks_override")
        if blocks:  # the cache this engine will have, not the measured one's
            bs = (engine.get("args") or {}).get("block_size") or profile.block_size
            profile = dataclasses.replace(profile, kv_capacity_tokens=int(blocks) * int(bs))
    pins = {"budget": float(engine.get("pin_budget", 0.5)), "ttl_s": float(engine.get("pin_ttl_s", 120.0))} \
        if keep_kv else None
    if keep_kv:
        _refuse_unsafe_offload(engine.get("args") or {})
    args = engine_args(engine, model_path, policy, profile, pins)
    tokenizer = Tokenizer.from_model_dir(args.model, needed_by="the vllm engine")
    interception = make_interception("discard", profile, ToolDurations())  # the gateway's tool-duration predictor
    return VLLMEngine(args, tokenizer, name=name, interception=interception, keep_kv=keep_kv)


def _refuse_unsafe_offload(args: Dict[str, Any]) -> None:
    """Kept KV with vLLM's ``OffloadingConnector`` could load a context's old
    content after it was cut (its per-request offload keys only grow): refused,
    naming what works (package docstring, "Swap")."""
    kv = args.get("kv_transfer_config") or {}
    connector = kv.get("kv_connector") if isinstance(kv, dict) else getattr(kv, "kv_connector", None)
    if connector == "OffloadingConnector" or (args.get("kv_offloading_size") and not connector):
        raise ValueError("engine.args: vLLM's OffloadingConnector cannot serve kept (pinned) contexts -- a context "
                         "continued with other tokens would be looked up under its old content; use "
                         "kv_connector: SimpleCPUOffloadConnector (with lazy_offload: true), or interception: discard")


def _auto_profile(engine: Dict[str, Any], model_path: str, policy: Any, name: str) -> Any:
    """The cached measured profile of this model on this vLLM build and
    device, measured now (on an FCFS engine started for it) if missing."""
    import re

    from ..native.loader import cache_root
    from ..tokenizer import Tokenizer
    from ..policies.costmodel import Profile, ProfileError
    from .profile import METHOD, measure_request_profile

    model = _resolve_model(str(engine.get("model") or model_path))
    device = _device()
    knobs = {k: engine.get(k) for k in ("dtype", "max_num_batched_tokens", "tensor_parallel_size",
                                        "pipeline_parallel_size")}
    knobs["block_size"] = (engine.get("args") or {}).get("block_size")
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{Path(model).name}-vllm-{device}-"
                 + "-".join(f"{v}" for v in knobs.values()) + f"-m{METHOD}")
    path = cache_root() / "profiles" / f"{key}.json"
    if path.is_file():
        try:
            return Profile.load(path)
        except ProfileError as e:
            log.warning("ignoring the cached profile %s: %s", path, e)
    log.warning("measuring a profile of %s on vLLM (once; cached in %s)", model, path)
    args = engine_args(engine, model_path, _replace_policy(policy, ranking="fcfs"), None)
    with VLLMEngine(args, Tokenizer.from_model_dir(args.model, needed_by="the vllm engine"),
                    name=f"{name}-profile") as probe:
        prof = measure_request_profile(probe, model=Path(model).name, device=device,
                                       kv_bytes_per_token=probe.kv_bytes_per_token)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    prof.save(tmp)
    os.replace(tmp, path)
    return prof


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # a label only
        pass
    from ..machine import cpu_description

    try:
        return f"cpu: {cpu_description()['model_name']}"
    except Exception:  # a label only
        import platform

        return f"cpu: {platform.processor() or platform.machine()}"


def _replace_policy(policy: Any, **changes: Any) -> Any:
    import dataclasses

    if policy is None:
        from types import SimpleNamespace

        return SimpleNamespace(prefix_caching=True, starvation_threshold=100, refresh_interval=1, **changes)
    return dataclasses.replace(policy, **changes)
