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
        window = gen.tail + delta
        hit = any(s in window and window.rfind(s) + len(s) > len(gen.tail) for s in sp.pause_on)
        gen.tail = window[-max(len(s) for s in sp.pause_on):]
        return text, None, hit
    return text, None, False


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
