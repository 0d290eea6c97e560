"""The native engine on a GPU: ``interlace bench engine --device cuda``.

Random-weight models of three real shapes -- Qwen2.5-0.5B (q/k/v biases,
tied embeddings), Llama-3.2-1B (tied embeddings, llama3 rope scaling) and
Llama-3-8B -- built from their configs, nothing downloaded: weights drawn
N(0, 0.02), norms 1, in bfloat16 on the device.  For each shape:

* decode tokens/s of the native engine (``attention: triton``, sampling on
  the device, greedy, EOS ignored) at each batch size and context length:
  ``batch`` prompts of ``context`` random token ids filled, then ``--new``
  tokens generated; decode tokens/s = batch * (new - 1) / generation time,
  the best of ``--repeat`` rounds (2: the first compiles the kernels).
  Beside it the memory-bandwidth limit: a decode step reads every weight
  once (the embedding table only where it is also the head) and each row's
  KV, (weight bytes + batch * (context + new/2) * KV bytes per token) /
  the device-to-device copy bandwidth measured here (a large ``copy_``,
  bytes read + written per second), and the fraction of it reached.  A cell
  whose KV does not fit the device's memory beside the weights is skipped
  and the table says so.
* prefill TFLOP/s (2 * layer parameters per token + causal attention's
  2 * context * heads * head_dim * layers) from the fills above, against a
  large bfloat16 matmul measured here.
* cascade decode (shared-prefix attention, ``kernels/cascade.py``) against
  plain paged decode (``kernels/paged_attention.py``) for ``--forks`` rows
  sharing a ``--prefix``-token prefix, each with its own ``--suffix``
  tokens: the kernels alone, the shape's heads, on the same caches (their
  outputs are compared too).
* with ``--profile-dir``, each shape's profile for the simulator (what
  ``interlace profile`` writes: forward times by batch tokens, swap
  bandwidth, saturation point), measured on the benchmark's engine.
* Hugging Face transformers on the same GPU, the same shape (its own random
  weights) and the same batches and lengths (``--hf-batches``: only those):
  the prompt prefilled once, then greedy steps of one token on its KV cache,
  the decode steps timed alone and best of ``--repeat``, with its own
  fraction of the bandwidth limit; a cell that runs out of memory says so.

The JSON (``--json``) is rewritten after every cell, so a failure or a
timeout later keeps what was measured; a part that raises is recorded
(``decode_error``, ``hf_error``, ``cascade_error``) and the next part runs.

    interlace bench engine --device cuda [--shapes qwen2.5-0.5b llama-3.2-1b llama-3-8b]
        [--batches 1 8 32 128 256] [--contexts 512 2048] [--new 32] [--no-hf]
        [--json out.json] [--plot out.png] [--profile-dir DIR]

``--device cpu --shapes tiny`` runs every part on a tiny model on the CPU
(the torch attention in the engine, the Triton kernels under the
interpreter for the cascade part): the tests' smoke run; its numbers mean
nothing.  Without a CUDA device ``--device cuda`` exits with status 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

#: Hugging Face configs of the shapes (the published models' config.json values that set the work)
SHAPES: Dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
                         tie_word_embeddings=True, use_sliding_window=False),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                         tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                       tie_word_embeddings=False),
    # the smoke run's (--device cpu): every code path in seconds
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=4096, tie_word_embeddings=False),
}
GPU_SHAPES = ["qwen2.5-0.5b", "llama-3.2-1b", "llama-3-8b"]
BLOCK_SIZE = 16


class NoDevice(RuntimeError):
    """The device asked for is not there (or cannot run the bench)."""


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, iters: int) -> float:
    """Seconds per call of ``fn`` (after one warm-up call)."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Bytes per second a device-to-device ``copy_`` moves (read + written)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), dev, 10)
    del a, b
    return 2 * nbytes / t


