"""The scheduler, kept tables, master choice and token selection without the model: exact token
counts, block ids and orders on tiny configurations (milliseconds, CPU only)."""

from __future__ import annotations

import pytest
import torch

from tokendance.engine.request import Request, RequestStatus
from tokendance.engine.scheduler import Scheduler
from tokendance.errors import CapacityError
from tokendance.kv.manager import KVCacheManager, RecallKey, SessionKey
from tokendance.reuse.selection import make_selector
from tokendance.round_core import planning
from tokendance.round_core.spans import Span
from tokendance.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def request(request_id: str, num_prompt: int, max_tokens: int = 4, start: int = 100) -> Request:
    return Request(request_id, list(range(start, start + num_prompt)), GREEDY, max_tokens)


def step(scheduler: Scheduler, requests: dict[str, Request], token: int = 7):
    """One schedule + a fake model that samples `token` for every request that samples."""
    out = scheduler.schedule()
    sampled = {item.request_id: token for item in out.scheduled if item.sample}
    scheduler.update_from_output(out, sampled, requests)
    return [(item.request_id, len(item.token_ids), item.sample) for item in out.scheduled]


def test_prefill_is_chunked_by_the_token_budget():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=4)
    a = request("a", 20)
    scheduler.add(a)
    assert step(scheduler, {"a": a}) == [("a", 8, False)]
    assert step(scheduler, {"a": a}) == [("a", 8, False)]
    assert step(scheduler, {"a": a}) == [("a", 4, True)]
    assert a.num_computed_tokens == 20 and a.output_token_ids == [7]
    assert kv.get_slots("a") == list(range(20))  # blocks 0-4 in order; the sampled token gets its slot next step


def test_decodes_go_first_and_prefills_share_what_is_left():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=4)
    a, b = request("a", 3), request("b", 12, start=200)
    requests = {"a": a, "b": b}
    scheduler.add(a)
    assert step(scheduler, requests) == [("a", 3, True)]
    scheduler.add(b)
    assert step(scheduler, requests) == [("a", 1, True), ("b", 7, False)]
    assert step(scheduler, requests) == [("a", 1, True), ("b", 5, True)]


