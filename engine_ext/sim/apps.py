"""Parrot's four applications as DAGs of LLM calls in *tokens*: the shapes of ``interlace bench apps``.

``bench/apps.py`` runs chain summary, map-reduce summary, a GPTs-style
shared prompt and a MetaGPT-style multi-agent loop on the native engine as
text.  The simulator (``app_engine``, ``interlace sim apps``) needs the same
calls with the same dependencies, stages, clients and output lengths, but
as token counts and piece identities (two prompts share KV exactly where
their pieces are the same): this module.  It is a pure-data mirror, not an
import: engine_ext may not import bench (layers import downward), and
bench/apps.py imports httpx at module level.  ``tests/test_sim_apps.py``
holds the two together (call names, stages, clients, inputs, max_tokens of
every call equal to bench's builders at the same sizes).

Token counts of the constant text (template pieces between placeholders,
the chat template's head and tail, the user queries, the task) were
measured once with the embedded model's tokenizer (SmolLM2-135M-Instruct,
the one ``bench apps`` uses), each piece tokenized on its own as the
gateway tokenizes a semantic call's pieces; e.g. chain's later step is
``[11, summary, 12, chunk, 12]``, the chat head 24 tokens and the tail 6.
A document piece is ``chunk_tokens`` tokens (bench cuts the document by
tokens: 256, 256, 259, 256, ... measured for the default cut), a variable
holding a call's output is that call's ``max_tokens`` (bench's calls all
end at ``max_tokens``, checked there).  Llama-3's tokenizer gives other
counts for the same English text (about 10% fewer); the shapes do not
depend on it.

Size sets: :data:`BENCH` (= bench apps' defaults), :data:`QUICK` (= its
``--quick``), :data:`PARROT` (GPU scale, our reading of Parrot's section 8:
documents of 20,000+ tokens in 1,024-token chunks, 50-token outputs (the
middle of Figure 11's range); a Bing-Copilot-sized system prompt of 6,000
tokens and 32 users; MetaGPT with 8 files and 3 review rounds.  The paper
gives ranges, not one setting: these are assumptions, stated in every
report).

Objectives are deduced by the gateway's own deduction
(``policies/deduction.py``, Parrot section 5.2): every final variable is fetched with the
latency criterion; a call's reverse stage is its longest path to one;
stage 0 and single-call stages are latency-critical, a stage of two or
more calls a task group (throughput).  Free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, Hashable, List, Optional, Tuple

from ..policies.deduction import CallNode, deduce
from ..policies.objectives import LATENCY

APPS = ("chain", "mapreduce", "shared", "multiagent")


class AppSpecError(ValueError):
    """Bad application sizes or names: the message names the option."""


# ---------------------------------------------------------------- token counts (SmolLM2 tokenizer, module doc)
CHAT_HEAD = 24   # "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\n<|im_start|>user\n"
CHAT_TAIL = 6    # "<|im_end|>\n<|im_start|>assistant\n"
CHAIN_FIRST_HEAD = 10                   # "Summarize the following text in detail.\n"
CHAIN_HEAD, CHAIN_MID, CHAIN_TAIL = 11, 12, 12
MAP_HEAD = 13                           # "Summarize the following part of a document in detail.\n"
REDUCE_HEAD, REDUCE_SEP, REDUCE_TAIL = 20, 7, 11
SHARED_SYSTEM_EXTRA = 5                 # "\n\nCustomer:\n" after the system prompt
SHARED_TAIL = 6                         # "\nTripMate:"
USER_QUERY_TOKENS = (16, 15, 17, 11, 16, 14, 16, 17, 12, 11, 16, 13, 14, 19, 11, 15)  # bench's 16 queries
TASK_TOKENS = 33
DESIGN_HEAD = 14


def design_tail(files: int) -> int:
    """The architect's text after the task: 31 tokens + 4 per file name in the list (measured for 2, 4 and 8)."""
    return 31 + 4 * files


CODER_HEAD, CODE_TAIL = 19, 23          # "You are a Python programmer ...\n" / "\n\nWrite the complete code of the file f..."
REVIEW_HEAD, REVIEW_PROJECT, REVIEW_SEP, REVIEW_TAIL = 16, 16, 8, 22
REVISE_MID, REVISE_SEP, REVISE_TAIL = 12, 8, 18


# ---------------------------------------------------------------- the description
@dataclass(frozen=True)
class Piece:
    """A run of prompt tokens: ``key`` names its content (equal keys, equal
    tokens), ``var`` the call whose output it is (None: constant text or a
    constant input), ``static`` whether it is the template's constant text
    (or the chat template's), which the gateway may share without demand."""

    key: Hashable
    tokens: int
    static: bool = False
    var: Optional[str] = None


