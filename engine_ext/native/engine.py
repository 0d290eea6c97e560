"""The native engine: Fill / Generate / FreeContext / pause / resume over a
paged, shareable KV cache, with continuous batching.

All engine state (contexts, blocks, the running batch) belongs to one engine
thread, so a forward pass never blocks the asyncio event loop that serves
HTTP.  The public coroutines send a command to that thread and await its
future; each command validates everything first and raises a typed error
before changing anything, so a failed call leaves the engine as it was.
Token events travel back with ``loop.call_soon_threadsafe``: those of one
step (or of a failed step, or of close) together, one call per consumer
loop at the step's end (``channel.Outbox``: one per token per stream was a
large part of a GPU step's host time at batch 256, issue 36; figures in
``channel.py``); a command's (pause, free) at once, ahead of its answer.

Cancellation leaves nothing behind: a command whose caller is cancelled
before the engine thread takes it is skipped; a cancelled ``generate`` is
aborted (even before its first token); a cancelled ``fill`` is undone, so
its caller may retry it.  After :meth:`NativeEngine.close`, every call (and
every call still waiting) raises :class:`~interlace.engine_ext.errors.EngineClosed`;
a failed step fails every stream and fill it could have touched.

This module is the engine's loop; its rooms, as nano-vllm splits its
engine (``llm_engine.py``, ``scheduler.py``):

* the step (:meth:`NativeEngine._step`): plan the intercepted contexts,
  schedule (``scheduler.py``), run the forward pass (``model_runner.py``),
  postprocess (``output.py``);
* the context commands (``contexts.py``): fill, fork, generate, free,
  truncate, pause, resume, park, and the undo of cancelled fills;
* interception (``interception.py``, InferCept): paused and parked contexts
  preserved, discarded or swapped to a host pool, the KV they waste, the
  swap budget per step;
* token output (``output.py``): a step's computed tokens booked, one token
  sampled per generation and turned into text, stop, pause, finish or failure;
* loading (``loader.py``: weights, dtype, tokenizer) and the attention backend
  (``attention.py``), both chosen before the engine starts.

Ranking policies order the work; the engine keeps each context's ``sched``
current for them (:meth:`NativeEngine._rank_state`).  A capacity policy
(Parrot's, ``capacity``) bounds the tokens run beside latency-critical work;
the scheduler holds what does not fit (``scheduler.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Dict, Hashable, List, Optional, Sequence

import torch

from .. import errors as E
from ..channel import Channel, Outbox
from ..policies.capacity import CapacityPolicy, is_latency
from ..policies.costmodel import Profile
from ..policies.interception import Handling, InterceptionPolicy, Preserve
from ..policies.ranking import FCFS, RankingPolicy, RankState
from ..protocol import PauseHint, RequestHint, SamplingParams, TokenEvent
from ..tokenizer import Tokenizer
from . import memory
from .attention import choose_backend
from .block_manager import BlockManager
from .block_sharing import VariantSet
from .contexts import ContextCommands, apply_hint
from .cores import ThreadGovernor
from .interception import Interceptor
from .loader import load_for_engine
from .model_runner import ModelRunner
from .models.llama import LlamaForCausalLM
from .output import TokenOutput
from .scheduler import Scheduler
from .sequence import Context, FillOp, State
from .swap import Swapper

log = logging.getLogger(__name__)


class NativeEngine:
    """Implements :class:`interlace.engine_ext.protocol.Engine`.

    Build it from a model path (HF directory or GGUF) with :meth:`load`, or
    from an in-memory model with the constructor (tests use tiny random ones).
    """

    def __init__(self, model: LlamaForCausalLM, tokenizer: Optional[Tokenizer] = None, *,
                 block_size: int = 16, num_blocks: Optional[int] = None, kv_cache_tokens: int = 16384,
                 max_batched_tokens: int = 512, max_seqs: int = 256, max_model_len: Optional[int] = None,
                 kv_dtype: Optional[torch.dtype] = None, interception: Optional[InterceptionPolicy] = None,
                 ranking: Optional[RankingPolicy] = None, eos_token_ids: Sequence[int] = (),
                 name: str = "model", profile: Optional[Profile] = None, host_pool_tokens: Optional[int] = None,
                 prefix_caching: bool = True, variants: Optional["VariantSet"] = None,
                 attention: str = "torch", cuda_graphs: Optional[bool] = None,
                 gpu_memory_utilization: Optional[float] = None, adapt_threads: bool = True,
                 capacity: Optional[CapacityPolicy] = None):
        """``profile`` is the cost model for the swap budget and recomputation
        chunks (else the interception policy's own, else none: swaps move the
        whole context at once and recomputation is not chunked).
        ``host_pool_tokens``: the host swap pool (default: as large as the
        KV cache; 0: no swapping, swaps fall back to discard).
        ``prefix_caching=False``: no automatic prefix caching.
        ``variants``: fine-tuned variants of ``model`` served in the same
        batches (:mod:`.block_sharing`); a fill creating a context names one.
        ``attention``: the attention backend (:mod:`.attention`): ``torch``
        (the default: gathers the blocks; the reference numerics), ``kernel``
        (the compiled CPU kernel reading them in place, :mod:`.cpu_attention`;
        an error where it cannot be built), ``triton`` (KV store, chunked
        prefill and decode attention as Triton kernels, :mod:`.kernels`; on a
        machine without CUDA under Triton's interpreter: for tests) or
        ``auto`` (the CPU kernel on a CPU where it builds, Triton on a GPU
        where it is installed, else torch).
        ``cuda_graphs``: decode-only steps replayed as CUDA graphs
        (:mod:`.cuda_graphs`; the Triton attention only).  None (default): on
        with CUDA and the Triton attention; ``True`` on a CPU runs the same
        padded static-buffer path eagerly (for tests); ``False``: off.
        ``gpu_memory_utilization`` (CUDA only; ignored on a CPU): the share of
        the GPU's memory this engine may use; the KV cache gets what the
        weights and a measured activation peak leave of it (:mod:`.memory`),
        instead of ``kv_cache_tokens`` (which then sizes the default host
        pool: pinned host memory as large as a GPU's cache would be too much).
        None: ``kv_cache_tokens``.
        ``adapt_threads`` (CPU only; default on): each step runs on as many of
        torch's threads (at most the engine thread's count at start, i.e.
        ``engine.threads`` or the usable cores) as there are free cores,
        re-chosen while the engine runs (:mod:`.cores`): beside a busy
        neighbour a fixed count stalls every parallel region.  ``False``:
        the count stays as it was.
        ``capacity``: Parrot's capacity regulation (:mod:`..policies.capacity`:
        the tokens run beside latency-critical work, held otherwise).  None
        (default): none, every context runs as memory allows (the gateway
        configures one: ``engine.capacity``)."""
        if not isinstance(adapt_threads, bool):
            raise ValueError(f"adapt_threads must be true or false, got {adapt_threads!r}")
        self._adapt_threads = adapt_threads
        self.threads: Optional["ThreadGovernor"] = None  # the engine thread's, on a CPU with adapt_threads
        self._fixed_threads = 0  # the engine thread's torch threads at start (CPU)
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, got {cuda_graphs!r}")
        if gpu_memory_utilization is not None:
            gpu_memory_utilization = memory.check_utilization(gpu_memory_utilization)
        if host_pool_tokens is not None and (not isinstance(host_pool_tokens, int) or host_pool_tokens < 0):
            raise ValueError(f"host_pool_tokens must be a non-negative integer, got {host_pool_tokens!r}")
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        self.block_size = block_size
        kv_dtype = kv_dtype or next(model.parameters()).dtype
        backend = choose_backend(attention, self.device)
        sized_by_memory = num_blocks is None and gpu_memory_utilization is not None and self.device.type == "cuda"
        if sized_by_memory:
            num_blocks = memory.blocks_from_memory(model, gpu_memory_utilization, max_batched_tokens, block_size,
                                                   kv_dtype, self.device, backend)
        num_blocks = num_blocks or max(1, kv_cache_tokens // block_size)
        self.max_model_len = min(max_model_len or self.cfg.max_position_embeddings, num_blocks * block_size)
        self.vocab_size = self.cfg.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else frozenset())
        if variants is not None and variants.model is not model:
            raise ValueError("variants must be built over this engine's model")
        self.variants = variants
        if host_pool_tokens is None:  # as large as the cache; a cache sized from GPU memory: kv_cache_tokens
            host_pool_tokens = kv_cache_tokens if sized_by_memory else num_blocks * block_size
        host_blocks = host_pool_tokens // block_size
        runner_args = (model, num_blocks, block_size, kv_dtype, self.device, variants, backend,
                       dict(max_seqs=max_seqs, max_model_len=self.max_model_len, cuda_graphs=cuda_graphs))
        self.runner: Optional[ModelRunner] = None  # allocated by the engine thread (see _loop)

        self.contexts: Dict[Hashable, Context] = {}
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "forward_s": 0.0,
                      "swap_out_blocks": 0, "swap_in_blocks": 0, "recomputed_tokens": 0, "kv_waste_token_s": 0.0,
                      "handlings": {h.value: 0 for h in Handling}, "host_used_blocks": 0}
        self.iteration_s = 0.0  # a recent forward pass's seconds (moving average), for the ranking
        self.swap_trace: Optional[List[tuple]] = None  # set to a list: (step, out, in, limit) per step that swapped
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.blocks, ranking or FCFS(), max_batched_tokens, max_seqs,
                                   inactive=self._inactive_contexts)
        self.scheduler.rank_state = self._rank_state
        if capacity is not None:
            if not isinstance(capacity, CapacityPolicy):
                raise TypeError(f"capacity must be a CapacityPolicy, got {type(capacity).__name__}")
            self.scheduler.capacity = capacity
        # the step's collaborators, each over the scheduler and blocks; the swapper comes with the KV cache
        self.interceptor = Interceptor(self.scheduler, self.blocks, self.stats, interception or Preserve(), profile)
        self.scheduler.release = self.interceptor.release_kv  # a dropped context's KV goes from the host pool too
        self.output = TokenOutput(self.scheduler, self.blocks, self.interceptor, self.stats, self.eos_token_ids,
                                  self.max_model_len)
        self.commands = ContextCommands(self.contexts, self.scheduler, self.blocks, self.interceptor, self.output,
                                        tokenizer=tokenizer, vocab_size=self.vocab_size,
                                        max_model_len=self.max_model_len, variants=variants, name=name)

        self._cmds: "queue.SimpleQueue" = queue.SimpleQueue()
        self._outbox = Outbox()  # the engine thread's token events: a step's go out together
        self._closed = False   # close() was called: no new commands
        self._stopped = False  # the engine thread has finished: nothing will run a queued command
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._loop, args=(runner_args, host_blocks, started), name="interlace-engine",
                                        daemon=True)
        self._thread.start()
        started.result()  # the KV cache allocation's error (out of memory), if any

    @property
    def swap(self) -> Optional[Swapper]:
        """The host swap pool and its queues (allocated by the engine thread with the KV cache)."""
        return self.interceptor.swap

    @property
    def intercepted(self) -> Dict[Hashable, Context]:
        """Paused or parked contexts, by id."""
        return self.interceptor.intercepted

    @property
    def interception(self) -> InterceptionPolicy:
        return self.interceptor.policy

    @property
    def profile(self) -> Optional[Profile]:
        """The cost model given to the engine (the interception policy may carry its own)."""
        return self.interceptor.profile

    @property
    def variant_names(self) -> frozenset:
        """The model variants this engine serves (its own name without variants)."""
        return frozenset(self.variants.names()) if self.variants is not None else frozenset({self.name})

    @classmethod
    def load(cls, model_path: str | Path, *, dtype: Optional[str] = None, device: Optional[str] = None,
             weights: Optional[str] = None, **kw: Any) -> "NativeEngine":
        """``dtype`` float32 (the default on a CPU: the reference numerics, token
        for token equal to transformers; ``auto``, bfloat16, on a GPU), bfloat16, float16, or ``auto``: see
        :func:`~.loader.resolve_dtype`.  ``weights``: how the weight matmuls are
        stored (default: dense in ``dtype``): ``float32``, ``bfloat16``,
        ``int8`` (per output channel, from the float weights) or
        ``as-shipped`` (a GGUF's quantized tensors): see
        :func:`~.loader.resolve_weights` and docs/quantization.md.  The valid
        names: :mod:`.options`; ``kw``: the constructor's."""
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model, tok, name = load_for_engine(model_path, dtype=dtype, weights=weights, device=dev)
        kw.setdefault("name", name)
        return cls(model, tok, **kw)

    # ================================================================ public API
    async def fill(self, context_id: Hashable, token_ids: Sequence[int],
                   parent_context_id: Optional[Hashable] = None, hint: Optional[RequestHint] = None,
                   variant: Optional[str] = None, *, op: Optional[FillOp] = None) -> int:
        """A fill whose caller is cancelled is undone (its tokens removed, a
        context it created dropped), so the caller can retry it safely.  The
        one exception: another call has already built on it (extended,
        generated into the context), in which case it stays.  ``hint``: the
        ranking fields it seeds (its objective and task group rank the
        prefill).  ``variant``: the
        model variant a new context runs (default: the base model); a fork
        runs its parent's, and naming another is an error.  ``op``: a
        :class:`~.sequence.FillOp` to record the fill in, for a caller that
        may have to undo it after its answer (:meth:`undo_fill`: the worker
        process, where a cancel can cross the answer)."""
        op = op if op is not None else FillOp(None)
        try:
            return await self._call(self.commands.fill, context_id, list(token_ids), parent_context_id, op, hint,
                                    variant)
        except asyncio.CancelledError:
            self.undo_fill(op)
            raise

    def undo_fill(self, op: FillOp) -> None:
        """Undo the fill recorded in ``op`` (see :meth:`fill`) as if its caller had been cancelled;
        non-blocking.  Nothing happens if it failed, or another call has built on it since."""
        self._post(lambda: self.commands.undo_fill(op))

    async def generate(self, context_id: Hashable, sampling: Optional[SamplingParams] = None,
                       parent_context_id: Optional[Hashable] = None,
                       hint: Optional[RequestHint] = None) -> AsyncIterator[TokenEvent]:
        """``hint`` seeds the ranking's view of the request (LAMPS: expected
        output and tool call)."""
        sampling = sampling or SamplingParams()
        ch = Channel()
        emit = self._outbox.emitter(ch)  # one object: the generation keeps it, abort finds the stream by it
        events = ch.events(self._call(self.commands.generate, context_id, sampling, parent_context_id, emit, hint),
                           lambda: self._post(lambda: self.commands.abort(context_id, emit)))
        async with contextlib.aclosing(events):  # a consumer that leaves early stops the decoding at once
            async for ev in events:
                yield ev

    async def free_context(self, context_id: Hashable) -> None:
        await self._call(self.commands.free, context_id)

    def free_context_nowait(self, context_id: Hashable) -> None:
        """Queue a free without waiting (for cleanup code that may itself be
        cancelled, e.g. when an HTTP client disconnects).  Errors are ignored:
        the context may be gone already."""
        self._post(lambda: self.commands.free(concurrent.futures.Future(), context_id)
                   if context_id in self.contexts else None)

    async def pause(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        await self._call(self.commands.pause, context_id, hint)

    async def resume(self, context_id: Hashable, token_ids: Sequence[int] = (),
                     hint: Optional[RequestHint] = None) -> None:
        """``hint``: the predictions for the segment the resume starts
        (:meth:`~engine_ext.protocol.Engine.resume`)."""
        await self._call(self.commands.resume, context_id, list(token_ids), hint)

    def set_pause_hint(self, context_id: Hashable, hint: PauseHint) -> None:
        if not isinstance(hint, PauseHint):
            raise TypeError(f"hint must be a PauseHint, got {type(hint).__name__}")
        self._post(lambda: self.commands.set_pause_hint(context_id, hint))

    def set_request_hint(self, context_id: Hashable, hint: RequestHint) -> None:
        """Update every ranking field of a live context (its expected output,
        tool and time, future segments, objective, task group; not the
        tenant) and drop its cached score: e.g. the model has named the tool
        its call goes to, or a criterion was deduced after the call was
        dispatched (Parrot).  Non-blocking; ignored if the context is gone."""
        if not isinstance(hint, RequestHint):
            raise TypeError(f"hint must be a RequestHint, got {type(hint).__name__}")
        hint.validate()

        def apply() -> None:
            ctx = self.contexts.get(context_id)
            if ctx is not None:
                apply_hint(ctx, hint)
        self._post(apply)

    async def park(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        """Put an idle context under the interception policy as if a tool
        call had intercepted it (a client-side tool call: the follow-up
        request will extend it).  Any later fill / generate / free / fork
        of (or from) it un-parks it: swapped KV comes back, discarded KV is
        recomputed, transparently.  Parking a parked context updates its hint."""
        await self._call(self.commands.park, context_id, hint)

    async def truncate(self, context_id: Hashable, num_tokens: int) -> int:
        """Cut an idle context back to its first ``num_tokens`` tokens,
        keeping the KV of the whole blocks before the cut (a follow-up that
        repeats a retained conversation but renders the model's reply
        differently from some token on).  Ends a parked interception.
        Returns the tokens whose KV is kept."""
        return await self._call(self.commands.truncate, context_id, num_tokens)

    async def computed_tokens(self, context_id: Hashable) -> int:
        """Tokens of the context whose KV is on the device or in the host
        pool: what a follow-up would not recompute."""
        return await self._call(lambda fut: fut.set_result(self.commands.get(context_id).num_computed))

    def set_policies(self, *, interception: Optional[InterceptionPolicy] = None,
                     ranking: Optional[RankingPolicy] = None, profile: Optional[Profile] = None,
                     capacity: Optional[CapacityPolicy] = None) -> None:
        """Replace the policies (those given) on the engine thread; blocks
        until done.  For start-up, when the profile is measured on the engine.
        ``capacity``: the capacity regulation (``NO_CAPACITY`` turns it off)."""
        if capacity is not None and not isinstance(capacity, CapacityPolicy):
            raise TypeError(f"capacity must be a CapacityPolicy, got {type(capacity).__name__}")

        def apply(fut):
            if capacity is not None:
                self.scheduler.capacity = capacity
            if interception is not None:
                self.interceptor.policy = interception
            if ranking is not None:
                self.scheduler.ranking = ranking
            if profile is not None:
                self.interceptor.profile = profile
            self.interceptor.configure()
            fut.set_result(None)
        self.call_sync(apply)

    def call_sync(self, fn: Callable[[concurrent.futures.Future], Any]) -> Any:
        """Run ``fn(future)`` on the engine thread and wait for the result
        (synchronous callers: start-up, the profiler).  Not from the engine thread."""
        if self._closed:
            raise E.EngineClosed("the engine is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        if self._stopped:
            self._fail_queued()
        return fut.result()

    def load_stats(self) -> Dict[str, int]:
        """The engine's load now, read without waiting for the engine thread
        (a snapshot that may be a step old; for metrics and replica routing):
        KV blocks in use and in all, ``queued_tokens`` (tokens of active
        contexts still to compute: prefill chunks and next decodes),
        ``running`` (contexts generating, not paused), ``waiting`` (active
        contexts with tokens to compute that are not generating: fills),
        ``contexts`` and ``threads`` (the CPU threads its steps run on now;
        0 on a GPU).  Parrot's capacity regulation (:mod:`..policies.capacity`):
        ``capacity_tokens`` (the cap in force now: the latency cap while a
        latency-critical context has work, else the throughput cap; 0: none
        but memory), ``active_tokens`` (context tokens of the active contexts
        with work: running or waiting to run, held ones included),
        ``latency_running`` (those of them latency-critical),
        ``capacity_held`` (contexts the cap held back at the last step),
        ``capacity_held_steps`` (steps that held some back, since start) and
        the configured ``capacity_latency_tokens`` /
        ``capacity_throughput_tokens`` (0: none).  (Named so because
        ``stats`` is the dict of counters.)"""
        for _ in range(3):
            try:
                active = list(self.scheduler.active)
                contexts = list(self.contexts.values())
                break
            except RuntimeError:  # changed size while copied by the engine thread: again
                continue
        else:
            active, contexts = [], []
        running = sum(1 for c in contexts if c.gen is not None and not c.gen.paused and not c.gen.done)
        queued = sum(max(0, c.num_uncomputed) for c in active)
        waiting = sum(1 for c in active if c.gen is None and c.num_uncomputed > 0)
        sched = self.scheduler
        cap = sched.capacity
        work = [c for c in active if c.num_uncomputed > 0]
        return {"kv_blocks_used": self.blocks.num_used, "kv_blocks_total": self.blocks.num_blocks,
                "queued_tokens": queued, "running": running, "waiting": waiting, "contexts": len(contexts),
                "threads": self.threads.threads if self.threads is not None else self._fixed_threads,
                "capacity_tokens": cap.limit(work) or 0,
                "active_tokens": sum(len(c.token_ids) for c in work),
                "latency_running": sum(1 for c in work if is_latency(c)),
                "capacity_held": sched.capacity_held if work else 0,  # (aborted while held: no step since)
                "capacity_held_steps": sched.capacity_held_steps,
                "capacity_latency_tokens": cap.latency_tokens or 0,
                "capacity_throughput_tokens": cap.throughput_tokens or 0}

    async def check_invariants(self) -> dict:
        """Verify block and context bookkeeping; returns usage counts."""
        return await self._call(self._cmd_check)

    async def context_length(self, context_id: Hashable) -> int:
        return await self._call(lambda fut: fut.set_result(len(self.commands.get(context_id).token_ids)))

    async def last_logits(self, context_id: Hashable) -> Optional[torch.Tensor]:
        """Float32 logits after the context's last token, if computed and kept
        (after a fill; a finished generation leaves its last token uncomputed)."""
        def get(fut):
            lg = self.commands.get(context_id).last_logits
            fut.set_result(None if lg is None else lg.to("cpu", copy=True))  # kept on the model's device
        return await self._call(get)

    async def context_tokens(self, context_id: Hashable) -> List[int]:
        return await self._call(lambda fut: fut.set_result(list(self.commands.get(context_id).token_ids)))

    def close(self) -> None:
        """Stop the engine: running generations end with ``abort``, pending
        fills and every later call raise :class:`EngineClosed`."""
        if not self._closed:
            self._closed = True
            self._cmds.put(None)
            self._thread.join(timeout=30)

    def __enter__(self) -> "NativeEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ============================================================ engine thread
    async def _call(self, fn: Callable, *args: Any) -> Any:
        if self._closed:
            raise E.EngineClosed("the engine is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((lambda f: fn(f, *args), fut))
        if self._stopped:  # closed from another thread after our check: nobody will run it
            self._fail_queued()
        return await asyncio.wrap_future(fut)

    def _post(self, fn: Callable[[], Any]) -> None:
        """Queue a command nobody waits for (cleanup that may run while its
        caller is being cancelled).  Its errors are ignored."""
        if not self._closed:
            self._cmds.put((lambda fut: fut.set_result(fn()), None))

    def _fail_queued(self) -> None:
        """Fail the commands left in the queue once the engine thread is gone,
        so no caller waits forever."""
        while True:
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return
            if item and item[1] is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(E.EngineClosed("the engine is closed"))

    def _loop(self, runner_args: tuple, host_blocks: int, started: concurrent.futures.Future) -> None:
        torch.set_grad_enabled(False)
        try:
            self.runner = ModelRunner(*runner_args[:-1], **runner_args[-1])
            self.interceptor.swap = Swapper(self.blocks, self.runner.kv, host_blocks)
            if self.device.type == "cpu":  # the sampler's kernel: built now (once per CPU), not at a first request
                from . import cpu_matmul

                cpu_matmul.load()
                self._fixed_threads = torch.get_num_threads()
                if self._adapt_threads:  # torch's thread count is per thread: this one's, from here on
                    self.threads = ThreadGovernor(self._fixed_threads, torch.set_num_threads)
        except BaseException as e:
            started.set_exception(e)
            return
        started.set_result(None)
        try:
            self._serve()
        finally:
            self._shutdown()
            self.runner.close()  # its pinned buffers and graphs; the KV cache stays readable

    def _serve(self) -> None:
        while True:
            self.interceptor.account_waste()
            busy = (self.scheduler.has_work() or bool(self.output.ready) or self.swap.busy
                    or self.interceptor.undecided())
            # preserved contexts are reconsidered as their calls age, even with nothing else to do
            reconsider = self.interceptor.preserving()
            if not busy and self.threads is not None:
                self.threads.idle()  # the cores while we wait say nothing about the next step's neighbours
            try:
                item = self._cmds.get(block=not busy, timeout=0.05 if reconsider and not busy else None)
            except queue.Empty:
                item = ()
            while item != ():
                if item is None:
                    return
                fn, fut = item
                if fut is None:  # nobody waits for it
                    fut = concurrent.futures.Future()
                if fut.set_running_or_notify_cancel():  # False: cancelled before it ran, skip it
                    try:
                        fn(fut)
                    except BaseException as e:  # validation errors go to the caller
                        if not fut.done():
                            fut.set_exception(e)
                try:
                    item = self._cmds.get_nowait()
                except queue.Empty:
                    item = ()
            try:
                self.interceptor.account_waste()
                with self._outbox.holding():  # its events: one wake-up per consumer loop, at its end
                    self._step()
            except Exception as e:  # a bug must not kill the engine silently
                log.exception("engine step failed")
                err = E.EngineError(f"engine step failed: {e!r}")
                err.__cause__ = e
                # every running generation and pending fill, wherever it was in the step
                with self._outbox.holding():
                    for ctx in list(self.contexts.values()):
                        if ctx.fill_waiters or (ctx.gen is not None and not ctx.gen.paused):
                            self.commands.fail(ctx, err)

    def _shutdown(self) -> None:
        self._stopped = True
        with self._outbox.holding():
            for ctx in list(self.contexts.values()):
                if ctx.gen is not None and not ctx.gen.done:
                    self.output.finish(ctx, "abort")
                for op in ctx.fill_waiters:
                    if not op.fut.done():
                        op.fut.set_exception(E.EngineClosed("the engine was closed"))
                ctx.fill_waiters.clear()
        self._fail_queued()

    def _inactive_contexts(self) -> List[Context]:
        """Contexts whose KV may be dropped before a running one's: idle ones
        least recently used first, then paused ones."""
        idle = [c for c in self.contexts.values() if c.state is State.IDLE and c not in self.scheduler.active]
        paused = [c for c in self.contexts.values() if c.state is State.PAUSED]
        return sorted(idle, key=lambda c: c.last_used) + sorted(paused, key=lambda c: c.last_used)

    def _rank_state(self) -> RankState:
        # C_other as the interception policy gets it (Scheduler.running_kv_tokens): the running contexts' device KV
        return RankState(iteration=self.stats["steps"], iteration_s=self.iteration_s or 1.0,
                         batch_context_tokens=self.scheduler.running_kv_tokens())

    # -------------------------------------------------------------------- step
    def _step(self) -> None:
        """One iteration: plan the intercepted contexts, schedule, run, postprocess."""
        if self.swap.inflight:
            self.swap.land()
        self.interceptor.plan()
        self.output.sample_ready()  # generations whose logits a fill already computed
        batch = self.scheduler.schedule()
        for ctx, err in batch.failed:
            self.commands.fail(ctx, err)
        n_out, n_in, limit = self.interceptor.issue_swaps(batch)
        if self.swap_trace is not None and (n_out or n_in):
            self.swap_trace.append((self.stats["steps"], n_out, n_in, limit))
        if not batch.chunks:
            return
        if self.threads is not None:
            self.stats["threads"] = self.threads.tick()
        t0 = time.perf_counter()
        logits, rows = self.runner.run(batch)
        if self.device.type != "cuda":
            self._forward_took(time.perf_counter() - t0)
        self.stats["steps"] += 1
        self.output.postprocess(batch, logits, rows)
        # a call that paused in this step is decided now, as the simulator decides it right after its
        # iteration: a call that returned before the next step was otherwise never planned (its KV kept)
        self.interceptor.plan()
        # on CUDA run() only queued the step: its GPU time comes from events, once it has run
        # (after sampling, whose copy of the ids waited for it; a step that sampled nothing: later)
        for dt in self.runner.forward_seconds():
            self._forward_took(dt)

    def _forward_took(self, dt: float) -> None:
        self.stats["forward_s"] += dt
        self.iteration_s = dt if not self.iteration_s else 0.8 * self.iteration_s + 0.2 * dt

    # ---------------------------------------------------------------- bookkeeping
    def _cmd_check(self, fut) -> None:
        tables = [c.table for c in self.contexts.values()]
        self.blocks.check_invariants(tables)
        for c in self.contexts.values():
            assert c.num_computed <= len(c.token_ids)
            assert len(c.table.blocks) >= self.blocks.blocks_for(c.num_computed)
            assert all(ch.parent is c and ch.id in self.contexts for ch in c.children)
            assert (c.intercept is not None) == (self.intercepted.get(c.id) is c), f"{c.id!r}: interception books"
            assert c.intercept is None or c.intercept.parked or c.state is State.PAUSED
        assert all(self.contexts.get(i) is c for i, c in self.intercepted.items())
        self.swap.check(list(self.contexts.values()))
        fut.set_result({"contexts": len(self.contexts), "used_blocks": self.blocks.num_used,
                        "free_blocks": self.blocks.num_free, "cached_blocks": len(self.blocks.evictable),
                        "preemptions": self.scheduler.num_preemptions, "host_used_blocks": self.swap.pool.num_used,
                        "host_free_blocks": len(self.swap.pool.free), "intercepted": len(self.intercepted),
                        **self.blocks.stats})
