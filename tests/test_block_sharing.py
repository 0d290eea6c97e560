"""Block sharing across fine-tuned variants in the native engine (BlockLLM,
issue #15): mixed-variant batches equal each variant served alone, shared
blocks are held and run once, LoRA per request equals PEFT, each variant's
prefix cache is its own, and replicas route a variant to its holder."""

from __future__ import annotations

import asyncio
from typing import Dict, List

import pytest
import torch
from safetensors.torch import load_file

from interlace.engine_ext import errors as E
from interlace.engine_ext.native.block_sharing import VariantSet, kv_blocks
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.native.loader import load_config, load_model, model_from_tensors
from interlace.engine_ext.native.setup import load_zoo_engine
from interlace.engine_ext.protocol import SamplingParams
from interlace.engine_ext.replicas import ReplicaSet
from interlace.engine_ext.zoo import Zoo, load_peft_adapter, merge_into
from interlace.engine_ext.zoo.variants import make_full_variant, make_lora_adapter

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21]]


async def greedy(engine, cid: str, ids: List[int], variant=None, sampling=GREEDY) -> List[int]:
    if variant is None:
        await engine.fill(cid, ids)
    else:
        await engine.fill(cid, ids, variant=variant)
    out = [ev.token_id async for ev in engine.generate(cid, sampling)]
    await engine.free_context(cid)
    return out


def alone(config: dict, tensors: Dict[str, torch.Tensor], tokenizer=None) -> NativeEngine:
    """The variant as a plain model of its own (no block sharing)."""
    return NativeEngine(model_from_tensors(config, tensors), tokenizer, kv_cache_tokens=2048)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_zoo(request, tiny_dirs, tmp_path_factory):
    """A zoo over a tiny model: the base, a full fine-tune of layer 1 and a rank-4 LoRA adapter."""
    d = tiny_dirs[request.param][0]
    root = tmp_path_factory.mktemp(f"zoo-{request.param}")
    z = Zoo(root / "zoo")
    z.add("base", str(d))
    z.add("ft", str(make_full_variant(d, root / "ft", layers=[1], scale=0.5, seed=1)), base="base")
    z.add("ad", str(make_lora_adapter(d, root / "ad", rank=4, seed=2, strength=0.3)), base="base")
    return z, d


def test_mixed_batch_equals_each_variant_alone(tiny_zoo):
    z, d = tiny_zoo
    raw, cfg = load_config(d)
    base_t = load_file(str(d / "model.safetensors"))
    refs = {"base": base_t, "ft": z.load("ft").tensors,
            "ad": merge_into(base_t, load_peft_adapter(z.adapter_dir("ad"), cfg, "ad"))}

    async def main():
        eng = load_zoo_engine(["base", "ft", "ad"], str(z.root), kv_cache_tokens=4096)
        try:
            jobs = [greedy(eng, f"{v}{i}", p, v) for i, p in enumerate(PROMPTS) for v in refs]
            got = await asyncio.gather(*jobs)
            assert (await eng.check_invariants())["contexts"] == 0
        finally:
            eng.close()
        k = 0
        outs = {}
        for i, p in enumerate(PROMPTS):
            for v, tensors in refs.items():
                ref_engine = alone(raw, tensors)
                try:
                    ref = await greedy(ref_engine, "x", p)
                finally:
                    ref_engine.close()
                assert got[k] == ref, (v, i)
                outs.setdefault(v, []).append(got[k])
                k += 1
        # the variants really differ (else equality above would prove nothing about routing rows)
        assert outs["base"] != outs["ft"] and outs["base"] != outs["ad"] and outs["ft"] != outs["ad"]

    asyncio.run(main())


