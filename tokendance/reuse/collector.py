"""Round prefill over shared KV: base KV of shared spans, token selection, selective recompute.

Two strategies behind one interface (`prefill(agents)`):

- `PerRequestReuse` (`pic`, the CacheBlend baseline, in `reuse/per_request.py`): agent after
  agent, each looks up every shared span's base KV, copies it into its own blocks with positions
  corrected, runs its own check pass and recomputes its selected tokens. N agents pay N times,
  and store N copies.
- `KVCollector` (`tokendance`): once per round for all agents: one base KV per distinct span
  (the master), one batched check pass, and one batched recompute. Agents' tables point at the
  master's slots in place (keys rotated when read) and hold private slots only for the tokens
  they recompute and their private text (Master-Mirror: the mirror is the block-sparse diff).

In both, a span's base KV is the KV the first agent holding it computed in its own full context
(for the KV Collector: the fewest agents covering every span compute their prompts in full).

Both leave each agent with a table covering tokens [0, L-1) of its prompt; the scheduler then
computes the last token and decodes as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokendance.errors import CapacityError
from tokendance.kv.manager import KVCacheManager
from tokendance.model.runner import ModelRunner, ScheduledRequest, SchedulerOutput
from tokendance.reuse.segments import TokenizedTurn
from tokendance.reuse.selection import Selector


@dataclass
class AgentPrefill:
    """One agent's prompt while its KV is prepared. Its table (`table_id`) already holds the
    `num_reused_prefix` tokens a session or the prefix cache provided."""

    table_id: str
    turn: TokenizedTurn
    num_reused_prefix: int
    selected: dict[int, list[int]] = field(default_factory=dict)  # span index -> offsets
    reused_spans: list[int] = field(default_factory=list)  # indices of spans served from shared KV
    # Segments of the agent's previous prompt, by content: their slots (held for the prefill),
    # so a segment that moved (retrieved memories, a feed) is reused like a shared span.
    recall: dict[bytes, list[int]] = field(default_factory=dict)
    recall_table: str | None = None  # the table holding the recalled slots until they are copied

    @property
    def token_ids(self) -> list[int]:
        return self.turn.token_ids

    @property
    def num_prepared(self) -> int:
        """Tokens this prefill covers: all but the last (the scheduler computes it and samples)."""
        return len(self.turn.token_ids) - 1

    def spans_to_reuse(self) -> list[int]:
        """Spans after the reused prefix that are shared in the round or recalled from the
        agent's previous prompt."""
        end = self.num_prepared
        return [
            i for i, s in enumerate(self.turn.spans)
            if (s.key is not None or s.content in self.recall) and s.start >= self.num_reused_prefix and s.end <= end
        ]


@dataclass
class PrefillReport:
    """Seconds per phase and tokens computed (in full-model token equivalents)."""

    lookup_seconds: float = 0.0  # base KV of shared spans (+ position-corrected copies in pic)
    selection_seconds: float = 0.0
    recompute_seconds: float = 0.0
    computed_tokens: float = 0.0
    recomputed_tokens: int = 0  # selected tokens of reused spans
    reused_tokens: int = 0  # tokens of reused spans served from shared KV


