"""Parrot's applications, request-centric against Semantic Variables (``interlace bench apps``).

    interlace bench apps [--apps chain,mapreduce,shared,multiagent] [--variants a-seq,a-par,b]
                         [--capacity off|on|both] [--latency-cap 2048] [--repeats 3] [--seed 0]
                         [--out-png docs/bench_apps.png] [--json out.json] [--quick]
    interlace bench apps --mixed [...]      (the mixed run: bench/mixed.py, ``--mixed --help``)

Parrot (OSDI '24, section 8) measures four application shapes against the
same applications written as an application would call an OpenAI-style
endpoint, with 200-300 ms of simulated network delay per request.  Here they
run on the native engine with the embedded model (SmolLM2-135M-Instruct,
CPU), the gateway in process on loopback (uvicorn in a thread; the engine's
counters are read directly), in the engine's fastest configuration on a CPU
by default (see "The engine" below):

* ``chain``      chain summary of the bundled document (``bench/data``),
  cut into ``--chunks`` pieces of ``--chunk-tokens`` tokens: each step
  summarises the summary so far plus the next piece.
* ``mapreduce``  one summary per piece (map), then one of all of them (reduce).
* ``shared``     ``--users`` users of one GPTs-style application: a long
  system prompt (``--system-tokens``) and a short query each; every user is a
  separate client (a separate session), all arriving together.
* ``multiagent`` MetaGPT-style: an architect designs ``--files`` files, a
  coder writes each, a reviewer reviews each (every reviewer's prompt holds
  the whole project's code), the coder revises it; review and revision
  repeat ``--rounds`` times.

Each application runs, in one invocation and each on a fresh gateway (so no
variant finds another's KV in the prefix cache), as

* ``a-seq``  request-centric: ``POST /v1/chat/completions`` for each call in
  program order, each awaited before the next;
* ``a-par``  request-centric, the stronger baseline: the independent calls of
  one stage issued together (``asyncio.gather``), stage after stage;
* ``b``      Semantic Variables (``docs/semantic-variables.md``) through the
  SDK's :class:`interlace.sdk.AsyncClient`: a session per client, every call
  submitted up front (the first stage at once, the variables the later stages
  write declared meanwhile, then the rest, all with ``chat: true``), the
  final variables fetched once (their producers marked ``criterion:
  latency`` at submit);
* ``*-nocache`` the same on an engine without its block-hash prefix cache
  (``prefix_caching: false``; the shared-prompt application only, as Parrot
  compares against both).

Each variant's gateway and engine are released before the next one starts
(:class:`Gateway`: without it every variant left ~1.3 GB behind and
``--quick`` ended in the OOM killer); between variants the process-tree RSS
stays at ~0.45 GB.  ``--quick`` (sizes in its ``--help``) runs every variant
of the four applications once: a smoke run that checks each works and gives
the table's shape, not numbers to compare (its calls are short, so the
network delay weighs more than in a full run).

A variant equal to another for an application is not run twice (``chain``
has one call per stage, so ``a-par`` is ``a-seq``; the users of ``shared``
are separate clients arriving together, so it has no ``a-seq``).

The network: every HTTP request the application makes (chat completion,
session, variable, call, fetch) waits a delay drawn uniformly from
``--delay-ms`` (seeded; the i-th request of every variant draws the same
delay), half before it is sent and half after its answer arrived: client-side
sleeps around the request (an :class:`httpx.AsyncBaseTransport` wrapper, the
transport of both the plain httpx client and the SDK's).  Session creation is
charged to ``b``; so are the SDK's re-asks of a long blocking get (it polls
in 30 s waits).

Measured per run: end-to-end latency (the application's first request to its
last answer), prompt tokens the engine prefilled (its ``prefill_tokens``
counter; a 1-token chunk after a cached prefix counts as decode there), the
peak of KV blocks in use (sampled every 5 ms; cached but unreferenced blocks
are not in use), output tokens and prompt tokens as the server reports them
(``usage`` of each completion; the sessions' ``usage``), and whether the final
texts equal the request-centric run's (greedy decoding: they should, up to
the float differences of other batch shapes).  Prompts are the same text: the
request-centric call sends the user turn that ``chat: true`` makes of the
semantic call's template (SmolLM2's chat template adds its default system
prompt to both).  Outputs are ``--output-tokens`` long at most, greedy;
the prompts ask for more than that, so calls end at ``max_tokens`` (counted).
Each placeholder follows a single newline: the server tokenizes a template's
pieces separately, and a piece ending in ``"\n\n"`` tokenizes differently
from the same text inside one string (one token instead of two).

The engine (``--weights``, ``--threads``).  By default the embedded model runs
as shipped (``weights: as-shipped``: the GGUF's Q4_1 tensors through the
compiled ``gguf`` kernel, float32 compute; ``docs/quantization.md``) with the
gateway's thread default (one torch thread per usable core, re-chosen while
it runs from what is free: ``adapt_threads``, ``docs/cpu-engine.md``), and
the compiled decode-attention kernel (``attention: auto``): the settings of
``docs/cpu-engine.md``.  As shipped decodes ~1.9x as fast as dense float32
at batch 1 and 8 (``docs/quantization.md``, a quiet 2-core EPYC); on this
2-core Xeon (Ice Lake, AVX-512 VNNI), 2026-11-28, with other test runs
beside it (load average 1-3), one 200-word summary / eight together, 32
tokens each, took 2.4-8.9 s / 12.6-13.4 s as shipped against 10.5-13.0 s /
15.7-25.2 s dense (three runs as shipped, two dense; the first bench apps tables, 2026-11-23,
ran dense float32 on one fixed thread).  The price is start-up: a gateway
as shipped loads in 20-33 s here, dense in 5-8 s (reading the GGUF's
metadata, ~11 s, and packing the Q4_1 tensors for the kernel, ~16 s,
profiled), paid once per variant and setting.  ``--weights float32`` gives
the dense reference path; ``--threads N`` caps the engine's threads
(``engine.threads``; before issue 31's governor the bench pinned one thread,
because with two a busy neighbour stalled every OpenMP barrier: a 312-token
prompt took 20 s instead of 3 s).

Capacity regulation (``--capacity``, issue 35; Parrot section 5.4,
``engine_ext/policies/capacity.py``): ``off`` runs every variant with
``engine.capacity.latency_tokens: null`` (no cap but memory), ``on`` with the
cap ``--latency-cap`` (default 2048 tokens, the engine's default and
Parrot's example) while latency-critical work runs and ``--throughput-cap``
otherwise (default none), ``both`` runs every variant once per setting (each
on its own fresh gateway, the settings alternating within a repeat).  The
tables come per setting, each with its ratios to that setting's ``b``; with
both, a table per app compares ``on`` with ``off`` (e2e on / off, and how
often the cap held work back).  The rule holds back only
work *beside* latency-critical work (latency-critical requests always run),
so in these applications it can act only where ``b``'s latency-critical
final calls overlap other work (plain completions carry no objective: the
request-centric variants never meet the latency cap).  The case it is for,
latency-critical chats beside a task group on one engine, is the mixed run
(``--mixed``, ``bench/mixed.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import math
import random
import re
import socket
import statistics
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import httpx

from interlace.engine_ext.machine import describe_machine, machine as machine_description
from interlace.engine_ext.sim.app_cli import parse_delay as sim_parse_delay
from interlace.engine_ext.sim.apps import QUICK as SIM_QUICK, BENCH as SIM_BENCH, AppSpecError, Sizes

DATA = Path(__file__).resolve().parent / "data" / "declaration_lincoln.txt"
MODEL = "smollm2"
APPS = ("chain", "mapreduce", "shared", "multiagent")
VARIANT_ORDER = ("a-seq", "a-par", "a-par-nocache", "b", "b-nocache")


class BenchError(ValueError):
    """Bad benchmark input (an unknown app, a bad size): the message names the option."""


# =========================================================================== the engine's settings
#: ``--capacity`` values, and the settings each runs
CAPACITY_MODES = {"off": ("off",), "on": ("on",), "both": ("off", "on")}
#: the latency cap of ``on`` unless ``--latency-cap`` says otherwise: the engine's default (Parrot's example)
DEFAULT_LATENCY_CAP = 2048


@dataclass(frozen=True)
class Capacity:
    """One setting of the engine's capacity regulation (the gateway config's
    ``engine.capacity``; ``engine_ext/policies/capacity.py``): ``label`` is
    ``off`` (``latency_tokens`` None: no cap but memory) or ``on``."""

    label: str
    latency_tokens: Optional[int]
    throughput_tokens: Optional[int] = None

    def config(self) -> Dict[str, Optional[int]]:
        return {"latency_tokens": self.latency_tokens, "throughput_tokens": self.throughput_tokens}

    def describe(self) -> str:
        if self.latency_tokens is None and self.throughput_tokens is None:
            return "capacity regulation off"
        return (f"capacity regulation on: {fmt_cap(self.latency_tokens)} beside latency-critical work, "
                f"else {fmt_cap(self.throughput_tokens)}")


def fmt_cap(tokens: Optional[int]) -> str:
    return "no cap" if tokens is None else f"{tokens} tokens"


def _positive_or_none(value: Optional[int], option: str) -> Optional[int]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise BenchError(f"{option} must be a positive number of tokens, got {value!r}")
    return value


def capacity_settings(mode: str, latency_cap: Optional[int] = None,
                      throughput_cap: Optional[int] = None) -> List[Capacity]:
    """The settings ``--capacity MODE`` runs, in order (``both``: off, then on)."""
    if mode not in CAPACITY_MODES:
        raise BenchError(f"--capacity must be one of {', '.join(CAPACITY_MODES)}, got {mode!r}")
    lat = _positive_or_none(latency_cap, "--latency-cap")
    thr = _positive_or_none(throughput_cap, "--throughput-cap")
    lat = DEFAULT_LATENCY_CAP if lat is None else lat
    if thr is not None and lat > thr:
        raise BenchError(f"--latency-cap ({lat}) must not exceed --throughput-cap ({thr})")
    made = {"off": Capacity("off", None, None), "on": Capacity("on", lat, thr)}
    return [made[label] for label in CAPACITY_MODES[mode]]


def parse_weights(text: str) -> str:
    from interlace.engine_ext.native.options import WEIGHTS

    if text not in WEIGHTS:
        raise BenchError(f"--weights must be one of {', '.join(WEIGHTS)}, got {text!r}")
    return text


# =========================================================================== applications
@dataclass
class Call:
    """One LLM call: ``text`` is the user turn with ``{{input:NAME}}`` placeholders;
    ``inputs`` binds each NAME to another call's output (``("var", name)``) or a
    constant (``("const", text)``); the call writes the variable ``out``."""

    out: str
    text: str
    inputs: Dict[str, Tuple[str, str]]
    max_tokens: int
    stage: int
    client: int = 0


@dataclass
class App:
    name: str
    calls: List[Call]
    finals: List[str]
    about: str
    clients: int = 1

    def stages(self) -> List[List[Call]]:
        n = max(c.stage for c in self.calls) + 1
        return [[c for c in self.calls if c.stage == s] for s in range(n)]


# the applications' sizes: one definition for the benchmark and the simulator (``interlace sim apps``)
FULL, QUICK = SIM_BENCH, SIM_QUICK

_PLACEHOLDER = re.compile(r"\{\{input:([A-Za-z_][A-Za-z0-9_]*)\}\}")


def render(text: str, values: Dict[str, str]) -> str:
    """The template with every ``{{input:NAME}}`` replaced by its value, in one pass."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def load_document() -> str:
    return DATA.read_text(encoding="utf-8")


