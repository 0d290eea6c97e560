"""Which kept (pinned) contexts to let go, when an engine keeps a paused or
idle request's KV on the device (InferCept's *preserve*, on an engine whose
cache is not Interlace's own: vLLM, engine_ext/vllm/pins.py).

A pin holds device memory for as long as its call lasts, so pins are
bounded three ways, checked before every scheduling step:

* **TTL**: a pin older than its time to live is released (a client that
  never comes back; Continuum's TTL).
* **Budget**: pins together hold at most ``budget_blocks``; over it, the
  most wasteful to keep goes first.
* **Pressure**: pins never starve running work -- when the free blocks do
  not cover what the running requests (and the head of the queue) need for
  the next step, pins are released, most wasteful first, until they do,
  before the engine would preempt a running request.

"Most wasteful to keep" is InferCept's preserve waste (eq. 2) for the time
left: context tokens x the call's expected remaining seconds (its hint or
the tool's learned mean; once a call has outlived that, the time already
waited, InferCept section 4.4; unknown: what is left of the TTL).  Whether
to keep a pin at all when the call begins is the interception policy's
decision (``InterceptionPolicy.decide``), not this module's.

Free of torch and of any engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, List, Optional, Sequence, Tuple

EXPIRED, DROPPED = "expired", "dropped"


@dataclass(frozen=True)
class Pin:
    """One kept context as the budget sees it."""

    id: Hashable
    blocks: int                        # KV blocks it holds (shared blocks counted once per holder)
    context_tokens: int                # tokens of KV it keeps
    since: float                       # when it was pinned (the call's start)
    ttl_s: float                       # released this long after ``since``
    expected_s: Optional[float] = None  # the call's expected length (None: unknown)


def remaining_s(pin: Pin, now: float) -> float:
    """The call's expected time left: the hint minus what has passed; once
    outlived, the time already waited (InferCept 4.4); unknown: the TTL's rest."""
    elapsed = max(0.0, now - pin.since)
    if pin.expected_s is None:
        return max(0.0, pin.ttl_s - elapsed)
    left = pin.expected_s - elapsed
    return left if left > 0 else elapsed


def keep_waste(pin: Pin, now: float) -> float:
    """Token-seconds of device memory keeping ``pin`` to its resume costs (eq. 2 for the time left)."""
    return pin.context_tokens * remaining_s(pin, now)


def pins_to_release(pins: Sequence[Pin], *, now: float, budget_blocks: int, free_blocks: int,
                    need_blocks: int) -> List[Tuple[Hashable, str]]:
    """The pins to release now, each with why (:data:`EXPIRED` or :data:`DROPPED`), in order."""
    out: List[Tuple[Hashable, str]] = []
    live = []
    for p in pins:
        if now - p.since >= p.ttl_s:
            out.append((p.id, EXPIRED))
            free_blocks += p.blocks
        else:
            live.append(p)
    held = sum(p.blocks for p in live)
    for p in sorted(live, key=lambda p: -keep_waste(p, now)):
        if held <= budget_blocks and free_blocks >= need_blocks:
            break
        out.append((p.id, DROPPED))
        held -= p.blocks
        free_blocks += p.blocks
    return out
