"""The vLLM plugin's scheduler-side round book, on token ids alone (no vLLM needed)."""

import pytest

from tokendance.round_core.spans import Boundaries, cut_spans
from tokendance.vllm_plugin.scheduler.round_book import RoundBook
from tokendance.vllm_plugin.scheduler.members import RoundParamsError, RoundTag, Stage

NL = 0  # the boundary token of these prompts
CUT = Boundaries(frozenset({NL}))


GEN = 99  # the generation prompt: what a chat template puts after the last message


def prompt(private: list[int], shared: list[list[int]], task: list[int]) -> list[int]:
    """private text, the shared outputs (each a line), the agent's task (the message it answers,
    never reused), then the generation prompt."""
    ids = [*private, NL]
    for line in shared:
        ids += [*line, NL]
    return ids + task + [NL, GEN]


OUTPUTS = [[10 + i * 7 + j for j in range(6)] for i in range(3)]  # three agents' outputs, 6 tokens each


def book(timeout: float = 1.0, hold: float = 30.0) -> RoundBook:
    return RoundBook(CUT, round_timeout_s=timeout, hold_timeout_s=hold)


def tag(agent: str, size: int | None = 3, round_id: str = "r1") -> RoundTag:
    return RoundTag(round_id, agent, size)


def planned(b: RoundBook) -> tuple[dict, str, list[str]]:
    """A complete round of three agents added to `b`: (prompts, its master, its mirrors)."""
    prompts = {f"a{i}": prompt([100 + i] * 4, OUTPUTS, [200 + i]) for i in range(3)}
    for agent, ids in prompts.items():
        b.add(agent, tag(agent), ids, now=0.0)
    master = next(a for a in prompts if b.find(a).role == "master")
    return prompts, master, [a for a in prompts if b.find(a).role == "mirror"]


def test_pieces_end_after_line_breaks_and_headers_keep_their_first_line():
    pieces = cut_spans([5, NL, 6, 7, NL, 8], CUT, "")
    assert [(p.start, p.end) for p in pieces] == [(0, 2), (2, 5), (5, 6)]
    assert cut_spans([6, 7, NL], CUT, "a")[0].key != cut_spans([6, 7, NL], CUT, "b")[0].key  # namespaced
    # ChatML (`S` opens a message, `E` ends it): a header goes with the message's first line, the
    # trailer with its last, as the engine cuts chat messages into segments
    S, E, NL2 = 1, 2, 3
    chatml = Boundaries(frozenset({NL, NL2}), frozenset({S, E}))
    ids = [S, 7, NL, 8, NL, 9, E, NL, S, 6, NL2, 5, E, NL, S, 4, NL]
    assert [(p.start, p.end) for p in cut_spans(ids, chatml, "")] == [(0, 5), (5, 8), (8, 14), (14, 17)]
    # a trailer with no line break (Llama 3's `<|eot_id|>`) ends its span before the next header
    assert [(p.start, p.end) for p in cut_spans([S, 7, NL, 8, E, S, 6, NL, 5], chatml, "")] == [(0, 5), (5, 9)]


def test_tag_parsing_refuses_malformed_params():
    assert RoundTag.parse(None) is None and RoundTag.parse({"other": 1}) is None
    assert RoundTag.parse({"tokendance": {"round_id": "r", "agent_id": "a", "round_size": 2}}) == RoundTag("r", "a", 2)
    for bad in ({"round_id": "r"}, {"round_id": "", "agent_id": "a"}, {"round_id": "r", "agent_id": "a", "round_size": 0},
                {"round_id": "r", "agent_id": "a", "round_size": True}, "r1",
                {"round_id": "r", "agent_id": "a", "anchors": 0}, {"round_id": "r", "agent_id": "a", "anchors": 1.5}):
        with pytest.raises(RoundParamsError):
            RoundTag.parse({"tokendance": bad})


