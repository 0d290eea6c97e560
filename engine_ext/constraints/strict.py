"""Strict tools under ``tool_choice: "auto"``: free text stays free, calls follow their schemas.

OpenAI's ``strict: true`` on a function tool guarantees that the model's
calls of it match its ``parameters`` schema, while the model stays free to
answer in prose or to call.  Here that is one llguidance grammar per request
(the design llguidance documents for tool calling, and what vLLM's
structural tags with ``triggers`` compile to), for hermes on a vocabulary
where ``<tool_call>`` is text::

    start: strict_call* strict_free                 # any number of calls, free text around them
    strict_free: strict_pre STRICT_ANY              # text runs between special tokens
    strict_head_0: strict_pre strict_lazy_0_0
    strict_lazy_0_0[lazy]: STRICT_ANY "<tool_call>"
    strict_call: <the format's forcing grammar, its call_start marker replaced by strict_head_0>

Free text is a lexeme matching anything; the *lazy* lexeme ``STRICT_ANY
"<tool_call>"`` ends at the first ``<tool_call>`` the model writes, and from
there the rest of the call is the format's own forcing grammar
(``fmt.grammar(compiler, tools, None, parallel)``, the one ``tool_choice:
"required"`` uses), so the constrained text is exactly what the format's parser
reads.  Once the call is complete the grammar is back in free text, waiting
for the next marker.  Decisions:

* **One grammar, not a trigger watcher in Python.**  llguidance's lexer finds
  the marker in the decoded bytes itself, incrementally, and masks tokens
  exactly at the boundary: a token holding the marker's last characters *and
  more* is allowed only if what follows the marker starts a valid call (after
  ``<tool_call`` the embedded vocabulary's ``>",`` is masked, ``>`` is not),
  which a processor that switches matchers after the fact cannot do.  The same
  grammar runs on vLLM (its structured outputs, llguidance backend), which a
  Python watcher could not.  The price: free text is masked too.  On the
  embedded model's 49,152-token vocabulary llguidance's mask in prose takes
  about 6 us a token and the whole processor (the mask applied to the logits)
  about 70 us, less than a forced call's grammar (about 120 us); a byte watcher
  would cost a few microseconds.  ``test_per_token_cost`` measures it.
* **Free text must be UTF-8**: a token that is not whole characters (a lone
  continuation byte) is masked where it would leave a broken character, as
  decoding it to text needs anyway.  Special tokens (other than EOS and the
  markers) stay allowed between calls, as without the constraint; EOS is
  allowed wherever the output could end, i.e. anywhere but inside a call.
* **Where a call starts.**  ``ToolFormat.call_start`` names the marker(s) that
  open a call, where the format's forcing grammar's text begins.  The forcing
  grammar is built through a recording builder (its Lark text, not compiled),
  and each marker is located there as the builder wrote it: a special token
  ``<[id]>`` where the vocabulary has one, then string literals (adjacent ones
  joined; the last may go on past the marker).  Three kinds of marker: text (a
  lazy lexeme ends free text at it); a special token (free text runs up to it;
  it is never free); a special token and text (harmony's ``<|channel|>commentary
  to=``: the token stays free, but a text run right after it may not begin with
  that text, a terminal with llguidance's ``&``/``~``).  A format whose grammar
  does not begin with its marker, or with no ``call_start`` (llama3_json's bare
  ``{``, pythonic's ``[``: prose writes those too), cannot constrain calls this
  way: :class:`CannotTrigger`.
* **Which schemas.**  Strict tools keep their ``parameters``; the other
  function tools get ``{"type": "object"}``: their calls are still well-formed
  JSON objects naming an offered tool, but their schemas are neither enforced
  nor compiled (a non-strict tool with a schema llguidance cannot enforce does
  not make the request fail).  ``parallel`` is the format's own (a mistral list
  may hold several calls); calls after free text need no ``parallel``.
* **Every round.**  :class:`StrictToolsProcessor` restarts the grammar on each
  ``on_resume()`` (server-side tool results were appended: the next round is
  free text again, also after a call aborted midway), so calls in later rounds
  are constrained too; with ``first`` (``tool_choice`` forcing the first round)
  that processor decides the first round and the strict grammar the ones after.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .grammar import Grammar, GrammarCompiler, GrammarProcessor, _lit, _rebuild_processor

__all__ = ["CannotTrigger", "StrictToolsProcessor", "strict_tools_grammar", "strict_functions", "triggered_lark"]

#: the request field that says a function tool is strict (``tools[i].function.strict``)
STRICT = "strict"


class CannotTrigger(ValueError):
    """The tool-call format has no marker from which to constrain calls lazily
    (no ``call_start``, or its forcing grammar does not begin with it)."""


def strict_functions(tools: Sequence[Mapping[str, Any]], all_strict: bool = False) -> List[str]:
    """Names of the function tools whose arguments are constrained: ``strict: true``, or all with ``all_strict``."""
    out = []
    for t in tools:
        if not isinstance(t, Mapping) or t.get("type", "function") != "function":
            continue
        fn = t.get("function", t)
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str) and (all_strict or fn.get(STRICT) is True):
            out.append(fn["name"])
    return out


def _loosened(tools: Sequence[Mapping[str, Any]], strict: Sequence[str]) -> List[Dict[str, Any]]:
    """``tools`` with every function not in ``strict`` taking any JSON object."""
    keep = set(strict)
    out: List[Dict[str, Any]] = []
    for t in tools:
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if (isinstance(fn, Mapping) and t.get("type", "function") == "function" and fn.get("name") not in keep):
            fn = {**fn, "parameters": {"type": "object"}}
            t = {**t, "function": fn} if "function" in t else fn
        out.append(dict(t) if isinstance(t, Mapping) else t)
    return out


# ----------------------------------------------------------- the format's grammar, as Lark text
class _Recorder:
    """A :class:`~interlace.parsers.formats.GrammarBuilder` that hands back the
    Lark text a format builds instead of compiling it (the building blocks are
    the compiler's own)."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.functions_seen: Mapping[str, Mapping[str, Any]] = {}

    def functions(self, tools: Sequence[Mapping[str, Any]], force: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
        return self.compiler.functions(tools, force)

    def json_rule(self, schema: Mapping[str, Any]) -> str:
        return self.compiler.json_rule(schema)

    def literal(self, text: str) -> str:
        return self.compiler.literal(text)

    def marker(self, text: str) -> str:
        return self.compiler.marker(text)

    def envelope(self, tools: Sequence[Mapping[str, Any]], **kw: Any) -> str:
        return GrammarCompiler.envelope(self, tools, **kw)  # type: ignore[arg-type]  (its tool_grammar is ours)

    def tool_grammar(self, lark: str, functions: Mapping[str, Mapping[str, Any]]) -> str:
        self.functions_seen = functions
        return lark


_JSON_DECODER = json.JSONDecoder()


def _pieces(lark: str) -> List[Tuple[str, str]]:
    """``lark`` cut into ``("str", literal)``, ``("skip", text)`` (a regex, an
    inline ``%json`` value) and ``("code", text)`` pieces, so that markers are
    looked for in string literals and rule bodies only, never inside a
    client's schema or a regex."""
    out: List[Tuple[str, str]] = []
    i, start, n = 0, 0, len(lark)

    def flush(end: int) -> None:
        if end > start:
            out.append(("code", lark[start:end]))

    while i < n:
        c = lark[i]
        if c == '"':
            flush(i)
            j = i + 1
            while j < n and lark[j] != '"':
                j += 2 if lark[j] == "\\" else 1
            out.append(("str", lark[i:j + 1]))
            i = start = j + 1
        elif c == "/":
            flush(i)
            j = i + 1
            while j < n and lark[j] not in "/\n":
                j += 2 if lark[j] == "\\" else 1
            out.append(("skip", lark[i:j + 1]))
            i = start = j + 1
        elif lark.startswith("%json", i):
            flush(i)
            j = i + len("%json")
            while j < n and lark[j] in " \t":
                j += 1
            try:
                _, end = _JSON_DECODER.raw_decode(lark, j)
            except ValueError:  # not JSON: llguidance will say so; skip the line
                end = lark.find("\n", j) if "\n" in lark[j:] else n
            out.append(("skip", lark[i:end]))
            i = start = end
        else:
            i += 1
    flush(n)
    return out


def _split_trigger(compiler: GrammarCompiler, trigger: str) -> Tuple[Optional[int], str]:
    """``(special token id, text)`` of a marker: the special token it starts with where the
    vocabulary has one (None: none), and the text after it (``<|channel|>commentary to=``:
    the token ``<|channel|>`` and ``commentary to=``; ``<tool_call>`` on a vocabulary where it is
    plain text: None and the whole marker)."""
    for i in range(len(trigger), 0, -1):
        mark = compiler.marker(trigger[:i])
        if mark.startswith("<["):
            return int(mark[2:-2]), trigger[i:]
    return None, trigger


def _locate(pieces: List[Tuple[str, str]], special: Optional[int], text: str, head: str) -> bool:
    """Replace, in ``pieces``, each place where a marker is written (its special token ``<[id]>``,
    then string literals whose text begins with ``text``, only layout between them) by the rule
    ``head`` and what the last literal holds past the marker.  False if there is none."""
    atoms: List[Tuple[str, str]] = []  # code split so that each <[id]> is an atom of its own
    for kind, piece in pieces:
        if kind == "code":
            atoms += [("special" if re.fullmatch(r"<\[\d+\]>", part) else "code", part)
                      for part in re.split(r"(<\[\d+\]>)", piece) if part]
        else:
            atoms.append((kind, piece))
    found = False
    i = 0
    out: List[Tuple[str, str]] = []
    while i < len(atoms):
        end, rest = _match(atoms, i, special, text)
        if end is None:
            out.append(atoms[i])
            i += 1
            continue
        out.append(("code", head + (f" {_lit(rest)}" if rest else "")))
        found = True
        i = end
    pieces[:] = out
    return found


def _match(atoms: List[Tuple[str, str]], i: int, special: Optional[int], text: str) -> Tuple[Optional[int], str]:
    """(the atom after the marker written from ``atoms[i]`` on, the literal text past it), or (None, "")."""
    def skip(j: int) -> int:
        while j < len(atoms) and atoms[j][0] == "code" and not atoms[j][1].strip():
            j += 1
        return j

    if special is not None:
        if atoms[i] != ("special", f"<[{special}]>"):
            return None, ""
        if not text:
            return i + 1, ""
        j = skip(i + 1)
    else:
        j = i
    got = ""
    while j < len(atoms) and atoms[j][0] == "str":
        try:
            got += json.loads(atoms[j][1])
        except ValueError:
            return None, ""
        if got.startswith(text):
            return j + 1, got[len(text):]
        if not text.startswith(got):
            return None, ""
        j = skip(j + 1)
    return None, ""


def triggered_lark(compiler: GrammarCompiler, fmt: Any, tools: Sequence[Mapping[str, Any]], *,
                   parallel: bool = True) -> Tuple[str, Mapping[str, Mapping[str, Any]]]:
    """The Lark grammar of free text with calls of ``tools`` in ``fmt``'s format, and the
    functions it covers.  Raises :class:`CannotTrigger`, the format's ``CannotForce`` or the
    compiler's ``GrammarError`` (an invalid tool list).

    Free text is runs of text (``STRICT_ANY``) between special tokens.  A marker is text (a
    lazy lexeme ends the run at its first occurrence), a special token (free text runs up to
    it; elsewhere it is not free), or a special token and text (``<|channel|>commentary to=``:
    the token stays free, but a run right after it must not begin with that text, a terminal
    ``STRICT_NOT_i``); ``strict_pre`` is free text that ends right after a special token,
    ``strict_pre_i`` the same ending with the special token ``i`` of such a marker.
    """
    triggers = tuple(getattr(fmt, "call_start", ()) or ())
    if not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise CannotTrigger(f"the {getattr(fmt, 'name', '?')!r} tool-call format has no marker that opens a call "
                            "(call_start), so strict tools cannot be constrained under tool_choice \"auto\"")
    rec = _Recorder(compiler)
    lark = fmt.grammar(rec, list(tools), None, parallel)
    if not isinstance(lark, str):
        raise CannotTrigger(f"the {fmt.name!r} format's grammar is not built with the GrammarBuilder's "
                            "envelope() or tool_grammar()")
    parts = [_split_trigger(compiler, t) for t in triggers]
    only_calls = {sp for sp, text in parts if sp is not None and not text}  # never free
    guarded: Dict[int, List[str]] = {}  # special token -> the texts that may not follow it in free text
    for sp, text in parts:
        if sp is not None and text:
            guarded.setdefault(sp, []).append(text)
    if only_calls & set(guarded):
        raise CannotTrigger(f"the {fmt.name!r} format's call_start markers {triggers!r} use one special token "
                            "both alone and followed by text")
    pieces = _pieces(lark)
    heads: List[str] = []
    # the states free text can be in before a head: after a token whose next run is free, or one per guarded token
    states = [("strict_pre", "STRICT_ANY")] + [(f"strict_pre_{sp}", f"STRICT_NOT_{sp}") for sp in guarded]
    for k, (trig, (sp, text)) in enumerate(zip(triggers, parts)):
        head = f"strict_head_{k}"
        if not _locate(pieces, sp, text, head):
            raise CannotTrigger(f"the {fmt.name!r} format's grammar does not begin with its call_start "
                                f"marker {trig!r}")
        if sp is None:  # text: a lazy lexeme ends the run at the marker
            heads.append(f"{head}: " + " | ".join(f"{st} strict_lazy_{k}_{n}" for n, (st, _) in enumerate(states)))
            heads += [f"strict_lazy_{k}_{n}[lazy]: {run} {_lit(text)}" for n, (_, run) in enumerate(states)]
        else:
            heads.append(f"{head}: " + " | ".join(f"{st} {run} <[{sp}]>" + (f" {_lit(text)}" if text else "")
                                                   for st, run in states))
    body = "".join(text for _, text in pieces)
    body, renamed = re.subn(r"(?m)^start(\s*:)", r"strict_call\1", body)
    if renamed != 1:
        raise CannotTrigger(f"the {fmt.name!r} format's grammar has no single start rule")
    eos = set(compiler.eos_token_ids)
    free = [i for i in compiler.special_token_ids() if i not in eos and i not in only_calls and i not in guarded]
    lines = ["%llguidance {}", "start: strict_call* strict_free", "STRICT_ANY: /(?s:.*)/",
             "strict_free: " + " | ".join(f"{st} {run}" for st, run in states)]
    closers = [f"{st} {run} strict_special" for st, run in states] if free else []
    lines.append("strict_pre: \"\"" + "".join(f" | {c}" for c in closers))
    if free:  # the model may write them in prose as it could without the constraint
        lines.append(f"strict_special: <[{_ranges(free)}]>")
    for sp, texts in guarded.items():
        lines.append(f"strict_pre_{sp}: " + " | ".join(f"{st} {run} <[{sp}]>" for st, run in states))
        lines.append(f"STRICT_NOT_{sp}: /(?s:.*)/ & ~(({' | '.join(_lit(t) for t in texts)}) /(?s:.*)/)")
    return "\n".join(lines + heads) + "\n" + body.strip("\n") + "\n", rec.functions_seen


def _ranges(ids: Sequence[int]) -> str:
    """Sorted token ids as llguidance's ``<[...]>`` list of ranges (``0-1,3-16``)."""
    out: List[str] = []
    lo = prev = ids[0]
    for i in list(ids[1:]) + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(lo) if lo == prev else f"{lo}-{prev}")
        if i is not None:
            lo = prev = i
    return ",".join(out)


def strict_tools_grammar(compiler: GrammarCompiler, fmt: Any, tools: Sequence[Mapping[str, Any]],
                         strict: Sequence[str], *, parallel: bool = True) -> Grammar:
    """The compiled grammar of :func:`triggered_lark` where the functions named in ``strict``
    keep their schemas and the others take any JSON object.  Raises as :func:`triggered_lark`;
    a strict tool's schema that cannot be enforced is the compiler's ``GrammarError`` naming it."""
    lark, functions = triggered_lark(compiler, fmt, _loosened(tools, strict), parallel=parallel)
    return dataclasses.replace(compiler.tool_grammar(lark, functions), kind="strict_tools")


# ------------------------------------------------------------------------ the processor
class StrictToolsProcessor(GrammarProcessor):
    """The strict-tools grammar on one stream, restarted each round.

    A :class:`GrammarProcessor` over :func:`strict_tools_grammar` that also
    applies after server-side tool results were appended (``every_round``: the
    gateway does not wrap it to apply to the first round only): each
    :meth:`on_resume` restarts the grammar after what the earlier rounds
    generated, in free text.  ``first``, when given, is the processor of the
    first round (``tool_choice`` forcing calls); the strict grammar takes over
    from the first resume on.  ``resumes`` counts :meth:`on_resume` calls (a
    worker-process engine replays them on its copy).

    Engines that run grammars themselves (vLLM) get the whole grammar for each
    request they start (:meth:`segment_grammar`): right at the start of a
    round; after a pause the gateway resumes with nothing appended (a pause
    marker in prose or inside a call's arguments), it restarts in free text
    too, which leaves the rest of a call cut by such a pause unconstrained.
    """

    every_round = True

    def __init__(self, matcher: Any, eos_token_ids: Sequence[int], vocab_size: int, *, spec: Optional[str],
                 first: Any = None):
        super().__init__(matcher, eos_token_ids, vocab_size, kind="strict_tools", spec=spec)
        self._pristine = matcher.deep_copy()
        self.first = first
        self.resumes = 0
        self._restart = False

    @classmethod
    def build(cls, compiler: GrammarCompiler, grammar: Grammar, first: Any = None) -> "StrictToolsProcessor":
        base = compiler.processor(grammar)
        return cls(base.matcher, base.eos_token_ids, base.vocab_size, spec=base.spec, first=first)

    def __reduce__(self) -> Tuple[Any, tuple]:
        if self.consumed or self.steps or self.resumes:
            raise TypeError(f"this strict_tools processor has started ({self.steps} steps, {self.resumes} "
                            "resumes): its parse state cannot be shipped")
        return _rebuild_strict, (self.spec, tuple(self.eos_token_ids), self.vocab_size, self.first)

    @property
    def _first_round(self) -> bool:
        return self.first is not None and self.resumes == 0

    def on_resume(self) -> None:
        self.resumes += 1
        self._restart = True

    def __call__(self, generated: Sequence[int], logits: Any) -> Any:
        if self._first_round:
            return self.first(generated, logits)
        if self._restart:  # a new round: free text again, after what the earlier rounds generated
            self._restart = False
            self.matcher = self._pristine.deep_copy()
            self.consumed = len(generated)
        return super().__call__(generated, logits)

    def segment_grammar(self, n_generated: int) -> Dict[str, Any]:
        if self._first_round:
            return self.first.segment_grammar(n_generated)
        return GrammarProcessor.segment_grammar(self, 0)


def _rebuild_strict(spec: str, eos_token_ids: Tuple[int, ...], vocab_size: int, first: Any) -> StrictToolsProcessor:
    """Unpickle a :class:`StrictToolsProcessor` in an engine worker process (its ``__reduce__``)."""
    base = _rebuild_processor(spec, "strict_tools", eos_token_ids, vocab_size, False)
    return StrictToolsProcessor(base.matcher, base.eos_token_ids, base.vocab_size, spec=base.spec, first=first)
