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

Interception (InferCept): a paused context, or an idle one *parked* for a
client's follow-up, is handed to the interception policy before the next
step's scheduling, and every step after while it is preserved (the dynamic
estimate t_now - t_call may change the answer): preserve keeps its blocks,
discard releases them (full ones stay in the prefix cache) and recomputes on
resume -- in chunks under S mixed with decodes if the policy says so --, swap
moves its exclusive blocks to a host pool (``swap.py``), a budget per step.
A resumed (or un-parked) swapped context is scheduled again only once all
its blocks are back.  Ranking policies order the work; the engine keeps each
context's ``sched`` current and learns tool durations from pause to resume.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Dict, Hashable, List, Optional, Sequence

import torch

from .. import errors as E
from ..policies.costmodel import Profile
from ..policies.interception import BatchState, Handling, InterceptedContext, InterceptionPolicy, Preserve
from ..policies.ranking import FCFS, RankingPolicy, RankState
from ..channel import Channel, Outbox
from ..protocol import PauseHint, RequestHint, SamplingParams, TokenEvent
from ..stream_text import token_text
from .block_manager import BlockManager
from .block_sharing import VariantSet
from .loader import load_config, load_model, resolve_model_dir
from .model_runner import ModelRunner
from .models.llama import LlamaForCausalLM
from .sampler import sample
from .scheduler import Batch, Scheduler
from .sequence import Context, FillOp, Generation, Interception, State
from .swap import SWAPPED, Swapper
from ..tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Map a configured dtype name to a torch dtype.

    ``auto`` picks the fastest dtype that keeps float32's exponent range:
    bfloat16 on CUDA devices that support it and on CPUs with native
    bfloat16 dot products (AVX512-BF16 or AMX), where the weight matmuls run
    about twice as fast as in float32 (``interlace bench engine``); float32
    on other CPUs, where bfloat16 is emulated and slower.
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


WEIGHTS = ("as-shipped", "float32", "bfloat16", "int8")


def resolve_weights(weights: Optional[str], dtype: Optional[str], device: torch.device) -> torch.dtype:
    """Check the ``weights`` setting against ``dtype`` and return the compute dtype.

    ``dtype`` is the compute dtype: activations, KV cache, norms, the
    embedding, and dense weights.  ``weights`` is how the weight matmuls are
    stored: unset, dense in ``dtype`` (the default); ``float32`` /
    ``bfloat16``, dense in that dtype, which is then the compute dtype too
    (``dtype`` unset or ``auto``; another ``dtype`` is a contradiction, an
    error); ``int8`` / ``as-shipped``, quantized (:mod:`.quant`), with compute
    in ``dtype`` (default float32), on the CPU only.  ``auto`` with quantized
    weights is float32: their matmuls run on float32 activations whatever
    the dtype, so bfloat16 compute only adds conversions and loses the fused
    decode ops (measured on an AVX512-BF16 CPU: 72 against 98 tokens/s at
    batch 1, docs/benchmarks.md).

    On a GPU the default compute dtype is ``auto`` (bfloat16 where the GPU
    has it): float32 there halves the bandwidth a decode step can use and
    the Triton prefill and cascade kernels spill their float32 tiles.  The
    quantized formats' matmuls are CPU kernels: ``as-shipped`` on a GPU
    loads the GGUF dequantized (dense in the compute dtype, see
    :meth:`NativeEngine.load`), so the shipped config starts there too;
    ``int8`` (made from float weights, only to save CPU memory) is refused."""
    if weights is None:
        return resolve_dtype(dtype or ("float32" if device.type == "cpu" else "auto"), device)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {list(WEIGHTS)}, got {weights!r}")
    if weights in ("float32", "bfloat16"):
        if dtype not in (None, "auto") and DTYPES.get(dtype) is not DTYPES[weights]:
            raise ValueError(f"weights: {weights} with dtype: {dtype}: dense weights compute in their own dtype; "
                             f"drop one of the two settings")
        return DTYPES[weights]
    if device.type != "cpu":
        if weights == "as-shipped":  # dequantized: dense in the compute dtype
            return resolve_dtype(dtype or "auto", device)
        raise ValueError(f"weights: {weights} runs on the CPU only (its matmuls are CPU kernels); on "
                         f"{device.type} leave weights unset (dense, dtype auto: bfloat16)")
    return resolve_dtype("float32" if dtype in (None, "auto") else dtype, device)


