"""Agent traces: requests whose generation is intercepted by tool calls.

Format (InferCept's): a JSON object ``{request_id: [segment, ...], ...}``;
each segment is an object with ``prompt_tokens``, ``completion_tokens``,
``api_time`` (seconds) and ``api_token_length`` (tokens the tool returns).
We also read and write ``{"requests": [{"id", "arrival", "app",
"segments": [...]}, ...]}``, which carries arrival times and the
application (used as the tool name: tools of one kind take similar times).

Segment semantics (what the simulator and the native bench replay):

* segment 0's ``prompt_tokens`` is the request's prompt; each segment then
  decodes ``completion_tokens`` tokens;
* every segment but the last ends in an interception (a tool call) of
  ``api_time`` seconds -- a zero-time call still pauses the request -- whose
  result appends ``api_token_length`` tokens, followed by the next segment's
  ``prompt_tokens`` (a later user turn, for chat-like augments; 0 for a pure
  tool loop), all prefilled before the next segment decodes;
* the last segment's ``api_time`` / ``api_token_length`` are kept on a round
  trip but not replayed (the request ends when its last segment is decoded).

So a request with n segments makes n - 1 calls, its output is the sum of
``completion_tokens`` (at least 1), and the context at call j is
``sum(prompt + completion of segments <= j) + sum(api_token_length of calls < j)``.

Generators reproduce InferCept's Table 1 (and LAMPS' Table 2 for ToolBench):
each cell is read as (mean, standard deviation) -- the paper's header says
"variance", but read as variances several cells are implausible (VE's
context of 2185 tokens would vary by 11 tokens, Math's 9e-5 s calls by
7.7e-3 s); samples are gamma-distributed with that mean and deviation
(non-negative, right-skewed, as call times and lengths are).
Counts of calls are rounded and at least 1.  Token splits that Table 1 does
not give (decode tokens per step, tool result sizes) are stated per augment
in :data:`AUGMENTS` and are assumptions, not measurements.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple


class TraceError(ValueError):
    """A trace file or object is malformed; the message names the request and field."""


@dataclass(frozen=True)
class Segment:
    prompt_tokens: int
    completion_tokens: int
    api_time: float = 0.0
    api_token_length: int = 0


@dataclass
class TraceRequest:
    id: str
    segments: List[Segment]
    arrival: float = 0.0
    app: str = ""

    @property
    def num_calls(self) -> int:
        return len(self.segments) - 1

    @property
    def output_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.segments)

    @property
    def tool_s(self) -> float:
        """Seconds spent in calls (excluded from InferCept's normalized latency)."""
        return sum(s.api_time for s in self.segments[:-1])

    def call_contexts(self) -> List[int]:
        """Context length (tokens) when each call begins."""
        out, ctx = [], 0
        for i, s in enumerate(self.segments):
            ctx += s.prompt_tokens + s.completion_tokens
            if i < len(self.segments) - 1:
                out.append(ctx)
                ctx += s.api_token_length
        return out

    @property
    def peak_context(self) -> int:
        return sum(s.prompt_tokens + s.completion_tokens for s in self.segments) + \
            sum(s.api_token_length for s in self.segments[:-1])


@dataclass
class Trace:
    requests: List[TraceRequest] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)


# ---------------------------------------------------------------- validation
_INT_FIELDS = ("prompt_tokens", "completion_tokens", "api_token_length")


