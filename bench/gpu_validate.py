"""The first GPU run, prepared: ``python -m interlace.bench.gpu_validate --phase NAME --out DIR``.

Why: this project gets GPUs rarely and briefly (about 15 minutes in all,
start-up included, on a bare machine with no package registry), so a GPU
run must work the first time, keep whatever it measured when a later part
fails, and say at once which target held.  ``scripts/gpu_first_run.sh``
runs each phase below in its own process under its own timeout (a crash, a
hang or a poisoned CUDA context in one phase cannot stop the next), each
phase writes ``DIR/<phase>.json`` as soon as it has something, and the
``summary`` phase prints one table of targets with PASS / FAIL last.

Phases, in the order the script runs them:

* ``preflight``: versions (python, torch, triton, numpy, transformers), the
  device, where ``interlace`` was imported from (the installed wheel, not
  the checkout's ``./interlace``), and that the kernels are compiled, not
  interpreted.
* ``ceilings``: a device-to-device copy (bytes read + written per second)
  and a large bf16 matmul: the two ceilings every later figure is read
  against.
* ``kernel_tests``: the kernel, CUDA-graph, swap, sampler and fused-op test
  files under pytest, compiled on the device; counts by outcome.
* ``correctness``: the kernels at the real head shapes of Qwen2.5-0.5B,
  Llama-3.2-1B and Llama-3-8B in bfloat16 against a float64 reference
  (decode with and without split-K, chunked prefill over a cached prefix,
  cascade, the KV store); and the native engine against transformers with
  the same random weights: float32 greedy tokens equal, bf16 first-step
  logits close.
* ``bench8b``: a reduced ``interlace bench engine --device cuda`` on the
  Llama-3-8B shape (decode against the bandwidth limit at batch 1, 32 and
  256, transformers at batch 32, cascade at 64 forks of a 4k prefix).
* ``anatomy``: one decode step taken apart on the Llama-3.2-1B shape:
  wall and GPU ms per step (CUDA graphs on and off), kernels per step and
  GPU time by kernel class, from two profiled runs whose difference is
  decode steps alone.
* ``summary``: reads the phases' files and prints the target table.

``--dry-run`` runs every phase on the CPU with tiny shapes (the kernels
under Triton's interpreter): the test suite runs it, so the script cannot
rot between GPU runs; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

PHASES = ["preflight", "ceilings", "kernel_tests", "correctness", "bench8b", "anatomy", "profile"]

#: the test files the kernel_tests phase runs (a missing one is reported, not fatal)
KERNEL_TESTS = ["tests/test_triton_kernels.py", "tests/test_cuda_graphs.py", "tests/test_swap.py",
                "tests/test_sampler.py", "tests/test_sampler_device.py", "tests/test_fused_kernels.py",
                "tests/test_cascade_engine.py"]

#: head shapes (query heads, KV heads, head dim) of the benchmark's models
HEAD_SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.2-1b": (32, 8, 64), "llama-3-8b": (32, 8, 128)}

#: the issue's targets on the GPU (issue 36)
TARGETS = {"b1_fraction": 0.70, "b256_fraction": 0.50, "vs_hf_b32": 5.0, "cascade_64": 2.0}


class Phase:
    """One phase's result file: ``record`` merges into it and rewrites it at once (atomically)."""

    def __init__(self, out: Path, name: str, dry_run: bool):
        self.path = out / f"{name}.json"
        self.data: Dict[str, Any] = {"phase": name, "dry_run": dry_run, "started": time.time(), "checks": []}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)

    def record(self, **kw: Any) -> None:
        self.data.update(kw)
        self.save()

    def check(self, name: str, ok: Optional[bool], value: Any, target: str = "") -> None:
        """A target: printed in the summary as PASS / FAIL, or ``ok=None``: measured, not judged (a
        speed target in the dry run, whose numbers mean nothing)."""
        self.data["checks"].append({"name": name, "ok": None if ok is None else bool(ok), "value": value,
                                    "target": target})
        self.save()
        print(f"[{self.data['phase']}] {verdict(ok)} {name}: {value} {target}".rstrip(), flush=True)

    def attempt(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one part; an exception becomes a failed check with its traceback, and the phase goes on."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - recorded as a FAIL; the next part still runs
            self.data.setdefault("errors", {})[name] = traceback.format_exc(limit=8)
            self.check(name, False, f"{type(e).__name__}: {str(e)[:300]}")
            return None


def verdict(ok: Optional[bool]) -> str:
    return "not judged" if ok is None else "PASS" if ok else "FAIL"


def _device(dry_run: bool):
    import torch

    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device (torch.cuda.is_available() is False); use --dry-run on a CPU")
    return torch.device("cuda", torch.cuda.current_device())


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------------------------------ phases
def preflight(ph: Phase, dry_run: bool) -> None:
    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for dist in ("torch", "triton", "numpy", "transformers", "pytest"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    ph.record(versions=versions, executable=sys.executable, platform=platform.platform(),
              pythonsafepath=os.environ.get("PYTHONSAFEPATH"))
    import torch

    import interlace

    where = Path(interlace.__file__).resolve().parent
    ph.record(interlace_from=str(where), commit=os.environ.get("INTERLACE_COMMIT"))
    ph.check("interlace imported from the installed wheel, not ./interlace",
             where != (Path.cwd() / "interlace").resolve(), str(where))
    dev = _device(dry_run)
    if dev.type == "cuda":
        from interlace.bench.engine_cuda import gpu_description

        p = torch.cuda.get_device_properties(dev)
        ph.record(device={**gpu_description(dev), "capability": f"{p.major}.{p.minor}"})
        ph.check("bfloat16 supported", torch.cuda.is_bf16_supported(), torch.cuda.get_device_name(dev))
    from interlace.engine_ext.native import kernels

    ph.check("triton installed", kernels.available(), versions["triton"])
    from interlace.engine_ext.native.kernels import paged_attention

    kind = type(paged_attention._store_kv_kernel).__name__
    interpreted = kernels.interpreted()
    ph.record(kernel_object=kind, interpreted=interpreted)
    if dry_run:
        ph.check("kernels interpreted on the CPU (dry run)", interpreted, kind)
    else:
        ph.check("kernels compiled, not interpreted", not interpreted and kind == "JITFunction", kind)
        # one launch: the compiler and the driver agree (a first compile error shows here, not in a bench)
        k = torch.randn(4, 2, 64, device=dev, dtype=torch.bfloat16)
        cache = torch.zeros(2, 2, 16, 64, device=dev, dtype=torch.bfloat16)
        cache2 = torch.zeros_like(cache)
        paged_attention.store_kv(k, k, cache, cache2, torch.tensor([0, 1, 17, -1], device=dev))
        _sync(dev)
        ok = torch.equal(cache[:, 0, 1], k[1]) and torch.equal(cache[:, 1, 1], k[2])
        ph.check("a compiled kernel ran (store_kv)", ok, "slots written")


def ceilings(ph: Phase, dry_run: bool) -> None:
    import torch

    from interlace.bench.engine_cuda import copy_bandwidth, matmul_tflops

    dev = _device(dry_run)
    bw = copy_bandwidth(dev, 2 ** 26 if dry_run else 2 ** 31)
    ph.record(copy_bandwidth_gb_s=bw / 1e9)
    n = 256 if dry_run else 8192
    tf = matmul_tflops(dev, n, torch.float32 if dry_run else torch.bfloat16)
    ph.record(matmul_n=n, matmul_tflops=tf)
    ph.check("ceilings measured", bw > 0 and tf > 0, f"copy {bw / 1e9:.0f} GB/s, matmul {tf:.1f} TFLOP/s")


def kernel_tests(ph: Phase, dry_run: bool, timeout_s: float) -> None:
    files = [f for f in KERNEL_TESTS if Path(f).exists()]
    ph.record(files=files, missing=[f for f in KERNEL_TESTS if f not in files])
    xml = Path(os.environ.get("TMPDIR", "/tmp")) / f"interlace-kernel-tests-{os.getpid()}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={xml}",
           *files]
    if dry_run:  # the suite runs these under the interpreter already: collect all, run a quick few
        cmd += ["-k", "staging or graph_sizes or step_args"]
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        tail, rc = (r.stdout + r.stderr)[-6000:], r.returncode
    except subprocess.TimeoutExpired as e:
        tail, rc = f"timed out after {timeout_s:.0f} s\n{(e.stdout or b'')[-4000:]!r}", None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: List[str] = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            kids = {c.tag for c in case}
            if "failure" in kids:
                counts["failed"] += 1
                failures.append(name)
            elif "error" in kids:
                counts["errors"] += 1
                failures.append(name)
            elif "skipped" in kids:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        xml.unlink()
    elif rc is None:  # timed out: no report; count pytest's progress characters so far (the first GPU run's case)
        counts.update(progress_counts(tail))
        failures.append(f"pytest timed out after {timeout_s:.0f} s (counts from its progress line)")
    ph.record(command=" ".join(cmd), rc=rc, seconds=time.time() - t0, counts=counts, failures=failures,
              output_tail=tail)
    ph.check("kernel tests pass compiled" if not dry_run else "kernel tests run (dry run: a few)",
             rc == 0 and counts["passed"] > 0 and not failures,
             f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
             f"{counts['skipped']} skipped")


def progress_counts(text: str) -> Dict[str, int]:
    """Outcomes from pytest's ``-q`` progress lines (``..sF.E``) in ``text``, which may be a bytes
    repr with escaped newlines: what a run killed before its report leaves."""
    lines = text.replace("\\n", "\n").splitlines()
    progress = "".join(ln.strip(" b'\"[]%0123456789") for ln in lines
                       if ln.strip() and set(ln.strip(" b'\"[]%0123456789")) <= set(".sFEx"))
    return {"passed": progress.count("."), "failed": progress.count("F"), "errors": progress.count("E"),
            "skipped": progress.count("s") + progress.count("x")}


# -------------------------------------------------------------------------------------- correctness
def _ref_attention(q, k, v, allowed, scale):
    """float64: q [R, H, D], k/v [R, L, Hkv, D] (each row its own keys), allowed [R, L] -> [R, H, D]."""
    import torch

    R, H, D = q.shape
    g = H // k.shape[2]
    k = k.double().repeat_interleave(g, dim=2)
    v = v.double().repeat_interleave(g, dim=2)
    s = torch.einsum("rhd,rlhd->rhl", q.double(), k) * scale
    s = s.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("rhl,rlhd->rhd", torch.softmax(s, dim=-1), v)


def _gather(cache, tables, lens, width):
    """[R, width, Hkv, D] of each row's first ``width`` positions (``tables`` [R, nb] long; past a row's
    length: whatever the blocks hold, masked by the caller)."""
    import torch

    bs = cache.shape[2]
    pos = torch.arange(width, device=cache.device)
    blocks = tables[:, pos // bs]                        # [R, width]
    return cache[:, blocks, pos % bs].permute(1, 2, 0, 3)  # [Hkv, R, width, D] -> [R, width, Hkv, D]


def _err(got, want) -> float:
    """Largest error relative to the reference's largest magnitude."""
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12))