def chunk_text(tokenizer, text: str, n: int, size: int) -> List[str]:
    """The first ``n`` pieces of ``size`` tokens of ``text`` (decoded back to text)."""
    ids = tokenizer.encode(text)
    if len(ids) < n * size:
        raise BenchError(f"the document has {len(ids)} tokens: fewer than --chunks {n} x --chunk-tokens {size}")
    return [tokenizer.decode(ids[i * size:(i + 1) * size]).strip() for i in range(n)]


def chain_app(chunks: Sequence[str], out: int) -> App:
    calls = [Call("summary_0", "Summarize the following text in detail.\n{{input:chunk}}",
                  {"chunk": ("const", chunks[0])}, out, 0)]
    for i in range(1, len(chunks)):
        calls.append(Call(f"summary_{i}",
                          "Here is a summary of a document so far:\n{{input:summary}}\n\n"
                          "Here is the next part of the document:\n{{input:chunk}}\n\n"
                          "Write an updated, detailed summary that covers both.",
                          {"summary": ("var", f"summary_{i - 1}"), "chunk": ("const", chunks[i])}, out, i))
    return App("chain", calls, [f"summary_{len(chunks) - 1}"],
               f"chain summary, {len(chunks)} pieces, {out} tokens per step")


def mapreduce_app(chunks: Sequence[str], out: int, reduce_out: Optional[int] = None) -> App:
    """One summary per piece (map), then one of them all (reduce; ``reduce_out``
    tokens, default ``out``)."""
    calls = [Call(f"part_{i}", "Summarize the following part of a document in detail.\n{{input:chunk}}",
                  {"chunk": ("const", c)}, out, 0) for i, c in enumerate(chunks)]
    body = "\n\n".join(f"Part {i + 1}:\n{{{{input:s{i}}}}}" for i in range(len(chunks)))
    calls.append(Call("summary", "Here are summaries of the parts of a document, in order.\n\n" + body
                      + "\n\nWrite one detailed summary of the whole document.",
                      {f"s{i}": ("var", f"part_{i}") for i in range(len(chunks))},
                      out if reduce_out is None else reduce_out, 1))
    per_call = f"{out} tokens per call" if reduce_out in (None, out) else f"{out} tokens per map, {reduce_out} reduce"
    return App("mapreduce", calls, ["summary"], f"map-reduce summary, {len(chunks)} pieces, {per_call}")


