"""What the kept engine context gives each API's follow-ups: the same agent
jobs through chat completions, the Responses API and the Messages API, against
a gateway that keeps no context (``interlace bench apis``, issue 33).

    interlace bench apis --jobs 4 --turns 10 --tool-s 1 --repeats 3 --json apis.json

Why a module of its own over ``interlace bench jobs``.  That benchmark
compares *servers* (Interlace on vLLM, stock ``vllm serve``) under one API;
this one compares *APIs* on one engine.  It reuses that benchmark's job model
as it is -- :func:`bench.agent_jobs.build_jobs` (the forced replies, each
turn's prompt ids as the gateway renders them), :func:`~bench.agent_jobs.run_jobs`
(Poisson arrivals, lognormal client tool times, the per-turn check of the
token counts) and its accounting -- and adds a client per API and the
variants' gateways.  An ``--api`` option there would have put a second axis
(API x server) into a table and a CLI built around one.

Variants (``--variants``), each on a gateway process of its own (the native
engine, the embedded SmolLM2-135M-Instruct in float32, the same KV cache,
``--ranking``, ``server.replay: true``): a gateway of its own so that no
variant finds another's blocks in the prefix cache (every variant runs the
same texts); all of them are started first, and every repeat runs each
variant in turn (the order rotated per repeat), so a slow spell of the
machine falls on every variant rather than on one:

* ``chat``: chat completions, the whole history each turn (as OpenAI clients
  send it);
* ``responses-prev``: the Responses API, ``store: true``; a follow-up sends
  ``previous_response_id`` and only the ``function_call_output`` item (with
  ``instructions`` and ``tools``, which OpenAI does not carry over);
* ``responses-full``: the Responses API, ``store: false``, the whole input
  each turn -- the earlier output items echoed back as the server returned
  them, then the ``function_call_output`` (the OpenAI Agents SDK's default);
* ``messages``: the Anthropic Messages API, the whole history each turn
  (the server's ``text`` and ``tool_use`` blocks echoed back, then a user
  turn with the ``tool_result``);
* ``chat-no-retention`` (the baseline): the chat jobs on a gateway with
  ``retention.enabled: false`` -- the prefix cache only, a stock server's
  strongest path today.

Same tokens everywhere.  Every reply is forced (``interlace.replay``, on all
three APIs).  Each turn is checked (:class:`bench.agent_jobs.Mismatch` fails
the run): the prompt and completion tokens the API reports equal the plan's
(so every API rendered the very prompt ids of the chat path), and the text
and call it streamed are the forced ones.

Measured per variant (median over ``--repeats`` with the min-max spread):
the follow-ups' time to first token (the first streamed delta carrying
output: median and p90), the prompt tokens each follow-up prefilled (prompt
less cached; mean per follow-up), its cached tokens (chat's
``prompt_tokens_details.cached_tokens``, the Responses API's
``input_tokens_details.cached_tokens``, the Messages API's
``cache_read_input_tokens``), the job completion time (mean and p90), and
each one's ratio to ``chat-no-retention``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import agent_jobs as aj
from .agent_jobs import BenchError, Job, Mismatch, Workload

VARIANTS = ("chat", "responses-prev", "responses-full", "messages", "chat-no-retention")
BASELINE = "chat-no-retention"
MODEL_NAME = aj.MODEL_NAME
#: The Responses API's function tools and the Messages API's tools: the chat tools, in each API's shape.
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in aj.TOOLS]
MESSAGES_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"]} for t in aj.TOOLS]


def parse_variants(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names or len(set(names)) != len(names):
        raise BenchError(f"--variants: {bad[0] if bad else text!r} is not a list of distinct variants of "
                         f"{', '.join(VARIANTS)}")
    return names


def _mismatch(job: Job, k: int, got: str) -> Mismatch:
    return Mismatch(f"job {job.index} turn {k}: the gateway answered {got}, not the forced reply "
                    f"{job.turns[k].reply!r}")


# ------------------------------------------------------------------------------------------- clients
class ResponsesClient:
    """``POST /v1/responses``, streamed.  ``chained``: ``store: true`` and a follow-up by
    ``previous_response_id`` with only the tool's output; else ``store: false`` and the
    whole input, the earlier output items echoed back as they came."""

    def __init__(self, http: Any, url: str, chained: bool):
        self.http, self.url, self.chained = http, url.rstrip("/") + "/v1/responses", chained
        self.state: Dict[int, Tuple[Optional[str], List[Dict[str, Any]]]] = {}  # job -> (last id, input items)

    def _body(self, job: Job, k: int) -> Dict[str, Any]:
        t = job.turns[k]
        prev_id, items = self.state.get(job.index, (None, []))
        if k == 0:
            items = [{"role": "user", "content": job.messages[1]["content"]}]
        body = {"model": MODEL_NAME, "instructions": job.messages[0]["content"], "tools": RESPONSES_TOOLS,
                "temperature": 0, "max_output_tokens": len(t.out_ids), "stream": True, "store": self.chained,
                "interlace": {"replay": t.reply}}
        if self.chained and k:
            body.update(previous_response_id=prev_id, input=items[-1:])  # the function_call_output alone
        else:
            body["input"] = items
        return body

    async def turn(self, job: Job, k: int) -> Tuple[float, float, Dict[str, Any]]:
        t = job.turns[k]
        body = self._body(job, k)
        t0, first, response = time.perf_counter(), None, None
        async for now, ev in aj._events(self.http, self.url, body):
            kind = ev.get("type")
            if first is None and kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
                first = now
            if kind in ("response.completed", "response.incomplete", "response.failed"):
                response = ev["response"]
            elif kind == "error":
                raise RuntimeError(f"{self.url}: error event {ev}")
        end = time.perf_counter()
        if response is None or first is None:
            raise Mismatch(f"job {job.index} turn {k}: the stream carried no output or no final response")
        out = response["output"]
        text = "".join(c["text"] for it in out if it["type"] == "message" for c in it["content"]
                       if c["type"] == "output_text")
        calls = [it for it in out if it["type"] == "function_call"]
        if t.call is None:
            ok = response["status"] == "completed" and text == t.reply and not calls
        else:
            ok = (response["status"] == "completed" and text.strip() == t.content and len(calls) == 1
                  and calls[0]["name"] == t.call["name"] and json.loads(calls[0]["arguments"]) == t.call["arguments"])
        if not ok:
            raise _mismatch(job, k, f"{text!r} {[(c['name'], c['arguments']) for c in calls]} ({response['status']})")
        if t.call is not None:  # the next turn's input: what came back, then the tool's output
            prev_items = [] if self.chained else list(body["input"]) + out
            self.state[job.index] = (response["id"], prev_items + [
                {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": t.result}])
        u = response["usage"]
        return first - t0, end - t0, {"prompt_tokens": u["input_tokens"], "completion_tokens": u["output_tokens"],
                                      "prompt_tokens_details": u.get("input_tokens_details")}


class MessagesClient:
    """``POST /v1/messages``, streamed; the whole history each turn, the assistant's
    blocks echoed back as they came, then a user turn with the ``tool_result``."""

    def __init__(self, http: Any, url: str):
        self.http, self.url = http, url.rstrip("/") + "/v1/messages"
        self.history: Dict[int, List[Dict[str, Any]]] = {}

    async def turn(self, job: Job, k: int) -> Tuple[float, float, Dict[str, Any]]:
        t = job.turns[k]
        messages = self.history.get(job.index) if k else [{"role": "user", "content": job.messages[1]["content"]}]
        body = {"model": MODEL_NAME, "system": job.messages[0]["content"], "tools": MESSAGES_TOOLS,
                "messages": messages, "max_tokens": len(t.out_ids), "temperature": 0, "stream": True,
                "interlace": {"replay": t.reply}}
        t0, first, blocks, args, stop, usage = time.perf_counter(), None, [], {}, None, None
        async for now, ev in aj._events(self.http, self.url, body):
            kind = ev.get("type")
            if kind == "content_block_start":
                blocks.append(dict(ev["content_block"]))
            elif kind == "content_block_delta":
                first = first if first is not None else now
                d = ev["delta"]
                if d["type"] == "text_delta":
                    blocks[ev["index"]]["text"] += d["text"]
                else:
                    args[ev["index"]] = args.get(ev["index"], "") + d["partial_json"]
            elif kind == "content_block_stop" and ev["index"] in args:
                blocks[ev["index"]]["input"] = json.loads(args[ev["index"]])
            elif kind == "message_delta":
                stop, usage = ev["delta"]["stop_reason"], ev["usage"]
            elif kind == "error":
                raise RuntimeError(f"{self.url}: error event {ev}")
        end = time.perf_counter()
        if usage is None or first is None:
            raise Mismatch(f"job {job.index} turn {k}: the stream carried no output or no usage")
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        uses = [b for b in blocks if b["type"] == "tool_use"]
        if t.call is None:
            ok = stop == "end_turn" and text == t.reply and not uses
        else:
            ok = (stop == "tool_use" and text.strip() == t.content and len(uses) == 1
                  and uses[0]["name"] == t.call["name"] and uses[0]["input"] == t.call["arguments"])
        if not ok:
            raise _mismatch(job, k, f"{text!r} {[(b['name'], b['input']) for b in uses]} ({stop})")
        if t.call is not None:
            self.history[job.index] = messages + [
                {"role": "assistant", "content": blocks},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0]["id"],
                                              "content": t.result}]}]
        cached = usage.get("cache_read_input_tokens") or 0
        return first - t0, end - t0, {"prompt_tokens": usage["input_tokens"] + cached,
                                      "completion_tokens": usage["output_tokens"],
                                      "prompt_tokens_details": {"cached_tokens": cached}}


def make_client(variant: str, http: Any, url: str) -> Any:
    """The client of ``variant`` for the gateway at ``url``."""
    if variant in ("chat", BASELINE):
        return aj.GatewayClient(http, url)
    if variant.startswith("responses-"):
        return ResponsesClient(http, url, chained=variant == "responses-prev")
    return MessagesClient(http, url)


# ------------------------------------------------------------------------------------------- accounting
def summarize_run(records: Sequence[aj.TurnRecord], jobs: Sequence[Job], time_scale: float, wall_s: float
                  ) -> Dict[str, Any]:
    """bench jobs' metrics of one run, plus the follow-ups' TTFT median and what each
    follow-up prefilled (prompt less cached) and found cached, on average."""
    run = aj.summarize_run(records, jobs, time_scale, wall_s)
    follow = [r for r in records if r.turn > 0]
    if any(r.cached_tokens is None for r in follow):
        raise Mismatch("a follow-up's usage reported no cached tokens")
    run.update(ttft_median_s=statistics.median(r.ttft_s for r in follow) if follow else None,
               prefilled_mean=statistics.fmean(r.prompt_tokens - r.cached_tokens for r in follow) if follow else None,
               cached_mean=statistics.fmean(r.cached_tokens for r in follow) if follow else None)
    return run


SUMMARY_KEYS = ("ttft_median_s", "ttft_p90_s", "prefilled_mean", "cached_mean", "followup_cached_frac",
                "job_mean_s", "job_p90_s", "model_mean_s")
RATIO_KEYS = ("ttft_median_s", "ttft_p90_s", "prefilled_mean", "job_mean_s", "job_p90_s", "model_mean_s")


def summarize_repeats(runs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Optional[float]]]:
    """Per metric: the median over the repeats and the min and max."""
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for k in SUMMARY_KEYS:
        xs = [r[k] for r in runs if r.get(k) is not None]
        out[k] = ({"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs
                  else {"median": None, "min": None, "max": None, "n": 0})
    return out


def ratios(summ: Dict[str, Dict[str, Any]], base: Dict[str, Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """Each metric's median over the baseline's (lower is better for all of them)."""
    out = {}
    for k in RATIO_KEYS:
        a, b = summ[k]["median"], base[k]["median"]
        out[k] = a / b if a is not None and b else None
    return out


def _fmt(cell: Dict[str, Any], digits: int, pct: bool = False) -> str:
    if cell["median"] is None:
        return "n/a"
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:.{digits}f}")
    return f(cell["median"]) + (f" [{f(cell['min'])}-{f(cell['max'])}]" if cell["n"] > 1 else "")


def table(names: Sequence[str], summaries: Dict[str, Dict[str, Any]]) -> List[str]:
    """The markdown table (medians over the repeats, [min-max]) with each variant's ratios to the baseline."""
    lines = ["| variant | follow-up TTFT median s | TTFT p90 s | prefilled / follow-up | cached / follow-up | "
             "cached / prompt | job mean s | job p90 s | job less tools s | vs baseline: TTFT, prefilled, job |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = summaries.get(BASELINE)
    for n in names:
        s = summaries[n]
        r = ratios(s, base) if base is not None else {}
        vs = ", ".join(f"{r[k]:.2f}x" if r.get(k) is not None else "n/a"
                       for k in ("ttft_median_s", "prefilled_mean", "job_mean_s")) if base is not None else "n/a"
        lines.append(f"| {n} | {_fmt(s['ttft_median_s'], 3)} | {_fmt(s['ttft_p90_s'], 3)} | "
                     f"{_fmt(s['prefilled_mean'], 0)} | {_fmt(s['cached_mean'], 0)} | "
                     f"{_fmt(s['followup_cached_frac'], 0, pct=True)} | {_fmt(s['job_mean_s'], 2)} | "
                     f"{_fmt(s['job_p90_s'], 2)} | {_fmt(s['model_mean_s'], 2)} | {vs} |")
    return lines


# ------------------------------------------------------------------------------------------- gateways
def gateway_config(variant: str, kv_tokens: int, ranking: str, policy: Dict[str, Any]) -> Dict[str, Any]:
    """The config of ``variant``'s gateway: the native engine over the embedded model in float32,
    ``kv_tokens`` of KV cache, the replay extension allowed, stored responses in memory; the
    baseline's keeps no context (``retention.enabled: false``)."""
    model: Dict[str, Any] = {"path": "embedded", "dtype": "float32", "kv_cache_tokens": kv_tokens,
                             "max_model_len": aj.MAX_MODEL_LEN}
    if variant == BASELINE:
        model["retention"] = {"enabled": False}
    return {"server": {"replay": True, "responses": {"path": ":memory:"}}, "plugins": {"entrypoints": False},
            "engine": {"ranking": ranking, **policy}, "models": {MODEL_NAME: model}}


async def run_variant(variant: str, url: str, jobs: Sequence[Job], time_scale: float
                      ) -> Tuple[List[aj.TurnRecord], float]:
    """``jobs`` through ``variant``'s client against the gateway at ``url`` (bench jobs' run:
    every turn's token counts checked against the plan)."""
    import httpx

    limits = httpx.Limits(max_connections=len(jobs) + 4, max_keepalive_connections=len(jobs) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        return await aj.run_jobs(make_client(variant, http, url), jobs, time_scale)


def measure(names: Sequence[str], workloads: Sequence[List[Job]], warm: List[Job], time_scale: float,
            kv_tokens: int, ranking: str, policy: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """Start every variant's gateway, warm each up, then per repeat run each variant in
    turn (the order rotated by one per repeat); each variant's runs, one per repeat."""
    import httpx

    runs: Dict[str, List[Dict[str, Any]]] = {n: [] for n in names}
    with contextlib.ExitStack() as stack:
        urls = {}
        for n in names:
            t = time.monotonic()
            gw = aj.GatewayProcess(gateway_config(n, kv_tokens, ranking, policy))
            stack.callback(gw.close)
            urls[n] = gw.url
            asyncio.run(run_variant(n, gw.url, warm, time_scale))  # first-request set-up: not measured
            print(f"  [{n}: started and warmed in {time.monotonic() - t:.0f} s]", file=sys.stderr, flush=True)
        for rep, jobs in enumerate(workloads):
            order = list(names[rep % len(names):]) + list(names[:rep % len(names)])
            for n in order:
                before = aj._scrape(httpx.get, urls[n] + "/metrics")
                records, wall = asyncio.run(run_variant(n, urls[n], jobs, time_scale))
                run = summarize_run(records, jobs, time_scale, wall)
                after = aj._scrape(httpx.get, urls[n] + "/metrics")
                run.update(variant=n, repeat=rep, counters=aj._delta(before, after),
                           records=[asdict(r) for r in sorted(records, key=lambda r: (r.job, r.turn))])
                print(f"  {n} #{rep}: follow-up TTFT median {run['ttft_median_s']:.3f} s, prefilled "
                      f"{run['prefilled_mean']:.0f} / cached {run['cached_mean']:.0f} tokens per follow-up, "
                      f"job mean {run['job_mean_s']:.2f} s ({wall:.1f} s)", file=sys.stderr, flush=True)
                runs[n].append(run)
    return runs


# ------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="interlace bench apis", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--jobs", type=int, default=4, help="concurrent agent jobs (default 4)")
    ap.add_argument("--turns", default="10", help="model calls per job, N or LO-HI drawn per job (default 10)")
    ap.add_argument("--tool-s", type=float, default=1.0, help="median client tool duration, s (default 1)")
    ap.add_argument("--tool-sigma", type=float, default=0.5, help="the tool durations' lognormal sigma (default 0.5)")
    ap.add_argument("--result-tokens", default="10-30", help="tokens of each tool result, LO-HI (default 10-30)")
    ap.add_argument("--arrival-s", type=float, default=0.5, help="mean gap between job starts, s (default 0.5)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiplies tool durations and arrival gaps")
    ap.add_argument("--kv-tokens", type=int, default=32768,
                    help="every gateway's KV cache, tokens (default 32768: every repeat's contexts fit, nothing "
                         "is evicted)")
    ap.add_argument("--ranking", default="fcfs", help="every gateway's ranking (default fcfs: LAMPS's profile "
                                                       "measurement at start-up left out)")
    ap.add_argument("--policy", default="{}", help="JSON merged into every gateway's engine section "
                                                    "(e.g. '{\"interception\": \"preserve\"}')")
    ap.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r for its texts, calls and times")
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant (default 3; the spread is min-max)")
    ap.add_argument("--json", metavar="PATH", help="write the machine, flags, every turn and the summaries as JSON")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except BenchError as e:
        print(f"interlace bench apis: error: {e}", file=sys.stderr)
        return 2


def _workload(args: argparse.Namespace) -> Workload:
    return aj.workload(args)  # bench jobs' options and checks (without its vLLM cache bound)


def _main(args: argparse.Namespace) -> int:
    names = parse_variants(args.variants)
    w = _workload(args)
    try:
        policy = json.loads(args.policy)
    except json.JSONDecodeError as e:
        raise BenchError(f"--policy is not JSON: {e}") from None
    if not isinstance(policy, dict):
        raise BenchError("--policy must be a JSON object")

    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.machine import describe_machine, machine
    from interlace.engine_ext.tokenizer import Tokenizer
    from interlace.parsers.formats import HERMES

    tok = Tokenizer.from_model_dir(str(embedded_model_dir()), needed_by="bench apis")
    workloads = [aj.build_jobs(tok, HERMES, w, args.seed + r) for r in range(args.repeats)]
    warm = aj.build_jobs(tok, HERMES, Workload(1, (2, 2), 0.01, 0.0, (10, 10), 0.0), seed=-1)
    peak = [sum(len(j.turns[-1].prompt_ids) + len(j.turns[-1].out_ids) for j in jobs) for jobs in workloads]
    mach = machine()
    header = (f"bench apis: {args.jobs} jobs x {args.turns} turns, tools lognormal median {args.tool_s:g} s "
              f"sigma {args.tool_sigma:g}, results {args.result_tokens} tokens, arrivals every {args.arrival_s:g} s "
              f"(mean), time x{args.time_scale:g}; embedded SmolLM2-135M-Instruct float32 on the native engine, "
              f"KV cache {args.kv_tokens} tokens per gateway (a repeat's final contexts: {min(peak)}-{max(peak)} "
              f"tokens, {sum(peak)} over all repeats); ranking {args.ranking}; policy {policy}; "
              f"{args.repeats} repeat(s) from seed {args.seed}")
    print(header, file=sys.stderr, flush=True)
    if args.repeats < 3:
        print("  (fewer than 3 repeats: a smoke run, not a measurement)", file=sys.stderr)
    runs = measure(names, workloads, warm, args.time_scale, args.kv_tokens, args.ranking, policy)
    summaries = {n: summarize_repeats(runs[n]) for n in names}
    totals = [sorted({(runs[n][i]["prompt_tokens"], runs[n][i]["completion_tokens"]) for n in names})
              for i in range(args.repeats)]
    same = all(len(t) == 1 for t in totals)  # run_jobs also checked every turn against the plan
    print(f"\n{header}\nmachine: {describe_machine(mach)}\nflags: {' '.join(sys.argv[1:])}\n")
    for ln in table(names, summaries):
        print(ln)
    print(f"\nsame tokens in every variant: {'yes' if same else 'NO'} (prompt and completion tokens per repeat: "
          f"{totals})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "header": header, "machine": mach, "flags": vars(args), "argv": sys.argv[1:],
            "final_context_tokens": peak, "same_tokens": same, "summaries": summaries,
            "ratios": {n: ratios(summaries[n], summaries[BASELINE]) for n in names
                       if BASELINE in summaries and n != BASELINE},
            "runs": runs}, indent=1, default=str) + "\n")
        print(f"results: {args.json}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
