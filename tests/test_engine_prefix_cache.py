"""Prefix-cache block digests: keyed, over the whole chain of blocks."""

from interlace.engine_ext.native.block_manager import BlockManager, BlockTable, chain_hash

BS = 4


def _cache(bm, tokens):
    """Compute ``tokens`` in a context, then free it: its full blocks stay cached."""
    t = BlockTable()
    bm.prepare_append(t, 0, len(tokens))
    bm.seal_full_blocks(t, tokens, len(tokens))
    hashes = list(t.hashes)
    bm.release(t)
    return hashes


def test_hit_needs_the_whole_prefix_not_just_the_last_block():
    bm = BlockManager(16, BS, hash_key=b"k" * 32)
    a, b, same = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    _cache(bm, a + same)
    t = BlockTable()
    assert bm.match_prefix(t, b + same + [0]) == 0  # same last block, different prefix: no sharing
    bm.release(t)
    t = BlockTable()
    assert bm.match_prefix(t, a + same + [0]) == 2 * BS
    bm.release(t)
    bm.check_invariants()


def test_digest_is_keyed_and_cryptographic():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    k1, k2 = b"\x01" * 32, b"\x02" * 32
    h1 = _cache(BlockManager(8, BS, hash_key=k1), tokens)
    assert h1 == _cache(BlockManager(8, BS, hash_key=k1), tokens)  # deterministic for one key
    assert all(isinstance(h, bytes) and len(h) == 32 for h in h1)   # 256-bit digests
    h2 = _cache(BlockManager(8, BS, hash_key=k2), tokens)
    assert not set(h1) & set(h2)  # another key, other digests: nothing to precompute offline
    assert chain_hash(k1, h1[0], tokens[4:]) == h1[1]  # the second digest covers the first
    assert chain_hash(k1, None, tokens[4:]) != h1[1]
    # every engine draws its own key
    assert BlockManager(8, BS).hash_key != BlockManager(8, BS).hash_key


def test_a_started_table_continues_with_cached_blocks():
    """A fork (or a context filled further) whose new tokens repeat cached
    blocks takes them: its partial block is replaced by the cached full one."""
    bm = BlockManager(32, BS, hash_key=b"k" * 32)
    seq = list(range(1, 18))  # 4 full blocks + 1 token
    _cache(bm, seq)
    parent = BlockTable()
    bm.prepare_append(parent, 0, 6)  # computed 6 tokens: 1 full block (sealed) + 2 of the next
    bm.seal_full_blocks(parent, seq, 6)
    child = bm.fork(parent)
    assert bm.extend_prefix(child, seq, 6) == 16  # blocks 1-3 from the cache; the last token stays to compute
    assert len(child.blocks) == 4 and len(child.hashes) == 4 and child.blocks[0] == parent.blocks[0]
    assert bm.extend_prefix(parent, [1, 2, 3, 4, 5, 6, 99, 98, 97], 6) == 6  # other tokens: nothing
    bm.release(child)
    bm.release(parent)
    bm.check_invariants()


def test_a_forked_fill_uses_the_prefix_cache_for_its_own_tokens(tiny_dirs):
    import asyncio

    import torch

    from interlace.engine_ext.native.engine import NativeEngine

    seq = [(7 * i) % 250 + 1 for i in range(70)]
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=512) as eng:
        async def go():
            await eng.fill("a", seq)        # computes and caches seq's blocks
            await eng.free_context("a")
            await eng.fill("p", seq[:22])   # a prefix context ending inside a block
            before = eng.stats["prefill_tokens"]
            await eng.fill("c", seq[22:], parent_context_id="p")
            computed = eng.stats["prefill_tokens"] - before
            logits = await eng.last_logits("c")
            await eng.check_invariants()
            await eng.free_context("c")
            await eng.free_context("p")
            return computed, logits
        computed, logits = asyncio.run(go())
    assert computed <= 4, computed  # 48 tokens to fill, all but the last block's worth came from the cache
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=512, prefix_caching=False) as ref:
        async def plain():
            await ref.fill("x", seq)
            return await ref.last_logits("x")
        expected = asyncio.run(plain())
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_hits_count_what_the_cache_covered_once():
    """``hits`` (a request's cached_tokens) counts the positions the cache covered; blocks found
    again after the table was released (a preemption, a discard) are a recomputation avoided,
    not prompt tokens served from cache, and are not counted twice."""
    bm = BlockManager(32, BS, hash_key=b"k" * 32)
    seq = list(range(1, 15))  # 3 full blocks + 2 tokens
    _cache(bm, seq)
    t = BlockTable()
    assert bm.match_prefix(t, seq) == 3 * BS and t.hits == 3 * BS
    bm.prepare_append(t, 3 * BS, len(seq))  # the rest computed here
    bm.seal_full_blocks(t, seq, len(seq))
    assert t.high == len(seq)
    bm.release(t)  # preempted
    assert bm.match_prefix(t, seq) == 3 * BS and t.hits == 3 * BS  # found again: not counted again
    bm.release(t)
    t.high = 0  # a new request on it (the engine resets high as a fill starts one)
    assert bm.match_prefix(t, seq) == 3 * BS and t.hits == 6 * BS
    bm.release(t)
    bm.check_invariants()