SYSTEM_PROMPT = """You are TripMate, a travel-planning assistant built for a travel agency's customers. Your job is to help each customer plan a trip that fits their budget, their interests and the time they have. Follow every rule below in every answer.

Role and tone. Be warm, brief and practical. Write for a traveller reading on a phone: short paragraphs, lists where they help, no long introductions. Never pretend to be a human agent; if a customer asks, say you are an automated assistant of the agency. Do not use slang or emoji. Address the customer directly.

What you know. You know geography, typical seasons and weather, how travellers usually get around in a city, common sights, neighbourhoods, local food, customs, etiquette, typical price levels, and the paperwork travellers often need. You do not know today's prices, schedules, opening hours, exchange rates or availability: say that such details must be checked with the agency or the provider before booking, and never invent a specific price, flight number, hotel name that you are unsure exists, or a timetable.

How to plan. First make sure you know the destination, the number of days, the month of travel, the budget level (shoestring, moderate or comfortable), who travels (alone, a couple, a family with children, a group) and the main interests (history, food, nature, art, nightlife, shopping, relaxation). If one of these is missing and it matters for the answer, make a reasonable assumption, state it in one line at the top, and go on; ask at most one short question at the end. Then give a day-by-day plan. For each day give a morning, an afternoon and an evening item, grouped by neighbourhood so that the traveller does not cross the city twice in one day. Mention how to get between the places (walk, metro, bus, taxi, train) and roughly how long it takes. Add one food suggestion per day that fits the budget. End with three practical tips for the destination (money, safety, local customs or transport passes).

Safety rules. Never encourage anything illegal or dangerous, such as entering closed areas, hiking alone in unsafe conditions, or driving after drinking. For health questions, give general advice only and suggest seeing a doctor or a travel clinic. For visas and entry rules, say which kind of document is usually needed and that the traveller must confirm the current rules with the official embassy or consulate. If a destination has an official travel warning that you know of, mention that warnings change and must be checked. Do not collect personal data: never ask for passport numbers, card numbers or addresses.

Accessibility and families. If a traveller mentions reduced mobility, prefer step-free routes, fewer long walks and places with lifts; say which sights are known to be hard to reach. For families with small children, include rest breaks, parks and early dinners, and avoid plans with more than two long visits per day.

Budget levels. Shoestring: hostels or guesthouses, street food and markets, free sights and walking tours, public transport only. Moderate: three-star hotels or apartments, casual restaurants, a few paid museums, public transport and the occasional taxi. Comfortable: four- or five-star hotels, well-known restaurants, guided tours, taxis or private transfers.

Examples of good answers. Customer: Three days in Lisbon in April, moderate budget, a couple who like food and history. TripMate: Day 1, Alfama: morning at the castle, afternoon walking down to the cathedral and the old streets, evening fado dinner in the neighbourhood. Day 2, Belem by tram 15: monastery and tower in the morning, the pastry shop nearby, afternoon at the riverside museum, evening in Bairro Alto. Day 3, a day trip by train to Sintra, back for dinner in the Baixa. Tips: buy a rechargeable transport card, wear shoes with grip for the steep cobbles, book fado dinners ahead.

Customer: A weekend in Vienna in December with two children. TripMate: Day 1, the old centre: the cathedral and a Christmas market in the morning, lunch break, the natural history museum in the afternoon, early dinner. Day 2, Schoenbrunn palace grounds and the zoo, rest at the hotel after lunch, an evening walk past the lights on the Ring. Tips: dress warmly, many shops close on Sunday, buy a day ticket for public transport.

Format. Start with the plan; no preamble. Keep each answer under three hundred words unless the customer asks for more detail. If the customer writes in another language, answer in that language."""

USER_QUERIES = [
    "Four days in Kyoto in November, moderate budget, I love temples and food.",
    "A weekend in Paris with my parents, one of them uses a wheelchair.",
    "Five days in Iceland in July on a shoestring budget, I like hiking.",
    "Three days in New York in December with two teenagers.",
    "A week in Morocco in spring for a couple who like markets and desert trips.",
    "Two days in Rome in August, comfortable budget, history and art.",
    "Three days in Barcelona for a group of friends who like nightlife and beaches.",
    "A long weekend in Prague in winter, shoestring budget, solo traveller.",
    "Six days in Peru including Machu Picchu, moderate budget.",
    "Three days in Singapore with small children, comfortable budget.",
    "A week in Scotland by train in September, I like castles and whisky.",
    "Two days in Istanbul in May for a couple interested in food.",
    "Four days in Mexico City, moderate budget, art and street food.",
    "Five days in Vietnam, from Hanoi to Ha Long Bay, shoestring budget.",
    "A weekend in Amsterdam in April, museums and cycling.",
    "Three days in Cape Town in January with a family, nature and beaches.",
]


def system_prompt(tokenizer, n_tokens: int) -> str:
    """The system prompt, cut to ``n_tokens`` tokens (repeated if asked for more than it has)."""
    ids = tokenizer.encode(SYSTEM_PROMPT)
    while len(ids) < n_tokens:
        ids = ids + tokenizer.encode("\n\n" + SYSTEM_PROMPT)
    return tokenizer.decode(ids[:n_tokens]).strip()


def shared_app(system: str, users: int, out: int) -> App:
    calls = [Call(f"answer_{u}", system + "\n\nCustomer:\n{{input:query}}\nTripMate:",
                  {"query": ("const", USER_QUERIES[u % len(USER_QUERIES)])}, out, 0, client=u)
             for u in range(users)]
    return App("shared", calls, [c.out for c in calls],
               f"{users} users sharing a system prompt, {out} tokens per answer", clients=users)


TASK = ("A command-line to-do list manager in Python: add, list, complete and delete tasks, "
        "saved in a JSON file, with due dates and priorities.")
FILES = ["models.py", "storage.py", "cli.py", "utils.py", "reports.py", "config.py", "search.py", "export.py"]


def multiagent_app(files: int, rounds: int, out: int) -> App:
    names = FILES[:files]
    calls = [Call("design", "You are the software architect of a small team. The task:\n{{input:task}}\n"
                  f"The project has these files: {', '.join(names)}. For each file, list the classes and "
                  "functions it must define, with their signatures and one line on what each does.",
                  {"task": ("const", TASK)}, out, 0)]
    coder = ("You are a Python programmer on a small team. The architect's design of the project:\n"
             "{{input:design}}\n\n")
    for i, f in enumerate(names):
        calls.append(Call(f"code_{i}_r0", coder + f"Write the complete code of the file {f}, following the design. "
                          "Answer with the code only.", {"design": ("var", "design")}, out, 1))
    stage = 2
    for r in range(rounds):
        project = "".join(f"# file {f}\n{{{{input:code{j}}}}}\n\n" for j, f in enumerate(names))
        for i, f in enumerate(names):
            calls.append(Call(f"review_{i}_r{r}",
                              "You are a code reviewer on a small team. The architect's design:\n{{input:design}}\n\n"
                              "The current code of the project:\n" + project
                              + f"Review the file {f}: list its bugs and what is missing, as short bullet points.",
                              {"design": ("var", "design"),
                               **{f"code{j}": ("var", f"code_{j}_r{r}") for j in range(len(names))}}, out, stage))
        for i, f in enumerate(names):
            calls.append(Call(f"code_{i}_r{r + 1}",
                              coder + f"Your code of the file {f}:\n{{{{input:code}}}}\n\n"
                              "The reviewer's comments:\n{{input:review}}\n\n"
                              f"Rewrite {f} addressing every comment. Answer with the code only.",
                              {"design": ("var", "design"), "code": ("var", f"code_{i}_r{r}"),
                               "review": ("var", f"review_{i}_r{r}")}, out, stage + 1))
        stage += 2
    return App("multiagent", calls, [f"code_{i}_r{rounds}" for i in range(len(names))],
               f"multi-agent review loop, {files} files, {rounds} rounds, {out} tokens per call")