@dataclass(frozen=True)
class SimCall:
    """One LLM call: its prompt as pieces (chat template included), the
    variable it writes (``out``), its output length, bench's stage and client."""

    out: str
    pieces: Tuple[Piece, ...]
    max_tokens: int
    stage: int
    client: int = 0

    @property
    def inputs(self) -> Tuple[str, ...]:
        return tuple(p.var for p in self.pieces if p.var is not None)

    @property
    def prompt_tokens(self) -> int:
        return sum(p.tokens for p in self.pieces)


@dataclass
class AppDAG:
    name: str
    calls: List[SimCall]
    finals: List[str]
    about: str
    clients: int = 1
    _by_out: Dict[str, SimCall] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_out = {c.out: c for c in self.calls}

    def call(self, out: str) -> SimCall:
        return self._by_out[out]

    def stages(self) -> List[List[SimCall]]:
        n = max(c.stage for c in self.calls) + 1
        return [[c for c in self.calls if c.stage == s] for s in range(n)]


@dataclass(frozen=True)
class Sizes:
    """The applications' sizes: bench apps' and the simulator's one definition (``bench/apps.py`` imports it)."""

    chunks: int = 8
    chunk_tokens: int = 256
    output_tokens: int = 32
    users: int = 16
    system_tokens: int = 800
    files: int = 4
    rounds: int = 2

    def validated(self) -> "Sizes":
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AppSpecError(f"--{f.name.replace('_', '-')} must be a positive integer, got {v!r}")
        return self


BENCH = Sizes()
QUICK = Sizes(chunks=3, chunk_tokens=96, output_tokens=12, users=4, system_tokens=256, files=2, rounds=1)
PARROT = Sizes(chunks=20, chunk_tokens=1024, output_tokens=50, users=32, system_tokens=6000, files=8, rounds=3)
SIZE_SETS = {"bench": BENCH, "quick": QUICK, "parrot": PARROT}


def _chat(*pieces: Piece) -> Tuple[Piece, ...]:
    """The user turn wrapped in the chat template (both ways of calling: ``chat: true`` renders the same)."""
    return (Piece("chat.head", CHAT_HEAD, True),) + tuple(p for p in pieces if p.tokens > 0) + \
        (Piece("chat.tail", CHAT_TAIL, True),)


def _var(name: str, tokens: int) -> Piece:
    return Piece(("out", name), tokens, False, name)


def _doc(i: int, n: int) -> Piece:
    return Piece(("doc", i, n), n)  # a constant input (a value, not template text)


def chain_app(s: Sizes) -> AppDAG:
    out = s.output_tokens
    calls = [SimCall("summary_0", _chat(Piece("chain.head0", CHAIN_FIRST_HEAD, True), _doc(0, s.chunk_tokens)),
                     out, 0)]
    for i in range(1, s.chunks):
        calls.append(SimCall(f"summary_{i}", _chat(
            Piece("chain.head", CHAIN_HEAD, True), _var(f"summary_{i - 1}", out), Piece("chain.mid", CHAIN_MID, True),
            _doc(i, s.chunk_tokens), Piece("chain.tail", CHAIN_TAIL, True)), out, i))
    return AppDAG("chain", calls, [f"summary_{s.chunks - 1}"],
                  f"chain summary, {s.chunks} pieces of {s.chunk_tokens} tokens, {out} tokens per step")


def mapreduce_app(s: Sizes) -> AppDAG:
    out = s.output_tokens
    calls = [SimCall(f"part_{i}", _chat(Piece("map.head", MAP_HEAD, True), _doc(i, s.chunk_tokens)), out, 0)
             for i in range(s.chunks)]
    body: List[Piece] = [Piece("reduce.head", REDUCE_HEAD, True)]
    for i in range(s.chunks):
        if i:
            body.append(Piece(("reduce.sep", i), REDUCE_SEP, True))  # "\n\nPart {i+1}:\n"
        body.append(_var(f"part_{i}", out))
    body.append(Piece("reduce.tail", REDUCE_TAIL, True))
    calls.append(SimCall("summary", _chat(*body), out, 1))
    return AppDAG("mapreduce", calls, ["summary"],
                  f"map-reduce summary, {s.chunks} pieces of {s.chunk_tokens} tokens, {out} tokens per call")


