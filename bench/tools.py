"""Partial tool execution, measured: Conveyor's six workloads with it off and on.

    interlace bench tools [--pairs 5] [--delay-s 0.7] [--plot docs/bench_tools.png] [--json out.json]
                          [--only codegen search ...] [--quick]
    interlace bench tools --report out.json [--plot ...]      # print a saved (or interrupted) run

Conveyor (Xu et al., 2024) starts a tool on the partially decoded call so
that tool time overlaps decoding.  Its six workloads, adapted to this gateway
and a CPU:

* CodeGen     a numpy + matplotlib (Agg) script in a ```python fence; the
              ``python`` tool runs each statement as soon as it is complete.
* Search      three ``search`` calls (Hello World in Python, C++, Java), hermes
              format, over a small generated corpus with an emulated network
              delay (``--delay-s``); the search starts on the completed ``query``.
* Planning    an LLMCompiler plan: two independent searches, a calculator
              step, a format step, ``join()``; each step starts when its line
              is complete (ON) or all at the plan's end (OFF).
* Validation  a ``local_news`` call (a benchmark tool registered through the
              plugin hook) whose first field, ``location``, violates the
              schema: with partial execution decoding of the call is aborted
              at once; without, the error shows after the whole call.
              Measured: time until the error is known (as in the paper).
* Database    a ``sqlite`` query over a small generated database.
* Calculator  ``200*701`` with the ``calculator`` tool.

The model's outputs are recorded texts replayed by forced decoding (the
``interlace.replay`` request extension, which the benchmark's config allows
with ``server: {server_tools: true, replay: true}``), so each run decodes the
same tokens at the real cost of decoding them.  Requests go through the
gateway's public HTTP API (``POST /v1/chat/completions``, streaming, in
process over ASGI: :mod:`interlace.bench.asgi`) of a gateway started by
``create_app``'s lifespan; the engine is wrapped in a thin proxy that only
timestamps its token events, pauses and resumes.

OFF is an ordinary executor, not a handicapped ON: the gateway with
``partial_execution: false`` starts all of a round's calls together once the
round's decoding is over, and the benchmark's config gives every tool enough
workers to run a round's independent calls in parallel (Planning's two
searches).  Every OFF run records whether they did (``concurrency``).

Measurements (per run, from the engine's marks and the streamed tool
results): ``g_i`` = round start (request start, or the resume that appended
round i-1's results) to the engine's pause at the call-end marker; ``t_i`` =
that pause to the round's last tool result; ``g_{n+1}`` = the final round.
OFF and ON runs are measured as pairs (back to back, the order alternating
from pair to pair, after one warm-up pair); every comparison of the modes is
made inside a pair against that pair's own bound, and only then summarised
over pairs (median, min-max).  See :mod:`interlace.bench.pairs` for the bound
(Conveyor's equation 2) and why a pair above it is flagged, not reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from interlace import Granularity, Tool, hookimpl
from interlace.engine_ext.machine import describe_machine, machine
from interlace.bench.asgi import post_sse
from interlace.bench.pairs import Pair, Timing, concurrency, pair, summarize_pairs


# ======================================================================= the benchmark's own tool


class LocalNewsTool(Tool):
    """Local news for a US city (the Validation workload's tool; canned results, no network).

    ``location`` must be ``"City, ST"``: the schema says so, and the gateway
    checks each field the moment it is complete (``validate_early``).
    """

    name = "local_news"
    description = "Latest local news for a US city. location must be 'City, ST' (city and two-letter state)."
    parameters = {
        "type": "object",
        "properties": {
            "location": {"type": "string", "pattern": r"^[A-Za-z .'-]+, [A-Z]{2}$",
                         "description": "City and state, e.g. 'Springfield, IL'."},
            "topic": {"type": "string"},
            "language": {"type": "string", "enum": ["en", "es"]},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
            "sort_by": {"type": "string", "enum": ["date", "relevance"]},
            "since": {"type": "string", "description": "ISO date"},
        },
        "required": ["location"],
        "additionalProperties": False,
    }
    granularity = Granularity.ON_FIELD
    timeout_s = 5.0

    def on_finish(self, arguments: Dict[str, Any]) -> Dict[str, Any]:
        return {"location": arguments["location"], "articles": [
            {"title": "City council approves the new budget", "date": "2024-05-02"}]}


@hookimpl
def register_tools(register):  # type: ignore[no-untyped-def]
    """Plugin hook (this module is loaded as a plugin module by the benchmark's config)."""
    register(LocalNewsTool())


# ======================================================================= fixtures

CORPUS = [
    {"id": "so/python-hello", "title": "How do I print Hello World in Python?",
     "text": "In Python 3, print is a function: print(\"Hello, World!\") prints the text and a newline. "
             "Save it as hello.py and run python3 hello.py."},
    {"id": "so/cpp-hello", "title": "Hello World program in C++",
     "text": "#include <iostream> then int main() { std::cout << \"Hello, World!\" << std::endl; return 0; } "
             "Compile with g++ hello.cpp -o hello."},
    {"id": "so/java-hello", "title": "Java Hello World program: public static void main",
     "text": "public class Hello { public static void main(String[] args) { System.out.println(\"Hello, World!\"); "
             "} } Save as Hello.java, compile with javac Hello.java and run java Hello."},
    {"id": "so/rust-hello", "title": "Hello World in Rust", "text": "fn main() { println!(\"Hello, World!\"); }"},
    {"id": "so/go-hello", "title": "Hello World in Go",
     "text": "package main; import \"fmt\"; func main() { fmt.Println(\"Hello, World!\") }"},
    {"id": "so/python-venv", "title": "How to create a Python virtual environment",
     "text": "python3 -m venv .venv and then source .venv/bin/activate."},
    {"id": "so/cpp-vector", "title": "C++ vector push_back vs emplace_back",
     "text": "emplace_back constructs the element in place."},
    {"id": "so/java-string", "title": "Java String equals vs ==", "text": "Use equals to compare contents."},
    {"id": "fin/msft-cap", "title": "Microsoft market capitalization (USD billion)", "text": "3120"},
    {"id": "fin/aapl-cap", "title": "Apple market capitalization (USD billion)", "text": "2940"},
    {"id": "fin/nvda-cap", "title": "Nvidia market capitalization (USD billion)", "text": "2210"},
    {"id": "fin/msft-rev", "title": "Microsoft annual revenue (USD billion)", "text": "245"},
]

EMPLOYEES = [("Ada", "Engineering", 142000), ("Grace", "Engineering", 151000), ("Linus", "Infrastructure", 128000),
             ("Barbara", "Research", 139000), ("Ken", "Infrastructure", 133000), ("Margaret", "Research", 147000),
             ("Dennis", "Engineering", 125000), ("Frances", "Research", 136000)]


def write_fixtures(root: Path) -> Dict[str, Path]:
    """The search corpus (JSONL) and the sqlite database, under ``root``."""
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in CORPUS), encoding="utf-8")
    db = root / "company.sqlite"
    conn = sqlite3.connect(db)
    try:
        with conn:
            conn.execute("CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, team TEXT, salary INTEGER)")
            conn.executemany("INSERT INTO employees (name, team, salary) VALUES (?, ?, ?)", EMPLOYEES)
    finally:
        conn.close()
    return {"corpus": corpus, "db": db}


