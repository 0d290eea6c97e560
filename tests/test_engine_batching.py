"""Continuous batching gives the same tokens as running one request at a
time, with and without preemption (fp32, greedy)."""

import asyncio

import pytest
import torch

from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.protocol import SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 300 + 1 for j in range(5 + 3 * i)] for i in range(8)]


async def one(eng, cid, prompt, n):
    await eng.fill(cid, prompt)
    evs = [e async for e in eng.generate(cid, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True))]
    await eng.free_context(cid)
    return [e.token_id for e in evs], [e.logprob for e in evs]


def sequential(eng, prompts, n):
    async def go():
        return [await one(eng, f"s{i}", p, n) for i, p in enumerate(prompts)]
    return asyncio.run(go())


def concurrent(eng, prompts, n):
    async def go():
        return await asyncio.gather(*(one(eng, f"c{i}", p, n) for i, p in enumerate(prompts)))
    return asyncio.run(go())


def assert_same(a, b):
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert all(abs(x - y) < 1e-4 for x, y in zip(la, lb))


def _batched(eng, prompts, n):
    """The concurrent run really shared steps (and reused no cached prefix:
    each run gets a fresh engine, so nothing is computed once for both)."""
    st = asyncio.run(eng.check_invariants())
    assert st["prefix_hit_blocks"] == 0
    assert eng.stats["steps"] < len(prompts) * n  # fewer steps than tokens: contexts were batched


def test_concurrent_equals_sequential(tiny_dirs):
    kw = dict(block_size=4, kv_cache_tokens=1024, max_batched_tokens=24)
    with NativeEngine.load(tiny_dirs["qwen2"][0], **kw) as eng:
        seq = sequential(eng, PROMPTS, 16)
    with NativeEngine.load(tiny_dirs["qwen2"][0], **kw) as eng:
        con = concurrent(eng, PROMPTS, 16)
        _batched(eng, PROMPTS, 16)
    assert_same(seq, con)


def test_preemption_gives_same_tokens(tiny_dirs):
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=1024) as big:
        ref = sequential(big, PROMPTS, 20)
    # 8 requests of up to 46 tokens in 24 blocks of 4: they cannot all fit
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, num_blocks=24, max_batched_tokens=32) as small:
        got = concurrent(small, PROMPTS, 20)
        stats = asyncio.run(small.check_invariants())
    assert stats["preemptions"] > 0
    assert stats["used_blocks"] == 0
    assert_same(ref, got)


def test_concurrent_equals_sequential_smollm2(smol_dir):
    prompts = None
    with NativeEngine.load(smol_dir, kv_cache_tokens=1024) as eng:
        tok = eng.tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
                   ("Name a fruit.", "What is 3 + 4?", "Say hello in French.", "Describe the sky in five words.")]
        seq = sequential(eng, prompts, 12)
    with NativeEngine.load(smol_dir, kv_cache_tokens=1024) as eng:
        con = concurrent(eng, prompts, 12)
        _batched(eng, prompts, 12)
    assert_same(seq, con)


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_dirs):
    with NativeEngine.load(tiny_dirs["qwen3"][0], block_size=4, kv_cache_tokens=512) as eng:
        sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)

        async def sample(cid, others):
            await eng.fill(cid, PROMPTS[2])
            gens = [eng.fill(f"{cid}-o{i}", p) for i, p in enumerate(PROMPTS[:others])]
            await asyncio.gather(*gens)

            async def drain(c):
                return [e.token_id async for e in eng.generate(c, SamplingParams(max_tokens=10, ignore_eos=True))]
            res = await asyncio.gather(
                *([_tokens(eng, cid, sp)] + [drain(f"{cid}-o{i}") for i in range(others)]))
            for c in [cid] + [f"{cid}-o{i}" for i in range(others)]:
                await eng.free_context(c)
            return res[0]

        a = asyncio.run(sample("a", 0))
        b = asyncio.run(sample("b", 5))
        assert a == b


def _known_logits(generated, logits):
    """Tokens 10..19 with logits 0, -1, ..., -9; everything else impossible:
    the distribution each setting must sample from is known exactly."""
    out = logits.new_full(logits.shape, float("-inf"))
    out[10:20] = -torch.arange(10, dtype=logits.dtype)
    return out


