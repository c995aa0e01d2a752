"""Per-request position-independent reuse (`pic`, the CacheBlend baseline): the shared-span
machinery of `round_kv.RoundKV` applied one agent at a time."""

from __future__ import annotations

import time

from tokendance.reuse.round_kv import (
    AgentPrefill,
    Prefill,
    PrefillReport,
    count_reuse,
    private_positions,
)
from tokendance.reuse.cost import account
from tokendance.reuse.policy import ReusePolicy
from tokendance.reuse.segments import TokenizedTurn


class PerRequestReuse(ReusePolicy):
    """Per-request position-independent reuse (`pic`, CacheBlend-style): prefix-cache hits for
    the history, then each agent separately copies every shared span's base KV into its own
    blocks at its own positions, runs its own check pass and recomputes its own selection. Base
    KV is computed once and kept for the round (the role of a chunk store)."""

    prepares_tables = True

    name = "pic"

    def open_table(self, request_id: str, turn: TokenizedTurn) -> AgentPrefill:
        """A private table for the tokens it prepares, its prefix from the prefix cache."""
        return self.round_kv.open_cached(request_id, turn, turn.num_prepared)

    def finish(self, agent: AgentPrefill) -> None:
        self.round_kv.offer_exact_prefix(agent)

    def prefill(self, agents: list[AgentPrefill]) -> Prefill:
        report = PrefillReport()
        check = 0.0
        for agent in agents:  # each agent is ready once its own recompute ran
            check += yield from self._prefill_one(agent, report)
        count_reuse(agents, report)
        report.cost = account(agents, self.round_kv.selector.ratio, check)
        return report

    def _prefill_one(self, agent: AgentPrefill, report: PrefillReport):
        """Spans seen before are reused; the first agent holding a span computes it in full and
        its KV becomes the span's base (as a KV store fills from the requests it serves). Returns
        the cost of its check pass."""
        rk, check = self.round_kv, 0.0
        started = time.perf_counter()
        agent.reused_spans = [i for i in agent.spans_to_reuse() if agent.turn.spans[i].key in rk.masters]
        slots = rk.kv.get_slots(agent.table_id)
        for index in agent.reused_spans:
            span = agent.turn.spans[index]
            rk.runner.copy_kv(rk.master_slots(span.key), slots[span.start:span.end], list(range(span.start, span.end)))
        report.lookup_seconds += time.perf_counter() - started

        started = time.perf_counter()
        selector = rk.selector
        if selector.needs_check_pass and agent.reused_spans:
            (checked,) = yield from rk.check([agent])
            check = (agent.num_prepared - agent.num_reused_prefix) * (rk.check_layer + 1) / rk.num_layers
            report.computed_tokens += check
        for index in agent.reused_spans:
            span = agent.turn.spans[index]
            scores = None
            if selector.needs_check_pass:
                rows = slice(span.start - agent.num_reused_prefix, span.end - agent.num_reused_prefix)
                scores = rk.span_scores(checked, rows, slots[span.start:span.end], range(span.start, span.end))
            agent.selected[index] = selector.select(span.end - span.start, scores)
        report.selection_seconds += time.perf_counter() - started

        started = time.perf_counter()
        rk.register_masters(agent)  # before it runs: its blocks are held for the agents after it
        report.computed_tokens += yield from rk.recompute([agent], private_positions, releases=True)
        report.recompute_seconds += time.perf_counter() - started
        return check
