"""Agent-trace benchmark: interception handling and ranking policies side by
side, on the native engine or in the simulator (``interlace bench trace``).

    interlace bench trace --trace mixed --rates 0.5,1,2 --sim h100-gpt-j-6b
    interlace bench trace --trace mixed --rates 0.5,1 --num-requests 10 --max-context 192 \\
        --time-scale 0.1 --kv-cache-tokens 1024
    interlace bench trace --trace mixed --rates 2 --sim h100-gpt-j-6b --ablation

Why both.  The issue's targets are about a GPU serving a 6B model, which this
project has no machine for: the simulator runs the *same* policy objects
against a cost model (a roofline-derived H100 profile, labelled as derived),
and the native engine shows, on a small trace with the embedded model, that
the policies keep the same order on a real engine (and, with a measured
profile, that the simulator predicts the engine: ``tests/test_sim_validation.py``).

Variants (``--variants``; name -> interception, ranking, prefix caching):

* ``vllm``      vllm + fcfs + prefix caching: vLLM today (a tool result is a
  new request; the automatic prefix cache keeps what was not evicted) -- the
  baseline of the headline figures;
* ``vllm-old``  vllm + fcfs, no prefix caching: Discard+FCFS as the papers
  measured vLLM (a resumed request queues as a new one and recomputes at
  once) -- a historical row, printed but never a headline;
* ``preserve``, ``swap``, ``infercept``: that handling + fcfs + prefix caching
  (``infercept``, InferCept+FCFS, is LAMPS' baseline);
* ``lamps``     infercept + lamps with ``make_ranking``'s defaults (LAMPS as
  published builds on InferCept's handling);
* ``lamps-segment`` / ``lamps-job``: LAMPS' horizon set to the paper's
  segment (each call starts a new "request") / to the whole job (adds the
  later segments); ``lamps-at-call``: the handling LAMPS predicted for a
  segment applied at its call (Algorithm 1, lines 35-42) instead of deciding
  afresh -- side by side so the defaults are chosen by measurement;
* ``interlace`` Interlace's default (:data:`INTERLACE_DEFAULT`).  A variant
  whose configuration repeats an earlier one's is run once and printed as
  ``name (= earlier)``: the tables say so rather than pretend a difference.

Predictions.  Online by default (the product's condition): the simulator
learns lengths and call times as it goes (``simulate(oracle=False)``), and
the native runner feeds one :class:`~engine_ext.policies.hints.SegmentPredictor`
per variant run as the gateway does.  ``--oracle`` gives every policy the
trace's true lengths, call times and later segments (an upper bound);
``--oracle-too`` runs both and prints the oracle rows beside the online ones,
never as the headline.  ``--seeds 0,1,2`` runs every (rate, variant) per seed
(trace and arrivals drawn per seed); tables and headline lines give the
median over seeds with the spread (min-max) beside it, the JSON keeps each
seed's results.

Native runner.  Each trace request arrives at its Poisson time (asyncio);
its prompt is ``prompt_tokens`` random token ids (seeded, distinct per
request); it generates under :class:`ForcedOutput` exactly each segment's
``completion_tokens`` random ids, the last of every non-final segment being
a special token (not EOS) that the request's ``pause_on`` names, so the
engine pauses right after that token -- exactly ``completion_tokens`` per
segment, checked per request.  The request then waits the call's
``api_time`` (real ``asyncio.sleep``, times ``--time-scale``) and resumes
with ``api_token_length`` random tokens plus the next segment's
``prompt_tokens``.  Records (arrival, first token, finish, tool time as
waited, output tokens) are summarised by :func:`engine_ext.sim.metrics.summarize`,
the same function the simulator uses.  Where the engine accepts a
``RequestHint``, each segment gets its own: the first at ``generate``, the
next at each ``resume(..., hint=)`` -- the trace's true values with
``--oracle``, else the shared predictor's (observed at each pause, call and
finish, as the gateway observes them).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import random
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from interlace.engine_ext.machine import describe_machine, machine as machine_description


class BenchError(ValueError):
    """Bad benchmark input (unknown variant, trace, rate): the message names the option."""


@dataclass(frozen=True)
class Variant:
    """A policy configuration.  ``horizon`` / ``handling_at_call`` are LAMPS'
    options (``make_ranking(..., horizon=, handling_at_call=)``); None: the
    ranking's default."""

    interception: str
    ranking: str
    prefix_caching: bool
    about: str = ""
    horizon: Optional[str] = None
    handling_at_call: Optional[bool] = None

    @property
    def config(self) -> Tuple[str, str, bool, Optional[str], Optional[bool]]:
        """What the run depends on, defaults resolved (two variants with the
        same config are run once); LAMPS' options only where the ranking is LAMPS."""
        if self.ranking != "lamps":
            return (self.interception, self.ranking, self.prefix_caching, None, None)
        return (self.interception, self.ranking, self.prefix_caching,
                self.horizon if self.horizon is not None else _ranking_default("horizon"),
                self.handling_at_call if self.handling_at_call is not None else _ranking_default("handling_at_call"))

    @property
    def label(self) -> str:
        """``handling, ranking (LAMPS' options), prefix cache`` for the tables."""
        ic, rk, pc, horizon, at_call = self.config
        if rk == "lamps":
            rk = f"lamps ({horizon}{', at call' if at_call else ''})"
        return f"{ic}, {rk}, {'on' if pc else 'off'}"

    def ranking_options(self) -> Dict[str, Any]:
        """The options given to ``make_ranking`` (the unset ones keep its defaults)."""
        return {k: v for k, v in (("horizon", self.horizon), ("handling_at_call", self.handling_at_call))
                if v is not None}


def _ranking_default(option: str) -> Any:
    from interlace.engine_ext.policies import make_ranking

    return inspect.signature(make_ranking).parameters[option].default


#: Interlace's default configuration (``engine.interception`` / ``engine.ranking``
#: defaults: the paper defaults, with the engine's prefix cache on).
INTERLACE_DEFAULT = Variant("infercept", "lamps", True, "Interlace's default configuration")

#: The headline's baseline (vLLM today) and the historical row (the papers' vLLM).
BASELINE, HISTORICAL = "vllm", "vllm-old"

VARIANTS: Dict[str, Variant] = {
    "vllm": Variant("vllm", "fcfs", True, "Discard+FCFS with prefix caching (vLLM today): the baseline"),
    "vllm-old": Variant("vllm", "fcfs", False, "Discard+FCFS without prefix caching (vLLM of the papers' time): "
                                               "historical, never a headline"),
    "preserve": Variant("preserve", "fcfs", True, "Preserve every paused context"),
    "swap": Variant("swap", "fcfs", True, "Swap every paused context (budgeted)"),
    "infercept": Variant("infercept", "fcfs", True, "InferCept: min-waste handling, FCFS"),
    "lamps": Variant("infercept", "lamps", True, "LAMPS ranking on InferCept's handling (the ranking's defaults)"),
    "lamps-segment": Variant("infercept", "lamps", True, "LAMPS, the paper's segment horizon", horizon="segment"),
    "lamps-job": Variant("infercept", "lamps", True, "LAMPS, job horizon (adds the later segments)", horizon="job"),
    "lamps-at-call": Variant("infercept", "lamps", True, "LAMPS, its predicted handling applied at the call",
                             handling_at_call=True),
    "interlace": INTERLACE_DEFAULT,
}

