"""What the BlockLLM cluster simulator (``blocks``) reasons about: a cluster,
a model family cut into blocks, a roofline cost per block, a workload, and
the KV-migration arithmetic of BlockLLM §5.1.  Torch-free, seeded.

Everything here is a *cost model*: times are ``max(flops / peak, bytes /
bandwidth) + launch overhead`` on nominal hardware numbers, never
measurements, so the simulator compares provisioning policies under the same
assumptions rather than predicting a real deployment.

* :class:`ClusterSpec` -- servers x GPUs, memory, peak compute and HBM
  bandwidth, intra-server (NVLink-like) and inter-server links, the host
  link blocks are loaded over.  The defaults are roughly BlockLLM's testbed
  (4 servers: 2x2 + 2x4 A100-80GB, 100 Gb/s between servers).
* :class:`ModelSpec` -- the foundation model (Llama-7B-like by default).
* :class:`FamilySpec` / :func:`build_family` -- N variants of that base,
  each a chain of blocks: ``embed``, ``layers_per_block`` transformer layers
  per layer-block, ``head``.  A *full fine-tune* (FF) changes k middle/late
  layer-blocks (the paper: sharing early layers costs accuracy, later ones
  do not); each changed block is, with ``equivalence_prob``, judged
  equivalent to the base block by the zoo and shared, else unique.  A
  *LoRA* variant adds one tiny adapter block after every layer-block
  (BlockLLM's lazy partitioning: foundation + PE adapter).
* :func:`block_time` -- the roofline of one block on one batch.
* :class:`WorkloadSpec` / :func:`generate_workload` -- Poisson arrivals,
  skewed popularity (the paper's uniform-rate weights, or Zipf), lognormal
  prompt / output lengths.
* :func:`migration_time` -- §5.1's overlapped migration: recompute from the
  front while copying from the back; done where they meet.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

GIB = 1024 ** 3


class ClusterSimError(ValueError):
    """Bad input to the cluster simulator (a spec field, a workload, a
    family that cannot be placed): one line a user can act on."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ClusterSimError(msg)


def _positive(obj: Any, names: Tuple[str, ...], where: str, allow_zero: Tuple[str, ...] = ()) -> None:
    for n in names:
        v = getattr(obj, n)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        _need(ok and (v >= 0 if n in allow_zero else v > 0),
              f"{where}.{n} must be a {'non-negative' if n in allow_zero else 'positive'} number, got {v!r}")


