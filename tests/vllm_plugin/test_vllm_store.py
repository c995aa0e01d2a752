"""The session store (`store.py`): Master-Mirror storage of agents at rest on plain tensors, the
scheduler's index of it, and a round book claiming an evicted history back from it (no vLLM)."""

import math

import torch
from torch import nn

from tests.vllm_plugin.test_vllm_rounds import NL, Pool, run_round, salted_first_round
from tokendance.vllm_plugin.worker.store import SessionStore
from tokendance.vllm_plugin.scheduler.store_index import StoreIndex
from tokendance.vllm_plugin.worker.mirror_pass import KeyRotator

LAYERS, HEADS, DIM = 3, 2, 16


class Rope(nn.Module):
    """A neox RoPE table as vLLM's rotary modules hold it (cos | sin per position)."""

    is_neox_style = True
    rotary_dim = DIM

    def __init__(self, positions: int = 256, base: float = 10000.0):
        super().__init__()
        inv = 1.0 / base ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)
        angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=-1).float()


ROTATE = KeyRotator(Rope())


def kv(length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(length, HEADS, DIM, generator=g).bfloat16(), torch.randn(length, HEADS, DIM, generator=g).bfloat16())
            for _ in range(LAYERS)]


def test_a_mirror_is_stored_as_its_masters_piece_plus_the_rows_that_differ_and_read_back_bit_for_bit():
    """Agent A holds piece P at 10..30; agent B holds it at 40..60, copied from A with keys
    re-rotated, except rows it recomputed (2 in every layer, 5 more in layer 0: a check layer).
    B's entry keeps its own rows and those diff rows only; both read back exactly as held; the
    master goes when the last entry reading it does."""
    store = SessionStore(LAYERS, ROTATE)
    a = kv(64, seed=0)
    assert store.save("A", lambda i: a[i], 64, [(b"P", 10, 30), (b"a-own", 0, 10)]) > 0
    b = kv(80, seed=1)
    recomputed = {0: [0, 1, 2, 3, 4, 5, 13], 1: [0, 13], 2: [0, 13]}
    for layer, (keys, values) in enumerate(b):
        keys[40:60] = ROTATE(a[layer][0][10:30], torch.arange(10, 30), torch.arange(40, 60))
        values[40:60] = a[layer][1][10:30]
        for row in recomputed[layer]:
            keys[40 + row] += 1
    added = store.save("B", lambda i: b[i], 80, [(b"P", 40, 60)])
    session = store.sessions["B"]
    assert sorted(map(tuple, session.diff_index.tolist())) == sorted((40 + r, i) for i in range(LAYERS) for r in recomputed[i])
    assert session.own_positions.tolist() == list(range(0, 40)) + list(range(60, 80))
    row_bytes = 2 * HEADS * DIM * 2  # K and V, bf16
    assert added == session.nbytes == (LAYERS * 60 + sum(map(len, recomputed.values()))) * row_bytes
    for name, held, length in (("A", a, 64), ("B", b, 80)):
        keys, values = store.rows(name, 0, length)
        for layer in range(LAYERS):
            assert torch.equal(keys[:, layer], held[layer][0]) and torch.equal(values[:, layer], held[layer][1])
        keys, _ = store.rows(name, 5, 45)  # any range
        assert torch.equal(keys[:, 1], held[1][0][5:45])
    assert len(store.masters) == 2
    store.drop("A")
    assert b"P" in store.masters and b"a-own" not in store.masters  # B still reads P
    assert torch.equal(store.rows("B", 0, 80)[0][:, 2], b[2][0])
    store.drop("B")
    assert store.nbytes == 0 and not store.masters


def test_a_piece_captured_from_its_master_leaves_mirrors_only_the_rows_they_recomputed():
    """The master's piece captured as the pass reads it: a mirror saved before the master differs
    from it only in its recomputed rows (from another mirror it would differ everywhere: a second
    re-rotation rounds differently); the master's own save reads it whole; a captured piece no
    entry reads goes when its round closes."""
    store = SessionStore(LAYERS, ROTATE)
    master = kv(40, seed=5)
    store.capture(b"P", lambda i: (master[i][0][10:30], master[i][1][10:30]), 10, 30, round_serial=1)
    store.capture(b"Q", lambda i: (master[i][0][30:40], master[i][1][30:40]), 30, 40, round_serial=1)
    mirrors = {}
    for agent, at in (("m1", 50), ("m2", 70)):
        held = kv(100, seed=at)
        for layer, (keys, values) in enumerate(held):
            keys[at:at + 20] = ROTATE(master[layer][0][10:30], torch.arange(10, 30), torch.arange(at, at + 20))
            values[at:at + 20] = master[layer][1][10:30]
            keys[at] += 1  # its first token recomputed
        mirrors[agent] = held
        store.save(agent, lambda i, held=held: held[i], 100, [(b"P", at, at + 20)])
        assert store.sessions[agent].diff_index[:, 0].unique().tolist() == [at]
    store.save("master", lambda i: master[i], 40, [(b"P", 10, 30)])
    assert len(store.sessions["master"].diff_index) == 0 and store.masters[b"P"].holders == 3
    store.close_round(1)
    assert set(store.masters) == {b"P"}  # Q: captured, read by no entry
    store.capture(b"R", lambda i: (master[i][0][:5], master[i][1][:5]), 0, 5, round_serial=1)
    assert b"R" not in store.masters  # a pass that ended after its round closed keeps nothing
    for agent, held in mirrors.items():
        assert torch.equal(store.rows(agent, 0, 100)[0][:, 2], held[2][0])


