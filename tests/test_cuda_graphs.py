"""The native engine on CUDA (issue 14): decode CUDA graphs, staged step inputs, KV sizing from memory.

Without CUDA the Triton kernels run under the interpreter and the decode
graphs' static-buffer path runs eagerly (:class:`DecodeGraphs` with
``capture=False``): everything but the capture itself is checked here on any
machine.  The tests marked for CUDA capture real graphs and pin real memory.

Each runner-level test drives two :class:`ModelRunner` over the same tiny
random model, one eager and one through the graphs, with the same contexts
and the same (NaN-filled) caches: a cache slot nobody wrote stays NaN, so a
padded row that wrote the cache, or a kernel that read an unwritten slot, shows.
"""

from __future__ import annotations

import asyncio
from typing import List

import pytest
import torch

pytest.importorskip("triton")

from interlace.engine_ext.native import kernels  # noqa: E402,F401  (sets TRITON_INTERPRET without CUDA)
from interlace.engine_ext.native.block_manager import BlockTable  # noqa: E402
from interlace.engine_ext.native.cuda_graphs import graph_sizes  # noqa: E402
from interlace.engine_ext.native.kernels.attention import TritonAttention  # noqa: E402
from interlace.engine_ext.native.memory import KVCacheMemoryError, kv_blocks_for  # noqa: E402
from interlace.engine_ext.native.model_runner import ModelRunner  # noqa: E402
from interlace.engine_ext.native.models.llama import LlamaForCausalLM, ModelConfig  # noqa: E402
from interlace.engine_ext.native.scheduler import Batch, ScheduledChunk  # noqa: E402
from interlace.engine_ext.native.sequence import Context  # noqa: E402
from interlace.engine_ext.native.staging import Staged, StepStaging  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # where the Triton kernels run compiled; the interpreter without CUDA
BS = 4            # block size: contexts cross many block boundaries
NUM_BLOCKS = 64
MAX_LEN = 1024    # max_model_len: split-K 2-4 in the graphs, 1 in eager steps over these short contexts
TOL = 1e-4


def tiny_model(window=None, seed=0, device="cpu") -> LlamaForCausalLM:
    cfg = ModelConfig(model_type="mistral" if window else "llama", vocab_size=320, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=MAX_LEN,
                      tie_word_embeddings=False, attention_bias=False, qk_norm=False, sliding_window=window)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    return model.eval().to(device)


def runner(model, graphs: bool, max_seqs=8, device="cpu") -> ModelRunner:
    r = ModelRunner(model, NUM_BLOCKS, BS, torch.float32, torch.device(device), None, TritonAttention(),
                    max_seqs=max_seqs, max_model_len=MAX_LEN, cuda_graphs=graphs)
    r.kv.fill_(float("nan"))  # every slot nobody writes stays NaN
    return r


