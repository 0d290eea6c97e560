"""Interception handling (InferCept): what to do with a paused context's KV.

While a request waits for a tool, its KV cache can be *preserved* (kept on
the GPU: costs memory for the whole tool call), *discarded* (freed, and
recomputed on resume: costs compute) or *swapped* (copied to host memory and
back: costs transfer time).  InferCept picks the option with the least GPU
memory waste.  This module holds the single decision point engines call;
the waste-minimising policy replaces :class:`AlwaysPreserve` in a later change.

Free of torch, so every engine and the simulator share one copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Protocol


class Handling(str, enum.Enum):
    PRESERVE = "preserve"
    DISCARD = "discard"
    SWAP = "swap"


@dataclass(frozen=True)
class InterceptedContext:
    """What a policy may look at when deciding."""

    context_len: int
    num_blocks: int
    expected_duration_s: Optional[float]
    tool: Optional[str]


class InterceptionPolicy(Protocol):
    def decide(self, ctx: InterceptedContext) -> Handling: ...


class AlwaysPreserve:
    """Keep the KV of every paused context: the right choice for short tool
    calls, and the only one that never recomputes."""

    def decide(self, ctx: InterceptedContext) -> Handling:
        return Handling.PRESERVE


class AlwaysDiscard:
    """Free the KV of every paused context and recompute it on resume."""

    def decide(self, ctx: InterceptedContext) -> Handling:
        return Handling.DISCARD
