"""``interlace sim``: replay a trace on the simulator and print its metrics.

``--trace`` is a trace file (InferCept's JSON format, see ``traces``) or a
generator name (``mixed``, ``toolbench``, ``qa``, ...) with
``--num-requests`` and ``--seed``; ``--rate`` gives Poisson arrivals
(seeded by ``--seed``).  Lengths, calls and later segments are predicted
online as the served product does; ``--oracle`` reads them from the trace
(the upper bound, never the product's condition).  ``--horizon`` and
``--handling-at-call`` are LAMPS' options.  Bad input exits 2 with one line
on stderr.
``interlace sim blocks ...`` is the cluster simulator (``block_cli``);
``interlace sim apps ...`` runs Parrot's applications on a simulated engine
(``app_cli``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..policies import INTERCEPTION_NAMES, RANKING_NAMES, Profile, ProfileError, make_interception, make_ranking
from .simulator import SimulationError, simulate
from .traces import GENERATORS, TraceError, generate, load_trace, with_poisson_arrivals

TABLE_KEYS = ("completed", "rps", "norm_latency_p50", "norm_latency_p90", "norm_latency_p99", "e2e_mean", "e2e_p99",
              "ttft_mean", "ttft_p99", "kv_waste_gb_s", "iterations", "preemptions", "recomputed_tokens",
              "swap_out_blocks", "swap_in_blocks")


BLOCKS_EPILOG = ("Cluster mode: `interlace sim blocks [--variants N] [--rate R] [--cluster JSON] "
                 "[--placement locality|naive] [--kv owner-first|least-loaded] [--speculate K] [--ablate] ...` "
                 "compares per-model and block (BlockLLM) provisioning of N fine-tuned variants on a simulated "
                 "cluster; `interlace sim blocks --help` lists its options.  Applications: `interlace sim apps "
                 "[--apps ...] [--sizes bench|parrot|quick] [--profile P] [--repeats N] ...` runs Parrot's "
                 "applications request-centric and through Semantic Variables on a simulated engine; "
                 "`interlace sim apps --help` lists its options.")


def add_sim_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.epilog = BLOCKS_EPILOG
    p.add_argument("--trace", required=True,
                   help=f"trace JSON file, or a generator: {', '.join(GENERATORS)}")
    p.add_argument("--policy", default="infercept", help=f"interception policy: {', '.join(INTERCEPTION_NAMES)}")
    p.add_argument("--ranking", default="lamps", help=f"ranking: {', '.join(RANKING_NAMES)}")
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals at this many requests/s (default: the trace's arrivals)")
    p.add_argument("--profile", default="h100-gpt-j-6b", help="profile JSON file or built-in name")
    p.add_argument("--num-requests", type=int, default=200, help="requests to generate (generator traces)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-caching", action="store_true", help="freed blocks are not kept for reuse")
    p.add_argument("--starvation-threshold", type=int, default=100)
    p.add_argument("--refresh-interval", type=int, default=1, help="LAMPS score refresh, in iterations")
    p.add_argument("--max-batch-requests", type=int, default=None)
    p.add_argument("--admission", choices=("greedy", "peak"), default="greedy")
    p.add_argument("--rank-preempt", action="store_true",
                   help="the best-ranked waiting request may preempt lower-ranked running ones (LAMPS Alg. 1)")
    p.add_argument("--oracle", action="store_true",
                   help="read lengths, call times and later segments from the trace (the upper bound) instead of "
                        "predicting them online as the product does")
    p.add_argument("--horizon", choices=("segment", "job"), default="job",
                   help="LAMPS scores up to the next call (segment, the paper's) or adds the later ones (job)")
    p.add_argument("--handling-at-call", action="store_true",
                   help="LAMPS: a call gets the handling predicted for its segment (Algorithm 1) instead of the "
                        "interception policy deciding afresh")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def run_sim(args: argparse.Namespace) -> int:
    try:
        profile = Profile.load(args.profile)
        if args.trace in GENERATORS:
            if args.num_requests < 1:
                return _fail(f"--num-requests must be >= 1, got {args.num_requests}")
            trace = generate(args.trace, args.num_requests, args.seed)
        elif Path(args.trace).exists():
            trace = load_trace(args.trace)
        else:
            return _fail(f"trace {args.trace}: no such file (or generator: {', '.join(GENERATORS)})")
        if not trace.requests:
            return _fail(f"trace {args.trace}: no requests")
        if args.rate is not None:
            trace = with_poisson_arrivals(trace, args.rate, args.seed)
        interception = make_interception(args.policy, profile)
        ranking = make_ranking(args.ranking, profile, interception, starvation_threshold=args.starvation_threshold,
                               refresh_interval=args.refresh_interval, horizon=args.horizon,
                               handling_at_call=args.handling_at_call)
        res = simulate(trace, profile, interception, ranking, prefix_caching=not args.no_prefix_caching,
                       max_batch_requests=args.max_batch_requests, admission=args.admission,
                       oracle=args.oracle, rank_preempt=args.rank_preempt)
    except (TraceError, ProfileError, ValueError, SimulationError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    m = dict(res.metrics, rate=args.rate, trace=args.trace, oracle=args.oracle)
    if args.json:
        print(json.dumps(m))
        return 0
    print(f"sim: {m['policy']} + {m['ranking']} on {m['profile']} ({m['profile_source']}); "
          + ("oracle predictions (upper bound)" if args.oracle else "online predictions"))
    for k in TABLE_KEYS:
        v = m.get(k)
        print(f"  {k:<20} {v:.4g}" if isinstance(v, float) else f"  {k:<20} {v}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["blocks"]:
        from .block_cli import main as blocks_main

        return blocks_main(argv[1:])
    if argv[:1] == ["apps"]:
        from .app_cli import main as apps_main

        return apps_main(argv[1:])
    p = argparse.ArgumentParser(prog="interlace sim", description=__doc__.splitlines()[0])
    return run_sim(add_sim_arguments(p).parse_args(argv))
