"""Engine throughput: prefill and decode tokens/s at several batch sizes, the
native engine side by side with its peers on the same prompts and the same
model (the embedded SmolLM2-135M-Instruct unless ``--model`` says otherwise):
Hugging Face transformers ``generate`` (always), llama.cpp through
``llama-cpp-python`` on the GGUF file as shipped (batch 1: its Python API runs
one sequence; when it is installed and the model is a GGUF), and vLLM's CPU
engine (when ``vllm`` imports, or ``--vllm-python`` names a Python that has it;
prefix caching off, eager).

    interlace bench engine [--batches 1 8 32] [--new 64] [--long 2048] [--repeat 3]
                           [--variants "interlace float32" "vllm bfloat16" ...] [--neighbour 0 1]

On a GPU: ``interlace bench engine --device cuda`` (:mod:`.engine_cuda`).

Method.  Prompt lengths vary from row to row (``--prompt-lens``, default 60
to 200 tokens, drawn per row), the same prompts for every engine; they are
random token ids, so no two share a prefix (nothing is served from a prefix
cache).  ``--long N`` adds a batch-1 row with an N-token prompt.  Prefill
tokens/s = prompt tokens / time to compute the prompts' KV (the engine:
concurrent ``fill`` calls; the others: a one-token generation).  Decode
tokens/s = batch * (new - 1) / decode time (the engine: the ``generate``
streams after the fill; the others: a ``new``-token generation minus the
one-token one; llama.cpp: the tokens after the first).  Greedy, EOS ignored.

Each variant (engine x weights) is measured in a fresh subprocess (so no
variant inherits another's threads, caches or allocator state), the variants
take turns within each of ``--repeat`` rounds (so a noisy neighbour on a
shared machine hits them alike), and the best round per cell is reported.

``--neighbour N`` runs the same cells with N busy processes beside each
variant (pure-Python loops, started after its warm-up): a server's other
work, or the tool workers of partial execution.  Several counts in one run
(``--neighbour 0 1``) give each variant a quiet row and a ``+1`` row, and the
ratios of one to the other.  The header records the machine's ISA class
(AVX2, AVX-512, AMX): which kernels every engine could use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from interlace.engine_ext.machine import describe_machine, machine as machine_description

def prompts(vocab_size: int, n: int, length: "int | tuple", seed: int) -> List[List[int]]:
    """``n`` prompts of random token ids (clear of the special tokens at both
    ends of the vocabulary), each ``length`` tokens long, or a length drawn
    from ``(lo, hi)`` per row.  Random, so that no two prompts -- and no two
    batch sizes or rounds -- share a prefix: the engine's prefix cache must
    not turn a prefill measurement into a cache hit."""
    rng = random.Random(seed)
    lo, hi = min(1000, vocab_size // 4), vocab_size - 100
    lengths = [length if isinstance(length, int) else rng.randint(*length) for _ in range(n)]
    return [[rng.randrange(lo, hi) for _ in range(k)] for k in lengths]


def bench_native(engine, batch: List[List[int]], new: int) -> Dict[str, float]:
    from interlace.engine_ext.protocol import SamplingParams

    sp = SamplingParams(max_tokens=new, ignore_eos=True)

    async def go():
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.fill(f"b{i}", p) for i, p in enumerate(batch)))
        # on a GPU a fill returns once its steps are queued, not run (no step waits for the device but
        # for its sampled ids): wait for them, or the prefill's tail is timed as decode (the first GPU
        # run's 351% of the matmul ceiling for prefill was that)
        device = getattr(engine, "device", None)
        if getattr(device, "type", None) == "cuda":
            import torch

            torch.cuda.synchronize(device)
        t1 = time.perf_counter()

        async def drain(i):
            n = 0
            async for _ in engine.generate(f"b{i}", sp):
                n += 1
            return n
        counts = await asyncio.gather(*(drain(i) for i in range(len(batch))))
        t2 = time.perf_counter()
        for i in range(len(batch)):
            await engine.free_context(f"b{i}")
        assert all(c == new for c in counts)
        return t1 - t0, t2 - t1

    tp, td = asyncio.run(go())
    return {"prefill": sum(map(len, batch)) / tp, "decode": len(batch) * (new - 1) / td}


def bench_hf(model, batch: List[List[int]], new: int) -> Dict[str, float]:
    import torch

    width = max(map(len, batch))  # left padding: every row's last prompt token at the end
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    kw = dict(do_sample=False, attention_mask=mask, pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        t2 = time.perf_counter()
    assert out.shape[1] == ids.shape[1] + new
    tp, tg = t1 - t0, t2 - t1
    return {"prefill": sum(map(len, batch)) / tp, "decode": len(batch) * (new - 1) / max(tg - tp, 1e-9)}


def bench_vllm(llm, batch: List[List[int]], new: int) -> Dict[str, float]:
    from vllm import SamplingParams, TokensPrompt

    def gen(n: int) -> float:
        sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n for o in out)
        return time.perf_counter() - t0

    tp = gen(1)
    tg = gen(new)
    return {"prefill": sum(map(len, batch)) / tp, "decode": len(batch) * (new - 1) / max(tg - tp, 1e-9)}


def bench_llama_cpp(llm, batch: List[List[int]], new: int) -> Optional[Dict[str, float]]:
    """One sequence at a time (llama-cpp-python's API): batch 1 only."""
    if len(batch) != 1:
        return None
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(batch[0])  # the prompt's KV
    t1 = time.perf_counter()
    n = 0
    for _ in llm.generate(batch[0], top_k=1, temp=0.0, reset=False):  # greedy; the prompt is evaluated already
        n += 1
        if n == 1:
            t2 = time.perf_counter()
        if n == new:
            break
    t3 = time.perf_counter()
    return {"prefill": len(batch[0]) / (t1 - t0), "decode": (new - 1) / (t3 - t2)}


def machine() -> Dict[str, object]:
    """The machine as recorded with the results: the CPU with its ISA flags
    (:func:`interlace.engine_ext.machine.machine`), torch's threads, version and the CPU
    kernel level it dispatches to, and the GPU if one is used."""
    import torch

    extra: Dict[str, object] = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if torch.cuda.is_available():
        extra["gpu"] = torch.cuda.get_device_name()
    return machine_description(**extra)


#: Cases measured per variant: batch sizes, and "long" (batch 1, a ``--long``-token prompt).
LONG = "long"


def cases(batches: List[int], long: int) -> List[str]:
    return [str(b) for b in batches] + ([LONG] if long else [])


def case_prompts(case: str, vocab: int, lens: tuple, long: int, seed: int) -> List[List[int]]:
    if case == LONG:
        return prompts(vocab, 1, long, seed)
    return prompts(vocab, int(case), lens, seed)


def gguf_of(model: Optional[str]) -> Optional[Path]:
    """The GGUF file a variant that runs GGUF files (llama.cpp) loads: ``--model`` when it is one,
    the embedded model's otherwise; None for a Hugging Face directory."""
    if model is None:
        from interlace.engine_ext.embedded import embedded_gguf

        return embedded_gguf()
    return Path(model) if str(model).endswith(".gguf") else None


def load_variant(variant: str, model: Optional[str], kv_tokens: int):
    """(bench function, engine, closer) for one variant, loaded in this process."""
    import torch

    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.native.loader import resolve_model_dir

    kind, what = variant.split(maxsplit=1)
    model_dir = resolve_model_dir(model) if model else embedded_model_dir()
    if kind == "interlace":
        from interlace.engine_ext.native.engine import NativeEngine

        settings = engine_weights(what)
        path = gguf_of(model) if settings.get("weights") == "as-shipped" else (model or model_dir)
        eng = NativeEngine.load(path, **settings, kv_cache_tokens=kv_tokens)
        return bench_native, eng, eng.close
    if kind == "transformers":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, what)).eval()
        return bench_hf, hf, lambda: None
    if kind == "vllm":
        import os

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, -(-kv_tokens * 100_000 // 2**30))))
        from vllm import LLM

        llm = LLM(model=str(model_dir), dtype=what, enforce_eager=True, enable_prefix_caching=False,
                  max_model_len=min(8192, kv_tokens), seed=0)
        return bench_vllm, llm, lambda: None
    if kind == "llama.cpp":
        from llama_cpp import Llama

        gguf = gguf_of(model)
        llm = Llama(model_path=str(gguf), n_ctx=min(8192, kv_tokens), n_batch=512, verbose=False, seed=0,
                    n_threads=torch.get_num_threads())
        return bench_llama_cpp, llm, llm.close
    raise SystemExit(f"unknown variant {variant!r}")


#: ``interlace X/passive``: OpenMP's threads sleep at once at a barrier (``OMP_WAIT_POLICY=PASSIVE``);
#: ``interlace X/spin=N``: they spin N rounds first (``GOMP_SPINCOUNT``; libgomp's default is 300000, and
#: 1000 where it sees more threads than CPUs).  Read when OpenMP starts: set in the worker's environment.
WAIT_OPTIONS = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def worker_env(variant: str) -> Dict[str, str]:
    """The environment a variant's worker runs with: ours, plus its OpenMP wait policy options."""
    import os

    env = dict(os.environ)
    for opt in variant.split(maxsplit=1)[-1].split("/")[1:]:
        env.update(WAIT_OPTIONS.get(opt, {}))
        if opt.startswith("spin="):
            env["GOMP_SPINCOUNT"] = str(int(opt[len("spin="):]))
    return env


def engine_weights(what: str) -> Dict[str, object]:
    """``interlace X[/ATTENTION][/fixed][/passive|/spin=N]``: X is a dtype (float32, bfloat16: dense
    weights in it) or a weights setting (as-shipped, int8: quantized weights); decode attention as served
    (``auto``: the compiled kernel where it builds) unless ``/torch`` asks for the reference gather;
    threads as served (adapted to the free cores) unless ``/fixed`` keeps them at torch's count
    (``adapt_threads: false``); OpenMP's wait policy as served unless ``/passive`` or ``/spin=N``
    (:func:`worker_env`)."""
    what, *rest = what.split("/")
    out: Dict[str, object] = {"attention": "auto"}
    for opt in rest:
        if opt == "fixed":
            out["adapt_threads"] = False
        elif opt not in WAIT_OPTIONS and not opt.startswith("spin="):  # those are the worker's environment
            out["attention"] = opt
    if what in ("float32", "bfloat16", "float16"):
        return {**out, "dtype": what}
    return {**out, "weights": what}


#: A busy neighbour: a pure-Python loop holding one core (the issue's, and what a CPU-bound tool worker
#: or another service on the server does), until it is killed.
NEIGHBOUR = "while True:\n    pass\n"


def isa_class(mach: Dict[str, object]) -> str:
    """The machine's matmul ISA in one word, for the table: AMX, AVX-512 (+VNNI/BF16), AVX2 or other."""
    isa = set((mach.get("cpu") or mach).get("isa") or ())  # a machine() record, or its cpu part
    if {"amx_tile", "amx_bf16"} <= isa:
        return "AMX"
    if "avx512f" in isa:
        extra = [n for f, n in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16")) if f in isa]
        return "AVX-512" + (f" ({', '.join(extra)})" if extra else "")
    return "AVX2" if "avx2" in isa else "other"


def measure(variant: str, model: Optional[str], batches: List[int], lens: tuple, long: int,
            new: int, neighbours: int = 0) -> Dict[str, Optional[dict]]:
    """One variant ("interlace float32", "vllm bfloat16", "llama.cpp Q4_1", ...), every case, in this process;
    with ``neighbours`` busy processes running beside it from after the warm-up to the end."""
    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.native.loader import load_config, resolve_model_dir

    model_dir = resolve_model_dir(model) if model else embedded_model_dir()
    vocab = load_config(model_dir)[1].vocab_size
    kv_tokens = max(max(batches) * (lens[1] + new), long + new) + 1024
    fn, eng, close = load_variant(variant, model, kv_tokens)
    busy: List[subprocess.Popen] = []
    try:
        fn(eng, prompts(vocab, 1, 32, seed=1), 4)  # warm-up: kernels, allocator
        busy = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) for _ in range(neighbours)]
        if busy:
            time.sleep(0.5)  # running, and seen by the scheduler, before the first cell
        return {c: fn(eng, case_prompts(c, vocab, lens, long, seed=1000 + i), new)
                for i, c in enumerate(cases(batches, long))}
    finally:
        for p in busy:
            p.kill()
            p.wait()
        close()


