"""The cost model every policy reasons with: a *profile* of one model on one device.

InferCept's equations need ``T_fwd`` (iteration time as a function of the
tokens in the batch), ``T_swap`` (time to move KV between GPU and host) and
the saturation point ``S`` (past which more tokens in an iteration cost
proportionally more time: recomputation chunks are kept under it).  LAMPS
needs the same numbers to predict a request's memory over time.

A profile is either *measured* (``interlace profile`` runs the engine on the
current device) or *derived* from a roofline (bytes and FLOPs per step over
a GPU's bandwidth and peak compute); ``source`` says which, and derived
profiles must never be reported as measurements.

Forward time is piecewise linear in the batched tokens (measured points,
linear extrapolation past the last) plus a term linear in the context tokens
the batch attends to (KV read per step).  Free of torch.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple


class ProfileError(ValueError):
    """A profile file is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class Profile:
    model: str
    device: str
    source: str                        # "measured" or "derived (roofline): ..."
    block_size: int
    kv_bytes_per_token: int            # M in InferCept's equations
    kv_capacity_tokens: int            # device KV cache, in tokens
    max_batched_tokens: int            # tokens one iteration may carry
    fwd_tokens: Tuple[int, ...]        # batched token counts, ascending
    fwd_seconds: Tuple[float, ...]     # forward time at each, attending no context
    fwd_s_per_context_token: float     # added time per attended context token (summed over the batch)
    swap_s_per_block: float            # moving one block one way (device <-> host)
    saturation_tokens: int             # S: past it an iteration's time grows linearly with its tokens
    host_capacity_tokens: int = 0      # host swap pool, in tokens (0: as large as the device's)
    notes: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ProfileError(f"profile {self.model!r}: {what}")
        need(isinstance(self.block_size, int) and self.block_size > 0, "block_size must be a positive integer")
        need(self.kv_bytes_per_token > 0, "kv_bytes_per_token must be positive")
        need(self.kv_capacity_tokens >= self.block_size, "kv_capacity_tokens must hold at least one block")
        need(self.max_batched_tokens > 0, "max_batched_tokens must be positive")
        need(len(self.fwd_tokens) == len(self.fwd_seconds) >= 1,
             "fwd_tokens and fwd_seconds must be non-empty lists of the same length")
        need(all(a < b for a, b in zip(self.fwd_tokens, self.fwd_tokens[1:])) and self.fwd_tokens[0] >= 1,
             "fwd_tokens must be strictly ascending positive integers")
        need(all(math.isfinite(s) and s > 0 for s in self.fwd_seconds), "fwd_seconds must be positive")
        need(math.isfinite(self.fwd_s_per_context_token) and self.fwd_s_per_context_token >= 0,
             "fwd_s_per_context_token must be >= 0")
        need(math.isfinite(self.swap_s_per_block) and self.swap_s_per_block > 0, "swap_s_per_block must be positive")
        need(self.saturation_tokens >= 1, "saturation_tokens must be >= 1")

    # ------------------------------------------------------------------ model
    def t_fwd(self, batched_tokens: int, context_tokens: int = 0) -> float:
        """Seconds of one iteration computing ``batched_tokens`` tokens that
        attend ``context_tokens`` tokens of KV in total."""
        n = max(1, batched_tokens)
        xs, ys = self.fwd_tokens, self.fwd_seconds
        if n <= xs[0] or len(xs) == 1:
            base = ys[0] if n <= xs[0] else ys[0] * n / xs[0]
        else:
            i = min(bisect.bisect_left(xs, n), len(xs) - 1)
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            base = y0 + (y1 - y0) * (n - x0) / (x1 - x0)  # past the last point: the last slope
        return base + self.fwd_s_per_context_token * max(0, context_tokens)

    def t_swap(self, tokens: int) -> float:
        """Seconds to move the KV of ``tokens`` tokens one way, block by block."""
        return -(-max(0, tokens) // self.block_size) * self.swap_s_per_block

    def swap_limit_tokens(self, iteration_s: float) -> int:
        """InferCept's swap limit N_i: tokens whose swap hides behind one
        forward pass of ``iteration_s`` seconds (whole blocks)."""
        return int(iteration_s // self.swap_s_per_block) * self.block_size

    def added_time(self, tokens: int, base_tokens: int = 0) -> float:
        """Seconds that ``tokens`` more tokens add to an iteration already
        carrying ``base_tokens`` (InferCept's "per-chunk *added* iteration
        time" of eq. 4).  The attended-context term is the same with or
        without them (the batch's KV is read either way), so it cancels: on
        a profile flat below S, a chunk that keeps the iteration under S
        adds nothing."""
        if tokens <= 0:
            return 0.0
        return max(0.0, self.t_fwd(base_tokens + tokens) - self.t_fwd(base_tokens)) if base_tokens > 0 else \
            self.t_fwd(tokens)

    def recompute_chunk(self, decode_tokens: int) -> int:
        """Tokens of recomputation that fit in one iteration beside
        ``decode_tokens`` decodes without passing the saturation point."""
        return max(self.block_size, self.saturation_tokens - decode_tokens)

    def prefill_budget(self, decode_tokens: int, chunked: bool, max_batched_tokens: Optional[int] = None) -> int:
        """Tokens an iteration gives its waiting work (new prompts, tool
        results, recomputation alike) beside ``decode_tokens`` decodes.

        ``chunked`` (InferCept's chunked recomputation): the iteration is
        filled "until the GPU saturation point is reached" (section 4.3), so
        every prefill token counts against S minus the decodes (at least one
        block: progress); otherwise the engine's token budget.  One rule for
        the simulator and the native engine (an earlier simulator capped only
        recomputation at S while new prompts took the whole budget, which
        alone inverted the ablation's "+ chunked recompute" step)."""
        cap = self.max_batched_tokens if max_batched_tokens is None else max_batched_tokens
        room = max(0, cap - decode_tokens)
        return min(room, self.recompute_chunk(decode_tokens)) if chunked else room

    @property
    def kv_gb_per_token(self) -> float:
        return self.kv_bytes_per_token / 1e9

    # -------------------------------------------------------------------- I/O
    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["fwd_tokens"], d["fwd_seconds"] = list(self.fwd_tokens), list(self.fwd_seconds)
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: Dict[str, Any], where: str = "profile") -> "Profile":
        if not isinstance(d, dict):
            raise ProfileError(f"{where}: expected a JSON object, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ProfileError(f"{where}: unknown fields {unknown}")
        missing = sorted(k for k, f in cls.__dataclass_fields__.items()
                         if k not in d and f.default is MISSING and f.default_factory is MISSING)
        if missing:
            raise ProfileError(f"{where}: missing fields {missing}")
        try:
            d = dict(d, fwd_tokens=tuple(int(x) for x in d["fwd_tokens"]),
                     fwd_seconds=tuple(float(x) for x in d["fwd_seconds"]))
            return cls(**d)
        except ProfileError:
            raise
        except (TypeError, ValueError) as e:
            raise ProfileError(f"{where}: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        p = Path(path)
        if not p.is_file():
            builtin = BUILTIN_PROFILES.get(str(path))
            if builtin is not None:
                return builtin()
            raise ProfileError(f"profile {path}: no such file (built-in names: {sorted(BUILTIN_PROFILES)})")
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ProfileError(f"profile {path}: {e}") from e
        return cls.from_dict(data, str(path))


# ------------------------------------------------------------------ rooflines
@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes: float
    hbm_bw: float        # bytes/s, peak
    flops: float         # dense bf16 FLOP/s, peak
    link_bw: float       # host link bytes/s, one way, peak
    bw_eff: float = 0.8  # achievable fractions of the peaks
    flops_eff: float = 0.6
    link_eff: float = 0.8
    step_overhead_s: float = 0.002  # launches, sampling, scheduling per iteration


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2


H100_SXM = GPU("H100-SXM-80GB", 80e9, 3.35e12, 989e12, 64e9)
SHAPES = {
    "gpt-j-6b": ModelShape("GPT-J-6B", 6.05e9, 28, 16, 256),
    "llama-3-8b": ModelShape("Llama-3-8B", 8.03e9, 32, 8, 128),
}


def roofline(shape: ModelShape, gpu: GPU = H100_SXM, block_size: int = 16, mem_util: float = 0.9,
             max_batched_tokens: int = 2048) -> Profile:
    """A profile *derived* from bytes and FLOPs per step (not measured).

    One iteration reads every weight once (memory bound) or does 2 FLOPs per
    parameter per token (compute bound), whichever takes longer, and reads
    the KV of every attended token; S is where the two bounds meet.
    """
    w_bytes = shape.params * shape.dtype_bytes
    kv_tok = 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.dtype_bytes
    bw, fl = gpu.hbm_bw * gpu.bw_eff, gpu.flops * gpu.flops_eff
    t_mem = w_bytes / bw
    s = max(1, int(t_mem * fl / (2 * shape.params)))
    pts = sorted({1, 8, 32, 64, 128, s, 2 * s, 512, 1024, max_batched_tokens})
    secs = [gpu.step_overhead_s + max(t_mem, 2 * shape.params * n / fl) for n in pts]
    cap = int((gpu.hbm_bytes * mem_util - w_bytes) / kv_tok)
    return Profile(
        model=shape.name, device=gpu.name,
        source=f"derived (roofline): {gpu.hbm_bw / 1e12:.2f} TB/s x{gpu.bw_eff}, {gpu.flops / 1e12:.0f} TFLOP/s "
               f"x{gpu.flops_eff}, host link {gpu.link_bw / 1e9:.0f} GB/s x{gpu.link_eff}",
        block_size=block_size, kv_bytes_per_token=kv_tok, kv_capacity_tokens=cap - cap % block_size,
        max_batched_tokens=max_batched_tokens, fwd_tokens=tuple(pts), fwd_seconds=tuple(secs),
        fwd_s_per_context_token=kv_tok / bw, swap_s_per_block=block_size * kv_tok / (gpu.link_bw * gpu.link_eff),
        saturation_tokens=s, notes="not a measurement: bandwidth/compute bounds at the stated efficiencies")


def _measured(name: str) -> "Profile":
    return Profile.load(Path(__file__).with_name("profiles") / f"{name}.json")


BUILTIN_PROFILES = {
    "h100-gpt-j-6b": lambda: roofline(SHAPES["gpt-j-6b"]),
    "h100-llama-3-8b": lambda: roofline(SHAPES["llama-3-8b"]),
    # measured (profiles/__init__.py): the native engine on an H200, 2026-11-28
    "h200-llama-3-8b": lambda: _measured("h200-llama-3-8b"),
}


def unit_profile(kv_capacity_tokens: int = 6, saturation_tokens: int = 1 << 20) -> Profile:
    """One token of KV = one unit of memory, one iteration = one second
    whatever it carries (LAMPS' example of Figure 3); swaps take no time."""
    return Profile(model="unit", device="unit", source="derived (unit model)", block_size=1,
                   kv_bytes_per_token=1, kv_capacity_tokens=kv_capacity_tokens, max_batched_tokens=1 << 20,
                   fwd_tokens=(1, 1 << 20), fwd_seconds=(1.0, 1.0), fwd_s_per_context_token=0.0,
                   swap_s_per_block=1e-9, saturation_tokens=saturation_tokens)


def fit_piecewise(points: Sequence[Tuple[int, float]]) -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
    """Median time per batched-token count, made non-decreasing (a larger
    batch never takes less time: a dip is noise)."""
    by_n: Dict[int, list] = {}
    for n, s in points:
        by_n.setdefault(int(n), []).append(float(s))
    xs = sorted(by_n)
    ys, best = [], 0.0
    for x in xs:
        v = sorted(by_n[x])[len(by_n[x]) // 2]
        best = max(best, v)
        ys.append(best)
    return tuple(xs), tuple(ys)
