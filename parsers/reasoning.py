"""Reasoning parsers: a reasoning model's thinking kept apart from its answer and its calls.

Reasoning models (Qwen3, DeepSeek-R1 / V3.1, GLM-4.5+, Kimi-K2-Thinking, Magistral) write
their thinking between two markers (``<think>`` ... ``</think>``, ``[THINK]`` ... ``[/THINK]``)
before the answer.  That text must never reach ``content`` and must never swallow a tool
call: the most reported faults of peer servers are exactly those (vllm#39056: a call written
inside ``<think>`` is lost; #19017: calls stuck in ``reasoning_content``; #27703: reasoning
leaking into content when tools are on).

Design.  A reasoning parser is a :class:`StreamingParser` that wraps the model's tool-call
parser: it emits :class:`~.events.Reasoning` for the thinking and hands everything after it
to the tool-call parser, whose events pass through unchanged.  So partial execution and early
abort work as without reasoning (a call after ``</think>`` starts its tool while it decodes),
and a plugin adds a reasoning family the way it adds a tool format: a subclass with a
:class:`ReasoningFormat`, registered through the same ``register_parsers`` hook (the registry
tells the two kinds apart by the class attribute each carries: ``format`` or ``reasoning``).

Decisions, the same for every family here:

* Where the output starts.  Several templates open the thinking in the generation prompt
  (DeepSeek-R1, Qwen3-Thinking-2507, DeepSeek-V3.1 in thinking mode: the prompt ends with
  ``<think>``), so the output has only the closing marker.  Which case applies is read off the
  prompt (:meth:`ReasoningFormat.starts_inside`), not guessed from the output: a prompt ending
  in the start marker starts inside the reasoning; otherwise the output is reasoning only if it
  begins with the start marker (leading whitespace aside), and is all answer if not (a thinking
  model with thinking switched off).
* A reasoning that never closes (``max_tokens`` ran out while thinking) stays reasoning: the
  answer is empty, as DeepSeek's API and vLLM's R1 parser answer.
* A tool call's opening marker inside the reasoning ends the reasoning (``calls_end_reasoning``):
  the marker and what follows go to the tool-call parser, so the call is run, not lost.  These
  families' templates never render a call inside the thinking, and their call markers are
  special tokens a model writes only to call; a model that forgets ``</think>`` before its call
  (#39056) still gets its call made.  That is what the families' reference parsers do (vLLM's
  and SGLang's qwen3, glm45, kimi_k2; vLLM's mistral), except DeepSeek's, which leave such a
  call in the reasoning: so does :class:`DeepSeekR1Format` (docs/tool-formats.md has the table).
* Whitespace that only separates the reasoning from the answer (the ``\\n\\n`` after
  ``</think>``) and the reasoning's own leading/trailing whitespace are layout, not text.
* Everything after the reasoning is answer: a second ``<think>`` later in the same output is
  text (interleaved thinking happens in a new segment after a tool result, which gets a new
  parser).

Previous turns' reasoning.  Each format says how a kept reasoning is written back into a
prompt (:meth:`ReasoningFormat.render`) and which turns keep it (``keep``): ``"last"`` keeps
the reasoning of the assistant turns after the last user message (Qwen3's, GLM's and
gpt-oss's templates: the current tool-calling chain keeps its thinking, finished answers
lose it), ``"none"`` drops all (DeepSeek-R1's), ``"all"`` keeps every turn's.

Cost: one :func:`split_text` scan per delta while reasoning (the end marker and the call
markers), nothing once in the answer but the tool-call parser's own work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from .base import StreamingParser, split_text
from .events import Event, Text

_WS = " \t\r\n"


class ReasoningFormat:
    """How one model family writes its reasoning; see the module docstring."""

    name: str = ""
    #: the markers around the reasoning
    start: str = "<think>"
    end: str = "</think>"
    #: markers that are special tokens in the family's tokenizer (decoded for the parser)
    special_tokens: tuple[str, ...] = ()
    #: a tool call's opening marker inside the reasoning ends it (the call is parsed, not lost)
    calls_end_reasoning: bool = True
    #: which earlier assistant turns keep their reasoning in a prompt: "last" | "none" | "all"
    keep: str = "last"

    def starts_inside(self, prompt_tail: str) -> bool:
        """Whether the generation prompt (its last characters, ``prompt_tail``) opened the reasoning."""
        return prompt_tail.rstrip(_WS).endswith(self.start)

    def render(self, text: str) -> str:
        """A kept reasoning as the assistant turn writes it, before the turn's answer and calls."""
        return f"{self.start}\n{text.strip(_WS)}\n{self.end}\n\n"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


