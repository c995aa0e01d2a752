"""Rounds, agent sessions and the reuse modes on the real model (fp32, so paths that must agree
can be compared exactly): memory, waves, aborts. tests/reuse/test_round_fidelity.py has what a
round computes (fidelity, scores, cost)."""

from __future__ import annotations

import math
import random

import pytest

from tests.helpers import AGENTS, LOGIT_ATOL, WORDS, history, persona, round_turns
from tokendance import (
    AgentTurn,
    ContextLengthError,
    InvalidRequestError,
    SamplingParams,
)
from tokendance.engine.rounds import RoundAborted
from tokendance.kv.manager import RecallKey, SessionKey
from tokendance.reuse.fidelity import compare

PARAMS = SamplingParams(temperature=0, max_tokens=12, return_logits=1)


def test_full_recompute_reproduces_full_prefill(make_llm):
    reference = make_llm(dtype="float32", reuse="full").run_round(round_turns(1), PARAMS)
    for mode, masters in (("pic", "agent"), ("tokendance", "neutral"), ("tokendance", "agent")):
        llm = make_llm(dtype="float32", reuse=mode, recompute_ratio=1.0, masters=masters)
        result = llm.run_round(round_turns(1), PARAMS)
        assert result.stats.reused_tokens == 0 and result.stats.recomputed_tokens > 0
        for ours, ref in zip(result.outputs, reference.outputs):
            assert ours.token_ids == ref.token_ids
            assert (ours.logits[0] - ref.logits[0]).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize("mode", ["tokendance", "pic"])
def test_round_outputs_do_not_depend_on_turn_order(make_llm, mode):
    """The same rounds submitted in another order (to a second engine) give identical outputs:
    masters, selection and batches follow the contents, not the arrival order."""
    ordered, shuffled = make_llm(reuse=mode), make_llm(reuse=mode)
    for rounds in (1, 2):  # round 2: sessions and recalled segments too
        turns = round_turns(rounds)
        permuted = [turns[i] for i in random.Random(rounds).sample(range(len(turns)), len(turns))]
        assert [t.agent_id for t in permuted] != [t.agent_id for t in turns]
        want = {o.agent_id: (o.token_ids, o.num_cached_tokens) for o in ordered.run_round(turns, PARAMS).outputs}
        got = shuffled.run_round(permuted, PARAMS).outputs
        assert [o.agent_id for o in got] == [t.agent_id for t in permuted]
        assert {o.agent_id: (o.token_ids, o.num_cached_tokens) for o in got} == want


def test_master_mirror_reads_equal_private_corrected_copies(make_llm):
    """tokendance reads master keys rotated at attention time; pic copies them rotated into private
    blocks. With the same masters (the first holder's, in its context) and selection both must
    compute the same thing."""
    pic = make_llm(dtype="float32", reuse="pic", recompute_ratio=0.3).run_round(round_turns(1), PARAMS)
    td = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.3, masters="agent").run_round(round_turns(1), PARAMS)
    assert td.stats.reused_tokens == pic.stats.reused_tokens > 0
    for a, b in zip(td.outputs, pic.outputs):
        assert (a.logits[0] - b.logits[0]).abs().max().item() < LOGIT_ATOL
        assert a.token_ids == b.token_ids
    assert td.stats.kv_bytes_per_agent < pic.stats.kv_bytes_per_agent


def test_ratio_zero_keeps_no_private_copy_of_shared_spans(make_llm):
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.0)
    result = llm.run_round(round_turns(1), PARAMS)
    assert result.stats.recomputed_tokens == 0
    assert all(agent.diff_blocks == 0 for agent in result.stats.agents)
    # every shared-span token of every agent points into blocks several agents hold
    assert result.stats.shared_compression == pytest.approx(len(AGENTS), rel=0.01)