def test_a_round_plans_one_master_and_mirrors_claim_up_to_their_last_shared_piece():
    b = book()
    prompts = {f"a{i}": prompt([100 + i] * (3 + 2 * i), OUTPUTS, [200 + i, 201]) for i in range(3)}
    for i, (agent, ids) in enumerate(prompts.items()):
        b.add(agent, tag(agent), ids, now=0.0)
        assert b.claim(agent, 0, now=0.0) is None or i == 2  # held until the round is complete
    roles = {agent: b.find(agent).role for agent in prompts}
    assert sorted(roles.values()) == ["master", "mirror", "mirror"]
    master = next(a for a, r in roles.items() if r == "master")
    mirror = next(a for a, r in roles.items() if r == "mirror")
    assert b.claim(master, 0, now=0.1) == 0  # vLLM computes the master in full
    assert b.claim(mirror, 0, now=0.1) is None  # until the master's KV exists
    b.mark_ready(master, [7, 8])
    ids = prompts[mirror]
    shared_end = len(ids) - 4  # the task's two tokens, its line break and the generation prompt stay with vLLM
    assert b.claim(mirror, 0, now=0.2) == shared_end
    spans = b.loads_for(b.find(mirror))
    assert len(spans) == 1  # the three output lines follow each other in both prompts: one span
    span = spans[0]
    assert (span.length, span.source_block_ids) == (3 * 7, [7, 8])
    assert ids[span.start:span.start + span.length] == prompts[master][span.source_start:span.source_start + span.length]


@pytest.mark.parametrize("from_tag", [False, True])
def test_in_round_anchors_plan_several_masters_and_mirrors_read_all_their_encodings(from_tag):
    """With 2 anchors (the book's setting, or the first member's tag), a round of four plans two
    masters; a mirror waits for both, and each of its spans names both encodings of its tokens."""
    b = RoundBook(CUT, round_timeout_s=1.0, hold_timeout_s=30.0, anchors=1 if from_tag else 2)
    prompts = {f"a{i}": prompt([100 + i] * (3 + i), OUTPUTS, [200 + i]) for i in range(4)}
    for agent, ids in prompts.items():
        b.add(agent, RoundTag("r1", agent, 4, anchors=2 if from_tag else None), ids, now=0.0)
    masters = [a for a in prompts if b.find(a).role == "master"]
    mirrors = [a for a in prompts if b.find(a).role == "mirror"]
    assert (len(masters), len(mirrors)) == (2, 2)
    b.mark_ready(masters[0], [1, 2])
    assert b.claim(mirrors[0], 0, now=0.1) is None  # the second anchor is not computed yet
    b.mark_ready(masters[1], [3, 4])
    assert b.claim(mirrors[0], 0, now=0.1) == len(prompts[mirrors[0]]) - 3  # not the task (answered)
    spans = b.loads_for(b.find(mirrors[0]))
    assert len(spans) == 1 and {tuple(blocks) for blocks, _ in spans[0].sources} == {(1, 2), (3, 4)}
    span, ids = spans[0], prompts[mirrors[0]]
    for blocks, start in span.sources:
        owner = masters[0] if blocks == [1, 2] else masters[1]
        assert prompts[owner][start:start + span.length] == ids[span.start:span.start + span.length]


def test_a_piece_a_master_holds_twice_is_read_from_its_first_occurrence_only():
    """A line repeated within the masters' prompts (a JSON field in every post) has one encoding per
    anchor, not one per occurrence: the mirror reads the master's first occurrence."""
    b = book()
    line, other = OUTPUTS[0], OUTPUTS[1]
    prompts = {"a0": prompt([100] * 3, [line, line, other], [200]), "a1": prompt([101] * 4, [line], [201]),
               "a2": prompt([102] * 5, [other], [202])}
    for agent, ids in prompts.items():
        b.add(agent, tag(agent), ids, now=0.0)
    assert b.find("a0").role == "master"
    b.mark_ready("a0", [5, 6])
    assert b.claim("a1", 0, now=0.1) and b.claim("a2", 0, now=0.1)
    first = prompts["a0"].index(line[0])
    (span,) = b.loads_for(b.find("a1"))
    assert span.sources == [([5, 6], first)]
    assert len(b.loads_for(b.find("a2"))[0].sources) == 1