#: InferCept's Figure 3, one technique at a time (then LAMPS' ranking, then
#: the prefix cache, which gives Interlace's default).  No prefix caching
#: until the last step, as in the paper's vLLM.
ABLATION: List[Tuple[str, Variant]] = [
    ("vllm", Variant("vllm", "fcfs", False)),
    ("+ keep arrival (discard)", Variant("discard", "fcfs", False)),
    ("+ chunked recompute", Variant("discard-chunked", "fcfs", False)),
    ("+ swap budget", Variant("swap-budget", "fcfs", False)),
    ("+ heuristic preserve", Variant("heuristic", "fcfs", False)),
    ("+ min-waste (infercept)", Variant("infercept", "fcfs", False)),
    ("+ lamps ranking", Variant("infercept", "lamps", False)),
    ("+ prefix caching (interlace)", INTERLACE_DEFAULT),
]

METRIC_COLUMNS = [("norm p50", "norm_latency_p50", 4), ("norm p90", "norm_latency_p90", 4),
                  ("norm p99", "norm_latency_p99", 4), ("e2e mean s", "e2e_mean", 2), ("e2e p99 s", "e2e_p99", 2),
                  ("TTFT mean s", "ttft_mean", 3), ("TTFT p99 s", "ttft_p99", 3), ("req/s", "rps", 3),
                  ("KV waste GB*s", "kv_waste_gb_s", 3)]


# ------------------------------------------------------------------- inputs
def parse_rates(text: str) -> List[float]:
    try:
        rates = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--rates must be comma-separated numbers of requests/s, got {text!r}") from None
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise BenchError(f"--rates must be positive numbers of requests/s, got {text!r}")
    return rates