def shared_app(s: Sizes) -> AppDAG:
    system = Piece(("system", s.system_tokens), s.system_tokens + SHARED_SYSTEM_EXTRA, True)
    calls = [SimCall(f"answer_{u}", _chat(system, Piece(("query", u), USER_QUERY_TOKENS[u % len(USER_QUERY_TOKENS)]),
                                          Piece("shared.tail", SHARED_TAIL, True)), s.output_tokens, 0, client=u)
             for u in range(s.users)]
    return AppDAG("shared", calls, [c.out for c in calls],
                  f"{s.users} users sharing a {s.system_tokens}-token system prompt, {s.output_tokens} tokens per "
                  "answer", clients=s.users)


def multiagent_app(s: Sizes) -> AppDAG:
    out, n = s.output_tokens, s.files
    calls = [SimCall("design", _chat(Piece("design.head", DESIGN_HEAD, True), Piece("task", TASK_TOKENS),
                                     Piece(("design.tail", n), design_tail(n), True)), out, 0)]
    coder = (Piece("coder.head", CODER_HEAD, True), _var("design", out))
    for i in range(n):
        calls.append(SimCall(f"code_{i}_r0", _chat(*coder, Piece(("code.tail", i), CODE_TAIL, True)), out, 1))
    stage = 2
    for r in range(s.rounds):
        project: List[Piece] = [Piece("review.project", REVIEW_PROJECT, True)]  # "...project:\n# file f0\n"
        for j in range(n):
            if j:
                project.append(Piece(("review.sep", j), REVIEW_SEP, True))   # "\n\n# file fj\n"
            project.append(_var(f"code_{j}_r{r}", out))
        for i in range(n):
            calls.append(SimCall(f"review_{i}_r{r}", _chat(Piece("review.head", REVIEW_HEAD, True), _var("design", out),
                                                           *project, Piece(("review.tail", i), REVIEW_TAIL, True)),
                                 out, stage))
        for i in range(n):
            calls.append(SimCall(f"code_{i}_r{r + 1}", _chat(
                *coder, Piece(("revise.mid", i), REVISE_MID, True), _var(f"code_{i}_r{r}", out),
                Piece("revise.sep", REVISE_SEP, True), _var(f"review_{i}_r{r}", out),
                Piece(("revise.tail", i), REVISE_TAIL, True)), out, stage + 1))
        stage += 2
    return AppDAG("multiagent", calls, [f"code_{i}_r{s.rounds}" for i in range(n)],
                  f"multi-agent review loop, {n} files, {s.rounds} rounds, {out} tokens per call")


BUILDERS = {"chain": chain_app, "mapreduce": mapreduce_app, "shared": shared_app, "multiagent": multiagent_app}


def build_app(name: str, sizes: Sizes) -> AppDAG:
    if name not in BUILDERS:
        raise AppSpecError(f"unknown application {name!r}; choose from {', '.join(APPS)}")
    return BUILDERS[name](sizes.validated())


def parse_apps(text: Optional[str]) -> List[str]:
    names = [a.strip() for a in (text or ",".join(APPS)).split(",") if a.strip()]
    bad = [a for a in names if a not in APPS]
    if bad or not names:
        raise AppSpecError(f"--apps: unknown application {bad[0] if bad else text!r}; choose from {', '.join(APPS)}")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------- objectives (the gateway's rule, one place)
def deduce_objectives(app: AppDAG) -> Dict[str, Tuple[Optional[str], Optional[str]]]:
    """``{call out: (objective, task_group)}`` with every final variable
    fetched under the latency criterion, per client (a client's calls are
    one session: task groups never span clients), by the deduction the
    gateway runs (:func:`~..policies.deduction.deduce`)."""
    res: Dict[str, Tuple[Optional[str], Optional[str]]] = {}
    for cid in sorted({c.client for c in app.calls}):
        calls = [c for c in app.calls if c.client == cid]
        prefs = deduce([CallNode(c.out, c.inputs, (c.out,)) for c in calls],
                       {f: LATENCY for f in app.finals if app.call(f).client == cid}, group_prefix=f"c{cid}.tg")
        res.update({c.out: (prefs[c.out].objective, prefs[c.out].task_group) for c in calls})
    return res


__all__ = ["APPS", "AppDAG", "AppSpecError", "BENCH", "BUILDERS", "PARROT", "Piece", "QUICK", "SIZE_SETS", "SimCall",
           "Sizes", "build_app", "chain_app", "deduce_objectives", "mapreduce_app", "multiagent_app", "parse_apps",
           "shared_app"]
