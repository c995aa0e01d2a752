"""Block tables over one `BlockPool`: allocation, prefix-cache hits, copy-on-write, tables that
point at blocks other tables own (agent sessions, master/mirror sharing), and kept tables.

A table is named by a `TableId`: a request id (str) while a request runs, or a typed key for KV
kept outside requests (`SessionKey`, `RecallKey`, `ScratchKey`, `MasterKey`). Kept tables are pinned or
unpinned; when an allocation does not fit, the manager evicts unpinned kept tables itself, least
recently kept first, before it reports failure. Nobody is called back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from tokendance.kv.block_pool import BlockPool
from tokendance.kv.hashing import BlockHash, extend_block_hashes


@dataclass(frozen=True)
class SessionKey:
    """An agent's KV kept between rounds (its prompt and output so far)."""

    agent_id: str


@dataclass(frozen=True)
class RecallKey:
    """Segments of an agent's previous prompt, held while a round prefill copies them."""

    agent_id: str


@dataclass(frozen=True)
class ScratchKey:
    """Throw-away KV of a round prefill's check pass."""

    index: int


@dataclass(frozen=True)
class MasterKey:
    """The slots of a round's masters, held while its prefill runs (see `reuse.round_kv`)."""


TableId = Hashable  # a request id (str), or one of the keys above


@dataclass
class RequestKV:
    """One table: which physical slot holds each token's KV.

    `slots[i]` is the slot of token i (slot = block_id * block_size + offset). Positions and slots
    are decoupled: a table may point at slots of blocks that other tables hold, written for other
    positions (keys are rotated to the reader's position when read). `block_ids` are the blocks
    this table holds one reference on; `spare` are slots of its private blocks not yet used.
    A table is `regular` while token i sits at offset i % block_size of block_ids[i // block_size]
    (plain requests); only regular tables take part in prefix caching.
    """

    block_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    spare: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the request's full blocks
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    regular: bool = True


@dataclass(frozen=True)
class PrefixHit:
    """Result of a side-effect-free prefix-cache lookup."""

    block_ids: list[int]
    block_hashes: list[BlockHash]  # hashes of all full blocks of the looked-up tokens

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


NO_HIT = PrefixHit([], [])

BlockCopy = tuple[int, int]  # (source block, destination block): copy the KV before the step runs


