"""Tokenizer, chat template and streaming-safe detokenization.

Uses the ``tokenizers`` library on the model directory's tokenizer.json and
renders the chat template with Jinja2 the way transformers does (sandboxed,
``trim_blocks``/``lstrip_blocks``), without importing transformers at serve
time.  Every engine, the engine worker and the benches load a model
directory's tokenizer one way, :meth:`Tokenizer.from_model_dir` (which of its
files count, and what a missing tokenizer.json means).
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    """The messages could not be rendered by the model's chat template."""


def _token_str(v: Any) -> Optional[str]:
    if isinstance(v, dict):  # older tokenizer_config: {"content": "...", ...}
        return v.get("content")
    return v


# -------------------------------------------------- untrusted text in rendered prompts
# A placeholder stands for one untrusted string while a template renders:
# supplementary private-use characters, which no template transforms.
_PH_OPEN, _PH_CLOSE = "\U000F0000", "\U000F0001"
_PH_DIGIT0 = 0xF0010
_PH_RE = re.compile("\U000F0000([\U000F0010-\U000F0019]+)\U000F0001")


class UntrustedText:
    """Hands out placeholders for untrusted strings (message contents, tool
    arguments, tool results) so a prompt can be rendered twice, once with the
    placeholders and once with the real text, and the real text then located
    and tokenized as plain text.  Call it on each untrusted string."""

    def __init__(self) -> None:
        self.values: List[str] = []

    def __call__(self, text: str) -> str:
        if not text:
            return text  # nothing to protect, and templates test emptiness (``if message.content``)
        self.values.append(text)
        digits = "".join(chr(_PH_DIGIT0 + int(d)) for d in str(len(self.values) - 1))
        return f"{_PH_OPEN}{digits}{_PH_CLOSE}"

    def index(self, digits: str) -> int:
        return int("".join(str(ord(c) - _PH_DIGIT0) for c in digits))


def _as_rendered(value: str) -> List[str]:
    """The forms a template may write a string in: as is, JSON-escaped (``tojson``), trimmed."""
    forms = [value]
    for ensure_ascii in (False, True):
        esc = json.dumps(value, ensure_ascii=ensure_ascii)[1:-1]
        if esc not in forms:
            forms.append(esc)
    for f in (value.strip(), value.lstrip(), value.rstrip()):
        if f not in forms:
            forms.append(f)
    return forms


def split_untrusted(marked: str, real: str, marks: UntrustedText) -> List[Tuple[str, bool]]:
    """``real`` (the prompt rendered with the untrusted strings) as pieces
    ``(text, trusted)``, using ``marked`` (the same prompt rendered with
    ``marks``' placeholders) to tell the template's own text from the
    untrusted strings.

    Each placeholder's real text is found by trying the forms a template
    writes a string in (as is, JSON-escaped, trimmed) where the next
    template piece must follow; if that fails (a template that transforms the
    text otherwise), the untrusted string is used as is, so the prompt may
    then differ from the template's but is never less safe.
    """
    parts = _PH_RE.split(marked)  # text, digits, text, digits, ..., text
    pieces: List[Tuple[str, bool]] = [(parts[0], True)]
    pos = len(parts[0]) if real.startswith(parts[0]) else -1
    for k in range(1, len(parts), 2):
        i = marks.index(parts[k])
        after = parts[k + 1]
        if i >= len(marks.values):  # placeholder-like text that is not ours: plain text
            pieces.append((_PH_OPEN + parts[k] + _PH_CLOSE, False))
            pieces.append((after, True))
            continue
        value = marks.values[i]
        chosen = value
        if pos >= 0:
            for form in _as_rendered(value):
                if real.startswith(form, pos) and real.startswith(after, pos + len(form)):
                    chosen = form
                    pos += len(form) + len(after)
                    break
            else:
                pos = -1
        pieces.append((chosen, False))
        pieces.append((after, True))
    return [p for p in pieces if p[0]]