KEEP = ("last", "none", "all")


def check_reasoning(fmt: Any, owner: str) -> ReasoningFormat:
    """``fmt`` if it describes a reasoning family, else a ``TypeError`` naming ``owner``."""
    problems = []
    if not isinstance(getattr(fmt, "name", None), str) or not fmt.name:
        problems.append("`name` must be a non-empty string")
    for attr in ("start", "end"):
        if not isinstance(getattr(fmt, attr, None), str) or not getattr(fmt, attr):
            problems.append(f"`{attr}` must be a non-empty string")
    tokens = getattr(fmt, "special_tokens", None)
    if not isinstance(tokens, tuple) or not all(isinstance(s, str) and s for s in tokens):
        problems.append("`special_tokens` must be a tuple of non-empty strings")
    if getattr(fmt, "keep", None) not in KEEP:
        problems.append(f"`keep` must be one of {', '.join(KEEP)}")
    for meth in ("starts_inside", "render"):
        if not callable(getattr(fmt, meth, None)):
            problems.append(f"`{meth}` must be a method")
    if problems:
        from .formats import FormatError

        raise FormatError(f"reasoning parser {owner}: its `reasoning` is not a reasoning format: "
                          + "; ".join(problems))
    return fmt  # type: ignore[no-any-return]


class ReasoningParser(StreamingParser):
    """Thinking first, then the answer through the tool-call parser ``inner`` (None: plain text).

    ``starts_inside``: the prompt opened the reasoning (:meth:`ReasoningFormat.starts_inside`).
    ``call_markers``: the tool format's ``call_start`` (a call opening inside the reasoning ends it).
    """

    name: ClassVar[str] = ""
    reasoning: ClassVar[ReasoningFormat] = ReasoningFormat()

    def __init__(self, *, inner: StreamingParser | None = None, starts_inside: bool = False,
                 call_markers: Sequence[str] = (), **kw: Any) -> None:
        super().__init__(**kw)
        fmt = self.reasoning
        self.inner = inner
        self.format = getattr(inner, "format", None)
        self._end = fmt.end
        self._markers = (fmt.end, *(m for m in call_markers if m)) if fmt.calls_end_reasoning else (fmt.end,)
        self._state = "reasoning" if starts_inside else "start"
        self._lead = True   # at the reasoning's start: whitespace there is layout
        self._held = ""     # whitespace at the reasoning's end so far: layout if the end marker follows

    @property
    def in_call(self) -> bool:
        return self._state == "answer" and self.inner is not None and self.inner.in_call

    # The tool-call parser applies the layout rule to the answer; this parser's own events are
    # reasoning, which is never layout: both bypass the base class's layout pass.
    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if delta:
            self._buf += delta
            self._feed()
        out, self._out = self._out, []
        return out

    def finish(self) -> list[Event]:
        if self._finished:
            return []
        self._finished = True
        self._finish()
        out, self._out = self._out, []
        return out

    def _answer(self, text: str) -> None:
        if self.inner is None:
            self._emit_text(text)
        elif text:
            self._out.extend(self.inner.feed(text))

    def _think(self, text: str) -> None:
        if self._lead:
            text = text.lstrip(_WS)
            if not text:
                return
            self._lead = False
        body = text.rstrip(_WS)
        if body:
            self._emit_reasoning(self._held + body)
            self._held = text[len(body):]
        else:
            self._held += text

    def _feed(self) -> None:
        while True:
            buf = self._buf
            st = self._state
            if st == "start":
                rest = buf.lstrip(_WS)
                start = self.reasoning.start
                if not rest or (len(rest) < len(start) and start.startswith(rest)):
                    return  # undecided: leading whitespace, or a prefix of the start marker
                if rest.startswith(start):
                    self._buf = rest[len(start):]
                    self._state = "reasoning"
                else:
                    self._state = "answer"
            elif st == "reasoning":
                end, marker = split_text(buf, self._markers)
                self._think(buf[:end])
                if marker is None:
                    self._buf = buf[end:]
                    return
                self._held = ""
                if marker == self._end:
                    self._buf = buf[end + len(marker):]
                    self._state = "gap"
                else:  # a call opens inside the reasoning: the reasoning is over, the call is parsed
                    self._buf = buf[end:]
                    self._state = "answer"
            elif st == "gap":  # whitespace between the reasoning and the answer is layout
                rest = buf.lstrip(_WS)
                self._buf = rest
                if not rest:
                    return
                self._state = "answer"
            else:
                self._buf = ""
                self._answer(buf)
                return

    def _finish(self) -> None:
        buf, self._buf = self._buf, ""
        if self._state == "start":
            self._answer(buf)  # whitespace, or a prefix of the start marker: it was the answer
        elif self._state == "reasoning":
            self._think(buf)   # a partial marker at the end: it was reasoning
        elif self._state == "answer":
            self._answer(buf)
        self._held = ""
        if self.inner is not None:
            self._out.extend(self.inner.finish())