def matmul_tflops(dev: torch.device, n: int, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    t = timed(lambda: a @ b, dev, 10)
    return 2 * n ** 3 / t / 1e12


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 0.02) (biases too), norm weights 1: what an initialised model looks like."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # (a tied head is listed once)
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def native_model(config: dict, dtype: torch.dtype, dev: torch.device):
    from interlace.engine_ext.native.models.llama import LlamaForCausalLM, ModelConfig, rope_inv_freq

    cfg = ModelConfig.from_hf(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=dev).to(dtype)
    model.inv_freq = rope_inv_freq(cfg).to(dev)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    randomize(model, 0)
    return model.eval()


def hf_model(config: dict, dtype: torch.dtype, dev: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(**config)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    randomize(model, 0)
    return model.eval()


def weight_bytes_read(model) -> int:
    """Bytes of weights a decode step reads: all of them once, but of an embedding table that is not
    also the head only the batch's rows (counted as nothing)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # (tied: counted once)
    if not model.cfg.tie_word_embeddings:
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    return total


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()


def prefill_flops_per_token(model, context: int) -> float:
    """2 flops per layer weight (the head runs on one row per prompt: left out) plus causal attention,
    QK and PV over on average context/2 keys: 2 * 2 * (context / 2) * heads * head_dim per layer."""
    cfg = model.cfg
    layer_params = sum(p.numel() for p in model.layers.parameters())
    return 2 * layer_params + 2 * context * cfg.num_heads * cfg.head_dim * cfg.num_layers


def fits(dev: torch.device, need: int, headroom: int, budget: Optional[float]) -> bool:
    """Whether ``need`` bytes of KV fit: in the device's free memory less ``headroom`` (on a GPU),
    and within ``budget`` bytes (``--kv-budget-mib``) where one is set."""
    if budget is not None and need > budget:
        return False
    if dev.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(dev)
    return need + headroom <= free


def bench_decode(args, name: str, config: dict, dev: torch.device, dtype: torch.dtype,
                 cells: Optional[List[dict]] = None, save=lambda: None) -> List[dict]:
    """The native engine's cells (decode, the bound, prefill) for one shape."""
    from interlace.bench.engine import bench_native, prompts
    from interlace.engine_ext.native.engine import NativeEngine

    model = native_model(config, dtype, dev)
    cfg = model.cfg
    kvt = kv_bytes_per_token(cfg, dtype)
    wbytes = weight_bytes_read(model)
    if cells is None:
        cells = []
    cells += [dict(batch=b, context=c) for c in args.contexts for b in args.batches]
    for cell in cells:  # each row's blocks, and one more (slack: no cell may need to preempt)
        cell["kv_tokens"] = cell["batch"] * (-(-(cell["context"] + args.new) // BLOCK_SIZE) + 1) * BLOCK_SIZE
    # headroom: activations of a prefill chunk and the logits of a batch (float32, a few copies), 2 GiB more
    headroom = 2 ** 31 + 4 * max(args.batches) * cfg.vocab_size * 4 + 64 * args.max_batched_tokens * cfg.hidden_size
    budget = None if args.kv_budget_mib is None else args.kv_budget_mib * 2 ** 20
    fitting = [c for c in cells if fits(dev, c["kv_tokens"] * kvt, headroom, budget)]
    for c in cells:
        if c not in fitting:
            c["skipped"] = f"does not fit: {c['kv_tokens'] * kvt / 2 ** 30:.3g} GiB of KV beside the weights"
    if not fitting:
        return cells
    engine = NativeEngine(model, block_size=BLOCK_SIZE, kv_cache_tokens=max(c["kv_tokens"] for c in fitting),
                          max_seqs=max(c["batch"] for c in fitting), max_batched_tokens=args.max_batched_tokens,
                          host_pool_tokens=0, prefix_caching=False, name=name,
                          attention="triton" if dev.type == "cuda" else "torch")
    try:
        for ctx in args.contexts:  # warm-up: the kernels' compilations, per context length
            bench_native(engine, prompts(cfg.vocab_size, 2, ctx, seed=1), 4)
        for c in fitting:
            best = None
            for r in range(args.repeat):
                got = bench_native(engine, prompts(cfg.vocab_size, c["batch"], c["context"], seed=100 + r), args.new)
                best = got if best is None else {k: max(best[k], got[k]) for k in got}
            kv_read = c["batch"] * (c["context"] + args.new / 2) * kvt
            bound = c["batch"] * args.bandwidth / (wbytes + kv_read)
            c.update(decode_tok_s=best["decode"], bound_tok_s=bound, fraction=best["decode"] / bound,
                     weight_bytes=wbytes, kv_bytes_read=kv_read, prefill_tok_s=best["prefill"],
                     prefill_tflops=best["prefill"] * prefill_flops_per_token(model, c["context"]) / 1e12)
            print(f"{name} b={c['batch']} ctx={c['context']}: decode {best['decode']:.1f} tok/s "
                  f"({c['fraction']:.0%} of the bandwidth limit)", file=sys.stderr)
            save()
    finally:
        engine.close()
    try:
        if args.profile_dir:
            write_profile(args, name, model, dev)
    finally:
        del engine, model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return cells


def write_profile(args, name: str, model, dev: torch.device) -> None:
    """The simulator's cost model of this shape on this device (what ``interlace profile`` writes), measured
    on an engine of the profiler's own default cache size (it times prefill chunks up to
    ``--max-batched-tokens`` and decode batches, which the benchmark's cache is not sized for)."""
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.native.profiler import measure_profile

    out = Path(args.profile_dir) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with NativeEngine(model, block_size=BLOCK_SIZE, kv_cache_tokens=16384, max_batched_tokens=args.max_batched_tokens,
                      name=name, attention="triton" if dev.type == "cuda" else "torch") as engine:
        measure_profile(engine, quick=dev.type != "cuda").save(out)
    print(f"{name}: profile for interlace sim written to {out}", file=sys.stderr)


def hf_decode(model, ids: torch.Tensor, new: int, dev: torch.device) -> Dict[str, float]:
    """transformers' own forward, timed as the engine is: the prompt prefilled once (timed alone), then
    ``new - 1`` greedy steps of one token each on its KV cache (``past_key_values``), timed together.
    (``generate`` timed twice and subtracted, as before issue 36, counted two prefills' noise into
    decode.)  Returns prefill tokens/s, decode tokens/s and the tokens, for a check."""
    with torch.no_grad():
        sync(dev)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        t1 = time.perf_counter()
        toks = [tok]
        for _ in range(new - 1):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(tok)
        sync(dev)
        t2 = time.perf_counter()
    b = ids.shape[0]
    return {"prefill": b * ids.shape[1] / (t1 - t0), "decode": b * (new - 1) / (t2 - t1),
            "tokens": torch.cat(toks, 1).tolist()}


def bench_hf(args, config: dict, dev: torch.device, dtype: torch.dtype, cells: List[dict],
             save=lambda: None) -> None:
    """transformers on the same cells (``--hf-batches`` only, if set): ``hf_tok_s`` and its own
    ``hf_fraction`` of the bandwidth limit, or ``hf_skipped``; best of ``--repeat`` after a warm-up."""
    from interlace.bench.engine import prompts

    model = hf_model(config, dtype, dev)
    try:
        for c in cells:
            if "skipped" in c:
                c["hf_skipped"] = c["skipped"]
                continue
            if args.hf_batches and c["batch"] not in args.hf_batches:
                continue
            ids = torch.tensor(prompts(config["vocab_size"], c["batch"], c["context"], seed=100), device=dev)
            try:
                hf_decode(model, ids[:, :16], 2, dev)  # warm-up
                best = max(hf_decode(model, ids, args.new, dev)["decode"] for _ in range(args.repeat))
                c["hf_tok_s"] = best
                if "bound_tok_s" in c:
                    c["hf_fraction"] = best / c["bound_tok_s"]
            except torch.cuda.OutOfMemoryError:
                c["hf_skipped"] = "out of memory"
                gc.collect()
                torch.cuda.empty_cache()
            save()
    finally:
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def bench_cascade(args, config: dict, dev: torch.device, dtype: torch.dtype) -> List[dict]:
    """Plain paged decode against cascade decode for ``forks`` rows sharing a prefix: seconds per call,
    the speed-up, and the largest difference between the two outputs.  Each timed call is the launch
    alone, no host sync in it: the cascade plan (``plan_cascade``) is built before, as the engine builds
    it once per step, and plain decode gets its split-K (chosen from the host-known lengths)."""
    from interlace.engine_ext.native.kernels.cascade import cascade_decode, plan_cascade
    from interlace.engine_ext.native.kernels.paged_attention import paged_decode_attention, pick_num_splits

    heads, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    pre_blocks = -(-args.prefix // BLOCK_SIZE)
    suf_blocks = -(-args.suffix // BLOCK_SIZE)
    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    for forks in args.forks:
        n_blocks = pre_blocks + forks * suf_blocks
        kc = torch.randn(hkv, n_blocks, BLOCK_SIZE, d, device=dev, generator=g).to(dtype)
        vc = torch.randn(hkv, n_blocks, BLOCK_SIZE, d, device=dev, generator=g).to(dtype)
        q = torch.randn(forks, heads, d, device=dev, generator=g).to(dtype)
        tables = [list(range(pre_blocks)) + list(range(pre_blocks + f * suf_blocks, pre_blocks + (f + 1) * suf_blocks))
                  for f in range(forks)]
        lens = [pre_blocks * BLOCK_SIZE + args.suffix] * forks
        bt = torch.tensor(tables, dtype=torch.int32, device=dev)
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        splits = pick_num_splits(max(lens), forks * hkv, dev)
        plan = plan_cascade(tables, lens, BLOCK_SIZE, device=dev)
        scale = 1 / math.sqrt(d)
        plain = paged_decode_attention(q, kc, vc, bt, sl, scale, num_splits=splits)
        casc = cascade_decode(q, kc, vc, plan, scale)
        t_plain = timed(lambda: paged_decode_attention(q, kc, vc, bt, sl, scale, num_splits=splits), dev,
                        args.kernel_iters)
        t_casc = timed(lambda: cascade_decode(q, kc, vc, plan, scale), dev, args.kernel_iters)
        out.append(dict(forks=forks, prefix=pre_blocks * BLOCK_SIZE, suffix=args.suffix, plain_s=t_plain,
                        cascade_s=t_casc, speedup=t_plain / t_casc,
                        max_abs_diff=float((plain.float() - casc.float()).abs().max())))
        del kc, vc
    return out


def gpu_description(dev: torch.device) -> Dict[str, object]:
    if dev.type != "cuda":
        return {}
    p = torch.cuda.get_device_properties(dev)
    got: Dict[str, object] = {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2 ** 30, 1),
                              "sms": p.multi_processor_count, "cuda_runtime": torch.version.cuda}
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                            str(dev.index or 0)], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            got["driver"] = r.stdout.strip()
    return got


def versions() -> Dict[str, str]:
    got = {}
    for dist in ("torch", "triton", "transformers"):
        try:
            got[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return got


def fmt(x: Optional[float], spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def report(res: dict) -> str:
    m = res["machine"]
    lines = [f"device: {m.get('gpu', 'cpu')}" + (f", driver {m['driver']}" if "driver" in m else "")
             + (f", CUDA {m['cuda_runtime']}" if m.get("cuda_runtime") else ""),
             "versions: " + ", ".join(f"{k} {v}" for k, v in sorted(res["versions"].items())),
             f"copy bandwidth {res['copy_bandwidth_gb_s']:.0f} GB/s (read + written); "
             f"{res['dtype']} matmul {res['matmul_n']}^3: {res['matmul_tflops']:.1f} TFLOP/s; "
             f"{res['new']} new tokens per row, best of {res['repeat']}", ""]
    for name, s in res["shapes"].items():
        lines += [f"### {name} ({s['params'] / 1e6:,.1f} M parameters, {s['kv_bytes_per_token'] / 1024:g} KiB of KV "
                  "per token)", "",
                  "| batch | context | interlace decode tok/s | bandwidth limit tok/s | fraction "
                  "| transformers tok/s (fraction) | interlace / transformers | prefill TFLOP/s (of matmul) |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in s["decode"]:
            if "skipped" in c:
                lines.append(f"| {c['batch']} | {c['context']} | {c['skipped']} | | | | | |")
                continue
            hf = c.get("hf_tok_s")
            lines.append(
                f"| {c['batch']} | {c['context']} | {c['decode_tok_s']:.1f} | {c['bound_tok_s']:.1f} "
                f"| {c['fraction']:.0%} | {fmt(hf) + ' (' + format(c['hf_fraction'], '.0%') + ')' if hf else c.get('hf_skipped', '-')} "
                f"| {fmt(c['decode_tok_s'] / hf, '.2f') + 'x' if hf else '-'} "
                f"| {c['prefill_tflops']:.2f} ({c['prefill_tflops'] / res['matmul_tflops']:.0%}) |")
        for part in ("decode_error", "hf_error", "cascade_error"):
            if s.get(part):
                lines += ["", f"{part.replace('_', ' ')}: {s[part]}"]
        if s.get("cascade"):
            lines += ["", "| forks | prefix | suffix | paged decode ms | cascade ms | speed-up | max diff |",
                      "|---|---|---|---|---|---|---|"]
            for c in s["cascade"]:
                lines.append(f"| {c['forks']} | {c['prefix']} | {c['suffix']} | {c['plain_s'] * 1e3:.3f} "
                             f"| {c['cascade_s'] * 1e3:.3f} | {c['speedup']:.2f}x | {c['max_abs_diff']:.1e} |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(res["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, name in zip(axes[0], shapes):
        cells = res["shapes"][name]["decode"]
        for ctx in sorted({c["context"] for c in cells}):
            row = [c for c in cells if c["context"] == ctx and "decode_tok_s" in c]
            if not row:
                continue
            b = [c["batch"] for c in row]
            line, = ax.plot(b, [c["decode_tok_s"] for c in row], marker="o", label=f"interlace, {ctx}")
            ax.plot(b, [c["bound_tok_s"] for c in row], linestyle=":", color=line.get_color(),
                    label=f"bandwidth limit, {ctx}")
            hf = [(c["batch"], c["hf_tok_s"]) for c in row if c.get("hf_tok_s")]
            if hf:
                ax.plot(*zip(*hf), marker="x", linestyle="--", color=line.get_color(), label=f"transformers, {ctx}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{name} on {res['machine'].get('gpu', 'cpu')}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="interlace bench engine --device", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", required=True, choices=["cuda", "cpu"],
                    help="cuda: the benchmark; cpu: a smoke run of its code (with --shapes tiny)")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--new", type=int)
    ap.add_argument("--repeat", type=int, help="rounds per cell, the best reported (default 2 on a GPU: the "
                                               "first compiles the Triton kernels for the cell's shapes)")
    ap.add_argument("--max-batched-tokens", type=int)
    ap.add_argument("--forks", type=int, nargs="+")
    ap.add_argument("--prefix", type=int, help="the cascade part's shared prefix, tokens")
    ap.add_argument("--suffix", type=int, help="the cascade part's tokens per fork past the prefix")
    ap.add_argument("--kernel-iters", type=int)
    ap.add_argument("--kv-budget-mib", type=float, help="at most this much KV cache (default: what fits)")
    ap.add_argument("--no-hf", action="store_true", help="leave out the transformers peer")
    ap.add_argument("--hf-batches", type=int, nargs="+", help="run the transformers peer at these batch sizes "
                                                              "only (default: every cell)")
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--plot", help="save a PNG plot of decode tokens/s here")
    ap.add_argument("--profile-dir", help="also write each shape's profile for the simulator here "
                                          "(interlace profile's JSON, measured on the benchmark's engine: "
                                          "interlace sim --profile DIR/SHAPE.json)")
    args = ap.parse_args(argv)
    try:
        return run(args)
    except NoDevice as e:
        print(f"interlace bench engine: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise NoDevice("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if gpu and importlib.util.find_spec("triton") is None:
        raise NoDevice("--device cuda needs the triton package (pip install triton)")
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    defaults = (dict(shapes=GPU_SHAPES, batches=[1, 8, 32, 128, 256], contexts=[512, 2048], new=32,
                     repeat=2, max_batched_tokens=8192, forks=[16, 64], prefix=4096, suffix=128,
                     kernel_iters=50) if gpu else
                dict(shapes=["tiny"], batches=[1, 2], contexts=[16, 32], new=4, repeat=1, max_batched_tokens=256,
                     forks=[2, 4], prefix=64, suffix=16, kernel_iters=1))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.new < 2:
        raise SystemExit("--new must be at least 2 (decode speed is timed past the first token)")
    args.bandwidth = copy_bandwidth(dev, 2 ** 30 if gpu else 2 ** 26)
    n = 8192 if gpu else 256
    tflops = matmul_tflops(dev, n, dtype)
    from interlace.bench.engine import machine

    res: dict = {"machine": {**machine(), **gpu_description(dev)}, "versions": versions(), "device": args.device,
                 "dtype": str(dtype).replace("torch.", ""), "copy_bandwidth_gb_s": args.bandwidth / 1e9,
                 "matmul_n": n, "matmul_tflops": tflops, "new": args.new, "repeat": args.repeat, "shapes": {}}
    def save() -> None:  # after every cell: an exception or a timeout later loses nothing measured
        if args.json:
            tmp = Path(args.json).with_suffix(".tmp")
            tmp.write_text(json.dumps(res, indent=1))
            tmp.replace(args.json)

    save()
    for name in args.shapes:
        config = SHAPES[name]
        from interlace.engine_ext.native.models.llama import LlamaForCausalLM, ModelConfig

        cfg = ModelConfig.from_hf(config)
        with torch.device("meta"):
            params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
        shape = res["shapes"][name] = {"config": config, "params": params,
                                       "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype), "decode": [],
                                       "cascade": []}
        print(f"{name}: native engine", file=sys.stderr)
        try:
            bench_decode(args, name, config, dev, dtype, shape["decode"], save)
        except Exception as e:  # noqa: BLE001 - recorded, and the shape's other parts still run
            shape["decode_error"] = f"{type(e).__name__}: {e}"
            print(f"{name}: native engine failed: {shape['decode_error']}", file=sys.stderr)
        save()
        if not args.no_hf:
            print(f"{name}: transformers", file=sys.stderr)
            try:
                bench_hf(args, config, dev, dtype, shape["decode"], save)
            except Exception as e:  # noqa: BLE001
                shape["hf_error"] = f"{type(e).__name__}: {e}"
                print(f"{name}: transformers failed: {shape['hf_error']}", file=sys.stderr)
            save()
        print(f"{name}: cascade kernels", file=sys.stderr)
        try:
            shape["cascade"] = bench_cascade(args, config, dev, dtype)
        except Exception as e:  # noqa: BLE001
            shape["cascade_error"] = f"{type(e).__name__}: {e}"
            print(f"{name}: cascade failed: {shape['cascade_error']}", file=sys.stderr)
        save()
    print(report(res))
    save()
    if args.plot:
        plot(res, args.plot)
        print(f"plot saved to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
