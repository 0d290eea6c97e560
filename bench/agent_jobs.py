"""Whole agent jobs with client-side tool calls, through the gateway on vLLM
against stock ``vllm serve`` (``interlace bench jobs``, issue 37).

    interlace bench jobs --jobs 8 --turns 20 --tool-s 2 --kv-tokens 6144 --repeats 3 --json jobs.json

What runs.  ``--jobs`` agent jobs, each a chat conversation of ``--turns``
model calls (a range ``20-40`` draws each job's count).  Every call but the
last is answered by a client-side tool call; the client then sleeps the
tool's duration (lognormal, median ``--tool-s``, log-spread
``--tool-sigma``, times ``--time-scale``), appends the assistant message and
the tool's result (``--result-tokens`` of text) and sends the whole
conversation again, as OpenAI clients do.  The last call answers in text.
Jobs start at Poisson times (mean gap ``--arrival-s``).  A system prompt and
three tool definitions are shared by every job (a common prefix, as for one
agent product); everything else is distinct per job, turn and repeat.

Systems (``--variants``), each started fresh with the same KV cache
(``--kv-tokens``, in vLLM's 128-token CPU blocks via
``num_gpu_blocks_override``), model (the embedded SmolLM2-135M-Instruct in
float32), ``max_model_len`` 4096 (20-40 turns fit) and eager mode:

* ``vllm-serve``: stock ``vllm serve`` (FCFS, automatic prefix caching;
  :class:`bench.engines_trace._Server`): what a client gets today;
* ``interlace``: ``interlace serve`` with ``engine: {kind: vllm}`` and the
  policy's default interception: a client tool call's context stays pinned
  in vLLM until its follow-up (issue 37; before the pins exist this row is
  the same path as the next one);
* ``interlace-discard``: the same with ``interception: discard`` (the
  follow-up finds only what vLLM's prefix cache kept).

Same tokens on every system.  Every reply is forced: the gateway gets it as
``interlace.replay`` (its text, tokenized by the model's tokenizer, then
EOS); stock vLLM gets the same token ids as a token-id grammar
(``structured_outputs``, llguidance's ``<[id]>``; the server runs the
guidance backend).  The gateway renders the conversation with its own chat
template and tool format, which a stock server's ``/v1/chat/completions``
would render differently (SmolLM2's template knows no tools), so stock vLLM
is sent ``/v1/completions`` with the token ids the gateway renders for the
same messages (computed before the run, so rendering costs neither side
time in the measurement).  Each turn is checked: the gateway's
``usage.prompt_tokens`` equals those ids' count, its streamed call equals
the forced one, stock vLLM's streamed ids equal the forced ids, and both
count the same completion tokens -- a mismatch fails the run.

Measured per system (median over ``--repeats`` with the min-max spread):
job completion time (arrival to final answer; mean and p90), the same less
the job's tool time (the model's share), time to first token of the
follow-ups (the first streamed delta carrying output: a reply starts with a
short sentence before its call, so this is the first decoded token on both
systems, plus the gateway's parser), the follow-ups' ``cached_tokens`` over
``prompt_tokens`` (stock vLLM reports ``prompt_tokens_details`` only when
started with ``--enable-prompt-tokens-details``; where it does not, the
table shows its server-side prefix-cache hit rate over all turns from
``vllm:prefix_cache_hits_total`` / ``queries_total`` instead), and turns per
second.  The gateway's pin and saved-prefill counters (``/metrics`` samples
whose name holds ``pin`` or ``prefill_tokens_saved``) are recorded per
repeat.  One server per system serves all its repeats (a start-up is a
minute on a CPU); each repeat's texts come from its own seed, so nothing of
an earlier repeat is in the cache, and every system sees the same texts,
arrivals and tool times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

VARIANTS = ("vllm-serve", "interlace", "interlace-discard")
BASELINE = "vllm-serve"
MAX_MODEL_LEN = 4096  # 20-40 turns of an agent job fit (SmolLM2 takes 8192)
VLLM_CPU_BLOCK = 128
MODEL_NAME = "agent"

SYSTEM_PROMPT = ("You are a software engineering agent in a repository. Use the tools until the task is done; "
                 "before each call, say in two words what you do. Then answer with a short summary.")
TOOLS = [{"type": "function", "function": {
    "name": name, "description": about,
    "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    for name, about, arg in (("read_file", "Read a file", "path"), ("search", "Search the code", "query"),
                             ("run_tests", "Run tests", "target"))]
PREFACES = ("Checking.", "Let me look.", "Next step.", "Running it.", "Reading more.", "Searching.")
WORDS = ("alpha beta gamma delta value index parser token buffer cache block queue worker request reply stream "
         "config engine module error result assert return import class def self list dict key path line file "
         "test case check pass fail retry timeout limit budget count total offset length window batch shard "
         "node edge graph tree leaf root branch merge split join read write open close lock event state").split()


class BenchError(ValueError):
    """Bad benchmark input: the message names the option."""


class Mismatch(RuntimeError):
    """A system did not decode or count the planned tokens: the comparison would not be fair."""


# ------------------------------------------------------------------------------------------- workload
@dataclass
class Turn:
    """One model call of a job: the forced reply (text and ids, EOS last), and for a
    tool call its content, call and the tool's result and duration."""

    reply: str
    out_ids: List[int]
    prompt_ids: List[int]           # the conversation so far, as the gateway renders it
    content: Optional[str] = None   # the text before the call
    call: Optional[Dict[str, Any]] = None  # {"name", "arguments": dict}
    result: Optional[str] = None
    tool_s: float = 0.0             # before time scaling


