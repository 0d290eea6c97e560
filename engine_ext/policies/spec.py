"""One model's scheduling policy, as configured: which interception handling and
which ranking run, with their knobs.

It lives with the policies (not in the gateway's config) because every engine
takes it: the native engine builds its policies from it, the vLLM engine hands
its ranking to ``InterlaceScheduler``, and an engine worker process rebuilds it
from its fields.  Names are resolved by :func:`make_interception` and
:func:`make_ranking`; the gateway's config validates them first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .capacity import DEFAULT_LATENCY_TOKENS, CapacityPolicy


@dataclass(frozen=True)
class PolicySpec:
    """One model's scheduling policy (names resolved by this package)."""

    interception: str = "infercept"
    ranking: str = "lamps"
    starvation_threshold: int = 100
    refresh_interval: int = 1
    horizon: str = "job"           # LAMPS: "segment" (the paper's) or "job" (adds the predicted later segments)
    handling_at_call: bool = False  # LAMPS: the call gets the handling predicted for its segment (Alg. 1)
    profile: str = "auto"          # "auto", a built-in profile name or a profile file
    swap_space_tokens: int = 16384
    prefix_caching: bool = True
    # Parrot's capacity regulation (capacity.py): the engine's running tokens while latency-critical work
    # runs, and otherwise (None: no cap but memory).  latency_capacity_tokens None: regulation off.
    latency_capacity_tokens: Optional[int] = DEFAULT_LATENCY_TOKENS
    throughput_capacity_tokens: Optional[int] = None

    def capacity(self) -> CapacityPolicy:
        return CapacityPolicy(latency_tokens=self.latency_capacity_tokens,
                              throughput_tokens=self.throughput_capacity_tokens)