class Contexts:
    """Contexts with blocks from 2 upwards: blocks 0 and 1 are nobody's (block 0 is where a padded
    row's table points, and where slot 0 is)."""

    def __init__(self, lens: List[int], seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.next_block = 2
        self.ctxs = []
        for i, n in enumerate(lens):
            toks = torch.randint(1, 320, (n,), generator=g).tolist()
            self.ctxs.append(Context(f"c{i}", toks, BlockTable()))
        self.g = g

    def grow(self, ctx: Context, n: int) -> None:
        while len(ctx.table.blocks) * BS < n:
            ctx.table.blocks.append(self.next_block)
            self.next_block += 1

    def prefill(self, ctxs=None) -> Batch:
        chunks = []
        for c in ctxs or self.ctxs:
            self.grow(c, len(c.token_ids))
            chunks.append(ScheduledChunk(c, 0, len(c.token_ids)))
        return Batch(chunks=chunks)

    def decode(self, ctxs=None) -> Batch:
        """One new token per context (appended; its KV not computed yet)."""
        chunks = []
        for c in ctxs or self.ctxs:
            c.token_ids.append(int(torch.randint(1, 320, (1,), generator=self.g)))
            self.grow(c, len(c.token_ids))
            chunks.append(ScheduledChunk(c, len(c.token_ids) - 1, 1))
        return Batch(chunks=chunks)

    @property
    def unowned(self) -> List[int]:
        return [0, 1] + list(range(self.next_block, NUM_BLOCKS))


def both(batch: Batch, eager: ModelRunner, graphed: ModelRunner):
    le, re_ = eager.run(batch)
    lg, rg = graphed.run(batch)
    assert re_ == rg
    assert not lg.isnan().any(), "NaN logits: a kernel read an unwritten slot"
    err = (le - lg).abs().max().item()
    assert err <= TOL, f"graph path logits differ from eager by {err}"
    return le, lg


def assert_untouched(r: ModelRunner, blocks: List[int]) -> None:
    kv = r.kv[:, :, :, blocks]
    assert kv.isnan().all(), f"a block nobody owns was written: {[b for b in blocks if not r.kv[:, :, :, b].isnan().all()]}"


# ------------------------------------------------------------------------------------------------ sizes
def test_graph_sizes_pad_to_powers_of_two_then_steps_of_eight():
    assert graph_sizes(1) == [1]
    assert graph_sizes(3) == [1, 2, 4]
    assert graph_sizes(5) == [1, 2, 4, 8]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert graph_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert graph_sizes(10_000)[-1] == 256  # capped: larger decode batches run eagerly


# ------------------------------------------------------------------------------------- the padded graph path
@pytest.mark.parametrize("lens,window", [([3, 9, 14], None), ([5, 1, 12, 7, 20], None), ([5, 1, 12, 7, 20], 6)])
def test_padded_decode_equals_eager_and_padded_rows_write_nothing(lens, window):
    """3 contexts pad to 4, 5 to 8 (mistral: a sliding window of 6); three decode steps each,
    so the static buffers are rewritten between "replays"."""
    model = tiny_model(window, device=DEV)
    eager, graphed = runner(model, False, device=DEV), runner(model, True, device=DEV)
    cs = Contexts(lens)
    both(cs.prefill(), eager, graphed)
    assert graphed.graphs.replays == 0  # a prefill step is eager
    for step in range(3):
        both(cs.decode(), eager, graphed)
        assert graphed.graphs.replays == step + 1
    b = graphed.graphs.padded_size(len(lens))
    assert b > len(lens)  # the batch was padded
    # the padded rows read no key either: their table points at block 0, which is NaN
    assert not graphed.graphs._forward(b).isnan().any()
    assert_untouched(graphed, cs.unowned)
    assert_untouched(eager, cs.unowned)


def test_mixed_step_and_decode_after_prefill_fall_back_to_eager_and_agree():
    model = tiny_model(device=DEV)
    eager, graphed = runner(model, False, device=DEV), runner(model, True, device=DEV)
    cs = Contexts([6, 11, 3])
    both(cs.prefill(cs.ctxs[:2]), eager, graphed)
    # a mixed step: two decodes and a prefill chunk of the third context
    mixed = cs.decode(cs.ctxs[:2])
    mixed.chunks += cs.prefill(cs.ctxs[2:]).chunks
    both(mixed, eager, graphed)
    assert graphed.graphs.replays == 0
    # a chunk of a prefill in progress (start > 0 but several tokens): eager too
    c = cs.ctxs[2]
    c.token_ids += [7, 8, 9]
    cs.grow(c, len(c.token_ids))
    both(Batch(chunks=[ScheduledChunk(c, len(c.token_ids) - 3, 3)]), eager, graphed)
    assert graphed.graphs.replays == 0
    both(cs.decode(), eager, graphed)  # then all decode: the graphs
    assert graphed.graphs.replays == 1
    assert_untouched(graphed, cs.unowned)


def test_batch_larger_than_the_largest_graph_runs_eagerly():
    model = tiny_model(device=DEV)
    eager, graphed = runner(model, False, device=DEV), runner(model, True, max_seqs=4, device=DEV)
    assert graphed.graphs.sizes == [1, 2, 4]
    cs = Contexts([4, 5, 6, 7, 8])
    both(cs.prefill(), eager, graphed)
    both(cs.decode(), eager, graphed)
    assert graphed.graphs.replays == 0
    both(cs.decode(cs.ctxs[:4]), eager, graphed)  # four fit
    assert graphed.graphs.replays == 1


def test_graphs_need_the_triton_attention_and_a_bool():
    model = tiny_model()
    with pytest.raises(ValueError, match="needs attention: triton"):
        ModelRunner(model, 8, BS, torch.float32, torch.device("cpu"), None, None, cuda_graphs=True)
    from interlace.engine_ext.native.engine import NativeEngine

    with pytest.raises(ValueError, match="cuda_graphs must be true or false"):
        NativeEngine(model, kv_cache_tokens=64, attention="triton", cuda_graphs="yes")
    # on the CPU the default is off, with or without Triton
    assert ModelRunner(model, 8, BS, torch.float32, torch.device("cpu"), None, TritonAttention()).graphs is None


def test_engine_with_decode_graphs_generates_what_the_eager_engine_does():
    """Greedy tokens of ragged contexts decoding together (3 pad to 4), one finishing early so the
    batch shrinks (4 -> 3 -> ...), through the engine; its buffers are dropped at close."""
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.protocol import SamplingParams

    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]

    async def run(engine):
        await asyncio.gather(*(engine.fill(f"c{i}", p) for i, p in enumerate(prompts)))

        async def tokens(cid, n):
            sp = SamplingParams(max_tokens=n, ignore_eos=True)
            return [ev.token_id async for ev in engine.generate(cid, sp) if ev.token_id is not None]

        out = await asyncio.gather(*(tokens(f"c{i}", n) for i, n in enumerate((6, 3, 6))))
        for i in range(len(prompts)):
            await engine.free_context(f"c{i}")
        books = await engine.check_invariants()
        assert books["contexts"] == 0 and books["used_blocks"] == 0  # no block leaked (cached ones are free)
        return out

    got, replays = {}, 0
    for graphs in (True, False):
        with NativeEngine(tiny_model(device=DEV), block_size=BS, kv_cache_tokens=256, max_batched_tokens=32,
                          attention="triton", cuda_graphs=graphs) as eng:
            got[graphs] = asyncio.run(run(eng))
            if graphs:
                replays = eng.runner.graphs.replays
        assert eng.runner.graphs is None and eng.runner.staging is None  # freed with the engine
    assert replays >= 4
    assert got[True] == got[False]


