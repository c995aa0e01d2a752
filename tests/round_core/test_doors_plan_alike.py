"""Both front doors plan a round with the round core: the engine's KV Collector (over its agents'
segments) and the vLLM plugin's round book (over the token ids vLLM hands it) make the same plan
for the same round. The differences are those named here:
- the plugin has no neutral row (vLLM computes requests only: every block belongs to one), so it
  plans agent masters, which the engine plans with `masters="agent"`;
- the plugin's passes run in vLLM's admission order (arrival), the engine's longest output first:
  first holders are compared in one order;
- the plugin computes pieces shorter than `min_piece_tokens` (4 by default, a setting: re-rotating
  them costs more than it saves), the engine reuses any span; compared at 1.
"""

import pytest

from tokendance.model.loader import load_tokenizer
from tokendance.reuse.collector import plan_masters, plan_sources
from tokendance.reuse.round_kv import AgentPrefill
from tokendance.reuse.segments import tokenize_round
from tokendance.round_core import planning
from tokendance.vllm_plugin.scheduler.round_book import RoundBook
from tokendance.vllm_plugin.scheduler.members import RoundTag
from tokendance.workloads import make_workload


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def engine_plan(turns) -> dict:
    """agent -> (role, {reused span: [(source agent, start)]}, [spans it provides])."""
    agents = [AgentPrefill(t.agent_id, t, 0, block_hashes=[]) for t in turns]  # no session: from the prefix cache
    masters = plan_masters(agents, anchors=1, neutral=False)
    plans = plan_sources(agents, list(range(len(agents))), masters)
    out = {}
    for index, (agent, plan) in enumerate(zip(agents, plans)):
        spans = {s.start: s for s in agent.turn.spans}
        reused = {(start, spans[start].end): [(agents[i].turn.agent_id, at) for i, at in sources]
                  for start, sources in plan.reused.items()}
        role = planning.Role.MASTER if index in masters.members else plan.role
        out[agent.turn.agent_id] = (role, reused, [(p.start, p.end) for p in plan.provides])
    return out


def plugin_plan(tokenizer, turns) -> tuple[dict, dict]:
    """The same, from the round book, and each member's pieces."""
    book = RoundBook(tokenizer.boundaries, round_timeout_s=1e9, hold_timeout_s=1e9, min_piece_tokens=1,
                     lookup=lambda _: None)
    for t in turns:
        book.add(t.agent_id, RoundTag("r", t.agent_id, len(turns)), t.token_ids, now=0.0, salt=t.agent_id)
    out, pieces = {}, {}
    for t in turns:
        member = book.find(t.agent_id)
        reused = {(r.start, r.start + r.length): [(h.member.tag.agent_id, h.start) for h in r.sources]
                  for r in member.reusable}
        out[t.agent_id] = (member.role, reused, list(member.provides))
        pieces[t.agent_id] = [(p.start, p.end) for p in member.pieces]
    return out, pieces


@pytest.mark.parametrize("workload_name,agents,round_index", [
    ("generative-agents", 6, 1), ("generative-agents", 6, 2), ("agent-society", 6, 1), ("debate", 3, 1),
    ("debate", 3, 2)])
def test_the_engine_and_the_plugin_plan_a_round_alike(tokenizer, workload_name, agents, round_index):
    workload = make_workload(workload_name, agents, seed=3)
    turns = tokenize_round(tokenizer, workload.turns(round_index, [workload.synthetic_outputs(r)
                                                                   for r in range(round_index)]))
    engine = engine_plan(turns)
    plugin, pieces = plugin_plan(tokenizer, turns)
    for turn in turns:  # the plugin cuts vLLM's ids where the engine cut the messages
        assert pieces[turn.agent_id] == [(s.start, s.end) for s in turn.spans]
    assert plugin == engine
    roles = [role for role, _, _ in engine.values()]
    assert planning.Role.MASTER in roles and planning.Role.MIRROR in roles  # a plan that shares, not a trivial one
    for turn in turns:  # the message each agent answers is computed in its own context by both
        last = max((s for s in turn.spans if s.end < len(turn.token_ids)), key=lambda s: s.end)
        assert all(end <= last.start for _, end in engine[turn.agent_id][1])


def test_neutral_masters_are_the_engines_alone(tokenizer):
    """The engine's default computes every shared span in a row of no agent's context: no member is
    a master then, and every mirror's sources are the row's (the plugin cannot compute such a row)."""
    workload = make_workload("generative-agents", 6, seed=3)
    turns = tokenize_round(tokenizer, workload.turns(1, [workload.synthetic_outputs(0)]))
    agents = [AgentPrefill(t.agent_id, t, 0, block_hashes=[]) for t in turns]
    masters = plan_masters(agents, neutral=True)
    assert masters.neutral and not masters.members
    plans = plan_sources(agents, list(range(len(agents))), masters)
    row = {key: sources for key, sources in masters.where.items()}
    for agent, plan in zip(agents, plans):
        keys = {s.start: s.key for s in agent.turn.spans}
        assert all(sources == row[keys[start]] for start, sources in plan.reused.items() if keys[start] in row)
