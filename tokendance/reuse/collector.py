"""The KV Collector (`tokendance`): collective reuse once per round for all agents.

One base KV per distinct shared span (the master: by default every shared span computed once in
a row of its own, in no agent's context; `masters="agent"`: as an agent holding it computed it in
its own context), one batched check pass, and one batched recompute. Agents' tables point at the
master's slots in place (keys rotated when read) and hold private slots only for the tokens they
recompute and their private text (Master-Mirror: the mirror is the block-sparse diff). Agents keep
their KV between rounds as sessions, and segments of their previous prompt that moved are recalled
(copied, position-corrected) instead of recomputed.

The per-request baseline (`pic`) is in `reuse/per_request.py`; the shared machinery in
`reuse/round_kv.py`.
"""

from __future__ import annotations

import time

from tokendance.kv.manager import RecallKey, SessionKey
from tokendance.reuse.round_kv import (
    AgentPrefill,
    Prefill,
    PrefillReport,
    Ready,
    RoundKV,
    count_reuse,
    private_positions,
)
from tokendance.reuse.policy import ReusePolicy
from tokendance.reuse.cost import account
from tokendance.reuse.segments import TokenizedTurn
from tokendance.round_core import planning
from tokendance.round_core.spans import common_prefix


class KVCollector(ReusePolicy):
    """Collective reuse for a whole round (`tokendance`), over agent sessions: one batched check
    pass, each agent selecting its own tokens."""

    prepares_tables = True
    keeps_sessions = True

    name = "tokendance"

    def __init__(self, round_kv: RoundKV, anchors: int = 1, masters: str = "agent"):
        super().__init__(round_kv)
        self.anchors = anchors
        self.neutral = masters == "neutral" and anchors == 1  # anchors are agents' contexts

    def open_table(self, request_id: str, turn: TokenizedTurn) -> AgentPrefill:
        """The agent's session table, cut to the longest prefix its new prompt shares with it.
        The segments of the session after the cut stay held (pinned) for the prefill (recall)."""
        kv, prepared = self.round_kv.kv, turn.num_prepared
        session: Session | None = kv.unkeep(SessionKey(turn.agent_id), request_id)
        if session is None:  # a new agent, or one whose session was evicted or ended
            return self.round_kv.open_cached(request_id, turn)
        common = min(common_prefix(session.token_ids, turn.token_ids), prepared)
        slots = kv.get_slots(request_id)
        wanted = {s.content for s in turn.spans if s.start >= common}
        recall = {s.content: slots[s.start:s.end] for s in session.spans
                  if s.content in wanted and common <= s.start and s.end <= len(slots)}
        recall_id = None
        if recall:  # only the blocks of segments the new prompt holds again stay, until copied
            recall_id = RecallKey(turn.agent_id)
            kv.create_table(recall_id)
            kv.append_shared_slots(recall_id, [slot for span in recall.values() for slot in span])
            kv.keep(recall_id, pinned=True)
        kv.truncate(request_id, common)
        return AgentPrefill(request_id, turn, common, recall=recall, recall_table=recall_id)

    def finish(self, agent: AgentPrefill) -> None:
        """A table opened from the prefix cache offers its exact prefix back to it, for this
        agent's next prompt when it keeps no session (anonymous agents of transparent rounds) and
        for every other request. A session's table may hold reused KV anywhere: it offers nothing."""
        if agent.from_prefix_cache:
            self.round_kv.offer_exact_prefix(agent)

    def prefill(self, agents: list[AgentPrefill]) -> Prefill:
        try:
            return (yield from self._prefill(agents))
        finally:  # recalled segments not copied (e.g. a failed prefill) are freed now
            for agent in agents:
                if agent.recall_table is not None:
                    self.round_kv.kv.free(agent.recall_table)
                    agent.recall_table, agent.recall = None, {}

    def _prefill(self, agents: list[AgentPrefill]) -> Prefill:
        """Masters first (their tables are complete once computed), then the check pass of the
        others, then the others' recompute, whose agents are ready one by one: those with the
        longest outputs to write first, so the round's last output comes early."""
        rk, report = self.round_kv, PrefillReport()
        started = time.perf_counter()
        # Masters. Neutral (the default): every shared span computed once, in a row of its own, so
        # that no agent's private text reaches the KV the others read (docs/concepts.md#where-
        # masters-are-computed: closed-loop quality measured no different from agent masters').
        # Agent: a few agents whose prompts hold every distinct span (greedy cover) compute them in
        # full; their in-context KV of each span is the base every other agent reuses.
        round_masters = plan_masters(agents, self.anchors, self.neutral)
        neutral = (yield from rk.neutral_masters(agents, round_masters)) if self.neutral else 0
        report.computed_tokens += neutral
        masters = [agents[i] for i in round_masters.members]
        for agent in masters:  # they compute their shared spans, and still recall their own
            agent.reused_spans = [i for i in agent.reused_spans if agent.turn.spans[i].key is None]
            for index in agent.reused_spans:
                span = agent.turn.spans[index]
                agent.selected[index] = rk.selector.select(span.end - span.start, None)
            self._build_table(agent)
        report.computed_tokens += yield from rk.recompute(masters, private_positions)
        for agent in masters:
            rk.register_masters(agent)
            if agent.from_prefix_cache:
                rk.offer_exact_prefix(agent)
        if self.anchors > 1:  # in-round anchors: each span's base is the mean of its encodings
            rk.blend_masters(agents, round_masters)
        # The others' prefixes the masters computed (a system prompt, at the same positions) are
        # prefix-cache hits now: exact, neither checked nor recomputed.
        others = [i for i, a in enumerate(agents) if all(a is not m for m in masters)]
        for index in others:
            rk.extend_cached(agents[index])
            _plan_reuse(agents[index])  # the rules again, over the grown prefix
        # The others in the order they are computed: those with the longest outputs to write
        # first, so the round's last output comes early.
        others.sort(key=lambda i: (-agents[i].max_output_tokens, len(private_positions(agents[i]))))
        plan_sources(agents, others, round_masters)
        others = [agents[i] for i in others]
        report.lookup_seconds = time.perf_counter() - started

        started = time.perf_counter()
        check = yield from self._select(others)
        report.computed_tokens += check
        report.selection_seconds = time.perf_counter() - started

        started = time.perf_counter()
        for agent in others:  # every table is built before any agent runs: a pool too small fails here
            self._build_table(agent)
            rk.register_masters(agent)  # the spans it computes first, for the later holders
        if masters:
            yield Ready(masters)
        # In this order a span's first holder runs in the same step as its later holders or before:
        # each layer writes the step's keys and values before any attention reads them.
        report.computed_tokens += yield from rk.recompute(others, private_positions, releases=True)
        report.recompute_seconds = time.perf_counter() - started
        count_reuse(agents, report)
        report.cost = account(agents, rk.selector.ratio, check, neutral)
        return report

    def _select(self, agents: list[AgentPrefill]):
        """Each agent's tokens to recompute (a generator: the check pass); returns its cost in
        full-model token equivalents."""
        rk, selector = self.round_kv, self.round_kv.selector
        if not selector.needs_check_pass:
            for agent in agents:
                for index in agent.reused_spans:
                    span = agent.turn.spans[index]
                    spread = rk.spread.get(span.key) if selector.score == "spread" else None
                    agent.selected[index] = selector.select(span.end - span.start, spread)
            return 0.0
        probes = [a for a in agents if a.reused_spans]
        fresh = yield from rk.check(probes)
        for agent, checked in zip(probes, fresh):
            for index in agent.reused_spans:
                span = agent.turn.spans[index]
                if span.key is not None and span.key not in rk.masters:  # its first holder has not computed it yet
                    agent.selected[index] = selector.select(span.end - span.start, None)
                    continue
                rows = slice(span.start - agent.num_reused_prefix, span.end - agent.num_reused_prefix)
                scores = rk.span_scores(checked, rows, rk.source_slots(agent, index), range(span.start, span.end))
                agent.selected[index] = selector.select(span.end - span.start, scores)
        checked = sum(a.num_prepared - a.num_reused_prefix for a in probes)
        return checked * (rk.check_layer + 1) / rk.num_layers

    def _build_table(self, agent: AgentPrefill) -> None:
        """Mirror: master slots in place for reused tokens of shared spans, private slots for
        everything else. Recalled spans (the agent's own, from its previous prompt) are copied
        into private slots, position-corrected: the old blocks they sat in can then be freed,
        and the agent's private KV stays packed."""
        rk = self.round_kv
        reused = {agent.turn.spans[i].start: i for i in agent.reused_spans}
        copies: tuple[list[int], list[int], list[int]] = ([], [], [])
        position = agent.num_reused_prefix
        while position < agent.num_prepared:
            index = reused.get(position)
            if index is None:
                end = min((s for s in reused if s > position), default=agent.num_prepared)
                rk.private_slots(agent.table_id, end - position)
                position = end
                continue
            span = agent.turn.spans[index]
            source = rk.source_slots(agent, index)
            if span.key not in rk.masters:  # recalled
                copies[0].extend(source)
                copies[1].extend(rk.private_slots(agent.table_id, len(source)))
                copies[2].extend(range(span.start, span.end))
            else:
                chosen = set(agent.selected[index])
                for offset in range(span.end - span.start):
                    if offset in chosen:
                        rk.private_slots(agent.table_id, 1)
                    else:
                        rk.kv.append_shared_slots(agent.table_id, [source[offset]])
            position = span.end
        if copies[0]:
            rk.runner.copy_kv(*copies)
        if agent.recall_table is not None:  # copied: the old blocks go back to the pool now
            rk.kv.free(agent.recall_table)
            agent.recall_table, agent.recall = None, {}