@pytest.mark.parametrize("selection", ["cacheblend", "epic"])
def test_diff_blocks_are_the_selected_tokens_footprint(make_llm, selection):
    ratio = 0.2
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=ratio, selection=selection)
    result = llm.run_round(round_turns(1), PARAMS)
    kv, block_size = llm.engine.kv, llm.engine.kv.block_size
    for agent_stats in result.stats.agents:
        slots = kv.get_slots(SessionKey(agent_stats.agent_id))
        turn = next(t for t in round_turns(1) if t.agent_id == agent_stats.agent_id)
        spans = _shared_spans(llm, turn.agent_id)
        private = {kv.block_of(s) for s in slots if kv.pool.ref_counts[kv.block_of(s)] == 1}
        selected_blocks = {kv.block_of(slots[p]) for s in spans for p in range(s.start, s.end) if kv.block_of(slots[p]) in private}
        selected = sum(math.ceil(ratio * (s.end - s.start)) for s in spans)
        assert agent_stats.diff_blocks == len(selected_blocks)
        # recomputed tokens are packed: the diff is about their count, not the span's size
        assert len(selected_blocks) <= math.ceil(selected / block_size) + len(spans)
        assert len(selected_blocks) < sum(math.ceil((s.end - s.start) / block_size) for s in spans)
    # the masters are computed on their own (neutral): every agent recomputes its share
    assert result.stats.recomputed_tokens == len(AGENTS) * sum(
        math.ceil(ratio * (s.end - s.start)) for s in _shared_spans(llm, "ada")
    )


def _shared_spans(llm, agent_id):
    from tokendance.reuse.segments import tokenize_round

    tokenized = tokenize_round(llm.tokenizer, round_turns(1))
    return next(t for t in tokenized if t.agent_id == agent_id).shared_spans


def test_sessions_compute_only_new_tokens(make_llm):
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=1.0)
    reference = make_llm(dtype="float32", reuse="full")
    first = llm.run_round(round_turns(1), PARAMS)
    reference.run_round(round_turns(1), PARAMS)
    second_turns = []
    for agent, output in zip(AGENTS, first.outputs):
        messages = history(agent, AGENTS.index(agent), 1)
        messages += [{"role": "assistant", "content": output.text},
                     {"role": "user", "content": f"{agent}, think about tomorrow's market and answer briefly."}]
        second_turns.append(AgentTurn(agent, messages))
    second = llm.run_round(second_turns, PARAMS)
    expected = reference.run_round(second_turns, PARAMS)
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in expected.outputs]
    for out_1, out_2 in zip(first.outputs, second.outputs):
        assert out_2.num_cached_tokens >= out_1.num_prompt_tokens  # the whole earlier prompt reused
    new_tokens = sum(o.num_prompt_tokens - o.num_cached_tokens for o in second.outputs)
    assert second.stats.computed_tokens == new_tokens
    assert expected.stats.computed_tokens == sum(o.num_prompt_tokens for o in expected.outputs)


def memory_turns(round_index: int) -> list[AgentTurn]:
    """Each agent's retrieved memories: one line leaves and one arrives per round, so the lines
    that stay sit at other positions than in the agent's previous prompt."""
    turns = []
    for agent in AGENTS[:2]:
        rng = random.Random(f"memories-{agent}")
        lines = [f"- {agent} saw " + " ".join(rng.choice(WORDS) for _ in range(10)) + "." for _ in range(8)]
        memories = "\n".join(lines[round_index:round_index + 6])
        turns.append(AgentTurn(agent, [{"role": "system", "content": persona(agent, 12)},
                                       {"role": "user", "content": f"Memories:\n{memories}"},
                                       {"role": "user", "content": f"Day {round_index}: what do you do?"}]))
    return turns