class RoundKV:
    """KV operations of a round prefill on one engine's KV manager and runner."""

    def __init__(
        self,
        kv: KVCacheManager,
        runner: ModelRunner,
        selector: Selector,
        check_layer: int,
        max_batch_tokens: int,
        reclaim: Callable[[], bool],
    ):
        self.kv = kv
        self.runner = runner
        self.selector = selector
        self.check_layer = check_layer
        self.max_batch_tokens = max_batch_tokens
        self.reclaim = reclaim
        self.num_layers = len(runner.model.layers)
        # span key -> (table id, first token, length) of its master: the span as the first agent
        # holding it computed it, in that agent's own context (see KVCollector)
        self.masters: dict[bytes, tuple[str, int, int]] = {}
        self.held_tables: list[str] = []  # kept alive for the prefill only (recalled sessions)

    # ------------------------------------------------------------ allocation

    def private_slots(self, table_id: str, count: int) -> list[int]:
        while True:
            slots = self.kv.append_private_slots(table_id, count)
            if slots is not None:
                return slots
            if not self.reclaim():
                raise CapacityError(f"the KV pool cannot hold this round ({count} more tokens needed)")

    def release_masters(self) -> None:
        """Forget this round's masters (their blocks live on while any table references them)."""
        self.masters.clear()
        self.release_held()

    def release_held(self) -> None:
        for table_id in self.held_tables:
            if self.kv.has(table_id):
                self.kv.free(table_id)
        self.held_tables.clear()

    def register_masters(self, agent: "AgentPrefill") -> None:
        """Make the agent's computed shared spans the masters of spans not mastered yet."""
        for index in agent.spans_to_reuse():
            span = agent.turn.spans[index]
            if span.key is not None and span.key not in self.masters:
                self.masters[span.key] = (agent.table_id, span.start, span.end - span.start)

    def source_slots(self, agent: "AgentPrefill", index: int) -> list[int]:
        """Base KV of a reused span: the round's master if shared, else the agent's recall."""
        span = agent.turn.spans[index]
        if span.key in self.masters:
            return self.master_slots(span.key)
        return agent.recall[span.content]

    # ------------------------------------------------------------ forward passes

    def run(self, items: list[ScheduledRequest], num_layers: int | None = None) -> None:
        """Forward `items` in groups of about `max_batch_tokens` new tokens."""
        group: list[ScheduledRequest] = []
        tokens = 0
        for item in items:
            if group and tokens + len(item.token_ids) > self.max_batch_tokens:
                self.runner.compute_kv(SchedulerOutput(scheduled=group), num_layers)
                group, tokens = [], 0
            group.append(item)
            tokens += len(item.token_ids)
        if group:
            self.runner.compute_kv(SchedulerOutput(scheduled=group), num_layers)

    def master_slots(self, key: bytes) -> list[int]:
        table_id, start, length = self.masters[key]
        return self.kv.get_slots(table_id)[start:start + length]

    def check_keys(self, agents: list[AgentPrefill]) -> list[torch.Tensor]:
        """Fresh keys at the check layer of every token in [prefix, L-1) of each agent, computed in
        its real context through the first check_layer+1 layers, in scratch slots."""
        scratch = []
        items = []
        try:
            for index, agent in enumerate(agents):
                table_id = f"scratch:{index}"
                self.kv.create_table(table_id)
                scratch.append(table_id)
                self.kv.append_shared_slots(table_id, self.kv.get_slots(agent.table_id)[: agent.num_reused_prefix])
                new = range(agent.num_reused_prefix, agent.num_prepared)
                self.private_slots(table_id, len(new))
                slots = self.kv.get_slots(table_id)
                items.append(ScheduledRequest(table_id, agent.token_ids[new.start:new.stop], new, slots, False, None))
            self.run(items, num_layers=self.check_layer + 1)
            return [
                self.runner.read_keys(self.check_layer, item.context_slots[item.positions.start:], list(item.positions))
                for item in items
            ]
        finally:
            for table_id in scratch:
                self.kv.free(table_id)

    def deviation(self, fresh: torch.Tensor, slots: list[int], positions: range) -> torch.Tensor:
        cached = self.runner.read_keys(self.check_layer, slots, list(positions))
        return (fresh - cached).pow(2).sum(dim=(1, 2))  # [num_tokens]

    def recompute(self, agents: list[AgentPrefill], positions_of: Callable[[AgentPrefill], list[int]]) -> int:
        """Compute the given positions of each agent through all layers over its fused table."""
        items = []
        for agent in agents:
            positions = positions_of(agent)
            if not positions:
                continue
            slots = self.kv.get_slots(agent.table_id)[: positions[-1] + 1]
            token_ids = [agent.token_ids[p] for p in positions]
            items.append(ScheduledRequest(agent.table_id, token_ids, positions, slots, False, None))
        self.run(items)
        return sum(len(i.token_ids) for i in items)


def private_positions(agent: AgentPrefill) -> list[int]:
    """Positions of [prefix, L-1) that are not served from shared KV: private text and the
    selected tokens of reused spans."""
    reused = set()
    for index in agent.reused_spans:
        span = agent.turn.spans[index]
        chosen = set(agent.selected.get(index, ()))
        reused.update(span.start + o for o in range(span.end - span.start) if o not in chosen)
    return [p for p in range(agent.num_reused_prefix, agent.num_prepared) if p not in reused]


