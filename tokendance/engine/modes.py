"""Reuse modes as strategies: how a round's prompt KV is prepared before the scheduler computes
each agent's last prompt token and decodes. Chosen once, when the engine is built."""

from __future__ import annotations

from tokendance.engine.request import Request
from tokendance.errors import CapacityError, InvalidRequestError
from tokendance.reuse.collector import AgentPrefill, KVCollector, PrefillReport, RoundKV
from tokendance.reuse.per_request import PerRequestReuse
from tokendance.reuse.segments import TokenizedTurn, common_prefix

REUSE_MODES = ("full", "prefix", "pic", "tokendance")


class ReuseMode:
    name = ""
    prepares_tables = False  # False: the scheduler computes whole prompts (full, prefix)
    keeps_sessions = False  # True: agents' tables persist between rounds

    def open_table(self, rounds, request: Request, turn: TokenizedTurn) -> AgentPrefill:
        raise NotImplementedError

    def prefill(self, agents: list[AgentPrefill]) -> PrefillReport:
        return PrefillReport()

    def after_prefill(self, rounds, request: Request, agent: AgentPrefill) -> None:
        """Hook once the agent's table covers [0, L-1)."""


class SchedulerOnly(ReuseMode):
    """`full` (prefix caching off for the engine) and `prefix`: nothing prepared."""

    def __init__(self, name: str):
        self.name = name


class PerRequestMode(ReuseMode):
    """`pic`: prefix-cache hits for history, CacheBlend-style reuse agent by agent."""

    name = "pic"
    prepares_tables = True

    def __init__(self, round_kv: RoundKV):
        self.strategy = PerRequestReuse(round_kv)

    def open_table(self, rounds, request: Request, turn: TokenizedTurn) -> AgentPrefill:
        """A private table for [0, L-1), its prefix from the prefix cache."""
        kv, prepared = rounds.engine.kv, request.num_tokens - 1
        hit = kv.find_prefix_hit(turn.token_ids, turn.namespace)
        cached = min(hit.num_tokens(kv.block_size), prepared)
        while True:
            copies = kv.allocate_slots(request.request_id, prepared, cached, hit)
            if copies is not None:
                break
            if not rounds.reclaim():
                raise CapacityError(f"the KV pool cannot hold agent {turn.agent_id!r}'s prompt")
        rounds.engine.runner.copy_blocks(copies)
        return AgentPrefill(request.request_id, turn, cached)

    def prefill(self, agents: list[AgentPrefill]) -> PrefillReport:
        return self.strategy.prefill(agents)

    def after_prefill(self, rounds, request: Request, agent: AgentPrefill) -> None:
        # Only the exact prefix before the first blended span may serve as prefix-cache hits.
        exact = min((agent.turn.spans[i].start for i in agent.reused_spans), default=agent.num_prepared)
        rounds.engine.kv.mark_irregular(request.request_id, exact, request.token_ids, request.namespace)


class CollectiveMode(ReuseMode):
    """`tokendance`: agent sessions, then the KV Collector with Master-Mirror tables."""

    name = "tokendance"
    prepares_tables = True
    keeps_sessions = True

    def __init__(self, round_kv: RoundKV, scope: str):
        self.strategy = KVCollector(round_kv, scope)

    def open_table(self, rounds, request: Request, turn: TokenizedTurn) -> AgentPrefill:
        """The agent's session table, cut to the longest prefix its new prompt shares with it.
        The segments of the session after the cut stay held for the prefill (recall)."""
        kv, prepared = rounds.engine.kv, request.num_tokens - 1
        session = rounds.sessions.pop(turn.agent_id, None)
        if session is None:
            kv.create_table(request.request_id)
            return AgentPrefill(request.request_id, turn, 0)
        common = min(common_prefix(session.token_ids, turn.token_ids), prepared)
        slots = kv.get_slots(session.table_id)
        wanted = {s.content for s in turn.spans if s.start >= common}
        recall = {s.content: slots[s.start:s.end] for s in session.spans
                  if s.content in wanted and common <= s.start and s.end <= len(slots)}
        recall_id = None
        if recall:  # only the blocks of segments the new prompt holds again stay, until copied
            recall_id = f"recall:{turn.agent_id}"
            kv.create_table(recall_id)
            kv.append_shared_slots(recall_id, [slot for span in recall.values() for slot in span])
            self.strategy.round_kv.held_tables.append(recall_id)
        kv.rename(session.table_id, request.request_id)
        kv.truncate(request.request_id, common)
        return AgentPrefill(request.request_id, turn, common, recall=recall, recall_table=recall_id)

    def prefill(self, agents: list[AgentPrefill]) -> PrefillReport:
        report = self.strategy.prefill(agents)
        self.strategy.round_kv.release_held()
        return report


def make_mode(name: str, round_kv: RoundKV, collective_scope: str) -> ReuseMode:
    if name not in REUSE_MODES:
        raise InvalidRequestError(f"reuse must be one of {', '.join(REUSE_MODES)}, got {name!r}")
    if collective_scope not in ("agent", "block"):
        raise InvalidRequestError(f"collective_selection must be 'agent' or 'block', got {collective_scope!r}")
    if name == "pic":
        return PerRequestMode(round_kv)
    if name == "tokendance":
        return CollectiveMode(round_kv, collective_scope)
    return SchedulerOnly(name)
