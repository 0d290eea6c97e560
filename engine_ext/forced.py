"""Forced decoding: make the engine emit a recorded output, token by token,
at the real cost of decoding it.

Benchmarks replay recorded model outputs this way (so their results do not
depend on a small model's skill), and tests use it to drive tool-calling
paths deterministically.  It is an ordinary logits processor, so it goes
through the same engine hook as constrained decoding.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


class ForcedOutput:
    """Logits processor forcing ``token_ids``, then ``end_token_id`` (if given).

    Uses only tensor methods, so it works with any engine's tensor type.
    Past the end of the recording (and without an end token) it leaves the
    logits alone.
    """

    def __init__(self, token_ids: Sequence[int], end_token_id: Optional[int] = None):
        self.token_ids = list(token_ids)
        if end_token_id is not None:
            self.token_ids.append(end_token_id)

    def __call__(self, generated: Sequence[int], logits: Any) -> Any:
        i = len(generated)
        if i >= len(self.token_ids):
            return logits
        out = logits.new_full(logits.shape, float("-inf"))
        out[self.token_ids[i]] = 0.0
        return out