def parse_variants(text: Optional[str]) -> List[str]:
    names = [v.strip() for v in (text or ",".join(VARIANTS)).split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise BenchError(f"--variants: unknown variant {bad[0] if bad else text!r}; "
                         f"choose from {', '.join(VARIANTS)}")
    return names


def parse_seeds(text: str) -> List[int]:
    try:
        seeds = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise BenchError(f"--seeds must name distinct integers, got {text!r}")
    return seeds


def load_base_trace(spec: str, n: Optional[int], seed: int):
    """A trace file, or a generator name (InferCept augments, mixed, toolbench)."""
    from interlace.engine_ext.sim import traces

    if Path(spec).is_file():
        tr = traces.load_trace(spec)
        if n is not None:
            tr = traces.Trace(tr.requests[:n])
        return tr
    if spec in traces.GENERATORS:
        return traces.generate(spec, 200 if n is None else n, seed)
    raise BenchError(f"--trace {spec!r}: no such file, and not a generator "
                     f"(generators: {', '.join(traces.GENERATORS)})")


def same_as(names: Sequence[str], variants: Dict[str, Variant]) -> Dict[str, str]:
    """``{name: earlier name}`` for variants whose configuration repeats an earlier one's."""
    seen: Dict[Tuple, str] = {}
    out = {}
    for n in names:
        t = variants[n].config
        if t in seen:
            out[n] = seen[t]
        else:
            seen[t] = n
    return out


def build_policies(v: Variant, profile, starvation_threshold: int = 100):
    """Fresh policy objects (their predictors learn online: never shared between runs)."""
    from interlace.engine_ext.policies import ToolDurations, make_interception, make_ranking

    ic = make_interception(v.interception, profile, ToolDurations())
    rk = make_ranking(v.ranking, profile, ic, starvation_threshold=starvation_threshold, **v.ranking_options())
    return ic, rk


# ---------------------------------------------------------------- simulator
def mean_non_tool(records) -> Optional[float]:
    """Mean end-to-end latency without the tool time (what serving can
    change: on the mixed trace tool calls are most of every request's e2e)."""
    xs = [r.e2e - r.tool_s for r in records]
    return sum(xs) / len(xs) if xs else None


def mean_norm_latency(records) -> Optional[float]:
    """Mean of InferCept's normalized latency (the validation compares means:
    with a handful of requests a median is one request's number)."""
    xs = [r.norm_latency for r in records]
    return sum(xs) / len(xs) if xs else None


def run_sim_variant(trace, profile, v: Variant, *, oracle: bool = False, starvation_threshold: int = 100
                    ) -> Dict[str, Any]:
    """One variant in the simulator; ``oracle``: the trace's true lengths and
    call times (an upper bound), else learned online (the product's condition)."""
    from interlace.engine_ext.sim.simulator import simulate

    ic, rk = build_policies(v, profile, starvation_threshold)
    t0 = time.perf_counter()
    res = simulate(trace, profile, ic, rk, prefix_caching=v.prefix_caching, oracle=oracle)
    m = dict(res.metrics)
    m["norm_latency_mean"] = mean_norm_latency(res.records)
    m["non_tool_mean"] = mean_non_tool(res.records)
    m["run_s"] = time.perf_counter() - t0
    return m


# ------------------------------------------------------------------- native
def pause_marker(tokenizer, eos_ids) -> Tuple[int, str]:
    """A special token (not EOS, not a chat-turn start) whose text ends each
    non-final segment: random ids never spell it, so the engine pauses
    exactly after it."""
    if tokenizer is None or not getattr(tokenizer, "special_tokens", None):
        raise BenchError("the native trace bench needs a model with a tokenizer that has special tokens "
                         "(to pause exactly at a segment's end)")
    cands = [(len(t), t, i) for t, i in tokenizer.special_tokens.items()
             if i not in eos_ids and "start" not in t.lower() and len(t) > 3]
    if not cands:
        raise BenchError("the model's tokenizer has no special token usable as a pause marker")
    _, text, tid = max(cands)
    return tid, text


def _random_ids(rng: random.Random, n: int, vocab: int) -> List[int]:
    lo, hi = min(1000, vocab // 4), vocab - 100
    return [rng.randrange(lo, hi) for _ in range(n)]


def _supports(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def segment_hint(hint_cls, req, segment: int, context_tokens: int, time_scale: float, predictor=None):
    """The ``RequestHint`` for segment ``segment`` of trace request ``req``,
    whose context then holds ``context_tokens``: with no ``predictor`` the
    trace's true values (output, call time, the later segments as
    ``SchedInfo.future`` holds them -- the oracle); else the shared
    :class:`SegmentPredictor`'s prediction, as the gateway makes it (the tool
    is not named before the model writes the call; tools are offered to
    every request)."""
    segs = req.segments
    last = len(segs) - 1
    if predictor is None:
        s = segs[segment]
        future = tuple((segs[j].completion_tokens, segs[j].api_time * time_scale if j < last else None,
                        segs[j - 1].api_token_length + segs[j].prompt_tokens) for j in range(segment + 1, len(segs)))
        return hint_cls(app=req.app or None, expected_output=s.completion_tokens,
                        expected_tool=(req.app or "tool") if segment < last else None,
                        expected_tool_s=s.api_time * time_scale if segment < last else None, future=future)
    p = predictor.predict(req.app, context_tokens, segment)
    return hint_cls(app=req.app or None, expected_output=p.expected_output, expected_tool=p.expected_tool,
                    expected_tool_s=p.expected_tool_s, future=p.future)


async def _drive_request(engine, req, t0: float, *, marker: Tuple[int, str], vocab: int, seed: int,
                         time_scale: float, hint_cls, records: list, problems: list, predictor=None) -> None:
    """One trace request on ``engine`` (module doc).  ``hint_cls``: the
    engine's ``RequestHint`` (None: it takes none); ``predictor``: the run's
    shared :class:`SegmentPredictor` (online hints), None for the oracle."""
    from interlace.engine_ext.constraints.forced import ForcedOutput
    from interlace.engine_ext.protocol import SamplingParams
    from interlace.engine_ext.sim.metrics import RequestRecord

    rng = random.Random(f"bench-trace:{seed}:{req.id}")
    segs = req.segments
    mid, mtext = marker
    pieces = []
    for i, s in enumerate(segs):
        p = _random_ids(rng, s.completion_tokens, vocab)
        if i < len(segs) - 1 and p:
            p[-1] = mid
        pieces.append(p)
    prompt = _random_ids(rng, max(1, segs[0].prompt_tokens), vocab)
    forced = ForcedOutput(pieces)
    total = sum(len(p) for p in pieces)
    sp = SamplingParams(max_tokens=max(1, total), ignore_eos=True, logits_processors=[forced],
                        pause_on=(mtext,) if len(segs) > 1 else (), skip_special_tokens=False)
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.monotonic()))
    arrival = time.monotonic()
    cid = f"trace-{req.id}"
    context = seg_start = len(prompt)  # tokens in the context; where the current segment started
    kw = {}
    if hint_cls is not None:
        kw["hint"] = segment_hint(hint_cls, req, 0, context, time_scale, predictor)
    resume_hint = hint_cls is not None and _supports(engine.resume, "hint")
    # the tool each pause waits for, named as the gateway names it (the engine learns a time per tool,
    # as the simulator does per application); the oracle also gives the call's true time
    tool = req.app or "tool"
    pause_hint = getattr(engine, "set_pause_hint", None) if len(segs) > 1 else None

    def name_the_call(i: int) -> None:
        if pause_hint is not None and i < len(segs) - 1:
            from interlace.engine_ext.protocol import PauseHint
            pause_hint(cid, PauseHint(tool=tool, expected_duration_s=None if predictor is not None
                                      else segs[i].api_time * time_scale))
    first = None
    tool_s = 0.0
    out = 0
    seg, seg_out = 0, 0
    fill = asyncio.ensure_future(engine.fill(cid, prompt))
    try:
        # the fill's command is queued first and the generate's right behind
        # it, so the step that completes the prompt also samples the first
        # token (as the simulator models it), instead of a round trip later
        await asyncio.sleep(0)
        stream = engine.generate(cid, sp, **kw)
        async for ev in stream:
            if not fill.done():
                await fill
            now = time.monotonic()
            if ev.token_id is not None:
                out += 1
                seg_out += 1
                if first is None:
                    first = now
                    name_the_call(0)  # the generation exists now (a one-token first segment pauses unnamed)
            if ev.paused:
                s = segs[seg]
                if seg_out != s.completion_tokens:
                    problems.append(f"request {req.id} segment {seg}: paused after {seg_out} tokens, "
                                    f"expected {s.completion_tokens}")
                if predictor is not None:
                    predictor.observe_segment(req.app, seg_start, seg_out)
                context += seg_out
                wait = s.api_time * time_scale
                t_call = now
                await asyncio.sleep(wait)
                seg += 1
                seg_out = 0
                nxt = segs[seg]
                tokens = _random_ids(rng, s.api_token_length + nxt.prompt_tokens, vocab)
                forced.on_resume()
                waited = time.monotonic() - t_call
                tool_s += waited
                if predictor is not None:
                    # per-tool times are the engine's to learn (it times its pauses): the app's figures only
                    predictor.observe_call(req.app, tool, waited, len(tokens), tool_durations=False)
                context += len(tokens)
                seg_start = context
                if resume_hint:
                    await engine.resume(cid, tokens, hint=segment_hint(hint_cls, req, seg, context, time_scale,
                                                                       predictor))
                else:
                    await engine.resume(cid, tokens)
                name_the_call(seg)
            if ev.finish_reason is not None:
                break
        finish = time.monotonic()
        await fill
        if seg != len(segs) - 1 or seg_out != segs[-1].completion_tokens:
            problems.append(f"request {req.id}: ended in segment {seg} after {seg_out} tokens "
                            f"(expected segment {len(segs) - 1}, {segs[-1].completion_tokens} tokens)")
        if predictor is not None:
            predictor.observe_segment(req.app, seg_start, seg_out)
            predictor.observe_finish(req.app, seg + 1)
        records.append(RequestRecord(req.id, arrival - t0, (first if first is not None else finish) - t0,
                                     finish - t0, tool_s, out))
    finally:
        if not fill.done():
            fill.cancel()
        await asyncio.gather(fill, return_exceptions=True)
        if cid in getattr(engine, "contexts", {cid: None}):
            await engine.free_context(cid)


async def _warm_up(engine) -> None:
    """One short request before timing, so a fresh engine's first steps
    (allocator, kernel selection) do not land on the first trace request."""
    from interlace.engine_ext.protocol import SamplingParams

    await engine.fill("trace-warm-up", list(range(1000, 1024)))
    async for _ in engine.generate("trace-warm-up", SamplingParams(max_tokens=4, ignore_eos=True)):
        pass
    await engine.free_context("trace-warm-up")


def native_engine_kwargs(engine_cls, v: Variant, profile, kv_cache_tokens: int, max_batched_tokens: int,
                         host_pool_tokens: Optional[int]) -> Tuple[Dict[str, Any], List[str]]:
    """Constructor kwargs for this variant, and notes on what the engine
    could not take (an engine without a prefix-caching switch, ...)."""
    ic, rk = build_policies(v, profile)
    kw: Dict[str, Any] = dict(kv_cache_tokens=kv_cache_tokens, max_batched_tokens=max_batched_tokens,
                              interception=ic, ranking=rk)
    notes = []
    if _supports(engine_cls.__init__, "profile"):
        kw["profile"] = profile
    if _supports(engine_cls.__init__, "prefix_caching"):
        kw["prefix_caching"] = v.prefix_caching
    elif not v.prefix_caching:
        notes.append("engine has no prefix_caching switch: ran with its prefix cache")
    if host_pool_tokens is not None and _supports(engine_cls.__init__, "host_pool_tokens"):
        kw["host_pool_tokens"] = host_pool_tokens
    return kw, notes


def kv_bytes_per_token(model) -> int:
    import torch

    c = model.cfg
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.empty(0, dtype=next(model.parameters()).dtype
                                                                         ).element_size()


def load_native_model(model: Optional[str], dtype: str = "float32"):
    """Model and tokenizer loaded once (every variant's engine shares the
    weights), on a thread that ends (see ``loader.in_passing_thread``)."""
    import torch

    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.native.loader import (in_passing_thread, load_config, load_model, resolve_dtype,
                                                    resolve_model_dir)
    from interlace.engine_ext.tokenizer import Tokenizer

    def build():
        d = resolve_model_dir(model) if model else embedded_model_dir()
        raw, _ = load_config(d)
        m = load_model(d, resolve_dtype(dtype, torch.device("cpu")), torch.device("cpu"))
        return m, Tokenizer.from_model_dir(d, raw), Path(d).name
    return in_passing_thread(build)


def measure_native_profile(model, tokenizer, kv_cache_tokens: int, max_batched_tokens: int):
    """A quick measured profile of this model on this machine (ENGINE's
    ``profiler.measure_profile``), with the engine settings the bench uses."""
    from interlace.engine_ext.native.engine import NativeEngine
    try:
        from interlace.engine_ext.native.profiler import measure_profile
    except ImportError as e:
        raise BenchError("no measured profile: engine_ext/native/profiler.py (measure_profile) is missing; "
                         "pass --profile PATH") from e
    eng = NativeEngine(model, tokenizer, kv_cache_tokens=kv_cache_tokens, max_batched_tokens=max_batched_tokens)
    try:
        return measure_profile(eng, quick=True)
    finally:
        eng.close()


def run_native_variant(model, tokenizer, trace, v: Variant, profile, *, kv_cache_tokens: int,
                       max_batched_tokens: int, time_scale: float, seed: int,
                       host_pool_tokens: Optional[int] = None, oracle: bool = False) -> Dict[str, Any]:
    """One variant on a fresh engine (shared weights) over ``trace``
    (arrivals already set, call times already in the trace's seconds).
    ``oracle``: hints carry the trace's true values; else one
    :class:`SegmentPredictor` for the run learns them as the gateway does."""
    from interlace.engine_ext import protocol
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.policies.hints import SegmentPredictor
    from interlace.engine_ext.sim.metrics import summarize

    kw, notes = native_engine_kwargs(NativeEngine, v, profile, kv_cache_tokens, max_batched_tokens,
                                     host_pool_tokens)
    eng = NativeEngine(model, tokenizer, **kw)
    hint_cls = getattr(protocol, "RequestHint", None)
    if hint_cls is not None and not _supports(eng.generate, "hint"):
        hint_cls = None
    if hint_cls is None:
        notes.append("engine takes no RequestHint: no hints")
    elif not _supports(eng.resume, "hint"):
        notes.append("engine's resume takes no hint: every segment keeps the first segment's")
    # online, as the gateway: the engine's own learned tool times (it times each pause), the app's figures here
    predictor = None if oracle or hint_cls is None else SegmentPredictor(
        durations=getattr(kw["interception"], "durations", None))
    marker = pause_marker(tokenizer, eng.eos_token_ids)
    records: list = []
    problems: list = []

    async def go():
        await _warm_up(eng)
        t0 = time.monotonic() + 0.05
        await asyncio.gather(*(_drive_request(eng, r, t0, marker=marker, vocab=eng.vocab_size, seed=seed,
                                              time_scale=time_scale, hint_cls=hint_cls, records=records,
                                              problems=problems, predictor=predictor) for r in trace.requests))
        wall = time.monotonic() - t0
        inv = await eng.check_invariants()
        return wall, inv

    try:
        wall, inv = asyncio.run(go())
        stats = dict(eng.stats() if callable(getattr(eng, "stats", None)) else eng.stats)
    finally:
        eng.close()
    if problems:
        raise RuntimeError("forced decoding did not replay the trace exactly: " + "; ".join(problems[:5]))
    waste_tok_s = stats.get("kv_waste_token_s")
    waste = (waste_tok_s * kv_bytes_per_token(model) / 1e9) if waste_tok_s is not None else float("nan")
    if waste_tok_s is None:
        notes.append("engine reports no kv_waste_token_s")
    extra = {"notes": notes, "norm_latency_mean": mean_norm_latency(records),
             "non_tool_mean": mean_non_tool(records),
             "engine_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, dict))},
             "leaked_blocks": inv.get("used_blocks"),
             # the mechanism counters under the simulator's names and meanings (the ablation's columns):
             # preemptions = running contexts preempted for memory (inv's "preemptions" counts every KV drop)
             "handling": dict(stats.get("handlings", {})), "recomputed_tokens": stats.get("recomputed_tokens"),
             "preemptions": stats.get("running_preemptions", inv.get("preemptions")),
             "paused_dropped": stats.get("paused_dropped"), "swap_out_blocks": stats.get("swap_out_blocks"),
             "swap_in_blocks": stats.get("swap_in_blocks")}
    return summarize(records, wall, waste, extra)


# ------------------------------------------------------------------ reports
def fmt(x: Any, digits: int) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def median_over_seeds(runs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One variant's metrics over seeds: each number the median of the
    seeds' values (None where no seed has one), nested dicts (handling
    counts, engine stats) likewise, notes merged; ``spread`` maps each
    top-level number to its (min, max) and ``seeds`` counts the runs."""
    if not runs:
        raise ValueError("no runs to summarise")

    def num(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)

    def merge(ds: Sequence[Dict[str, Any]], spread: Optional[Dict[str, Tuple[float, float]]]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for k in dict.fromkeys(k for d in ds for k in d):
            vals = [d.get(k) for d in ds]
            nums = [v for v in vals if num(v)]
            if nums:
                out[k] = statistics.median(nums)
                if spread is not None:
                    spread[k] = (min(nums), max(nums))
            elif all(isinstance(v, dict) for v in vals if v is not None) and any(vals):
                out[k] = merge([v for v in vals if v is not None], None)
            elif all(isinstance(v, list) for v in vals if v is not None) and any(vals):
                out[k] = list(dict.fromkeys(x for v in vals if v for x in v))
            else:
                out[k] = next((v for v in vals if v is not None), vals[0])
        return out
    spread: Dict[str, Tuple[float, float]] = {}
    out = merge(runs, spread)
    out["spread"], out["seeds"] = spread, len(runs)
    return out


def cell(m: Dict[str, Any], key: str, digits: int) -> str:
    """A table cell: the value (a median over seeds), with its min-max beside it over several seeds."""
    sp = m.get("spread", {}).get(key)
    if m.get("seeds", 1) > 1 and sp is not None:
        return f"{fmt(m.get(key), digits)} ({fmt(sp[0], digits)}-{fmt(sp[1], digits)})"
    return fmt(m.get(key), digits)


def print_table(rate: float, names: Sequence[str], results: Dict[str, Dict[str, Any]], variants: Dict[str, Variant],
                dupes: Dict[str, str], out=sys.stdout, upper: Optional[Dict[str, Dict[str, Any]]] = None,
                mode: Optional[str] = None) -> None:
    """One rate's table; ``upper``: the oracle runs, printed below as an
    upper bound; ``mode`` ("online" / "oracle") names what the main rows used."""
    seeds = next(iter(results.values())).get("seeds", 1) if results else 1
    what = [{"online": "online predictions", "oracle": "oracle lengths and call times (an upper bound)"}[mode]
            ] if mode else []
    what += [f"median over {seeds} seeds (min-max)"] if seeds > 1 else []
    print(f"\nrate {rate:g} req/s" + (f" ({'; '.join(what)})" if what else ""), file=out)
    print("| variant | handling, ranking, prefix cache | " + " | ".join(c for c, _, _ in METRIC_COLUMNS)
          + " | completed |", file=out)
    print("|" + "---|" * (len(METRIC_COLUMNS) + 3), file=out)
    rows = [(n, results[n], "") for n in names]
    if upper is not None:
        rows += [(n, upper[n], " [oracle: upper bound]") for n in names]
    for n, m, tag in rows:
        label = n + (f" (= {dupes[n]})" if n in dupes else "") + tag
        print(f"| {label} | {variants[n].label} | " + " | ".join(cell(m, k, d) for _, k, d in METRIC_COLUMNS)
              + f" | {cell(m, 'completed', 0)} |", file=out)


def sustainable_rate(rates: Sequence[float], lat: Sequence[Optional[float]], slo: float) -> Optional[float]:
    """Highest request rate at which the p50 normalized latency stays within
    ``slo``, interpolated linearly between the swept rates; None if even the
    lowest rate misses it; the highest swept rate if none does (a lower bound)."""
    pts = sorted((r, l) for r, l in zip(rates, lat))
    if not pts or pts[0][1] is None or pts[0][1] > slo:
        return None
    best = pts[0][0]
    for (r0, l0), (r1, l1) in zip(pts, pts[1:]):
        if l1 is None or l1 > slo:
            return r0 + (r1 - r0) * (slo - l0) / (l1 - l0) if l1 is not None and l1 > l0 else r0
        best = r1
    return best


def over_seeds(xs: Sequence[Optional[float]], digits: int, unit: str = "") -> str:
    """The median of per-seed values with their min-max beside it (and how
    many seeds had a value, when some had none); one seed: the value."""
    vals = [x for x in xs if x is not None]
    if not vals:
        return "n/a"
    text = f"{statistics.median(vals):.{digits}f}{unit}"
    if len(xs) > 1:
        some = f", {len(vals)} of {len(xs)} seeds" if len(vals) < len(xs) else ""
        text += f" ({min(vals):.{digits}f}{unit} to {max(vals):.{digits}f}{unit}{some})"
    return text


def _median(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


#: how the summary names the two vLLM rows
_BASELINE_LABEL = {BASELINE: "vllm (prefix cache: today's vLLM)",
                   HISTORICAL: "vllm-old (no prefix cache: the papers' vLLM)"}


def summary_lines(rates: Sequence[float], grids: Sequence[Dict[float, Dict[str, Dict[str, Any]]]],
                  names: Sequence[str], slos: Optional[Sequence[float]] = None, label: str = "") -> List[str]:
    """The issue's comparisons, where the variants they name were run, from
    one grid (``{rate: {variant: metrics}}``) per seed.  Each figure is
    computed per seed (a ratio pairs two variants on the same seed's trace)
    and given as the median over seeds with the min-max beside it.

    * sustainable rate at equal p50 normalized latency (default: 2x, 4x and
      10x the lowest median p50 at the lowest rate): interlace against
      ``vllm`` (the headline; target >= 2x at 2x and 4x), and against
      ``vllm-old`` on a line marked historical;
    * per rate, mean e2e of lamps against infercept+fcfs and their p99 e2e
      ratio (target: mean >= 20% lower with p99 <= 1.5x).
    ``label`` prefixes every line (the oracle's upper bound)."""
    lines: List[str] = []
    bases = [b for b in (BASELINE, HISTORICAL) if b in names]
    if "interlace" in names and bases:
        low = min(rates)
        lowest = [_median([g[low][n]["norm_latency_p50"] for g in grids]) for n in names]
        base = min((x for x in lowest if x is not None), default=None)
        if slos:
            targets = [(slo, None) for slo in slos]
        elif base is not None:
            targets = [(round(k * base, 4), k) for k in (2, 4, 10)]
        else:
            targets = []
        for slo, k in targets:
            a = [sustainable_rate(rates, [g[r]["interlace"]["norm_latency_p50"] for r in rates], slo) for g in grids]
            top = " (at least: interlace meets it at the top rate)" if any(x == max(rates) for x in a) else ""
            mult = f" ({k}x the lowest p50)" if k else ""
            for b_name in bases:
                b = [sustainable_rate(rates, [g[r][b_name]["norm_latency_p50"] for r in rates], slo) for g in grids]
                ratios = [x / y if x and y else None for x, y in zip(a, b)]
                line = (f"p50 normalized latency <= {slo:g} s/token{mult}: interlace sustains "
                        f"{over_seeds(a, 3)} req/s, {_BASELINE_LABEL[b_name]} {over_seeds(b, 3)} req/s: "
                        f"{over_seeds(ratios, 2, 'x')}{top}")
                if b_name == HISTORICAL:
                    line = "historical, not the headline: " + line
                elif k in (2, 4):
                    r = _median(ratios)
                    line += "; target >= 2x: " + ("met" if r is not None and r >= 2 else
                                                  "not shown (sweep higher rates)" if top else "missed")
                lines.append(label + line)
    if "lamps" in names and "infercept" in names:
        for r in rates:
            a = [g[r]["lamps"]["e2e_mean"] for g in grids]
            b = [g[r]["infercept"]["e2e_mean"] for g in grids]
            cut = [100 * (1 - x / y) if x is not None and y else None for x, y in zip(a, b)]
            p99 = [x / y if x is not None and y else None
                   for x, y in ((g[r]["lamps"]["e2e_p99"], g[r]["infercept"]["e2e_p99"]) for g in grids)]
            if _median(cut) is None:
                continue
            line = (f"{label}rate {r:g}: mean e2e lamps {over_seeds(a, 2, ' s')} vs infercept+fcfs "
                    f"{over_seeds(b, 2, ' s')}: {over_seeds(cut, 1, '%')} lower; p99 e2e "
                    f"{over_seeds(p99, 2, 'x')} infercept's")
            c = [g[r]["lamps"].get("non_tool_mean") for g in grids]
            d = [g[r]["infercept"].get("non_tool_mean") for g in grids]
            cut2 = [100 * (1 - x / y) if x is not None and y else None for x, y in zip(c, d)]
            if _median(cut2) is not None:
                line += (f"; without tool time {over_seeds(c, 2, ' s')} vs {over_seeds(d, 2, ' s')}: "
                         f"{over_seeds(cut2, 1, '%')} lower")
            met = round(_median(cut), 9) >= 20 and round(_median(p99) or math.inf, 9) <= 1.5  # not float noise
            lines.append(line + f"; target (>= 20% lower, p99 <= 1.5x): {'met' if met else 'missed'}")
    return lines


ORDER_METRICS = (("norm_latency_p50", "p50 normalized latency"), ("e2e_mean", "mean e2e"))


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a of two scorings of the same items: 1 = same order."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    if not pairs:
        return 1.0
    agree = sum(((a[i] > a[j]) - (a[i] < a[j])) * ((b[i] > b[j]) - (b[i] < b[j])) for i, j in pairs)
    return agree / len(pairs)


def order_lines(rates: Sequence[float], native: Dict[float, Dict[str, Dict[str, Any]]],
                sim: Dict[float, Dict[str, Dict[str, Any]]]) -> List[str]:
    """Per rate and metric: the variants from best to worst on the engine
    and in the simulator, Kendall's tau between them, and each variant's
    simulator/engine ratio (the simulator's validation on this machine)."""
    lines = ["", "order of the variants, best first (native engine | simulator, same trace and profile):"]
    for r in rates:
        names = [n for n in sim[r] if native[r][n].get("norm_latency_p50") is not None]
        for key, label in ORDER_METRICS:
            a = [native[r][n][key] for n in names]
            b = [sim[r][n][key] for n in names]
            by = lambda vals: " < ".join(n for _, n in sorted(zip(vals, names)))  # noqa: E731
            ratios = ", ".join(f"{n} {sb / sa:.2f}" for n, sa, sb in zip(names, a, b) if sa)
            lines.append(f"rate {r:g}, {label}: native {by(a)} | sim {by(b)}; Kendall tau {kendall_tau(a, b):+.2f}; "
                         f"sim/native {ratios}")
    return lines


def plot_rates(rates: Sequence[float], grid, names: Sequence[str], title: str, path: str,
               dupes: Dict[str, str]) -> None:
    """InferCept Figure 2's panels: p50 normalized latency, mean end-to-end
    latency, completed requests/s and mean TTFT against the request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("norm_latency_p50", "p50 normalized latency (s/token)", True),
              ("e2e_mean", "mean end-to-end latency (s)", True),
              ("rps", "completed requests/s", False), ("ttft_mean", "mean TTFT (s)", True)]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    styles = ["-", "--", "-.", ":"]
    for ax, (key, label, log) in zip(axes.flat, panels):
        for i, n in enumerate(names):
            ys = [grid[r][n].get(key) for r in rates]
            ys = [math.nan if y is None else y for y in ys]
            lab = n + (f" (= {dupes[n]})" if n in dupes else "")
            ax.plot(rates, ys, marker="o", markersize=3, linestyle=styles[i % len(styles)], label=lab)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ablation(steps: Sequence[str], res: Dict[str, Dict[str, Any]], title: str, path: str) -> None:
    """InferCept Figure 3: normalized latency and KV waste per added technique."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(steps))
    a.bar(xs, [res[s]["norm_latency_p50"] or 0 for s in steps], color="tab:blue")
    a.set_ylabel("p50 normalized latency (s/token)")
    b.bar(xs, [res[s]["kv_waste_gb_s"] or 0 for s in steps], color="tab:orange")
    b.set_ylabel("KV memory waste (GB*s)")
    for ax in (a, b):
        ax.set_xticks(list(xs), steps, rotation=35, ha="right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------- CLI
def add_trace_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", required=True, help="trace JSON file, or a generator: math qa ve chatbot image tts "
                                                   "mixed toolbench")
    ap.add_argument("--rates", required=True, help="comma-separated request rates (req/s), Poisson arrivals")
    ap.add_argument("--sim", metavar="PROFILE", help="simulate with this profile (file or built-in name, e.g. "
                                                     "h100-gpt-j-6b) instead of running the native engine")
    ap.add_argument("--variants", help=f"comma-separated, default all: {','.join(VARIANTS)}")
    ap.add_argument("--ablation", action="store_true", help="InferCept Figure 3: add one technique at a time")
    ap.add_argument("--num-requests", type=int, help="requests (generators: default 200; files: first N)")
    ap.add_argument("--duration", type=float, help="generators: rate x DURATION requests per rate (arrivals "
                                                   "over about DURATION seconds: a steady state, not a burst)")
    ap.add_argument("--jobs", type=int, default=1, help="simulator: runs in parallel processes")
    ap.add_argument("--seed", type=int, default=0, help="the trace's and arrivals' seed (one run per rate)")
    ap.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2: every (rate, variant) per seed; tables and "
                                    "comparisons give the median over seeds with the min-max (overrides --seed)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply every call time by this")
    ap.add_argument("--max-context", type=int, help="scale each request's tokens down to this peak context")
    ap.add_argument("--max-calls", type=int, help="keep at most this many calls per request")
    oracle = ap.add_mutually_exclusive_group()
    oracle.add_argument("--oracle", action="store_true", help="give the policies the trace's true lengths, call "
                        "times and later segments (an upper bound; default: predicted online, as the product does)")
    oracle.add_argument("--oracle-too", action="store_true", help="run online and with the oracle, and print the "
                        "oracle rows beside the online ones as an upper bound (the headline stays online)")
    ap.add_argument("--starvation-threshold", type=int, default=100)
    ap.add_argument("--slo", help="comma-separated p50 normalized latencies (s/token) for the sustainable-rate "
                                  "comparison (default: 2x, 4x, 10x the lowest p50 at the lowest rate)")
    ap.add_argument("--model", help="native: HF directory or .gguf (default: the embedded model)")
    ap.add_argument("--dtype", default="float32", help="native: model dtype (default float32)")
    ap.add_argument("--profile", help="native: measured profile JSON for the policies (default: measure "
                                      "one quickly with the profiler)")
    ap.add_argument("--kv-cache-tokens", type=int, default=2048, help="native: KV cache size")
    ap.add_argument("--threads", type=int, default=0, help="native: torch threads (0: torch's default; 1 is "
                                                         "steadier on a shared 2-core machine)")
    ap.add_argument("--max-batched-tokens", type=int, default=512, help="native: tokens per step")
    ap.add_argument("--host-pool-tokens", type=int, help="native: swap pool (default: the engine's)")
    ap.add_argument("--with-sim", action="store_true",
                    help="native: also simulate the same traces with the same profile, and print both orders "
                         "of the variants and the simulator/engine ratios (the simulator's validation)")
    ap.add_argument("--engines", help="instead of policy variants: the same trace on these engines, comma-"
                    "separated: vllm-server (stock vLLM over HTTP), vllm (vLLM in Interlace: pins by min-waste), "
                    "vllm-preserve, vllm-discard, native, native-x1, native-x2 (two worker replicas behind a "
                    "ReplicaSet); see bench/engines_trace.py")
    ap.add_argument("--engine-kv-tokens", type=int, help="--engines: every engine's KV cache in tokens (default: "
                    "each engine's own: 16384 native, vLLM's from kv_cache_space_gb)")
    ap.add_argument("--out-png", help="save the plot here")
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH",
                    help="write all results as JSON to PATH (bare --json: print the JSON instead of tables)")


def run_trace(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BenchError as e:
        print(f"interlace bench trace: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from interlace.engine_ext.sim import traces

    rates = parse_rates(args.rates)
    if args.ablation:
        variants = {name: v for name, v in ABLATION}
        names = [name for name, _ in ABLATION]
        if args.variants:
            raise BenchError("--variants and --ablation are exclusive (the ablation's steps are fixed)")
    else:
        variants = VARIANTS
        names = parse_variants(args.variants)
    if args.time_scale < 0 or not math.isfinite(args.time_scale):
        raise BenchError(f"--time-scale must be >= 0, got {args.time_scale!r}")
    if args.num_requests is not None and args.num_requests < 1:
        raise BenchError(f"--num-requests must be positive, got {args.num_requests!r}")
    if args.duration is not None:
        if not (math.isfinite(args.duration) and args.duration > 0):
            raise BenchError(f"--duration must be a positive number of seconds, got {args.duration!r}")
        if Path(args.trace).is_file() or args.num_requests is not None:
            raise BenchError("--duration needs a generator --trace and no --num-requests")
    slos = parse_rates(args.slo) if args.slo else None
    seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    modes = ["oracle"] if args.oracle else ["online", "oracle"] if args.oracle_too else ["online"]
    head = modes[0]  # the headline's condition; the oracle beside it is an upper bound

    def base_trace(seed: int):
        try:
            n = max(1, math.ceil(max(rates) * args.duration)) if args.duration is not None else args.num_requests
            base = load_base_trace(args.trace, n, seed)
        except traces.TraceError as e:
            raise BenchError(str(e)) from e
        if args.max_context or args.max_calls or args.time_scale != 1.0:
            base = traces.scale_trace(base, max_context=args.max_context, max_calls=args.max_calls,
                                      time_scale=args.time_scale)
        return base

    def per_rate(tr, rate: float):
        if args.duration is None:
            return tr
        return traces.Trace(tr.requests[:max(1, math.ceil(rate * args.duration))])
    bases = {seed: base_trace(seed) for seed in seeds}
    if getattr(args, "engines", None):  # the same trace on different engines and replicas (bench/engines_trace.py)
        from .engines_trace import run_engines

        if len(seeds) > 1:
            raise BenchError("--engines runs one seed: give --seed, not several --seeds")
        args.seed = seeds[0]
        return run_engines(args, bases[seeds[0]], rates, per_rate)
    arrivals = {seed: {r: traces.with_poisson_arrivals(per_rate(bases[seed], r), r, seed) for r in rates}
                for seed in seeds}
    dupes = same_as(names, variants)
    to_json = args.json == "-"
    out = sys.stderr if to_json else sys.stdout
    # runs[mode][seed][rate][variant]: each seed's metrics
    runs: Dict[str, Dict[int, Dict[float, Dict[str, Dict[str, Any]]]]] = {
        m: {seed: {r: {} for r in rates} for seed in seeds} for m in modes}
    sim_runs: Dict[str, Dict[int, Dict[float, Dict[str, Dict[str, Any]]]]] = {}
    n0 = len(bases[seeds[0]])
    n_desc = (f"{n0} requests" if args.duration is None
              else f"rate x {args.duration:g} s requests, up to {n0}")
    seed_desc = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {','.join(map(str, seeds))}"
    pred_desc = {"online": "predictions online", "oracle": "oracle predictions (an upper bound)"}[head] + (
        ", oracle beside them" if len(modes) > 1 else "")
    if args.sim:
        from interlace.engine_ext.policies import Profile, ProfileError
        try:
            profile = Profile.load(args.sim)
        except ProfileError as e:
            raise BenchError(f"--sim: {e}") from e
        mach = machine_description()
        header = (f"simulator, profile {profile.model} on {profile.device} ({profile.source}); trace {args.trace} "
                  f"({n_desc}, {seed_desc}, time scale {args.time_scale:g}); {pred_desc}")
        jobs = [(m, seed, r, n) for m in modes for seed in seeds for r in rates for n in names if n not in dupes]

        def kw(mode: str) -> Dict[str, Any]:
            return dict(oracle=mode == "oracle", starvation_threshold=args.starvation_threshold)
        if args.jobs > 1:
            from concurrent.futures import ProcessPoolExecutor
            with ProcessPoolExecutor(args.jobs) as ex:
                futs = {ex.submit(run_sim_variant, arrivals[seed][r], profile, variants[n], **kw(m)): (m, seed, r, n)
                        for m, seed, r, n in jobs}
                for f, (m, seed, r, n) in futs.items():
                    runs[m][seed][r][n] = f.result()
                    _progress((m, seed, r, n), runs[m][seed][r][n])
        else:
            for m, seed, r, n in jobs:
                runs[m][seed][r][n] = run_sim_variant(arrivals[seed][r], profile, variants[n], **kw(m))
                _progress((m, seed, r, n), runs[m][seed][r][n])
    else:
        import torch

        from interlace.bench.engine import machine as torch_machine
        from interlace.engine_ext.policies import Profile, ProfileError

        if args.threads:
            torch.set_num_threads(args.threads)
        model, tok, mname = load_native_model(args.model, args.dtype)
        if args.profile:
            try:
                profile = Profile.load(args.profile)
            except ProfileError as e:
                raise BenchError(f"--profile: {e}") from e
            if (profile.kv_capacity_tokens, profile.max_batched_tokens) != (args.kv_cache_tokens,
                                                                             args.max_batched_tokens):
                # step costs do not depend on the cache size: the policies must see this engine's
                profile = replace(profile, kv_capacity_tokens=args.kv_cache_tokens,
                                  max_batched_tokens=args.max_batched_tokens)
        else:
            profile = measure_native_profile(model, tok, args.kv_cache_tokens, args.max_batched_tokens)
        mach = torch_machine()
        mach["torch_threads"] = torch.get_num_threads()
        header = (f"native engine, {mname} ({args.dtype}), KV cache {args.kv_cache_tokens} tokens, "
                  f"{args.max_batched_tokens} tokens/step; policies' profile: {profile.source}; trace {args.trace} "
                  f"({n_desc}, {seed_desc}, max context {args.max_context}, max calls "
                  f"{args.max_calls}, call times x{args.time_scale:g}); {pred_desc}")
        if args.with_sim:
            sim_runs = {m: {seed: {r: {} for r in rates} for seed in seeds} for m in modes}
        for m in modes:
            for seed in seeds:
                for r in rates:
                    tr = arrivals[seed][r]
                    for n in names:
                        if n in dupes:
                            continue
                        if args.with_sim:
                            sim_runs[m][seed][r][n] = run_sim_variant(tr, profile, variants[n], oracle=m == "oracle")
                        t = time.perf_counter()
                        runs[m][seed][r][n] = run_native_variant(
                            model, tok, tr, variants[n], profile, kv_cache_tokens=args.kv_cache_tokens,
                            max_batched_tokens=args.max_batched_tokens, time_scale=1.0, seed=seed,
                            host_pool_tokens=args.host_pool_tokens, oracle=m == "oracle")
                        runs[m][seed][r][n]["run_s"] = time.perf_counter() - t
                        _progress((m, seed, r, n), runs[m][seed][r][n])
    for grids in [runs] + ([sim_runs] if sim_runs else []):
        for m in grids:
            for seed in seeds:
                for r in rates:
                    for n in names:
                        if n in dupes:
                            grids[m][seed][r][n] = grids[m][seed][r][dupes[n]]
    # medians over seeds: med[mode][rate][variant]
    med = {m: {r: {n: median_over_seeds([runs[m][seed][r][n] for seed in seeds]) for n in names} for r in rates}
           for m in modes}
    upper = med.get("oracle") if head != "oracle" else None

    print(f"\n{header}\nmachine: {describe_machine(mach)}", file=out)
    if args.ablation:
        for r in rates:
            for m in modes:
                print_ablation(r, names, med[m][r], out, mode=m)
    else:
        for r in rates:
            print_table(r, names, med[head][r], variants, dupes, out, upper=upper[r] if upper else None, mode=head)
        lines = summary_lines(rates, [runs[head][seed] for seed in seeds], names, slos,
                              label="" if head == "online" else "oracle (an upper bound): ")
        if upper is not None:
            lines += summary_lines(rates, [runs["oracle"][seed] for seed in seeds], names, slos,
                                   label="upper bound (oracle): ")
        if lines:
            print("", file=out)
            for ln in lines:
                print(ln, file=out)
    if sim_runs:
        sim_med = {r: {n: median_over_seeds([sim_runs[head][seed][r][n] for seed in seeds]) for n in names}
                   for r in rates}
        for ln in order_lines(rates, med[head], sim_med):
            print(ln, file=out)
    notes = sorted({n for m in modes for r in rates for v in med[m][r].values() for n in v.get("notes", [])})
    for n in notes:
        print(f"note: {n}", file=out)
    if args.out_png:
        if args.ablation:
            plot_ablation(names, med[head][rates[0]], f"{header}; rate {rates[0]:g} req/s", args.out_png)
        else:
            plot_rates(rates, med[head], names, header, args.out_png, dupes)
        print(f"plot saved to {args.out_png}", file=out)
    result = {"header": header, "machine": mach, "rates": rates, "seeds": seeds, "predictions": head,
              "variants": {n: {**variants[n].__dict__, "config": variants[n].config} for n in names},
              "same_as": dupes,
              # the medians over seeds (each with its "spread"); the oracle's as "upper_bound"
              "results": {str(r): med[head][r] for r in rates},
              "per_seed": {m: {str(seed): {str(r): runs[m][seed][r] for r in rates} for seed in seeds}
                           for m in modes}}
    if upper is not None:
        result["upper_bound"] = {str(r): upper[r] for r in rates}
    if sim_runs:
        result["simulated"] = {m: {str(seed): {str(r): sim_runs[m][seed][r] for r in rates} for seed in seeds}
                               for m in sim_runs}
    if args.json and not to_json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    elif to_json:
        print(json.dumps(result, default=str))
    return 0


def _progress(key, m) -> None:
    mode, seed, rate, name = key
    print(f"  {mode}, seed {seed}, rate {rate:g} {name}: p50 {fmt(m['norm_latency_p50'], 4)} s/token "
          f"({m['run_s']:.1f} s)", file=sys.stderr)


def print_ablation(rate: float, steps: Sequence[str], res: Dict[str, Dict[str, Any]], out=sys.stdout,
                   mode: str = "online") -> None:
    """InferCept Figure 3 as a table, with the counters that explain each
    step: the handlings chosen at calls (preserve / discard / swap), the
    tokens recomputed, the preemptions, and the blocks swapped out / in
    (medians over seeds, like every column)."""
    seeds = next(iter(res.values())).get("seeds", 1) if res else 1
    what = {"online": "online predictions", "oracle": "oracle lengths and call times: an upper bound"}.get(mode, mode)
    print(f"\nablation at {rate:g} req/s (InferCept Figure 3; each step adds one technique; {what}"
          + (f"; median over {seeds} seeds (min-max)" if seeds > 1 else "") + ")", file=out)
    print("| step | handling, ranking, prefix cache | norm p50 | change | e2e mean s | KV waste GB*s | "
          "preserve / discard / swap | recomputed tokens | preemptions | swap blocks out / in |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|", file=out)
    prev = None
    for s in steps:
        m = res[s]
        v = ABLATION[[n for n, _ in ABLATION].index(s)][1]
        p50 = m.get("norm_latency_p50")
        ch = f"{100 * (p50 / prev - 1):+.1f}%" if prev and p50 is not None else "-"
        h = m.get("handling") or {}
        handled = " / ".join(fmt(h.get(k), 0) for k in ("preserve", "discard", "swap"))
        print(f"| {s} | {v.label} | {cell(m, 'norm_latency_p50', 4)} | {ch} | {cell(m, 'e2e_mean', 2)} | "
              f"{cell(m, 'kv_waste_gb_s', 3)} | {handled} | {cell(m, 'recomputed_tokens', 0)} | "
              f"{cell(m, 'preemptions', 0)} | {fmt(m.get('swap_out_blocks'), 0)} / {fmt(m.get('swap_in_blocks'), 0)} |",
              file=out)
        prev = p50


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="interlace bench trace", description=__doc__.split("\n\n")[0])
    add_trace_arguments(ap)
    return run_trace(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
