"""Tokenizer, chat template and streaming-safe detokenization.

Uses the ``tokenizers`` library on the model directory's tokenizer.json and
renders the chat template with Jinja2 the way transformers does (sandboxed,
``trim_blocks``/``lstrip_blocks``), without importing transformers at serve
time.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    """The messages could not be rendered by the model's chat template."""


def _token_str(v: Any) -> Optional[str]:
    if isinstance(v, dict):  # older tokenizer_config: {"content": "...", ...}
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, model_dir: Path, config: Optional[dict] = None):
        model_dir = Path(model_dir)
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

    @staticmethod
    def _json(p: Path) -> dict:
        return json.loads(p.read_text()) if p.exists() else {}

    # ------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

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
        return self.encode(self.apply_chat_template(messages, **kwargs))


def _raise(msg: str):
    raise jinja2.TemplateError(msg)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never end in
    half a UTF-8 character.

    Decoding token by token breaks multi-byte characters (and, for some
    tokenizers, spacing), so each step decodes a short window ending at the new
    token and emits only what the window adds beyond its already-emitted part,
    holding back while the text ends in U+FFFD (an incomplete byte sequence).
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids: List[int] = list(context_ids[-6:])  # a little left context for leading-space rules
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def reset_context(self, context_ids: Sequence[int]) -> None:
        """Restart after tokens were appended from outside (a resumed tool result)."""
        self.__init__(self.tokenizer, context_ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset])
        full = dec(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back at the end of a stream (a dangling partial char)."""
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset])
        full = dec(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