def build_apps(names: Sequence[str], sizes: Sizes, tokenizer) -> List[App]:
    out = []
    chunks = None
    for n in names:
        if n in ("chain", "mapreduce") and chunks is None:
            chunks = chunk_text(tokenizer, load_document(), sizes.chunks, sizes.chunk_tokens)
        if n == "chain":
            out.append(chain_app(chunks, sizes.output_tokens))
        elif n == "mapreduce":
            out.append(mapreduce_app(chunks, sizes.output_tokens))
        elif n == "shared":
            out.append(shared_app(system_prompt(tokenizer, sizes.system_tokens), sizes.users, sizes.output_tokens))
        elif n == "multiagent":
            out.append(multiagent_app(sizes.files, sizes.rounds, sizes.output_tokens))
    return out


def variants_for(app: App) -> Tuple[List[str], Dict[str, str]]:
    """The variants run for ``app``, and ``{variant: same as}`` for the ones not run twice."""
    if app.name == "shared":
        return ["a-par", "a-par-nocache", "b", "b-nocache"], {}
    if all(len(s) == 1 for s in app.stages()):
        return ["a-seq", "b"], {"a-par": "a-seq"}
    return ["a-seq", "a-par", "b"], {}


# =========================================================================== the network
class DelayedTransport(httpx.AsyncBaseTransport):
    """An httpx async transport that sleeps ``delay/2`` before sending each request
    and ``delay/2`` after its answer arrived (the whole body read), ``delay``
    drawn uniformly from ``[lo, hi]`` seconds by ``rng`` in the order requests
    are made.  Counts requests."""

    def __init__(self, inner, rng: random.Random, lo: float, hi: float):
        self.inner = inner
        self.rng = rng
        self.lo, self.hi = lo, hi
        self.requests = 0
        self.delay_s = 0.0

    async def handle_async_request(self, request):
        d = self.rng.uniform(self.lo, self.hi) if self.hi > 0 else 0.0
        self.requests += 1
        self.delay_s += d
        await asyncio.sleep(d / 2)
        resp = await self.inner.handle_async_request(request)
        await resp.aread()
        await asyncio.sleep(d / 2)
        return resp

    async def aclose(self) -> None:
        await self.inner.aclose()


def delayed_transport(rng: random.Random, lo: float, hi: float) -> DelayedTransport:
    return DelayedTransport(httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=200,
                                                                         max_keepalive_connections=200)), rng, lo, hi)


class ServerError(RuntimeError):
    """The gateway answered with an error: the request and the answer, for the report."""


def _check(resp, what: str) -> Dict[str, Any]:
    if resp.status_code >= 400:
        body = resp.text[:1500]
        req = resp.request
        sent = (req.content or b"")[:800].decode("utf-8", "replace")
        raise ServerError(f"{what}: {req.method} {req.url.path}{'?' + req.url.query.decode() if req.url.query else ''}"
                          f" -> HTTP {resp.status_code}: {body}\n  request body: {sent}")
    return resp.json()


# =========================================================================== the two ways of running an app
@dataclass
class Outcome:
    """What one run of an app produced (the measured numbers are added by :func:`measure`)."""

    values: Dict[str, str] = field(default_factory=dict)
    client_s: Dict[int, float] = field(default_factory=dict)   # per client: first request to last answer
    prompt_tokens: int = 0
    output_tokens: int = 0
    calls_at_max: int = 0     # request-centric: calls that ended at max_tokens (finish_reason "length")
    calls: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)


async def run_request_centric(client, app: App, parallel: bool) -> Outcome:
    """``POST /v1/chat/completions`` per call with the rendered prompt: in program
    order, each awaited (``parallel=False``), or each stage's calls together."""
    oc = Outcome()
    t0 = time.monotonic()

    async def one(c: Call) -> None:
        values = {k: (v if kind == "const" else oc.values[v]) for k, (kind, v) in c.inputs.items()}
        body = {"model": MODEL, "messages": [{"role": "user", "content": render(c.text, values)}],
                "max_tokens": c.max_tokens, "temperature": 0}
        r = _check(await client.post("/v1/chat/completions", json=body), f"chat completion for {c.out}")
        ch = r["choices"][0]
        oc.values[c.out] = ch["message"].get("content") or ""
        oc.prompt_tokens += r["usage"]["prompt_tokens"]
        oc.output_tokens += r["usage"]["completion_tokens"]
        oc.calls_at_max += ch.get("finish_reason") == "length"
        oc.calls += 1
        oc.client_s[c.client] = max(oc.client_s.get(c.client, 0.0), time.monotonic() - t0)

    for stage in app.stages():
        if parallel:
            await asyncio.gather(*(one(c) for c in stage))
        else:
            for c in stage:
                await one(c)
    return oc


async def run_semantic(url: str, transport: httpx.AsyncBaseTransport, app: App) -> Outcome:
    """The app through Semantic Variables with the SDK's :class:`AsyncClient`
    (over ``transport``, the delayed network): per client, a session; its first
    stage submitted at once while the variables the later stages write are
    declared; then every later call at once; then the final variables fetched
    (their producers marked ``criterion: latency`` at submit)."""
    from interlace.sdk import AsyncClient, Output

    oc = Outcome()
    oc.extra["sessions"] = []
    oc.extra["calls"] = {}  # the variable a call writes -> (session id, its token, the call's id)
    finals = set(app.finals)
    t0 = time.monotonic()

    async def session(client, cid: int) -> None:
        calls = [c for c in app.calls if c.client == cid]
        s = await client.session()
        oc.extra["sessions"].append((s.id, s.token))
        first = min(c.stage for c in calls)
        var: Dict[str, Any] = {}

        async def submit(c: Call) -> None:
            out: Dict[str, Any] = Output(max_tokens=c.max_tokens, temperature=0,
                                         criterion="latency" if c.out in finals else None).to_json(
                var[c.out].id if c.out in var else None)
            inputs = {k: (v if kind == "const" else var[v]) for k, (kind, v) in c.inputs.items()}
            call = await s.submit(c.text + "{{output:out}}", inputs=inputs, outputs={"out": out}, chat=True)
            var.setdefault(c.out, call.output)
            oc.extra["calls"][c.out] = (s.id, s.token, call.id)

        async def declare(name: str) -> None:
            var[name] = await s.variable(name=name)

        later = [c for c in calls if c.stage != first]
        await asyncio.gather(*(submit(c) for c in calls if c.stage == first), *(declare(c.out) for c in later))
        await asyncio.gather(*(submit(c) for c in later))

        async def fetch(name: str) -> None:
            oc.values[name] = await var[name].aget(criterion="latency")

        await asyncio.gather(*(fetch(c.out) for c in calls if c.out in finals))
        oc.client_s[cid] = time.monotonic() - t0

    async with AsyncClient(url, model=MODEL, timeout=900.0, transport=transport) as client:
        await asyncio.gather(*(session(client, u) for u in range(app.clients)))
    return oc