# ======================================================================= workloads (recorded outputs)


@dataclass
class Workload:
    name: str
    model: str                      # one of the config's model names (sets the parser / format)
    tools: List[str]                # server tools
    prompt: str
    rounds: List[str]               # recorded output per round; the last one is the final answer
    validation: bool = False        # measure time to the tool error instead of end-to-end

    @property
    def key(self) -> str:
        return self.name.lower()


CODEGEN = '''```python
import numpy as np
import matplotlib.pyplot as plt

rng = np.random.default_rng(42)
t = np.linspace(0, 10, 400)
paths = rng.normal(0, 0.05, size=(80000, t.size)).cumsum(axis=1)
waves = np.sin(t) + paths
lo, mid, hi = np.percentile(waves, [5, 50, 95], axis=0)
plt.figure(figsize=(8, 4))
plt.fill_between(t, lo, hi, alpha=0.3, label="90% band")
plt.plot(t, mid, label="median")
plt.plot(t, np.sin(t), "--", label="sin(t)")
plt.legend()
plt.savefig("sine_wave.png")
print("saved sine_wave.png")
```
'''

CODEGEN_QUICK = '''```python
import numpy as np
import matplotlib.pyplot as plt
x = np.linspace(0, 2 * np.pi, 2000)
y = np.convolve(np.sin(x), np.ones(50) / 50, mode="same")
plt.plot(x, y)
plt.savefig("sine.png")
print("saved")
```
'''