@dataclass
class Job:
    index: int
    arrival_s: float                # before time scaling
    messages: List[Dict[str, Any]]  # system + user
    turns: List[Turn] = field(default_factory=list)

    def conversation(self, k: int) -> List[Dict[str, Any]]:
        """The messages a client sends for turn ``k``: the first ones, then each
        earlier turn's assistant message and tool result."""
        msgs = list(self.messages)
        for i, t in enumerate(self.turns[:k]):
            cid = f"call_{self.index}_{i}"
            msgs.append({"role": "assistant", "content": t.content, "tool_calls": [
                {"id": cid, "type": "function",
                 "function": {"name": t.call["name"], "arguments": json.dumps(t.call["arguments"])}}]})
            msgs.append({"role": "tool", "tool_call_id": cid, "content": t.result})
        return msgs


@dataclass(frozen=True)
class Workload:
    jobs: int
    turns: Tuple[int, int]
    tool_s: float
    tool_sigma: float
    result_tokens: Tuple[int, int]
    arrival_s: float


def parse_range(text: str, option: str) -> Tuple[int, int]:
    """``20`` or ``20-40`` (inclusive), positive integers."""
    parts = str(text).split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if lo < 1 or hi < lo:
        raise BenchError(f"{option} must be N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_variants(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names or len(set(names)) != len(names):
        raise BenchError(f"--variants: {bad[0] if bad else text!r} is not a list of distinct systems of "
                         f"{', '.join(VARIANTS)}")
    return names


def _text(rng: random.Random, tokenizer: Any, head: str, n_tokens: int) -> str:
    """``head`` then random words, ``n_tokens`` tokens or one word more."""
    words: List[str] = []
    while len(tokenizer.encode(head + " ".join(words))) < n_tokens:
        words.extend(rng.choice(WORDS) for _ in range(4))
        if rng.random() < 0.3:
            words.append("\n")
    return head + " ".join(words).replace(" \n ", "\n")


def _call(rng: random.Random) -> Dict[str, Any]:
    w = lambda: rng.choice(WORDS)  # noqa: E731
    name = rng.choice([t["function"]["name"] for t in TOOLS])
    args = {"read_file": {"path": f"src/{w()}/{w()}.py"}, "search": {"query": f"{w()} {w()}"},
            "run_tests": {"target": f"tests/test_{w()}.py"}}[name]
    return {"name": name, "arguments": args}


def build_jobs(tokenizer: Any, fmt: Any, w: Workload, seed: int, max_model_len: int = MAX_MODEL_LEN) -> List[Job]:
    """The jobs of one repeat (all of it drawn from ``seed``), every turn's prompt ids
    rendered as the gateway renders them.  Raises :class:`BenchError` when a job's
    conversation would not fit ``max_model_len``."""
    from interlace.gateway.prompt import render_messages

    rng = random.Random(seed)
    eos = min(tokenizer.eos_token_ids)
    jobs: List[Job] = []
    t = 0.0
    for j in range(w.jobs):
        job = Job(j, t, [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": _text(rng, tokenizer, f"Task {seed}-{j}: fix the failing "
                                                                           "test. Notes: ", 40)}])
        t += rng.expovariate(1 / w.arrival_s) if w.arrival_s > 0 else 0.0
        n = rng.randint(*w.turns)
        for k in range(n):
            prompt = render_messages(tokenizer, job.conversation(k), TOOLS, fmt)
            if k == n - 1:
                reply = _text(rng, tokenizer, "Done. ", 16)
                turn = Turn(reply, tokenizer.encode(reply) + [eos], prompt)
            else:
                content, call = rng.choice(PREFACES), _call(rng)
                reply = f"{content}\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
                turn = Turn(reply, tokenizer.encode(reply) + [eos], prompt, content, call,
                            _text(rng, tokenizer, "", rng.randint(*w.result_tokens)),
                            rng.lognormvariate(math.log(w.tool_s), w.tool_sigma))
            if len(prompt) + len(turn.out_ids) > max_model_len:
                raise BenchError(f"job {j} needs {len(prompt) + len(turn.out_ids)} tokens at turn {k + 1} of {n}, "
                                 f"more than max_model_len {max_model_len}: lower --turns or --result-tokens")
            job.turns.append(turn)
        jobs.append(job)
    return jobs