async def semantic_usage(url: str, sessions: Sequence[Tuple[str, str]], delete: bool = True) -> Dict[str, Any]:
    """The sessions' usage summed (no network delay: after the measurement), then the sessions deleted."""
    tot: Dict[str, Any] = {}
    calls: Dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as c:
        for sid, token in sessions:
            auth = {"Authorization": f"Bearer {token}"}
            info = _check(await c.get(f"/v1/sessions/{sid}", headers=auth), "session info")
            for k, v in (info.get("usage") or {}).items():
                if isinstance(v, (int, float)):
                    tot[k] = tot.get(k, 0) + v
            for k, v in (info.get("calls") or {}).items():
                calls[k] = calls.get(k, 0) + int(v)
            if delete:
                _check(await c.delete(f"/v1/sessions/{sid}", headers=auth), "delete session")
    tot["calls"] = calls
    return tot


# =========================================================================== the gateway
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def release_memory() -> None:
    """Collect what is unreachable now (a stopped gateway's engine: see :class:`Gateway`)
    and give the C heap's free pages back to the system.  glibc keeps the
    pages an engine's smaller buffers freed (about 480 MB of the embedded
    model's, measured) for the next allocation: bounded, but they would show
    in every later variant's RSS; ``malloc_trim`` returns them (glibc only:
    elsewhere the collection alone)."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None
    if trim is not None:
        trim(0)


class Gateway:
    """The gateway app on loopback, uvicorn in a thread (``with Gateway(cfg) as gw``);
    ``wrap`` wraps the ASGI app uvicorn serves.

    Leaving the block stops the server (its lifespan closes the engines),
    drops the app and calls :func:`release_memory` (a full garbage
    collection), so one variant's engine is gone before the next one's
    loads.  Why the collection: a stopped engine, its model (540 MB of
    float32 weights) and its KV cache are reachable only through reference
    cycles (the engine's scheduler holds its bound methods, the gateway's
    metrics collector holds the engine, the loading thread's frames hold the
    model), which reference counting never frees; CPython collects them in
    its oldest generation only when the objects that survived since the last
    full pass reach a quarter of all long-lived ones, which with torch
    loaded is rare.  Without it, ``bench apps --quick`` grew about 1.3 GB
    per variant until the OOM killer ended it.  Callers keep no reference
    to ``engine`` past the block.
    """

    def __init__(self, config: Dict[str, Any], wrap: Optional[Callable[[Any], Any]] = None):
        import uvicorn

        from interlace.gateway.app import create_app
        from interlace.gateway.config import parse_config

        self.app = create_app(parse_config(config, "<bench apps>"))
        self.served = wrap(self.app) if wrap is not None else self.app  # e.g. a simulated network
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.served, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="bench-apps-gateway")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.state.gateway.models[MODEL].engine

    def __enter__(self) -> "Gateway":
        self.thread.start()
        deadline = time.time() + 600
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=120)
        stuck = self.thread.is_alive()
        self.app = self.served = self.server = None  # the engine hangs off the app
        release_memory()
        if stuck and exc[0] is None:
            raise RuntimeError("the gateway did not stop within 120 s (its engine is not released)")


def gateway_config(prefix_caching: bool, kv_cache_tokens: int, max_batched_tokens: int, *,
                   weights: Optional[str] = None, threads: int = 0,
                   capacity: Optional[Capacity] = None) -> Dict[str, Any]:
    """The gateway's config: the embedded model, float32 compute; ``weights``
    None keeps the engine's default (dense float32), ``threads`` 0 the
    gateway's (the usable cores, adapted while running), ``capacity`` None the
    engine's default regulation."""
    model: Dict[str, Any] = {"path": "embedded", "dtype": "float32", "kv_cache_tokens": kv_cache_tokens,
                             "max_batched_tokens": max_batched_tokens, "prefix_caching": prefix_caching}
    if weights is not None:
        model["weights"] = weights
    cfg: Dict[str, Any] = {"plugins": {"entrypoints": False}, "models": {MODEL: model}}
    engine: Dict[str, Any] = {}
    if threads:
        engine["threads"] = threads
    if capacity is not None:
        engine["capacity"] = capacity.config()
    if engine:
        cfg["engine"] = engine
    return cfg


async def _sample_blocks(engine, peak: List[int], stop: asyncio.Event, every_s: float = 0.005,
                         held: Optional[List[int]] = None) -> None:
    """``peak[0]``: the most KV blocks in use, sampled every ``every_s``; with
    ``held``, ``held[0]`` the most requests the capacity cap held back at one
    step (``load_stats()["capacity_held"]``, read every tenth sample; an
    engine without it counts 0)."""
    n = 0
    while not stop.is_set():
        peak[0] = max(peak[0], engine.blocks.num_used)
        if held is not None and n % 10 == 0:
            held[0] = max(held[0], int(engine.load_stats().get("capacity_held", 0)))
        n += 1
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    peak[0] = max(peak[0], engine.blocks.num_used)


async def _warm_up(url: str) -> None:
    """One short completion before timing (a fresh engine's first steps are slow),
    and a session created and deleted where the server has them."""
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as c:
        _check(await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "Hi"}]}),
               "warm-up")
        r = await c.post("/v1/sessions", json={})
        if r.status_code == 201:
            s = r.json()
            await c.delete(f"/v1/sessions/{s['id']}", headers={"Authorization": f"Bearer {s['token']}"})


def _wait_idle(engine, timeout_s: float = 10.0) -> int:
    deadline = time.time() + timeout_s
    while engine.blocks.num_used and time.time() < deadline:
        time.sleep(0.05)
    return engine.blocks.num_used


