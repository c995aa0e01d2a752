"""A fixed pool of KV blocks with reference counts, an ordered free list and a prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from tokendance.kv.hashing import BlockHash


class BlockPool:
    """Blocks 0..num_blocks-1.

    Invariants: ref_counts[b] == number of holders of block b; b is in the free queue iff
    ref_counts[b] == 0; num_free + num_used == num_blocks. Freed blocks keep their hash (they stay
    prefix-cache hits) and join the queue's tail, so the head is the least recently freed: taking
    from the head is LRU eviction, and both ends are O(1).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.min_free = num_blocks  # low-water mark of num_free since reset_watermark()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def reset_watermark(self) -> None:
        self.min_free = len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def find_cached(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue (evicting their cache entries)."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._uncache(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        self.min_free = min(self.min_free, len(self._free))
        return block_ids

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block (a prefix-cache hit or a share)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
                self.min_free = min(self.min_free, len(self._free))
            self.ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop a holder from each block; blocks nobody holds go to the free queue's tail in the
        order given (pass a request's table reversed so its tail blocks are evicted first)."""
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            assert count > 0, f"block {block_id} released more often than held"
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def set_hash(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that a full block holds the tokens named by `block_hash`. A hash already cached
        keeps its first block (the duplicate stays an ordinary block)."""
        if self.block_hashes[block_id] is not None or block_hash in self._cached:
            return
        self.block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id

    def _uncache(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hashes[block_id] = None
