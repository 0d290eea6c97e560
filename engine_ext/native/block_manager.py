"""Paged KV cache bookkeeping: reference-counted blocks, fork sharing,
copy-on-write and automatic prefix caching.

The KV cache is cut into fixed-size blocks.  A context owns a *block table*
(the list of its block ids in token order).  Blocks are shared, never copied,
when a context is forked (ref count +1) or when a new context starts with a
token prefix that some earlier context computed: every *full* computed block
is registered under a chained hash of all tokens up to its end, so equal
prefixes map to equal hashes (vLLM's automatic prefix caching).

The chain hash is a keyed BLAKE2b digest (256 bits) of the previous block's
digest and the block's token ids, with a random key per cache.  A hit thus
means the whole prefix is equal, not just the block's own tokens: an
unkeyed 64-bit hash (Python's ``hash``) lets anyone who can choose prompts
search offline for a colliding prefix and have another tenant's request read
KV computed for different tokens (the class of vLLM's CVE-2025-25183).

Each block is always in exactly one of three states, which
:meth:`BlockManager.check_invariants` verifies:

* free   - ref 0, no hash, in the free list;
* cached - ref 0, hashed, in the LRU of evictable blocks (reusable by hash
  until it is evicted to serve an allocation);
* owned  - ref > 0, in the block table of at least one live context.

This module only keeps books; the model runner moves the bytes (it executes
the copy-on-write copies this module asks for).  Free of torch.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterable, List, Optional, Sequence, Tuple


class OutOfBlocks(Exception):
    """Raised by :meth:`BlockManager.allocate` when nothing is free or evictable."""


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: Optional[bytes] = None


_ROOT = b"\0" * 32  # the "parent digest" of a context's first block


def chain_hash(key: bytes, parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """Digest of a full block: keyed BLAKE2b over the digest of the block
    before it and the block's token ids (4 bytes each, little-endian)."""
    h = hashlib.blake2b(parent or _ROOT, key=key, digest_size=32)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


