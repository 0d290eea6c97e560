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

Reuse is safe because every step ends by waiting for the GPU (the model
runner synchronizes before it returns the step's logits): the copy that read
the host buffer and the kernels that read the device buffer have finished
before the next step writes them.

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
        self.host = torch.empty(0, dtype=torch.long, pin_memory=pin)
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
        if n > self.host.numel():
            cap = max(1024, 1 << (n - 1).bit_length())
            self.host = torch.empty(cap, dtype=torch.long, pin_memory=self.pin)
            self.dev = torch.empty(cap, dtype=torch.long, device=self.device)
        if n:
            self.host[:n] = torch.tensor(self._flat, dtype=torch.long)
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
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
        self.host = self.dev = None
        self._views = []

    @property
    def capacity(self) -> Optional[int]:
        return None if self.host is None else self.host.numel()