def test_claims_skip_what_vllms_prefix_cache_holds():
    b = book()
    prompts, master, (mirror, _) = planned(b)
    b.mark_ready(master, [1])
    first_line_end = 5 + 7
    assert b.claim(mirror, first_line_end, now=0.0) == len(prompts[mirror]) - 3 - first_line_end
    assert b.claim(mirror, len(prompts[mirror]) - 1, now=0.0) == 0  # all cached: nothing to claim
    assert b.find(mirror).role == "exact"


def test_incomplete_rounds_are_planned_at_the_timeout_and_late_members_are_exact():
    b = book(timeout=1.0)
    prompts = [prompt([100 + i] * 4, OUTPUTS, [200 + i]) for i in range(3)]
    b.add("a0", tag("a0", size=5), prompts[0], now=0.0)
    b.add("a1", tag("a1", size=5), prompts[1], now=0.0)
    assert b.claim("a0", 0, now=0.5) is None
    assert b.claim("a0", 0, now=1.5) in (0, None)  # planned now: a master (0) or a held mirror
    assert {b.find("a0").role, b.find("a1").role} == {"master", "mirror"}
    b.add("a2", tag("a2", size=5), prompts[2], now=1.6)
    assert b.find("a2").role == "exact" and b.claim("a2", 0, now=1.6) == 0


def test_a_round_still_filling_waits_for_members_that_come_one_after_another():
    """The timeout counts from the latest member: four members 0.8 s apart (as a large round's
    long prompts reach the scheduler) under a 1 s timeout form one round; a fifth that never comes
    is waited for one timeout after the fourth."""
    b = book(timeout=1.0)
    agents = [f"a{i}" for i in range(4)]
    for i, agent in enumerate(agents):
        b.add(agent, tag(agent, size=5), prompt([100 + i] * 4, OUTPUTS, [200 + i]), now=0.8 * i)
        assert b.claim("a0", 0, now=0.8 * i + 0.7) is None  # 3.1 s after the first: still filling
    assert b.claim("a0", 0, now=2.4 + 1.1) in (0, None)  # planned: no member came for 1 s
    assert sorted(b.find(a).role for a in agents) == ["master", "mirror", "mirror", "mirror"]


def test_mirrors_fall_back_to_exact_when_their_master_is_gone_or_too_slow():
    for gone in (True, False):
        b = book(hold=10.0)
        _, master, (mirror, _) = planned(b)
        if gone:
            b.finish(master)  # aborted before its prompt was computed
            assert b.claim(mirror, 0, now=1.0) == 0
        else:
            assert b.claim(mirror, 0, now=5.0) is None
            assert b.claim(mirror, 0, now=11.0) == 0
        assert b.find(mirror).role == "exact"


def test_masters_blocks_are_released_once_no_mirror_needs_them():
    """Pinned until every mirror's load has gone to the workers (their pass fills it in that step,
    before vLLM's forward) or its request ended first (it never reads them); the master may finish
    before its mirrors."""
    b = book()
    _, master, mirrors = planned(b)
    assert b.mark_ready(master, [3, 4]) == [3, 4]
    b.finish(master)  # the master may finish first: its blocks stay pinned
    assert b.releasable() == []
    for mirror in mirrors:
        assert b.claim(mirror, 0, now=0.0) > 0
    first = b.find(mirrors[0])
    assert b.sent(first) == [] and first.stage == Stage.SENT
    assert b.releasable() == []  # the second still reads them
    b.finish(mirrors[1])  # aborted before its load was sent
    assert sorted(b.releasable()) == [3, 4]
    assert b.releasable() == []  # once
    b.finish(mirrors[0])
    assert b.rounds == {} and b.members == {}


def test_a_round_without_shared_content_computes_everyone_exactly():
    b = book()
    for i in range(3):
        b.add(f"a{i}", tag(f"a{i}"), [300 + i * 10 + j for j in range(12)], now=0.0)
    assert {b.find(f"a{i}").role for i in range(3)} == {"exact"}
    assert all(b.claim(f"a{i}", 0, now=0.0) == 0 for i in range(3))


