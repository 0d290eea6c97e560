"""What one generated token does to a stream's text: the rules every engine
applies, so that the native engine and the request-level engines (vLLM in
process, vLLM over HTTP) stream the same events for the same tokens.

* EOS (unless ``ignore_eos``) and ``stop_token_ids`` finish with "stop";
  their text is not part of the stream.
* ``stop`` strings finish with "stop" and are cut from the text; a text end
  that may begin a stop string is held back until it is known not to.
* ``max_tokens`` (or the model's context limit) finishes with "length",
  releasing what was held back.
* A ``pause_on`` string completed by this token pauses the stream right after
  it (the caller pauses; held-back text goes out with the pause event).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple


def token_text(gen: Any, tok: int, *, is_eos: bool, at_limit: bool) -> Tuple[str, Optional[str], bool]:
    """Apply ``tok`` (already appended to ``gen.generated``) to ``gen``'s text
    state (``detok``, ``held``, ``tail``, ``sampling``): returns the text the
    token's event carries, the finish reason (None: goes on) and whether a
    ``pause_on`` string was completed."""
    sp = gen.sampling
    detok = gen.detok
    delta = detok.add(tok) if detok is not None and not is_eos else ""
    text = gen.held + delta
    gen.held = ""
    finish = "stop" if is_eos else None
    by_string = False
    if finish is None and sp.stop:
        hits = [(text.find(s), s) for s in sp.stop if s in text]
        if hits:
            text, finish, by_string = text[:min(hits)[0]], "stop", True
        else:
            keep = held_suffix(text, sp.stop)
            if keep:
                text, gen.held = text[:-keep], text[-keep:]
    if finish is None and (len(gen.generated) >= sp.max_tokens or at_limit):
        finish = "length"
    if finish is not None:
        if not by_string:  # what was held back was not a stop string after all
            text += gen.held + (detok.flush() if detok is not None else "")
        return text, finish, False
    if sp.pause_on:
        hit, gen.tail = pause_hit(gen.tail, delta, sp.pause_on)
        return text, None, hit
    return text, None, False


def pause_hit(tail: str, delta: str, pause_on: Sequence[str]) -> Tuple[bool, str]:
    """Whether ``delta`` completes a ``pause_on`` string after ``tail`` (the
    text before it, as long as the longest string), and the new tail."""
    window = tail + delta
    hit = any(s in window and window.rfind(s) + len(s) > len(tail) for s in pause_on)
    return hit, window[-max(len(s) for s in pause_on):]


class PauseWatch:
    """The ``pause_on`` rule alone, for a process that sees a stream's tokens
    but not its text: vLLM's engine core, where Interlace's scheduler stops a
    request on the very token that completes a pause string, so a paused
    request keeps exactly its context's KV (engine_ext/vllm/pins.py).  The
    same detokenizer and the same :func:`pause_hit` as :func:`token_text`,
    so both processes pause on the same token."""

    def __init__(self, tokenizer: Any, context_ids: Sequence[int], pause_on: Sequence[str],
                 skip_special_tokens: bool = True, eos_token_ids: Sequence[int] = ()):
        from .tokenizer import IncrementalDetokenizer

        self.detok = IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens)
        self.pause_on = tuple(pause_on)
        self.eos = frozenset(eos_token_ids)
        self.tail = ""

    def add(self, tok: int) -> bool:
        """Feed one generated token; True when it completes a pause string."""
        if tok in self.eos:  # an end of stream carries no text (token_text's is_eos)
            return False
        hit, self.tail = pause_hit(self.tail, self.detok.add(tok), self.pause_on)
        return hit


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
