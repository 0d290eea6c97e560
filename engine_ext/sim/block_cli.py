"""``interlace sim blocks``: per-model vs block provisioning (BlockLLM) of N
fine-tuned variants on a simulated cluster -- a cost model, not a measurement.

Prints, for each N, the two modes side by side with their ratio (and with
``--ablate`` the placement, KV and speculation ablations of block
provisioning); ``--json`` prints one JSON object.  Bad input exits 2 with
one ``error: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .block_cluster import ClusterSimError, ClusterSpec, FamilySpec, ModelSpec, WorkloadSpec, build_family, \
    generate_workload
from .blocks import KV_POLICIES, PLACEMENTS, BlockSimConfig, simulate_cluster

DEFAULT_VARIANTS = (1, 2, 4, 8)
# (label, metric key, format)
ROWS: Tuple[Tuple[str, str, str], ...] = (
    ("throughput tok/s", "throughput_tok_s", "{:.0f}"),
    ("latency p50 s", "latency_p50_s", "{:.2f}"),
    ("latency p95 s", "latency_p95_s", "{:.2f}"),
    ("GPU util", "gpu_util", "{:.3f}"),
    ("mean batch", "mean_batch", "{:.1f}"),
    ("weights at start GiB", "weights_initial_gib", "{:.1f}"),
    ("weights peak GiB", "weights_peak_gib", "{:.1f}"),
    ("KV peak GiB", "kv_peak_gib", "{:.1f}"),
    ("memory peak GiB", "mem_peak_gib", "{:.1f}"),
    ("hops same GPU", "hop_frac_gpu", "{:.3f}"),
    ("hops intra-server", "hop_frac_server", "{:.3f}"),
    ("hops inter-server", "hop_frac_inter", "{:.3f}"),
    ("act. MiB inter-server", "act_mib_inter", "{:.1f}"),
    ("KV migrations", "migrations", "{:d}"),
    ("KV MiB copied", "kv_mib_moved", "{:.1f}"),
    ("KV tokens recomputed", "kv_tokens_recomputed", "{:d}"),
    ("load events", "load_events", "{:d}"),
    ("load time s", "load_time_s", "{:.2f}"),
    ("spec hits/misses", "spec", "{}"),
    ("spec net latency s", "spec_net_s", "{:.3f}"),
)


def add_blocks_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--variants", default=None,
                   help="number of fine-tuned variants, or a comma list (default: 1,2,4,8)")
    p.add_argument("--requests", type=int, default=200, help="requests per run (default 200)")
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals, requests/s in all (default 20)")
    p.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform",
                   help="variant weights: uniform-drawn rates (BlockLLM §7.1) or Zipf")
    p.add_argument("--prompt-mean", type=int, default=256)
    p.add_argument("--output-mean", type=int, default=64)
    p.add_argument("--cluster", default=None,
                   help="cluster spec: inline JSON or a JSON file; fields override the defaults "
                        "(4 servers: 2x2 + 2x4 A100-80GB, 100 Gb/s)")
    p.add_argument("--layers-per-block", type=int, default=4)
    p.add_argument("--lora-fraction", type=float, default=0.5, help="share of variants that are LoRA (else FF)")
    p.add_argument("--placement", choices=PLACEMENTS, default="locality")
    p.add_argument("--kv", choices=KV_POLICIES, default="owner-first", dest="kv_policy")
    p.add_argument("--speculate", type=int, default=0, help="surrogates for the top-K bottleneck blocks")
    p.add_argument("--surrogate-accuracy", type=float, default=0.83)
    p.add_argument("--surrogate-speedup", type=float, default=20.0)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--ablate", action="store_true",
                   help="also run block provisioning with naive placement, least-loaded KV dispatch and, "
                        "unless --speculate is set, speculation on 2 blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _variants(text: Optional[str]) -> List[int]:
    if text is None:
        return list(DEFAULT_VARIANTS)
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ClusterSimError(f"--variants: expected an integer or a comma list, got {text!r}") from None
    if not ns or any(n < 1 for n in ns):
        raise ClusterSimError(f"--variants must be >= 1, got {text!r}")
    return ns


def run_blocks_comparison(args: argparse.Namespace) -> Dict[str, Any]:
    """Every run the arguments ask for, as one JSON-able dict."""
    cluster = ClusterSpec.from_json(args.cluster) if args.cluster else ClusterSpec()
    model = ModelSpec()
    if args.rate is None or not args.rate > 0:
        raise ClusterSimError(f"--rate must be a positive number of requests/s, got {args.rate}")
    base = BlockSimConfig(placement=args.placement, kv_policy=args.kv_policy, speculate=args.speculate,
                          surrogate_accuracy=args.surrogate_accuracy, surrogate_speedup=args.surrogate_speedup,
                          max_batch=args.max_batch, seed=args.seed)
    configs: List[Tuple[str, BlockSimConfig]] = [
        ("per-model", BlockSimConfig(mode="per-model", max_batch=args.max_batch, seed=args.seed)),
        ("block", base)]
    if args.ablate:
        other_pl = "naive" if args.placement == "locality" else "locality"
        other_kv = "least-loaded" if args.kv_policy == "owner-first" else "owner-first"
        configs += [(f"block {other_pl}", _replace(base, placement=other_pl)),
                    (f"block {other_kv}", _replace(base, kv_policy=other_kv)),
                    (f"block spec={0 if args.speculate else 2}", _replace(base, speculate=0 if args.speculate else 2))]
    runs = []
    for n in _variants(args.variants):
        fam = build_family(model, FamilySpec(variants=n, layers_per_block=args.layers_per_block,
                                             lora_fraction=args.lora_fraction, seed=args.seed))
        wl = WorkloadSpec(requests=args.requests, rate=args.rate, popularity=args.popularity,
                          prompt_mean=args.prompt_mean, output_mean=args.output_mean, seed=args.seed)
        reqs = generate_workload(n, wl)
        out = {"variants": n, "variant_kinds": [v.kind for v in fam.variants], "results": {}}
        for label, cfg in configs:
            out["results"][label] = simulate_cluster(cluster, fam, reqs, cfg).metrics
        runs.append(out)
    return {"simulated": True, "note": "cost model (roofline), not a measurement",
            "cluster": cluster.to_dict(), "model": model.name,
            "workload": {"requests": args.requests, "rate": args.rate, "popularity": args.popularity,
                         "prompt_mean": args.prompt_mean, "output_mean": args.output_mean, "seed": args.seed},
            "runs": runs}


def _replace(cfg: BlockSimConfig, **kw: Any) -> BlockSimConfig:
    from dataclasses import replace
    return replace(cfg, **kw)


def _cell(m: Dict[str, Any], key: str, fmt: str) -> str:
    if key == "spec":
        return f"{m['spec_hits']}/{m['spec_misses']}"
    return fmt.format(m[key])


def format_table(report: Dict[str, Any]) -> str:
    c = report["cluster"]
    w = report["workload"]
    lines = [f"interlace sim blocks -- SIMULATED ({report['note']}); {report['model']}, "
             f"{sum(c['gpus_per_server'])} GPUs in servers {c['gpus_per_server']}, "
             f"{c['gpu_mem_gib']:g} GiB, {c['inter_server_gbps']:g} Gb/s between servers; "
             f"{w['requests']} requests at {w['rate']:g}/s ({w['popularity']}), seed {w['seed']}"]
    for run in report["runs"]:
        res = run["results"]
        labels = list(res)
        kinds = ",".join(run["variant_kinds"])
        lines.append("")
        lines.append(f"N = {run['variants']} variants ({kinds})")
        head = f"  {'':<22}" + "".join(f"{lab:>19}" for lab in labels) + f"{'block/pm':>10}"
        lines.append(head)
        pm, blk = res["per-model"], res["block"]
        for label, key, fmt in ROWS:
            cells = "".join(f"{_cell(res[lab], key, fmt):>19}" for lab in labels)
            ratio = ""
            if key != "spec":
                a, b = pm[key], blk[key]
                ratio = f"{b / a:.2f}x" if a else ("=" if b == a else "-")
            lines.append(f"  {label:<22}{cells}{ratio:>10}")
    return "\n".join(lines)


def run_blocks(args: argparse.Namespace) -> int:
    try:
        report = run_blocks_comparison(args)
    except ClusterSimError as e:
        return _fail(str(e).splitlines()[0])
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="interlace sim blocks", description=__doc__.splitlines()[0])
    return run_blocks(add_blocks_arguments(p).parse_args(argv))