# ------------------------------------------------------------------------------------------- clients
@dataclass
class TurnRecord:
    job: int
    turn: int
    start_s: float                  # since the run's start
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: Optional[int]    # None: the server did not report it
    tool_s: float = 0.0             # the tool's sleep after this turn, as slept


async def _events(http: Any, url: str, body: Dict[str, Any]):
    """The parsed server-sent events of a streamed POST, each with its arrival time."""
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield time.perf_counter(), json.loads(line[6:])


def _cached(usage: Dict[str, Any]) -> Optional[int]:
    details = usage.get("prompt_tokens_details")
    return None if not details or details.get("cached_tokens") is None else int(details["cached_tokens"])


class GatewayClient:
    """Chat completions through the gateway, the reply forced by ``interlace.replay``."""

    def __init__(self, http: Any, url: str):
        self.http, self.url = http, url.rstrip("/") + "/v1/chat/completions"

    async def turn(self, job: Job, k: int) -> Tuple[float, float, Dict[str, Any]]:
        t = job.turns[k]
        body = {"model": MODEL_NAME, "messages": job.conversation(k), "tools": TOOLS, "temperature": 0,
                "max_tokens": len(t.out_ids), "stream": True, "stream_options": {"include_usage": True},
                "interlace": {"replay": t.reply}}
        t0, first, usage, finish = time.perf_counter(), None, None, None
        content, name, args = "", "", ""
        async for now, ev in _events(self.http, self.url, body):
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                d = ch.get("delta") or {}
                if first is None and (d.get("content") or d.get("tool_calls")):
                    first = now
                content += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    name += (tc.get("function") or {}).get("name") or ""
                    args += (tc.get("function") or {}).get("arguments") or ""
                finish = ch.get("finish_reason") or finish
        end = time.perf_counter()
        if usage is None or first is None:
            raise Mismatch(f"job {job.index} turn {k}: the stream carried no output or no usage")
        if t.call is None:
            ok = finish == "stop" and content == t.reply
        else:
            ok = (finish == "tool_calls" and content.strip() == t.content and name == t.call["name"]
                  and json.loads(args or "null") == t.call["arguments"])
        if not ok:
            raise Mismatch(f"job {job.index} turn {k}: the gateway answered {content!r} {name} {args} "
                           f"({finish}), not the forced reply {t.reply!r}")
        return first - t0, end - t0, usage