def test_shared_blocks_are_held_once_and_run_once(tiny_zoo):
    z, d = tiny_zoo
    eng = load_zoo_engine(["base", "ft", "ad"], str(z.root), kv_cache_tokens=256)
    try:
        vs = eng.variants
        ft, ad = vs.get("ft"), vs.get("ad")
        assert sorted(ft.unique_blocks) == ["layers.1.attn", "layers.1.mlp"]
        layer0, layer1 = eng.model.layers[0], eng.model.layers[1]
        # a full fine-tune overrides only its unique blocks' modules; the rest are the base's tensors
        assert set(ft.weights) == {layer1.attn.qkv, layer1.attn.o, layer1.mlp.gate_up, layer1.mlp.down} | (
            {layer1.attn.q_norm, layer1.attn.k_norm} if eng.cfg.qk_norm else set())
        assert not ad.weights and ad.lora  # an adapter: the base's weights plus its own A/B
        info = {v.name: v for v in z.variants()}
        held = vs.weight_bytes()
        base_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in eng.model.parameters()}.values())
        assert held["base"] == base_bytes
        assert held["unique"] == info["ft"].unique_bytes + info["ad"].unique_bytes
        # one forward over rows of all three: a shared module is one group over every row, a unique one two
        batch = vs.batch([0, 1, 2, 1, 0])
        assert [rows for _, rows in batch.groups(layer0.attn.qkv)] == [None]
        groups = batch.groups(layer1.attn.qkv)
        assert len(groups) == 2
        rows = sorted(tuple(sorted(r.tolist())) for _, r in groups)
        assert rows == [(0, 2, 4), (1, 3)]  # base and the adapter's rows share the base's weight
        assert vs.batch([0, 0]) is None  # base rows only: the plain path
    finally:
        eng.close()


def test_lora_logits_equal_peft(tiny_dirs, tmp_path):
    """The engine's per-request LoRA against PEFT's own model on the same adapter."""
    peft = pytest.importorskip("peft")  # in the test extra; the merge reference is tested in test_zoo
    from transformers import AutoModelForCausalLM

    d, _ = tiny_dirs["llama"]
    ad = make_lora_adapter(d, tmp_path / "ad", rank=8, seed=5, strength=0.3)
    _, cfg = load_config(d)
    model = load_model(d)
    vs = VariantSet(model, "base")
    vs.add("ad", lora=load_peft_adapter(ad, cfg, "ad"))
    hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), ad).eval()
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
        with hf.disable_adapter():
            plain = hf(torch.tensor([ids])).logits[0, -1]

    async def main():
        eng = NativeEngine(model, variants=vs, kv_cache_tokens=512)
        try:
            await eng.fill("a", ids, variant="ad")
            await eng.fill("b", ids)
            return await eng.last_logits("a"), await eng.last_logits("b")
        finally:
            eng.close()

    got, got_base = asyncio.run(main())
    assert (ref - plain).abs().max() > 0.1  # the adapter changes the logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_base, plain, rtol=1e-4, atol=1e-4)


def test_prefix_cache_is_per_variant(tiny_dirs, tmp_path):
    """A block of KV computed under one variant's weights is reused by the
    same variant, never by one whose KV differs; a variant that differs only
    in the head shares the base's cache."""
    d, _ = tiny_dirs["llama"]
    raw, cfg = load_config(d)
    base_t = load_file(str(d / "model.safetensors"))
    ft = dict(base_t)
    ft["model.layers.0.self_attn.k_proj.weight"] = ft["model.layers.0.self_attn.k_proj.weight"] * 1.5
    head = dict(base_t)
    head["lm_head.weight"] = head["lm_head.weight"] * -1.0
    model = load_model(d)
    vs = VariantSet(model, "base")
    assert vs.add("ft", tensors=ft).namespace is not None
    assert vs.add("head", tensors=head).namespace is None  # the head is past the KV
    assert "lm_head" not in kv_blocks(cfg.num_layers) and "layers.0.attn" in kv_blocks(cfg.num_layers)
    prompt = list(range(1, 40))  # two full 16-token blocks

    async def main():
        eng = NativeEngine(model, variants=vs, kv_cache_tokens=1024)
        ref = alone(raw, ft)
        try:
            await greedy(eng, "b1", prompt)
            s0 = (await eng.check_invariants())["prefix_hit_blocks"]
            out_ft = await greedy(eng, "f1", prompt, "ft")
            s1 = (await eng.check_invariants())["prefix_hit_blocks"]
            assert s1 == s0  # the base's blocks were not reused under ft's weights
            assert out_ft == await greedy(ref, "r", prompt)
            await greedy(eng, "f2", prompt, "ft")
            s2 = (await eng.check_invariants())["prefix_hit_blocks"]
            assert s2 >= s1 + 2  # ft's own blocks are
            await greedy(eng, "h1", prompt, "head")
            assert (await eng.check_invariants())["prefix_hit_blocks"] >= s2 + 2  # the base's, by the head variant
        finally:
            eng.close()
            ref.close()

    asyncio.run(main())


