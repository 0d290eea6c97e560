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