def available_variants(model: Optional[str], dtypes: List[str], vllm_python: Optional[str]) -> List[str]:
    """The default variants: the engine in each dtype (and as shipped, for a GGUF), transformers in
    each dtype, llama.cpp on a GGUF, vLLM in each dtype -- those whose package is installed."""
    import importlib.util

    out = [f"interlace {d}" for d in dtypes]
    if gguf_of(model) is not None:
        out.append("interlace as-shipped")
    out += [f"transformers {d}" for d in dtypes]
    if gguf_of(model) is not None and importlib.util.find_spec("llama_cpp") is not None:
        out.append("llama.cpp as-shipped")
    if vllm_python or importlib.util.find_spec("vllm") is not None:
        out += [f"vllm {d}" for d in dtypes]
    return out


def run_worker(variant: str, args: argparse.Namespace, neighbours: int = 0) -> Dict[str, object]:
    python = args.vllm_python if variant.startswith("vllm") and args.vllm_python else sys.executable
    cmd = [python, "-m", "interlace.bench.engine", "--worker", variant, "--batches", *map(str, args.batches),
           "--prompt-lens", *map(str, args.prompt_lens), "--long", str(args.long), "--new", str(args.new),
           "--neighbour", str(neighbours)]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(variant))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"variant {variant!r} failed (exit {out.returncode})")
    return json.loads(line[len("RESULT "):])