def kernel_correctness(ph: Phase, dry_run: bool) -> None:
    import torch

    from interlace.engine_ext.native.kernels.paged_attention import paged_decode_attention, store_kv
    from interlace.engine_ext.native.kernels.prefill_attention import paged_prefill_attention

    dev = _device(dry_run)
    dtype = torch.float32 if dry_run else torch.bfloat16
    tol = 1e-4 if dry_run else 2e-2  # bf16: 8 bits of mantissa in the probabilities and the output
    bs = 16
    shapes = {"tiny": (4, 2, 16)} if dry_run else HEAD_SHAPES
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (H, Hkv, D) in shapes.items():
        B, max_len = (3, 40) if dry_run else (8, 2048)
        nb = -(-max_len // bs)
        blocks = B * nb + 4
        kc = torch.randn(Hkv, blocks, bs, D, device=dev, generator=g).to(dtype)
        vc = torch.randn(Hkv, blocks, bs, D, device=dev, generator=g).to(dtype)
        perm = torch.randperm(blocks, device=dev, generator=g)[:B * nb].view(B, nb)
        lens = torch.randint(1, max_len + 1, (B,), device=dev, generator=g)
        lens[0] = max_len
        q = torch.randn(B, H, D, device=dev, generator=g).to(dtype)
        scale = D ** -0.5
        width = int(lens.max())
        allowed = torch.arange(width, device=dev)[None, :] < lens[:, None]
        want = _ref_attention(q, _gather(kc, perm, lens, width), _gather(vc, perm, lens, width), allowed, scale)
        bt, sl = perm.to(torch.int32), lens.to(torch.int32)
        for splits in (None, 1, 8):
            def decode(splits=splits):
                got = paged_decode_attention(q, kc, vc, bt, sl, scale, num_splits=splits)
                e = _err(got, want)
                ph.check(f"decode {name} H={H}/{Hkv} D={D} split-K {splits or 'auto'}", e <= tol, f"{e:.2e}",
                         f"<= {tol:g} of max |ref|")
            ph.attempt(f"decode {name} split-K {splits or 'auto'}", decode)

        def prefill():  # 3 contexts: a cached prefix, then new rows (one from position 0)
            starts, news = ([0, 5, 17], [9, 4, 11]) if dry_run else ([0, 700, 1500], [300, 512, 129])
            rows = sum(news)
            qp = torch.randn(rows, H, D, device=dev, generator=g).to(dtype)
            cu = torch.tensor([0] + list(itertools_accumulate(news)), dtype=torch.int32, device=dev)
            st = torch.tensor(starts, dtype=torch.int32, device=dev)
            got = paged_prefill_attention(qp, kc, vc, bt[:3], cu, st, scale, max_new=max(news))
            worst = 0.0
            for i, (s0, n) in enumerate(zip(starts, news)):
                L = s0 + n
                k = _gather(kc, perm[i:i + 1], None, L).expand(n, L, Hkv, D)
                v = _gather(vc, perm[i:i + 1], None, L).expand(n, L, Hkv, D)
                al = torch.arange(L, device=dev)[None, :] <= (s0 + torch.arange(n, device=dev))[:, None]
                ref = _ref_attention(qp[int(cu[i]):int(cu[i]) + n], k, v, al, scale)
                worst = max(worst, _err(got[int(cu[i]):int(cu[i]) + n], ref))
            ph.check(f"prefill {name} H={H}/{Hkv} D={D}", worst <= tol, f"{worst:.2e}", f"<= {tol:g} of max |ref|")
        ph.attempt(f"prefill {name}", prefill)

        def store():
            T = 37
            k = torch.randn(T, Hkv, D, device=dev, generator=g).to(dtype)
            v = torch.randn(T, Hkv, D, device=dev, generator=g).to(dtype)
            kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
            slots = torch.randperm(blocks * bs, device=dev, generator=g)[:T]
            slots[3] = -1
            store_kv(k, v, kc2, vc2, slots)
            keep = slots >= 0
            s = slots[keep]
            ok = (torch.equal(kc2[:, s // bs, s % bs].transpose(0, 1), k[keep])
                  and torch.equal(vc2[:, s // bs, s % bs].transpose(0, 1), v[keep])
                  and int((kc2 != 0).any(-1).sum()) == int(keep.sum()) * Hkv)
            ph.check(f"store_kv {name}", ok, "exact, slot -1 untouched")
        ph.attempt(f"store_kv {name}", store)

        def cascade():
            from interlace.engine_ext.native.kernels.cascade import cascade_decode_attention, find_shared_prefixes

            forks, pre, suf = (3, 32, 7) if dry_run else (16, 1024, 64)
            pb, sb = pre // bs, -(-suf // bs)
            need = pb + forks * sb
            kc3 = torch.randn(Hkv, need, bs, D, device=dev, generator=g).to(dtype)
            vc3 = torch.randn(Hkv, need, bs, D, device=dev, generator=g).to(dtype)
            tables = [list(range(pb)) + list(range(pb + f * sb, pb + (f + 1) * sb)) for f in range(forks)]
            L = pre + suf
            qc = torch.randn(forks, H, D, device=dev, generator=g).to(dtype)
            shared = find_shared_prefixes(tables, [L] * forks, bs, device=dev)
            got = cascade_decode_attention(qc, kc3, vc3, scale=scale, **shared._asdict())
            t = torch.tensor(tables, device=dev)
            ref = _ref_attention(qc, _gather(kc3, t, None, L), _gather(vc3, t, None, L),
                                 torch.ones(forks, L, dtype=torch.bool, device=dev), scale)
            e = _err(got, ref)
            ph.check(f"cascade {name} {forks} forks", e <= tol, f"{e:.2e}", f"<= {tol:g} of max |ref|")
        ph.attempt(f"cascade {name}", cascade)


def itertools_accumulate(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def engine_vs_transformers(ph: Phase, dry_run: bool) -> None:
    """The native engine (Triton attention, graphs where CUDA) and transformers, same random weights."""
    import torch

    from interlace.bench.engine import prompts
    from interlace.bench.engine_cuda import SHAPES, hf_decode, hf_model
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.native.loader import model_from_tensors
    from interlace.engine_ext.protocol import SamplingParams

    dev = _device(dry_run)
    name = "tiny" if dry_run else "llama-3.2-1b"
    config = SHAPES[name]
    n_prompts, length, new = (2, 12, 6) if dry_run else (4, 64, 16)
    batch = prompts(config["vocab_size"], n_prompts, length, seed=7)
    ids = torch.tensor(batch, device=dev)
    for dtype in (torch.float32,) + (() if dry_run else (torch.bfloat16,)):
        hf = hf_model(config, dtype, dev)
        want = hf_decode(hf, ids, new, dev)["tokens"]
        with torch.no_grad():
            hf_logits = hf(input_ids=ids).logits[:, -1].double()
        model = model_from_tensors(config, {k: v for k, v in hf.state_dict().items()}, dtype, dev)
        del hf
        eng = NativeEngine(model, kv_cache_tokens=4096, max_seqs=8, host_pool_tokens=0, prefix_caching=False,
                           attention="triton", name=name)
        try:
            async def go():
                for i, p in enumerate(batch):
                    await eng.fill(i, p)

                async def gen(i):
                    toks = [ev.token_id async for ev in eng.generate(i, SamplingParams(max_tokens=new,
                                                                                      ignore_eos=True))]
                    await eng.free_context(i)
                    return toks
                return list(await asyncio.gather(*(gen(i) for i in range(len(batch)))))
            got = asyncio.run(go())
            logits = _engine_first_logits(eng, batch)
        finally:
            eng.close()
        same = sum(a == b for ga, wa in zip(got, want) for a, b in zip(ga, wa))
        total = sum(len(w) for w in want)
        err = _err(logits.to(dev), hf_logits)
        if dtype == torch.float32:
            ph.check(f"engine = transformers, {name} float32 greedy tokens", got == want, f"{same}/{total} equal")
            ph.check(f"engine ~ transformers, {name} float32 last-prompt logits", err <= 1e-3, f"{err:.2e}",
                     "<= 1e-3 of max |logit|")
        else:
            ph.check(f"engine ~ transformers, {name} bfloat16 last-prompt logits", err <= 5e-2, f"{err:.2e}",
                     "<= 5e-2 of max |logit|")
            ph.record(bf16_greedy_equal=f"{same}/{total}")  # random weights: near-ties flip in bf16
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _engine_first_logits(eng, batch):
    """The engine's logits for each prompt's last token: one step of the model runner's prefill, read
    through the engine's own forward (fill, then the context's kept logits)."""
    import torch

    async def go():
        out = []
        for i, p in enumerate(batch):
            await eng.fill(("logits", i), p)
            ctx = eng.contexts[("logits", i)]
            out.append(ctx.last_logits.double().cpu())
            await eng.free_context(("logits", i))
        return torch.stack(out)
    return asyncio.run(go())


def correctness(ph: Phase, dry_run: bool) -> None:
    ph.attempt("kernels against float64", lambda: kernel_correctness(ph, dry_run))
    ph.attempt("engine against transformers", lambda: engine_vs_transformers(ph, dry_run))


# ------------------------------------------------------------------------------------------- benchmark
def bench8b(ph: Phase, dry_run: bool, out: Path) -> None:
    from interlace.bench import engine_cuda

    raw = out / "bench8b_raw.json"
    argv = (["--device", "cpu", "--shapes", "tiny", "--batches", "1", "2", "--contexts", "16", "--new", "4",
             "--forks", "2", "--hf-batches", "2"] if dry_run else
            ["--device", "cuda", "--shapes", "llama-3-8b", "--batches", "1", "32", "256", "--contexts", "512",
             "--new", "32", "--repeat", "2", "--forks", "64", "--prefix", "4096", "--suffix", "128",
             "--hf-batches", "32"])
    argv += ["--json", str(raw)]
    ph.record(argv=argv)
    rc = engine_cuda.main(argv)
    res = json.loads(raw.read_text()) if raw.exists() else {}
    raw.unlink(missing_ok=True)
    ph.record(rc=rc, result=res)
    shape = next(iter(res.get("shapes", {}).values()), {})
    cells = {c["batch"]: c for c in shape.get("decode", [])}
    for err in ("decode_error", "hf_error", "cascade_error"):
        if shape.get(err):
            ph.check(err.replace("_", " "), False, shape[err])
    b_small, b_mid, b_big = (1, 2, 2) if dry_run else (1, 32, 256)

    def fraction_check(b: int, target: float) -> None:
        c = cells.get(b)
        if c is None or "skipped" in c or "fraction" not in c:
            ph.check(f"decode batch {b} of the bandwidth limit", False, (c or {}).get("skipped", "not measured"),
                     f">= {target:.0%}")
            return
        f = c["fraction"]
        ok = target <= f <= 1.0  # past the bound is a measurement error, never a pass
        ph.check(f"decode batch {b} of the bandwidth limit", None if dry_run else ok,
                 f"{f:.1%} ({c['decode_tok_s']:.1f} of {c['bound_tok_s']:.1f} tok/s)"
                 + (" PAST THE BOUND: measurement error" if f > 1.0 else ""), f">= {target:.0%}")
    for b, c in sorted(cells.items()):  # a figure past its own bound is a measurement error, never a result
        if "prefill_tflops" in c and res.get("matmul_tflops"):
            share = c["prefill_tflops"] / res["matmul_tflops"]
            ph.check(f"prefill batch {b} within the matmul ceiling", share <= 1.05,
                     f"{c['prefill_tflops']:.1f} TFLOP/s = {share:.0%} of the measured matmul"
                     + ("" if share <= 1.05 else ": PAST THE BOUND, a measurement error"), "<= 100%")
    fraction_check(b_small, TARGETS["b1_fraction"])
    fraction_check(b_big, TARGETS["b256_fraction"])
    c = cells.get(b_mid, {})
    if c.get("hf_tok_s"):
        r = c["decode_tok_s"] / c["hf_tok_s"]
        ph.check(f"batch {b_mid} against transformers", None if dry_run else r >= TARGETS["vs_hf_b32"],
                 f"{r:.2f}x ({c['decode_tok_s']:.0f} vs {c['hf_tok_s']:.0f} tok/s; transformers at "
                 f"{c.get('hf_fraction', 0):.0%} of the limit)", f">= {TARGETS['vs_hf_b32']:g}x")
    else:
        ph.check(f"batch {b_mid} against transformers", False, c.get("hf_skipped", "not measured"))
    casc = shape.get("cascade") or []
    if casc:
        top = max(casc, key=lambda x: x["forks"])
        ph.check(f"cascade at {top['forks']} forks of a {top['prefix']}-token prefix",
                 None if dry_run else top["speedup"] >= TARGETS["cascade_64"],
                 f"{top['speedup']:.2f}x ({top['plain_s'] * 1e3:.3f} vs {top['cascade_s'] * 1e3:.3f} ms, "
                 f"max diff {top['max_abs_diff']:.1e})", f">= {TARGETS['cascade_64']:g}x")
    else:
        ph.check("cascade", False, "not measured")


# --------------------------------------------------------------------------------------------- anatomy
KERNEL_CLASSES = [  # first match wins; names as the profiler reports CUDA kernels
    ("matmul", ("gemm", "cutlass", "cublas", "nvjet", "xmma", "wgmma", "splitk")),
    ("attention", ("_decode_kernel", "_prefill_kernel", "_merge", "_prefix_kernel", "cascade", "attention")),
    ("kv store", ("store_kv",)),
    ("norm / rope / silu (fused)", ("rms", "rope", "silu", "fused")),
    ("sampling", ("argmax", "exponential", "topk", "sort", "softmax", "distribution", "sample", "max_kernel")),
    ("copy", ("memcpy", "memset", "copy")),
    ("elementwise / other", ("",)),
]


def classify(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "elementwise / other"


def anatomy(ph: Phase, dry_run: bool) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from interlace.bench.engine import bench_native, prompts
    from interlace.bench.engine_cuda import SHAPES, native_model
    from interlace.engine_ext.native.engine import NativeEngine

    dev = _device(dry_run)
    name = "tiny" if dry_run else "llama-3.2-1b"
    config = SHAPES[name]
    batch_n, ctx_len, short, long = (2, 8, 3, 5) if dry_run else (32, 128, 8, 40)
    dtype = torch.float32 if dry_run else torch.bfloat16
    model = native_model(config, dtype, dev)
    ph.record(shape=name, batch=batch_n, context=ctx_len, decode_steps=long - short)
    batch = prompts(config["vocab_size"], batch_n, ctx_len, seed=3)
    for graphs in ((False,) if dry_run else (False, True)):
        tag = "graphs" if graphs else "eager"
        eng = NativeEngine(model, kv_cache_tokens=batch_n * (ctx_len + long + 32), max_seqs=batch_n,
                           host_pool_tokens=0, prefix_caching=False, attention="triton",
                           cuda_graphs=graphs if not dry_run else None, name=name)
        try:
            bench_native(eng, batch, short)  # warm-up: compiles, captures
            walls, gpu = {}, {}
            for n in (short, long):
                s0, f0 = eng.stats["steps"], eng.stats["forward_s"]
                t0 = time.perf_counter()
                bench_native(eng, batch, n)
                walls[n] = (time.perf_counter() - t0, eng.stats["steps"] - s0)
                gpu[n] = eng.stats["forward_s"] - f0
            d_steps = walls[long][1] - walls[short][1]
            wall_ms = (walls[long][0] - walls[short][0]) / d_steps * 1e3
            gpu_ms = (gpu[long] - gpu[short]) / d_steps * 1e3
            part = {"wall_ms_per_step": wall_ms, "forward_ms_per_step": gpu_ms, "steps": d_steps}
            if not graphs:  # kernels: two profiled runs, their difference is decode steps alone
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                counted = {}
                for n in (short, long):
                    # CUDA kernels are traced device-wide from this thread; a CPU op's callbacks fire on
                    # its own thread only, so the dry run profiles on the engine thread, which runs them
                    prof = profile(activities=acts)
                    on_engine = dev.type != "cuda"
                    (eng.call_sync if on_engine else _direct)(lambda fut: fut.set_result(prof.__enter__()))
                    try:
                        bench_native(eng, batch, n)
                    finally:
                        (eng.call_sync if on_engine else _direct)(
                            lambda fut: fut.set_result((_sync(dev), prof.__exit__(None, None, None))))
                    kinds: Dict[str, List[float]] = {}
                    for ev in prof.events():
                        on_gpu = str(getattr(ev, "device_type", "")).endswith("CUDA")
                        if dev.type == "cuda" and not on_gpu:
                            continue
                        if dev.type != "cuda" and not ev.name.startswith("aten::"):
                            continue
                        dur = (getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0) or 0) \
                            if on_gpu else ev.cpu_time
                        c = kinds.setdefault(classify(ev.name), [0, 0.0])
                        c[0] += 1
                        c[1] += dur
                    counted[n] = kinds
                by_class = {}
                for cls in {k for n in counted for k in counted[n]}:
                    a, b = counted[short].get(cls, [0, 0.0]), counted[long].get(cls, [0, 0.0])
                    by_class[cls] = {"per_step": (b[0] - a[0]) / d_steps, "us_per_step": (b[1] - a[1]) / d_steps}
                part["by_class"] = by_class
                part["kernels_per_step"] = sum(v["per_step"] for v in by_class.values())
                part["kernels_per_layer"] = part["kernels_per_step"] / model.cfg.num_layers
            ph.record(**{tag: part})
            ph.check(f"step anatomy ({tag})", True,
                     f"wall {wall_ms:.2f} ms/step, forward {gpu_ms:.2f} ms/step"
                     + (f", {part['kernels_per_step']:.0f} {'kernels' if dev.type == 'cuda' else 'aten ops'}"
                        f"/step ({part['kernels_per_layer']:.1f}/layer)" if "kernels_per_step" in part else ""))
        finally:
            eng.close()


def _direct(fn: Callable[[Any], None]) -> Any:
    """``fn(future)`` on this thread (the shape of ``NativeEngine.call_sync``)."""
    import concurrent.futures

    fut: concurrent.futures.Future = concurrent.futures.Future()
    fn(fut)
    return fut.result()


# --------------------------------------------------------------------------------------------- summary
def profile(ph: Phase, dry_run: bool) -> None:
    """The cost model (``Profile``) of the 8B shape measured on this device: ``interlace profile``'s
    measurement (:func:`measure_profile`) on the native engine with random bfloat16 weights (no
    weights can be downloaded there; timing does not depend on their values).  It is what the
    simulator runs at GPU speed (``interlace sim apps --profile FILE``), in place of the derived H100
    roofline: the profile is the ``profile`` key of ``profile.json``."""
    import torch

    from interlace.bench.engine_cuda import SHAPES, native_model
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.native.profiler import measure_profile

    dev = _device(dry_run)
    name = "tiny" if dry_run else "llama-3-8b"
    dtype = torch.float32 if dry_run else torch.bfloat16
    # 262,144 tokens of KV (32 GiB at 128 KiB a token), a 32k-token pinned host pool for the swap timing,
    # 2,048-token iterations (the measurement's largest point)
    kv, host, mbt = (512, 256, 64) if dry_run else (262144, 32768, 2048)
    model = native_model(SHAPES[name], dtype, dev)
    eng = NativeEngine(model, kv_cache_tokens=kv, max_seqs=256, host_pool_tokens=host, prefix_caching=False,
                       max_batched_tokens=mbt, attention="triton", name=name)
    try:
        prof = measure_profile(eng, quick=dry_run)
    finally:
        eng.close()
    ph.record(shape=name, profile=prof.to_dict())  # in the phase's file: at most 8 files come back
    pts = ", ".join(f"{n}: {s * 1e3:.2f} ms" for n, s in zip(prof.fwd_tokens, prof.fwd_seconds))
    ph.check("forward time measured", all(s > 0 for s in prof.fwd_seconds), pts)
    ph.check("saturation point S", None, f"{prof.saturation_tokens} tokens")
    ph.check("attention per context token", None, f"{prof.fwd_s_per_context_token * 1e9:.2f} ns")
    ph.check("swap per block", None, f"{prof.swap_s_per_block * 1e6:.1f} us")


def summary(out: Path, phases: List[str]) -> int:
    rows: List[Tuple[str, str, str, str, str]] = []
    for name in phases:
        p = out / f"{name}.json"
        if not p.exists():
            rows.append((name, "(phase wrote nothing)", "", "", "FAIL"))
            continue
        data = json.loads(p.read_text())
        if not data.get("finished"):
            rows.append((name, "phase did not finish", data.get("error", "timed out or crashed"), "", "FAIL"))
        for c in data.get("checks", []):
            rows.append((name, c["name"], str(c["value"]), c.get("target", ""), verdict(c["ok"])))
    head = ["| phase | check | value | target | result |", "|---|---|---|---|---|"]
    table = "\n".join(head + [f"| {' | '.join(r)} |" for r in rows])
    failed = sum(r[4] == "FAIL" for r in rows)
    passed = sum(r[4] == "PASS" for r in rows)
    text = f"{table}\n\n{passed} PASS, {failed} FAIL, {len(rows) - passed - failed} not judged\n"
    print(text)  # (into run.log: what comes back from a GPU machine is at most 8 files)
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interlace.bench.gpu_validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", required=True, choices=PHASES + ["summary"])
    ap.add_argument("--out", required=True, help="the folder each phase writes its JSON to")
    ap.add_argument("--dry-run", action="store_true", help="the CPU rehearsal: tiny shapes, the interpreter")
    ap.add_argument("--timeout", type=float, default=120.0, help="kernel_tests: pytest's own limit, seconds")
    ap.add_argument("--phases", nargs="+", default=PHASES, help="summary: the phases that ran")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase == "summary":
        return summary(out, args.phases)
    ph = Phase(out, args.phase, args.dry_run)
    try:
        if args.phase == "kernel_tests":
            kernel_tests(ph, args.dry_run, args.timeout)
        elif args.phase == "bench8b":
            bench8b(ph, args.dry_run, out)
        else:
            globals()[args.phase](ph, args.dry_run)
    except BaseException as e:  # recorded in the file, then re-raised: the script sees the exit status
        ph.record(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=12))
        raise
    ph.record(finished=True, seconds=time.time() - ph.data["started"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