def test_a_piece_read_back_at_new_positions_is_rotated_once_and_saved_again_differs_only_where_recomputed():
    """A mirror holds captured piece P at 50..70 (one recomputed row). Its next request holds P at
    90..110, read back from the store: each row rotated once from where it was computed (the
    master's rows from the master's positions, the recomputed row from the mirror's), so saved
    again it differs from the master in that row only. Rotating the stored rows a second time, from
    50..70, rounds differently in rows no one recomputed."""
    store = SessionStore(LAYERS, ROTATE)
    master = kv(30, seed=7)
    store.capture(b"P", lambda i: (master[i][0][10:30], master[i][1][10:30]), 10, 30, round_serial=1)
    held = kv(80, seed=8)
    for layer, (keys, values) in enumerate(held):
        keys[50:70] = ROTATE(master[layer][0][10:30], torch.arange(10, 30), torch.arange(50, 70))
        values[50:70] = master[layer][1][10:30]
        keys[50] += 1  # recomputed
    store.save("m", lambda i: held[i], 80, [(b"P", 50, 70)])
    keys, values = store.rows("m", 50, 70, at=torch.arange(90, 110))
    assert torch.equal(keys[1:], store._moved(store.masters[b"P"], slice(1, 20), torch.arange(91, 110)))
    assert torch.equal(keys[0, 0], ROTATE(held[0][0][50:51], torch.tensor([50]), torch.tensor([90]))[0])
    assert torch.equal(store.rows("m", 50, 70, at=torch.arange(50, 70))[0], store.rows("m", 50, 70)[0])
    before = kv(90, seed=9)
    after = [(torch.cat([before[i][0], keys[:, i]]), torch.cat([before[i][1], values[:, i]])) for i in range(LAYERS)]
    store.save("m2", lambda i: after[i], 110, [(b"P", 90, 110)])
    assert store.sessions["m2"].diff_index[:, 0].unique().tolist() == [90]
    twice = ROTATE(store.rows("m", 50, 70)[0][:, 1], torch.arange(50, 70), torch.arange(90, 110))
    assert not torch.equal(twice[1:], keys[1:, 1])  # the old way: a second rounding


def test_the_store_is_smaller_than_dense_as_more_agents_share_a_piece():
    """N agents each holding one shared piece (copied, a few rows recomputed) and a private run:
    the store holds one master, so bytes per agent fall toward the private run plus the diffs."""
    shared, private, changed = 200, 40, 10
    sizes = {}
    for n in (2, 8, 32):
        store = SessionStore(LAYERS, ROTATE)
        master = kv(shared, seed=99)
        for agent in range(n):
            held = kv(private + shared, seed=agent)
            for layer, (keys, values) in enumerate(held):
                keys[private:] = ROTATE(master[layer][0], torch.arange(shared), torch.arange(private, private + shared))
                values[private:] = master[layer][1]
                if agent:  # the first is the master: computed in full
                    keys[private:private + changed] += 1
            store.save(f"agent{agent}", lambda i, held=held: held[i], private + shared,
                       [(b"own%d" % agent, 0, private), (b"shared", private, private + shared)])
        dense = n * (private + shared) * LAYERS * 2 * HEADS * DIM * 2
        sizes[n] = dense / store.nbytes
    row = (private + changed) / (private + shared)
    assert sizes[2] < sizes[8] < sizes[32] < 1 / row
    assert math.isclose(sizes[32], (private + shared) * 32 / (32 * private + shared + 31 * changed), rel_tol=1e-9)


def test_a_piece_an_agent_computed_whole_is_kept_whole_and_read_back_bit_for_bit():
    """An agent that computed piece P itself (its first holder was not pinned) differs from P's
    master in every row: its entry keeps every (position, layer) row of P, so the restore the
    scheduler issues as exact is exact, at any recompute ratio the agent ran."""
    master = kv(20, seed=11)
    held = kv(60, seed=12)
    for keys, values in held:
        keys[30:50] = ROTATE(master[0][0], torch.arange(20), torch.arange(30, 50)) + 0.01  # its own context
        values[30:50] = master[0][1]
    store = SessionStore(LAYERS, ROTATE)
    store.save("master", lambda i: master[i], 20, [(b"P", 0, 20)])
    store.save("a", lambda i: held[i], 60, [(b"P", 30, 50)])
    assert len(store.sessions["a"].diff_index) == 20 * LAYERS
    keys, values = store.rows("a", 0, 60)
    assert all(torch.equal(keys[:, i], held[i][0]) and torch.equal(values[:, i], held[i][1]) for i in range(LAYERS))


