"""Block pool and KV cache manager: exact block ids, prefix hits, copy-on-write, and property tests
of the invariants under random operation sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokendance.kv.block_pool import BlockPool
from tokendance.kv.hashing import extend_block_hashes, root_hash
from tokendance.kv.manager import KVCacheManager


def check_invariants(pool: BlockPool) -> None:
    held = {b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0}
    free = {b for b in range(pool.num_blocks) if pool.is_free(b)}
    assert all(count >= 0 for count in pool.ref_counts)
    assert not held & free, "a block is both free and held"
    assert len(held) + len(free) == pool.num_blocks
    assert pool.num_free + pool.num_used == pool.num_blocks
    for block_id, block_hash in enumerate(pool.block_hashes):  # every hash recorded is findable
        if block_hash is not None:
            assert pool.find_cached(block_hash) == block_id


def test_free_queue_order_is_eviction_order():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1]
    pool.set_hash(0, b"h0")
    pool.release(reversed(a))  # tail block first: 1 then 0
    assert pool.allocate(2) == [2, 3]  # untouched blocks come first
    assert pool.find_cached(b"h0") == 0
    assert pool.allocate(1) == [1]  # then the least recently freed
    assert pool.allocate(1) == [0]  # evicting block 0 drops its cache entry
    assert pool.find_cached(b"h0") is None
    check_invariants(pool)


def test_hashes_are_chained_and_namespaced():
    tokens = list(range(10))
    a, b, c = [], [], []
    extend_block_hashes(a, tokens, 4, "tenant-a")
    extend_block_hashes(b, tokens, 4, "tenant-b")
    extend_block_hashes(c, [99] + tokens[1:], 4, "tenant-a")
    assert len(a) == 2  # only full blocks
    assert a[0] != b[0] and a[1] != b[1]
    assert a[0] != c[0] and a[1] != c[1]  # a change in block 0 changes every later hash
    assert root_hash("x") != root_hash("y")


def test_manager_prefix_hit_and_exact_block_ids():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots("a", 10, 0) == []
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.get_slots("a") == list(range(10))
    kv.register_computed_blocks("a", prompt, 10, "")
    hit = kv.find_prefix_hit(prompt + [50, 51], "")
    assert hit.block_ids == [0, 1] and hit.num_tokens(4) == 8
    assert kv.find_prefix_hit(prompt, "other").block_ids == []
    assert kv.allocate_slots("b", 12, 8, hit) == []
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    kv.free("a")
    kv.free("b")
    assert kv.pool.num_free == 8
    check_invariants(kv.pool)


def test_copy_on_write_when_the_whole_prompt_is_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    kv.allocate_slots("a", 8, 0)
    kv.register_computed_blocks("a", prompt, 8, "")
    hit = kv.find_prefix_hit(prompt, "")
    assert hit.block_ids == [0, 1]
    # b reuses both blocks but must recompute token 7, which lives in shared block 1
    copies = kv.allocate_slots("b", 8, 7, hit)
    assert copies == [(1, 2)]
    assert kv.get_block_ids("b") == [0, 2]
    assert kv.get_slots("b")[4:8] == [8, 9, 10, 11]
    assert kv.get_block_ids("a") == [0, 1]
    check_invariants(kv.pool)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", 8, 0)
    before = (list(kv.pool.ref_counts), kv.pool.num_free)
    assert kv.allocate_slots("b", 9, 0) is None
    assert not kv.can_allocate("b", 9, 0)
    assert (list(kv.pool.ref_counts), kv.pool.num_free) == before
    assert not kv.has("b")


operations = st.lists(
    st.tuples(
        st.sampled_from(["new", "grow", "free", "register"]),
        st.integers(0, 5),  # request index
        st.integers(1, 40),  # token count
        st.integers(0, 3),  # prompt family: shared prefixes make hits likely
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(2, 12), st.sampled_from([1, 2, 4]))
def test_random_operations_keep_pool_invariants(ops, num_blocks, block_size):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    tokens: dict[str, list[int]] = {}
    for op, index, count, family in ops:
        request_id = f"r{index}"
        if op == "new" and request_id not in tokens:
            prompt = [family] * 6 + list(range(count))
            hit = kv.find_prefix_hit(prompt, "")
            computed = min(hit.num_tokens(block_size), len(prompt) - 1)
            if kv.allocate_slots(request_id, len(prompt), computed, hit) is not None:
                tokens[request_id] = prompt
        elif op == "grow" and request_id in tokens:
            prompt = tokens[request_id]
            if kv.allocate_slots(request_id, len(prompt) + count, len(prompt)) is not None:
                prompt.extend(range(100, 100 + count))
        elif op == "register" and request_id in tokens:
            kv.register_computed_blocks(request_id, tokens[request_id], len(tokens[request_id]), "")
        elif op == "free" and request_id in tokens:
            kv.free(request_id)
            del tokens[request_id]
        check_invariants(kv.pool)
        for rid, held in kv.tables.items():
            assert len(kv.get_slots(rid)) + len(held.spare) == len(held.block_ids) * block_size
    held_total = sum(len(r.block_ids) for r in kv.tables.values())
    assert sum(kv.pool.ref_counts) == held_total  # ref_count == number of holders
    for request_id in list(tokens):
        kv.free(request_id)
    assert kv.pool.num_free == num_blocks
    assert all(count == 0 for count in kv.pool.ref_counts)


shared_operations = st.lists(
    st.tuples(
        st.sampled_from(["plain", "mirror", "truncate", "free", "rename"]),
        st.integers(0, 4),  # table index
        st.integers(0, 4),  # source table index (mirror)
        st.integers(1, 30),  # token count
    ),
    max_size=50,
)


@settings(max_examples=150, deadline=None)
@given(shared_operations, st.integers(4, 16), st.sampled_from([1, 4]))
def test_tables_sharing_slots_keep_pool_invariants(ops, num_blocks, block_size):
    """Mirrors point at other tables' slots; ending any table never frees a block another holds."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
    for op, index, source, count in ops:
        table, other = f"t{index}", f"t{source}"
        if op == "plain" and not kv.has(table):
            kv.allocate_slots(table, count, 0)
        elif op == "mirror" and not kv.has(table) and kv.has(other) and table != other:
            kv.create_table(table)
            kv.append_shared_slots(table, kv.get_slots(other)[:count])
            if kv.append_private_slots(table, count % 5) is None:
                assert kv.pool.num_free < kv.num_blocks_needed(count % 5)
        elif op == "truncate" and kv.has(table):
            kv.truncate(table, count)
        elif op == "rename" and kv.has(table) and not kv.has(f"{table}r"):
            kv.rename(table, f"{table}r")
        elif op == "free":
            kv.free(table)
        check_invariants(kv.pool)
        holders = [b for r in kv.tables.values() for b in r.block_ids]
        assert sorted(holders) == sorted(b for b in range(num_blocks) for _ in range(kv.pool.ref_counts[b]))
        for rid, held in kv.tables.items():
            assert len(set(held.block_ids)) == len(held.block_ids)  # one reference per table
            assert {s // block_size for s in kv.get_slots(rid)} <= set(held.block_ids)
    for table in list(kv.tables):
        kv.free(table)
    assert kv.pool.num_free == num_blocks
