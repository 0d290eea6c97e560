"""A discrete-event simulator of a multi-tenant cluster serving a family of
fine-tuned variants, either one whole model per engine (per-model
provisioning) or BlockLLM-style block by block (block provisioning), on the
cost model of :mod:`block_cluster`.  Torch-free and seeded: the same inputs
give the same numbers.

What one run models:

* **Instances and GPUs.**  An instance is one copy of a block (or, per
  model, of a whole variant fused into one engine) on one GPU.  A GPU runs
  one run at a time; its instances take turns, oldest waiting request
  first.  A run packs up to ``max_batch`` queued requests (and
  ``max_batch_tokens`` new tokens) of one instance -- BlockLLM's loose
  per-block batching (§6) -- and carries them on through the following
  blocks of their chains that the same GPU holds (§4.3), up to the chain's
  end.  A request's first visit to a block that keeps
  KV reserves its whole context (prompt + output) on that GPU, and waits in
  the queue while the GPU has no room.
* **Requests.**  Iteration 0 is the prefill of the prompt through the whole
  chain; every later iteration decodes one token through the whole chain.
  Between two blocks the activations of the iteration's tokens travel at the
  link speed between the two GPUs (free on the same GPU); from the last
  block back to the first, a token id.
* **Dispatch** (§5.3).  The next block's instance is chosen by ``Latency =
  T_queue + T_compute + T_transfer + T_load`` with ``T_queue`` the GPU's
  remaining run, owed recomputation, and queued plus in-flight requests
  times its recent time per request (an O(1) stand-in for the sum of the
  queued batches' compute; counting in-flight requests stops a finished
  batch from herding onto one idle GPU), ``T_transfer`` the activation hop
  plus, off the request's KV home, the §5.1 migration of every KV block
  ahead that lives there (time plus the target's recomputation), ``T_load``
  what is left of the instance's load.  ``kv_policy``: ``owner-first``
  takes the least estimate, ties to the home -- so the owner is left only
  when it is worse by more than the migration -- and a request that leaves
  moves those blocks at once; ``least-loaded`` (the paper's ablation) takes
  the least ``T_queue + T_load`` and migrates KV block by block wherever it
  is.  Per-model engines are sticky: a request stays on the engine that
  prefilled it (no migration).
* **Migration** (§5.1): :func:`~block_cluster.migration_time`; the target
  GPU pays for the recomputed tokens in its next batch.
* **Scaling** (§5.3): when an instance's queue exceeds ``scale_threshold``
  of the maximum queue (the requests whose full KV fits a GPU beside one
  whole model), the block -- with locality placement, its whole co-located
  sub-component -- gets a new instance on another GPU (at most once per
  ``scale_cooldown_s`` per block), loaded from host memory: ``T_load =
  D_evicted / B_mem + D_block / B_host``.  Per model, a replica needs an
  empty GPU; with more variants than GPUs, a variant without an engine
  evicts the least recently used idle engine (no resident KV) and loads.
* **Placement** (§5.3): ``locality`` counts, from the traffic, how often
  two blocks directly follow each other (the co-dependency counter) and puts
  each block where its neighbours weigh most (same GPU counts twice, same
  server once), within ``weight_fraction`` of a GPU's memory; replicas too.
  ``naive`` (ablation) places round-robin and replicates onto a random GPU.
* **Speculation** (§5.2): ``speculate = k`` gives surrogates to the k blocks
  with the most expected work (traffic x time), never two consecutive blocks
  of any chain and never a chain's last block.  A speculated batch also runs
  the surrogate (``1 / surrogate_speedup`` of the block's time on the
  requests whose next block is not on this GPU -- the only hops it can
  hide); a correct guess (probability ``surrogate_accuracy``) sends the
  predicted activations at the surrogate's end, hiding up to the block's
  time of the next hop; a wrong one re-executes: the next GPU pays that
  request's work on the block again.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from .block_cluster import (GIB, BatchShape, Block, ClusterSimError, ClusterSpec, Family, WorkRequest, block_time,
                            migration_time)
from .metrics import percentile

MODES = ("per-model", "block")
PLACEMENTS = ("locality", "naive")
KV_POLICIES = ("owner-first", "least-loaded")
_ARRIVE, _ENQ, _DONE, _LOADED = 0, 1, 2, 3
TOKEN_ID_BYTES = 4


@dataclass(frozen=True)
class BlockSimConfig:
    """The policy knobs of one run (defaults: BlockLLM as described)."""

    mode: str = "block"
    placement: str = "locality"
    kv_policy: str = "owner-first"
    speculate: int = 0
    surrogate_accuracy: float = 0.83     # §7.3: 192 of 231 speculations were accurate
    surrogate_speedup: float = 20.0      # Table 4: a pruned transformer block, ~23x
    max_batch: int = 64
    max_batch_tokens: int = 8192
    scale_threshold: float = 0.25
    scale_cooldown_s: float = 1.0
    recompute_chunk: int = 512           # chunked-prefill size of a KV recomputation
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ClusterSimError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.placement not in PLACEMENTS:
            raise ClusterSimError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.kv_policy not in KV_POLICIES:
            raise ClusterSimError(f"kv policy must be one of {KV_POLICIES}, got {self.kv_policy!r}")
        if not (isinstance(self.speculate, int) and self.speculate >= 0):
            raise ClusterSimError(f"speculate must be an integer >= 0, got {self.speculate!r}")
        if not 0 <= self.surrogate_accuracy <= 1:
            raise ClusterSimError(f"surrogate accuracy must be in [0, 1], got {self.surrogate_accuracy!r}")
        if not self.surrogate_speedup >= 1:
            raise ClusterSimError(f"surrogate speed-up must be >= 1, got {self.surrogate_speedup!r}")
        if self.max_batch < 1 or self.max_batch_tokens < 1 or self.recompute_chunk < 1:
            raise ClusterSimError("max_batch, max_batch_tokens and recompute_chunk must be >= 1")
        if not 0 < self.scale_threshold <= 1 or self.scale_cooldown_s < 0:
            raise ClusterSimError("scale_threshold must be in (0, 1] and scale_cooldown_s >= 0")


@dataclass
class BlockSimResult:
    metrics: Dict[str, Any]
    placement: Dict[str, List[int]]     # block (or model) id -> GPUs of its instances at the start
    speculated: Tuple[str, ...]         # blocks given a surrogate
    chains: Dict[str, Tuple[str, ...]]  # variant -> the chain of block ids it runs through


class _Inst:
    __slots__ = ("block", "gpu", "ready_at", "queue", "resident")

    def __init__(self, block: Block, gpu: int, ready_at: float) -> None:
        self.block, self.gpu, self.ready_at = block, gpu, ready_at
        self.queue: Deque["_Req"] = deque()
        self.resident = 0                 # requests whose KV it holds


class _Gpu:
    __slots__ = ("idx", "server", "weights", "kv", "busy_until", "busy_s", "insts", "blocks", "queued",
                 "inbound", "t_per_req", "batch", "last_used", "debt")

    def __init__(self, idx: int, server: int) -> None:
        self.idx, self.server = idx, server
        self.weights = self.kv = 0.0
        self.busy_until = self.busy_s = self.t_per_req = self.last_used = self.debt = 0.0
        self.insts: List[_Inst] = []
        self.blocks: Dict[str, _Inst] = {}
        self.queued = 0
        self.inbound = 0                  # dispatched here, still on the wire
        self.batch: Optional[Tuple] = None


class _Req:
    __slots__ = ("w", "chain", "gen", "pos", "kv", "first", "finish", "enq_t")

    def __init__(self, w: WorkRequest, chain: Tuple[str, ...]) -> None:
        self.w, self.chain = w, chain
        self.gen = self.pos = 0
        self.kv: Dict[str, Tuple[_Inst, float]] = {}   # block id -> (owner instance, reserved bytes)
        self.first: Optional[float] = None
        self.finish: Optional[float] = None
        self.enq_t = 0.0


class _Sim:
    def __init__(self, cluster: ClusterSpec, family: Family, requests: Sequence[WorkRequest],
                 cfg: BlockSimConfig) -> None:
        if not requests:
            raise ClusterSimError("no requests to simulate")
        self.c, self.f, self.cfg = cluster, family, cfg
        self.rng = random.Random(cfg.seed * 31337 + 1)
        self.servers = cluster.gpu_servers()
        self.gpus = [_Gpu(i, s) for i, s in enumerate(self.servers)]
        self.mem = cluster.mem_bytes
        self.per_model = cfg.mode == "per-model"
        if self.per_model:
            self.blocks = {f"model:{v.name}": family.model_block(v) for v in family.variants}
            self.chains = {v.name: (f"model:{v.name}",) for v in family.variants}
        else:
            self.blocks = dict(family.blocks)
            self.chains = {v.name: v.chain for v in family.variants}
        self.variant_names = [v.name for v in family.variants]
        for r in requests:
            if not 0 <= r.variant < len(self.variant_names):
                raise ClusterSimError(f"request {r.id}: variant {r.variant} out of range")
        self.requests = [_Req(w, self.chains[self.variant_names[w.variant]]) for w in requests]
        self.max_context = max(w.prompt + w.output for w in requests)
        mean_ctx = sum(w.prompt + w.output / 2 for w in requests) / len(requests)
        self.used = sorted({b for ch in self.chains.values() for b in ch}, key=self._block_order)
        # co-dependency counter and expected work, from the traffic
        self.codep: Dict[str, Dict[str, float]] = {b: {} for b in self.used}
        self.traffic: Dict[str, float] = {b: 0.0 for b in self.used}
        for r in self.requests:
            ch, n = r.chain, r.w.output
            for a, b in zip(ch, ch[1:]):
                self._count(a, b, n)
            if len(ch) > 1 and n > 1:
                self._count(ch[-1], ch[0], n - 1)
            for b in ch:
                self.traffic[b] += n
        shape1 = BatchShape()
        shape1.add_decode(int(mean_ctx))
        self.t1 = {b: block_time(self.blocks[b], shape1, cluster) for b in self.used}
        self.rec_rate: Dict[str, float] = {}
        full = max((family.model_block(v) for v in family.variants), key=lambda b: b.weight_bytes)
        self.max_queue = max(1, int((self.mem - full.weight_bytes) / (full.kv_bytes_per_token * self.max_context)))
        self.instances: Dict[str, List[_Inst]] = {b: [] for b in self.used}
        self.pending: Dict[str, List[_Req]] = {b: [] for b in self.used}
        self.cooldown: Dict[str, float] = {}
        self.heap: List[Tuple] = []
        self.seq = 0
        self.now = 0.0
        self.s: Dict[str, float] = {k: 0 for k in (
            "hops_gpu", "hops_server", "hops_inter", "bytes_gpu", "bytes_server", "bytes_inter", "migrations",
            "kv_bytes_moved", "kv_tokens_recomputed", "load_events", "load_time_s", "evictions", "batches",
            "batched_requests", "spec_hits", "spec_misses", "spec_saved_s", "spec_cost_s")}
        self.w_total = self.kv_total = self.w_peak = self.kv_peak = self.mem_peak = 0.0
        self._place_initial()
        self.w_initial = self.w_total
        self.placement_at_start = {b: sorted(i.gpu for i in insts) for b, insts in self.instances.items() if insts}
        self.speculated = self._pick_speculated() if not self.per_model else ()
        self.spec_set = set(self.speculated)

    # ------------------------------------------------------------ helpers
    def _block_order(self, b: str) -> Tuple[int, str]:
        base = self.f.base_chain
        return (base.index(b), "") if b in base else (len(base), b)

    def _count(self, a: str, b: str, n: float) -> None:
        if a == b:
            return
        self.codep[a][b] = self.codep[a].get(b, 0.0) + n
        self.codep[b][a] = self.codep[b].get(a, 0.0) + n

    def _push(self, t: float, kind: int, a: Any, b: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _account(self, dw: float = 0.0, dkv: float = 0.0) -> None:
        self.w_total += dw
        self.kv_total += dkv
        self.w_peak = max(self.w_peak, self.w_total)
        self.kv_peak = max(self.kv_peak, self.kv_total)
        self.mem_peak = max(self.mem_peak, self.w_total + self.kv_total)

    def _kv_need(self, r: _Req, blk: Block) -> float:
        return (r.w.prompt + r.w.output) * blk.kv_bytes_per_token

    def _free(self, g: _Gpu) -> float:
        return self.mem - g.weights - g.kv

    # ---------------------------------------------------------- placement
    def _eligible(self, blks: Sequence[Block], g: _Gpu) -> bool:
        if any(b.id in g.blocks for b in blks):
            return False
        w = sum(b.weight_bytes for b in blks)
        if self.per_model:
            if g.insts:
                return False
        elif g.weights + w > self.c.weight_fraction * self.mem:
            return False
        # room for the weights and one request of the longest context
        return self._free(g) - w >= sum(b.kv_bytes_per_token for b in blks) * self.max_context

    def _pick_gpu(self, blks: Sequence[Block], rr: Optional[int] = None) -> Optional[_Gpu]:
        """Where new instances of ``blks`` go: round-robin from GPU ``rr``
        (naive initial placement), a random GPU (naive scaling), the first
        empty GPU (per model), else the GPU where their co-dependent blocks
        weigh most (same GPU twice, same server once), least loaded first."""
        ok = [g for g in self.gpus if self._eligible(blks, g)]
        if not ok:
            return None
        if self.per_model:
            return ok[0]
        if self.cfg.placement == "naive":
            if rr is not None:
                return min(ok, key=lambda g: (g.idx - rr) % len(self.gpus))
            return self.rng.choice(ok)
        ids = {b.id for b in blks}

        def score(g: _Gpu) -> Tuple:
            s = 0.0
            for b in ids:
                for n, cnt in self.codep.get(b, {}).items():
                    if n in ids:
                        continue
                    for inst in self.instances.get(n, ()):
                        if inst.gpu == g.idx:
                            s += 2 * cnt
                        elif self.servers[inst.gpu] == g.server:
                            s += cnt
            load = max(0.0, g.busy_until - self.now) + g.debt + (g.queued + g.inbound) * g.t_per_req
            return (-s, load, g.weights, g.idx)
        return min(ok, key=score)

    def _add_instance(self, blk: Block, g: _Gpu, ready_at: float) -> _Inst:
        inst = _Inst(blk, g.idx, ready_at)
        g.insts.append(inst)
        g.blocks[blk.id] = inst
        g.weights += blk.weight_bytes
        self.instances[blk.id].append(inst)
        self._account(dw=blk.weight_bytes)
        return inst

    def _place_initial(self) -> None:
        if self.per_model:
            order = sorted(self.used, key=lambda b: (-self.traffic[b], b))
            for b in order:
                blk = self.blocks[b]
                if blk.weight_bytes + blk.kv_bytes_per_token * self.max_context > self.mem:
                    raise ClusterSimError(
                        f"variant {blk.owner} does not fit a {self.c.gpu_mem_gib:g} GiB GPU: "
                        f"{blk.weight_bytes / GIB:.1f} GiB weights + "
                        f"{blk.kv_bytes_per_token * self.max_context / GIB:.1f} GiB KV of one longest request")
                g = self._pick_gpu([blk])
                if g is None:
                    break              # more variants than GPUs: the rest are loaded on demand
                self._add_instance(blk, g, 0.0)
            return
        for i, b in enumerate(self.used):
            blk = self.blocks[b]
            g = self._pick_gpu([blk], rr=i)
            if g is None:
                need = sum(self.blocks[x].weight_bytes for x in self.used) / GIB
                raise ClusterSimError(
                    f"the distinct blocks ({need:.1f} GiB) do not fit the cluster: block {b} "
                    f"({blk.weight_bytes / GIB:.2f} GiB) finds no GPU with room within weight_fraction "
                    f"{self.c.weight_fraction:g} of {self.c.gpu_mem_gib:g} GiB")
            self._add_instance(blk, g, 0.0)

    def _pick_speculated(self) -> Tuple[str, ...]:
        k = self.cfg.speculate
        if k == 0:
            return ()
        last = {ch[-1] for ch in self.chains.values()}
        adjacent = {frozenset(p) for ch in self.chains.values() for p in zip(ch, ch[1:])}
        chosen: List[str] = []
        for b in sorted(self.used, key=lambda b: (-self.traffic[b] * self.t1[b], b)):
            if len(chosen) == k:
                break
            if b in last or any(frozenset((b, c)) in adjacent for c in chosen):
                continue
            chosen.append(b)
        return tuple(chosen)

    # ------------------------------------------------------------ costs
    def _recompute_rate(self, blk: Block) -> float:
        r = self.rec_rate.get(blk.id)
        if r is None:
            shape = BatchShape()
            shape.add_prefill(self.cfg.recompute_chunk)
            r = self.rec_rate[blk.id] = self.cfg.recompute_chunk / block_time(blk, shape, self.c)
        return r

    def _migration(self, r: _Req, blk: Block, src: int, dst: int):
        _, bw, lat = self.c.link(src, dst, self.servers)
        return migration_time(r.w.prompt + r.gen, self._recompute_rate(blk), bw / blk.kv_bytes_per_token, lat)

    def _hop(self, src: int, dst: int, nbytes: float) -> float:
        _, bw, lat = self.c.link(src, dst, self.servers)
        return lat + nbytes / bw

    def _t_queue(self, inst: _Inst) -> float:
        """``T_queue + T_load``: the GPU's remaining run, its owed recomputation,
        and its queued and inbound requests at its recent time per request
        (an O(1) stand-in for §5.3's sum over the queued batches), plus what
        is left of the instance's load."""
        g = self.gpus[inst.gpu]
        return (max(0.0, g.busy_until - self.now) + g.debt + (g.queued + g.inbound) * g.t_per_req
                + max(0.0, inst.ready_at - self.now))

    # ------------------------------------------------------------ dispatch
    def _kv_home(self, r: _Req, bid: str) -> Optional[int]:
        """The GPU holding the request's KV for ``bid`` or, for a block without
        KV, for the next block of the chain that has some (None: no KV yet)."""
        owned = r.kv.get(bid)
        if owned is not None:
            return owned[0].gpu
        for nb in r.chain[r.pos:]:
            o = r.kv.get(nb)
            if o is not None:
                return o[0].gpu
            if self.blocks[nb].kv_bytes_per_token:
                return None
        return None

    def _bulk(self, r: _Req, home: int, dst: int) -> Tuple[List[Tuple[Block, _Inst]], Optional[Any]]:
        """Moving the request off ``home`` to GPU ``dst`` for the rest of this
        iteration: the KV blocks ahead whose KV is on ``home`` and that
        ``dst`` holds too, and one §5.1 migration of all of them together
        (recomputation at the blocks' combined rate, copy at the link's speed
        over their combined KV per token)."""
        moved = []
        for nb in r.chain[r.pos:]:
            o = r.kv.get(nb)
            inst = self.gpus[dst].blocks.get(nb)
            if o is not None and o[0].gpu == home and inst is not None:
                moved.append((self.blocks[nb], inst))
        if not moved:
            return moved, None
        _, bw, lat = self.c.link(home, dst, self.servers)
        rec = 1.0 / sum(1.0 / self._recompute_rate(b) for b, _ in moved)
        kv = sum(b.kv_bytes_per_token for b, _ in moved)
        return moved, migration_time(r.w.prompt + r.gen, rec, bw / kv, lat)

    def _leave_cost(self, r: _Req, home: int, dst: int, memo: Dict[str, float]) -> float:
        """The estimate's price of leaving the home GPU: the bulk migration's
        time plus the recomputation it makes ``dst`` do (memoised per link class)."""
        cls = self.c.link(home, dst, self.servers)[0]
        if cls not in memo:
            moved, m = self._bulk(r, home, dst)
            memo[cls] = 0.0 if m is None else m.time_s + m.recomputed_tokens * sum(
                1.0 / self._recompute_rate(b) for b, _ in moved)
        return memo[cls]

    def _choose(self, r: _Req, bid: str, src: Optional[int], nbytes: float) -> Optional[_Inst]:
        """§5.3's estimate ``T_queue + T_compute + T_transfer + T_load`` over
        the instances of ``bid``.  ``owner-first``: an instance off the KV's
        home GPU also pays the migration of the KV it would pull, so the
        owner loses only when it is worse by more than that; ties go to it.
        ``least-loaded``: the least ``T_queue + T_load``, KV wherever it is."""
        insts = self.instances[bid]
        if not insts:
            return None
        owned = r.kv.get(bid)
        if owned is not None and (self.per_model or len(insts) == 1):
            return owned[0]
        if len(insts) == 1:
            return insts[0]
        blk = self.blocks[bid]
        home = self._kv_home(r, bid) if self.cfg.kv_policy == "owner-first" else None
        ordered = sorted(insts, key=lambda i: i.gpu != home)
        memo: Dict[str, float] = {}
        best, best_key = None, math.inf
        for inst in ordered:
            if owned is not None and inst is not owned[0] and self._free(self.gpus[inst.gpu]) < self._kv_need(r, blk):
                continue                 # no room for the migrated KV there
            if self.cfg.kv_policy == "least-loaded":
                key = self._t_queue(inst)
            else:
                tr = self._hop(src, inst.gpu, nbytes) if src is not None else 0.0
                if home is not None and inst.gpu != home:
                    tr += self._leave_cost(r, home, inst.gpu, memo)
                key = self._t_queue(inst) + self.t1[bid] + tr
            if key < best_key:
                best, best_key = inst, key
        return best if best is not None else owned[0] if owned is not None else insts[0]

    def _dispatch(self, r: _Req, src: Optional[int], nbytes: float, spec_block_s: Optional[float] = None) -> None:
        bid = r.chain[r.pos]
        inst = self._choose(r, bid, src, nbytes)
        if inst is None:                 # per model: no engine holds this variant now
            self.pending[bid].append(r)
            self._try_swap()
            return
        delay = 0.0
        if src is not None:
            cls, _, _ = self.c.link(src, inst.gpu, self.servers)
            self.s["hops_" + cls] += 1
            self.s["bytes_" + cls] += nbytes
            delay = self._hop(src, inst.gpu, nbytes)
        mig = 0.0
        home = self._kv_home(r, bid)
        if home is not None and home != inst.gpu and self.cfg.kv_policy == "owner-first":
            mig = self._move(r, home, inst.gpu)
        owned = r.kv.get(bid)
        if owned is not None and owned[0] is not inst:
            mig = max(mig, self._migrate(r, owned, inst))
        if spec_block_s is not None and src is not None and src != inst.gpu:
            if self.rng.random() < self.cfg.surrogate_accuracy:
                self.s["spec_hits"] += 1
                hidden = min(delay, spec_block_s)
                self.s["spec_saved_s"] += hidden
                delay -= hidden
            else:
                self.s["spec_misses"] += 1
                redo = self.t1[bid]
                self.gpus[inst.gpu].debt += redo
                self.s["spec_cost_s"] += redo
        self.gpus[inst.gpu].inbound += 1
        self._push(self.now + max(delay, mig), _ENQ, r, inst)

    def _move(self, r: _Req, home: int, dst: int) -> float:
        """Owner-first leaving its home: migrate every KV block ahead that
        ``dst`` holds, as one (see :meth:`_bulk`); returns its time."""
        moved, m = self._bulk(r, home, dst)
        if m is None:
            return 0.0
        need = sum(r.kv[b.id][1] for b, _ in moved)
        if self._free(self.gpus[dst]) < need:
            return 0.0                   # no room: the blocks migrate one by one if at all
        self._count_migration(m, sum(b.kv_bytes_per_token for b, _ in moved),
                              m.recomputed_tokens * sum(1.0 / self._recompute_rate(b) for b, _ in moved), dst)
        for b, inst in moved:
            self._rehome(r, r.kv[b.id], inst)
        self._try_start(self.gpus[home])
        return m.time_s

    def _count_migration(self, m: Any, kv_per_token: float, recompute_s: float, dst: int) -> None:
        self.s["migrations"] += 1
        self.s["kv_bytes_moved"] += m.copied_tokens * kv_per_token
        self.s["kv_tokens_recomputed"] += m.recomputed_tokens
        self.gpus[dst].debt += recompute_s

    def _rehome(self, r: _Req, owned: Tuple[_Inst, float], dst: _Inst) -> None:
        src_inst, nbytes = owned
        self.gpus[src_inst.gpu].kv -= nbytes
        src_inst.resident -= 1
        self.gpus[dst.gpu].kv += nbytes
        dst.resident += 1
        r.kv[dst.block.id] = (dst, nbytes)

    def _migrate(self, r: _Req, owned: Tuple[_Inst, float], dst: _Inst) -> float:
        """One block's KV to ``dst`` (§5.1); returns the migration's time."""
        blk = dst.block
        m = self._migration(r, blk, owned[0].gpu, dst.gpu)
        self._count_migration(m, blk.kv_bytes_per_token, m.recomputed_tokens / self._recompute_rate(blk), dst.gpu)
        src_gpu = self.gpus[owned[0].gpu]
        self._rehome(r, owned, dst)
        self._try_start(src_gpu)         # memory freed there
        return m.time_s

    # ------------------------------------------------------------ engines
    def _reserve(self, r: _Req, inst: _Inst, g: _Gpu) -> bool:
        """The request's KV at this block instance: already there, or reserved
        now for its whole context if the GPU has room (else False)."""
        blk = inst.block
        if not blk.kv_bytes_per_token:
            return True
        owned = r.kv.get(blk.id)
        if owned is not None:
            return owned[0] is inst
        need = self._kv_need(r, blk)
        if self._free(g) < need:
            return False
        g.kv += need
        inst.resident += 1
        r.kv[blk.id] = (inst, need)
        self._account(dkv=need)
        return True

    @staticmethod
    def _shape(reqs: Sequence[_Req]) -> BatchShape:
        shape = BatchShape()
        for r in reqs:
            if r.gen == 0:
                shape.add_prefill(r.w.prompt)
            else:
                shape.add_decode(r.w.prompt + r.gen)
        return shape

    def _try_start(self, g: _Gpu) -> None:
        """Start a run on an idle GPU: a batch from the instance whose oldest
        request waited longest, carried on through the following blocks of
        each request's chain that this GPU also holds (BlockLLM runs
        consecutive co-located blocks as one sub-component, §4.3), up to the
        chain's end.  The run occupies the GPU for the sum of its steps and
        releases its requests at its end."""
        if g.batch is not None:
            return
        cands = [i for i in g.insts if i.queue and i.ready_at <= self.now]
        cands.sort(key=lambda i: i.queue[0].enq_t)
        for inst in cands:
            batch: List[_Req] = []
            keep: Deque[_Req] = deque()
            tokens = 0
            for r in inst.queue:
                new = r.w.prompt if r.gen == 0 else 1
                if (len(batch) >= self.cfg.max_batch or (batch and tokens + new > self.cfg.max_batch_tokens)
                        or not self._reserve(r, inst, g)):
                    keep.append(r)       # next batch, or waits for memory
                    continue
                batch.append(r)
                tokens += new
            if not batch:
                continue
            inst.queue = keep
            g.queued -= len(batch)
            t, spec = self._run(g, inst, batch)
            g.busy_until = self.now + t
            g.busy_s += t
            g.last_used = self.now
            g.t_per_req = t / len(batch) if g.t_per_req == 0 else 0.8 * g.t_per_req + 0.2 * t / len(batch)
            g.batch = (batch, spec)
            self.s["batches"] += 1
            self.s["batched_requests"] += len(batch)
            self._push(self.now + t, _DONE, g)
            return

    def _run(self, g: _Gpu, inst: _Inst, batch: List[_Req]) -> Tuple[float, Dict[int, float]]:
        """Time of the run starting with ``batch`` at ``inst`` (module doc),
        advancing each request's position to the last block it runs here.
        Returns the time and, for requests leaving a speculated block for
        another GPU, that block's time (what a correct guess can hide)."""
        t = g.debt
        g.debt = 0.0
        spec: Dict[int, float] = {}
        frontier: List[Tuple[_Inst, List[_Req]]] = [(inst, batch)]
        while frontier:
            cur, reqs = frontier.pop(0)
            shape = self._shape(reqs)
            t_block = block_time(cur.block, shape, self.c)
            t += t_block
            groups: Dict[int, Tuple[_Inst, List[_Req]]] = {}
            leaving: List[_Req] = []
            for r in reqs:
                if r.pos == len(r.chain) - 1:
                    continue             # the chain's end: a token, then dispatch
                nxt = g.blocks.get(r.chain[r.pos + 1])
                if nxt is not None and nxt.ready_at <= self.now and self._reserve(r, nxt, g):
                    r.pos += 1
                    groups.setdefault(id(nxt), (nxt, []))[1].append(r)
                else:
                    leaving.append(r)
            if leaving and cur.block.id in self.spec_set:
                t_sur = block_time(cur.block, self._shape(leaving), self.c) / self.cfg.surrogate_speedup
                t += t_sur
                self.s["spec_cost_s"] += t_sur * len(reqs)
                for r in leaving:
                    spec[id(r)] = t_block
            frontier.extend(groups.values())
        return t, spec

    def _done(self, g: _Gpu) -> None:
        batch, spec = g.batch
        g.batch = None
        hidden = self.f.model.hidden * self.f.model.act_bytes
        freed = False
        for r in batch:
            if r.pos == len(r.chain) - 1:
                r.gen += 1
                if r.gen == 1:
                    r.first = self.now
                if r.gen >= r.w.output:
                    self._finish(r)
                    freed = True
                    continue
                r.pos = 0
                nbytes = float(TOKEN_ID_BYTES)
            else:
                r.pos += 1
                nbytes = float((r.w.prompt if r.gen == 0 else 1) * hidden)
            self._dispatch(r, g.idx, nbytes, spec.get(id(r)))
        if freed:
            for other in self.gpus:
                self._try_start(other)
            if self.per_model:
                self._try_swap()
        else:
            self._try_start(g)

    def _finish(self, r: _Req) -> None:
        r.finish = self.now
        for inst, nbytes in r.kv.values():
            self.gpus[inst.gpu].kv -= nbytes
            inst.resident -= 1
            self._account(dkv=-nbytes)
        r.kv.clear()

    def _segment(self, inst: _Inst) -> List[Block]:
        """The sub-component ``inst`` runs in: the blocks on its GPU connected
        to it by co-dependency (chain neighbours), in chain order.  Per model,
        or with naive placement (which knows no co-dependency), the block alone."""
        if self.per_model or self.cfg.placement == "naive":
            return [inst.block]
        g = self.gpus[inst.gpu]
        seen, todo = {inst.block.id}, [inst.block.id]
        while todo:
            for n in self.codep.get(todo.pop(), {}):
                if n not in seen and n in g.blocks:
                    seen.add(n)
                    todo.append(n)
        return [self.blocks[b] for b in sorted(seen, key=self._block_order)]

    def _maybe_scale(self, inst: _Inst) -> None:
        """§5.3's scaling: a queue past ``scale_threshold`` of the maximum
        gets its block -- with locality, its whole co-located sub-component --
        a new instance elsewhere, loaded from host memory."""
        if len(inst.queue) <= self.cfg.scale_threshold * self.max_queue:
            return
        bid = inst.block.id
        if self.now < self.cooldown.get(bid, -1.0):
            return
        seg = self._segment(inst)
        g = self._pick_gpu(seg)
        if g is None and len(seg) > 1:
            seg = [inst.block]
            g = self._pick_gpu(seg)
        for b in seg:
            self.cooldown[b.id] = self.now + self.cfg.scale_cooldown_s
        if g is None:
            return
        lt = self._load_time_many(seg)
        for b in seg:
            new = self._add_instance(b, g, self.now + lt)
            self._push(new.ready_at, _LOADED, new)
        self.s["load_events"] += 1
        self.s["load_time_s"] += lt

    def _load_time_many(self, blks: Sequence[Block], evicted_bytes: float = 0.0) -> float:
        """``T_swap = D_evicted / B_mem + D_blocks / B_host`` (§5.3; loaded from host memory)."""
        return evicted_bytes / self.c.hbm_bytes_s + sum(b.weight_bytes for b in blks) / (self.c.host_load_gbs * 1e9)

    def _try_swap(self) -> None:
        """Per model, more variants than GPUs: give each waiting variant an
        engine, on an empty GPU or in place of the least recently used idle one."""
        waiting = sorted((reqs[0].w.arrival, bid) for bid, reqs in self.pending.items()
                         if reqs and not self.instances[bid])
        for _, bid in waiting:
            blk = self.blocks[bid]
            empty = [g for g in self.gpus if not g.insts]
            evicted = 0.0
            if empty:
                g = empty[0]
            else:
                idle = [g for g in self.gpus if g.batch is None and all(
                    i.resident == 0 and not i.queue and i.ready_at <= self.now
                    and not self.pending[i.block.id] for i in g.insts)]
                if not idle:
                    return
                g = min(idle, key=lambda g: (g.last_used, g.idx))
                for old in list(g.insts):
                    evicted += old.block.weight_bytes
                    self.instances[old.block.id].remove(old)
                    del g.blocks[old.block.id]
                    g.weights -= old.block.weight_bytes
                    self._account(dw=-old.block.weight_bytes)
                    self.s["evictions"] += 1
                g.insts.clear()
            lt = self._load_time_many([blk], evicted)
            new = self._add_instance(blk, g, self.now + lt)
            self.s["load_events"] += 1
            self.s["load_time_s"] += lt
            self._push(new.ready_at, _LOADED, new)

    # ------------------------------------------------------------ run
    def run(self) -> BlockSimResult:
        for r in self.requests:
            self._push(r.w.arrival, _ARRIVE, r)
        while self.heap:
            t, _, kind, a, b = heapq.heappop(self.heap)
            self.now = t
            if kind == _ARRIVE:
                self._dispatch(a, None, 0.0)
            elif kind == _ENQ:
                a.enq_t = t
                b.queue.append(a)
                g = self.gpus[b.gpu]
                g.queued += 1
                g.inbound -= 1
                self._maybe_scale(b)
                self._try_start(g)
            elif kind == _DONE:
                self._done(a)
            else:  # _LOADED
                waiting = self.pending[a.block.id]
                self.pending[a.block.id] = []
                for r in waiting:
                    self.gpus[a.gpu].inbound += 1
                    self._push(t, _ENQ, r, a)
                self._try_start(self.gpus[a.gpu])
        stuck = [r.w.id for r in self.requests if r.finish is None]
        if stuck:
            raise ClusterSimError(f"{len(stuck)} requests never finished (e.g. {stuck[:3]}): "
                                  f"the cluster cannot hold them")
        return BlockSimResult(self._metrics(), self.placement_at_start, self.speculated, dict(self.chains))

    def _metrics(self) -> Dict[str, Any]:
        reqs = self.requests
        start = min(r.w.arrival for r in reqs)
        makespan = max(r.finish for r in reqs) - start
        e2e = [r.finish - r.w.arrival for r in reqs]
        ttft = [r.first - r.w.arrival for r in reqs]
        tokens = sum(r.w.output for r in reqs)
        s = self.s
        hops = s["hops_gpu"] + s["hops_server"] + s["hops_inter"]
        act = s["bytes_gpu"] + s["bytes_server"] + s["bytes_inter"]
        busy = sum(g.busy_s for g in self.gpus)
        return {
            "mode": self.cfg.mode, "placement": self.cfg.placement if not self.per_model else "one model per GPU",
            "kv_policy": self.cfg.kv_policy if not self.per_model else "sticky",
            "variants": len(self.variant_names), "gpus": len(self.gpus),
            "completed": len(reqs), "output_tokens": tokens, "makespan_s": makespan,
            "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
            "latency_p50_s": percentile(e2e, 50), "latency_p95_s": percentile(e2e, 95),
            "latency_mean_s": sum(e2e) / len(e2e), "ttft_p50_s": percentile(ttft, 50),
            "gpu_util": busy / (len(self.gpus) * makespan) if makespan > 0 else 0.0,
            "weights_initial_gib": self.w_initial / GIB, "weights_peak_gib": self.w_peak / GIB,
            "weights_one_model_per_engine_gib": self.f.per_model_weight_bytes() / GIB,
            "kv_peak_gib": self.kv_peak / GIB, "mem_peak_gib": self.mem_peak / GIB,
            "instances_final": sum(len(v) for v in self.instances.values()),
            "mean_batch": s["batched_requests"] / s["batches"] if s["batches"] else 0.0,
            "hops": int(hops),
            "hop_frac_gpu": s["hops_gpu"] / hops if hops else 0.0,
            "hop_frac_server": s["hops_server"] / hops if hops else 0.0,
            "hop_frac_inter": s["hops_inter"] / hops if hops else 0.0,
            "act_mib_gpu": s["bytes_gpu"] / 2 ** 20, "act_mib_server": s["bytes_server"] / 2 ** 20,
            "act_mib_inter": s["bytes_inter"] / 2 ** 20, "act_mib_total": act / 2 ** 20,
            "migrations": int(s["migrations"]), "kv_mib_moved": s["kv_bytes_moved"] / 2 ** 20,
            "kv_tokens_recomputed": int(s["kv_tokens_recomputed"]),
            "load_events": int(s["load_events"]), "load_time_s": s["load_time_s"], "evictions": int(s["evictions"]),
            "speculated_blocks": list(self.speculated), "spec_hits": int(s["spec_hits"]),
            "spec_misses": int(s["spec_misses"]), "spec_saved_s": s["spec_saved_s"],
            "spec_cost_s": s["spec_cost_s"], "spec_net_s": s["spec_cost_s"] - s["spec_saved_s"],
        }


def simulate_cluster(cluster: ClusterSpec, family: Family, requests: Sequence[WorkRequest],
                     cfg: BlockSimConfig = BlockSimConfig()) -> BlockSimResult:
    """Run one provisioning mode over ``requests`` (see module doc)."""
    return _Sim(cluster, family, requests, cfg).run()


__all__ = ["MODES", "PLACEMENTS", "KV_POLICIES", "BlockSimConfig", "BlockSimResult", "simulate_cluster"]