def _hermes(name: str, arguments: Dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def workloads(quick: bool = False) -> List[Workload]:
    code = CODEGEN_QUICK if quick else CODEGEN
    search_langs = ["Python"] if quick else ["Python", "C++", "Java"]
    search_rounds = [("I will look up each program, starting with Python.\n" if i == 0 else "")
                     + _hermes("search", {"query": f"Hello World program in {lang}", "k": 2})
                     for i, lang in enumerate(search_langs)]
    search_final = ("Here they are." if quick else
                    "Python: print(\"Hello, World!\")\nC++: std::cout << \"Hello, World!\";\n"
                    "Java: System.out.println(\"Hello, World!\");")
    plan = ("Thought: I need both market caps, then their ratio, then a formatted sentence.\n"
            "$1 = search(\"Microsoft market capitalization\")\n"
            "$2 = search(\"Apple market capitalization\")\n"
            "$3 = calculator(\"round($1 / $2, 3)\")\n"
            "$4 = format(\"Microsoft's market cap is {0} times Apple's.\", [\"$3\"])\n"
            "join()")
    if quick:
        plan = ("$1 = search(\"Microsoft market capitalization\")\n$2 = search(\"Apple market capitalization\")\n"
                "$3 = calculator(\"$1 / $2\")\njoin()")
    news = {"location": "Springfield", "topic": "city council elections, school board budget and road works",
            "language": "en", "max_results": 10, "sort_by": "date", "since": "2024-05-01"}
    return [
        Workload("CodeGen", "smollm2-code", ["python"],
                 "Plot a sine wave with random-walk noise (many paths) as a median and a 90% band; save a PNG.",
                 [code, "The plot is saved as sine_wave.png: the median path and the 90% band around sin(t)."
                  if not quick else "Saved."]),
        Workload("Search", "smollm2", ["search"],
                 "Write Hello World in Python, C++ and Java, using the search tool to check each.",
                 [*search_rounds, search_final]),
        Workload("Planning", "smollm2-plan", ["search", "calculator", "format"],
                 "How many times larger is Microsoft's market cap than Apple's? Use the tools, and format the answer.",
                 [plan, "Microsoft's market cap is about 1.061 times Apple's." if not quick else "Done."]),
        Workload("Validation", "smollm2", ["local_news"], "What is the local news in Springfield, Illinois?",
                 [_hermes("local_news", news if not quick else {"location": "Springfield", "topic": "roads",
                                                               "language": "en"}), "Sorry."], validation=True),
        Workload("Database", "smollm2", ["sqlite"], "List every employee in the database.",
                 [_hermes("sqlite", {"query": "SELECT * FROM employees"}),
                  "There are 8 employees: Ada, Grace, Linus, Barbara, Ken, Margaret, Dennis and Frances."
                  if not quick else "Eight."]),
        Workload("Calculator", "smollm2", ["calculator"], "What is 200 times 701?",
                 [_hermes("calculator", {"expression": "200*701"}), "200 times 701 is 140200."]),
    ]


def gateway_config(corpus: Path, db: Path, delay_s: float, tool_nice: int = 0, dtype: str = "float32",
                   workers: int = 2, adapt_threads: bool = True) -> Dict[str, Any]:
    """The benchmark's gateway.  Server tools and replay are off by default in
    a gateway; this one enables both for its in-process caller.  Every tool
    gets ``workers`` workers (a common tool setting; 2 = the most independent
    calls of one tool in a round, Planning's two searches), so OFF runs a
    round's independent calls in parallel as an ordinary executor would; tool workers
    get ``nice``: on a CPU-only host, decoding first, tools on the CPU it
    leaves.  A tool's wall-time limit (``timeout_s``) counts from the call's
    start, i.e. with partial execution from the moment its name is decoded,
    so it includes decoding the arguments: 120 s, so a slow decode on a busy
    machine does not time a call out (the calculator's own default is 5 s).
    The python tool may use 4 GB (CodeGen's arrays take ~1 GB).  ``adapt_threads``: the engines' threads
    follow the free cores, as served (docs/cpu-engine.md); False keeps them fixed."""
    common: Dict[str, Any] = {"workers": workers, "timeout_s": 120.0,
                              **({"nice": tool_nice} if tool_nice else {})}
    return {
        "server": {"server_tools": True, "replay": True},
        "models": {"smollm2": {"path": "embedded", "dtype": dtype, "adapt_threads": adapt_threads},
                   "smollm2-code": {"path": "embedded", "parser": "markdown", "dtype": dtype,
                                    "adapt_threads": adapt_threads},
                   "smollm2-plan": {"path": "embedded", "parser": "plan", "dtype": dtype,
                                    "adapt_threads": adapt_threads}},
        "plugins": {"entrypoints": False, "modules": [__name__ if __name__ != "__main__" else "interlace.bench.tools"]},
        "tools": {"search": {"corpus": str(corpus), "delay_s": delay_s, **common},
                  "sqlite": {"database": str(db), **common},
                  "python": {"memory_mb": 4096, **common},
                  "calculator": dict(common), "format": dict(common), "local_news": dict(common)},
    }


# ======================================================================= measuring one request


class TimedEngine:
    """Delegates to the engine; records when each token event, pause and resume happened."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.marks: List[tuple] = []  # (kind, time.time(), extra)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, context_id: Any, sampling: Any, *args: Any, **kwargs: Any):
        async with contextlib.aclosing(self._engine.generate(context_id, sampling, *args, **kwargs)) as stream:
            async for ev in stream:
                now = time.time()
                if ev.paused:
                    self.marks.append(("pause", now, ev.token_id is not None))
                elif ev.finish_reason is not None:
                    self.marks.append(("finish", now, ev.token_id is not None))
                elif ev.token_id is not None:
                    self.marks.append(("token", now, None))
                yield ev

    async def resume(self, context_id: Any, token_ids: Sequence[int] = (), hint: Any = None) -> None:
        self.marks.append(("resume_call", time.time(), len(token_ids)))
        await self._engine.resume(context_id, token_ids, hint=hint)
        self.marks.append(("resume", time.time(), len(token_ids)))


@dataclass
class Run:
    workload: str
    partial: bool
    latency_s: float                # end to end (Validation: until the tool error is known)
    g: List[float]                  # g_1 .. g_n (rounds ending in a tool call)
    t: List[float]                  # t_1 .. t_n (pause -> the round's last result; 0 if all were ready)
    g_final: float                  # g_{n+1}
    tokens: int                     # decoded tokens (Validation: until the error was known)
    round_tokens: List[int]
    results: List[Dict[str, Any]]   # the streamed server tool results (+ received_at)
    round_ends: List[float]         # seconds from request start to each pause
    t0: float = 0.0                 # request start (time.time())
    concurrency: List[Dict[str, Any]] = field(default_factory=list)  # see pairs.concurrency

    def timing(self) -> Timing:
        return Timing(self.latency_s, self.g, self.t, self.g_final)


async def run_once(app: Any, wl: Workload, partial: bool, max_tokens: int = 1200) -> Run:
    """One request of ``wl`` through ``POST /v1/chat/completions`` (streaming)."""
    gw = app.state.gateway
    base = gw.models[wl.model]
    timed = TimedEngine(base.engine)
    body = {"model": wl.model, "messages": [{"role": "user", "content": wl.prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True,
            "interlace": {"server_tools": wl.tools, "replay": wl.rounds, "partial_execution": partial}}
    results: List[Dict[str, Any]] = []
    end: Optional[float] = None
    error_at: Optional[float] = None
    gw.models[wl.model] = dataclasses.replace(base, engine=timed)  # this request's engine events get timed
    try:
        t0 = time.time()
        async for at, ev in post_sse(app, "/v1/chat/completions", body):
            if ev == "[DONE]":
                continue
            if "error" in ev:
                raise RuntimeError(f"{wl.name}: the gateway streamed an error: {ev['error']}")
            res = (ev.get("interlace") or {}).get("tool_result")
            if res is not None:
                results.append({**res, "received_at": at})
                if wl.validation and not res["ok"] and error_at is None:
                    error_at = at  # the error is known: what the Validation workload measures
            if any(c.get("finish_reason") for c in ev.get("choices") or []):
                end = at
    finally:
        gw.models[wl.model] = base
    if end is None:
        raise RuntimeError(f"{wl.name}: the stream ended without a finish_reason")
    if wl.validation:
        if error_at is None:
            raise RuntimeError(f"{wl.name}: the invalid call produced no error result")
        end = error_at
    g, t, g_final, round_tokens, round_ends = rounds(timed.marks, results, t0)
    # decoded tokens (Validation: those decoded before the error was known, what early abort saves)
    tokens = sum(1 for k, at, x in timed.marks
                 if (k == "token" or (k in ("pause", "finish") and x)) and (not wl.validation or at <= end))
    run = Run(wl.name, partial, end - t0, g, t, g_final, tokens, round_tokens, results, round_ends, t0=t0)
    run.concurrency = concurrency(results, [t0 + e for e in round_ends])
    return run


def rounds(marks: Sequence[tuple], results: Sequence[Dict[str, Any]], t0: float
           ) -> tuple[List[float], List[float], float, List[int], List[float]]:
    """``g_i``, ``t_i``, ``g_{n+1}``, tokens per round and the pause times (from
    ``t0``) out of the engine's marks and the tool results."""
    g: List[float] = []
    t: List[float] = []
    round_tokens: List[int] = []
    round_ends: List[float] = []
    start, n_tok = t0, 0
    g_final = 0.0
    pause_at: Optional[float] = None
    for kind, at, extra in marks:
        if kind == "token" or (kind in ("pause", "finish") and extra):
            n_tok += 1
        if kind == "pause":
            g.append(at - start)
            round_tokens.append(n_tok)
            round_ends.append(at - t0)
            pause_at, n_tok = at, 0
        elif kind == "resume_call":
            # the round's tools ended before this resume; the last result after the pause marks t_i
            done = [r["finished_at"] for r in results
                    if pause_at is not None and r["finished_at"] >= pause_at and r["received_at"] <= at]
            t.append((max(done) - pause_at) if done else 0.0)
        elif kind == "resume":
            start = at
        elif kind == "finish":
            g_final = at - start
            round_tokens.append(n_tok)
    return g, t, g_final, round_tokens, round_ends


# ======================================================================= the benchmark


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def summarize(wl: Workload, off: List[Run], on: List[Run]) -> Dict[str, Any]:
    """One workload's row: descriptive medians of each mode, and the per-pair
    comparison (``off[i]`` with ``on[i]``) summarised over pairs."""
    if len(off) != len(on):
        raise ValueError(f"{wl.name}: {len(off)} OFF runs but {len(on)} ON runs")
    n = min(len(r.g) for r in off)
    row: Dict[str, Any] = {
        "workload": wl.name, "validation": wl.validation, "rounds": n,
        "g_s": [_median([r.g[i] for r in off]) for i in range(n)],
        "t_s": [_median([r.t[i] if i < len(r.t) else 0.0 for r in off]) for i in range(n)],
        "g_final_s": _median([r.g_final for r in off]),
        "off_s": _median([r.latency_s for r in off]), "on_s": _median([r.latency_s for r in on]),
        "tokens_off": _median([r.tokens for r in off]), "tokens_on": _median([r.tokens for r in on]),
    }
    if wl.validation:
        saved = [a.latency_s - b.latency_s for a, b in zip(off, on)]
        row.update(n_pairs=len(saved), saved_s=_median(saved), saved_range_s=[min(saved), max(saved)],
                   tokens_not_decoded=row["tokens_off"] - row["tokens_on"],
                   aborted_early=all(any(x.get("aborted_early") for x in r.results) for r in on),
                   errors_off=all(any(not x["ok"] for x in r.results) for r in off))
        return row
    pairs: List[Pair] = [pair(a.timing(), b.timing()) for a, b in zip(off, on)]
    row["pairs"] = [p.to_dict() for p in pairs]
    row["summary"] = summarize_pairs(pairs)
    row["ratio_t_g"] = sum(row["t_s"]) / sum(row["g_s"]) if sum(row["g_s"]) else 0.0
    # OFF runs a round's independent calls in parallel (an ordinary executor)
    groups = [c for r in off for c in r.concurrency]
    row["off_parallel"] = {"groups": len(groups), "concurrent": sum(c["concurrent"] for c in groups),
                           "start_spread_ms_max": max((c["start_spread_s"] * 1000 for c in groups), default=None),
                           "end_spread_ms_max": max((c["end_spread_s"] * 1000 for c in groups), default=None),
                           "shortest_ms_min": min((c["shortest_s"] * 1000 for c in groups), default=None),
                           "calls": max((c["calls"] for c in groups), default=0),
                           "tool": groups[0]["tool"] if groups else None}
    # evidence that tools really ran during decoding in the ON runs
    early = [res["content"]["statements_run_early"] for r in on for res in r.results
             if isinstance(res.get("content"), dict) and "statements_run_early" in res["content"]]
    if early:
        row["statements_run_early"] = _median(early)
        row["statements"] = _median([res["content"]["statements"] for r in on for res in r.results
                                     if isinstance(res.get("content"), dict) and "statements" in res["content"]])
    row["results_ready_before_round_end"] = _median([sum(1 for res in r.results if _ready_in_round(r, res))
                                                     for r in on])
    row["all_ok"] = all(res["ok"] for r in off + on for res in r.results)
    return row


def _ready_in_round(run: Run, res: Dict[str, Any]) -> bool:
    """The result was there before the decoding of the round that called the tool ended."""
    pauses = [run.t0 + e for e in run.round_ends if run.t0 + e >= res["started_at"]]
    return bool(pauses) and res["finished_at"] <= pauses[0]


async def measure_pairs(app: Any, wl: Workload, pairs: int, warmup: int = 1,
                        verbose: bool = False) -> tuple[List[Run], List[Run]]:
    """``warmup`` unmeasured pairs, then ``pairs`` OFF/ON pairs, each pair back
    to back, the order alternating (OFF first in even pairs, ON first in odd)."""
    for _ in range(warmup):
        for mode in (False, True):
            await run_once(app, wl, mode)
    off: List[Run] = []
    on: List[Run] = []
    for i in range(pairs):
        for mode in ((False, True) if i % 2 == 0 else (True, False)):
            r = await run_once(app, wl, mode)
            (on if mode else off).append(r)
            if verbose:
                print(f"  {wl.name:<10} pair {i + 1} {'on ' if mode else 'off'} {r.latency_s * 1000:8.0f} ms  "
                      f"g={[round(x * 1000) for x in r.g]} t={[round(x * 1000) for x in r.t]} "
                      f"g_final={r.g_final * 1000:.0f} tokens={r.tokens}", file=sys.stderr)
    return off, on


@contextlib.asynccontextmanager
async def running_gateway(delay_s: float, tool_nice: int = 0, dtype: str = "float32", workers: int = 2,
                          adapt_threads: bool = True):
    """The benchmark's gateway app, started (fixtures in a temporary folder, removed after)."""
    from interlace.gateway.app import create_app
    from interlace.gateway.config import parse_config

    tmp = Path(tempfile.mkdtemp(prefix="interlace-bench-tools-"))
    try:
        fx = write_fixtures(tmp)
        cfg = parse_config(gateway_config(fx["corpus"], fx["db"], delay_s, tool_nice, dtype, workers, adapt_threads),
                           "<bench tools>")
        app = create_app(cfg)
        async with app.router.lifespan_context(app):
            yield app
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def bench(args: argparse.Namespace, out: Dict[str, Any]) -> Dict[str, Any]:
    """Measure the chosen workloads into ``out`` (``workloads``, ``runs``);
    with ``--json``, ``out`` is saved after each workload, so an interrupted
    run keeps what it measured (``--report`` prints it)."""
    chosen = [w for w in workloads(args.quick) if not args.only or w.key in [o.lower() for o in args.only]]
    if not chosen:
        raise SystemExit(f"no workload matches {args.only}")
    import torch

    threads = torch.get_num_threads()
    if args.engine_threads:
        torch.set_num_threads(args.engine_threads)
    try:
        out["machine"] = machine(engine_threads=torch.get_num_threads(), torch=torch.__version__,
                                 adapt_threads=not args.fixed_threads)
        out.setdefault("workloads", [])
        out.setdefault("runs", [])
        async with running_gateway(args.delay_s, args.tool_nice, args.dtype, args.workers,
                                   not args.fixed_threads) as app:
            for wl in chosen:
                off, on = await measure_pairs(app, wl, args.pairs, args.warmup, args.verbose)
                row = summarize(wl, off, on)
                out["workloads"].append(row)
                out["runs"] += [_run_dict(r, i) for runs in (off, on) for i, r in enumerate(runs)]
                if args.verbose:
                    print(f"{wl.name}: off {row['off_s'] * 1000:.0f} ms, on {row['on_s'] * 1000:.0f} ms",
                          file=sys.stderr)
                if args.json:
                    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        return out
    finally:
        torch.set_num_threads(threads)


_RESULT_KEYS = ("name", "ok", "error", "arguments", "started_at", "tool_started_at", "arguments_done_at",
                "finished_at", "received_at", "partial_execution", "aborted_early")


def _run_dict(r: Run, pair_index: int) -> Dict[str, Any]:
    d = dataclasses.asdict(r)
    d["pair"] = pair_index
    d["results"] = [{k: v for k, v in res.items() if k in _RESULT_KEYS}
                    | ({"statements_run_early": res["content"].get("statements_run_early")}
                       if isinstance(res.get("content"), dict) and "statements_run_early" in res["content"] else {})
                    for res in r.results]
    return d


# ======================================================================= report


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x * 100:.0f}%"