def measure(app: App, variant: str, *, seed: int, repeat: int, delay: Tuple[float, float], kv_cache_tokens: int,
            max_batched_tokens: int, weights: Optional[str] = None, threads: int = 0,
            capacity: Optional[Capacity] = None) -> Dict[str, Any]:
    """One run of ``app`` as ``variant`` on a fresh gateway (:func:`gateway_config`'s
    settings): the table's numbers."""
    cfg = gateway_config(not variant.endswith("-nocache"), kv_cache_tokens, max_batched_tokens, weights=weights,
                         threads=threads, capacity=capacity)
    kind = variant.removesuffix("-nocache")
    with Gateway(cfg) as gw:  # (no local holds the engine past the block: it is collected there)

        async def go() -> Tuple[Outcome, float, int, int, int, Dict[str, Any]]:
            eng = gw.engine
            await _warm_up(gw.url)
            await asyncio.sleep(0.05)
            rng = random.Random(f"bench-apps:{seed}:{app.name}:{repeat}")
            transport = delayed_transport(rng, *delay)
            peak, held = [0], [0]
            stop = asyncio.Event()
            before = dict(eng.stats)
            held_steps0 = int(eng.load_stats().get("capacity_held_steps", 0))
            sampler = asyncio.ensure_future(_sample_blocks(eng, peak, stop, held=held))
            t0 = time.monotonic()
            try:
                if kind == "b":
                    oc = await run_semantic(gw.url, transport, app)
                else:
                    async with httpx.AsyncClient(base_url=gw.url, transport=transport, timeout=900.0) as client:
                        oc = await run_request_centric(client, app, parallel=(kind == "a-par"))
                wall = time.monotonic() - t0
            finally:
                stop.set()
                await sampler
            held_steps = int(eng.load_stats().get("capacity_held_steps", 0)) - held_steps0
            prefill = eng.stats["prefill_tokens"] - before["prefill_tokens"]
            decode = eng.stats["decode_tokens"] - before["decode_tokens"]
            usage: Dict[str, Any] = {}
            if kind == "b":
                usage = await semantic_usage(gw.url, oc.extra["sessions"])
                oc.prompt_tokens = int(usage.get("prompt_tokens", 0))
                oc.output_tokens = int(usage.get("completion_tokens", 0))
                oc.calls = sum(usage.get("calls", {}).values()) or len(app.calls)
            return oc, wall, prefill, decode, peak[0], {"requests": transport.requests, "usage": usage,
                                                         "delay_s": transport.delay_s, "held": held[0],
                                                         "held_steps": held_steps}

        oc, wall, prefill, decode, peak, net = asyncio.run(go())
        leaked = _wait_idle(gw.engine)
    row = {"app": app.name, "variant": variant, "capacity": capacity.label if capacity is not None else "default",
           "repeat": repeat, "e2e_s": wall, "prefill_tokens": prefill,
           "decode_tokens": decode, "peak_blocks": peak, "output_tokens": oc.output_tokens,
           "prompt_tokens": oc.prompt_tokens, "calls": oc.calls,
           "calls_at_max": oc.calls_at_max if kind != "b" else None,
           "http_requests": net["requests"], "network_s_sum": net["delay_s"],
           "client_mean_s": statistics.fmean(oc.client_s.values()) if oc.client_s else None,
           "finals": {k: oc.values.get(k) for k in app.finals}, "leaked_blocks": leaked,
           "held_max": net["held"], "held_steps": net["held_steps"]}
    if kind == "b":
        row["usage"] = net["usage"]
    return row