class StockClient:
    """``/v1/completions`` of a stock vLLM server with the gateway's prompt ids and
    the reply's ids forced by a token-id grammar."""

    def __init__(self, http: Any, url: str, model: str):
        self.http, self.url, self.model = http, url.rstrip("/") + "/completions", model

    async def turn(self, job: Job, k: int) -> Tuple[float, float, Dict[str, Any]]:
        t = job.turns[k]
        body = {"model": self.model, "prompt": t.prompt_ids, "temperature": 0, "max_tokens": len(t.out_ids),
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
                "structured_outputs": {"grammar": "start: " + " ".join(f"<[{i}]>" for i in t.out_ids)}}
        t0, first, usage, ids = time.perf_counter(), None, None, []
        async for now, ev in _events(self.http, self.url, body):
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                if first is None and (ch.get("text") or ch.get("token_ids")):
                    first = now
                ids += ch.get("token_ids") or []
        end = time.perf_counter()
        if usage is None or first is None:
            raise Mismatch(f"job {job.index} turn {k}: the stream carried no output or no usage")
        if ids != t.out_ids:
            raise Mismatch(f"job {job.index} turn {k}: vllm serve decoded {ids}, not the forced {t.out_ids}")
        return first - t0, end - t0, usage


async def run_jobs(client: Any, jobs: Sequence[Job], time_scale: float) -> Tuple[List[TurnRecord], float]:
    """Every job at its arrival, turn after turn with the tool's sleep between; the
    records of every turn and the wall time from the first arrival to the last answer.
    Each turn's usage is checked against the plan (:class:`Mismatch`)."""
    records: List[TurnRecord] = []
    t0 = time.perf_counter() + 0.05

    async def job_loop(job: Job) -> None:
        await asyncio.sleep(max(0.0, t0 + job.arrival_s * time_scale - time.perf_counter()))
        for k, t in enumerate(job.turns):
            start = time.perf_counter() - t0
            ttft, e2e, usage = await client.turn(job, k)
            if usage.get("prompt_tokens") != len(t.prompt_ids) or usage.get("completion_tokens") != len(t.out_ids):
                raise Mismatch(f"job {job.index} turn {k}: usage {usage} counts other tokens than the plan "
                               f"({len(t.prompt_ids)} prompt, {len(t.out_ids)} completion)")
            rec = TurnRecord(job.index, k, start, ttft, e2e, usage["prompt_tokens"], usage["completion_tokens"],
                             _cached(usage))
            if t.call is not None:
                s = time.perf_counter()
                await asyncio.sleep(t.tool_s * time_scale)
                rec.tool_s = time.perf_counter() - s
            records.append(rec)

    await asyncio.gather(*(job_loop(j) for j in jobs))
    return records, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------- accounting
def _p90(xs: Sequence[float]) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    pos = 0.9 * (len(s) - 1)  # linear interpolation between closest ranks (numpy's default)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def summarize_run(records: Sequence[TurnRecord], jobs: Sequence[Job], time_scale: float, wall_s: float
                  ) -> Dict[str, Any]:
    """One run's metrics.  A job's completion time runs from its arrival to the end of
    its last turn; its model time is that less the tool sleeps it waited."""
    by_job: Dict[int, List[TurnRecord]] = {}
    for r in records:
        by_job.setdefault(r.job, []).append(r)
    if sorted(by_job) != [j.index for j in jobs] or any(len(by_job[j.index]) != len(j.turns) for j in jobs):
        raise ValueError("the records do not cover every turn of every job once")
    job_s, model_s = [], []
    for j in jobs:
        rs = sorted(by_job[j.index], key=lambda r: r.turn)
        done = rs[-1].start_s + rs[-1].e2e_s - j.arrival_s * time_scale
        job_s.append(done)
        model_s.append(done - sum(r.tool_s for r in rs))
    follow = [r for r in records if r.turn > 0]
    reported = [r for r in follow if r.cached_tokens is not None]
    return {
        "jobs": len(jobs), "turns": len(records), "wall_s": wall_s,
        "job_mean_s": statistics.fmean(job_s), "job_p90_s": _p90(job_s),
        "model_mean_s": statistics.fmean(model_s),
        "ttft_mean_s": statistics.fmean(r.ttft_s for r in follow) if follow else None,
        "ttft_p90_s": _p90([r.ttft_s for r in follow]),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "completion_tokens": sum(r.completion_tokens for r in records),
        "followup_prompt_tokens": sum(r.prompt_tokens for r in follow),
        "followup_cached_tokens": sum(r.cached_tokens for r in reported) if reported else None,
        "followup_cached_frac": (sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)
                                 if reported and len(reported) == len(follow) else None),
        "turns_per_s": len(records) / wall_s,
    }