@pytest.mark.parametrize("ratio", [0.2, 1.0])
def test_sessions_recall_segments_that_moved(make_llm, ratio):
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=ratio)
    reference = make_llm(dtype="float32", reuse="full")
    llm.run_round(memory_turns(0), PARAMS)
    second = llm.run_round(memory_turns(1), PARAMS)
    expected = reference.run_round(memory_turns(1), PARAMS)
    tokenizer = llm.tokenizer
    # lines 2-4 of round 0 are lines 1-3 of round 1, one line earlier: recalled, not recomputed
    # (line 1 may begin inside the prefix the prompts share, and line 5 ended the message before)
    moved = sum(len(tokenizer.encode(line + "\n")) for turn in memory_turns(0) for line in turn.messages[1]["content"].split("\n")[3:6])
    if ratio < 1.0:
        assert second.stats.reused_tokens >= moved * (1 - ratio) - 2 * 3  # ceil() per line
        assert second.stats.computed_tokens <= expected.stats.computed_tokens - second.stats.reused_tokens
        assert compare(expected.outputs, second.outputs).mean_kl < 0.05  # close; a near-tie may flip top-1
    else:  # recomputing every recalled token reproduces full prefill
        assert second.stats.reused_tokens == 0 and second.stats.recomputed_tokens >= moved
        assert [o.token_ids for o in second.outputs] == [o.token_ids for o in expected.outputs]
        for ours, ref in zip(second.outputs, expected.outputs):
            assert (ours.logits[0] - ref.logits[0]).abs().max().item() < LOGIT_ATOL
    assert not any(isinstance(table, RecallKey) for table in llm.engine.kv.tables)  # released after the prefill


def test_ending_or_evicting_an_agent_leaves_the_others_unchanged(make_llm):
    ratio = dict(dtype="float32", reuse="tokendance", recompute_ratio=0.2)
    kept, ended, evicted = make_llm(**ratio), make_llm(**ratio), make_llm(**ratio)
    for llm in (kept, ended, evicted):
        llm.run_round(round_turns(1), PARAMS)
    assert ended.end_agent("ada") and not ended.end_agent("ada")
    turns = round_turns(2, AGENTS[1:])
    pool = kept.engine.kv.pool
    pool.reset_watermark()
    free_before = pool.num_free
    want = kept.run_round(turns, PARAMS)
    needed = free_before - pool.min_free
    # memory pressure: leave one block less than the round needs, so it must evict idle "ada"
    kv = evicted.engine.kv
    kv.create_table("ballast")
    kv.append_private_slots("ballast", (kv.pool.num_free - needed + 1) * kv.block_size)
    got_ended = ended.run_round(turns, PARAMS)
    got_evicted = evicted.run_round(turns, PARAMS)
    assert evicted.engine.stats().num_evictions >= 1 and "ada" not in evicted.rounds.sessions()
    for outputs in (got_ended.outputs, got_evicted.outputs):
        assert [o.token_ids for o in outputs] == [o.token_ids for o in want.outputs]
    kv.free("ballast")
    for llm in (kept, ended, evicted):
        for agent in AGENTS:
            llm.end_agent(agent)
        assert llm.engine.stats().num_used_blocks == 0  # no leak


def test_namespaces_never_share_blocks(make_llm):
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.2)
    # both tenants' agents see the very same shared messages
    turns = round_turns(1, ["ada", "bo"], namespace="tenant-a") + round_turns(1, ["cy", "di"], namespace="tenant-b")
    result = llm.run_round(turns, PARAMS)
    kv = llm.engine.kv
    blocks_a = kv.held_blocks([SessionKey(a) for a in ("ada", "bo")])
    blocks_b = kv.held_blocks([SessionKey(a) for a in ("cy", "di")])
    assert not blocks_a & blocks_b
    assert result.stats.reused_tokens > 0  # sharing still happens inside each namespace


def test_bad_rounds_are_rejected_and_nothing_leaks(make_llm):
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.2)
    with pytest.raises(InvalidRequestError, match="duplicate agent ids"):
        llm.run_round(round_turns(1, ["ada", "ada"]), PARAMS)
    with pytest.raises(InvalidRequestError, match="non-empty"):
        llm.run_round([], PARAMS)
    too_long = AgentTurn("bo", [{"role": "user", "content": "word " * 9000}])
    with pytest.raises(ContextLengthError):
        llm.run_round([round_turns(1, ["ada"])[0], too_long], PARAMS)
    with pytest.raises(InvalidRequestError, match="messages or segments"):
        llm.run_round([AgentTurn("cy")], PARAMS)
    assert llm.engine.stats().num_used_blocks == 0 and not llm.engine.has_unfinished
    result = llm.run_round(round_turns(1), PARAMS)
    assert all(o.num_generated_tokens > 0 for o in result.outputs)
    reference = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.2).run_round(round_turns(1), PARAMS)
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in reference.outputs]