def test_variant_errors_leave_nothing(tiny_zoo):
    z, _ = tiny_zoo

    async def main():
        eng = load_zoo_engine(["base", "ft"], str(z.root), kv_cache_tokens=512)
        plain = NativeEngine(load_model(tiny_zoo[1]), kv_cache_tokens=256, name="tiny")
        try:
            with pytest.raises(E.UnknownVariant, match="'nope'"):
                await eng.fill("x", [1, 2, 3], variant="nope")
            await eng.fill("p", [1, 2, 3], variant="ft")
            with pytest.raises(E.InvalidContextState, match="runs variant 'ft'"):
                await eng.fill("c", [4], parent_context_id="p", variant="base")
            with pytest.raises(E.InvalidContextState):
                await eng.fill("p", [4], variant="base")
            # a fork runs its parent's variant
            await eng.fill("c", [4], parent_context_id="p")
            st = await eng.check_invariants()
            assert st["contexts"] == 2
            with pytest.raises(E.UnknownVariant):
                await plain.fill("x", [1], variant="ft")
            await plain.fill("y", [1], variant="tiny")  # an engine's own name is its only variant
            assert plain.variant_names == frozenset({"tiny"})
            assert eng.variant_names == frozenset({"base", "ft"})
        finally:
            eng.close()
            plain.close()

    asyncio.run(main())


def test_fork_runs_parent_variant(tiny_zoo):
    z, d = tiny_zoo
    raw, _ = load_config(d)

    async def main():
        eng = load_zoo_engine(["base", "ft"], str(z.root), kv_cache_tokens=1024)
        ref = alone(raw, z.load("ft").tensors)
        try:
            await eng.fill("p", PROMPTS[0], variant="ft")
            out = [ev.token_id async for ev in eng.generate("c", GREEDY, parent_context_id="p")]
            assert out == await greedy(ref, "r", PROMPTS[0])
        finally:
            eng.close()
            ref.close()

    asyncio.run(main())


def test_replicas_route_a_variant_to_its_holder(tiny_zoo):
    z, _ = tiny_zoo

    async def main():
        a = load_zoo_engine(["base", "ft"], str(z.root), kv_cache_tokens=512)
        b = load_zoo_engine(["base", "ad"], str(z.root), kv_cache_tokens=512)
        rs = ReplicaSet([a, b], ["a", "b"])
        try:
            assert rs.variant_names == frozenset({"base", "ft", "ad"})
            for i in range(3):
                await rs.fill(f"ft{i}", PROMPTS[i], variant="ft")
                await rs.fill(f"ad{i}", PROMPTS[i], variant="ad")
                assert rs.replica_of(f"ft{i}") == "a" and rs.replica_of(f"ad{i}") == "b"
            with pytest.raises(E.UnknownVariant):
                await rs.fill("x", [1], variant="nope")
            assert rs.replica_of("x") is None
            await rs.fill("fork", [5], parent_context_id="ad0")
            assert rs.replica_of("fork") == "b"
        finally:
            rs.close()

    asyncio.run(main())