def _expected(temperature, top_k=0, top_p=1.0):
    x = -torch.arange(10, dtype=torch.float64) / temperature
    if top_k:
        x[top_k:] = float("-inf")
    p = torch.softmax(x, 0)
    if top_p < 1.0:
        keep = (p.cumsum(0) - p) <= top_p
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum()
    return p


def test_sampling_follows_temperature_top_k_and_top_p(tiny_dirs):
    """Each setting's token frequencies match its exact distribution (so a
    sampler that ignored temperature, top-k or top-p would fail), entropy
    grows with temperature, top-k=1 and a tiny top-p are greedy, and
    different seeds give different samples."""
    n = 300
    settings = {"t0.5": dict(temperature=0.5), "t1": dict(temperature=1.0), "t4": dict(temperature=4.0),
                "k3": dict(temperature=4.0, top_k=3), "p0.5": dict(temperature=1.0, top_p=0.5),
                "k1": dict(temperature=1.0, top_k=1), "greedy": dict(temperature=0.0),
                "t1-seed2": dict(temperature=1.0)}
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=16, kv_cache_tokens=4096, max_model_len=512) as eng:
        async def draw(name, kw):
            await eng.fill(name, [1, 2, 3])
            sp = SamplingParams(max_tokens=n, ignore_eos=True, seed=2 if name.endswith("seed2") else 1,
                                logits_processors=[_known_logits], **kw)
            toks = await _tokens(eng, name, sp)
            await eng.free_context(name)
            return toks

        async def go():
            return dict(zip(settings, await asyncio.gather(*(draw(k, v) for k, v in settings.items()))))

        got = asyncio.run(go())

    def freqs(toks):
        assert all(10 <= t < 20 for t in toks)
        return torch.bincount(torch.tensor(toks) - 10, minlength=10).double() / len(toks)

    def entropy(f):
        f = f[f > 0]
        return float(-(f * f.log()).sum())

    for name, kw in settings.items():
        if name == "greedy" or "seed" in name:
            continue
        exp = _expected(kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))
        f = freqs(got[name])
        bound = 4.5 * (exp * (1 - exp) / n).sqrt() + 1.0 / n
        assert ((f - exp).abs() <= bound).all(), (name, f.tolist(), exp.tolist())
    h = {k: entropy(freqs(v)) for k, v in got.items()}
    assert h["greedy"] == h["k1"] == h["p0.5"] == 0.0  # all token 10, the argmax
    assert got["greedy"] == got["k1"] == got["p0.5"] == [10] * n
    assert 0.3 < h["t0.5"] < h["t1"] < h["t4"]
    assert h["k3"] < h["t4"]
    assert got["t1"] != got["t1-seed2"]


async def _tokens(eng, cid, sp):
    return [e.token_id async for e in eng.generate(cid, sp)]


def test_logits_processor_hook(tiny_dirs):
    seen = []

    def only_42_then_7(generated, logits):
        seen.append(list(generated))
        out = logits.new_full(logits.shape, float("-inf"))
        out[42 if len(generated) < 3 else 7] = 0.0
        return out

    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=256) as eng:
        async def go():
            await eng.fill("x", [1, 2, 3])
            return await _tokens(eng, "x", SamplingParams(max_tokens=5, ignore_eos=True,
                                                          logits_processors=[only_42_then_7]))
        assert asyncio.run(go()) == [42, 42, 42, 7, 7]
    assert seen[:3] == [[], [42], [42, 42]]  # the hook sees the tokens generated so far


def test_failing_logits_processor_fails_only_its_request(tiny_dirs):
    from interlace.engine_ext.errors import EngineError

    def broken(generated, logits):
        raise RuntimeError("boom")

    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=256) as eng:
        async def go():
            await eng.fill("bad", [1, 2, 3])
            await eng.fill("good", [1, 2, 3])
            bad = _tokens(eng, "bad", SamplingParams(max_tokens=5, logits_processors=[broken]))
            good = _tokens(eng, "good", SamplingParams(max_tokens=5, ignore_eos=True))
            return await asyncio.gather(bad, good, return_exceptions=True)

        bad, good = asyncio.run(go())
        assert isinstance(bad, EngineError) and "boom" in str(bad)
        assert len(good) == 5
