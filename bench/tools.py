"""Partial tool execution, measured: Conveyor's six workloads with it off and on.

    interlace bench tools [--runs 5] [--delay-s 0.5] [--plot docs/bench_tools.png] [--json out.json]
                          [--only codegen search ...] [--quick]

Conveyor (Xu et al., 2024) starts a tool on the partially decoded call so
that tool time overlaps decoding.  Its six workloads, adapted to this gateway
and a CPU:

* CodeGen     a numpy + matplotlib (Agg) script in a ```python fence; the
              ``python`` tool runs each statement as soon as it is complete.
* Search      three ``search`` calls (Hello World in Python, C++, Java), hermes
              format, over a small generated corpus with an emulated network
              delay (``--delay-s``); the search starts on the completed ``query``.
* Planning    an LLMCompiler plan: two searches, a calculator step, a format
              step, ``join()``; each step starts when its line is complete.
* Validation  a ``local_news`` call (a benchmark tool registered through the
              plugin hook) whose first field, ``location``, violates the
              schema: with partial execution decoding of the call is aborted
              at once; without, the error shows after the whole call.
              Measured: time until the error is known (as in the paper).
* Database    a ``sqlite`` query over a small generated database.
* Calculator  ``200*701`` with the ``calculator`` tool.

The model's outputs are recorded texts replayed by forced decoding (the
``interlace.replay`` request extension), so each run decodes the same tokens
at the real cost of decoding them.  Requests go through the product's path
(``build_plan`` + ``run_completion`` of a gateway started by ``create_app``'s
lifespan), in process; the engine is wrapped in a thin proxy that only
timestamps its token events, pauses and resumes.

Measurements.  From the OFF runs (tools start only once a round's decoding is
over): ``g_i`` = time from the round's start (request start, or the engine
resume that appended the previous round's results) to the engine's pause at
the call-end marker; ``t_i`` = time from that pause to the last tool result of
the round; ``g_{n+1}`` = the final round.  Conveyor's equation (2) then gives
``L_old = sum(g_i + t_i) + g_{n+1}`` and the best case ``L_best = sum(max(g_i,
t_i)) + g_{n+1}``; the theoretical best improvement is ``L_old / L_best - 1``
and the measured one ``median(OFF) / median(ON) - 1`` (the paper's
definition).  "achieved" is measured / theoretical.  OFF and ON runs are
interleaved (order alternating per repetition), after one warm-up run of each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from interlace.bench import cpu_model
from interlace.gateway.hookspecs import hookimpl
from interlace.gateway.tools import Granularity, Tool

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
        plan = ("$1 = search(\"Microsoft market capitalization\")\n$2 = calculator(\"$1 / 1000\")\n"
                "$3 = format(\"{0} trillion\", [\"$2\"])\njoin()")
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


def gateway_config(corpus: Path, db: Path, delay_s: float, tool_nice: int = 0,
                   dtype: str = "float32") -> Dict[str, Any]:
    """Tool workers get ``nice`` (a common tool setting): on a CPU-only host,
    decoding first, tools on the CPU it leaves."""
    common = {"nice": tool_nice} if tool_nice else {}
    return {
        "models": {"smollm2": {"path": "embedded", "dtype": dtype},
                   "smollm2-code": {"path": "embedded", "parser": "markdown", "dtype": dtype},
                   "smollm2-plan": {"path": "embedded", "parser": "plan", "dtype": dtype}},
        "plugins": {"entrypoints": False, "modules": [__name__ if __name__ != "__main__" else "interlace.bench.tools"]},
        "tools": {"search": {"corpus": str(corpus), "delay_s": delay_s, **common},
                  "sqlite": {"database": str(db), **common},
                  "python": {"isolate_network": True, **common},
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

    async def resume(self, context_id: Any, token_ids: Sequence[int] = ()) -> None:
        self.marks.append(("resume_call", time.time(), len(token_ids)))
        await self._engine.resume(context_id, token_ids)
        self.marks.append(("resume", time.time(), len(token_ids)))


@dataclass
class Run:
    workload: str
    partial: bool
    latency_s: float
    g: List[float]                  # g_1 .. g_n (rounds ending in a tool call)
    t: List[float]                  # t_1 .. t_n
    g_final: float                  # g_{n+1}
    tokens: int                     # decoded tokens
    round_tokens: List[int]
    results: List[Dict[str, Any]]
    round_ends: List[float]         # seconds from request start to each pause
    t0: float = 0.0                 # request start (time.time())
    ok: bool = True
    note: str = ""


async def run_once(gw: Any, wl: Workload, partial: bool, max_tokens: int = 1200) -> Run:
    from interlace.gateway import openai_api as api
    from interlace.gateway.app import build_plan
    from interlace.gateway.completions import Finish, ServerToolResult, run_completion

    base = gw.models[wl.model]
    timed = TimedEngine(base.engine)
    model = dataclasses.replace(base, engine=timed)
    body = api.validate_chat_request({
        "model": wl.model, "messages": [{"role": "user", "content": wl.prompt}], "max_tokens": max_tokens,
        "temperature": 0,
        "interlace": {"server_tools": wl.tools, "replay": wl.rounds, "partial_execution": partial}})
    results: List[Dict[str, Any]] = []
    end = None
    t0 = time.time()
    plan = build_plan(gw, model, body)
    async with contextlib.aclosing(run_completion(model, plan, gw.runtime, gw.metrics)) as events:
        async for ev in events:
            if isinstance(ev, ServerToolResult):
                results.append({**ev.to_dict(), "received_at": time.time()})
                if wl.validation:
                    end = time.time()  # the error is known: what the Validation workload measures
                    break
            elif isinstance(ev, Finish):
                end = time.time()
    if end is None:
        raise RuntimeError(f"{wl.name}: the completion produced no Finish event")
    # rounds from the engine marks
    g: List[float] = []
    t: List[float] = []
    round_tokens: List[int] = []
    round_ends: List[float] = []
    start, n_tok = t0, 0
    g_final = 0.0
    pause_at: Optional[float] = None
    for kind, at, extra in timed.marks:
        if kind in ("token", "pause", "finish") and (kind == "token" or extra):
            n_tok += 1
        if kind == "pause":
            g.append(at - start)
            round_tokens.append(n_tok)
            round_ends.append(at - t0)
            pause_at, n_tok = at, 0
        elif kind == "resume_call":
            # the tools of the round ended before the resume; their last result marks t_i
            finished = [r["finished_at"] for r in results if pause_at is not None and r["finished_at"] >= pause_at
                        and r["received_at"] <= at]
            t.append((max(finished) - pause_at) if finished else 0.0)
        elif kind == "resume":
            start = at
        elif kind == "finish":
            g_final = at - start
            round_tokens.append(n_tok)
    if wl.validation and len(t) < len(g):
        finished = [r["finished_at"] for r in results]
        t.append(max(0.0, max(finished) - pause_at) if finished and pause_at else 0.0)
    tokens = sum(1 for k, _, x in timed.marks if k == "token" or (k in ("pause", "finish") and x))
    return Run(wl.name, partial, end - t0, g, t, g_final, tokens, round_tokens, results, round_ends, t0=t0)


# ======================================================================= the benchmark


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def summarize(wl: Workload, off: List[Run], on: List[Run]) -> Dict[str, Any]:
    n = min(len(r.g) for r in off)
    g = [_median([r.g[i] for r in off]) for i in range(n)]
    t = [_median([r.t[i] if i < len(r.t) else 0.0 for r in off]) for i in range(n)]
    g_final = _median([r.g_final for r in off])
    off_s, on_s = _median([r.latency_s for r in off]), _median([r.latency_s for r in on])
    improvement = off_s / on_s - 1 if on_s > 0 else 0.0
    row: Dict[str, Any] = {
        "workload": wl.name, "rounds": n, "g_s": g, "t_s": t, "g_final_s": g_final,
        "off_s": off_s, "on_s": on_s, "off_runs_s": [r.latency_s for r in off], "on_runs_s": [r.latency_s for r in on],
        "improvement": improvement, "validation": wl.validation,
        "tokens_off": _median([r.tokens for r in off]), "tokens_on": _median([r.tokens for r in on]),
    }
    if wl.validation:
        row.update(theoretical=None, achieved=None, saved_s=off_s - on_s,
                   tokens_not_decoded=row["tokens_off"] - row["tokens_on"],
                   aborted_early=all(any(x.get("aborted_early") for x in r.results) for r in on),
                   errors_off=all(any(not x["ok"] for x in r.results) for r in off))
        return row
    l_old = sum(gi + ti for gi, ti in zip(g, t)) + g_final
    l_best = sum(max(gi, ti) for gi, ti in zip(g, t)) + g_final
    theoretical = l_old / l_best - 1
    row.update(l_old_s=l_old, l_best_s=l_best, theoretical=theoretical,
               achieved=(improvement / theoretical) if theoretical >= 0.01 else None,
               saved_s=off_s - on_s, best_saved_s=l_old - l_best,
               ratio_t_g=(sum(t) / sum(g)) if sum(g) else 0.0)
    # evidence that tools really ran during decoding in the ON runs
    early = []
    for r in on:
        for res in r.results:
            c = res.get("content")
            if isinstance(c, dict) and "statements_run_early" in c:
                early.append(c["statements_run_early"])
    if early:
        row["statements_run_early"] = _median(early)
        row["statements"] = _median([res["content"]["statements"] for r in on for res in r.results
                                     if isinstance(res.get("content"), dict) and "statements" in res["content"]])
    hidden = [sum(1 for res in r.results if _ready_in_round(r, res)) for r in on]
    row["results_ready_before_round_end"] = _median(hidden) if hidden else 0
    row["all_ok"] = all(res["ok"] for r in off + on for res in r.results)
    return row


def _ready_in_round(run: Run, res: Dict[str, Any]) -> bool:
    """The result was there before the decoding of the round that called the tool ended."""
    pauses = [run.t0 + e for e in run.round_ends if run.t0 + e >= res["started_at"]]
    return bool(pauses) and res["finished_at"] <= pauses[0]


async def bench(args: argparse.Namespace) -> Dict[str, Any]:
    from interlace.gateway.app import create_app
    from interlace.gateway.config import parse_config

    chosen = [w for w in workloads(args.quick) if not args.only or w.key in [o.lower() for o in args.only]]
    if not chosen:
        raise SystemExit(f"no workload matches {args.only}")
    import torch

    threads = torch.get_num_threads()
    if args.engine_threads:
        torch.set_num_threads(args.engine_threads)
    tmp = Path(tempfile.mkdtemp(prefix="interlace-bench-tools-"))
    try:
        fx = write_fixtures(tmp)
        cfg = parse_config(gateway_config(fx["corpus"], fx["db"], args.delay_s, args.tool_nice, args.dtype),
                           "<bench tools>")
        app = create_app(cfg)
        gw = app.state.gateway
        out: Dict[str, Any] = {"workloads": [], "runs": []}
        async with app.router.lifespan_context(app):
            for wl in chosen:
                for _ in range(args.warmup):
                    for mode in (False, True):
                        await run_once(gw, wl, mode)
                runs: Dict[bool, List[Run]] = {False: [], True: []}
                for i in range(args.runs):
                    for mode in ((False, True) if i % 2 == 0 else (True, False)):
                        r = await run_once(gw, wl, mode)
                        runs[mode].append(r)
                        if args.verbose:
                            print(f"  {wl.name:<10} {'on ' if mode else 'off'} {r.latency_s * 1000:8.0f} ms  "
                                  f"g={[round(x * 1000) for x in r.g]} t={[round(x * 1000) for x in r.t]} "
                                  f"g_final={r.g_final * 1000:.0f} tokens={r.tokens}", file=sys.stderr)
                row = summarize(wl, runs[False], runs[True])
                out["workloads"].append(row)
                out["runs"] += [_run_dict(r) for r in runs[False] + runs[True]]
                if args.verbose:
                    print(f"{wl.name}: off {row['off_s'] * 1000:.0f} ms, on {row['on_s'] * 1000:.0f} ms",
                          file=sys.stderr)
        out["engine_threads"] = torch.get_num_threads()
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        torch.set_num_threads(threads)


def _run_dict(r: Run) -> Dict[str, Any]:
    d = {k: v for k, v in dataclasses.asdict(r).items()}
    d["results"] = [{k: v for k, v in res.items() if k in ("name", "ok", "error", "started_at", "finished_at",
                                                            "received_at", "partial_execution", "aborted_early")}
                    | ({"statements_run_early": res["content"].get("statements_run_early")}
                       if isinstance(res.get("content"), dict) and "statements_run_early" in res["content"] else {})
                    for res in r.results]
    return d


# ======================================================================= report


def machine() -> Dict[str, Any]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.date.today().isoformat()}


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def table(rows: List[Dict[str, Any]]) -> str:
    head = ("| workload | g (Σg_i) ms | t (Σt_i) ms | g_n+1 ms | off ms | on ms | improvement | "
            "theoretical best | achieved |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if r["validation"]:
            lines.append(f"| {r['workload']}* | {_ms(sum(r['g_s']))} | {_ms(sum(r['t_s']))} | - | {_ms(r['off_s'])} "
                         f"| {_ms(r['on_s'])} | {_pct(r['improvement'])} | n/a (early abort) | - |")
        else:
            ach = "-" if r["achieved"] is None else f"{r['achieved'] * 100:.0f}%"
            lines.append(f"| {r['workload']} | {_ms(sum(r['g_s']))} | {_ms(sum(r['t_s']))} | {_ms(r['g_final_s'])} "
                         f"| {_ms(r['off_s'])} | {_ms(r['on_s'])} | {_pct(r['improvement'])} "
                         f"| {_pct(r['theoretical'])} | {ach} |")
    return "\n".join(lines)


def notes(rows: List[Dict[str, Any]]) -> str:
    out = []
    for r in rows:
        if r["validation"]:
            out.append(f"{r['workload']}*: time until the schema error is known; partial execution aborted the "
                       f"call early: {r['aborted_early']}; tokens decoded {r['tokens_off']:.0f} (off) vs "
                       f"{r['tokens_on']:.0f} (on): {r['tokens_not_decoded']:.0f} tokens and "
                       f"{r['saved_s'] * 1000:.0f} ms of decoding saved")
        elif "statements_run_early" in r:
            out.append(f"{r['workload']}: {r['statements_run_early']:.0f} of {r['statements']:.0f} statements ran "
                       f"while the model was still decoding (ON)")
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
        if r.get("l_best_s"):
            left.plot([i + 0.02, i + 0.38], [r["l_best_s"]] * 2, color="k", lw=1.5,
                      label="theoretical best (eq. 2)" if i == 0 else None)
    left.set_xticks(xs, names)
    left.set_ylabel("end-to-end latency (s), median")
    left.set_title("Latency per workload")
    left.legend(fontsize=8)
    ratio = np.logspace(-3, 2, 400)
    right.plot(ratio, ((1 + ratio) / np.maximum(1, ratio) - 1) * 100, label="theoretical best, g_n+1 = 0")
    for r in rows:
        if r["validation"]:
            continue
        right.scatter([max(r["ratio_t_g"], 1e-3)], [r["improvement"] * 100], color="tab:red", zorder=3)
        right.scatter([max(r["ratio_t_g"], 1e-3)], [r["theoretical"] * 100], facecolors="none",
                      edgecolors="k", zorder=3)
        right.annotate(r["workload"], (max(r["ratio_t_g"], 1e-3), r["improvement"] * 100),
                       textcoords="offset points", xytext=(5, 5), fontsize=8)
    right.scatter([], [], color="tab:red", label="measured")
    right.scatter([], [], facecolors="none", edgecolors="k", label="best for the measured g_i, t_i, g_n+1")
    right.set_xscale("log")
    right.set_xlabel("tool time / decoding time  (Σt_i / Σg_i)")
    right.set_ylabel("latency improvement (%)")
    right.set_title("Improvement vs t/g (Conveyor Fig. 8)")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="interlace bench tools", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="measured runs per workload and mode (median)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs per workload and mode first")
    p.add_argument("--delay-s", type=float, default=0.7, help="emulated network delay of each search (s)")
    p.add_argument("--engine-threads", type=int, default=1,
                   help="torch threads for the engine (0: torch's default); 1 leaves the other cores to the tools")
    p.add_argument("--tool-nice", type=int, default=10,
                   help="nice value for the tool worker processes (0: leave them at the gateway's priority)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="engine dtype (the recorded results use float32)")
    p.add_argument("--only", nargs="+", metavar="WORKLOAD", help="run only these workloads")
    p.add_argument("--plot", default="docs/bench_tools.png", help="where to save the plot ('' for none)")
    p.add_argument("--json", help="also write the results (and every run) as JSON here")
    p.add_argument("--quick", action="store_true", help="smoke test: short outputs, 1 run, no warm-up")
    p.add_argument("-v", "--verbose", action="store_true", help="print each run")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.runs, args.warmup = 1, 0
        if "--delay-s" not in (argv or sys.argv):
            args.delay_s = 0.2
    t_start = time.time()
    out = asyncio.run(bench(args))
    out["machine"] = {**machine(), "engine_threads": out.pop("engine_threads")}
    out["settings"] = {"runs": args.runs, "warmup": args.warmup, "delay_s": args.delay_s, "quick": args.quick,
                       "engine_threads": args.engine_threads, "tool_nice": args.tool_nice}
    rows = out["workloads"]
    print(f"interlace bench tools: {out['machine']['cpu']}, {out['machine']['cores']} cores, "
          f"{out['machine']['date']}; engine threads {out['machine']['engine_threads']}, tool workers at nice "
          f"{args.tool_nice}; median of {args.runs} runs per mode; search delay {args.delay_s:g} s")
    print(table(rows))
    extra = notes(rows)
    if extra:
        print(extra)
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(f"({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