@pytest.fixture(scope="module")
def long_round(make_llm):
    """`round_turns(3)` and full prefill's outputs of it (the waves tests' reference)."""
    turns = round_turns(3)
    return turns, make_llm(dtype="float32", reuse="full").run_round(turns, PARAMS)


def pool_of_two_and_a_half(reference) -> int:
    """A KV pool holding 2.6 of the longest agent's tables (prompt and reply) of `reference`."""
    longest = max(len(o.prompt_token_ids) for o in reference.outputs) + PARAMS.max_tokens
    bytes_per_token = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads x 64, float32
    return int(2.6 * longest * bytes_per_token)


@pytest.mark.parametrize("mode", ["pic", "tokendance"])
def test_a_round_too_large_for_the_pool_runs_in_waves(make_llm, mode, long_round):
    turns, reference = long_round
    llm = make_llm(dtype="float32", reuse=mode, recompute_ratio=1.0, kv_cache_bytes=pool_of_two_and_a_half(reference))
    result = llm.run_round(turns, PARAMS)  # four agents' tables cannot be held at once
    assert result.stats.num_waves > 1 and result.stats.num_agents == len(AGENTS)
    assert [o.agent_id for o in result.outputs] == AGENTS
    for ours, ref in zip(result.outputs, reference.outputs):
        assert ours.token_ids == ref.token_ids
        assert (ours.logits[0] - ref.logits[0]).abs().max().item() < LOGIT_ATOL


def test_a_queued_round_whose_agents_all_left_ends_aborted(make_llm):
    """A round waiting behind another, whose clients all leave before it starts, ends as aborted
    (not failed on an empty list of waves); the round before it completes, and the left round
    keeps nothing."""
    llm = make_llm(reuse="tokendance")
    first = llm.rounds.submit(round_turns(1), PARAMS)
    queued = llm.rounds.submit(round_turns(1, namespace="left"), PARAMS)
    assert all(llm.rounds.abort(agent, queued) is None for agent in AGENTS)  # none had started
    while not (first.done and queued.done):
        llm.engine.step()
    assert isinstance(queued.error, RoundAborted)
    assert [o.agent_id for o in llm.rounds.collect(first).outputs] == AGENTS
    assert sorted(llm.rounds.sessions()) == sorted(AGENTS)  # the first round's, and none of the left one
    for agent in AGENTS:
        llm.end_agent(agent)
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_a_round_in_waves_whose_client_left_stops_and_keeps_nothing(make_llm, long_round):
    """A /v1/rounds client leaving a round that runs in waves, after its first wave finished: the
    engine ends every agent (none got its reply) and aborts them; the round stops within a step
    (its later waves never start) and keeps no session, not even of the agents that had finished."""
    turns, reference = long_round
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=1.0,
                   kv_cache_bytes=pool_of_two_and_a_half(reference))  # four tables do not fit at once
    job = llm.rounds.submit(turns, PARAMS)
    while not llm.rounds.sessions() and not job.done:  # until the first wave ended and kept its sessions
        llm.engine.step()
    assert llm.rounds.sessions() and not job.done
    for agent in AGENTS:  # what the server does when the client of a /v1/rounds request leaves
        llm.end_agent(agent)
        llm.rounds.abort(agent, job)
    steps = 0
    while not job.done:
        llm.engine.step()
        steps += 1
    assert steps <= 1
    outputs = job.outputs.values() if job.error else llm.rounds.collect(job).outputs
    assert sum(o.finish_reason == "abort" for o in outputs) > 0
    assert llm.rounds.sessions() == {}
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_ending_an_agent_during_its_round_drops_its_session_after_the_round(make_llm):
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.2)
    answers = []

    def on_output(output):
        if output.agent_id == "bo" and not answers:
            answers.append((llm.rounds.is_running("bo"), llm.end_agent("bo")))

    result = llm.rounds.run(round_turns(1), PARAMS, on_output)
    assert answers == [(True, True)]
    assert all(o.finish_reason in ("stop", "length") for o in result.outputs)  # its turn still finished
    assert sorted(llm.rounds.sessions()) == ["ada", "cy", "di"]
    assert not llm.end_agent("bo")


