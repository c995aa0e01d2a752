"""Per-request block tables over one `BlockPool`: allocation, prefix-cache hits, copy-on-write."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokendance.kv.block_pool import BlockPool
from tokendance.kv.hashing import BlockHash, extend_block_hashes


@dataclass
class RequestKV:
    """One request's view of the pool.

    `slots[i]` is the physical slot of token i (slot = block_id * block_size + offset). Token
    positions and physical slots are decoupled on purpose: a table may point at slots of blocks
    that other requests hold at other positions.
    """

    block_ids: list[int] = field(default_factory=list)  # held blocks (one reference each)
    slots: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the request's full blocks
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache


@dataclass(frozen=True)
class PrefixHit:
    """Result of a side-effect-free prefix-cache lookup."""

    block_ids: list[int]
    block_hashes: list[BlockHash]  # hashes of all full blocks of the looked-up tokens

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


NO_HIT = PrefixHit([], [])

BlockCopy = tuple[int, int]  # (source block, destination block): copy the KV before the step runs


class KVCacheManager:
    """Owns the block tables. `find_prefix_hit` and `can_allocate` change nothing; `allocate_slots`
    either commits a whole allocation or changes nothing."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.requests: dict[str, RequestKV] = {}

    # ------------------------------------------------------------ lookups

    def find_prefix_hit(self, token_ids: Sequence[int], namespace: str) -> PrefixHit:
        if not self.enable_prefix_caching:
            return NO_HIT
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, token_ids, self.block_size, namespace)
        block_ids = []
        for block_hash in hashes:
            block_id = self.pool.find_cached(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixHit(block_ids, hashes)

    def get_slots(self, request_id: str) -> list[int]:
        return self.requests[request_id].slots

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.requests[request_id].block_ids

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ allocation

    def _plan(
        self, request_id: str, num_tokens: int, num_computed_tokens: int, hit: PrefixHit
    ) -> tuple[int, bool]:
        """(free blocks this allocation consumes, whether the first written block needs a copy)."""
        kv = self.requests.get(request_id)
        held = len(kv.block_ids) if kv else len(hit.block_ids)
        num_free_hits = sum(1 for b in hit.block_ids if self.pool.ref_counts[b] == 0) if not kv else 0
        needs_copy = self._written_block_is_shared(kv, hit, num_computed_tokens)
        new_blocks = max(0, self.num_blocks_needed(num_tokens) - held)
        return new_blocks + num_free_hits + int(needs_copy), needs_copy

    def can_allocate(
        self, request_id: str, num_tokens: int, num_computed_tokens: int, hit: PrefixHit = NO_HIT
    ) -> bool:
        needed, _ = self._plan(request_id, num_tokens, num_computed_tokens, hit)
        return needed <= self.pool.num_free

    def allocate_slots(
        self, request_id: str, num_tokens: int, num_computed_tokens: int, hit: PrefixHit = NO_HIT
    ) -> list[BlockCopy] | None:
        """Make tokens [0, num_tokens) of the request addressable, tokens from
        `num_computed_tokens` on writable. A new request first takes `hit`'s blocks. Returns the
        block copies to run before the step (copy-on-write), or None if the pool is too small
        (nothing changed)."""
        needed, needs_copy = self._plan(request_id, num_tokens, num_computed_tokens, hit)
        if needed > self.pool.num_free:
            return None
        kv = self.requests.get(request_id)
        if kv is None:
            kv = self.requests[request_id] = RequestKV()
            self.pool.acquire(hit.block_ids)
            self._append_blocks(kv, hit.block_ids)
            kv.block_hashes = list(hit.block_hashes)
            kv.num_registered_blocks = len(hit.block_ids)
        copies = []
        if needs_copy:
            copies.append(self._copy_on_write(kv, num_computed_tokens // self.block_size))
        missing = self.num_blocks_needed(num_tokens) - len(kv.block_ids)
        if missing > 0:
            self._append_blocks(kv, self.pool.allocate(missing))
        return copies

    def register_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, namespace: str
    ) -> None:
        """Offer the request's fully computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        kv = self.requests[request_id]
        num_full = num_computed_tokens // self.block_size
        if num_full <= kv.num_registered_blocks:
            return
        extend_block_hashes(kv.block_hashes, token_ids[: num_full * self.block_size], self.block_size, namespace)
        for index in range(kv.num_registered_blocks, num_full):
            self.pool.set_hash(kv.block_ids[index], kv.block_hashes[index])
        kv.num_registered_blocks = num_full

    def free(self, request_id: str) -> None:
        kv = self.requests.pop(request_id, None)
        if kv is not None:
            self.pool.release(reversed(kv.block_ids))

    # ------------------------------------------------------------ internals

    def _written_block_is_shared(
        self, kv: RequestKV | None, hit: PrefixHit, num_computed_tokens: int
    ) -> bool:
        index = num_computed_tokens // self.block_size
        block_ids = kv.block_ids if kv else hit.block_ids
        if index >= len(block_ids):
            return False
        holders = self.pool.ref_counts[block_ids[index]] + (0 if kv else 1)
        return holders > 1

    def _copy_on_write(self, kv: RequestKV, index: int) -> BlockCopy:
        (new_block,) = self.pool.allocate(1)
        old_block = kv.block_ids[index]
        self.pool.release([old_block])
        kv.block_ids[index] = new_block
        start = index * self.block_size
        for i in range(start, min(start + self.block_size, len(kv.slots))):
            kv.slots[i] = new_block * self.block_size + (i - start)
        kv.num_registered_blocks = min(kv.num_registered_blocks, index)
        return old_block, new_block

    def _append_blocks(self, kv: RequestKV, block_ids: Sequence[int]) -> None:
        size = self.block_size
        for block_id in block_ids:
            kv.block_ids.append(block_id)
            kv.slots.extend(range(block_id * size, (block_id + 1) * size))