@pytest.mark.skipif(not CUDA, reason="captures real CUDA graphs")
def test_captured_cuda_graphs_replay_the_eager_logits():
    model = tiny_model(device="cuda")
    eager, graphed = runner(model, False, device="cuda"), runner(model, True, device="cuda")
    assert graphed.graphs.capture and graphed.graphs.host.is_pinned()
    cs = Contexts([3, 9, 14])
    both(cs.prefill(), eager, graphed)
    for _ in range(3):  # the same graph replayed over new inputs in the static buffers
        both(cs.decode(), eager, graphed)
    both(cs.decode(cs.ctxs[:1]), eager, graphed)  # another size: a second graph in the shared pool
    both(cs.decode(), eager, graphed)             # and the first again
    assert sorted(graphed.graphs.graphs) == [1, 4] and graphed.graphs.replays == 5
    assert graphed.staging.host.is_pinned() and eager.staging.host.is_pinned()  # the eager steps' inputs
    assert_untouched(graphed, cs.unowned)
    graphed.close()
    assert graphed.graphs is None and graphed.staging is None


# ------------------------------------------------------------------------------------------ staged inputs
def test_staging_packs_every_input_into_one_buffer_and_views_it():
    st = StepStaging(torch.device("cpu"), pin=False)
    a = st.tensor([3, 1, 4], torch.long)
    b = st.tensor([[1, 2], [3, 4], [5, 6]], torch.int32)
    c = st.tensor([], torch.long)
    d = st.tensor([-1, 2 ** 40], torch.long)
    views = st.upload()
    assert [v.tolist() for v in views] == [[3, 1, 4], [[1, 2], [3, 4], [5, 6]], [], [-1, 2 ** 40]]
    assert [v.dtype for v in views] == [torch.long, torch.int32, torch.long, torch.long]
    assert views[0].data_ptr() == st.dev.data_ptr()  # views of the one device buffer
    assert views[3].data_ptr() == st.dev.data_ptr() + 9 * 8
    first = st.host
    st.tensor(list(range(100)))
    assert st.upload()[0].tolist() == list(range(100))
    # double-buffered: this upload wrote the other host buffer, the one the last copy read is untouched
    assert st.host.data_ptr() != first.data_ptr() and first[:3].tolist() == [3, 1, 4]
    st.tensor([7])
    st.upload()
    assert st.host.data_ptr() == first.data_ptr() and first[0] == 7  # two uploads later: reused
    st.tensor(list(range(5000)))
    assert st.upload()[0].tolist() == list(range(5000)) and st.capacity == 8192  # grown by doubling
    with pytest.raises(ValueError, match="equal lengths"):
        st.tensor([[1], [2, 3]])
    st.close()
    assert st.capacity is None