def drain(llm, job) -> tuple[list, list]:
    """Step the engine until the round is done: (agent id, finished) of every output, and for each
    step that gave a round agent a token, whether the round still had KV to prepare."""
    seen, preparing = [], []
    while not job.done:
        outputs = llm.engine.step()
        seen += [(o.agent_id, o.finished) for o in outputs]
        if any(o.agent_id is not None for o in outputs):
            preparing.append(job.has_work)
    return seen, preparing


def test_a_round_is_a_job_of_the_step_loop(make_llm):
    """The round's preparation runs in the engine's steps (64-token groups here), beside a lone
    request (which finishes before any agent's first token) and beside the round's own agents:
    the first agents decode while later ones are still prepared. Outputs equal the same round
    run alone."""
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.2, max_num_batched_tokens=64)
    solo = llm.engine.make_request("The river is", SamplingParams(temperature=0, max_tokens=3))
    llm.engine.add(solo)
    job = llm.rounds.submit(round_turns(1), PARAMS)
    seen, preparing = drain(llm, job)
    result = llm.rounds.collect(job)
    first_agent = next(i for i, (agent, _) in enumerate(seen) if agent is not None)
    assert seen[:first_agent] == [(None, False), (None, False), (None, True)]  # done before any agent's first token
    assert preparing[0] and not preparing[-1]  # agents decoded while others were still prepared
    assert result.stats.first_token_seconds < result.stats.prefill_seconds
    alone = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.2, max_num_batched_tokens=64)
    reference = alone.run_round(round_turns(1), PARAMS)
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in reference.outputs]


def test_agents_aborted_while_their_round_prepares_its_kv(make_llm):
    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.2, max_num_batched_tokens=64)
    job = llm.rounds.submit(round_turns(1), PARAMS)
    llm.engine.step()  # the preparation has started; no agent runs yet
    assert llm.rounds.abort("bo") is None
    drain(llm, job)
    result = llm.rounds.collect(job)
    reasons = {o.agent_id: o.finish_reason for o in result.outputs}
    assert reasons["bo"] == "abort" and all(reasons[a] in ("stop", "length") for a in ("ada", "cy", "di"))
    assert sorted(llm.rounds.sessions()) == ["ada", "cy", "di"]

    job = llm.rounds.submit(round_turns(2), PARAMS)
    llm.engine.step()
    for agent in AGENTS:
        llm.rounds.abort(agent)
    drain(llm, job)
    with pytest.raises(RoundAborted):  # nobody is left to answer: the round stops in its prefill
        llm.rounds.collect(job)
    assert not llm.engine.has_unfinished and not llm.rounds.sessions()
    assert llm.engine.stats().num_used_blocks == 0
    assert llm.run_round(round_turns(2), PARAMS).stats.num_agents == len(AGENTS)  # the runner is whole

    job = llm.rounds.submit(round_turns(3), PARAMS)  # some agents decode, others are still prepared
    while not (llm.engine.stats().num_running and job.has_work):
        llm.engine.step()
    for agent in AGENTS:
        llm.rounds.abort(agent)
    drain(llm, job)
    with pytest.raises(RoundAborted):  # the rest of its preparation is not run for nobody
        llm.rounds.collect(job)
    assert not llm.engine.has_unfinished and not llm.rounds.sessions()
    assert llm.engine.stats().num_used_blocks == 0
