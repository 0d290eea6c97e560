"""A context (Parrot's name for a KV-cache state) and the generation running in it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Set

from ..policies.interception import Handling
from ..policies.ranking import SchedInfo
from ..protocol import PauseHint, SamplingParams, TokenEvent
from .block_manager import BlockTable


class State(enum.Enum):
    IDLE = "idle"              # holds KV, nothing running
    GENERATING = "generating"  # a generate() stream is live
    PAUSED = "paused"          # intercepted: the stream waits for resume()


@dataclass(eq=False)
class Generation:
    """The decoding state of one generate() stream."""

    sampling: SamplingParams
    emit: Callable[[Any], None]           # engine thread only: a TokenEvent or an exception, via its Outbox
    detok: Any = None                     # IncrementalDetokenizer, or None without a tokenizer
    rng: Any = None                       # torch.Generator for seeded sampling
    device_rng: Any = None                # its counterpart on the GPU, made on first use (sampler.py)
    generated: List[int] = field(default_factory=list)
    held: str = ""                        # text held back: a possible stop-string prefix
    tail: str = ""                        # recent text, to find pause strings spanning tokens
    paused: bool = False
    done: bool = False
    pause_hint: Any = None                # PauseHint for the next pause_on pause (set_pause_hint)


@dataclass(eq=False)
class FillOp:
    """One ``fill`` call, kept so that a caller who cancels it can have it
    undone: the tokens it appended start at ``rollback`` and end at ``end``."""

    fut: Any                              # concurrent.futures.Future of the caller
    rollback: int = 0                     # context length before the fill
    end: int = 0                          # context length after it
    created: bool = False                 # the fill created the context (new or forked)
    ctx: Optional["Context"] = None


@dataclass(eq=False)
class Interception:
    """A context waiting for a tool (paused) or a client's follow-up (parked)."""

    hint: PauseHint
    call_time: float                      # engine clock when it began
    parked: bool = False
    handling: Optional[Handling] = None   # None: not decided yet (the next step plans it)
    predicted: Optional[Handling] = None  # the ranking's handling for this call (LAMPS at the call): applied, kept


@dataclass(eq=False)
class Context:
    id: Hashable
    token_ids: List[int]
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    parent: Optional["Context"] = None
    children: Set["Context"] = field(default_factory=set)
    last_logits: Any = None               # logits after the last token, when all are computed
    gen: Optional[Generation] = None
    fill_waiters: List[FillOp] = field(default_factory=list)  # fills resolved when all tokens are computed
    last_fill: Optional[FillOp] = None    # the fill that last changed the tokens, while nothing else has
    arrival: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    sched: SchedInfo = field(default_factory=SchedInfo)   # what the ranking reads
    intercept: Optional[Interception] = None  # set while paused or parked
    host: Dict[int, int] = field(default_factory=dict)    # table index -> host block (swapped out)
    swap_ops: int = 0                     # swap moves queued or in flight
    recompute_end: int = 0                # positions below it were computed before (discarded): recomputation
    waiting_swap_in: bool = False         # activate once every block is back on the device
    variant: int = 0                      # the model variant whose weights it runs (block_sharing.py); 0: base

    @property
    def on_host(self) -> bool:
        """Some of its KV is in (or moving to/from) the host pool: it must not be scheduled."""
        return bool(self.host) or self.swap_ops > 0

    @property
    def state(self) -> State:
        if self.gen is None:
            return State.IDLE
        return State.PAUSED if self.gen.paused else State.GENERATING

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def event(self, **kw: Any) -> TokenEvent:
        return TokenEvent(**kw)