@pytest.mark.parametrize("attention", ["triton", "torch"])
def test_runner_with_staged_inputs_equals_plain_tensors(attention):
    """The runner's step through the staging (placeholders resolved in the metadata, the prefill
    spans and the Triton arguments), without pinning on the CPU, against its plain tensors."""
    if attention == "triton" and CUDA:
        pytest.skip("compiled Triton kernels take CUDA tensors; on CUDA every runner stages its inputs "
                    "(test_captured_cuda_graphs_replay_the_eager_logits)")
    model = tiny_model()
    kernel = TritonAttention() if attention == "triton" else None
    plain = ModelRunner(model, NUM_BLOCKS, BS, torch.float32, torch.device("cpu"), None, kernel)
    staged = ModelRunner(model, NUM_BLOCKS, BS, torch.float32, torch.device("cpu"), None, kernel)
    assert plain.staging is None  # the CPU keeps plain tensors
    staged.staging = StepStaging(torch.device("cpu"), pin=False)
    cs = Contexts([6, 11, 3])
    if attention == "triton":  # the kernels never read an unwritten slot (the torch path's gather does)
        plain.kv.fill_(float("nan"))
        staged.kv.fill_(float("nan"))

    def mixed():  # two decodes and the third context's prefill
        batch = cs.decode(cs.ctxs[:2])
        batch.chunks += cs.prefill(cs.ctxs[2:]).chunks
        return batch

    for batch in (cs.prefill(cs.ctxs[:2]), mixed(), cs.decode()):
        lp, rp = plain.run(batch)
        ls, rs = staged.run(batch)
        assert rp == rs and not ls.isnan().any() and torch.equal(lp, ls)
    assert staged.staging.capacity >= 1024
    staged.close()
    assert staged.staging is None


def test_resolve_replaces_placeholders_only():
    st = StepStaging(torch.device("cpu"), pin=False)
    args = TritonAttention.step_args([(0, 2, 0, [5, 6])], [(2, 7, [1, 2])], BS, 0, torch.device("cpu"), st.tensor)
    assert isinstance(args.prefill_rows, Staged) and args.max_new == 2
    st.upload()
    st.resolve(args)
    assert args.prefill_rows.tolist() == [0, 1] and args.decode_tables.tolist() == [[1, 2]]
    assert args.decode_lens.dtype == torch.int32 and args.window == 0


# ----------------------------------------------------------------------------------- KV sizing from memory
GIB = 1024 ** 3


def test_kv_blocks_follow_the_utilization_rule():
    # 80 GiB at 0.9 = 72 GiB; less 16 GiB weights, 4 GiB activations, 1 GiB other = 51 GiB of 2 MiB blocks
    assert kv_blocks_for(80 * GIB, 16 * GIB, 4 * GIB, 0.9, 2 * 1024 ** 2, GIB) == int(51 * GIB * 1.0) // (2 * 1024 ** 2)
    assert kv_blocks_for(1000, 100, 100, 0.5, 30) == 10  # (500 - 200) // 30
    assert kv_blocks_for(1000, 100, 100, 0.5, 30, free_bytes=400) == 10  # free is not the limit
    assert kv_blocks_for(1000, 100, 100, 0.5, 30, free_bytes=250) == 5   # (250 - 100) // 30