def test_a_mirror_resumed_after_preemption_is_computed_exactly():
    """Once filled, a mirror never claims again: its masters' blocks may be unpinned and reused."""
    b = book()
    _, master, (mirror, other) = planned(b)
    b.mark_ready(master, [5])
    assert b.claim(mirror, 0, now=0.0) > 0
    b.sent(b.find(mirror))  # its load went to the workers; then vLLM preempted it
    assert b.claim(mirror, 0, now=0.1) == 0 and b.find(mirror).role == "exact"
    assert b.claim(other, 0, now=0.1) > 0  # the others are not affected


def test_a_step_admits_claims_up_to_its_budget_and_the_rest_in_later_steps():
    b = RoundBook(CUT, round_timeout_s=1.0, hold_timeout_s=30.0, claim_tokens_per_step=30)
    prompts = {f"a{i}": prompt([100 + i] * 4, OUTPUTS, [200 + i]) for i in range(4)}
    for agent, ids in prompts.items():
        b.add(agent, tag(agent, size=4), ids, now=0.0)
    master = next(a for a in prompts if b.find(a).role == "master")
    mirrors = [a for a in prompts if b.find(a).role == "mirror"]
    b.mark_ready(master, [1])
    claims = []
    for m in mirrors:
        claims.append(b.claim(m, 0, now=0.0))
        if claims[-1]:
            b.commit(m, claims[-1])
    assert claims[0] == 26 and claims[1:] == [None, None]  # 26 + 26 > 30: one mirror this step
    b.next_step()
    assert b.claim(mirrors[1], 0, now=0.0) == 26 and b.commit(mirrors[1], 26) is b.find(mirrors[1])
    assert b.claim(mirrors[2], 0, now=0.0) is None
    b.next_step()
    assert b.claim(mirrors[2], 0, now=0.0) == 26


def test_a_claim_spends_nothing_until_vllm_commits_it():
    """vLLM may ask twice (an allocation that failed is retried): the same answer, and the step's
    budget is spent only by `commit`; a commit of another count leaves the member exact."""
    b = RoundBook(CUT, round_timeout_s=1.0, hold_timeout_s=30.0, claim_tokens_per_step=30)
    prompts = {f"a{i}": prompt([100 + i] * 4, OUTPUTS, [200 + i]) for i in range(4)}
    for agent, ids in prompts.items():
        b.add(agent, tag(agent, size=4), ids, now=0.0)
    master = next(a for a in prompts if b.find(a).role == "master")
    first, second, third = [a for a in prompts if b.find(a).role == "mirror"]
    b.mark_ready(master, [1])
    assert [b.claim(first, 0, now=0.0) for _ in range(3)] == [26, 26, 26]
    assert b.claim(second, 0, now=0.0) == 26  # nothing committed yet: the budget is whole
    assert b.commit(first, 26) is b.find(first)
    assert b.claim(second, 0, now=0.0) is None  # now it is spent
    b.next_step()
    assert b.claim(second, 0, now=0.0) == 26 and b.commit(second, 0) is None  # vLLM took none of it
    assert b.find(second).role == "exact" and b.claim(second, 0, now=0.0) == 0
    assert b.commit(master, 0) is None and b.find(master).role == "master"


def run_round(b: RoundBook, prompts: dict, size: int | None = None, num_computed: dict | None = None,
              salts: dict | None = None) -> dict:
    """Add, plan, compute the masters and commit every member's claim; the book's counters."""
    for agent, ids in prompts.items():
        b.add(agent, tag(agent, size=size or len(prompts)), ids, now=0.0, salt=(salts or {}).get(agent))
    for agent in prompts:
        if b.find(agent).role == "master":  # it claims its own history only, if it has one
            b.commit(agent, b.claim(agent, (num_computed or {}).get(agent, 0), now=0.0))
            b.mark_ready(agent, [1])
    for agent in prompts:
        if b.find(agent).role != "master":
            count = b.claim(agent, (num_computed or {}).get(agent, 0), now=0.0)
            b.commit(agent, count)
    return b.take_counters()


