"""A step's integer inputs in one reused host buffer, moved to the GPU in one asynchronous copy.

Why: the model runner builds each step's inputs from Python lists (token ids,
positions, KV slots, logit rows, block tables, sequence lengths ...).  Each
``torch.tensor(list, device="cuda")`` is a pageable host allocation plus a
synchronous copy: a dozen small blocking transfers per step, each stalling
the host until the GPU has caught up.  Here every input is appended to one
flat int64 list, written into one host buffer (pinned on CUDA, reused across
steps, grown by doubling when a step needs more) and copied with one
``non_blocking`` copy into one device buffer, of which the inputs are views
(int32 ones cast on the device).

Reuse without a per-step device synchronize: the host buffer is double
buffered, and an event recorded after each copy says when the copy that
read a buffer has finished; a step waits for that event (two steps back:
in practice long done) before it writes the buffer again.  The device
buffer needs no such wait: the next copy into it is queued on the same
stream after the kernels that read it.  (The model runner used to
synchronize the device at the end of every step to make reuse safe; that
sync stalled the host for the whole forward pass, issue 36.)

Two phases, since a step's inputs are only all known at the end:
:meth:`StepStaging.tensor` records values and returns a :class:`Staged`
placeholder; :meth:`StepStaging.upload` copies and :meth:`StepStaging.resolve`
swaps the placeholders in a dataclass (or a list of them) for the device views.

Used on CUDA only: on the CPU the runner keeps plain tensors (there is no
transfer to save, and nothing may change there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class Staged:
    """A placeholder for the ``index``-th staged input, until :meth:`StepStaging.resolve`."""

    index: int


class StepStaging:
    """One host buffer (pinned where ``pin``) and one device buffer, reused across steps."""

    def __init__(self, device: torch.device, pin: bool):
        self.device = device
        self.pin = pin
        # two host buffers, alternated, each with the event of the last copy that read it (CUDA)
        self._hosts = [torch.empty(0, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._copied: List[Optional[Any]] = [None, None]
        self._turn = 0
        self.dev = torch.empty(0, dtype=torch.long, device=device)
        self._flat: List[int] = []
        self._parts: List[Tuple[int, int, torch.dtype, Tuple[int, ...]]] = []
        self._views: List[torch.Tensor] = []

    def tensor(self, values: Sequence[Any], dtype: torch.dtype = torch.long) -> Staged:
        """Stage ``values`` (ints, or equally long lists of ints: a matrix) as a tensor of ``dtype``."""
        start = len(self._flat)
        if values and isinstance(values[0], (list, tuple)):
            width = len(values[0])
            shape: Tuple[int, ...] = (len(values), width)
            for row in values:
                if len(row) != width:
                    raise ValueError("staged matrix rows must have equal lengths")
                self._flat.extend(row)
        else:
            shape = (len(values),)
            self._flat.extend(values)
        self._parts.append((start, len(self._flat) - start, dtype, shape))
        return Staged(len(self._parts) - 1)

    def upload(self) -> List[torch.Tensor]:
        """Copy everything staged since the last upload; returns the device views, in staging order."""
        n = len(self._flat)
        i = self._turn
        self._turn ^= 1
        if self._copied[i] is not None:  # the copy that last read this host buffer (two uploads ago)
            self._copied[i].synchronize()
            self._copied[i] = None
        if n > self._hosts[i].numel():
            cap = max(1024, 1 << (n - 1).bit_length())
            self._hosts[i] = torch.empty(cap, dtype=torch.long, pin_memory=self.pin)
        if n > self.dev.numel():
            self.dev = torch.empty(max(1024, 1 << (n - 1).bit_length()), dtype=torch.long, device=self.device)
        host = self._hosts[i]
        if n:
            host[:n] = torch.tensor(self._flat, dtype=torch.long)
            self.dev[:n].copy_(host[:n], non_blocking=True)
            if self.device.type == "cuda":
                self._copied[i] = torch.cuda.Event()
                self._copied[i].record(torch.cuda.current_stream(self.device))
        views = []
        for start, size, dtype, shape in self._parts:
            v = self.dev[start:start + size].view(shape)
            views.append(v if dtype == torch.long else v.to(dtype))
        self._flat, self._parts, self._views = [], [], views
        return views

    def resolve(self, obj: Any) -> Any:
        """``obj`` with each :class:`Staged` in it replaced by its view: ``obj`` itself, an item of a
        list, a field of a dataclass (nested).  Objects holding no placeholder are left as they are
        (not copied, not assigned to)."""
        if isinstance(obj, Staged):
            return self._views[obj.index]
        if isinstance(obj, list):
            new = [self.resolve(o) for o in obj]
            return new if any(a is not b for a, b in zip(new, obj)) else obj
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                v = getattr(obj, f.name)
                r = self.resolve(v)
                if r is not v:
                    setattr(obj, f.name, r)
        return obj

    def close(self) -> None:
        """Free both buffers (the pinned one is page-locked memory until then)."""
        for e in self._copied:
            if e is not None:
                e.synchronize()  # a copy still reading a pinned buffer
        self._hosts, self._copied, self.dev = [], [None, None], None
        self._views = []

    @property
    def host(self) -> Optional[torch.Tensor]:
        """The host buffer the last upload wrote (None once closed)."""
        return self._hosts[self._turn ^ 1] if self._hosts else None

    @property
    def capacity(self) -> Optional[int]:
        return None if self.dev is None else self.dev.numel()