def versions() -> Dict[str, str]:
    import importlib.metadata

    got = {}
    for dist in ("torch", "transformers", "vllm", "vllm-cpu", "llama_cpp_python"):
        try:
            got[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return got


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--device" or a.startswith("--device=") for a in argv):  # the GPU benchmark (engine_cuda.py)
        from interlace.bench import engine_cuda

        return engine_cuda.main(argv)
    ap = argparse.ArgumentParser(prog="interlace bench engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=[60, 200], metavar=("LO", "HI"),
                    help="each row's prompt length is drawn from [LO, HI]")
    ap.add_argument("--long", type=int, default=2048, help="a batch-1 case with this prompt length (0: none)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each cell reports its best round")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--variants", nargs="+", help='e.g. "interlace float32" "interlace as-shipped" '
                                                  '"transformers float32" "llama.cpp as-shipped" "vllm bfloat16" '
                                                  "(default: every installed peer)")
    ap.add_argument("--vllm-python", help="a Python with vLLM's CPU build, for the vllm variants")
    ap.add_argument("--plot", help="save a PNG plot of decode tokens/s here")
    ap.add_argument("--json", help="also write every round as JSON here")
    ap.add_argument("--neighbour", type=int, nargs="+", default=[0], metavar="N",
                    help="measure every cell with N busy processes (a pure-Python loop each) beside the engine; "
                         "several values: each, in one run (e.g. 0 1: quiet and beside one)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one variant, print JSON
    args = ap.parse_args(argv)
    lens = tuple(args.prompt_lens)
    if any(n < 0 for n in args.neighbour):
        ap.error("--neighbour: a count of busy processes, 0 or more")

    if args.worker:
        res = measure(args.worker, args.model, args.batches, lens, args.long, args.new, args.neighbour[0])
        print("RESULT " + json.dumps({"result": res, "machine": machine(), "versions": versions()}))
        return 0

    base = args.variants or available_variants(args.model, args.dtypes, args.vllm_python)
    # a row per variant and neighbour count: "interlace as-shipped" quiet, "interlace as-shipped +1" beside one
    rowname = {(v, n): (v if n == 0 else f"{v} +{n}") for n in args.neighbour for v in base}
    variants = list(rowname.values())
    keys = cases(args.batches, args.long)
    rounds: Dict[str, List[Dict[str, Optional[dict]]]] = {v: [] for v in variants}
    mach: Dict[str, object] = {}
    vers: Dict[str, str] = {}
    order = list(rowname)
    for r in range(args.repeat):
        for v, n in (order if r % 2 == 0 else order[::-1]):
            got = run_worker(v, args, n)
            mach = got["machine"] if v.startswith("interlace") or not mach else mach
            vers.update(got.get("versions") or {})
            rounds[rowname[v, n]].append(got["result"])
            print(f"round {r + 1}/{args.repeat} {rowname[v, n]}: " + ", ".join(
                f"{c} decode {x['decode']:.0f} tok/s" for c, x in rounds[rowname[v, n]][-1].items() if x),
                file=sys.stderr)
    rows = {v: {c: ({k: max(rd[c][k] for rd in rounds[v]) for k in ("prefill", "decode")}
                    if all(rd.get(c) for rd in rounds[v]) else None) for c in keys} for v in variants}

    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (embedded, GGUF Q4_1)"
    label = {c: (f"b={c}" if c != LONG else f"b=1, {args.long}-token prompt") for c in keys}
    print(f"\n{name} | prompts {lens[0]}-{lens[1]} tokens, {args.new} new | best of "
          f"{args.repeat}\nmachine: {describe_machine(mach)}\nISA class: {isa_class(mach)}\nversions: "
          + ", ".join(f"{k} {v}" for k, v in sorted(vers.items())) + "\n")
    if any(args.neighbour):
        print("+N: the same cells with N busy processes (a pure-Python loop each) beside the engine\n")
    print("decode tokens/s (prefill tokens/s)\n")
    print("| variant | " + " | ".join(label[c] for c in keys) + " |")
    print("|" + "---|" * (1 + len(keys)))
    for v, row in rows.items():
        print(f"| {v} | " + " | ".join(f"{row[c]['decode']:.1f} ({row[c]['prefill']:.0f})" if row[c] else "-"
                                       for c in keys) + " |")
    for n in args.neighbour:
        suffix = "" if n == 0 else f" +{n}"
        print_ratios({v[:len(v) - len(suffix)]: row for v, row in rows.items()
                      if (v.endswith(suffix) if suffix else "+" not in v)}, keys, label,
                     "" if n == 0 else f" with {n} busy neighbour(s)")
        if n:
            print_neighbour_ratios(rows, keys, label, n)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": mach, "isa_class": isa_class(mach), "versions": vers,
                                               "neighbours": args.neighbour, "rounds": rounds, "best": rows},
                                              indent=1))
    if args.plot:
        plot({v: {c: row[c] for c in keys if c != LONG} for v, row in rows.items()},
             [int(c) for c in keys if c != LONG], f"{name}: decode, best of {args.repeat}", args.plot)
        print(f"plot saved to {args.plot}")
    return 0