def plan_masters(agents: list[AgentPrefill], anchors: int = 1, neutral: bool = False) -> planning.Masters:
    """Each agent's reused spans by the round core's rules (`planning.reusable_spans`: never the
    message it answers; an agent without a session keeps its prefix exact where that is cheap),
    and the round's masters (`planning.choose_round_masters`)."""
    for agent in agents:
        _plan_reuse(agent)
    held = [[a.turn.spans[i] for i in a.spans_to_reuse()] for a in agents]
    return planning.choose_round_masters(_reused(agents), held, anchors, neutral)


def plan_sources(agents: list[AgentPrefill], order: list[int], masters: planning.Masters) -> list[planning.MemberPlan]:
    """The reused spans of the agents in `order` (the order their passes run), by source
    (`planning.assign_sources`): a shared span no master holds is computed by its first holder in
    this order, in its own context, and reused by the later ones."""
    plans = planning.assign_sources(_reused(agents), order, masters)
    for index in order:
        agent, plan = agents[index], plans[index]
        agent.reused_spans = [i for i in agent.reused_spans
                              if agent.turn.spans[i].key is None or agent.turn.spans[i].start in plan.reused]
    return plans


def _plan_reuse(agent: AgentPrefill) -> None:
    agent.reused_spans = planning.reusable_spans(agent.turn.spans, agent.spans_to_reuse(), agent.num_prepared,
                                                 agent.from_prefix_cache)


def _reused(agents: list[AgentPrefill]) -> list[list]:
    """Each agent's reused spans, for the round core's planning."""
    return [[agent.turn.spans[i] for i in agent.reused_spans] for agent in agents]