def test_the_index_evicts_least_recently_used_agents_to_its_budget_but_never_a_pinned_one():
    index = StoreIndex(budget_bytes=250, bytes_per_token=10)
    for agent in ("a", "b", "c"):
        index.save(("", agent), agent, list(range(10)), [1], [], entry=f"req-{agent}")
    orders, drops, _ = index.take_orders()
    assert [o.entry for o in orders] == ["req-a", "req-b", "req-c"] and drops == [] and index.busy
    assert index.find(("", "a"), "a") is None  # not saved yet
    assert index.take_counters() == {"store_saving": 3}  # the gauge a client waits on to read settled counters
    index.reported(["req-a", "req-b"], {"req-a": 100, "req-b": 100}, total_bytes=200)
    index.reported(["req-c", "req-c"], {"req-c": 100}, total_bytes=300)  # a report repeated counts once
    assert not index.busy and index.take_counters() == {"store_saving": -3, "store_saves": 3}
    assert index.find(("", "a"), "other salt") is None
    index.pin(index.find(("", "a"), "a").entry)  # a is now the most recent, and read by a claim
    _, drops, _ = index.take_orders()
    assert drops == ["req-b"]  # over budget: the least recently used goes
    assert index.counters["store_evictions"] == 1 and index.total_bytes == 200
    index.total_bytes = 1000  # as if the workers reported a full store: a is pinned, c goes
    _, drops, _ = index.take_orders()
    assert drops == ["req-c"] and index.find(("", "a"), "a") is not None
    # a new request of a replaces its entry; the old one is dropped once its claim is done
    index.save(("", "a"), "a", list(range(12)), [2], [], entry="req-a2")
    orders, drops, _ = index.take_orders()
    assert [o.entry for o in orders] == ["req-a2"] and "req-a" not in drops
    index.unpin("req-a")
    assert index.take_orders()[1] == ["req-a"]
    index.reported(["req-a2"], {"req-a2": -1}, total_bytes=0)  # its save failed: never read back
    assert index.find(("", "a"), "a") is None and index.take_orders()[1] == ["req-a2"]


def test_a_save_not_reported_yet_counts_at_an_entrys_own_bytes_not_the_masters():
    """Until the workers report a save, the index counts it at the saved entries' own bytes per
    dense byte: the masters its agent reads are mostly held already. Counting it at the store's
    whole bytes per dense byte (masters included, ~3x an entry's own at Generative Agents N=80)
    evicted agents the budget held."""
    index = StoreIndex(budget_bytes=10_000, bytes_per_token=10)
    index.save(("", "a"), "a", list(range(100)), [1], [], entry="req-a")
    assert index.entries["req-a"].nbytes == 1000  # nothing reported yet: dense
    index.take_orders()
    index.reported(["req-a"], {"req-a": 200}, total_bytes=800)  # its own rows 200, the masters it made 600
    index.save(("", "b"), "b", list(range(50)), [2], [], entry="req-b")
    assert index.entries["req-b"].nbytes == 100 and index.total_bytes == 900


def test_a_mirror_claims_its_evicted_history_back_from_the_store():
    """Round 2 extends round 1: with the pool's blocks gone, every member's history past vLLM's hit
    (the master's too) is one exact span read from its agent's store entry (pinned by the
    connector), not computed."""
    pool = Pool(block_size=8)
    index = StoreIndex(budget_bytes=10**9, bytes_per_token=1)
    b, first, said = salted_first_round(pool, store=index)
    salts = {agent: agent for agent in first}
    for agent, ids in first.items():
        index.save(("", agent), agent, ids + said[agent][:-1], [1], [], entry=f"{agent}-1")
    index.take_orders()
    index.reported([f"{agent}-1" for agent in first], {}, total_bytes=0)
    pool.blocks.clear()  # vLLM evicted every session block
    second = {agent: ids + said[agent] + [NL, *[400 + j for j in range(6)], NL, 9] for agent, ids in first.items()}
    counters = run_round(b, second, salts=salts)
    mirrors = [b.find(agent) for agent in second if b.find(agent).role == "mirror"]
    assert mirrors and len(mirrors) < 3
    for m in [b.find(agent) for agent in second]:
        history = len(first[m.request_id]) + 2  # what its entry holds KV for
        stored = [s for s in m.spans if s.stored]
        assert [(s.start, s.length, s.source_start, s.exact) for s in stored] == [(0, history, 0, True)]
        assert m.store_entry == f"{m.request_id}-1" and m.session_blocks == []
    assert counters["restored_tokens"] == sum(len(ids) + 2 for ids in first.values())
    assert counters.get("computed_tokens.history", 0) == len(second)  # each agent's last said token: no KV
