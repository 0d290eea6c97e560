"""A semantic call's prompt as token ids, cut at its variable boundaries.

Prefix sharing (:mod:`.prefix_share`) needs a call's prompt as
*pieces* ending at variable boundaries, so equal prefixes can be found by
hashing.  Tokenizing each piece on its own would be simplest, but BPE does
not split text at arbitrary points: ``"about "`` then ``"cats"`` gives other
ids than ``"about cats"``, so the model would read another prompt than the
same text sent to ``/v1/chat/completions`` -- and a chain converted to
Semantic Variables would answer differently from the same chain run call by
call.  So the whole prompt is tokenized once, exactly as the chat endpoint
tokenizes it, and the ids are cut where the text's boundaries fall: a piece
ends with the last token that ends at or before its boundary (a token that
straddles a boundary belongs to the next piece).  Pieces are keyed by their
ids, so whatever the cut, two calls share only token-for-token equal
prefixes.

Chat prompts are rendered by :func:`gateway.prompt.render_text`, the chat
endpoint's own renderer; the boundaries are found by rendering once more
with marker characters around each variable's value.  A chat template that
changes the content (trimming it, escaping it) moves the markers; then the
prompt is one piece, still tokenized exactly, only not shared.

Values arrive after a call is submitted (a producer's output, a variable set
later), so the size checked at submit (:mod:`.submit`) is checked again
here, with every value known, before any text is joined: a template
repeating a placeholder 100 times over a 100 KB value rendered 10 MB and
held the event loop 9.9 s.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import TooLarge
from ..prompt import render_text
from .prefix_share import Piece

#: Unicode noncharacters: never in well-formed text a client means to send.
OPEN, CLOSE = "\ufdd0", "\ufdd1"

#: ``(text, is_value)``: constant template text, or a variable's (or constant input's) value.
Segment = Tuple[str, bool]


def _marked(segments: Sequence[Segment]) -> str:
    return "".join(OPEN + text + CLOSE if value else text for text, value in segments)


def _strip(marked: str) -> Tuple[str, List[Tuple[int, str]]]:
    """The text without markers, and each marker's position in it."""
    out: List[str] = []
    marks: List[Tuple[int, str]] = []
    n, last = 0, 0
    for i, ch in enumerate(marked):
        if ch == OPEN or ch == CLOSE:
            out.append(marked[last:i])
            n += i - last
            marks.append((n, ch))
            last = i + 1
    out.append(marked[last:])
    return "".join(out), marks


def prompt_pieces(tokenizer: Any, fmt: Any, segments: Optional[Sequence[Segment]] = None,
                  messages: Optional[Sequence[Tuple[str, Sequence[Segment]]]] = None, *,
                  max_bytes: Optional[int] = None) -> List[Piece]:
    """The prompt of ``segments`` (plain text), or of chat ``messages``
    (``(role, segments)``, rendered with the generation prompt), as pieces
    cut at the boundaries of values; ``Piece.static`` is true for pieces of
    constant text only.  ``max_bytes`` (:func:`gateway.prompt.prompt_bytes_bound`
    of the model): a prompt of more bytes of text is refused
    (``TooLarge``) before anything is joined, rendered or tokenized."""
    if max_bytes is not None:
        size = sum(len(text.encode("utf-8", "surrogatepass"))
                   for text, _ in [*(segments or ()), *(s for _, segs in (messages or ()) for s in segs)])
        if size > max_bytes:
            raise TooLarge(f"the prompt would hold {size} bytes of text, more than the model's context "
                           f"can hold ({max_bytes} bytes)", code="context_length_exceeded")
    if messages is None:
        real = "".join(text for text, _ in segments or ())
        untrusted = [(real, False)]
        marked = _marked(segments or ())
    else:
        def render(segs_of: Any, mark: Any) -> str:
            return render_text(tokenizer, [{"role": role, "content": segs_of(segs)} for role, segs in messages],
                               [], fmt, mark)

        untrusted = tokenizer.untrusted_pieces(lambda mark: render(lambda s: "".join(t for t, _ in s), mark))
        real = "".join(text for text, _ in untrusted)
        marked = render(_marked, lambda text: text)
    ids, ends = tokenizer.encode_pieces_with_ends(untrusted)
    stripped, marks = _strip(marked)
    n_values = sum(value for _, value in (segments or [s for _, segs in (messages or ()) for s in segs]))
    if stripped != real or len(marks) != 2 * n_values:
        # the template moved the markers (or a value holds one): one piece, not shared
        return [Piece(ids, False)] if ids else []
    pieces: List[Piece] = []
    k0, start, inside = 0, 0, False
    for pos, kind in marks + [(len(real), "")]:
        k = bisect_right(ends, pos) if kind else len(ids)
        if k > k0:
            straddles = (ends[k0 - 1] if k0 else 0) < start
            pieces.append(Piece(ids[k0:k], not inside and not straddles))
            k0 = k
        start, inside = pos, kind == OPEN
    return pieces