class KVCollector:
    """Collective reuse for a whole round (`tokendance`). `scope` picks how selection is shared:
    "agent" = one batched check pass, each agent selects its own tokens; "block" = one check pass
    per distinct span (in the first agent holding it), the selection applied to every agent."""

    def __init__(self, round_kv: RoundKV, scope: str = "agent"):
        self.round_kv = round_kv
        self.scope = scope

    def prefill(self, agents: list[AgentPrefill]) -> PrefillReport:
        rk, report = self.round_kv, PrefillReport()
        started = time.perf_counter()
        for agent in agents:
            agent.reused_spans = agent.spans_to_reuse()
        # Masters: a few agents whose prompts hold every distinct span (greedy cover) compute them
        # in full; their in-context KV of each span is the base every other agent reuses (closer
        # to the others' contexts than a span encoded on its own, so fewer tokens deviate).
        masters = _choose_masters(agents)
        for agent in masters:  # they compute their shared spans, and still recall their own
            agent.reused_spans = [i for i in agent.reused_spans if agent.turn.spans[i].key is None]
            for index in agent.reused_spans:
                span = agent.turn.spans[index]
                agent.selected[index] = rk.selector.select(span.end - span.start, None)
            self._build_table(agent)
        report.computed_tokens += rk.recompute(masters, private_positions)
        for agent in masters:
            rk.register_masters(agent)
        others = [a for a in agents if all(a is not m for m in masters)]
        for agent in others:  # shared spans no master holds are computed by each holder
            agent.reused_spans = [i for i in agent.reused_spans
                                  if agent.turn.spans[i].key is None or agent.turn.spans[i].key in rk.masters]
        report.lookup_seconds = time.perf_counter() - started

        started = time.perf_counter()
        report.computed_tokens += self._select(others)
        report.selection_seconds = time.perf_counter() - started

        started = time.perf_counter()
        for agent in others:
            self._build_table(agent)
        report.computed_tokens += rk.recompute(others, private_positions)
        report.recompute_seconds = time.perf_counter() - started
        count_reuse(agents, report)
        return report

    def _select(self, agents: list[AgentPrefill]) -> float:
        rk, selector = self.round_kv, self.round_kv.selector
        if not selector.needs_check_pass:
            for agent in agents:
                for index in agent.reused_spans:
                    span = agent.turn.spans[index]
                    agent.selected[index] = selector.select(span.end - span.start, None)
            return 0.0
        with_spans = [a for a in agents if a.reused_spans]
        probes = with_spans if self.scope == "agent" else _first_holders(with_spans)
        fresh = rk.check_keys(probes)
        chosen: dict[bytes, list[int]] = {}
        for agent, keys in zip(probes, fresh):
            for index in agent.reused_spans:
                span = agent.turn.spans[index]
                rows = slice(span.start - agent.num_reused_prefix, span.end - agent.num_reused_prefix)
                deviation = rk.deviation(keys[rows], rk.source_slots(agent, index), range(span.start, span.end))
                agent.selected[index] = selector.select(span.end - span.start, deviation)
                if span.key is not None:
                    chosen.setdefault(span.key, agent.selected[index])
        if self.scope == "block":
            for agent in agents:
                for index in agent.reused_spans:
                    span = agent.turn.spans[index]
                    if span.key is not None:
                        agent.selected[index] = chosen[span.key]
                    elif index not in agent.selected:  # a recalled span no probe checked
                        agent.selected[index] = selector.select(span.end - span.start, None)
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
            rk.held_tables.remove(agent.recall_table)
            agent.recall_table, agent.recall = None, {}


def _first_holders(agents: list[AgentPrefill]) -> list[AgentPrefill]:
    """A small set of agents whose reused spans cover every distinct shared span (greedy, in order)."""
    seen: set[bytes] = set()
    holders = []
    for agent in agents:
        keys = {agent.turn.spans[i].key for i in agent.reused_spans} - {None}
        if keys - seen:
            holders.append(agent)
            seen |= keys
    return holders


def _choose_masters(agents: list[AgentPrefill]) -> list[AgentPrefill]:
    """Agents that compute their prompts in full so that their shared spans become masters.
    Greedy: the agent whose not-yet-covered spans save the others the most tokens, as long as
    that saving exceeds what it gives up (reusing the spans earlier masters already cover). A
    span only a few agents hold by chance is not worth a master: its holders compute it."""
    holders: dict[bytes, int] = {}
    spans_of: dict[int, dict[bytes, int]] = {}  # agent -> shared span key -> length
    for agent in agents:
        spans = {agent.turn.spans[i].key: agent.turn.spans[i].end - agent.turn.spans[i].start
                 for i in agent.reused_spans if agent.turn.spans[i].key is not None}
        spans_of[id(agent)] = spans
        for key in spans:
            holders[key] = holders.get(key, 0) + 1
    covered: set[bytes] = set()
    masters: list[AgentPrefill] = []

    def gain(agent: AgentPrefill) -> int:
        spans = spans_of[id(agent)]
        saving = sum(length * (holders[key] - 1) for key, length in spans.items() if key not in covered)
        return saving - sum(length for key, length in spans.items() if key in covered)

    candidates = list(agents)
    while candidates:
        best = max(candidates, key=gain)
        if gain(best) <= 0:
            break
        masters.append(best)
        candidates.remove(best)
        covered |= spans_of[id(best)].keys()
    return masters


def count_reuse(agents: list[AgentPrefill], report: PrefillReport) -> None:
    for agent in agents:
        for index in agent.reused_spans:
            span = agent.turn.spans[index]
            selected = len(agent.selected.get(index, ()))
            report.recomputed_tokens += selected
            report.reused_tokens += span.end - span.start - selected
