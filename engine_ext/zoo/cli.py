"""``interlace zoo``: manage the block zoo (add, list, analyze, remove, make-variants).

Bad input (unknown names, wrong paths, mismatched or corrupt checkpoints,
bad arguments) exits 2 with one line ``error: ...`` on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional, Sequence

from .blocks import ZooError


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one ``error:`` line (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        raise ZooError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="interlace zoo", description="BlockLLM block zoo: bases and variants sharing blocks")
    root = _Parser(add_help=False)
    root.add_argument("--root", help="zoo directory (default: $INTERLACE_ZOO, else <cache>/zoo)")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    a = sub.add_parser("add", parents=[root], help="add a base (no --base) or a variant of BASE")
    a.add_argument("name")
    a.add_argument("path", help="HF directory, .gguf or 'embedded' (base); full fine-tune or PEFT LoRA dir (variant)")
    a.add_argument("--base", help="the base this variant derives from")

    ls = sub.add_parser("list", parents=[root], help="list bases and variants")
    ls.add_argument("--json", action="store_true")

    an = sub.add_parser("analyze", parents=[root], help="block equivalence: swap base blocks in, compare outputs")
    an.add_argument("variant", nargs="?", help="default: every variant")
    an.add_argument("--threshold", type=float, default=0.999)
    an.add_argument("--merge", action="store_true",
                    help="record passing blocks of full fine-tunes as merged (after a held-out check)")
    an.add_argument("--probes", help="file with one probe prompt per line")
    an.add_argument("--heldout", help="file with one held-out prompt per line (used with --merge)")
    an.add_argument("--json", action="store_true")

    rm = sub.add_parser("remove", parents=[root], help="remove a variant (or a base without variants)")
    rm.add_argument("name")

    mv = sub.add_parser("make-variants", help="write seeded synthetic full fine-tunes and LoRA adapters")
    mv.add_argument("--base", required=True, help="HF directory, .gguf or 'embedded'")
    mv.add_argument("--out", required=True, help="directory to write full-<i>/ and lora-<i>-r<rank>/ into")
    mv.add_argument("--full", type=int, default=0, help="number of full fine-tunes")
    mv.add_argument("--lora", type=int, default=0, help="number of LoRA adapters")
    mv.add_argument("--ranks", default="8,16,32,64", help="LoRA ranks, cycled over the adapters")
    mv.add_argument("--layers-per-variant", type=int, default=2, help="layers a full fine-tune perturbs")
    mv.add_argument("--scale", type=float, default=0.01, help="full fine-tune noise, x each tensor's std")
    mv.add_argument("--strength", type=float, default=None, help="LoRA update norm / weight norm")
    mv.add_argument("--seed", type=int, default=0)
    return p


def _lines(path: Optional[str]) -> Optional[List[str]]:
    if path is None:
        return None
    lines = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ZooError(f"{path}: no prompts")
    return lines


def _cmd_add(zoo, args) -> int:
    info = zoo.add(args.name, args.path, base=args.base)
    what = "base" if info.kind == "base" else f"{info.kind} variant of {info.base}"
    print(f"added {info.name} ({what}): {len(info.unique_blocks)} unique blocks, "
          f"{info.unique_bytes / 2**20:.2f} MiB")
    return 0


def _cmd_list(zoo, args) -> int:
    vs = zoo.variants()
    if args.json:
        print(json.dumps([asdict(v) for v in vs], indent=2))
        return 0
    rows = [("NAME", "BASE", "KIND", "UNIQUE", "UNIQUE MiB", "MERGED")]
    rows += [(v.name, v.base, v.kind, str(len(v.unique_blocks)), f"{v.unique_bytes / 2**20:.2f}",
              str(len(v.merged))) for v in vs]
    _table(rows)
    return 0


def _cmd_analyze(zoo, args) -> int:
    from .equivalence import analyze

    reports = analyze(zoo, args.variant, threshold=args.threshold, probes=_lines(args.probes),
                      heldout=_lines(args.heldout), merge=args.merge)
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=2))
        return 0
    rows = [("VARIANT", "BLOCK", "NEXT MIN", "NEXT MEAN", "ALL MEAN", "PASS", "NOTE")]
    rows += [(r.variant, r.block, f"{r.sim_min:.6f}", f"{r.sim_mean:.6f}", f"{r.sim_all_mean:.6f}",
              "yes" if r.passes else "no", r.note) for r in reports]
    _table(rows)
    held = {r.variant: r.heldout for r in reports if r.heldout}
    for name, h in held.items():
        print(f"{name}: held-out ({h['prompts']} prompts) cosine mean {h['cos_mean']:.6f}, "
              f"all positions {h['cos_all_mean']:.6f}, greedy agreement {h['greedy_agreement']:.4f}")
    if not args.merge and any(r.passes and r.kind == "full" for r in reports):
        print("nothing merged (pass --merge to record passing blocks)")
    return 0


def _cmd_remove(zoo, args) -> int:
    zoo.remove(args.name)
    print(f"removed {args.name}")
    return 0


def _cmd_make_variants(args) -> int:
    import random

    from .variants import DEFAULT_STRENGTH, resolve_base, make_full_variant, make_lora_adapter

    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError as e:
        raise ZooError(f"--ranks must be comma-separated integers: {e}") from e
    if args.full < 0 or args.lora < 0 or (args.lora and not ranks):
        raise ZooError("--full and --lora must be >= 0, and --ranks non-empty with --lora")
    base = resolve_base(args.base)
    n_layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    rng = random.Random(args.seed)
    out = Path(args.out)
    for i in range(args.full):
        layers = sorted(rng.sample(range(n_layers), min(args.layers_per_variant, n_layers)))
        d = make_full_variant(base, out / f"full-{i}", layers, args.scale, seed=args.seed + i)
        print(f"{d}\tfull\tlayers {','.join(map(str, layers))}\tscale {args.scale}")
    for i in range(args.lora):
        rank = ranks[i % len(ranks)]
        d = make_lora_adapter(base, out / f"lora-{i}-r{rank}", rank=rank, seed=args.seed + i,
                              strength=DEFAULT_STRENGTH if args.strength is None else args.strength)
        print(f"{d}\tlora\trank {rank}")
    return 0


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def main(argv: Optional[List[str]] = None) -> int:
    from interlace.engine_ext.native.models import UnsupportedModel

    from .store import Zoo

    try:
        args = build_parser().parse_args(argv)
        if args.cmd == "make-variants":
            return _cmd_make_variants(args)
        zoo = Zoo(args.root)
        return {"add": _cmd_add, "list": _cmd_list, "analyze": _cmd_analyze, "remove": _cmd_remove}[args.cmd](
            zoo, args)
    except (ZooError, UnsupportedModel, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