def _num(rid: str, where: str, value: Any, integer: bool) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"request {rid!r}: {where} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise TraceError(f"request {rid!r}: {where} must be finite, got {value!r}")
    if value < 0:
        raise TraceError(f"request {rid!r}: {where} must be >= 0, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise TraceError(f"request {rid!r}: {where} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def _segment(rid: str, i: int, obj: Any) -> Segment:
    if not isinstance(obj, dict):
        raise TraceError(f"request {rid!r}: segment {i} must be an object, got {type(obj).__name__}")
    vals = {}
    for name in ("prompt_tokens", "completion_tokens", "api_time", "api_token_length"):
        if name not in obj:
            raise TraceError(f"request {rid!r}: segment {i} is missing field {name!r}")
        vals[name] = _num(rid, f"segment {i} field {name!r}", obj[name], name in _INT_FIELDS)
    return Segment(**vals)


def validate_request(req: TraceRequest) -> TraceRequest:
    """Check a request built in code the way a loaded one is checked."""
    rid = req.id
    if not isinstance(rid, str) or not rid:
        raise TraceError(f"request {rid!r}: field 'id' must be a non-empty string")
    _num(rid, "field 'arrival'", req.arrival, False)
    if not isinstance(req.app, str):
        raise TraceError(f"request {rid!r}: field 'app' must be a string, got {type(req.app).__name__}")
    if not isinstance(req.segments, list) or not req.segments:
        raise TraceError(f"request {rid!r}: field 'segments' must be a non-empty list")
    for i, s in enumerate(req.segments):
        if not isinstance(s, Segment):
            raise TraceError(f"request {rid!r}: segment {i} must be a Segment, got {type(s).__name__}")
        for name in ("prompt_tokens", "completion_tokens", "api_time", "api_token_length"):
            _num(rid, f"segment {i} field {name!r}", getattr(s, name), name in _INT_FIELDS)
    if req.output_tokens < 1:
        raise TraceError(f"request {rid!r}: field 'completion_tokens' sums to 0 over its segments "
                         "(a request must generate at least one token)")
    return req


def _request(rid: str, segs: Any, arrival: Any = 0.0, app: Any = "") -> TraceRequest:
    if not isinstance(segs, list):
        raise TraceError(f"request {rid!r}: field 'segments' must be a list of segment objects, "
                         f"got {type(segs).__name__}")
    if not segs:
        raise TraceError(f"request {rid!r}: field 'segments' is empty")
    req = TraceRequest(rid, [_segment(rid, i, s) for i, s in enumerate(segs)],
                       _num(rid, "field 'arrival'", arrival, False), app)
    return validate_request(req)


def trace_from_obj(obj: Any, where: str = "trace") -> Trace:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object of requests, got {type(obj).__name__}")
    if "requests" in obj and isinstance(obj["requests"], list):
        out, seen = [], set()
        for i, r in enumerate(obj["requests"]):
            if not isinstance(r, dict):
                raise TraceError(f"{where}: request #{i} must be an object, got {type(r).__name__}")
            if "id" not in r:
                raise TraceError(f"{where}: request #{i} is missing field 'id'")
            rid = r["id"]
            if not isinstance(rid, (str, int)) or isinstance(rid, bool):
                raise TraceError(f"{where}: request #{i} field 'id' must be a string")
            rid = str(rid)
            if rid in seen:
                raise TraceError(f"request {rid!r}: field 'id' is duplicated")
            seen.add(rid)
            if "segments" not in r:
                raise TraceError(f"request {rid!r}: missing field 'segments'")
            out.append(_request(rid, r["segments"], r.get("arrival", 0.0), r.get("app", "")))
        return Trace(out)
    return Trace([_request(str(rid), segs) for rid, segs in obj.items()])


def load_trace(path: str | Path) -> Trace:
    """Read a trace file (either format of the module doc); TraceError names
    the request and field of the first problem."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace {path}: no such file")
    try:
        obj = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TraceError(f"trace {path}: not valid JSON ({e})") from e
    return trace_from_obj(obj, str(path))


def trace_to_obj(trace: Trace) -> Dict[str, Any]:
    return {"requests": [{"id": r.id, "arrival": r.arrival, "app": r.app,
                          "segments": [{"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                                        "api_time": s.api_time, "api_token_length": s.api_token_length}
                                       for s in r.segments]} for r in trace.requests]}


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write the ``{"requests": [...]}`` form (keeps arrivals and apps)."""
    Path(path).write_text(json.dumps(trace_to_obj(trace), indent=1) + "\n")


# ---------------------------------------------------------------- generators
@dataclass(frozen=True)
class Augment:
    """Statistics of one augment type: (mean, std) pairs."""

    call_s: Tuple[float, float]      # interception time, seconds (Table 1)
    calls: Tuple[float, float]       # interceptions per request (Table 1)
    context: Tuple[float, float]     # context length at an interception (Table 1)
    decode: Tuple[float, float]      # tokens decoded per segment (assumed)
    result: Tuple[float, float]      # tokens a call returns (assumed)


#: InferCept Table 1 (first three columns) plus our assumptions for decode
#: and result sizes (the paper only plots them, Figures 4-5).
AUGMENTS: Dict[str, Augment] = {
    "math": Augment((9e-5, 6e-5), (3.75, 1.3), (1422, 738), (40, 20), (4, 2)),
    "qa": Augment((0.69, 0.17), (2.52, 1.73), (1846, 428), (40, 20), (120, 60)),
    "ve": Augment((0.09, 0.014), (28.18, 15.2), (2185, 115), (12, 6), (20, 10)),
    "chatbot": Augment((28.6, 15.6), (4.45, 1.96), (753, 703), (120, 80), (40, 30)),
    "image": Augment((20.03, 7.8), (6.91, 3.93), (1247, 792), (80, 50), (16, 4)),
    "tts": Augment((17.24, 7.6), (6.91, 3.93), (1251, 792), (80, 50), (16, 4)),
}
#: LAMPS Table 2 (ToolBench): call time and count; context/decode/result assumed.
TOOLBENCH = Augment((1.72, 3.33), (2.45, 1.81), (1500, 600), (60, 40), (150, 100))
INFERCEPT_KINDS = tuple(AUGMENTS)
GENERATORS = INFERCEPT_KINDS + ("mixed", "toolbench")


def gamma(rng: random.Random, mean: float, std: float) -> float:
    """A gamma sample with this mean and standard deviation (the mean when std is 0)."""
    if std <= 0 or mean <= 0:
        return max(0.0, mean)
    k = (mean / std) ** 2
    return rng.gammavariate(k, std * std / mean)


def _count(rng: random.Random, mean: float, std: float, lo: int = 0) -> int:
    return max(lo, int(round(gamma(rng, mean, std))))


def _make_request(rid: str, app: str, aug: Augment, rng: random.Random) -> TraceRequest:
    n_calls = _count(rng, *aug.calls, lo=1)
    # contexts at the calls: Table 1's distribution, ascending, each call at
    # least two tokens (a decoded step) past the one before
    ctxs = sorted(max(2, _count(rng, *aug.context)) for _ in range(n_calls))
    for j in range(1, n_calls):
        ctxs[j] = max(ctxs[j], ctxs[j - 1] + 2)
    segs: List[Segment] = []
    prev = 0
    for j, c in enumerate(ctxs):
        gap = c - prev
        if j == 0:
            dec = min(max(1, _count(rng, *aug.decode)), gap - 1)
            prompt = gap - dec
        else:
            ret = segs[-1].api_token_length
            dec = min(max(1, _count(rng, *aug.decode)), gap)
            # the previous call's result and this segment's prompt fill the rest
            ret = min(ret, gap - dec)
            segs[-1] = replace(segs[-1], api_token_length=ret)
            prompt = gap - dec - ret
        segs.append(Segment(prompt, dec, gamma(rng, *aug.call_s), _count(rng, *aug.result)))
        prev = c
    segs.append(Segment(0, max(1, _count(rng, *aug.decode))))
    return TraceRequest(rid, segs, 0.0, app)


def generate_infercept(kind: str, n: int, seed: int = 0) -> Trace:
    """``n`` requests of one augment type (or ``mixed``: each request's
    type drawn uniformly, as InferCept's mixed workload), arrivals 0."""
    if kind not in AUGMENTS and kind != "mixed":
        raise ValueError(f"unknown augment kind {kind!r}; choose one of {', '.join(INFERCEPT_KINDS + ('mixed',))}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    rng = random.Random(f"infercept:{kind}:{seed}")
    out = []
    for i in range(n):
        k = rng.choice(INFERCEPT_KINDS) if kind == "mixed" else kind
        out.append(_make_request(str(i), k, AUGMENTS[k], rng))
    return Trace(out)


def generate_toolbench(n: int, seed: int = 0) -> Trace:
    """``n`` ToolBench-like requests (LAMPS Table 2 call statistics)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    rng = random.Random(f"toolbench:{seed}")
    return Trace([_make_request(str(i), "toolbench", TOOLBENCH, rng) for i in range(n)])


def generate(name: str, n: int, seed: int = 0) -> Trace:
    """A generator by name: an InferCept augment, ``mixed`` or ``toolbench``."""
    if name == "toolbench":
        return generate_toolbench(n, seed)
    return generate_infercept(name, n, seed)


def with_poisson_arrivals(trace: Trace, rate: float, seed: int = 0, start: float = 0.0) -> Trace:
    """A copy whose arrivals form a Poisson process of ``rate`` requests/s
    (exponential gaps, seeded; the first request arrives at ``start``)."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    rng = random.Random(f"poisson:{seed}")
    t, out = start, []
    for i, r in enumerate(trace.requests):
        if i:
            t += rng.expovariate(rate)
        out.append(replace(r, arrival=t, segments=list(r.segments)))
    return Trace(out)


def scale_trace(trace: Trace, *, max_context: Optional[int] = None, token_scale: float = 1.0,
                time_scale: float = 1.0, max_calls: Optional[int] = None) -> Trace:
    """A smaller copy for CPU runs: token counts times ``token_scale`` (and
    per request further so its peak context is at most ``max_context``),
    call times times ``time_scale``, at most ``max_calls`` calls per request.
    Every kept segment still decodes at least one token."""
    if token_scale <= 0 or time_scale < 0:
        raise ValueError("token_scale must be > 0 and time_scale >= 0")
    out = []
    for r in trace.requests:
        segs = list(r.segments)
        if max_calls is not None and len(segs) > max_calls + 1:
            segs = segs[:max_calls] + [replace(segs[-1])]
        f = token_scale
        if max_context is not None:
            peak = TraceRequest(r.id, segs).peak_context * token_scale
            if peak > max_context:
                f *= max_context / peak

        def tok(x: int, lo: int = 0) -> int:
            return max(lo, int(x * f))
        new = [Segment(tok(s.prompt_tokens), tok(s.completion_tokens, 1), s.api_time * time_scale,
                       tok(s.api_token_length)) for s in segs]
        if max_context is not None:  # rounding up decodes may overshoot: trim prompts, then results
            over = TraceRequest(r.id, new).peak_context - max_context
            for i, s in enumerate(new):
                if over <= 0:
                    break
                cut = min(over, s.prompt_tokens)
                new[i] = replace(s, prompt_tokens=s.prompt_tokens - cut)
                over -= cut
        out.append(replace(r, segments=new))
    return Trace(out)


def trace_stats(trace: Trace) -> Dict[str, float]:
    """Means and standard deviations of Table 1's three columns."""
    times = [s.api_time for r in trace for s in r.segments[:-1]]
    calls = [r.num_calls for r in trace]
    ctxs = [c for r in trace for c in r.call_contexts()]

    def ms(xs: Sequence[float]) -> Tuple[float, float]:
        if not xs:
            return (0.0, 0.0)
        m = sum(xs) / len(xs)
        return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
    (tm, ts), (cm, cs), (xm, xs_) = ms(times), ms(calls), ms(ctxs)
    return {"call_s_mean": tm, "call_s_std": ts, "calls_mean": cm, "calls_std": cs,
            "context_mean": xm, "context_std": xs_}