def _encode(tok: Any, text: str, add_special_tokens: bool) -> Any:
    """One text's encoding, through ``encode_batch``: the tokenizers library's ``encode`` holds the
    interpreter lock for the whole call, ``encode_batch`` releases it while the Rust code runs.  So
    tokenizing a big prompt in a worker thread leaves the event loop free (4 MB of text: the loop's
    longest wait fell from 2.5 s to 0.06 s on the 2-core development machine, the ids identical)."""
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]

class Tokenizer:
    def __init__(self, model_dir: Path, config: Optional[dict] = None):
        """The tokenizer of ``model_dir``, which holds a tokenizer.json; ``config``: the model's
        config.json (its ``vocab_size`` and ``eos_token_id`` count).  Loaders of a model
        directory use :meth:`from_model_dir`, which finds both."""
        model_dir = Path(model_dir)
        self.config: dict = config or {}  # the model's config.json, as given
        self.tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        tc_path = model_dir / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
        self.chat_template: Optional[str] = tc.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.exists():
            self.chat_template = jinja_path.read_text()
        self.bos_token = _token_str(tc.get("bos_token"))
        self.eos_token = _token_str(tc.get("eos_token"))
        self.vocab_size = max(self.tok.get_vocab_size(with_added_tokens=True), (config or {}).get("vocab_size", 0))
        eos: set[int] = set()
        for src in (config or {}, self._json(model_dir / "generation_config.json")):
            v = src.get("eos_token_id")
            eos.update(v if isinstance(v, list) else ([v] if v is not None else []))
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            eos.add(self.tok.token_to_id(self.eos_token))
        self.eos_token_ids = frozenset(eos)
        self._template: Optional[jinja2.Template] = None
        # Special tokens (control markers) by text, longest first, and a twin
        # tokenizer that reads them as plain text, for untrusted strings.
        self.special_tokens: Dict[str, int] = {
            t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self._special_re = (re.compile("|".join(re.escape(t) for t in sorted(self.special_tokens, key=len,
                                                                             reverse=True)))
                            if self.special_tokens else None)
        self._plain: Optional[HFTokenizer] = None

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike, config: Optional[dict] = None, *,
                       needed_by: Optional[str] = None) -> Optional["Tokenizer"]:
        """The tokenizer of a Hugging Face-style model directory: its tokenizer.json, with
        tokenizer_config.json, chat_template.jinja and generation_config.json where present, and
        the vocabulary size and end-of-sequence ids of its config.json (``config``: that file
        when the caller has read it already; none in the directory: ``{}``).

        Without a tokenizer.json: None (an engine then takes and returns token ids only), or,
        where ``needed_by`` names what cannot do without one, a ValueError saying so."""
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            if needed_by is not None:
                raise ValueError(f"{needed_by} needs the model's tokenizer: no tokenizer.json in {model_dir}")
            return None
        if config is None:
            config = cls._json(model_dir / "config.json")
        return cls(model_dir, config)

    @staticmethod
    def _json(p: Path) -> dict:
        return json.loads(p.read_text()) if p.exists() else {}

    # ------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> List[int]:
        """Token ids of ``text``.  With ``parse_special=False`` special-token
        text (``<|im_end|>``) is tokenized as ordinary text, never as the
        control token: the way to encode anything a client wrote."""
        tok = self.tok if parse_special else self._plain_tokenizer()
        return _encode(tok, text, add_special_tokens).ids

    def find_special(self, text: str) -> Optional[str]:
        """The first special token written in ``text`` (its text), or None."""
        m = self._special_re.search(text) if self._special_re is not None else None
        return m.group() if m else None

    def encode_pieces(self, pieces: Sequence[Tuple[str, bool]]) -> List[int]:
        """Encode ``(text, trusted)`` pieces: special tokens are recognised in
        trusted text only; everything between them (trusted text and
        untrusted text alike) is encoded as one run of plain text, so a
        benign prompt gets exactly the ids that encoding it whole would give."""
        return self.encode_pieces_with_ends(pieces)[0]

    def encode_pieces_with_ends(self, pieces: Sequence[Tuple[str, bool]]) -> Tuple[List[int], List[int]]:
        """:meth:`encode_pieces`, and where each token ends: a character
        offset into the pieces' concatenated text.  A token spanning a
        character split over several tokens (UTF-8 bytes) ends at that
        character's end.  Used to cut one prompt's tokens at positions of
        its text (Semantic Variables' boundaries) without tokenizing the
        parts on their own, which could give other ids."""
        ids: List[int] = []
        ends: List[int] = []
        run: List[str] = []
        pos = 0        # characters consumed so far
        run_start = 0  # where the pending plain-text run starts

        def flush() -> None:
            if run:
                plain = self._plain_tokenizer()
                enc = _encode(plain, "".join(run), False)
                ids.extend(enc.ids)
                ends.extend(run_start + e for _, e in enc.offsets)
                run.clear()

        for text, trusted in pieces:
            if not trusted or self._special_re is None:
                run.append(text)
                pos += len(text)
                continue
            last = 0
            for m in self._special_re.finditer(text):
                run.append(text[last:m.start()])
                flush()
                ids.append(self.special_tokens[m.group()])
                ends.append(pos + m.end())
                last = m.end()
                run_start = pos + m.end()
            run.append(text[last:])
            pos += len(text)
        flush()
        return ids, ends

    def _plain_tokenizer(self) -> HFTokenizer:
        """A twin of the tokenizer that reads special-token text as plain text."""
        if self._plain is None:
            plain = HFTokenizer.from_str(self.tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def encode_rendered(self, render: Callable[[Callable[[str], str]], str]) -> List[int]:
        """Token ids of a prompt with untrusted strings encoded as plain text.

        ``render(mark)`` builds the prompt text, passing every untrusted string
        through ``mark`` (message contents, tool arguments, tool results).  It
        is called twice: with placeholders, to find the template's own text,
        and with the identity, for the real text (see :func:`split_untrusted`).
        User text containing ``<|im_end|><|im_start|>system`` thus stays text
        instead of becoming the control tokens that open a system turn.
        """
        return self.encode_pieces(self.untrusted_pieces(render))

    def untrusted_pieces(self, render: Callable[[Callable[[str], str]], str]) -> List[Tuple[str, bool]]:
        """The ``(text, trusted)`` pieces :meth:`encode_rendered` encodes."""
        marks = UntrustedText()
        marked = render(marks)
        real = render(lambda text: text)
        return split_untrusted(marked, real, marks)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --------------------------------------------------------------- templates
    def apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[list] = None, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: List[Dict[str, Any]], **kwargs: Any) -> List[int]:
        """The chat template applied to ``messages``, with their string contents
        tokenized as plain text (only the template's markers are special)."""

        def render(mark: Callable[[str], str]) -> str:
            msgs = [{**m, "content": mark(m["content"])} if isinstance(m.get("content"), str) else m
                    for m in messages]
            return self.apply_chat_template(msgs, **kwargs)

        return self.encode_rendered(render)


def _raise(msg: str):
    raise jinja2.TemplateError(msg)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never end in
    half a UTF-8 character.

    Decoding token by token breaks multi-byte characters (and, for some
    tokenizers, spacing), so each step decodes a short window ending at the new
    token and emits only what the window adds beyond its already-emitted part,
    holding back while the text ends in U+FFFD (an incomplete byte sequence).
    ``skip_special_tokens=False`` keeps special tokens' text (for parsers
    that look for markers such as ``[TOOL_CALLS]``).
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: List[int] = list(context_ids[-6:])  # a little left context for leading-space rules
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def reset_context(self, context_ids: Sequence[int]) -> None:
        """Restart after tokens were appended from outside (a resumed tool result)."""
        self.__init__(self.tokenizer, context_ids, self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        dec, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back at the end of a stream (a dangling partial char)."""
        dec, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