SUMMARY_KEYS = ("job_mean_s", "job_p90_s", "model_mean_s", "ttft_mean_s", "ttft_p90_s", "followup_cached_frac",
                "server_prefix_hit_frac", "turns_per_s")


def summarize_repeats(runs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Optional[float]]]:
    """Per metric: the median over the repeats and the min and max."""
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for k in SUMMARY_KEYS:
        xs = [r[k] for r in runs if r.get(k) is not None]
        out[k] = ({"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs
                  else {"median": None, "min": None, "max": None, "n": 0})
    return out


def ratios(summ: Dict[str, Dict[str, Any]], base: Dict[str, Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """Each metric's median over the baseline's (lower is better for times; turns/s higher)."""
    out = {}
    for k in ("job_mean_s", "job_p90_s", "model_mean_s", "ttft_mean_s", "ttft_p90_s", "turns_per_s"):
        a, b = summ[k]["median"], base[k]["median"]
        out[k] = a / b if a is not None and b else None
    return out


def _fmt(cell: Dict[str, Any], digits: int = 2, pct: bool = False) -> str:
    if cell["median"] is None:
        return "n/a"
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:.{digits}f}")
    return f(cell["median"]) + (f" [{f(cell['min'])}-{f(cell['max'])}]" if cell["n"] > 1 else "")


def table(names: Sequence[str], summaries: Dict[str, Dict[str, Any]]) -> List[str]:
    """The markdown table (medians over the repeats, [min-max]) and the ratio lines."""
    lines = ["| system | job mean s | job p90 s | job less tools mean s | follow-up TTFT mean s | "
             "follow-up TTFT p90 s | follow-up cached / prompt | server prefix hits (all turns) | turns/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        s = summaries[n]
        lines.append(f"| {n} | {_fmt(s['job_mean_s'])} | {_fmt(s['job_p90_s'])} | {_fmt(s['model_mean_s'])} | "
                     f"{_fmt(s['ttft_mean_s'], 3)} | {_fmt(s['ttft_p90_s'], 3)} | "
                     f"{_fmt(s['followup_cached_frac'], pct=True)} | {_fmt(s['server_prefix_hit_frac'], pct=True)} | "
                     f"{_fmt(s['turns_per_s'], 3)} |")
    if BASELINE in summaries:
        for n in names:
            if n == BASELINE:
                continue
            r = ratios(summaries[n], summaries[BASELINE])
            parts = [f"{label} {r[k]:.2f}x" for label, k in (
                ("job mean", "job_mean_s"), ("job p90", "job_p90_s"), ("job less tools", "model_mean_s"),
                ("follow-up TTFT mean", "ttft_mean_s"), ("TTFT p90", "ttft_p90_s"), ("turns/s", "turns_per_s"))
                     if r[k] is not None]
            lines.append(f"\n{n} vs {BASELINE} (medians): " + ", ".join(parts))
    return lines


# ------------------------------------------------------------------------------------------- systems
def _scrape(http_get: Any, url: str) -> Dict[str, float]:
    """The counters of ``/metrics`` this benchmark records: the gateway's pins, retention
    (hits, misses, evictions by reason), saved prefill and tokens recomputed after a resume,
    vLLM's prefix-cache queries and hits (name{labels} -> value)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Dict[str, float] = {}
    for fam in text_string_to_metric_families(http_get(url).text):
        for s in fam.samples:
            if any(k in s.name for k in ("pin", "prefill_tokens_saved", "prefix_cache_", "retention_",
                                         "recomputed_tokens")):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _prefix_hit_frac(delta: Dict[str, float]) -> Optional[float]:
    q = sum(v for k, v in delta.items() if k.startswith("vllm:prefix_cache_queries"))
    h = sum(v for k, v in delta.items() if k.startswith("vllm:prefix_cache_hits"))
    return h / q if q else None


class GatewayProcess:
    """``interlace serve`` with ``config`` on a free loopback port, in its own
    process group (its vLLM engine core is a child), until :meth:`close`."""

    def __init__(self, config: Dict[str, Any]):
        import httpx

        from interlace.engine_ext.vllm.engine import server_env

        self.dir = tempfile.mkdtemp(prefix="interlace-bench-jobs-")
        cfg = Path(self.dir) / "config.json"
        cfg.write_text(json.dumps(config))  # JSON is YAML
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env, self.ipc_dir = server_env(dict(os.environ))
        self.log = Path(self.dir) / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "interlace.cli", "serve", "--config", str(cfg),
                                          "--port", str(self.port), "--log-level", "warning"],
                                         env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600  # LAMPS measures a profile at the first start (cached)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                self.close()
                raise RuntimeError(f"interlace serve exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError("interlace serve did not answer /health in 600 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def gateway_config(variant: str, blocks: int, ranking: Optional[str], engine_extra: Dict[str, Any]
                   ) -> Dict[str, Any]:
    """The gateway's config for an Interlace variant: vLLM with ``blocks`` KV blocks,
    the replay extension allowed, ``interception: discard`` for ``interlace-discard``."""
    from .engines_trace import VLLM

    policy: Dict[str, Any] = {}
    if ranking:
        policy["ranking"] = ranking
    if variant == "interlace-discard":
        policy["interception"] = "discard"
    engine = {**VLLM, "max_model_len": MAX_MODEL_LEN, "args": {"num_gpu_blocks_override": blocks}, **engine_extra}
    return {"server": {"replay": True}, "plugins": {"entrypoints": False},
            "models": {MODEL_NAME: {"path": "embedded", "engine": engine}}, **({"engine": policy} if policy else {})}


@contextlib.contextmanager
def start_system(variant: str, model_dir: str, blocks: int, ranking: Optional[str],
                 engine_extra: Dict[str, Any]) -> Iterator[Tuple[Any, str]]:
    """(client factory taking an httpx.AsyncClient, its /metrics URL) for ``variant``."""
    if variant == BASELINE:
        from .engines_trace import _Server

        server = _Server(model_dir, blocks, MAX_MODEL_LEN, ["--enable-prompt-tokens-details"])
        try:
            yield (lambda http: StockClient(http, server.url, model_dir)), server.url[:-3] + "/metrics"
        finally:
            server.close()
        return
    gw = GatewayProcess(gateway_config(variant, blocks, ranking, engine_extra))
    try:
        yield (lambda http: GatewayClient(http, gw.url)), gw.url + "/metrics"
    finally:
        gw.close()


def measure_system(variant: str, model_dir: str, blocks: int, workloads: Sequence[List[Job]],
                   warm: List[Job], time_scale: float, ranking: Optional[str],
                   engine_extra: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Start ``variant``, warm it up, run every repeat's jobs; one result per repeat."""
    import httpx

    runs = []
    with start_system(variant, model_dir, blocks, ranking, engine_extra) as (make_client, metrics_url):
        async def go(jobs: Sequence[Job]) -> Tuple[List[TurnRecord], float]:
            limits = httpx.Limits(max_connections=len(jobs) + 4, max_keepalive_connections=len(jobs) + 4)
            async with httpx.AsyncClient(timeout=600, limits=limits) as http:
                return await run_jobs(make_client(http), jobs, time_scale)

        asyncio.run(go(warm))  # grammar compilation, first-request set-up: not measured
        for rep, jobs in enumerate(workloads):
            before = _scrape(httpx.get, metrics_url)
            records, wall = asyncio.run(go(jobs))
            delta = _delta(before, _scrape(httpx.get, metrics_url))
            run = summarize_run(records, jobs, time_scale, wall)
            run.update(variant=variant, repeat=rep, counters=delta, server_prefix_hit_frac=_prefix_hit_frac(delta),
                       records=[asdict(r) for r in sorted(records, key=lambda r: (r.job, r.turn))])
            print(f"  {variant} #{rep}: job mean {run['job_mean_s']:.2f} s, p90 {run['job_p90_s']:.2f} s, "
                  f"follow-up TTFT {run['ttft_mean_s'] or float('nan'):.3f} s, {run['turns']} turns in "
                  f"{wall:.1f} s", file=sys.stderr, flush=True)
            runs.append(run)
    return runs


# ------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="interlace bench jobs", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="vllm-serve,interlace",
                    help=f"systems, comma-separated, of {', '.join(VARIANTS)} (default vllm-serve,interlace)")
    ap.add_argument("--jobs", type=int, default=8, help="concurrent agent jobs (default 8)")
    ap.add_argument("--turns", default="20", help="model calls per job, N or LO-HI drawn per job (default 20)")
    ap.add_argument("--tool-s", type=float, default=2.0, help="median client tool duration, s (default 2)")
    ap.add_argument("--tool-sigma", type=float, default=0.5,
                    help="the tool durations' lognormal sigma (default 0.5: 90%% within 0.44x-2.3x the median)")
    ap.add_argument("--result-tokens", default="10-30", help="tokens of each tool result, LO-HI (default 10-30)")
    ap.add_argument("--arrival-s", type=float, default=1.0, help="mean gap between job starts, s (default 1)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiplies tool durations and arrival gaps")
    ap.add_argument("--kv-tokens", type=int, default=6144,
                    help="every system's KV cache, tokens (whole 128-token vLLM blocks; default 6144)")
    ap.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r for its texts, calls and times")
    ap.add_argument("--repeats", type=int, default=3, help="runs per system (default 3; the spread is min-max)")
    ap.add_argument("--ranking", help="the Interlace rows' ranking (default: Interlace's default, LAMPS, which "
                                      "measures a vLLM profile at its first start; fcfs isolates the pins)")
    ap.add_argument("--engine-extra", default="{}", help="JSON merged into the Interlace rows' engine section "
                                                          "(e.g. '{\"pin_budget\": 0.5}')")
    ap.add_argument("--json", metavar="PATH", help="write the machine, flags, every turn and the summaries as JSON")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except BenchError as e:
        print(f"interlace bench jobs: error: {e}", file=sys.stderr)
        return 2


def _workload(args: argparse.Namespace) -> Workload:
    w = workload(args)
    if -(-args.kv_tokens // VLLM_CPU_BLOCK) <= MAX_MODEL_LEN // VLLM_CPU_BLOCK:  # vLLM keeps one block back
        raise BenchError(f"--kv-tokens must hold one whole request (max_model_len {MAX_MODEL_LEN}) and the block "
                         f"vLLM keeps back: at least {MAX_MODEL_LEN + VLLM_CPU_BLOCK}, got {args.kv_tokens}")
    return w


def workload(args: argparse.Namespace) -> Workload:
    """The job model of the workload options (``--jobs``, ``--turns``, ``--tool-s`` ...), each checked
    (:class:`BenchError` naming the option); ``bench apis`` runs the same jobs."""
    for opt in ("jobs", "repeats", "kv_tokens"):
        if getattr(args, opt) < 1:
            raise BenchError(f"--{opt.replace('_', '-')} must be positive, got {getattr(args, opt)}")
    for opt in ("tool_s", "time_scale"):
        if not (math.isfinite(getattr(args, opt)) and getattr(args, opt) > 0):
            raise BenchError(f"--{opt.replace('_', '-')} must be a positive number, got {getattr(args, opt)}")
    if not (math.isfinite(args.tool_sigma) and args.tool_sigma >= 0):
        raise BenchError(f"--tool-sigma must be >= 0, got {args.tool_sigma}")
    if not (math.isfinite(args.arrival_s) and args.arrival_s >= 0):
        raise BenchError(f"--arrival-s must be >= 0, got {args.arrival_s}")
    return Workload(args.jobs, parse_range(args.turns, "--turns"), args.tool_s, args.tool_sigma,
                    parse_range(args.result_tokens, "--result-tokens"), args.arrival_s)


def _main(args: argparse.Namespace) -> int:
    names = parse_variants(args.variants)
    w = _workload(args)
    try:
        extra = json.loads(args.engine_extra)
    except json.JSONDecodeError as e:
        raise BenchError(f"--engine-extra is not JSON: {e}") from None
    if not isinstance(extra, dict):
        raise BenchError("--engine-extra must be a JSON object")

    import vllm

    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.machine import describe_machine, machine
    from interlace.engine_ext.tokenizer import Tokenizer
    from interlace.parsers.formats import HERMES

    model_dir = str(embedded_model_dir())
    tok = Tokenizer.from_model_dir(model_dir, needed_by="bench jobs")
    workloads = [build_jobs(tok, HERMES, w, args.seed + r) for r in range(args.repeats)]
    warm = build_jobs(tok, HERMES, Workload(1, (2, 2), 0.01, 0.0, (10, 10), 0.0), seed=-1)
    blocks = -(-args.kv_tokens // VLLM_CPU_BLOCK)
    peak = [sum(len(j.turns[-1].prompt_ids) + len(j.turns[-1].out_ids) for j in jobs) for jobs in workloads]
    tool_total = [sum(t.tool_s for j in jobs for t in j.turns) * args.time_scale for jobs in workloads]
    mach = machine(vllm=vllm.__version__)
    header = (f"bench jobs: {args.jobs} jobs x {args.turns} turns, tools lognormal median {args.tool_s:g} s "
              f"sigma {args.tool_sigma:g}, results {args.result_tokens} tokens, arrivals every {args.arrival_s:g} s "
              f"(mean), time x{args.time_scale:g}; embedded SmolLM2-135M-Instruct float32 on vLLM, KV cache "
              f"{blocks} x {VLLM_CPU_BLOCK} = {blocks * VLLM_CPU_BLOCK} tokens (the jobs' final contexts: "
              f"{min(peak)}-{max(peak)} tokens); ranking {args.ranking or 'default'}; engine extra {extra}; "
              f"{args.repeats} repeat(s) from seed {args.seed}")
    print(header, file=sys.stderr, flush=True)
    if args.repeats < 3:
        print("  (fewer than 3 repeats: a smoke run, not a measurement)", file=sys.stderr)
    runs: Dict[str, List[Dict[str, Any]]] = {}
    failed = False
    for n in names:
        t = time.monotonic()
        try:
            runs[n] = measure_system(n, model_dir, blocks, workloads, warm, args.time_scale, args.ranking, extra)
        except Exception as e:  # noqa: BLE001 -- a failed system is reported, the others still run
            failed = True
            print(f"  {n}: FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        print(f"  [{n}: {time.monotonic() - t:.0f} s with start-up]", file=sys.stderr, flush=True)
    done = [n for n in names if n in runs]
    summaries = {n: summarize_repeats(runs[n]) for n in done}
    totals = [sorted({(runs[n][i]["prompt_tokens"], runs[n][i]["completion_tokens"]) for n in done})
              for i in range(args.repeats)]
    same = bool(done) and all(len(t) == 1 for t in totals)
    print(f"\n{header}\nmachine: {describe_machine(mach)}\nflags: {' '.join(sys.argv[1:])}\n")
    for ln in table(done, summaries):
        print(ln)
    print(f"\nsame tokens on every system: {'yes' if same else 'NO'} (prompt and completion tokens per repeat: "
          f"{totals}); "
          f"tool time per repeat {', '.join(f'{x:.0f}' for x in tool_total)} s")
    for n in done:
        if n != BASELINE:
            print(f"{n} counters per repeat: {[r['counters'] for r in runs[n]]}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "header": header, "machine": mach, "flags": vars(args), "argv": sys.argv[1:],
            "kv_blocks": blocks, "block_size": VLLM_CPU_BLOCK, "max_model_len": MAX_MODEL_LEN,
            "final_context_tokens": peak, "tool_time_s": tool_total, "same_tokens": same,
            "summaries": summaries,
            "ratios": {n: ratios(summaries[n], summaries[BASELINE]) for n in done
                       if BASELINE in summaries and n != BASELINE},
            "runs": runs}, indent=1, default=str) + "\n")
        print(f"results: {args.json}")
    return 1 if failed or not same else 0


if __name__ == "__main__":
    raise SystemExit(main())