def _from_dict(cls, d: Any, where: str):
    """A dataclass from a JSON object: unknown keys and wrong types are
    errors (a typo in a cluster file must not silently fall back to a default)."""
    if not isinstance(d, dict):
        raise ClusterSimError(f"{where}: expected a JSON object, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    _need(not unknown, f"{where}: unknown fields {unknown} (known: {sorted(known)})")
    kw: Dict[str, Any] = {}
    for k, v in d.items():
        default = known[k].default if known[k].default is not MISSING else None
        if isinstance(default, tuple):
            _need(isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
                  f"{where}.{k}: expected a list of integers, got {v!r}")
            v = tuple(v)
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            _need(isinstance(v, (int, float)) and not isinstance(v, bool), f"{where}.{k}: expected a number, got {v!r}")
        kw[k] = v
    return cls(**kw)


# --------------------------------------------------------------------- cluster
@dataclass(frozen=True)
class ClusterSpec:
    """The hardware.  Bandwidths are per direction; efficiencies say what
    fraction of the nominal peak a kernel reaches (roofline, not measured)."""

    gpus_per_server: Tuple[int, ...] = (2, 2, 4, 4)
    gpu_mem_gib: float = 80.0
    peak_tflops: float = 312.0          # A100 dense bf16
    mfu: float = 0.6                    # fraction of peak a GEMM reaches
    hbm_gbs: float = 2039.0             # A100-80GB HBM2e
    hbm_eff: float = 0.8
    intra_server_gbs: float = 300.0     # NVLink3: 600 GB/s both directions
    intra_server_latency_s: float = 10e-6
    inter_server_gbps: float = 100.0    # the paper's 100 Gb/s
    inter_server_latency_s: float = 50e-6
    host_load_gbs: float = 25.0         # PCIe 4 x16 from host memory: where blocks/models are loaded from
    launch_s: float = 20e-6             # per block execution (dispatch, sync)
    layer_launch_s: float = 10e-6       # per transformer layer in the block (kernel launches)
    weight_fraction: float = 0.5        # block placement puts at most this share of a GPU's memory in weights

    def __post_init__(self) -> None:
        _need(isinstance(self.gpus_per_server, tuple) and len(self.gpus_per_server) >= 1,
              "cluster.gpus_per_server must list at least one server")
        _need(all(isinstance(g, int) and g >= 0 for g in self.gpus_per_server),
              f"cluster.gpus_per_server must be non-negative integers, got {list(self.gpus_per_server)}")
        _need(sum(self.gpus_per_server) >= 1, "cluster has zero GPUs")
        _positive(self, ("gpu_mem_gib", "peak_tflops", "mfu", "hbm_gbs", "hbm_eff", "intra_server_gbs",
                         "inter_server_gbps", "host_load_gbs", "weight_fraction"), "cluster")
        _positive(self, ("intra_server_latency_s", "inter_server_latency_s", "launch_s", "layer_launch_s"),
                  "cluster", allow_zero=("intra_server_latency_s", "inter_server_latency_s", "launch_s",
                                         "layer_launch_s"))
        _need(self.mfu <= 1 and self.hbm_eff <= 1 and self.weight_fraction <= 1,
              "cluster.mfu, hbm_eff and weight_fraction must be <= 1")

    @property
    def n_gpus(self) -> int:
        return sum(self.gpus_per_server)

    def gpu_servers(self) -> List[int]:
        """Server index of each GPU, GPUs numbered server by server."""
        return [s for s, n in enumerate(self.gpus_per_server) for _ in range(n)]

    @property
    def mem_bytes(self) -> float:
        return self.gpu_mem_gib * GIB

    @property
    def flops_s(self) -> float:
        return self.peak_tflops * 1e12 * self.mfu

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_gbs * 1e9 * self.hbm_eff

    def link(self, a: int, b: int, servers: List[int]) -> Tuple[str, float, float]:
        """(class, bytes/s, latency s) between GPUs ``a`` and ``b``; same GPU is
        free (the activation stays in HBM)."""
        if a == b:
            return "gpu", math.inf, 0.0
        if servers[a] == servers[b]:
            return "server", self.intra_server_gbs * 1e9, self.intra_server_latency_s
        return "inter", self.inter_server_gbps / 8 * 1e9, self.inter_server_latency_s

    @classmethod
    def from_json(cls, text_or_path: str) -> "ClusterSpec":
        """A spec from inline JSON (``{...}``) or a JSON file; fields not
        given keep the defaults."""
        src = text_or_path.strip()
        where = "cluster"
        if not src.startswith("{"):
            p = Path(src)
            if not p.is_file():
                raise ClusterSimError(f"cluster {text_or_path!r}: neither inline JSON nor an existing file")
            src, where = p.read_text(), f"cluster {p}"
        try:
            d = json.loads(src)
        except json.JSONDecodeError as e:
            raise ClusterSimError(f"{where}: malformed JSON: {e}") from e
        try:
            return _from_dict(cls, d, where)
        except TypeError as e:  # pragma: no cover - _from_dict checks names first
            raise ClusterSimError(f"{where}: {e}") from e

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["gpus_per_server"] = list(self.gpus_per_server)
        return d


# ----------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelSpec:
    """The foundation every variant is fine-tuned from (Llama-7B by default)."""

    name: str = "llama-7b"
    layers: int = 32
    hidden: int = 4096
    ffn: int = 11008
    heads: int = 32
    kv_heads: int = 32
    vocab: int = 32000
    bytes_per_param: int = 2
    act_bytes: int = 2              # activation element size on the wire

    def __post_init__(self) -> None:
        for n in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "bytes_per_param", "act_bytes"):
            v = getattr(self, n)
            _need(isinstance(v, int) and v > 0, f"model.{n} must be a positive integer, got {v!r}")
        _need(self.hidden % self.heads == 0 and self.heads % self.kv_heads == 0,
              "model.hidden must divide by heads and heads by kv_heads")

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def layer_params(self) -> int:
        """q, o (h x h), k, v (h x kv_dim), gate/up/down (3 h ffn), two RMSNorms."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.ffn + 2 * h

    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_dim * self.bytes_per_param

    def embed_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        return self.vocab * self.hidden + self.hidden   # lm_head + final norm

    def lora_params(self, rank: int) -> int:
        """LoRA on q and v of one layer: A (h x r) and B (r x out) each."""
        return rank * (self.hidden + self.hidden) + rank * (self.hidden + self.kv_dim)

    def params(self) -> int:
        return self.embed_params() + self.layers * self.layer_params() + self.head_params()


@dataclass(frozen=True)
class Block:
    """One provisionable unit: a weight set with a cost.  ``parts`` is set for
    a whole model fused into one engine (per-model provisioning): its time is
    the sum of its parts' times on the same batch, i.e. the same arithmetic
    without the hops."""

    id: str
    kind: str                     # embed | layers | head | adapter | model
    params: int
    layers: int = 0               # transformer layers (KV, attention, launch overhead)
    hidden: int = 0
    bytes_per_param: int = 2
    kv_bytes_per_token: int = 0
    owner: Optional[str] = None   # the variant that alone uses it; None: shared base block
    parts: Tuple["Block", ...] = ()

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param if not self.parts else sum(p.weight_bytes for p in self.parts)


@dataclass(frozen=True)
class Variant:
    """An application: a chain of block ids, and how it was derived."""

    name: str
    kind: str                           # ff | lora
    chain: Tuple[str, ...]
    unique: Tuple[str, ...]             # blocks only this variant uses
    equivalent: Tuple[str, ...] = ()    # changed base blocks the zoo judged equivalent (served by the base block)


@dataclass(frozen=True)
class FamilySpec:
    """How N variants are generated from the base (seeded)."""

    variants: int = 4
    layers_per_block: int = 4
    lora_fraction: float = 0.5          # probability a variant is LoRA (else full fine-tune)
    ff_changed_blocks: int = 2          # layer-blocks a full fine-tune changes (middle/late)
    equivalence_prob: float = 0.5       # a changed block is judged equivalent to the base's and shared
    lora_rank: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        _need(isinstance(self.variants, int) and self.variants >= 1, f"variants must be >= 1, got {self.variants!r}")
        _need(isinstance(self.layers_per_block, int) and self.layers_per_block >= 1,
              f"layers_per_block must be >= 1, got {self.layers_per_block!r}")
        _need(0 <= self.lora_fraction <= 1 and 0 <= self.equivalence_prob <= 1,
              "lora_fraction and equivalence_prob must be in [0, 1]")
        _need(self.ff_changed_blocks >= 0 and self.lora_rank >= 1, "ff_changed_blocks >= 0 and lora_rank >= 1")


@dataclass(frozen=True)
class Family:
    model: ModelSpec
    spec: FamilySpec
    blocks: Dict[str, Block]            # every distinct block, base and unique
    base_chain: Tuple[str, ...]
    variants: Tuple[Variant, ...]

    def model_block(self, v: Variant) -> Block:
        """The variant as one fused model (per-model provisioning): all its
        weights, shared or not, in one engine."""
        return Block(f"model:{v.name}", "model", sum(self.blocks[b].params for b in v.chain),
                     layers=sum(self.blocks[b].layers for b in v.chain), hidden=self.model.hidden,
                     bytes_per_param=self.model.bytes_per_param,
                     kv_bytes_per_token=sum(self.blocks[b].kv_bytes_per_token for b in v.chain),
                     owner=v.name, parts=tuple(self.blocks[b] for b in v.chain))

    def distinct_weight_bytes(self) -> int:
        """Bytes of every block used by some chain, once each (block provisioning's initial footprint)."""
        used = {b for v in self.variants for b in v.chain}
        return sum(self.blocks[b].weight_bytes for b in used)

    def per_model_weight_bytes(self) -> int:
        """Bytes of one whole-model copy per variant (one model per engine)."""
        return sum(self.model_block(v).weight_bytes for v in self.variants)


def build_family(model: ModelSpec, spec: FamilySpec) -> Family:
    """The base chain and ``spec.variants`` variants (see module doc)."""
    m, lpb = model, spec.layers_per_block
    rng = random.Random(spec.seed * 7919 + 17)
    n_lb = math.ceil(m.layers / lpb)
    blocks: Dict[str, Block] = {}

    def add(b: Block) -> str:
        blocks[b.id] = b
        return b.id

    kvl = m.kv_bytes_per_token_layer()
    lb_layers = [min(lpb, m.layers - i * lpb) for i in range(n_lb)]
    embed = add(Block("embed", "embed", m.embed_params(), hidden=m.hidden, bytes_per_param=m.bytes_per_param))
    layer_ids = [add(Block(f"L{i:02d}", "layers", n * m.layer_params(), layers=n, hidden=m.hidden,
                           bytes_per_param=m.bytes_per_param, kv_bytes_per_token=n * kvl))
                 for i, n in enumerate(lb_layers)]
    head = add(Block("head", "head", m.head_params(), hidden=m.hidden, bytes_per_param=m.bytes_per_param))
    base_chain = (embed, *layer_ids, head)
    variants: List[Variant] = []
    first_changeable = n_lb // 3          # middle and late layer-blocks only
    for vi in range(spec.variants):
        name = f"v{vi:02d}"
        if rng.random() < spec.lora_fraction:
            chain: List[str] = [embed]
            unique: List[str] = []
            for i, lid in enumerate(layer_ids):
                a = add(Block(f"{name}.A{i:02d}", "adapter", lb_layers[i] * m.lora_params(spec.lora_rank),
                              hidden=m.hidden, bytes_per_param=m.bytes_per_param, owner=name))
                chain += [lid, a]
                unique.append(a)
            variants.append(Variant(name, "lora", tuple(chain + [head]), tuple(unique)))
            continue
        candidates = list(range(first_changeable, n_lb))
        changed = sorted(rng.sample(candidates, min(spec.ff_changed_blocks, len(candidates))))
        chain, unique, equiv = [embed], [], []
        for i, lid in enumerate(layer_ids):
            if i in changed and rng.random() >= spec.equivalence_prob:
                u = add(Block(f"{name}.L{i:02d}", "layers", blocks[lid].params, layers=lb_layers[i], hidden=m.hidden,
                              bytes_per_param=m.bytes_per_param, kv_bytes_per_token=lb_layers[i] * kvl, owner=name))
                chain.append(u)
                unique.append(u)
            else:
                if i in changed:
                    equiv.append(lid)
                chain.append(lid)
        variants.append(Variant(name, "ff", tuple(chain + [head]), tuple(unique), tuple(equiv)))
    return Family(model, spec, blocks, base_chain, tuple(variants))


# ------------------------------------------------------------------- roofline
@dataclass
class BatchShape:
    """What a batch asks of a block: new tokens computed, attention pairs
    (new token x context token, for FLOPs) and KV tokens read or written."""

    tokens: int = 0
    attend_pairs: int = 0
    kv_tokens: int = 0

    def add_prefill(self, prompt: int) -> None:
        self.tokens += prompt
        self.attend_pairs += prompt * (prompt + 1) // 2
        self.kv_tokens += prompt

    def add_decode(self, context: int) -> None:
        self.tokens += 1
        self.attend_pairs += context
        self.kv_tokens += context


def block_time(block: Block, shape: BatchShape, cluster: ClusterSpec) -> float:
    """Seconds one block takes on one batch: ``launch + max(flops / (peak *
    mfu), bytes / (hbm * eff))``.  FLOPs: ``2 * params`` per token plus ``4 *
    hidden`` per attention pair per layer.  Bytes: the weights (the embedding
    reads only the looked-up rows) plus the KV read.  A fused model is the sum
    of its parts on the same batch."""
    if block.parts:
        return sum(block_time(p, shape, cluster) for p in block.parts)
    n = max(1, shape.tokens)
    flops = 2.0 * block.params * n + 4.0 * block.layers * block.hidden * shape.attend_pairs
    weights = (min(block.params, n * block.hidden) if block.kind == "embed" else block.params) * block.bytes_per_param
    mem = weights + block.kv_bytes_per_token * shape.kv_tokens
    return (cluster.launch_s + cluster.layer_launch_s * block.layers
            + max(flops / cluster.flops_s, mem / cluster.hbm_bytes_s))


# -------------------------------------------------------------------- workload
@dataclass(frozen=True)
class WorkloadSpec:
    """Poisson arrivals at ``rate`` req/s in all, split over the variants by
    popularity weights: ``uniform`` (BlockLLM §7.1: each application's mean
    rate drawn uniformly, used as its weight) or ``zipf`` (weight 1/rank^s)."""

    requests: int = 200
    rate: float = 20.0
    popularity: str = "uniform"
    zipf_s: float = 1.0
    prompt_mean: int = 256
    output_mean: int = 64
    max_prompt: int = 1024
    max_output: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        _need(isinstance(self.requests, int) and self.requests >= 1, f"requests must be >= 1, got {self.requests!r}")
        _need(isinstance(self.rate, (int, float)) and math.isfinite(self.rate) and self.rate > 0,
              f"rate must be a positive number of requests/s, got {self.rate!r}")
        _need(self.popularity in ("uniform", "zipf"), f"popularity must be uniform or zipf, got {self.popularity!r}")
        _need(1 <= self.prompt_mean <= self.max_prompt and 1 <= self.output_mean <= self.max_output,
              "prompt_mean / output_mean must be in [1, max_prompt] / [1, max_output]")

    @property
    def max_context(self) -> int:
        return self.max_prompt + self.max_output


@dataclass(frozen=True)
class WorkRequest:
    id: int
    variant: int
    arrival: float
    prompt: int
    output: int


def popularity_weights(n: int, spec: WorkloadSpec) -> List[float]:
    rng = random.Random(spec.seed * 104729 + 3)
    if spec.popularity == "zipf":
        w = [1.0 / (i + 1) ** spec.zipf_s for i in range(n)]
    else:
        w = [rng.uniform(0.05, 1.0) for _ in range(n)]   # floor: no application is never called
    s = sum(w)
    return [x / s for x in w]


def _lognormal(rng: random.Random, mean: float, lo: int, hi: int, sigma: float = 0.5) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, int(round(rng.lognormvariate(mu, sigma)))))