def print_ratios(rows: Dict[str, Dict[str, Optional[dict]]], keys: List[str], label: Dict[str, str],
                 when: str = "") -> None:
    """The engine's best variant against each peer's best, per case (decode tokens/s ratios)."""
    def best(prefix: str, c: str) -> Optional[tuple]:
        got = [(row[c]["decode"], v) for v, row in rows.items() if v.startswith(prefix) and row.get(c)]
        return max(got) if got else None

    print(f"\ndecode speed{when}, the engine's best variant over each peer's best (same run):")
    for c in keys:
        ours = best("interlace", c)
        if ours is None:
            continue
        parts = []
        for peer in ("transformers", "vllm", "llama.cpp"):
            theirs = best(peer, c)
            if theirs:
                parts.append(f"{ours[0] / theirs[0]:.2f}x {theirs[1]}")
        print(f"  {label[c]}: {ours[1]} " + ("; ".join(parts) if parts else "(no peer)"))


def print_neighbour_ratios(rows: Dict[str, Dict[str, Optional[dict]]], keys: List[str], label: Dict[str, str],
                           n: int) -> None:
    """Each variant's decode speed beside ``n`` busy neighbours over its own quiet speed (same run)."""
    print(f"\ndecode speed beside {n} busy neighbour(s) over the same variant's quiet speed (same run):")
    for v, row in rows.items():
        quiet = rows.get(v[:-len(f" +{n}")]) if v.endswith(f" +{n}") else None
        if quiet is None:
            continue
        print(f"  {v[:-len(f' +{n}')]}: " + "; ".join(
            f"{label[c]} {row[c]['decode'] / quiet[c]['decode']:.2f}x" for c in keys if row.get(c) and quiet.get(c)))


def plot(rows: Dict[str, Dict[str, Optional[dict]]], batches: List[int], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for v, r in rows.items():
        pts = [(b, r[str(b)]["decode"]) for b in batches if r.get(str(b))]
        if not pts:
            continue
        ax.plot([b for b, _ in pts], [d for _, d in pts], marker="o",
                linestyle="-" if v.startswith("interlace") else "--", label=v)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