@dataclass
class BlockTable:
    """A context's view of the cache: its blocks and the hashes of the leading
    full, computed blocks (``len(hashes) <= len(blocks)``).

    ``root`` starts the hash chain: a model variant whose weights give other
    KV (``native/block_sharing.py``) has its own root, so its blocks are never
    found by another variant's prefix (None: the base model's chain).

    What the prefix cache saved (``usage.prompt_tokens_details.cached_tokens``):
    ``hits`` counts the positions the cache covered that the table had not
    covered before, ``forked`` the computed positions a fork's table started
    with (its owner takes and resets both once a request is answered);
    ``high`` is how far the table has been covered since the
    current request began, so a block found again after a preemption or a
    discard is a recomputation avoided, not a prompt token served from cache."""

    blocks: List[int] = field(default_factory=list)
    hashes: List[bytes] = field(default_factory=list)
    root: Optional[bytes] = None
    hits: int = 0
    forked: int = 0
    high: int = 0

    def copy(self) -> "BlockTable":
        return BlockTable(list(self.blocks), list(self.hashes), self.root)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, hash_key: Optional[bytes] = None,
                 prefix_caching: bool = True):
        """``hash_key`` keys the prefix-cache digests; a fresh random one by
        default (tests pass their own).  ``prefix_caching=False`` never seals
        or matches a block (vLLM as InferCept and LAMPS measured it)."""
        self.prefix_caching = prefix_caching
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_key = hash_key if hash_key is not None else os.urandom(32)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: Deque[int] = deque(range(num_blocks))
        self.evictable: "OrderedDict[int, None]" = OrderedDict()  # LRU order: oldest first
        self.by_hash: Dict[bytes, int] = {}
        self.stats = {"prefix_hit_blocks": 0, "evictions": 0, "cow_copies": 0}

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks an allocation can get (free or evictable)."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------------------------------------------------------------- primitives
    def allocate(self) -> int:
        if self.free:
            bid = self.free.popleft()
        elif self.evictable:
            bid, _ = self.evictable.popitem(last=False)
            blk = self.blocks[bid]
            del self.by_hash[blk.hash]
            blk.hash = None
            self.stats["evictions"] += 1
        else:
            raise OutOfBlocks()
        self.blocks[bid].ref_count = 1
        return bid

    def incref(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            self.evictable.pop(bid)  # a cached block comes back into use
        blk.ref_count += 1

    def decref(self, bid: int) -> None:
        blk = self.blocks[bid]
        assert blk.ref_count > 0, f"block {bid} freed twice"
        blk.ref_count -= 1
        if blk.ref_count == 0:
            if blk.hash is not None:
                self.evictable[bid] = None  # most recently used at the end
            else:
                self.free.append(bid)

    # ------------------------------------------------------- table operations
    def release(self, table: BlockTable) -> None:
        """Drop a table's references (the context is freed or preempted).
        Entries swapped out to the host (negative) hold no device block."""
        for bid in reversed(table.blocks):  # tail blocks are evicted first
            if bid >= 0:
                self.decref(bid)
        table.blocks.clear()
        table.hashes.clear()

    def truncate(self, table: BlockTable, num_blocks: int) -> None:
        """Keep only the table's first ``num_blocks`` blocks (a context cut
        back to a block boundary).  The dropped blocks are released like a
        preempted context's: hashed ones stay cached for their old tokens."""
        for bid in reversed(table.blocks[num_blocks:]):
            if bid >= 0:
                self.decref(bid)
        del table.blocks[num_blocks:]
        del table.hashes[num_blocks:]

    def fork(self, table: BlockTable) -> BlockTable:
        """A child's table shares every block of the parent's (all on the device)."""
        assert all(b >= 0 for b in table.blocks), "fork of a table with swapped-out blocks"
        for bid in table.blocks:
            self.incref(bid)
        return table.copy()

    def match_prefix(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Fill an empty table with cached blocks for the longest cached prefix
        of ``token_ids``; returns the number of tokens covered.

        At least one token is always left to compute, so the caller gets the
        last position's logits from a forward pass.
        """
        assert not table.blocks
        return self.extend_prefix(table, token_ids, 0)

    def extend_prefix(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> int:
        """Continue a started table with cached blocks: the positions from
        ``num_computed`` on (a fork's own tokens, a fill after computed KV)
        may repeat blocks some context computed before.  The block holding
        position ``num_computed`` (partial: computed up to it) is replaced by
        the cached full block when that block's hash matches -- its tokens,
        and the whole prefix before them, are equal.  Returns the tokens now
        covered (at least one is always left to compute)."""
        if not self.prefix_caching or any(b < 0 for b in table.blocks):
            return num_computed
        bs = self.block_size
        i = start = num_computed // bs
        if len(table.hashes) < i:  # the leading full blocks are not all sealed: no chain to continue
            return num_computed
        parent = table.hashes[i - 1] if i else table.root
        while i < (len(token_ids) - 1) // bs:
            h = chain_hash(self.hash_key, parent, token_ids[i * bs:(i + 1) * bs])
            bid = self.by_hash.get(h)
            if bid is None:
                break
            self.incref(bid)
            if i < len(table.blocks):
                self.decref(table.blocks[i])  # its own partial (or shared copy-on-write) block
                table.blocks[i] = bid
            else:
                table.blocks.append(bid)
            del table.hashes[i:]
            table.hashes.append(h)
            parent, i = h, i + 1
        if i == start:
            return num_computed
        self.stats["prefix_hit_blocks"] += i - start
        table.hits += max(0, i * bs - max(num_computed, table.high))
        table.high = max(table.high, i * bs)
        return i * bs

    def blocks_needed(self, table: BlockTable, start: int, end: int) -> int:
        """Blocks an append of positions [start, end) would allocate, counting
        a copy-on-write of a shared partial block."""
        need = max(0, self.blocks_for(end) - len(table.blocks))
        if start % self.block_size and start < end:
            bid = table.blocks[start // self.block_size]
            if self.blocks[bid].ref_count > 1:
                need += 1
        return need

    def prepare_append(self, table: BlockTable, start: int, end: int) -> List[Tuple[int, int]]:
        """Make positions [start, end) writable: allocate the blocks they need
        and copy a shared partial block first (copy-on-write).  Returns the
        (src, dst) block copies the model runner must do before writing KV.
        Raises :class:`OutOfBlocks` without changing anything if it can't."""
        if self.blocks_needed(table, start, end) > self.num_free:
            raise OutOfBlocks()
        copies: List[Tuple[int, int]] = []
        if start % self.block_size and start < end:
            idx = start // self.block_size
            old = table.blocks[idx]
            if self.blocks[old].ref_count > 1:
                new = self.allocate()
                self.decref(old)
                table.blocks[idx] = new
                copies.append((old, new))
                self.stats["cow_copies"] += 1
        while len(table.blocks) < self.blocks_for(end):
            table.blocks.append(self.allocate())
        return copies

    def seal_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register every full, computed block not yet hashed, so later
        contexts with the same prefix can reuse it."""
        table.high = max(table.high, num_computed)
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(table.hashes) < num_computed // bs:
            i = len(table.hashes)
            h = chain_hash(self.hash_key, table.hashes[-1] if table.hashes else table.root,
                           token_ids[i * bs:(i + 1) * bs])
            table.hashes.append(h)
            blk = self.blocks[table.blocks[i]]
            if blk.hash is None and h not in self.by_hash:
                blk.hash = h
                self.by_hash[h] = blk.id

    # --------------------------------------------------------------- checking
    def check_invariants(self, tables: Iterable[BlockTable] = ()) -> None:
        """Assert the state described in the module docstring.  ``tables``
        are the block tables of all live contexts; ref counts must equal the
        number of times each block appears in them."""
        free = set(self.free)
        evictable = set(self.evictable)
        assert len(free) == len(self.free), "duplicate block in free list"
        assert not (free & evictable), "block both free and cached"
        refs = [0] * self.num_blocks
        for t in tables:
            assert len(t.hashes) <= len(t.blocks)
            for bid in t.blocks:
                if bid >= 0:  # negative: swapped out to the host pool
                    refs[bid] += 1
        for blk in self.blocks:
            assert blk.ref_count == refs[blk.id], (
                f"block {blk.id}: ref_count {blk.ref_count} but {refs[blk.id]} table references")
            if blk.ref_count == 0:
                if blk.hash is None:
                    assert blk.id in free, f"unreferenced, unhashed block {blk.id} not free"
                else:
                    assert blk.id in evictable, f"unreferenced hashed block {blk.id} not cached"
            else:
                assert blk.id not in free and blk.id not in evictable, f"owned block {blk.id} listed free"
            if blk.hash is not None:
                assert self.by_hash.get(blk.hash) == blk.id, f"hash index wrong for block {blk.id}"
        assert len(self.by_hash) == sum(b.hash is not None for b in self.blocks)