def generate_workload(n_variants: int, spec: WorkloadSpec) -> List[WorkRequest]:
    """The requests, seeded: one Poisson stream at ``rate`` whose requests
    pick a variant by weight (the same as independent per-variant Poisson
    streams at ``rate * weight``)."""
    w = popularity_weights(n_variants, spec)
    rng = random.Random(spec.seed)
    t, out = 0.0, []
    for i in range(spec.requests):
        t += rng.expovariate(spec.rate)
        v = rng.choices(range(n_variants), weights=w)[0]
        out.append(WorkRequest(i, v, t, _lognormal(rng, spec.prompt_mean, 1, spec.max_prompt),
                               _lognormal(rng, spec.output_mean, 1, spec.max_output)))
    return out


# ------------------------------------------------------------------ migration
@dataclass(frozen=True)
class Migration:
    time_s: float
    recomputed_tokens: int
    copied_tokens: int


def migration_time(tokens: int, recompute_tok_s: float, copy_tok_s: float, latency_s: float = 0.0) -> Migration:
    """BlockLLM §5.1: move a ``tokens``-token KV cache by recomputing it from
    the front on the target (chunked prefill, ``recompute_tok_s``) while the
    owner copies it from the back (``copy_tok_s`` after the link's
    ``latency_s``); done when they meet.  Recomputation must go front to back
    (each token's KV depends on the ones before); copying need not, hence the
    two directions.  With ``R`` and ``C`` the rates, ``T`` solves ``R T + C
    (T - latency) = tokens``, i.e. ``T = (tokens + C latency) / (R + C)``,
    unless recomputation alone finishes before the copy starts (``T =
    tokens / R``)."""
    _need(tokens >= 0 and 0 < recompute_tok_s < math.inf and 0 < copy_tok_s < math.inf and latency_s >= 0,
          "migration: tokens >= 0, positive finite rates, latency >= 0")
    if tokens == 0:
        return Migration(0.0, 0, 0)
    if recompute_tok_s * latency_s >= tokens:
        return Migration(tokens / recompute_tok_s, tokens, 0)
    t = (tokens + copy_tok_s * latency_s) / (recompute_tok_s + copy_tok_s)
    recomputed = min(tokens, int(round(recompute_tok_s * t)))
    return Migration(t, recomputed, tokens - recomputed)


__all__ = ["GIB", "ClusterSimError", "ClusterSpec", "ModelSpec", "Block", "Variant", "FamilySpec", "Family",
           "build_family", "BatchShape", "block_time", "WorkloadSpec", "WorkRequest", "popularity_weights",
           "generate_workload", "Migration", "migration_time"]