def _in_passing_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a short-lived thread and return its result.

    Why: with the OpenMP runtime PyTorch uses, every thread that runs a
    parallel op keeps its own pool of worker threads for the life of the
    thread.  Once the pools together hold more threads than there are CPUs,
    the runtime stops letting idle workers spin between ops, and the many
    small ops of a decode step then pay a wake-up each: a bfloat16 decode
    step of SmolLM2 at batch 32 took ~92 ms instead of ~68 ms on 2 cores.
    Loading (a parallel copy of every weight) on the caller's thread, usually
    the main thread that serves HTTP, would leave such a pool behind; a
    thread that ends takes its pool with it, so the engine thread's is the
    only one.
    """
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="interlace-load")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helpers; absent on some builds and platforms
        return False


def _attention_kernel(attention: str, device: torch.device) -> Optional[Any]:
    """The attention kernels ``attention`` asks for (see :class:`NativeEngine`), or None (torch)."""
    if attention not in ("torch", "kernel", "triton", "auto"):
        raise ValueError(f"attention must be 'torch', 'kernel', 'triton' or 'auto', not {attention!r}")
    if attention == "triton" or (attention == "auto" and device.type == "cuda"):
        from . import kernels

        if kernels.available():
            from .kernels.attention import TritonAttention

            if device.type == "cpu" and not kernels.interpreted():
                # found by the first GPU run: the compiled kernels were handed CPU tensors
                raise ValueError("attention: triton with the engine on the CPU: this machine has CUDA, so the "
                                 "Triton kernels are compiled for the GPU; put the engine on cuda, or use "
                                 "attention: torch / kernel on the CPU")
            return TritonAttention()
        if attention == "triton":
            raise ValueError("attention: triton needs the triton package (pip install triton)")
        log.warning("attention: auto on %s: triton is not installed; attention gathers the cache with torch",
                    device)
        return None
    if attention == "torch" or device.type != "cpu":
        return None
    from . import cpu_attention

    kernel = cpu_attention.load()
    if kernel is None and attention == "kernel":
        raise ValueError("attention: kernel: the CPU paged-attention kernel cannot be built here (see the log)")
    return kernel


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
                 gpu_memory_utilization: Optional[float] = None):
        """``profile`` is the cost model for the swap budget and recomputation
        chunks (else the interception policy's own, else none: swaps move the
        whole context at once and recomputation is not chunked).
        ``host_pool_tokens``: the host swap pool (default: as large as the
        KV cache; 0: no swapping, swaps fall back to discard).
        ``prefix_caching=False``: no automatic prefix caching.
        ``variants``: fine-tuned variants of ``model`` served in the same
        batches (:mod:`.block_sharing`); a fill creating a context names one.
        ``attention``: how decode attention reads the KV cache: ``torch``
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
        None: ``kv_cache_tokens``."""
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, got {cuda_graphs!r}")
        if gpu_memory_utilization is not None:
            from .memory import check_utilization

            gpu_memory_utilization = check_utilization(gpu_memory_utilization)
        if host_pool_tokens is not None and (not isinstance(host_pool_tokens, int) or host_pool_tokens < 0):
            raise ValueError(f"host_pool_tokens must be a non-negative integer, got {host_pool_tokens!r}")
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        self.block_size = block_size
        kv_dtype = kv_dtype or next(model.parameters()).dtype
        attention_kernel = _attention_kernel(attention, self.device)
        sized_by_memory = num_blocks is None and gpu_memory_utilization is not None and self.device.type == "cuda"
        if sized_by_memory:
            num_blocks = self._blocks_from_memory(gpu_memory_utilization, max_batched_tokens, kv_dtype,
                                                  attention_kernel)
        num_blocks = num_blocks or max(1, kv_cache_tokens // block_size)
        self.max_model_len = min(max_model_len or self.cfg.max_position_embeddings, num_blocks * block_size)
        self.vocab_size = self.cfg.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else frozenset())
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.blocks, ranking or FCFS(), max_batched_tokens, max_seqs,
                                   inactive=self._inactive_contexts, release=self._release_kv)
        self.scheduler.rank_state = self._rank_state
        if host_pool_tokens is None:  # as large as the cache; a cache sized from GPU memory: kv_cache_tokens
            host_pool_tokens = kv_cache_tokens if sized_by_memory else num_blocks * block_size
        host_blocks = host_pool_tokens // block_size
        self.swap: Optional[Swapper] = None  # allocated by the engine thread, beside the KV cache
        self.runner: Optional[ModelRunner] = None  # allocated by the engine thread (see _loop)
        if variants is not None and variants.model is not model:
            raise ValueError("variants must be built over this engine's model")
        self.variants = variants
        runner_args = (model, num_blocks, block_size, kv_dtype, self.device, variants, attention_kernel,
                       dict(max_seqs=max_seqs, max_model_len=self.max_model_len, cuda_graphs=cuda_graphs))
        self.interception = interception or Preserve()
        self.profile = profile
        self._configure_policies()
        self.contexts: Dict[Hashable, Context] = {}
        self.intercepted: Dict[Hashable, Context] = {}  # paused or parked contexts, by id
        self.ready: List[Context] = []  # generating, all computed: sample from last_logits next step
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "forward_s": 0.0,
                      "swap_out_blocks": 0, "swap_in_blocks": 0, "recomputed_tokens": 0, "kv_waste_token_s": 0.0,
                      "handlings": {h.value: 0 for h in Handling}, "host_used_blocks": 0}
        self.iteration_s = 0.0  # a recent forward pass's seconds (moving average), for the ranking
        self.swap_trace: Optional[List[tuple]] = None  # set to a list: (step, out, in, limit) per step that swapped
        self._held_tokens = 0   # device KV tokens held by intercepted contexts, since _waste_at
        self._waste_at = time.monotonic()
        self._cmds: "queue.SimpleQueue" = queue.SimpleQueue()
        self._outbox = Outbox()  # the engine thread's token events: a step's go out together
        self._closed = False   # close() was called: no new commands
        self._stopped = False  # the engine thread has finished: nothing will run a queued command
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._loop, args=(runner_args, host_blocks, started), name="interlace-engine",
                                        daemon=True)
        self._thread.start()
        started.result()  # the KV cache allocation's error (out of memory), if any

    def _blocks_from_memory(self, utilization: float, max_batched_tokens: int, kv_dtype: torch.dtype,
                            attention_kernel: Optional[Any]) -> int:
        """KV blocks from the GPU's memory (CUDA): :func:`.memory.kv_blocks_for` with the activation
        peak of one dummy forward of ``max_batched_tokens`` tokens, measured before the cache exists."""
        from . import memory
        from .quant import weight_bytes

        peak, other = memory.measure_activation_peak(self.model, max_batched_tokens, self.block_size, kv_dtype,
                                                     self.device, attention_kernel)
        free, total = torch.cuda.mem_get_info(self.device)
        weights = weight_bytes(self.model)  # parameters, buffers, any prepacked copies
        per_block = ModelRunner.kv_bytes_per_block(self.model, self.block_size, kv_dtype)
        blocks = memory.kv_blocks_for(total, weights, peak, utilization, per_block, other, free_bytes=free)
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB) from gpu_memory_utilization %g of %.2f GiB "
                 "(weights %.2f GiB, activation peak %.2f GiB)", blocks, self.block_size,
                 blocks * per_block / memory.GIB, utilization, total / memory.GIB, weights / memory.GIB,
                 peak / memory.GIB)
        return blocks

    @classmethod
    def load(cls, model_path: str | Path, *, dtype: Optional[str] = None, device: Optional[str] = None,
             weights: Optional[str] = None, **kw: Any) -> "NativeEngine":
        """``dtype`` float32 (the default on a CPU: the reference numerics, token
        for token equal to transformers; ``auto``, bfloat16, on a GPU), bfloat16, float16, or ``auto``: see
        :func:`resolve_dtype`.  ``weights``: how the weight matmuls are
        stored (default: dense in ``dtype``): ``float32``, ``bfloat16``,
        ``int8`` (per output channel, from the float weights) or
        ``as-shipped`` (a GGUF's quantized tensors): see
        :func:`resolve_weights` and docs/quantization.md."""
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = resolve_weights(weights, dtype, dev)

        if weights == "as-shipped" and dev.type != "cpu":
            log.warning("weights: as-shipped on %s: the GGUF's quantized matmuls are CPU kernels; loading it "
                        "dequantized, dense in %s", dev, str(torch_dtype).removeprefix("torch."))
            weights = None

        def build():
            if weights == "as-shipped":
                from .quant import gguf_file, gguf_key, gguf_meta_dir, model_from_gguf

                gguf = gguf_file(model_path)
                meta = gguf_meta_dir(gguf)
                raw, _ = load_config(meta)
                model = model_from_gguf(gguf, raw, torch_dtype, dev)
                tok = Tokenizer(meta, raw) if (meta / "tokenizer.json").exists() else None
                return model, tok, f"{gguf.stem}-{gguf_key(gguf)}"  # the name of its converted directory
            model_dir = resolve_model_dir(model_path)
            raw, _ = load_config(model_dir)
            if weights == "int8":
                from .quant import quantize_int8

                model = quantize_int8(load_model(model_dir, torch.float32, dev), torch_dtype)
            else:
                model = load_model(model_dir, torch_dtype, dev)
            tok = Tokenizer(model_dir, raw) if (Path(model_dir) / "tokenizer.json").exists() else None
            return model, tok, Path(model_dir).name

        model, tok, name = _in_passing_thread(build)
        kw.setdefault("name", name)
        return cls(model, tok, **kw)

    # ================================================================ public API
    async def fill(self, context_id: Hashable, token_ids: Sequence[int],
                   parent_context_id: Optional[Hashable] = None, hint: Optional[RequestHint] = None,
                   variant: Optional[str] = None) -> int:
        """A fill whose caller is cancelled is undone (its tokens removed, a
        context it created dropped), so the caller can retry it safely.  The
        one exception: another call has already built on it (extended,
        generated into the context), in which case it stays.  ``hint``: the
        objective and task group its prefill is ranked by.  ``variant``: the
        model variant a new context runs (default: the base model); a fork
        runs its parent's, and naming another is an error."""
        op = FillOp(None)
        try:
            return await self._call(self._cmd_fill, context_id, list(token_ids), parent_context_id, op, hint,
                                    variant)
        except asyncio.CancelledError:
            self._post(lambda: self._undo_fill(op))
            raise

    async def generate(self, context_id: Hashable, sampling: Optional[SamplingParams] = None,
                       parent_context_id: Optional[Hashable] = None,
                       hint: Optional[RequestHint] = None) -> AsyncIterator[TokenEvent]:
        """``hint`` seeds the ranking's view of the request (LAMPS: expected
        output and tool call)."""
        sampling = sampling or SamplingParams()
        ch = Channel()
        emit = self._outbox.emitter(ch)  # one object: the generation keeps it, _abort finds the stream by it
        events = ch.events(self._call(self._cmd_generate, context_id, sampling, parent_context_id, emit, hint),
                           lambda: self._post(lambda: self._abort(context_id, emit)))
        async with contextlib.aclosing(events):  # a consumer that leaves early stops the decoding at once
            async for ev in events:
                yield ev

    async def free_context(self, context_id: Hashable) -> None:
        await self._call(self._cmd_free, context_id)

    def free_context_nowait(self, context_id: Hashable) -> None:
        """Queue a free without waiting (for cleanup code that may itself be
        cancelled, e.g. when an HTTP client disconnects).  Errors are ignored:
        the context may be gone already."""
        self._post(lambda: self._cmd_free(concurrent.futures.Future(), context_id)
                   if context_id in self.contexts else None)

    async def pause(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        await self._call(self._cmd_pause, context_id, hint)

    async def resume(self, context_id: Hashable, token_ids: Sequence[int] = ()) -> None:
        await self._call(self._cmd_resume, context_id, list(token_ids))

    def set_pause_hint(self, context_id: Hashable, hint: PauseHint) -> None:
        if not isinstance(hint, PauseHint):
            raise TypeError(f"hint must be a PauseHint, got {type(hint).__name__}")
        self._post(lambda: self._cmd_set_pause_hint(context_id, hint))

    def set_request_hint(self, context_id: Hashable, hint: RequestHint) -> None:
        """Update the objective and task group the ranking sees for a live
        context (Parrot: a criterion deduced after the call was dispatched).
        Non-blocking; ignored if the context is gone."""
        if not isinstance(hint, RequestHint):
            raise TypeError(f"hint must be a RequestHint, got {type(hint).__name__}")
        hint.validate()

        def apply() -> None:
            ctx = self.contexts.get(context_id)
            if ctx is not None:
                ctx.sched.objective, ctx.sched.task_group = hint.objective, hint.task_group
        self._post(apply)

    async def park(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        """Put an idle context under the interception policy as if a tool
        call had intercepted it (a client-side tool call: the follow-up
        request will extend it).  Any later fill / generate / free / fork
        of (or from) it un-parks it: swapped KV comes back, discarded KV is
        recomputed, transparently.  Parking a parked context updates its hint."""
        await self._call(self._cmd_park, context_id, hint)

    async def truncate(self, context_id: Hashable, num_tokens: int) -> int:
        """Cut an idle context back to its first ``num_tokens`` tokens,
        keeping the KV of the whole blocks before the cut (a follow-up that
        repeats a retained conversation but renders the model's reply
        differently from some token on).  Ends a parked interception.
        Returns the tokens whose KV is kept."""
        return await self._call(self._cmd_truncate, context_id, num_tokens)

    async def computed_tokens(self, context_id: Hashable) -> int:
        """Tokens of the context whose KV is on the device or in the host
        pool: what a follow-up would not recompute."""
        return await self._call(lambda fut: fut.set_result(self._get(context_id).num_computed))

    def set_policies(self, *, interception: Optional[InterceptionPolicy] = None,
                     ranking: Optional[RankingPolicy] = None, profile: Optional[Profile] = None) -> None:
        """Replace the policies (those given) on the engine thread; blocks
        until done.  For start-up, when the profile is measured on the engine."""
        def apply(fut):
            if interception is not None:
                self.interception = interception
            if ranking is not None:
                self.scheduler.ranking = ranking
            if profile is not None:
                self.profile = profile
            self._configure_policies()
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
        contexts with tokens to compute that are not generating: fills) and
        ``contexts``.  (Named so because ``stats`` is the dict of counters.)"""
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
        return {"kv_blocks_used": self.blocks.num_used, "kv_blocks_total": self.blocks.num_blocks,
                "queued_tokens": queued, "running": running, "waiting": waiting, "contexts": len(contexts)}

    async def check_invariants(self) -> dict:
        """Verify block and context bookkeeping; returns usage counts."""
        return await self._call(self._cmd_check)

    async def context_length(self, context_id: Hashable) -> int:
        return await self._call(lambda fut: fut.set_result(len(self._get(context_id).token_ids)))

    async def last_logits(self, context_id: Hashable) -> Optional[torch.Tensor]:
        """Float32 logits after the context's last token, if computed and kept
        (after a fill; a finished generation leaves its last token uncomputed)."""
        def get(fut):
            lg = self._get(context_id).last_logits
            fut.set_result(None if lg is None else lg.to("cpu", copy=True))  # kept on the model's device
        return await self._call(get)

    async def context_tokens(self, context_id: Hashable) -> List[int]:
        return await self._call(lambda fut: fut.set_result(list(self._get(context_id).token_ids)))

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
            self.swap = Swapper(self.blocks, self.runner.kv, host_blocks)
            if self.device.type == "cpu":  # the sampler's kernel: built now (once per CPU), not at a first request
                from . import cpu_matmul

                cpu_matmul.load()
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
            self._account_waste()
            busy = (self.scheduler.has_work() or bool(self.ready) or self.swap.busy
                    or any(c.intercept.handling is None for c in self.intercepted.values()))
            # preserved contexts are reconsidered as their calls age, even with nothing else to do
            reconsider = any(c.intercept.handling is Handling.PRESERVE for c in self.intercepted.values())
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
                self._account_waste()
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
                            self._fail(ctx, err)

    def _shutdown(self) -> None:
        self._stopped = True
        with self._outbox.holding():
            for ctx in list(self.contexts.values()):
                if ctx.gen is not None and not ctx.gen.done:
                    self._finish(ctx, "abort")
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

    # ---------------------------------------------------------------- commands
    def _get(self, cid: Hashable) -> Context:
        ctx = self.contexts.get(cid)
        if ctx is None:
            raise E.ContextNotFound(cid)
        ctx.last_used = time.monotonic()
        return ctx

    def _check_tokens(self, tokens: List[int], allow_empty: bool) -> None:
        if not allow_empty and not tokens:
            raise E.InvalidTokens("token_ids must not be empty")
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise E.InvalidTokens(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")

    def _check_len(self, n: int) -> None:
        if n > self.max_model_len:
            raise E.ContextTooLong(f"context of {n} tokens exceeds the limit of {self.max_model_len} tokens")

    def _new_context(self, cid: Hashable, parent_id: Optional[Hashable]) -> Context:
        """Validate-only part of creating a context; returns the parent or None."""
        if cid in self.contexts:
            raise E.ContextExists(f"context {cid!r} already exists; fork into a new id")
        return self._get(parent_id) if parent_id is not None else None

    def _variant(self, name: Optional[str], existing: Optional[Context]) -> int:
        """The variant index a fill names (validate-only): a new context's,
        or None / the same one for a fork or an existing context."""
        if name is None:
            return existing.variant if existing is not None else 0
        if self.variants is None:
            if name == self.name:
                return 0
            raise E.UnknownVariant(f"no model variant {name!r} here (this engine serves only {self.name!r})")
        v = self.variants.get(name).index
        if existing is not None and existing.variant != v:
            raise E.InvalidContextState(f"context {existing.id!r} runs variant "
                                        f"{self.variants.variants[existing.variant].name!r}, not {name!r}")
        return v

    @property
    def variant_names(self) -> frozenset:
        """The model variants this engine serves (its own name without variants)."""
        return frozenset(self.variants.names()) if self.variants is not None else frozenset({self.name})

    def _fork(self, cid: Hashable, parent: Context) -> Context:
        """The child shares the parent's device blocks.  If part of the
        parent's KV is in the host pool, the child shares the leading
        device-resident blocks and recomputes the rest."""
        self._unpark(parent)
        if parent.on_host:
            self.swap.land()  # no block mid-copy is shared
        blocks = parent.table.blocks
        k = blocks.index(SWAPPED) if SWAPPED in blocks else len(blocks)
        shared = type(parent.table)(blocks[:k], parent.table.hashes[:k], parent.table.root)
        computed = min(parent.num_computed, k * self.block_size)
        child = Context(cid, list(parent.token_ids), self.blocks.fork(shared), computed, parent=parent,
                        last_logits=parent.last_logits if computed == parent.num_computed else None,
                        variant=parent.variant)
        child.recompute_end = parent.num_computed if computed < parent.num_computed else 0
        parent.children.add(child)
        self.contexts[cid] = child
        return child

    def _cmd_fill(self, fut, cid, tokens, parent_id, op: FillOp, hint: Optional[RequestHint] = None,
                  variant: Optional[str] = None) -> None:
        self._check_hint(hint)
        ctx = self.contexts.get(cid)
        created = parent_id is not None or ctx is None
        if created:
            parent = self._new_context(cid, parent_id)
            self._check_tokens(tokens, allow_empty=parent is not None)
            base = len(parent.token_ids) if parent else 0
            self._check_len(base + len(tokens))
            v = self._variant(variant, parent)
            if parent:
                ctx = self._fork(cid, parent)
            else:
                ctx = Context(cid, [], variant=v)
                if v:
                    ctx.table.root = self.variants.variants[v].namespace
            self.contexts[cid] = ctx
        else:
            self._variant(variant, ctx)
            if ctx.state is not State.IDLE:
                raise E.ContextBusy(f"context {cid!r} is {ctx.state.value}; fill it when idle (or resume it)")
            self._check_tokens(tokens, allow_empty=True)
            self._check_len(len(ctx.token_ids) + len(tokens))
            self._unpark(ctx)
        if hint is not None:
            ctx.sched.objective, ctx.sched.task_group = hint.objective, hint.task_group
        op.fut, op.ctx, op.created, op.rollback = fut, ctx, created, len(ctx.token_ids)
        ctx.token_ids += tokens
        op.end = len(ctx.token_ids)
        if ctx.num_computed and not ctx.on_host and not ctx.swap_ops:
            # a fork's (or a longer context's) new tokens may repeat blocks computed before
            ctx.num_computed = self.blocks.extend_prefix(ctx.table, ctx.token_ids, ctx.num_computed)
        ctx.last_fill = op
        if ctx.num_uncomputed:
            ctx.last_logits = None
            ctx.fill_waiters.append(op)
            self.scheduler.add(ctx)
        else:
            fut.set_result(len(ctx.token_ids))

    def _undo_fill(self, op: FillOp) -> None:
        """The caller of ``op`` was cancelled: take its tokens back out, unless
        it never ran, failed, or another call has built on it since (a failed
        or undone fill is neither pending nor ``last_fill`` any more)."""
        ctx = op.ctx
        if ctx is None or self.contexts.get(ctx.id) is not ctx:
            return
        if op in ctx.fill_waiters:  # still computing
            i = ctx.fill_waiters.index(op)
            self._rollback_fills(ctx, i, E.FillCancelled(
                f"an earlier fill of context {ctx.id!r} was cancelled; this later fill was undone with it"))
        elif (ctx.last_fill is op and ctx.gen is None and not ctx.fill_waiters
              and len(ctx.token_ids) == op.end):  # done, and nothing built on it
            self._truncate(ctx, op.rollback, op.created)

    def _rollback_fills(self, ctx: Context, i: int, err: Exception) -> None:
        """Fail the fills from the ``i``-th pending one on, and remove their
        tokens (a later fill's tokens sit on top of an earlier one's)."""
        ops, ctx.fill_waiters = ctx.fill_waiters[i:], ctx.fill_waiters[:i]
        for op in ops:
            if not op.fut.done():
                op.fut.set_exception(err)
        self._truncate(ctx, ops[0].rollback, ops[0].created)

    def _truncate(self, ctx: Context, n: int, created: bool) -> None:
        """Put a context back to its first ``n`` tokens, or drop it if the
        undone fill created it (and nobody forked it since)."""
        ctx.last_fill = None
        if created and not ctx.children:
            self._drop(ctx)
            return
        if created and n == 0:  # forks of it already read its tokens: it stays as it is
            return
        del ctx.token_ids[n:]
        ctx.last_logits = None
        if ctx.num_computed > n:  # its KV past n may be in cached blocks: recompute
            self.scheduler.preempt(ctx)
        if not ctx.num_uncomputed:
            self.scheduler.remove(ctx)

    def _cmd_generate(self, fut, cid, sampling: SamplingParams, parent_id, emit,
                      hint: Optional[RequestHint] = None) -> None:
        sampling.validate()
        self._check_hint(hint)
        if (sampling.stop or sampling.pause_on) and self.tokenizer is None:
            raise E.InvalidSampling("stop and pause_on strings need an engine with a tokenizer")
        if parent_id is not None:
            parent = self._new_context(cid, parent_id)
            if not parent.token_ids:
                raise E.InvalidContextState(f"context {parent_id!r} is empty")
            ctx = None
        else:
            ctx = self._get(cid)
            if ctx.state is not State.IDLE:
                raise E.ContextBusy(f"context {cid!r} is already {ctx.state.value}")
            parent = None
        n = len((parent or ctx).token_ids)
        if n >= self.max_model_len:
            raise E.ContextTooLong(f"context of {n} tokens leaves no room to generate "
                                   f"(limit {self.max_model_len})")
        if ctx is None:
            ctx = self._fork(cid, parent)
        self._unpark(ctx)
        s = ctx.sched
        s.segment_generated, s.score, s.predicted_handling = 0, None, None
        if hint is not None:
            s.expected_output, s.expected_tool, s.expected_tool_s = (
                hint.expected_output, hint.expected_tool, hint.expected_tool_s)
            s.objective, s.task_group = hint.objective, hint.task_group
        ctx.last_fill = None  # generated tokens build on the last fill: it stays
        rng = None
        if not sampling.greedy:
            rng = torch.Generator(device="cpu")
            rng.manual_seed(sampling.seed if sampling.seed is not None
                            else int.from_bytes(os.urandom(8), "little") >> 1)
        detok = (IncrementalDetokenizer(self.tokenizer, ctx.token_ids, sampling.skip_special_tokens)
                 if self.tokenizer else None)
        ctx.gen = Generation(sampling, emit, detok, rng)
        self._activate(ctx)
        fut.set_result(ctx.gen)

    @staticmethod
    def _check_hint(hint: Optional[RequestHint]) -> None:
        if hint is not None:
            if not isinstance(hint, RequestHint):
                raise E.InvalidSampling(f"hint must be a RequestHint, got {type(hint).__name__}")
            hint.validate()

    def _activate(self, ctx: Context) -> None:
        if ctx.num_uncomputed == 0 and ctx.last_logits is not None:
            self.ready.append(ctx)
        else:
            if ctx.num_uncomputed == 0:  # no logits kept: recompute the last position
                self.scheduler.preempt(ctx)
            self.scheduler.add(ctx)

    def _cmd_free(self, fut, cid) -> None:
        ctx = self._get(cid)
        live = [c.id for c in ctx.children]
        if live:
            raise E.ContextHasChildren(f"context {cid!r} has live forked children {live[:5]!r}; free them first")
        if ctx.gen is not None:
            self._finish(ctx, "abort")
        for op in ctx.fill_waiters:
            if not op.fut.done():
                op.fut.set_exception(E.ContextNotFound(cid))
        ctx.fill_waiters.clear()
        self._drop(ctx)
        fut.set_result(None)

    def _drop(self, ctx: Context) -> None:
        self.scheduler.remove(ctx)
        self.intercepted.pop(ctx.id, None)
        ctx.intercept = None
        self._release_kv(ctx)
        if ctx.parent is not None:
            ctx.parent.children.discard(ctx)
        del self.contexts[ctx.id]

    def _abort(self, cid, emit: Callable) -> None:
        """Stop the generation of the stream that owns ``emit``, if it still runs."""
        ctx = self.contexts.get(cid)
        if ctx is not None and ctx.gen is not None and ctx.gen.emit is emit:
            self._finish(ctx, "abort", emit=False)

    def _cmd_pause(self, fut, cid, hint: Optional[PauseHint]) -> None:
        ctx = self._get(cid)
        if ctx.state is not State.GENERATING:
            raise E.InvalidContextState(f"context {cid!r} is {ctx.state.value}, not generating")
        self._pause(ctx, hint)
        fut.set_result(None)

    def _pause(self, ctx: Context, hint: Optional[PauseHint], token_event: Optional[TokenEvent] = None) -> None:
        self.scheduler.remove(ctx)
        if ctx in self.ready:
            self.ready.remove(ctx)
        self._intercept(ctx, hint or PauseHint(), parked=False)
        gen = ctx.gen
        gen.paused = True
        ev = token_event or TokenEvent(None, "")
        # text held back as a possible stop string ends here: what follows is the tool's output
        text, gen.held = ev.text + gen.held, ""
        gen.emit(TokenEvent(ev.token_id, text, ev.logprob, None, paused=True))

    def _cmd_resume(self, fut, cid, tokens: List[int]) -> None:
        ctx = self._get(cid)
        if ctx.state is not State.PAUSED:
            raise E.InvalidContextState(f"context {cid!r} is {ctx.state.value}, not paused")
        self._check_tokens(tokens, allow_empty=True)
        self._check_len(len(ctx.token_ids) + len(tokens) + 1)
        self._end_interception(ctx)
        ctx.token_ids += tokens
        if tokens:
            ctx.last_logits = None
        gen = ctx.gen
        gen.paused = False
        if gen.detok is not None:
            gen.detok.reset_context(ctx.token_ids)
        gen.tail = gen.held = ""
        self._activate(ctx)
        fut.set_result(None)

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

    # ------------------------------------------------------------ interception
    def _require_idle(self, ctx: Context, what: str) -> None:
        """Raise ContextBusy unless nothing runs on ``ctx`` (no generation, fill or step)."""
        if ctx.state is not State.IDLE or ctx.fill_waiters or ctx in self.scheduler.active:
            raise E.ContextBusy(f"context {ctx.id!r} is busy ({ctx.state.value}); {what} only idle contexts")

    def _cmd_truncate(self, fut, cid, n) -> None:
        ctx = self._get(cid)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(ctx.token_ids):
            raise ValueError(f"num_tokens must be an integer in [0, {len(ctx.token_ids)}], got {n!r}")
        self._require_idle(ctx, "truncate")
        self._unpark(ctx)
        if ctx.on_host:  # KV in (or on its way to or from) the host pool: recompute what is kept
            self.scheduler.preempt(ctx)
        keep = min(n, ctx.num_computed) // self.block_size
        self.blocks.truncate(ctx.table, keep)
        del ctx.token_ids[n:]
        ctx.num_computed = min(ctx.num_computed, keep * self.block_size)
        ctx.recompute_end = min(ctx.recompute_end, n)
        ctx.last_logits = ctx.last_fill = None
        fut.set_result(ctx.num_computed)

    def _cmd_set_pause_hint(self, cid, hint: PauseHint) -> None:
        ctx = self.contexts.get(cid)
        if ctx is None or ctx.gen is None or ctx.gen.done:
            return
        if ctx.intercept is not None and not ctx.intercept.parked:
            ctx.intercept.hint = hint  # paused already: later plans and the duration learned use it
        else:
            ctx.gen.pause_hint = hint

    def _cmd_park(self, fut, cid, hint: Optional[PauseHint]) -> None:
        ctx = self._get(cid)
        if hint is not None and not isinstance(hint, PauseHint):
            raise E.InvalidContextState(f"hint must be a PauseHint, got {type(hint).__name__}")
        self._require_idle(ctx, "park")
        if ctx.intercept is not None:
            ctx.intercept.hint = hint or PauseHint()
        else:
            self._intercept(ctx, hint or PauseHint(), parked=True)
        fut.set_result(None)

    def _intercept(self, ctx: Context, hint: PauseHint, parked: bool) -> None:
        """``ctx`` waits for a tool (or a client): the next step plans its handling."""
        ctx.intercept = Interception(hint, time.monotonic(), parked=parked)
        self.intercepted[ctx.id] = ctx
        on_interception = getattr(self.scheduler.ranking, "on_interception", None)
        if on_interception is not None:
            on_interception(ctx)
        ctx.sched.segment_generated = 0

    def _end_interception(self, ctx: Context, returned: bool = True) -> None:
        """The call returned (resume, or a follow-up on a parked context):
        learn its duration, fix the arrival time, bring swapped KV back.
        ``returned=False``: the paused generation ended without a resume
        (aborted): nothing to learn, the context just stops being intercepted."""
        rec = ctx.intercept
        if rec is None:
            return
        ctx.intercept = None
        self.intercepted.pop(ctx.id, None)
        now = time.monotonic()
        if returned:
            self.interception.durations.observe(rec.hint.tool, now - rec.call_time)
        if not self.interception.keeps_arrival:
            ctx.arrival = now  # re-queued as a new request (vLLM)
        if ctx.on_host:
            if returned:
                self.swap.swap_in(ctx)  # the scheduler skips it until every block is back
            else:
                self._release_kv(ctx)  # nobody waits for it: recompute if it is ever used

    def _unpark(self, ctx: Context) -> None:
        if ctx.intercept is not None and ctx.intercept.parked:
            self._end_interception(ctx)

    def _release_kv(self, ctx: Context) -> None:
        """Drop a context's KV, on the device and in the host pool (it keeps
        its tokens: what was computed is recomputed when next needed)."""
        self.swap.forget(ctx)
        ctx.recompute_end = min(len(ctx.token_ids), max(ctx.recompute_end, ctx.num_computed))
        self.blocks.release(ctx.table)

    def _device_tokens(self, ctx: Context) -> int:
        on_dev = sum(b >= 0 for b in ctx.table.blocks)
        return min(ctx.num_computed, on_dev * self.block_size)

    def _account_waste(self) -> None:
        """Token-seconds of device KV held by intercepted contexts (the
        holdings only change on this thread, between two calls)."""
        now = time.monotonic()
        self.stats["kv_waste_token_s"] += (now - self._waste_at) * self._held_tokens
        self._waste_at = now
        self._held_tokens = sum(self._device_tokens(c) for c in self.intercepted.values())

    def _profile(self) -> Optional[Profile]:
        return self.profile if self.profile is not None else getattr(self.interception, "profile", None)

    def _configure_policies(self) -> None:
        prof = self._profile()
        chunked = self.interception.chunked_recompute and prof is not None
        self.scheduler.recompute_chunk = prof.recompute_chunk if chunked else None

    def _rank_state(self) -> RankState:
        return RankState(iteration=self.stats["steps"], iteration_s=self.iteration_s or 1.0,
                         batch_context_tokens=sum(len(c.token_ids) for c in self.scheduler.active))

    def _plan_interceptions(self) -> None:
        """Ask the policy about contexts intercepted since the last step and
        those still preserved, and apply its answers."""
        cands = [c for c in self.intercepted.values() if c.intercept.handling in (None, Handling.PRESERVE)]
        if not cands:
            return
        infos = []
        for c in cands:
            held = self._device_tokens(c)
            if held == 0:  # nothing on the device (dropped for room, or never computed): nothing to decide
                if c.intercept.handling is None:
                    c.intercept.handling = Handling.DISCARD
                continue
            rec = c.intercept
            infos.append(InterceptedContext(context_len=held, num_blocks=sum(b >= 0 for b in c.table.blocks),
                                            expected_duration_s=rec.hint.expected_duration_s, tool=rec.hint.tool,
                                            id=c.id, call_time=rec.call_time))
        if not infos:
            return
        active = self.scheduler.active
        decodes = sum(1 for c in active if c.num_uncomputed == 1 and c.num_computed)
        batch = BatchState(context_tokens=sum(len(c.token_ids) for c in active), decode_tokens=decodes,
                           batched_tokens=max(1, min(self.scheduler.max_batched_tokens,
                                                     sum(c.num_uncomputed for c in active))),
                           swap_backlog_tokens=self.swap.backlog_blocks * self.block_size)
        plan = self.interception.plan(infos, batch, time.monotonic())
        for info in infos:
            self._apply_handling(self.contexts[info.id], plan.get(info.id, Handling.PRESERVE))

    def _apply_handling(self, ctx: Context, h: Handling) -> None:
        rec = ctx.intercept
        if h is Handling.PRESERVE:
            if rec.handling is None:
                self.stats["handlings"]["preserve"] += 1
            rec.handling = h
            return
        if h is Handling.SWAP and not self.swap.swap_out(ctx):
            h = Handling.DISCARD  # the host pool is full
        if h is Handling.DISCARD:
            self.scheduler.preempt(ctx)  # blocks released; full ones stay in the prefix cache
        rec.handling = h
        self.stats["handlings"][h.value] += 1

    def _issue_swaps(self, batch: Batch) -> None:
        """Move what the swap budget allows behind this step's forward pass
        (InferCept's N_i), or everything queued for an unbudgeted swap."""
        if not self.swap.busy:
            return
        prof = self._profile()
        limit = None
        if self.interception.budgeted_swap and prof is not None:
            ctx_tokens = sum(ch.start + ch.num for ch in batch.chunks)
            it = prof.t_fwd(max(1, batch.num_tokens), ctx_tokens)
            limit = max(1, prof.swap_limit_tokens(it) // self.block_size)  # at least one block: progress

        def make_room() -> bool:
            victim = self.scheduler._victim(None, [], set())
            if victim is None:
                return False
            self.scheduler.preempt(victim)
            return True

        n_out, n_in, failed = self.swap.issue(limit, make_room, can_wait=bool(batch.chunks))
        for ctx in failed:  # no device block to come back to: recompute instead
            self.scheduler.preempt(ctx)
        self.stats["swap_out_blocks"] = self.swap.stats["swap_out_blocks"]
        self.stats["swap_in_blocks"] = self.swap.stats["swap_in_blocks"]
        if self.swap_trace is not None and (n_out or n_in):
            self.swap_trace.append((self.stats["steps"], n_out, n_in, limit))

    # -------------------------------------------------------------------- step
    def _step(self) -> None:
        if self.swap.inflight:
            self.swap.land()
        self._plan_interceptions()
        if self.ready:
            ready, self.ready = self.ready, []
            self._sample_and_emit(ready, torch.stack([c.last_logits for c in ready]))
        batch = self.scheduler.schedule()
        for ctx, err in batch.failed:
            self._fail(ctx, err)
        self._issue_swaps(batch)
        self.stats["host_used_blocks"] = self.swap.pool.num_used
        if not batch.chunks:
            return
        t0 = time.perf_counter()
        logits, rows = self.runner.run(batch)
        if self.device.type != "cuda":
            self._forward_took(time.perf_counter() - t0)
        self.stats["steps"] += 1
        for ch in batch.chunks:
            ctx = ch.ctx
            if ch.start < ctx.recompute_end:
                self.stats["recomputed_tokens"] += min(ch.start + ch.num, ctx.recompute_end) - ch.start
                if ch.start + ch.num >= ctx.recompute_end:
                    ctx.recompute_end = 0
            ctx.num_computed += ch.num
            self.blocks.seal_full_blocks(ctx.table, ctx.token_ids, ctx.num_computed)
            self.stats["decode_tokens" if ch.num == 1 and ch.start > 0 else "prefill_tokens"] += ch.num
        sampling_ctx, sampling_rows = [], []
        for r, ci in enumerate(rows):
            ctx = batch.chunks[ci].ctx
            if ctx.state is State.GENERATING:
                sampling_ctx.append(ctx)
                sampling_rows.append(r)
            else:
                ctx.last_logits = logits[r].clone()
                self.scheduler.remove(ctx)
            for op in ctx.fill_waiters:
                if not op.fut.done():
                    op.fut.set_result(len(ctx.token_ids))
            ctx.fill_waiters.clear()
        if sampling_ctx:
            self._sample_and_emit(sampling_ctx, logits[sampling_rows])
        # on CUDA run() only queued the step: its GPU time comes from events, once it has run
        # (after sampling, whose copy of the ids waited for it; a step that sampled nothing: later)
        for dt in self.runner.forward_seconds():
            self._forward_took(dt)

    def _forward_took(self, dt: float) -> None:
        self.stats["forward_s"] += dt
        self.iteration_s = dt if not self.iteration_s else 0.8 * self.iteration_s + 0.2 * dt

    def _sample_and_emit(self, ctxs: List[Context], logits: torch.Tensor) -> None:
        picks = sample(logits, [c.gen for c in ctxs])
        for ctx, (tok, lp) in zip(ctxs, picks):
            if tok < 0:
                self._fail(ctx, E.EngineError(f"logits processor failed: {lp!r}"))
                continue
            gen = ctx.gen
            ctx.token_ids.append(tok)
            gen.generated.append(tok)
            ctx.sched.segment_generated += 1
            ctx.last_logits = None
            self._on_token(ctx, tok, lp)

    def _on_token(self, ctx: Context, tok: int, lp: Optional[float]) -> None:
        gen = ctx.gen
        sp = gen.sampling
        is_eos = (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids
        text, finish, pause = token_text(gen, tok, is_eos=is_eos, at_limit=len(ctx.token_ids) >= self.max_model_len)
        if finish is not None:
            self._finish(ctx, finish, TokenEvent(tok, text, lp, finish))
            return
        if pause:  # _pause emits the held-back text too
            hint, gen.pause_hint = gen.pause_hint or PauseHint(), None
            self._pause(ctx, hint, TokenEvent(tok, text, lp))
            return
        gen.emit(TokenEvent(tok, text, lp))
        if ctx not in self.scheduler.active:
            self.scheduler.add(ctx)

    def _finish(self, ctx: Context, reason: str, event: Optional[TokenEvent] = None, emit: bool = True) -> None:
        gen = ctx.gen
        gen.done = True
        ctx.gen = None
        if ctx.intercept is not None and not ctx.intercept.parked:  # aborted while paused
            self._end_interception(ctx, returned=False)
        self.scheduler.remove(ctx)
        if ctx in self.ready:
            self.ready.remove(ctx)
        if emit:
            gen.emit(event or TokenEvent(None, "", None, reason))

    def _fail(self, ctx: Context, err: Exception) -> None:
        """A scheduled fill or generation cannot proceed: report ``err`` and
        undo the failed fills, so the context is as it was before them."""
        self.scheduler.remove(ctx)
        if ctx in self.ready:
            self.ready.remove(ctx)
        if ctx.fill_waiters:
            self._rollback_fills(ctx, 0, err)
        if ctx.gen is not None:
            gen = ctx.gen
            gen.done = True
            ctx.gen = None
            if ctx.intercept is not None and not ctx.intercept.parked:
                self._end_interception(ctx, returned=False)
            gen.emit(err)