def test_a_long_prefill_leaves_room_for_requests_that_wait():
    """Beside other requests, a running prefill takes a quarter of the budget per step (less deep
    into a long prompt): a waiting request is admitted, and a running one decodes, in the same
    step instead of after the whole long prompt."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=16, max_num_seqs=4)
    long, short = request("long", 100), request("short", 3, start=300)
    requests = {"long": long, "short": short}
    scheduler.add(long)
    assert step(scheduler, requests) == [("long", 16, False)]  # alone: the whole budget
    scheduler.add(short)
    assert step(scheduler, requests) == [("long", 4, False), ("short", 3, True)]
    assert step(scheduler, requests) == [("long", 4, False), ("short", 1, True)]
    for _ in range(2):
        step(scheduler, requests)
    assert short.status is RequestStatus.FINISHED
    assert step(scheduler, requests) == [("long", 16, False)]  # alone again: the whole budget


def test_the_newest_running_request_is_preempted_and_recomputed():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    a, b = request("a", 8, max_tokens=8), request("b", 7, max_tokens=8, start=200)
    requests = {"a": a, "b": b}
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler, requests) == [("a", 8, True), ("b", 7, True)]
    assert kv.pool.num_free == 0
    # a's 9th token needs a third block: b (newest) is preempted, its blocks freed
    assert step(scheduler, requests) == [("a", 1, True)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert scheduler.waiting[0] is b and b.num_cached_tokens is None
    assert b.output_token_ids == [7]  # kept: it is recomputed with its prompt


def test_admission_is_fair_between_groups_and_a_large_group_leaves_reserved_slots():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=16)
    assert scheduler.reserved_seqs == 1
    requests = {}
    for i in range(20):  # a round of 20 agents arrives first
        requests[f"agent{i}"] = Request(f"agent{i}", [100 + i, 1], GREEDY, 4, group="round")
        scheduler.add(requests[f"agent{i}"])
    ran = step(scheduler, requests)
    assert len(ran) == 15  # it queues anyway: the last slot stays free for anyone else
    chat = requests["chat"] = request("chat", 3)
    scheduler.add(chat)
    assert ("chat", 3, True) in step(scheduler, requests)  # admitted at once, not after the round
    assert len(scheduler.running) == 16


def test_admission_takes_turns_between_groups_by_running_requests():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    assert scheduler.reserved_seqs == 0
    requests = {f"r{i}": Request(f"r{i}", [100 + i, 1], GREEDY, 4, group="round") for i in range(6)}
    requests |= {f"j{i}": Request(f"j{i}", [200 + i, 1], GREEDY, 4, group="job") for i in range(2)}
    requests["solo"] = request("solo", 2)
    for r in requests.values():  # the round's agents arrive before the job's prompts and a lone request
        scheduler.add(r)
    admitted = [name for name, _, _ in step(scheduler, requests)]
    assert admitted == ["r0", "j0", "solo", "r1", "j1", "r2", "r3", "r4"]


def test_a_group_that_fits_takes_every_slot():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=16)
    agents = {f"a{i}": Request(f"a{i}", [100 + i, 1], GREEDY, 4, group="round") for i in range(16)}
    for r in agents.values():
        scheduler.add(r)
    assert len(step(scheduler, agents)) == 16  # nothing of it would queue: no slot is held back


def test_a_prepared_table_enters_through_the_query_and_the_commit():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    a = request("a", 10)
    kv.create_table("a")
    kv.append_private_slots("a", 9)  # a round prefill computed tokens [0, 9)
    kv.mark_prepared("a", num_tokens=9, num_cached=6)
    computed = kv.find_computed("a", a.token_ids, "")
    assert (computed.num_tokens, computed.num_cached) == (9, 6)
    assert kv.find_computed("a", a.token_ids, "") == computed  # a query changes nothing
    scheduler.add(a)
    assert step(scheduler, {"a": a}) == [("a", 1, True)]  # only the last prompt token
    assert a.num_cached_tokens == 6 and a.num_computed_tokens == 10
    assert "a" not in kv.prepared


def test_prepared_tables_that_block_everything_are_dropped_not_deadlocked():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=1)
    a, b = request("a", 10), request("b", 10, start=200)
    for r in (a, b):
        kv.create_table(r.request_id)
        kv.append_private_slots(r.request_id, 8)
        kv.mark_prepared(r.request_id, 8, 8)
        scheduler.add(r)
    assert kv.pool.num_free == 0  # a needs a third block; only b's prepared table could give it
    assert step(scheduler, {"a": a, "b": b}) == [("a", 2, True)]
    assert not kv.has("b") and "b" not in kv.prepared  # b will be computed from scratch


def test_nothing_fits_and_nothing_to_drop_is_a_capacity_error():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.create_table(RecallKey("x"))
    kv.append_private_slots(RecallKey("x"), 8)
    kv.keep(RecallKey("x"), pinned=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    scheduler.add(request("a", 3))
    with pytest.raises(CapacityError):
        scheduler.schedule()


def test_kept_tables_are_evicted_least_recently_kept_first_and_pinned_never():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    for agent in ("old", "pinned", "new"):
        kv.create_table(agent)
        kv.append_private_slots(agent, 4)
        kv.keep(agent, key=SessionKey(agent), payload=f"{agent} payload", pinned=agent == "pinned")
    assert kv.find_kept(SessionKey) == {SessionKey(a): f"{a} payload" for a in ("old", "pinned", "new")}
    assert kv.pool.num_free == 1
    assert kv.allocate_slots("r", 8, 0) is not None  # needs one more block: "old" goes
    assert not kv.has(SessionKey("old")) and kv.num_evictions == 1
    assert kv.allocate_slots("s", 4, 0) is not None  # then "new"; "pinned" stays
    assert not kv.has(SessionKey("new")) and kv.has(SessionKey("pinned"))
    assert kv.allocate_slots("t", 4, 0) is None  # only the pinned one is left: nothing changes
    assert kv.num_evictions == 2 and kv.has(SessionKey("pinned"))
    assert kv.unkeep(SessionKey("pinned"), "agent-request") == "pinned payload"
    assert kv.has("agent-request") and not kv.find_kept(SessionKey)


def span(key: str, start: int, length: int) -> Span:
    return Span(start, start + length, key.encode(), key.encode())


def test_masters_cover_widely_shared_spans_and_skip_chance_overlaps():
    a = [span("x", 10, 40), span("y", 60, 40)]
    b = [span("y", 10, 40), span("x", 60, 40)]
    c = [span("x", 5, 40), span("y", 50, 40), span("rare", 100, 10)]
    d = [span("rare", 20, 10)]
    masters = planning.choose_round_masters([a, b, c, d])
    assert masters.members == [2]  # holds every span; "rare" (2 holders) is not worth a second master
    assert masters.where[b"x"] == [(2, 5)] and b"rare" in masters.where


def test_selectors_pick_their_tokens():
    deviation = torch.tensor([0.0, 5.0, 1.0, 9.0, 0.5, 0.1, 3.0, 0.2, 0.0, 0.0])
    assert make_selector("epic", 0.3).select(10, None) == [0, 1, 2]
    assert make_selector("cacheblend", 0.3).select(10, deviation) == [1, 3, 6]
    assert make_selector("cacheblend", 0.3).select(10, None) == [0, 1, 2]  # no check pass ran
    assert make_selector("cacheblend", 1.0).select(4, deviation[:4]) == [0, 1, 2, 3]
    assert make_selector("epic", 0.0).select(10, None) == []


def test_prefill_chunks_shrink_deep_into_a_long_prompt():
    """Each new token of a long prompt attends to more: chunk x context is bounded (budget x 512
    alone, budget x 128 beside others), so no step grows to seconds of attention."""
    kv = KVCacheManager(num_blocks=4096, block_size=16)
    scheduler = Scheduler(kv, max_num_batched_tokens=2048, max_num_seqs=4)
    long, short = request("long", 7800), request("short", 4, start=9000)
    requests = {"long": long, "short": short}
    scheduler.add(long)
    assert [step(scheduler, requests)[0][1] for _ in range(3)] == [2048, 2048 * 512 // 2048, 2048 * 512 // 2560]
    scheduler.add(short)
    computed = long.num_computed_tokens
    assert step(scheduler, requests) == [("long", 2048 * 128 // computed, False), ("short", 4, True)]