# =========================================================================== running and reporting
def _median(xs: Sequence[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per variant: medians over repeats (e2e, prefill, peak blocks, tokens), and the runs."""
    out: Dict[str, Dict[str, Any]] = {}
    for v in sorted({r["variant"] for r in rows}, key=VARIANT_ORDER.index):
        rs = [r for r in rows if r["variant"] == v and "error" not in r]
        errs = [r["error"] for r in rows if r["variant"] == v and "error" in r]
        s: Dict[str, Any] = {"runs": len(rs), "errors": errs}
        for k in ("e2e_s", "prefill_tokens", "peak_blocks", "output_tokens", "prompt_tokens", "http_requests",
                  "client_mean_s", "calls"):
            s[k] = _median([r[k] for r in rs])
        s["e2e_all"] = [round(r["e2e_s"], 3) for r in rs]
        s["held_max"] = max((r.get("held_max", 0) for r in rs), default=0)
        s["held_steps"] = _median([r.get("held_steps", 0) for r in rs])
        at_max = [r["calls_at_max"] for r in rs]
        s["calls_at_max"] = _median(at_max) if rs and at_max[0] is not None else None
        s["leaked_blocks"] = max((r["leaked_blocks"] for r in rs), default=0)
        if rs and "usage" in rs[0]:
            s["forked_tokens"] = _median([r["usage"].get("forked_tokens") for r in rs])
            s["filled_tokens"] = _median([r["usage"].get("filled_tokens") for r in rs])
        out[v] = s
    return out


def fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and digits == 0:
        return f"{x:.0f}"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


COLUMNS = ("variant", "e2e s", "x vs b", "prefilled tok", "x vs b", "peak KV blocks", "x vs b", "output tok",
           "prompt tok", "HTTP req", "runs")


def table(app: App, summ: Dict[str, Dict[str, Any]], same: Dict[str, str], setting: Optional[str] = None
          ) -> List[str]:
    """The markdown table of one app (under one capacity ``setting``): each
    variant's medians and its ratios to ``b``'s (of the same setting)."""
    b = summ.get("b", {})
    under = f"; capacity {setting}" if setting is not None else ""
    lines = [f"**{app.name}**: {app.about}; {len(app.calls)} calls in {len(app.stages())} stages{under}",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for v in VARIANT_ORDER:
        if v in same:
            lines.append(f"| {v} (= {same[v]}) |" + " |" * (len(COLUMNS) - 1))
            continue
        if v not in summ:
            continue
        s = summ[v]
        if not s["runs"]:
            why = s["errors"][0][:200] if s["errors"] else "?"
            lines.append(f"| {v} | failed: {why} |" + " |" * (len(COLUMNS) - 2))
            continue
        e2e = s["e2e_s"]
        lines.append("| " + " | ".join([
            v, fmt(e2e, 2), fmt(_ratio(e2e, b.get("e2e_s")), 2),
            fmt(s["prefill_tokens"], 0), fmt(_ratio(s["prefill_tokens"], b.get("prefill_tokens")), 2),
            fmt(s["peak_blocks"], 0), fmt(_ratio(s["peak_blocks"], b.get("peak_blocks")), 2),
            fmt(s["output_tokens"], 0), fmt(s["prompt_tokens"], 0), fmt(s["http_requests"], 0), str(s["runs"])]) + " |")
    return lines


CAPACITY_COLUMNS = ("variant", "e2e s off", "e2e s on", "on / off", "prefilled tok off", "prefilled tok on",
                    "peak KV blocks off", "peak KV blocks on", "held at most (on)", "steps holding (on)")


def capacity_table(app: App, by_setting: Dict[str, Dict[str, Dict[str, Any]]]) -> List[str]:
    """With both settings: each variant's medians off and on, and e2e on / off
    (> 1: regulation made it slower); "held at most" is the most requests
    the cap held back at one step (sampled; 0: it never bound), "steps
    holding" the engine's steps that held some back (median)."""
    off, on = by_setting.get("off", {}), by_setting.get("on", {})
    lines = [f"**{app.name}**: capacity regulation on against off (medians)",
             "| " + " | ".join(CAPACITY_COLUMNS) + " |", "|" + "---|" * len(CAPACITY_COLUMNS)]
    for v in VARIANT_ORDER:
        a, b = off.get(v), on.get(v)
        if not (a and b and a["runs"] and b["runs"]):
            continue
        lines.append("| " + " | ".join([
            v, fmt(a["e2e_s"], 2), fmt(b["e2e_s"], 2), fmt(_ratio(b["e2e_s"], a["e2e_s"]), 2),
            fmt(a["prefill_tokens"], 0), fmt(b["prefill_tokens"], 0), fmt(a["peak_blocks"], 0),
            fmt(b["peak_blocks"], 0), str(b.get("held_max", 0)), fmt(b.get("held_steps"), 0)]) + " |")
    return lines


#: The issue's targets: (app, metric, factor, baselines it is checked against).
TARGETS = [("mapreduce", "e2e_s", 2.0, ("a-seq", "a-par")), ("chain", "e2e_s", 1.3, ("a-seq",)),
           ("multiagent", "e2e_s", 3.0, ("a-seq", "a-par")),
           ("shared", "prefill_tokens", 5.0, ("a-par-nocache", "a-par"))]


def target_lines(summaries: Dict[str, Dict[str, Dict[str, Any]]]) -> List[str]:
    out = []
    for app, key, factor, bases in TARGETS:
        if app not in summaries:
            continue
        s = summaries[app]
        b = s.get("b", {}).get(key)
        what = "faster (e2e)" if key == "e2e_s" else "fewer prefilled tokens"
        for base in bases:
            a = s.get(base, {}).get(key)
            r = _ratio(a, b)
            verdict = "n/a" if r is None else ("met" if r >= factor else "NOT met")
            out.append(f"target {app}: b >= {factor:g}x {what} than {base}: {fmt(r, 2)}x -> {verdict}")
    return out


def check_lines(app: App, summ: Dict[str, Dict[str, Any]], rows: List[Dict[str, Any]]) -> List[str]:
    """Fairness checks: same output tokens, same final texts, calls at max_tokens, leaks."""
    out = []
    toks = {v: s["output_tokens"] for v, s in summ.items() if s["runs"]}
    if len(set(toks.values())) > 1:
        out.append(f"{app.name}: output tokens differ between variants: {toks}")
    ref = next((r for r in rows if r["variant"].startswith("a-") and "error" not in r), None)
    if ref is not None:
        for r in rows:
            if "error" not in r and r["variant"].startswith("b") and r["repeat"] == ref["repeat"]:
                same = sum(r["finals"].get(k) == ref["finals"].get(k) for k in app.finals)
                out.append(f"{app.name}: {r['variant']} final texts equal to {ref['variant']}'s: "
                           f"{same}/{len(app.finals)}")
                break
    for v, s in summ.items():
        if s.get("calls_at_max") is not None and s["calls"] and s["calls_at_max"] < s["calls"]:
            out.append(f"{app.name}: {v}: {s['calls'] - s['calls_at_max']:.0f} of {s['calls']:.0f} calls ended before "
                       "max_tokens (the model stopped)")
        if s.get("leaked_blocks"):
            out.append(f"{app.name}: {v}: {s['leaked_blocks']} KV blocks still in use after the run "
                       "(sessions deleted, 10 s later)")
        if s.get("forked_tokens") is not None:
            out.append(f"{app.name}: {v}: server usage filled_tokens {fmt(s.get('filled_tokens'), 0)}, "
                       f"forked_tokens {fmt(s.get('forked_tokens'), 0)}")
        if app.name == "shared" and s.get("client_mean_s") is not None:
            out.append(f"{app.name}: {v}: mean per-user latency {s['client_mean_s']:.2f} s")
    return out


def plot(apps: List[App], summaries: Dict[str, Dict[str, Dict[str, Dict[str, Any]]]], title: str,
         path: str) -> None:
    """Bars per app and variant (``summaries[app][setting][variant]``); with
    two capacity settings, ``on`` hatched beside ``off``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("e2e_s", "end-to-end latency (s)"), ("prefill_tokens", "tokens prefilled"),
              ("peak_blocks", "peak KV blocks in use")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    names = [a.name for a in apps]
    settings = [c for c in ("off", "on", "default") if any(c in summaries[n] for n in names)]
    present = [(v, c) for v in VARIANT_ORDER for c in settings
               if any(summaries[n].get(c, {}).get(v, {}).get("runs") for n in names)]
    width = 0.8 / max(1, len(present))
    colors = {"a-seq": "tab:red", "a-par": "tab:orange", "a-par-nocache": "tab:brown", "b": "tab:blue",
              "b-nocache": "tab:cyan"}
    for ax, (key, label) in zip(axes, panels):
        for j, (v, c) in enumerate(present):
            xs, ys = [], []
            for i, n in enumerate(names):
                s = summaries[n].get(c, {}).get(v)
                if s and s["runs"] and s.get(key) is not None:
                    xs.append(i + (j - (len(present) - 1) / 2) * width)
                    ys.append(s[key])
            ax.bar(xs, ys, width, label=v if len(settings) == 1 else f"{v}, capacity {c}", color=colors.get(v),
                   hatch="//" if c == "on" and len(settings) > 1 else None, edgecolor="white")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_apps(text: Optional[str]) -> List[str]:
    names = [a.strip() for a in (text or ",".join(APPS)).split(",") if a.strip()]
    bad = [a for a in names if a not in APPS]
    if bad or not names:
        raise BenchError(f"--apps: unknown application {bad[0] if bad else text!r}; choose from {', '.join(APPS)}")
    return names


def parse_delay(text: str) -> Tuple[float, float]:
    """``--delay-ms LO,HI`` in seconds (the simulator's parser, its error as this benchmark's)."""
    try:
        return sim_parse_delay(text)
    except AppSpecError as e:
        raise BenchError(str(e)) from None


def parse_variants(text: Optional[str]) -> Optional[List[str]]:
    """``--variants``: None (every variant an app has) or the names given."""
    if text is None:
        return None
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANT_ORDER]
    if bad or not names:
        raise BenchError(f"--variants: unknown variant {bad[0] if bad else text!r}; choose from "
                         f"{', '.join(VARIANT_ORDER)}")
    return names


def add_engine_arguments(ap: argparse.ArgumentParser, capacity_default: str,
                         latency_cap_default: int = DEFAULT_LATENCY_CAP) -> None:
    """The engine's options, shared with the mixed run (bench/mixed.py)."""
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--weights", default="as-shipped",
                    help="how the weight matmuls are stored (the model's weights option; default as-shipped: the "
                         "GGUF's Q4_1 tensors, the fastest on a CPU; float32: dense, the reference path)")
    ap.add_argument("--threads", type=int, default=0,
                    help="most torch threads of the engine (engine.threads; default 0: one per usable core, as many "
                         "as are free while it runs)")
    ap.add_argument("--capacity", default=capacity_default, choices=list(CAPACITY_MODES),
                    help="capacity regulation (engine.capacity): off, on, or both (every run once per setting, each "
                         f"on a fresh gateway; default {capacity_default})")
    ap.add_argument("--latency-cap", type=int, default=latency_cap_default,
                    help="with regulation on: the engine's tokens while latency-critical work runs "
                         f"(default {latency_cap_default})")
    ap.add_argument("--throughput-cap", type=int, default=None,
                    help="with regulation on: the engine's tokens otherwise (default: no cap but memory)")


def engine_options(args: argparse.Namespace) -> Tuple[List[Capacity], Dict[str, Any]]:
    """The capacity settings to run and :func:`gateway_config`'s other keyword arguments."""
    settings = capacity_settings(args.capacity, args.latency_cap, args.throughput_cap)
    for name in ("kv_cache_tokens", "max_batched_tokens"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.threads < 0:
        raise BenchError(f"--threads must be 0 (the gateway's default) or positive, got {args.threads}")
    return settings, {"weights": parse_weights(args.weights), "threads": args.threads}


def engine_header(args: argparse.Namespace, settings: Sequence[Capacity]) -> str:
    weights = ("as shipped (the GGUF's Q4_1 tensors)" if args.weights == "as-shipped"
               else f"weights {args.weights}")
    threads = f"at most {args.threads} threads" if args.threads else "threads: the usable cores, adapted"
    return (f"native engine, embedded SmolLM2-135M-Instruct, {weights}, float32 compute, {threads}; KV cache "
            f"{args.kv_cache_tokens} tokens, {args.max_batched_tokens} tokens/step; "
            + "; ".join(f"{c.label}: {c.describe()}" for c in settings))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="interlace bench apps", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixed", action="store_true",
                    help="the mixed run instead (latency-critical chats beside a map-reduce task group, "
                         "bench/mixed.py; its own options: --mixed --help)")
    ap.add_argument("--apps", help=f"comma-separated, default all: {','.join(APPS)}")
    ap.add_argument("--variants", help=f"comma-separated, default every one an app has: {','.join(VARIANT_ORDER)}")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run): " + ", ".join(
        f"{k} {v}" for k, v in QUICK.__dict__.items()))
    ap.add_argument("--repeats", type=int, default=1, help="runs of every variant (medians reported; the order of "
                                                           "the variants, and of the capacity settings, rotates "
                                                           "from repeat to repeat)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the network delays")
    ap.add_argument("--delay-ms", default="200,300", help="simulated network delay per HTTP request, uniform LO,HI ms")
    for k in Sizes.__dataclass_fields__:
        ap.add_argument("--" + k.replace("_", "-"), type=int, help=f"default {getattr(FULL, k)} ({getattr(QUICK, k)} "
                                                                   "with --quick)")
    add_engine_arguments(ap, capacity_default="both")
    ap.add_argument("--out-png", help="save the plot here")
    ap.add_argument("--json", metavar="PATH", help="write every run and the summaries as JSON")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--mixed" in argv:
        from .mixed import main as mixed_main

        return mixed_main([a for a in argv if a != "--mixed"])
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except BenchError as e:
        print(f"interlace bench apps: error: {e}", file=sys.stderr)
        return 2