def efficiency_cell(summary: Dict[str, Any]) -> str:
    """``87% (71% to 98%)``, with the pairs below the bound as ``; 1 of 5 pairs below L_best!``.

    Never shows a value above 100%: pairs above the bound are measurement
    errors and are only counted."""
    eff, n, bad = summary["efficiency"], summary["pairs"], summary["below_bound"]
    if eff is None:
        text = "n/a (all pairs below L_best!)" if summary["hideable"] else "n/a (nothing to hide)"
    else:
        text = f"{_pct(eff['median'])} ({_pct(eff['lo'])} to {_pct(eff['hi'])})"
        if eff["n"] < n - bad:
            text += f" of {eff['n']} pairs"
    if bad and eff is not None:
        text += f"; {bad} of {n} pairs below L_best!"
    return text


def table(rows: List[Dict[str, Any]]) -> str:
    head = ("| workload | pairs | Σg ms | Σt ms | g_n+1 ms | OFF ms | ON ms | max saving ms (L_old−L_best) | "
            "saved ms, median (min to max) | efficiency, median (min to max) | pairs below L_best | "
            "decode ON/OFF |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if r["validation"]:
            lines.append(f"| {r['workload']}* | {r['n_pairs']} | {_ms(sum(r['g_s']))} | "
                         f"{_ms(sum(r['t_s']))} | - | {_ms(r['off_s'])} | {_ms(r['on_s'])} | n/a (early abort) | "
                         f"{_ms(r['saved_s'])} ({_ms(r['saved_range_s'][0])} to {_ms(r['saved_range_s'][1])}) | "
                         f"n/a | - | - |")
            continue
        s = r["summary"]
        dec = s["decode_ratio"]
        lines.append(
            f"| {r['workload']} | {s['pairs']} | {_ms(sum(r['g_s']))} | {_ms(sum(r['t_s']))} | "
            f"{_ms(r['g_final_s'])} | {_ms(r['off_s'])} | {_ms(r['on_s'])} | {_ms(s['max_saving_s']['median'])} | "
            f"{_ms(s['saved_s']['median'])} ({_ms(s['saved_s']['lo'])} to {_ms(s['saved_s']['hi'])}) | "
            f"{efficiency_cell(s)} | {s['below_bound']}{'!' if s['below_bound'] else ''} | "
            + (f"{dec['median']:.2f} ({dec['lo']:.2f} to {dec['hi']:.2f}) |" if dec else "- |"))
    return "\n".join(lines)


def notes(rows: List[Dict[str, Any]], delay_s: float) -> str:
    out = []
    for r in rows:
        if r["validation"]:
            out.append(f"{r['workload']}*: time until the schema error is known; partial execution aborted the "
                       f"call early: {r['aborted_early']}; tokens decoded {r['tokens_off']:.0f} (off) vs "
                       f"{r['tokens_on']:.0f} (on): {r['tokens_not_decoded']:.0f} tokens not decoded")
            continue
        if "statements_run_early" in r:
            out.append(f"{r['workload']}: {r['statements_run_early']:.0f} of {r['statements']:.0f} statements ran "
                       f"while the model was still decoding (ON)")
        par = r.get("off_parallel") or {}
        if par.get("groups"):
            out.append(f"{r['workload']} OFF: {par['calls']} independent {par['tool']} calls of a round ran "
                       f"concurrently in {par['concurrent']} of {par['groups']} OFF runs (starts within "
                       f"{par['start_spread_ms_max']:.0f} ms, ends within {par['end_spread_ms_max']:.0f} ms, "
                       f"each call >= {par['shortest_ms_min']:.0f} ms; search delay {delay_s * 1000:.0f} ms)")
    return "\n".join(out)


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["workload"] + ("*" if r["validation"] else "") for r in rows]
    xs = np.arange(len(rows))
    left.bar(xs - 0.2, [r["off_s"] for r in rows], 0.4, label="partial execution off")
    left.bar(xs + 0.2, [r["on_s"] for r in rows], 0.4, label="partial execution on")
    for i, r in enumerate(rows):
        if not r["validation"]:
            best = _median([p["l_best_s"] for p in r["pairs"]])
            left.plot([i + 0.02, i + 0.38], [best] * 2, color="k", lw=1.5,
                      label="L_best (eq. 2), median over pairs" if i == 0 else None)
    left.set_xticks(xs, names)
    left.set_ylabel("end-to-end latency (s), median")
    left.set_title("Latency per workload")
    left.legend(fontsize=8)
    shown = [r for r in rows if not r["validation"] and r["summary"]["hideable"]]  # not "nothing to hide"
    for i, r in enumerate(shown):
        ok = [p["efficiency"] * 100 for p in r["pairs"] if p["efficiency"] is not None]
        bad = sum(p["below_bound"] for p in r["pairs"])
        right.scatter([i] * len(ok), ok, color="tab:blue", zorder=3, label="one OFF/ON pair" if i == 0 else None)
        if ok:
            right.plot([i - 0.25, i + 0.25], [statistics.median(ok)] * 2, color="k", lw=2,
                       label="median" if i == 0 else None)
        if bad:
            right.annotate(f"{bad} below L_best!", (i, 100), textcoords="offset points", xytext=(-20, 6),
                           fontsize=8, color="tab:red")
    right.axhline(100, color="grey", ls="--", lw=1)
    right.axhline(0, color="grey", lw=0.5)
    shown_eff = [p["efficiency"] * 100 for r in shown for p in r["pairs"] if p["efficiency"] is not None]
    right.set_ylim(min([-10.0, *[e - 10 for e in shown_eff]]), 115)
    if shown:
        right.set_xlim(-0.5, len(shown) - 0.5)
    else:
        right.text(0.5, 0.5, "no workload with tool time to hide", transform=right.transAxes, ha="center")
    right.set_xticks(range(len(shown)), [r["workload"] for r in shown])
    right.set_ylabel("time saved / most the bound allows (%)")
    right.set_title("Efficiency per pair: (L_off - L_on) / (L_old - L_best)")
    if shown:
        right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="interlace bench tools", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", "--runs", dest="pairs", type=int, default=5,
                   help="measured OFF/ON pairs per workload")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured pairs per workload first")
    p.add_argument("--delay-s", type=float, default=0.7, help="emulated network delay of each search (s)")
    p.add_argument("--workers", type=int, default=2,
                   help="workers per tool (enough for a round's independent calls to run in parallel)")
    p.add_argument("--engine-threads", type=int, default=0,
                   help="the engine's most torch threads (0: torch's default, the usable cores, as served); "
                        "the engine runs on as many of them as are free unless --fixed-threads")
    p.add_argument("--fixed-threads", action="store_true",
                   help="keep the engine's threads fixed (adapt_threads: false) instead of following the free "
                        "cores as served")
    p.add_argument("--tool-nice", type=int, default=10,
                   help="nice value for the tool worker processes (0: leave them at the gateway's priority)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="engine dtype (the recorded results use float32)")
    p.add_argument("--only", nargs="+", metavar="WORKLOAD", help="run only these workloads")
    p.add_argument("--plot", default="docs/bench_tools.png", help="where to save the plot ('' for none)")
    p.add_argument("--json", help="also write the results (every run, every pair, the machine) as JSON here")
    p.add_argument("--quick", action="store_true", help="smoke test: short outputs, 1 pair, no warm-up")
    p.add_argument("--report", metavar="JSON", help="measure nothing: print the table (and --plot) of a saved --json")
    p.add_argument("-v", "--verbose", action="store_true", help="print each run")
    return p


def report(out: Dict[str, Any], plot_path: Optional[str]) -> None:
    """Print the caption, the table and the notes of ``out``; save the plot."""
    st, rows = out["settings"], out["workloads"]
    print(f"interlace bench tools: {st['pairs']} OFF/ON pairs per workload (order alternating, "
          f"{st['warmup']} warm-up pair), tool workers {st['workers']} per tool at nice {st['tool_nice']}, "
          f"search delay {st['delay_s']:g} s, {st['dtype']}")
    print(f"machine: {describe_machine(out['machine'])}")
    print(f"command: {st['command']}")
    print(table(rows))
    extra = notes(rows, st["delay_s"])
    if extra:
        print(extra)
    if plot_path and rows:
        plot(rows, Path(plot_path))
        print(f"plot: {plot_path}")


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        report(json.loads(Path(args.report).read_text()), args.plot)
        return 0
    if args.quick:
        args.pairs, args.warmup = 1, 0
        if "--delay-s" not in (argv if argv is not None else sys.argv):
            args.delay_s = 0.2
    t_start = time.time()
    out: Dict[str, Any] = {"settings": {
        "pairs": args.pairs, "warmup": args.warmup, "delay_s": args.delay_s, "quick": args.quick,
        "workers": args.workers, "engine_threads": args.engine_threads, "tool_nice": args.tool_nice,
        "dtype": args.dtype,
        "command": "interlace bench tools " + " ".join(argv if argv is not None else sys.argv[1:])}}
    asyncio.run(bench(args, out))
    report(out, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(f"({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