# ---------------------------------------------------------------- the families
class ThinkFormat(ReasoningFormat):
    """``<think>`` ... ``</think>``: Qwen3, QwQ, GLM-4.5+, Kimi-K2-Thinking, MiniMax-M2."""

    name = "qwen3"
    special_tokens = ("<think>", "</think>")


class DeepSeekR1Format(ThinkFormat):
    """DeepSeek-R1 and V3.1/V3.2 (thinking mode): the template opens ``<think>`` in the prompt;
    earlier turns' reasoning is dropped (R1's template keeps only the answer).  A call written
    before ``</think>`` stays reasoning, as the family's reference parsers (vLLM's and SGLang's
    deepseek_r1 / deepseek_v3) leave it: DeepSeek's models call after their thinking."""

    name = "deepseek_r1"
    keep = "none"
    calls_end_reasoning = False


class GLM45Format(ThinkFormat):
    name = "glm45"


class KimiK2Format(ThinkFormat):
    name = "kimi_k2"


class MistralThinkFormat(ReasoningFormat):
    """Magistral: ``[THINK]`` ... ``[/THINK]`` (special tokens of its tokenizer)."""

    name = "mistral"
    start = "[THINK]"
    end = "[/THINK]"
    special_tokens = ("[THINK]", "[/THINK]")


def _family(fmt: ReasoningFormat) -> type[ReasoningParser]:
    return type(f"{type(fmt).__name__[:-6]}ReasoningParser", (ReasoningParser,),
                {"name": fmt.name, "reasoning": fmt, "__module__": __name__,
                 "__doc__": f"The {fmt.name!r} reasoning parser ({type(fmt).__doc__ or fmt.start})."})


Qwen3ReasoningParser = _family(ThinkFormat())
DeepSeekR1ReasoningParser = _family(DeepSeekR1Format())
GLM45ReasoningParser = _family(GLM45Format())
KimiK2ReasoningParser = _family(KimiK2Format())
MistralReasoningParser = _family(MistralThinkFormat())

#: the built-in reasoning parsers by config name (``reasoning_parser:``); deepseek_v3 is the
#: same family as deepseek_r1 (its thinking mode is told by the prompt)
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "deepseek_v3": DeepSeekR1ReasoningParser,
    "glm45": GLM45ReasoningParser,
    "kimi_k2": KimiK2ReasoningParser,
    "mistral": MistralReasoningParser,
}

__all__ = ["ReasoningFormat", "ReasoningParser", "REASONING_PARSERS", "check_reasoning", "ThinkFormat",
           "DeepSeekR1Format", "GLM45Format", "KimiK2Format", "MistralThinkFormat"]
