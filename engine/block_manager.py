"""The paged KV cache's block allocator, with prefix caching.

Blocks hold ``block_size`` tokens of KV. A full block whose KV is computed is registered
under a chained hash of its tokens (``blake2b(previous hash || token bytes)``, the chain's
root folding in the request's ``cache_salt``), so a later request with the same prefix
reuses it; a hit is verified against the stored token ids. Freed blocks keep their hash
and are reused least recently freed first (a request's blocks are freed tail first, so a
prefix's head outlives its tail).

A model whose every layer has a sliding window never reads a key again once it is a window
behind the next query: ``release_before`` gives such leading blocks back while the sequence
runs. Their block-table entries become ``FREED_BLOCK``, so the table keeps its length and
``block_table[position // block_size]`` stays the block of every position still held.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq

import numpy as np

from kvlayer.engine.sequence import Sequence

FREED_BLOCK = -1
"""The block-table entry of a block its sequence released (out of every window's reach). Never
a block id: attention gathers only the blocks its window reaches (``index_select`` would refuse
it), and the connector skips saves that would read one (it sees a negative id)."""


def block_hash(prev: bytes, token_ids: Seq[int]) -> bytes:
    """The chained hash of one full block (deterministic across processes)."""
    return hashlib.blake2b(prev + np.asarray(token_ids, dtype="<i4").tobytes(), digest_size=16).digest()


def root_hash(cache_salt: str | None) -> bytes:
    return hashlib.blake2b(b"kvlayer.engine\0" + (cache_salt or "").encode(), digest_size=16).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Allocates blocks to sequences; ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s leading full blocks (no references taken).

        At most ``(num_tokens - 1) // block_size`` blocks, so at least one token is left to
        compute (the engine needs its logits).
        """
        if not self.enable_prefix_caching:
            return []
        bs, tokens = self.block_size, seq.token_ids
        prev, out = root_hash(seq.cache_salt), []
        for i in range((len(tokens) - 1) // bs):
            chunk = tokens[i * bs : (i + 1) * bs]
            h = block_hash(prev, chunk)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(chunk):
                break
            out.append(bid)
            prev = h
        return out

    def can_allocate(self, hits: list[int], num_new_blocks: int) -> bool:
        """Whether taking ``hits`` and ``num_new_blocks`` fresh blocks fits the free pool."""
        hits_in_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return num_new_blocks <= len(self.free) - hits_in_free

    def take_hits(self, seq: Sequence, hits: list[int]) -> None:
        """Give ``seq`` (which holds no blocks) the cached blocks ``hits``."""
        assert not seq.block_table
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = self.blocks[hits[-1]].hash if hits else None
        self.num_hits += len(hits)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Extend ``seq``'s block table to hold ``num_tokens`` tokens; False if blocks ran out."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            bid, _ = self.free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None and self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.token_ids, block.ref_count = None, (), 1
            seq.block_table.append(bid)
        return True

    def commit(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks that are full and computed in the prefix cache (not those
        before ``seq.partial_kv_before``, which hold some layers' KV only)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        prev = seq.last_block_hash or root_hash(seq.cache_salt)
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // bs):
            chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(prev, chunk)
            # released unhashed (after a failed load), or some layers' KV only: chain on
            if seq.block_table[i] != FREED_BLOCK and i * bs >= seq.partial_kv_before:
                block = self.blocks[seq.block_table[i]]
                block.hash, block.token_ids = h, chunk
                self.cached.setdefault(h, block.block_id)
            prev = h
            seq.num_hashed_blocks = i + 1
            seq.last_block_hash = h

    def uncommit_from(self, seq: Sequence, num_valid_tokens: int) -> None:
        """Forget hashes of ``seq``'s blocks past ``num_valid_tokens`` (their KV is not valid)."""
        keep = num_valid_tokens // self.block_size
        if seq.num_hashed_blocks > keep:
            # a rollback never reaches released blocks: only a step's new tokens are rolled back
            assert keep >= seq.num_freed_blocks, "rolled back into released blocks"
            for bid in seq.block_table[keep : seq.num_hashed_blocks]:
                block = self.blocks[bid]
                if block.hash is not None and self.cached.get(block.hash) == bid:
                    del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
            seq.num_hashed_blocks = keep
            seq.last_block_hash = self.blocks[seq.block_table[keep - 1]].hash if keep else None

    def release_before(self, seq: Sequence, position: int) -> None:
        """Give back ``seq``'s blocks that hold only positions below ``position`` (no attention
        reads them again); their entries become ``FREED_BLOCK``. They keep their hashes, like
        blocks of a finished sequence, so later requests still hit them."""
        end = min(position // self.block_size, len(seq.block_table))
        for i in range(seq.num_freed_blocks, end):
            self._drop(seq.block_table[i])
            seq.block_table[i] = FREED_BLOCK
        seq.num_freed_blocks = max(seq.num_freed_blocks, end)

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first; blocks keep their hashes for later hits."""
        for bid in reversed(seq.block_table[seq.num_freed_blocks :]):
            self._drop(bid)
        seq.block_table = []
        seq.num_freed_blocks = 0
        seq.num_hashed_blocks = 0
        seq.last_block_hash = None

    def forget_sole_blocks(self, seq: Sequence) -> list[int]:
        """The ids of ``seq``'s blocks no other sequence holds, their hashes forgotten (their KV
        is not to be hit again); the caller zeroes their KV before it frees them."""
        ids = [bid for bid in seq.block_table[seq.num_freed_blocks :] if self.blocks[bid].ref_count == 1]
        for bid in ids:
            block = self.blocks[bid]
            if block.hash is not None and self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        return ids

    def _drop(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[bid] = None

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds (not in the free pool)."""
        return len(self.blocks) - len(self.free)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their KV)."""
        self.cached.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