@dataclass(frozen=True)
class ComputedKV:
    """What a waiting request finds already computed (side-effect-free query): a prefix-cache hit,
    or a table a round prefill prepared under its id. `num_cached` is what its usage reports."""

    hit: PrefixHit
    num_tokens: int
    num_cached: int

    def cut(self, num_tokens: int, block_size: int) -> ComputedKV:
        """Only the first `num_tokens` of a prefix-cache hit (a prepared table is never cut)."""
        if self.hit is NO_HIT and self.num_tokens:
            raise ValueError("a prepared table cannot be cut")
        blocks = -(-num_tokens // block_size)
        hit = PrefixHit(self.hit.block_ids[:blocks], self.hit.block_hashes) if blocks else NO_HIT
        return ComputedKV(hit, num_tokens, min(self.num_cached, num_tokens))


@dataclass
class KeptTable:
    pinned: bool
    payload: object = None  # what the keeper stores with it (e.g. a session's token ids)


class KVCacheManager:
    """Owns the block tables. Queries (`find_*`, `can_allocate`) change nothing; `allocate_slots`
    either commits a whole allocation or changes nothing (but for evicting unpinned kept tables,
    which it may do to make room)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.tables: dict[TableId, RequestKV] = {}
        self.kept: OrderedDict[TableId, KeptTable] = OrderedDict()  # least recently kept first
        self.prepared: dict[TableId, tuple[int, int]] = {}  # table -> (num_tokens, num_cached)
        self.num_evictions = 0

    # ------------------------------------------------------------ lookups

    def find_computed(self, request_id: str, token_ids: Sequence[int], namespace: str) -> ComputedKV:
        """Tokens of a waiting request whose KV exists: its prepared table, else prefix-cache hits.
        A fully cached prompt still computes its last token (for the next-token logits)."""
        if request_id in self.prepared:
            num_tokens, num_cached = self.prepared[request_id]
            return ComputedKV(NO_HIT, num_tokens, num_cached)
        hit = self.find_prefix_hit(token_ids, namespace)
        num_tokens = min(hit.num_tokens(self.block_size), len(token_ids) - 1)
        return ComputedKV(hit, num_tokens, num_tokens)

    def mark_prepared(self, request_id: str, num_tokens: int, num_cached: int) -> None:
        """The table `request_id` holds the KV of the request's first `num_tokens` tokens, before
        the request is scheduled (a round prefill); the scheduler finds it with `find_computed`."""
        self.prepared[request_id] = (num_tokens, num_cached)

    def drop_prepared(self, request_ids: Iterable[str]) -> int:
        """Free the prepared tables of these (waiting) requests; they will be computed like any
        preempted request. Returns how many were dropped."""
        dropped = [r for r in request_ids if r in self.prepared]
        for request_id in dropped:
            self.free(request_id)
        return len(dropped)

    def offer_exact_prefix(self, table_id: TableId, num_cacheable_tokens: int, token_ids, namespace: str) -> None:
        """Mark the table irregular and offer only its first `num_cacheable_tokens` (exact KV) to
        the prefix cache, never the rest (e.g. blended, position-corrected copies, master slots)."""
        kv = self.tables[table_id]
        kv.regular = False
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        in_order = 0  # leading full blocks whose tokens sit in token order in one block each
        while in_order < num_cacheable_tokens // size:
            slots = kv.slots[in_order * size:(in_order + 1) * size]
            if slots[0] % size or slots != list(range(slots[0], slots[0] + size)):
                break
            in_order += 1
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, token_ids[: in_order * size], size, namespace)
        for index, block_hash in enumerate(hashes):
            self.pool.set_hash(kv.slots[index * size] // size, block_hash)

    def find_prefix_hit(self, token_ids: Sequence[int], namespace: str) -> PrefixHit:
        if not self.enable_prefix_caching:
            return NO_HIT
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, token_ids, self.block_size, namespace)
        return PrefixHit(self.cached_blocks(hashes), hashes)

    def cached_blocks(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the leading `hashes` (a prefix's block hashes), up to the first miss."""
        block_ids = []
        for block_hash in hashes:
            block_id = self.pool.find_cached(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def has(self, table_id: TableId) -> bool:
        return table_id in self.tables

    def get_slots(self, table_id: TableId) -> list[int]:
        return self.tables[table_id].slots

    def get_block_ids(self, table_id: TableId) -> list[int]:
        return self.tables[table_id].block_ids

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_of(self, slot: int) -> int:
        return slot // self.block_size

    # ------------------------------------------------------------ allocation

    def _plan(
        self, request_id: str, num_tokens: int, num_computed_tokens: int, hit: PrefixHit
    ) -> tuple[int, bool]:
        """(free blocks this allocation consumes, whether the first written block needs a copy)."""
        kv = self.tables.get(request_id)
        if kv is None:
            have = len(hit.block_ids) * self.block_size
            num_free_hits = sum(1 for b in hit.block_ids if self.pool.ref_counts[b] == 0)
        else:
            have = len(kv.slots) + len(kv.spare)
            num_free_hits = 0
        needs_copy = self._written_block_is_shared(kv, hit, num_computed_tokens)
        new_blocks = self.num_blocks_needed(max(0, num_tokens - have))
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
        block copies to run before the step (copy-on-write), or None if the pool is too small even
        after evicting every unpinned kept table (nothing else changed)."""
        needed, needs_copy = self._plan(request_id, num_tokens, num_computed_tokens, hit)
        while needed > self.pool.num_free:
            if not self._evict_one():
                return None
            needed, needs_copy = self._plan(request_id, num_tokens, num_computed_tokens, hit)
        self.prepared.pop(request_id, None)  # the scheduler took it over
        kv = self.tables.get(request_id)
        if kv is None:
            kv = self.tables[request_id] = RequestKV()
            self.pool.acquire(hit.block_ids)
            kv.block_ids.extend(hit.block_ids)
            kv.slots.extend(self._block_slots(hit.block_ids))
            kv.block_hashes = list(hit.block_hashes)
            kv.num_registered_blocks = len(hit.block_ids)
        copies = []
        if needs_copy:
            copies.append(self._copy_on_write(kv, num_computed_tokens // self.block_size))
        self._grow(kv, num_tokens)
        return copies

    def register_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, namespace: str
    ) -> None:
        """Offer the request's fully computed blocks to the prefix cache."""
        kv = self.tables[request_id]
        if not self.enable_prefix_caching or not kv.regular:
            return
        num_full = num_computed_tokens // self.block_size
        if num_full <= kv.num_registered_blocks:
            return
        extend_block_hashes(kv.block_hashes, token_ids[: num_full * self.block_size], self.block_size, namespace)
        for index in range(kv.num_registered_blocks, num_full):
            self.pool.set_hash(kv.block_ids[index], kv.block_hashes[index])
        kv.num_registered_blocks = num_full

    def free(self, table_id: TableId) -> None:
        kv = self.tables.pop(table_id, None)
        self.kept.pop(table_id, None)
        self.prepared.pop(table_id, None)
        if kv is not None:
            self.pool.release(reversed(kv.block_ids))

    # ------------------------------------------------------------ kept tables

    def keep(self, table_id: TableId, key: TableId | None = None, payload=None, pinned: bool = False) -> None:
        """Keep a table outside any request (renamed to `key` if given), as the most recently kept.
        Unpinned kept tables are evicted, least recently kept first, when an allocation needs room."""
        if key is not None and key != table_id:
            self.rename(table_id, key)
            table_id = key
        if table_id not in self.tables:
            raise KeyError(f"no table {table_id!r}")
        self.kept.pop(table_id, None)
        self.kept[table_id] = KeptTable(pinned, payload)

    def unkeep(self, table_id: TableId, new_id: TableId | None = None):
        """Take a kept table back (renamed to `new_id` if given): it is an ordinary table again,
        never evicted. Returns its payload, or None if it is not kept (e.g. it was evicted)."""
        kept = self.kept.pop(table_id, None)
        if kept is None:
            return None
        if new_id is not None:
            self.rename(table_id, new_id)
        return kept.payload

    def find_kept(self, kind: type) -> dict[TableId, object]:
        """Kept tables whose id is of type `kind` (e.g. SessionKey), with their payloads."""
        return {table_id: k.payload for table_id, k in self.kept.items() if isinstance(table_id, kind)}

    def _evict_one(self) -> bool:
        victim = next((table_id for table_id, k in self.kept.items() if not k.pinned), None)
        if victim is None:
            return False
        self.free(victim)
        self.num_evictions += 1
        return True

    # ------------------------------------------------------------ shared tables

    def create_table(self, table_id: TableId) -> None:
        if table_id in self.tables:
            raise KeyError(f"table {table_id!r} exists")
        self.tables[table_id] = RequestKV(regular=False)

    def append_shared_slots(self, table_id: TableId, slots: Sequence[int]) -> None:
        """Point the next tokens of a table at slots of blocks held elsewhere (a mirror of a master);
        the table takes one reference on each block it did not hold yet."""
        kv = self.tables[table_id]
        kv.regular = False
        held = set(kv.block_ids)
        for slot in slots:
            block_id = slot // self.block_size
            if block_id not in held:
                held.add(block_id)
                kv.block_ids.append(block_id)
                self.pool.acquire([block_id])
        kv.slots.extend(slots)

    def append_private_slots(self, table_id: TableId, count: int) -> list[int] | None:
        """Give the next `count` tokens fresh slots in the table's own blocks (None if the pool is
        too small even after evicting every unpinned kept table; nothing else changed)."""
        kv = self.tables[table_id]
        missing = self.num_blocks_needed(max(0, count - len(kv.spare)))
        while missing > self.pool.num_free:
            if not self._evict_one():
                return None
        kv.regular = False
        start = len(kv.slots)
        self._grow(kv, start + count)
        return kv.slots[start:]

    def truncate(self, table_id: TableId, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens; release blocks nothing kept points at."""
        kv = self.tables[table_id]
        if num_tokens >= len(kv.slots):
            return
        kv.slots = kv.slots[:num_tokens]
        kv.spare = []
        kv.regular = False  # a partial last block no longer follows token order
        kv.block_hashes = kv.block_hashes[: num_tokens // self.block_size]
        kv.num_registered_blocks = min(kv.num_registered_blocks, len(kv.block_hashes))
        needed = {slot // self.block_size for slot in kv.slots}
        dropped = [b for b in kv.block_ids if b not in needed]
        kv.block_ids = [b for b in kv.block_ids if b in needed]
        self.pool.release(reversed(dropped))

    def rename(self, table_id: TableId, new_id: TableId) -> None:
        if new_id in self.tables:
            raise KeyError(f"table {new_id!r} exists")
        self.tables[new_id] = self.tables.pop(table_id)
        if table_id in self.kept:
            self.kept[new_id] = self.kept.pop(table_id)

    def held_blocks(self, table_ids: Iterable[TableId]) -> set[int]:
        return {b for t in table_ids for b in self.tables[t].block_ids}

    # ------------------------------------------------------------ internals

    def _grow(self, kv: RequestKV, num_tokens: int) -> None:
        need = num_tokens - len(kv.slots)
        if need <= 0:
            return
        missing = self.num_blocks_needed(max(0, need - len(kv.spare)))
        if missing:
            new_blocks = self.pool.allocate(missing)
            kv.block_ids.extend(new_blocks)
            kv.spare.extend(self._block_slots(new_blocks))
        kv.slots.extend(kv.spare[:need])
        del kv.spare[:need]

    def _block_slots(self, block_ids: Sequence[int]) -> list[int]:
        size = self.block_size
        return [s for b in block_ids for s in range(b * size, (b + 1) * size)]

    def _written_block_is_shared(
        self, kv: RequestKV | None, hit: PrefixHit, num_computed_tokens: int
    ) -> bool:
        if kv is not None and not kv.regular:
            return False  # irregular tables only ever write into their own fresh slots
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