@pytest.mark.parametrize("args,needle", [
    ((1000, 400, 100, 0.5, 30), "no room for the KV cache: 0.5 x"),
    ((1000, 100, 100, 0.5, 301), "one block takes 301 bytes"),
    ((1000, 0, 0, 1.0, 30, 0, 20), "only 0.00 GiB is free"),
])
def test_kv_blocks_error_names_the_numbers(args, needle):
    with pytest.raises(KVCacheMemoryError) as e:
        kv_blocks_for(*args)
    assert needle in str(e.value) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "0.9", None])
def test_utilization_out_of_range_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in \\(0, 1\\]"):
        kv_blocks_for(1000, 0, 0, bad, 10)


def test_engine_ignores_utilization_on_a_cpu_and_checks_it():
    from interlace.engine_ext.native.engine import NativeEngine

    with NativeEngine(tiny_model(), block_size=BS, kv_cache_tokens=64, gpu_memory_utilization=0.5) as eng:
        assert eng.blocks.num_blocks == 16  # kv_cache_tokens: the CPU has no memory share to measure
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        NativeEngine(tiny_model(), kv_cache_tokens=64, gpu_memory_utilization=2)


def test_config_takes_the_cuda_options_and_defaults_utilization_when_the_cache_is_not_sized():
    pytest.importorskip("jsonschema", reason="the gateway's config (the GPU run installs only the engine's needs)")
    from interlace.gateway.config import ConfigError, parse_config

    cfg = parse_config({"models": {
        "auto": {"path": "x"},
        "tokens": {"path": "x", "kv_cache_tokens": 4096},
        "share": {"path": "x", "gpu_memory_utilization": 0.5, "cuda_graphs": False},
        "replica": {"path": "x", "replicas": [{"kind": "native", "kv_cache_tokens": 1024}, "native"]},
    }})
    m = cfg.models
    assert m["auto"].replicas[0]["gpu_memory_utilization"] == 0.9
    assert "gpu_memory_utilization" not in m["tokens"].replicas[0]
    assert m["share"].replicas[0]["gpu_memory_utilization"] == 0.5 and m["share"].replicas[0]["cuda_graphs"] is False
    first, second = m["replica"].replicas
    assert "gpu_memory_utilization" not in first and second["gpu_memory_utilization"] == 0.9
    for bad, needle in [({"gpu_memory_utilization": 0}, "gpu_memory_utilization: 0 is less than or equal to"),
                        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization: 1.2 is greater than the maximum"),
                        ({"cuda_graphs": "on"}, "cuda_graphs: 'on' is not of type 'boolean'")]:
        with pytest.raises(ConfigError) as e:
            parse_config({"models": {"m": {"path": "x", **bad}}}, "f.yaml")
        assert needle in str(e.value), str(e.value)


@pytest.mark.skipif(CUDA, reason="the errors of the CUDA-only parts on a machine without CUDA")
def test_cuda_only_parts_refuse_a_cpu():
    from interlace.engine_ext.native.cuda_graphs import DecodeGraphs
    from interlace.engine_ext.native.memory import measure_activation_peak

    model = tiny_model()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        measure_activation_peak(model, 8, BS, torch.float32, torch.device("cpu"), None)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(model, torch.zeros(1), TritonAttention(), BS, 64, 4, 0, torch.device("cpu"), capture=True)


@pytest.mark.skipif(not CUDA, reason="measures GPU memory")
def test_engine_sizes_its_cache_from_gpu_memory():
    from interlace.engine_ext.native import memory
    from interlace.engine_ext.native.engine import NativeEngine

    model = tiny_model(device="cuda")
    peak, _ = memory.measure_activation_peak(model, 256, BS, torch.float32, torch.device("cuda"), TritonAttention())
    assert peak > 256 * 64 * 4  # at least the hidden states of 256 tokens
    free, total = torch.cuda.mem_get_info()
    share = 0.05
    with NativeEngine(model, block_size=BS, max_batched_tokens=256, attention="triton",
                      gpu_memory_utilization=share) as eng:
        per_block = ModelRunner.kv_bytes_per_block(model, BS, torch.float32)
        assert eng.blocks.num_blocks * per_block <= min(total * share, free)
        assert eng.blocks.num_blocks > 1000
        assert eng.swap.pool.num_blocks * BS == 16384  # the host pool: kv_cache_tokens, not the GPU cache's size