def run_order(variants: Sequence[str], settings: Sequence[Capacity], rep: int) -> List[Tuple[str, Capacity]]:
    """The (variant, capacity setting) runs of repeat ``rep``: the variants
    rotated by ``rep``, each run once per setting, the settings rotated too
    (off first in even repeats, on first in odd ones), so no variant or
    setting always runs first on a machine that drifts."""
    order = list(variants[rep % len(variants):]) + list(variants[:rep % len(variants)])
    sets = list(settings[rep % len(settings):]) + list(settings[:rep % len(settings)])
    return [(v, c) for v in order for c in sets]


def _main(args: argparse.Namespace) -> int:
    import torch

    names = parse_apps(args.apps)
    chosen = parse_variants(args.variants)
    delay = parse_delay(args.delay_ms)
    if args.repeats < 1:
        raise BenchError(f"--repeats must be positive, got {args.repeats}")
    settings, engine_kw = engine_options(args)
    base = QUICK if args.quick else FULL
    sizes = Sizes(**{k: (getattr(args, k) if getattr(args, k) is not None else getattr(base, k))
                     for k in Sizes.__dataclass_fields__})
    for k, v in sizes.__dict__.items():
        if v < 1:
            raise BenchError(f"--{k.replace('_', '-')} must be positive, got {v}")
    if sizes.users > len(USER_QUERIES):
        raise BenchError(f"--users: at most {len(USER_QUERIES)}")
    if sizes.files > len(FILES):
        raise BenchError(f"--files: at most {len(FILES)}")

    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.native.loader import load_config
    from interlace.engine_ext.tokenizer import Tokenizer

    d = embedded_model_dir()
    tok = Tokenizer(d, load_config(d)[0])
    apps = build_apps(names, sizes, tok)
    mach = machine_description(torch=torch.__version__, engine_threads=args.threads or "adapted")
    header = (f"{engine_header(args, settings)}; network {delay[0] * 1000:g}-{delay[1] * 1000:g} ms per HTTP "
              f"request (seed {args.seed}); sizes {sizes.__dict__}; {args.repeats} repeat(s), medians")
    rows: List[Dict[str, Any]] = []
    summaries: Dict[str, Dict[str, Dict[str, Dict[str, Any]]]] = {}
    sames: Dict[str, Dict[str, str]] = {}
    failed = False
    for app in apps:
        variants, same = variants_for(app)
        if chosen is not None:
            variants = [v for v in variants if v in chosen]
            same = {v: w for v, w in same.items() if v in chosen}
        sames[app.name] = same
        if not variants:
            print(f"  {app.name}: none of --variants {args.variants} applies "
                  f"(it has {', '.join(variants_for(app)[0])})", file=sys.stderr)
            continue
        app_rows = []
        for rep in range(args.repeats):
            for v, cap in run_order(variants, settings, rep):
                t = time.perf_counter()
                tag = f"{app.name} {v} capacity {cap.label} #{rep}"
                try:
                    row = measure(app, v, seed=args.seed, repeat=rep, delay=delay, capacity=cap,
                                  kv_cache_tokens=args.kv_cache_tokens, max_batched_tokens=args.max_batched_tokens,
                                  **engine_kw)
                    print(f"  {tag}: e2e {row['e2e_s']:.2f} s, prefilled {row['prefill_tokens']}, "
                          f"peak {row['peak_blocks']} blocks, {row['output_tokens']} output tokens, held at most "
                          f"{row['held_max']} ({time.perf_counter() - t:.1f} s with start-up)", file=sys.stderr)
                except Exception as e:  # noqa: BLE001 -- a failed variant is reported, the others still run
                    failed = True
                    row = {"app": app.name, "variant": v, "capacity": cap.label, "repeat": rep,
                           "error": f"{type(e).__name__}: {e}"}
                    print(f"  {tag}: FAILED: {row['error']}", file=sys.stderr)
                app_rows.append(row)
        rows += app_rows
        summaries[app.name] = {c.label: summarize([r for r in app_rows if r["capacity"] == c.label])
                               for c in settings}
    apps = [a for a in apps if a.name in summaries]

    print(f"\n{header}\nmachine: {describe_machine(mach)}\n")
    for app in apps:
        for c in settings:
            summ = summaries[app.name][c.label]
            for ln in table(app, summ, sames[app.name], c.label):
                print(ln)
            for ln in check_lines(app, summ, [r for r in rows if r["app"] == app.name and r["capacity"] == c.label]):
                print(f"check ({c.label}): {ln}")
            print()
        if len(settings) > 1:
            for ln in capacity_table(app, summaries[app.name]):
                print(ln)
            print()
    for c in settings:
        for ln in target_lines({a: s[c.label] for a, s in summaries.items()}):
            print(f"capacity {c.label}: {ln}")
    if args.out_png and apps:
        plot(apps, summaries, f"{header}; {describe_machine(mach)}", args.out_png)
        print(f"plot saved to {args.out_png}")
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "machine": mach, "sizes": sizes.__dict__,
                                               "delay_s": delay, "seed": args.seed, "same_as": sames,
                                               "capacity": {c.label: c.config() for c in settings},
                                               "engine": {**engine_kw, "kv_cache_tokens": args.kv_cache_tokens,
                                                          "max_batched_tokens": args.max_batched_tokens},
                                               "summaries": summaries, "runs": rows}, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