def test_worker_process_serves_variants(tiny_zoo):
    from interlace.engine_ext.worker import ProcessEngine

    z, d = tiny_zoo
    raw, _ = load_config(d)

    async def main():
        w = ProcessEngine.start({"path": "zoo/base", "variants": ["base", "ft"], "zoo": str(z.root),
                                 "kv_cache_tokens": 512, "threads": 1}, name="zoo-worker")
        ref = alone(raw, z.load("ft").tensors)
        try:
            assert w.variant_names == frozenset({"base", "ft"})
            assert await greedy(w, "a", PROMPTS[1], "ft") == await greedy(ref, "r", PROMPTS[1])
            with pytest.raises(E.UnknownVariant):
                await w.fill("x", [1], variant="ad")
        finally:
            w.close()
            ref.close()

    asyncio.run(main())


def test_embedded_variants_mixed_equal_alone(smol_zoo, smol_dir):
    """On the embedded model, float32: each variant's greedy text in one mixed batch equals it alone."""
    z = smol_zoo
    raw, cfg = load_config(smol_dir)
    eng = load_zoo_engine(["smol", "smol-ft", "smol-lora"], str(z.root), kv_cache_tokens=4096)
    tok = eng.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Name three fruits.")]
    base_t = z.load("smol").tensors
    refs = {"smol": base_t, "smol-ft": z.load("smol-ft").tensors,
            "smol-lora": merge_into(base_t, load_peft_adapter(z.adapter_dir("smol-lora"), cfg))}
    sampling = SamplingParams(max_tokens=24, temperature=0.0)

    async def main():
        try:
            got = await asyncio.gather(*(greedy(eng, f"{v}{i}", p, v, sampling)
                                         for i, p in enumerate(prompts) for v in refs))
        finally:
            eng.close()
        texts = {}
        for j, (v, tensors) in enumerate(refs.items()):
            ref_engine = alone(raw, tensors, tok)
            try:
                for i, p in enumerate(prompts):
                    assert got[i * len(refs) + j] == await greedy(ref_engine, "x", p, sampling=sampling), (v, i)
            finally:
                ref_engine.close()
            texts[v] = got[j::len(refs)]
        assert texts["smol"] != texts["smol-lora"]

    asyncio.run(main())


def test_rows_in_any_order_get_their_variants_weights(tiny_zoo):
    """VariantBatch over interleaved rows (indices) and over grouped rows
    (slices, as the runner orders them) both give each row its own
    variant's projection: base, full fine-tune, or base + LoRA."""
    z, d = tiny_zoo
    _, cfg = load_config(d)
    eng = load_zoo_engine(["base", "ft", "ad"], str(z.root), kv_cache_tokens=256)
    eng.close()
    vs = eng.variants
    layer = eng.model.layers[1]
    ft = z.load("ft").tensors
    merged = merge_into(z.load("base").tensors, load_peft_adapter(z.adapter_dir("ad"), cfg, "ad"))
    a = "model.layers.1.self_attn."
    refs = {0: layer.attn.qkv.weight,
            1: torch.cat([ft[a + f"{n}_proj.weight"] for n in "qkv"]),
            2: torch.cat([merged[a + f"{n}_proj.weight"] for n in "qkv"])}
    bias = layer.attn.qkv.bias  # the biases are the base's in every variant here
    torch.manual_seed(0)
    x = torch.randn(6, cfg.hidden_size)
    for rows in ([1, 2, 1, 0, 2, 0], [0, 0, 1, 1, 2, 2]):
        with torch.inference_mode():
            got = vs.batch(rows).linear(layer.attn.qkv, x)
        for r, v in enumerate(rows):
            want = torch.nn.functional.linear(x[r], refs[v], bias)
            torch.testing.assert_close(got[r], want, rtol=1e-4, atol=1e-4)
