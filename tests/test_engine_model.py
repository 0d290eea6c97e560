"""Our Llama-family decoder against transformers' reference, through the
engine's paged cache: prefill, token-by-token decode, forks and prefix reuse.
The tiny Mistral has a 6-token sliding window, shorter than every sequence
here, so each of these checks also covers windowed attention."""

import asyncio

import pytest
import torch

from helpers import run
from interlace.engine_ext.native.engine import NativeEngine

KINDS = ["llama", "qwen2", "qwen3", "mistral"]
TOKENS = [5, 17, 33, 200, 7, 8, 9, 10, 11, 12, 13, 99, 250, 3, 1, 2, 64, 65, 66, 300, 301, 42]


def ref_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(params=KINDS)
def pair(request, tiny_dirs):
    d, hf = tiny_dirs[request.param]
    eng = NativeEngine.load(d, block_size=4, kv_cache_tokens=512)
    yield eng, hf
    eng.close()


def test_prefill_logits_match_reference(pair):
    eng, hf = pair
    ref = ref_logits(hf, TOKENS)

    async def go():
        await eng.fill("p", TOKENS)
        return await eng.last_logits("p")

    torch.testing.assert_close(run(go()), ref[-1], atol=1e-4, rtol=1e-4)


def test_token_by_token_decode_matches_reference(pair):
    eng, hf = pair
    ref = ref_logits(hf, TOKENS)

    async def go():
        out = []
        for i, t in enumerate(TOKENS):
            await eng.fill("d", [t])  # one token at a time through the paged cache
            out.append(await eng.last_logits("d"))
        return torch.stack(out)

    torch.testing.assert_close(run(go()), ref, atol=1e-4, rtol=1e-4)


def test_forked_context_matches_reference(pair):
    eng, hf = pair
    prefix, a, b = TOKENS[:10], TOKENS[10:15], TOKENS[15:]  # prefix ends mid-block: copy-on-write

    async def go():
        await eng.fill("parent", prefix)
        await eng.fill("child_a", a, parent_context_id="parent")
        await eng.fill("child_b", b, parent_context_id="parent")
        await eng.fill("parent", [1, 2, 3])  # the parent goes on too; children must not see it
        res = [await eng.last_logits(c) for c in ("child_a", "child_b", "parent")]
        stats = await eng.check_invariants()
        return res, stats

    (la, lb, lp), stats = run(go())
    torch.testing.assert_close(la, ref_logits(hf, prefix + a)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lb, ref_logits(hf, prefix + b)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lp, ref_logits(hf, prefix + [1, 2, 3])[-1], atol=1e-4, rtol=1e-4)
    assert stats["cow_copies"] >= 2


def test_prefix_reuse_matches_reference(pair):
    eng, hf = pair

    async def go():
        await eng.fill("first", TOKENS)
        await eng.free_context("first")  # its full blocks stay cached
        before = (await eng.check_invariants())["prefix_hit_blocks"]
        await eng.fill("second", TOKENS[:16] + [77, 78])
        after = await eng.check_invariants()
        return await eng.last_logits("second"), after["prefix_hit_blocks"] - before

    logits, hits = run(go())
    assert hits == 4  # 16 tokens / block size 4
    torch.testing.assert_close(logits, ref_logits(hf, TOKENS[:16] + [77, 78])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_matches_reference(kind, tiny_dirs):
    """A prompt computed in chunks of 5 (each chunk attends to the cache
    written by the earlier ones, through the window where there is one)."""
    d, hf = tiny_dirs[kind]
    with NativeEngine.load(d, block_size=4, kv_cache_tokens=512, max_batched_tokens=5) as eng:
        async def go():
            await eng.fill("c", TOKENS)
            return await eng.last_logits("c"), eng.stats["steps"]

        logits, steps = run(go())
    assert steps == 5  # 22 tokens in chunks of at most 5
    torch.testing.assert_close(logits, ref_logits(hf, TOKENS)[-1], atol=1e-4, rtol=1e-4)


def test_sliding_window_is_honoured(tiny_dirs):
    """The reference itself differs from full attention past the window, so
    the checks above would catch an engine that ignored it."""
    d, hf = tiny_dirs["mistral"]
    assert hf.config.sliding_window == 6
    eng_cfg = NativeEngine.load(d, block_size=4, kv_cache_tokens=64)
    try:
        assert eng_cfg.cfg.sliding_window == 6
    finally:
        eng_cfg.close()
    windowed = ref_logits(hf, TOKENS)
    hf.config.sliding_window = None
    try:
        full = ref_logits(hf, TOKENS)
    finally:
        hf.config.sliding_window = 6
    torch.testing.assert_close(windowed[:6], full[:6])
    assert (windowed[6:] - full[6:]).abs().amax(-1).min() > 0.1


def test_mixed_window_layers_are_refused():
    from interlace.engine_ext.native.models import ModelConfig, UnsupportedModel

    base = dict(model_type="qwen2", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    assert ModelConfig.from_hf({**base, "use_sliding_window": False, "sliding_window": 32}).sliding_window is None
    with pytest.raises(UnsupportedModel, match="sliding-window"):
        ModelConfig.from_hf({**base, "use_sliding_window": True, "sliding_window": 32})
    with pytest.raises(UnsupportedModel, match="sliding-window"):
        ModelConfig.from_hf({**base, "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(UnsupportedModel, match="sliding_window"):
        ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 0})


def test_greedy_generation_matches_reference(pair):
    eng, hf = pair
    prompt = TOKENS[:9]

    async def go():
        await eng.fill("g", prompt)
        return [ev.token_id async for ev in eng.generate("g", _greedy(12))]

    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert run(go()) == ref[0, len(prompt):].tolist()


def _greedy(n):
    from interlace.engine_ext.protocol import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_decode_tracks_float32_reference(kind, tiny_dirs):
    """bfloat16 runs its own decode attention (two batched matmuls over the
    gathered blocks, float32 softmax): token by token, and for contexts of
    different lengths decoded in one batch, its logits stay within bfloat16
    rounding of the float32 reference."""
    d, hf = tiny_dirs[kind]
    ref = ref_logits(hf, TOKENS)
    scale = ref.abs().max()
    with NativeEngine.load(d, dtype="bfloat16", block_size=4, kv_cache_tokens=512) as eng:
        async def go():
            out = []
            for t in TOKENS:
                await eng.fill("d", [t])
                out.append(await eng.last_logits("d"))
            # three contexts of different lengths, one decode step together
            await asyncio.gather(*(eng.fill(f"b{n}", TOKENS[:n]) for n in (5, 11, 17)))
            batched = await asyncio.gather(*(eng.fill(f"b{n}", [TOKENS[n]]) for n in (5, 11, 17)))
            assert batched == [6, 12, 18]
            return torch.stack(out), [await eng.last_logits(f"b{n}") for n in (5, 11, 17)]

        seq, batched = run(go())
    assert seq.dtype == torch.float32
    torch.testing.assert_close(seq, ref, atol=0.03 * scale, rtol=0.05)
    for n, lg in zip((5, 11, 17), batched):
        torch.testing.assert_close(lg, ref[n], atol=0.03 * scale, rtol=0.05)
        assert lg.argmax() == ref[n].argmax() or ref[n].topk(2).values.diff().abs() < 0.03 * scale