def test_round_tokens_are_counted_by_who_computes_them_and_why():
    """Masters compute their prompts; a mirror's tokens outside its reused pieces are private; an
    identical prefix at the same positions (a system prompt under per-agent salts) is reused though
    an exact copy exists; the counts add up to every prompt token."""
    system = [100] * 4
    order = [OUTPUTS, OUTPUTS[1:] + OUTPUTS[:1], OUTPUTS[2:] + OUTPUTS[:2]]
    prompts = {f"a{i}": prompt(system, order[i], [200 + i, 201]) for i in range(3)}
    counters = run_round(book(), prompts)
    assert counters["rounds_complete"] == 1 and counters["members.master"] == 1 and counters["members.mirror"] == 2
    length = len(prompts["a0"])
    assert counters["computed_tokens.master"] == length
    # each mirror: system (5) and the three lines (21) reused; its task (2, and its line break) and
    # the generation prompt private
    assert counters["claimed_tokens"] == 2 * 26
    assert counters["computed_tokens.private"] == 2 * 4
    assert counters["reused_exact_tokens"] == 2 * 5  # the system piece: identical, at the same positions
    computed = sum(v for k, v in counters.items() if k.startswith("computed_tokens."))
    assert computed + counters["claimed_tokens"] == 3 * length


def test_pieces_no_master_holds_and_an_agents_own_history_are_counted():
    """Two pairs of agents each share a line the other pair lacks: the master (one of them) holds
    one pair's; the other pair's line is computed once, by its first holder (`no_master`), and
    reused by the second, in the same pass (a late span: copied layer by layer). An agent's previous
    request's tokens at the same positions, left beyond vLLM's block-aligned hit, are `history`."""
    common = [[50 + j for j in range(20)]]
    pair_a, pair_b = [[60 + j for j in range(5)]], [[70 + j for j in range(5)]]
    prompts = {"a0": prompt([1], common + pair_a, [9]), "a1": prompt([2], common + pair_a, [9]),
               "a2": prompt([3], common + pair_b, [9]), "a3": prompt([4], common + pair_b, [9])}
    b = book()
    counters = run_round(b, prompts)
    assert counters["members.master"] == 1
    assert counters["computed_tokens.no_master"] == 6  # one pair's line (5 + its boundary), once
    master = next(a for a in prompts if b.find(a).role == "master")
    pair = ["a2", "a3"] if master in ("a0", "a1") else ["a0", "a1"]
    first, second = b.find(pair[0]), b.find(pair[1])
    assert first.provides_end == 29 and first.claim[1] >= 29  # its claim covers the piece it provides
    late = [s for s in second.spans if s.late]
    assert [(s.start, s.length, s.source_start) for s in late] == [(23, 6, 23)]
    assert late[0].source_block_ids is first.block_ids  # filled when the first holder's load is sent
    for agent, ids in prompts.items():
        b.finish(agent, ids + [300, 301])  # what each said
    second = {agent: ids + [300, 301, NL] + [400 + i] * 3 + [NL] + [9] for i, (agent, ids) in enumerate(prompts.items())}
    counters = run_round(b, second, num_computed={agent: 4 for agent in second})  # vLLM's hit: 4 tokens
    mirrors = counters["members.mirror"]
    history = counters["computed_tokens.history"]
    assert mirrors >= 1 and history > 0
    # a mirror's history: its own first prompt and output, from position 4, outside reused pieces
    assert history <= mirrors * (len(prompts["a0"]) + 2 - 4)


