"""Forced decoding: make the engine emit a recorded output, token by token,
at the real cost of decoding it.

Benchmarks replay recorded model outputs this way (so their results do not
depend on a small model's skill), and tests use it to drive tool-calling
paths deterministically.  It is an ordinary logits processor, so it goes
through the same engine hook as constrained decoding.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence


class ForcedOutput:
    """Logits processor forcing a recording made of *pieces*, one per tool
    round, then ``end_token_id`` (if given).

    A piece is followed by the next one directly, or -- when the caller
    appends tool results and resumes -- from the start of the next piece
    (:meth:`on_resume`), so a round cut short (a call aborted on an invalid
    argument) does not replay the rest of its recording.  Uses only tensor
    methods, so it works with any engine's tensor type.  Past the end of the
    recording (without an end token) it leaves the logits alone.

    It pickles as it is (plain state), so a worker-process engine
    (:class:`~interlace.engine_ext.worker.ProcessEngine`) runs a copy of it;
    ``resumes`` counts the :meth:`on_resume` calls, which is how that engine
    passes them on to its copy.
    """

    def __init__(self, pieces: Sequence[Sequence[int]], end_token_id: Optional[int] = None):
        self.pieces: List[List[int]] = [list(p) for p in pieces] or [[]]
        if end_token_id is not None:
            self.pieces[-1].append(end_token_id)
        self.piece = 0
        self.base = 0          # generated tokens before the current piece
        self._advance = False
        self.resumes = 0       # on_resume() calls (ProcessEngine replays them on its copy)

    def on_resume(self) -> None:
        self._advance = True
        self.resumes += 1

    def _sync(self, n: int) -> None:
        """Move to the piece the ``n``-th generated token belongs to."""
        if self._advance:
            self._advance = False
            self.piece, self.base = self.piece + 1, n
        while self.piece < len(self.pieces) and n - self.base >= len(self.pieces[self.piece]):
            self.base += len(self.pieces[self.piece])  # piece done without a pause: the next follows
            self.piece += 1

    def segment_grammar(self, n_generated: int) -> Optional[dict]:
        """For engines that sample by themselves (vLLM): the rest of the
        recording from the ``n_generated``-th token, as a Lark grammar of
        token ids (llguidance's ``<[id]>``), then anything; None past its end."""
        self._sync(n_generated)
        if self.piece >= len(self.pieces):
            return None
        rest = self.pieces[self.piece][n_generated - self.base:] + [t for p in self.pieces[self.piece + 1:] for t in p]
        body = " ".join(f"<[{int(t)}]>" for t in rest)
        return {"grammar": f"start: {body} free\nfree: /(?s:.*)/\n"}

    def __call__(self, generated: Sequence[int], logits: Any) -> Any:
        n = len(generated)
        self._sync(n)
        if self.piece >= len(self.pieces):
            return logits
        out = logits.new_full(logits.shape, float("-inf"))
        out[self.pieces[self.piece][n - self.base]] = 0.0
        return out
