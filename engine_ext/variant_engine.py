"""One model variant's view of an engine that serves several (BlockLLM).

The gateway serves each zoo model (``path: zoo/NAME``) under its own name,
while the variants of one base share one engine (or one set of replicas):
:class:`VariantEngine` is what a model name holds.  It names its variant on
every fill, so a new context runs that variant's weights (and a context of
another variant is refused), and passes everything else through.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

from .protocol import RequestHint


class VariantEngine:
    """``inner`` (a native engine with variants, a worker, or a
    ``ReplicaSet`` of them) as seen by requests for ``variant``."""

    def __init__(self, inner: Any, variant: str):
        names = getattr(inner, "variant_names", None)
        if names is not None and variant not in names:
            raise ValueError(f"the engine does not serve the variant {variant!r} (it serves {sorted(names)})")
        self.inner = inner
        self.variant = variant

    async def fill(self, context_id: Hashable, token_ids: Sequence[int],
                   parent_context_id: Optional[Hashable] = None, hint: Optional[RequestHint] = None) -> int:
        return await self.inner.fill(context_id, token_ids, parent_context_id, hint, variant=self.variant)

    def close(self) -> None:
        """Closes nothing: the shared engine is closed once, by its owner."""

    def __getattr__(self, name: str) -> Any:  # generate, free_context, pause, ..., stats: the shared engine's
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"VariantEngine({self.variant!r} of {self.inner!r})"
