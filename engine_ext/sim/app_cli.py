"""``interlace sim apps``: Parrot's applications on a simulated engine at GPU speed -- a cost model, not a measurement.

    interlace sim apps [--apps chain,mapreduce,shared,multiagent] [--sizes bench|parrot|quick]
                       [--profile h100-llama-3-8b] [--repeats 3] [--seed 0] [--delay-ms 200,300]
                       [--baseline-cap 4096] [--latency-cap 2048] [--protocol parrot|sdk] [--json]

Runs each application (``apps``: the DAGs of ``interlace bench apps`` in
tokens) as every variant (``app_engine``: request-centric step by step and
stage-concurrent, capped at Parrot's baseline capacity or not, with the
block-hash prefix cache or not; Semantic Variables with forks and the cache,
or one of them) on a fresh simulated engine per run, ``--repeats`` times
with the network delays of repeat r drawn as ``bench apps`` draws them.
Prints a table per app (e2e mean, its min-max over the repeats, the ratios
to a-seq and a-par, prefilled tokens, peak KV blocks, calls/s, HTTP
requests), the issue's targets PASS/MISS and where the gain comes from
(a-par -> a-par-nocap: the capacity cap; a-par-nocap -> b-nofork: round
trips and objectives; b-nofork -> b: forks).  ``--profile`` is a built-in
name (the ``h100-*`` are derived rooflines, labelled so) or a profile JSON
file.  ``--json`` prints one JSON object.  Bad input exits 2 with one
``error: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..policies.costmodel import BUILTIN_PROFILES, Profile, ProfileError
from .app_engine import (BASELINE_CAP_TOKENS, LATENCY_CAP_TOKENS, PROTOCOLS, VARIANT_ABOUT, VARIANT_ORDER,
                         AppSimError, make_variant, run_variant, variants_for)
from .apps import SIZE_SETS, AppDAG, AppSpecError, Sizes, build_app, deduce_objectives, parse_apps

DEFAULT_PROFILE = "h100-llama-3-8b"

#: the issue's targets: (app, metric, factor, baseline, what); e2e and prefill: baseline / b, throughput: b / baseline
TARGETS = (("chain", "e2e_s", 1.3, "a-seq", "faster end to end"),
           ("mapreduce", "e2e_s", 2.0, "a-seq", "faster end to end"),
           ("multiagent", "e2e_s", 3.0, "a-seq", "faster end to end"),
           ("shared", "prefill_tokens", 5.0, "a-par-nocache", "fewer prefilled tokens"),
           ("shared", "calls_per_s", 1.5, "a-par-nocache", "the throughput (requests/s)"))
#: reported beside them, no verdict: the stronger baselines
INFO = (("chain", "e2e_s", "a-par-nocap"), ("mapreduce", "e2e_s", "a-par"), ("mapreduce", "e2e_s", "a-par-nocap"),
        ("multiagent", "e2e_s", "a-par"), ("multiagent", "e2e_s", "a-par-nocap"),
        ("shared", "prefill_tokens", "a-par"), ("shared", "calls_per_s", "a-par"),
        ("shared", "calls_per_s", "a-par-nocap-nocache"), ("shared", "calls_per_s", "a-par-nocap"))
MIN_USERS_FOR_THROUGHPUT = 16

SCALARS = ("e2e_s", "prefill_tokens", "decode_tokens", "recomputed_tokens", "cache_hit_tokens", "forked_tokens",
           "peak_blocks", "output_tokens", "prompt_tokens", "calls", "calls_per_s", "http_requests", "network_s_sum",
           "client_mean_s", "iterations", "preemptions", "held_steps", "alone_steps", "max_run_tokens",
           "prefix_filled_tokens")


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def parse_delay(text: str) -> Tuple[float, float]:
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not all(math.isfinite(x) and x >= 0 for x in parts) or parts[0] > parts[1]:
        raise AppSpecError(f"--delay-ms must be LO,HI milliseconds (0 <= LO <= HI), got {text!r}")
    return parts[0] / 1000, parts[1] / 1000


def parse_cap(text: str, option: str) -> Optional[int]:
    if text.strip().lower() in ("none", "off", "0"):
        return None
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 1:
        raise AppSpecError(f"{option} must be a positive number of tokens or 'none', got {text!r}")
    return v


def parse_variants(text: Optional[str]) -> Optional[List[str]]:
    if text is None:
        return None
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANT_ORDER]
    if bad or not names:
        raise AppSpecError(f"--variants: unknown variant {bad[0] if bad else text!r}; choose from "
                           f"{', '.join(VARIANT_ORDER)}")
    return list(dict.fromkeys(names))


def add_apps_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--apps", help="comma-separated, default all: chain,mapreduce,shared,multiagent")
    p.add_argument("--sizes", default="bench", choices=sorted(SIZE_SETS),
                   help="size set: bench (= bench apps' defaults), quick (its --quick), parrot (GPU scale, our "
                        "reading of Parrot's section 8: " + ", ".join(f"{k} {v}" for k, v in
                                                                       SIZE_SETS["parrot"].__dict__.items()) + ")")
    for k in Sizes.__dataclass_fields__:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"override the size set's {k} (bench {getattr(SIZE_SETS['bench'], k)})")
    p.add_argument("--variants", help="comma-separated, default each app's: " + ", ".join(VARIANT_ORDER))
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"built-in ({', '.join(sorted(BUILTIN_PROFILES))}) or a profile JSON file "
                        f"(default {DEFAULT_PROFILE}, a derived roofline)")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant, network delays seeded per repeat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay-ms", default="200,300", help="network delay per HTTP request, uniform LO,HI ms")
    p.add_argument("--baseline-cap", default=str(BASELINE_CAP_TOKENS),
                   help="request-centric engine's capacity, tokens (Parrot's baseline: 4096; 'none': no cap)")
    p.add_argument("--latency-cap", default=str(LATENCY_CAP_TOKENS),
                   help="Semantic Variables' engine: tokens beside latency-critical work (default 2048; 'none')")
    p.add_argument("--protocol", default="parrot", choices=PROTOCOLS,
                   help="b's client: parrot (submit all, then fetch) or sdk (bench apps' SDK client: session, "
                        "first stage + declarations, later submits, fetches)")
    p.add_argument("--min-prefix-tokens", type=int, default=16, help="shortest prefix the gateway forks")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


# ------------------------------------------------------------------ summaries
def _stats(xs: Sequence[Optional[float]]) -> Dict[str, Optional[float]]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "min": None, "max": None, "sd": None}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    out: Dict[str, Dict[str, Any]] = {}
    for v in [x for x in VARIANT_ORDER if any(r["variant"] == x for r in rows)]:
        rs = [r for r in rows if r["variant"] == v]
        s: Dict[str, Any] = {"runs": len(rs)}
        for k in SCALARS:
            if any(k in r for r in rs):
                s[k] = _stats([r.get(k) for r in rs])
        out[v] = s
    return out


def _mean(summ: Dict[str, Dict[str, Any]], v: str, k: str) -> Optional[float]:
    s = summ.get(v, {}).get(k)
    return None if s is None else s["mean"]


def ratio(summ: Dict[str, Dict[str, Any]], k: str, base: str, v: str = "b") -> Optional[float]:
    """How much better ``v`` is than ``base`` on ``k`` (> 1: better): base / v, or v / base for throughput."""
    a, b = _mean(summ, base, k), _mean(summ, v, k)
    if a is None or b is None or a == 0 or b == 0:
        return None
    return b / a if k == "calls_per_s" else a / b


def target_lines(summaries: Dict[str, Dict[str, Dict[str, Any]]], apps: Dict[str, AppDAG]) -> List[Dict[str, Any]]:
    out = []
    for app, k, factor, base, what in TARGETS:
        if app not in summaries:
            continue
        r = ratio(summaries[app], k, base)
        note = ""
        if k == "calls_per_s" and apps[app].clients < MIN_USERS_FOR_THROUGHPUT:
            verdict, note = "n/a", f" (needs {MIN_USERS_FOR_THROUGHPUT}+ users, have {apps[app].clients})"
        else:
            verdict = "n/a" if r is None else ("PASS" if r >= factor - 1e-12 else "MISS")
        out.append({"app": app, "metric": k, "factor": factor, "baseline": base, "ratio": r, "verdict": verdict,
                    "line": f"target {app}: b >= {factor:g}x {what} than {base}: {_fmt(r, 2)}x -> {verdict}{note}"})
    return out


def info_lines(summaries: Dict[str, Dict[str, Dict[str, Any]]]) -> List[str]:
    out = []
    for app, k, base in INFO:
        if app in summaries and base in summaries[app] and "b" in summaries[app]:
            what = {"e2e_s": "e2e", "prefill_tokens": "prefilled tokens", "calls_per_s": "throughput"}[k]
            out.append(f"vs stronger baseline {app}: b {what} {_fmt(ratio(summaries[app], k, base), 2)}x "
                       f"better than {base}")
    return out


def decomposition(app: str, summ: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """Where b's e2e gain over a-par comes from, step by step (each step's e2e ratio)."""
    steps = [("a-par", "a-par-nocap", "capacity cap removed"),
             ("a-par-nocap", "b-nofork", "DAG submitted up front, objectives (no client round trips)"),
             ("b-nofork", "b", "forked prefix contexts")]
    if "a-par" not in summ:
        return None
    parts = [f"{label} {_fmt(ratio(summ, 'e2e_s', a, b), 2)}x" for a, b, label in steps if a in summ and b in summ]
    return f"{app}: " + "; ".join(parts) if parts else None


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


COLUMNS = ("variant", "e2e s (mean)", "min-max", "a-seq / x", "a-par / x", "prefilled tok", "peak KV blocks",
           "calls/s", "HTTP req", "held steps")


def table(app: AppDAG, summ: Dict[str, Dict[str, Any]], same: Dict[str, str]) -> List[str]:
    objs = deduce_objectives(app)
    n_lat = sum(1 for o, _ in objs.values() if o == "latency")
    n_grp = len({g for _, g in objs.values() if g})
    lines = [f"**{app.name}**: {app.about}; {len(app.calls)} calls in {len(app.stages())} stages, "
             f"{sum(c.prompt_tokens for c in app.calls)} prompt tokens; b's objectives: {n_lat} latency-critical "
             f"calls, {n_grp} task groups",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for v in VARIANT_ORDER:
        if v in same:
            lines.append(f"| {v} (= {same[v]}) |" + " |" * (len(COLUMNS) - 1))
            continue
        if v not in summ:
            continue
        s = summ[v]
        e = s["e2e_s"]
        lines.append("| " + " | ".join([
            v, _fmt(e["mean"], 3), f"{e['min']:.3f}-{e['max']:.3f}",
            _fmt(ratio(summ, "e2e_s", "a-seq", v), 2) if "a-seq" in summ else "-",
            _fmt(ratio(summ, "e2e_s", "a-par", v), 2) if "a-par" in summ else "-",
            _fmt(s["prefill_tokens"]["mean"], 0), _fmt(s["peak_blocks"]["mean"], 0),
            _fmt(s["calls_per_s"]["mean"], 1), _fmt(s["http_requests"]["mean"], 0),
            _fmt(s["held_steps"]["mean"], 0)]) + " |")
    return lines


# ------------------------------------------------------------------ running
def simulate_apps(names: Sequence[str], sizes: Sizes, profile: Profile, *, variants: Optional[Sequence[str]] = None,
                  repeats: int = 3, seed: int = 0, delay: Tuple[float, float] = (0.2, 0.3),
                  baseline_cap: Optional[int] = BASELINE_CAP_TOKENS, latency_cap: Optional[int] = LATENCY_CAP_TOKENS,
                  protocol: str = "parrot", min_prefix_tokens: int = 16) -> Dict[str, Any]:
    """Every app and variant ``repeats`` times: the report as a dict (``--json``'s object)."""
    if repeats < 1:
        raise AppSpecError(f"--repeats must be positive, got {repeats}")
    if min_prefix_tokens < 1:
        raise AppSpecError(f"--min-prefix-tokens must be positive, got {min_prefix_tokens}")
    apps = {n: build_app(n, sizes) for n in names}
    runs: List[Dict[str, Any]] = []
    summaries: Dict[str, Dict[str, Dict[str, Any]]] = {}
    same_as: Dict[str, Dict[str, str]] = {}
    for n, app in apps.items():
        vs, same = variants_for(app)
        if variants is not None:
            vs = [v for v in variants if v not in same]
            same = {k: w for k, w in same.items() if k in variants}
        same_as[n] = same
        app_rows = []
        for rep in range(repeats):
            for v in vs:
                row = run_variant(app, make_variant(v, baseline_cap, latency_cap), profile, seed=seed, repeat=rep,
                                  delay=delay, protocol=protocol, min_prefix_tokens=min_prefix_tokens)
                app_rows.append({k: row[k] for k in ("app", "variant", "repeat", *SCALARS) if k in row})
        runs += app_rows
        summaries[n] = summarize(app_rows)
    targets = target_lines(summaries, apps)
    return {"profile": profile.model, "device": profile.device, "profile_source": profile.source,
            "sizes": sizes.__dict__, "delay_s": list(delay), "seed": seed, "repeats": repeats,
            "baseline_cap_tokens": baseline_cap, "latency_cap_tokens": latency_cap, "protocol": protocol,
            "min_prefix_tokens": min_prefix_tokens,
            "apps": {n: {"about": a.about, "calls": len(a.calls), "stages": len(a.stages()), "clients": a.clients,
                         "same_as": same_as[n], "variants": summaries[n]} for n, a in apps.items()},
            "targets": targets, "info": info_lines(summaries),
            "decomposition": [d for d in (decomposition(n, summaries[n]) for n in apps) if d],
            "variant_about": {v: VARIANT_ABOUT[v] for v in VARIANT_ORDER}, "runs": runs}


def print_report(rep: Dict[str, Any], apps: Dict[str, AppDAG]) -> None:
    d = rep["delay_s"]
    cap = rep["baseline_cap_tokens"]
    lat = rep["latency_cap_tokens"]
    print(f"sim apps on {rep['profile']} / {rep['device']} ({rep['profile_source']}); a cost model, not a measurement")
    print(f"sizes {rep['sizes']}; network {d[0] * 1000:g}-{d[1] * 1000:g} ms per HTTP request (seed {rep['seed']}, "
          f"{rep['repeats']} repeats, e2e mean and min-max over them); request-centric engine cap "
          f"{cap if cap else 'none'} tokens (Parrot's baseline), Semantic Variables' latency cap "
          f"{lat if lat else 'none'} tokens; b's client protocol {rep['protocol']}")
    print()
    for n, a in apps.items():
        for ln in table(a, rep["apps"][n]["variants"], rep["apps"][n]["same_as"]):
            print(ln)
        print()
    for t in rep["targets"]:
        print(t["line"])
    for ln in rep["info"]:
        print(ln)
    for ln in rep["decomposition"]:
        print(f"gain over a-par, step by step (e2e): {ln}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="interlace sim apps", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_apps_arguments(p).parse_args(argv)
    try:
        names = parse_apps(args.apps)
        base = SIZE_SETS[args.sizes]
        sizes = Sizes(**{k: (getattr(args, k) if getattr(args, k) is not None else getattr(base, k))
                         for k in Sizes.__dataclass_fields__}).validated()
        variants = parse_variants(args.variants)
        delay = parse_delay(args.delay_ms)
        baseline_cap = parse_cap(args.baseline_cap, "--baseline-cap")
        latency_cap = parse_cap(args.latency_cap, "--latency-cap")
        profile = Profile.load(args.profile)
        rep = simulate_apps(names, sizes, profile, variants=variants, repeats=args.repeats, seed=args.seed,
                            delay=delay, baseline_cap=baseline_cap, latency_cap=latency_cap, protocol=args.protocol,
                            min_prefix_tokens=args.min_prefix_tokens)
    except (AppSpecError, ProfileError, AppSimError, ValueError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if args.json:
        print(json.dumps(rep))
        return 0
    print_report(rep, {n: build_app(n, sizes) for n in names})
    return 0


__all__ = ["TARGETS", "add_apps_arguments", "main", "simulate_apps", "summarize", "target_lines"]