class Pool:
    """vLLM's prefix cache as the book sees it: block hash -> block id, for full computed blocks."""

    def __init__(self, block_size: int):
        self.block_size, self.blocks = block_size, {}

    def finish(self, b: RoundBook, agent: str, all_ids: list[int]) -> None:
        """The agent's request ends: its full blocks (the last token has no KV yet) are cached."""
        hashes = [(agent, tuple(all_ids[:(i + 1) * self.block_size])) for i in range(len(all_ids) // self.block_size)]
        for h in hashes[:(len(all_ids) - 1) // self.block_size]:
            self.blocks.setdefault(h, 1000 + len(self.blocks))
        b.finish(agent, all_ids, hashes)


def salted_first_round(pool: Pool, store=None) -> tuple[RoundBook, dict, dict]:
    """A book over `pool` (8-token blocks) and its first round of three agents, each under its own
    salt (its id), finished: (book, their prompts, what each said)."""
    b = RoundBook(CUT, round_timeout_s=1.0, hold_timeout_s=30.0, block_size=8, lookup=pool.blocks.get, store=store)
    first = {f"a{i}": prompt([100 + i] * 4, OUTPUTS, [200 + i]) for i in range(3)}
    run_round(b, first, salts={agent: agent for agent in first})
    said = {agent: [300 + i, 301, 302] for i, agent in enumerate(first)}
    for agent, ids in first.items():
        pool.finish(b, agent, ids + said[agent])
    return b, first, said


def test_a_mirror_reads_its_own_history_back_exactly_from_cached_blocks():
    """Round 2 extends each agent's round-1 request: past vLLM's block-aligned hit, the history its
    cached blocks hold is one exact span (copied, no check), read from those blocks (pinned by the
    connector); the unfinished last block's tokens are computed (`history`); under another salt,
    or once the blocks are evicted, nothing is read back."""
    for salt2, evicted in ((None, False), ("other", False), (None, True)):
        pool = Pool(block_size=8)
        b, first, said = salted_first_round(pool)
        if evicted:
            pool.blocks.clear()
        second = {agent: ids + said[agent] + [NL, *[400 + j for j in range(6)], NL, 9] for agent, ids in first.items()}
        counters = run_round(b, second, num_computed={agent: 8 for agent in second},
                             salts={agent: salt2 or agent for agent in second})
        mirrors = [b.find(agent) for agent in second if b.find(agent).role == "mirror"]
        assert mirrors
        for m in mirrors:
            exact = [s for s in m.spans if s.exact]
            if salt2 or evicted:
                assert not exact and m.session_blocks == []
                continue
            cached = (len(first[m.request_id]) + 3 - 1) // 8 * 8  # full blocks of its first request
            assert cached == 24
            assert exact[0].start == 8 and exact[0].length == cached - 8 and exact[0].source_start == 8
            assert m.session_blocks == sorted({exact[0].source_block_ids[i] for i in range(1, cached // 8)})
            assert all(i >= 1000 for i in m.session_blocks)
        if not (salt2 or evicted):
            # the master claims its own history the same way (exact copies, no piece of anyone's)
            master = next(b.find(agent) for agent in second if b.find(agent).role == "master")
            assert [(s.start, s.length, s.exact) for s in master.spans] == [(8, cached - 8, True)]
            assert counters["reused_exact_tokens"] == sum(s.length for m in [*mirrors, master] for s in m.spans if s.exact)
            # the unfinished last block's history, where no master's piece covers it (the master's too)
            assert counters["computed_tokens.history"] == sum(
                len(set(range(24, len(first[m.request_id]) + 3)) - {p for s in m.spans for p in range(s.start, s.start + s.length)})
                for m in [*mirrors, master]) > 0
        else:
            assert counters.get("reused_exact_tokens", 0) == 0 and counters["computed_tokens.history"] > 0


def test_a_mirror_recalls_its_own_pieces_that_moved_from_cached_blocks():
    """An agent's round-1 private line, two tokens later in its round-2 prompt: re-rotated from
    the block that still holds it (a recalled span, checked like a master's piece), not computed."""
    pool = Pool(block_size=4)
    b = RoundBook(CUT, round_timeout_s=1.0, hold_timeout_s=30.0, block_size=4, lookup=pool.blocks.get)
    first = {f"a{i}": prompt([100 + i] * 4, OUTPUTS, [200 + i]) for i in range(3)}
    run_round(b, first)
    for agent, ids in first.items():
        pool.finish(b, agent, ids + [300, 301])
    second = {agent: [999, NL] + ids for agent, ids in first.items()}  # everything moved by two
    counters = run_round(b, second)
    mirrors = [b.find(agent) for agent in second if b.find(agent).role == "mirror"]
    assert mirrors
    for m in mirrors:
        recalled = [s for s in m.spans if s.recalled]
        assert [(s.start, s.length, s.source_start, s.exact) for s in recalled] == [(2, 5, 0, False)]
        assert m.session_blocks == sorted({recalled[0].source_block_ids[0], recalled[0].source_block_ids[1]})
    assert counters["recalled_tokens"] == 5 * len(mirrors)
    assert counters.get("computed_tokens.moved", 0) == 0


def test_a_piece_is_read_from_its_first_holder_in_a_later_step_only_once_its_pass_is_confirmed():
    """A pair's line no master holds: its first holder's pass fills it in one step; the second
    holder, admitted in a later step (one mirror per step here), reads it from the first holder's
    blocks once vLLM reported that step, and computes it itself if the pass failed."""
    common = [[50 + j for j in range(20)]]
    pair_a, pair_b = [[60 + j for j in range(5)]], [[70 + j for j in range(5)]]
    prompts = {"a0": prompt([1], common + pair_a, [9]), "a1": prompt([2], common + pair_a, [9]),
               "a2": prompt([3], common + pair_b, [9]), "a3": prompt([4], common + pair_b, [9])}
    for failed in (False, True):
        b = RoundBook(CUT, round_timeout_s=1.0, hold_timeout_s=30.0, claim_tokens_per_step=1)
        for agent, ids in prompts.items():
            b.add(agent, tag(agent, size=4), ids, now=0.0)
        master = next(a for a in prompts if b.find(a).role == "master")
        b.mark_ready(master, [1])
        first, second = ["a2", "a3"] if master in ("a0", "a1") else ["a0", "a1"]
        b.commit(first, b.claim(first, 0, now=0.0))
        b.find(first).block_ids[:] = [5, 6, 7, 8]
        assert b.sent(b.find(first)) == [6]  # the block holding the line it provides (16-token blocks), pinned
        assert b.claim(second, 0, now=0.0) is None  # its pass is this step's: not confirmed yet
        b.next_step()
        if failed:
            b.failed_blocks({6})
        assert b.claim(second, 0, now=0.0) > 0
        from_first = [s for s in b.find(second).spans if s.source_block_ids is b.find(first).block_ids]
        assert bool(from_first) != failed
        if not failed:
            assert [(s.start, s.length) for s in from_first] == [(23, 6)]


def test_first_holders_pin_their_pieces_only_while_the_pins_leave_room_in_the_pool():
    """Pins last until a round's last mirror is filled. In a pool too small for them (here 4 blocks:
    pins may take 1, the master's), a first holder's piece is not pinned, and the member reading it
    in a later step computes it instead of waiting for blocks that would never come free; in a
    large pool it is pinned and read, as before."""
    common = [[50 + j for j in range(20)]]
    pair_a, pair_b = [[60 + j for j in range(5)]], [[70 + j for j in range(5)]]
    prompts = {"a0": prompt([1], common + pair_a, [9]), "a1": prompt([2], common + pair_a, [9]),
               "a2": prompt([3], common + pair_b, [9]), "a3": prompt([4], common + pair_b, [9])}
    for pool_blocks in (4, 100):
        b = RoundBook(CUT, round_timeout_s=1.0, hold_timeout_s=30.0, claim_tokens_per_step=1)
        b.pool_blocks = pool_blocks
        for agent, ids in prompts.items():
            b.add(agent, tag(agent, size=4), ids, now=0.0)
        master = next(a for a in prompts if b.find(a).role == "master")
        assert b.mark_ready(master, [1]) == [1]  # a master's blocks are always pinned
        first, second = ["a2", "a3"] if master in ("a0", "a1") else ["a0", "a1"]
        b.commit(first, b.claim(first, 0, now=0.0))
        b.find(first).block_ids[:] = [5, 6, 7, 8]
        pinned = b.sent(b.find(first))
        b.next_step()
        b.next_step()
        assert b.claim(second, 0, now=0.0) > 0
        from_first = [s for s in b.find(second).spans if s.source_block_ids is b.find(first).block_ids]
        if pool_blocks == 4:
            assert pinned == [] and not from_first and b.take_counters()["unpinned_holders"] == 1
        else:
            assert pinned == [6] and from_first
