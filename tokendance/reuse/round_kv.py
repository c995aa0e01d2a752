"""The machinery every reuse policy shares: an agent's prompt while its KV is prepared
(`AgentPrefill`) and the KV operations of a round prefill (`RoundKV`).

A `ReusePolicy` (reuse/policy.py; one per mode, chosen once) prepares each agent's table before the scheduler
computes its last prompt token and decodes: `open_table` (the table starts from what the agent's
session or the prefix cache holds), `prefill` (all agents of a round together), `finish` (once
the agent's table is complete, before the scheduler takes it over). Policies are given the KV
manager and the runner explicitly (through `RoundKV`); agent sessions are kept tables of the KV
manager.

A prefill runs no forward pass itself: it is a generator that yields the passes it needs
(`Work`) and the agents whose tables are complete (`Ready`), and the engine runs the passes in its
own steps, beside every other request's tokens (see `engine/round_job.py`). Reading fresh keys after
a pass (the check pass) is plain code after the `yield`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from tokendance.batch import ScheduledRequest
from tokendance.errors import CapacityError
from tokendance.kv.manager import KVCacheManager, MasterKey, PrefixHit, RecallKey, ScratchKey
from tokendance.model.kv_math import key_deviation
from tokendance.model.runner import ModelRunner
from tokendance.reuse.segments import TokenizedTurn
from tokendance.reuse.selection import Selector
from tokendance.round_core.planning import Masters
from tokendance.round_core.spans import Span


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
    recall_table: RecallKey | None = None  # the table holding the recalled slots until they are copied
    max_output_tokens: int = 0  # what the agent may write once ready (the prefill orders agents by it)
    # its table started from the prefix cache (no session; exact up to its first reused span):
    # the hashes of its prompt's full blocks, for later lookups
    block_hashes: list | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.turn.token_ids

    @property
    def num_prepared(self) -> int:
        """Tokens this prefill covers: all but the last (the scheduler computes it and samples),
        or all before a scored tail (`TokenizedTurn.num_prepared`)."""
        return self.turn.num_prepared

    @property
    def from_prefix_cache(self) -> bool:
        return self.block_hashes is not None

    @property
    def num_cached(self) -> int:
        """Prompt tokens not computed in this prefill (what usage reports as cached)."""
        reused = sum(self.turn.spans[i].end - self.turn.spans[i].start - len(self.selected.get(i, ()))
                     for i in self.reused_spans)
        return self.num_reused_prefix + reused

    def spans_to_reuse(self) -> list[int]:
        """Spans after the reused prefix that are shared in the round or recalled from the
        agent's previous prompt."""
        end = self.num_prepared
        return [
            i for i, s in enumerate(self.turn.spans)
            if (s.key is not None or s.content in self.recall) and s.start >= self.num_reused_prefix and s.end <= end
        ]


@dataclass
class Work:
    """Forward passes a prefill needs before it goes on: `items` through the first `num_layers`
    layers (all when None), no sampling. The engine may cut them into groups and run them over
    several steps. `releases`: each item computes the rest of one agent's table (its `request_id`
    is the table id), which is complete once the item has run."""

    items: list[ScheduledRequest]
    num_layers: int | None = None
    releases: bool = False


@dataclass
class Ready:
    """Agents whose tables are complete: nothing of theirs is left to compute."""

    agents: list["AgentPrefill"]


@dataclass
class PrefillReport:
    """Seconds per phase and tokens computed (in full-model token equivalents)."""

    lookup_seconds: float = 0.0  # base KV of shared spans (+ position-corrected copies in pic)
    selection_seconds: float = 0.0
    recompute_seconds: float = 0.0
    computed_tokens: float = 0.0
    recomputed_tokens: int = 0  # selected tokens of reused spans
    reused_tokens: int = 0  # tokens of reused spans served from shared KV
    cost: object = None  # RoundCost (reuse/cost.py), by kind and beside its bound


Prefill = Generator[Work | Ready, None, PrefillReport]  # what a policy's `prefill` is

@dataclass
class Checked:
    """What the check pass measured of one agent's tokens [prefix, L-1): their fresh keys at the
    check layer ([n, Hkv, D] float32)."""

    keys: torch.Tensor


class RoundKV:
    """KV operations of a round prefill on one engine's KV manager and runner, and the round's
    master registry. Invariant: every master's slots are held by the `MasterKey` table until the
    round's prefill ends, whatever becomes of the agent that computed them (it may decode, be
    preempted or finish meanwhile)."""

    def __init__(self, kv: KVCacheManager, runner: ModelRunner, selector: Selector, check_layer: int):
        self.kv = kv
        self.runner = runner
        self.selector = selector
        self.check_layer = check_layer
        self.num_layers = len(runner.model.layers)
        # span key -> slots of its master: the span as the first agent holding it computed it, in
        # that agent's own context (see KVCollector)
        self.masters: dict[bytes, list[int]] = {}
        # span key -> per token, how much its in-round anchors' encodings disagree (anchors > 1)
        self.spread: dict[bytes, torch.Tensor] = {}

    # ------------------------------------------------------------ allocation

    def open_cached(self, request_id: str, turn: TokenizedTurn, num_tokens: int | None = None) -> AgentPrefill:
        """The agent's table, created with the prefix cache's longest hit for the turn (whole
        blocks, within its prepared tokens), grown to `num_tokens` slots (default: just the hit)."""
        kv = self.kv
        hit = kv.find_prefix_hit(turn.token_ids, turn.namespace)
        hit = PrefixHit(hit.block_ids[: turn.num_prepared // kv.block_size], hit.block_hashes)
        cached = hit.num_tokens(kv.block_size)
        copies = kv.allocate_slots(request_id, max(cached, num_tokens or 0), cached, hit)
        if copies is None:
            raise CapacityError(f"the KV pool cannot hold agent {turn.agent_id!r}'s prompt")
        self.runner.copy_blocks(copies)  # none while the hit is whole blocks; kept for the invariant
        return AgentPrefill(request_id, turn, cached, block_hashes=hit.block_hashes)

    def extend_cached(self, agent: "AgentPrefill") -> None:
        """Extend a table opened from the prefix cache by what the cache holds now (blocks that
        agents computed earlier in this round offered)."""
        kv, size = self.kv, self.kv.block_size
        have = agent.num_reused_prefix // size
        if not agent.from_prefix_cache or len(kv.get_slots(agent.table_id)) != have * size:
            return
        more = kv.cached_blocks(agent.block_hashes[have: agent.num_prepared // size])
        if more:
            kv.append_shared_slots(agent.table_id, [b * size + i for b in more for i in range(size)])
            agent.num_reused_prefix += len(more) * size

    def offer_exact_prefix(self, agent: "AgentPrefill") -> None:
        """Offer the agent's KV before its first reused span to the prefix cache (exact: computed
        in full context, or a prefix-cache hit); never what follows (blended, copies, masters)."""
        exact = min((agent.turn.spans[i].start for i in agent.reused_spans), default=agent.num_prepared)
        self.kv.offer_exact_prefix(agent.table_id, exact, agent.token_ids, agent.turn.namespace)

    def private_slots(self, table_id: str, count: int) -> list[int]:
        """Fresh slots (the KV manager evicts idle sessions if it must), else CapacityError."""
        slots = self.kv.append_private_slots(table_id, count)
        if slots is None:
            raise CapacityError(f"the KV pool cannot hold this round ({count} more tokens needed)")
        return slots

    def release_masters(self) -> None:
        """Forget this round's masters (their blocks live on while any table references them) and
        free what is left of recalled segments."""
        self.masters.clear()
        self.spread.clear()
        self.kv.free(MasterKey())
        for table_id in list(self.kv.find_kept(RecallKey)):
            self.kv.free(table_id)

    def register_masters(self, agent: "AgentPrefill") -> None:
        """Make the agent's computed shared spans the masters of spans not mastered yet."""
        for index in agent.spans_to_reuse():
            span = agent.turn.spans[index]
            if span.key is not None and span.key not in self.masters:
                slots = self.kv.get_slots(agent.table_id)[span.start:span.end]
                if not self.kv.has(MasterKey()):
                    self.kv.create_table(MasterKey())
                self.kv.append_shared_slots(MasterKey(), slots)
                self.masters[span.key] = slots

    def neutral_masters(self, agents: list["AgentPrefill"], masters: Masters) -> Generator[Work, None, int]:
        """The round's neutral row (`masters.neutral`: every shared span that two or more of the
        agents reuse), computed once in a row of its own ([span][span]..., in the order they first
        appear), so that no agent's private text (a persona, memories) colours the KV every other
        agent reads. Returns the tokens computed.

        The spans read each other in the row, as they read each other in the agents' prompts (the
        round's outputs follow one another there): on the 135M model's shuffled village round,
        computing each span in a row of its own after the prompts' first token ([sink][span])
        raised the first token's mean KL to full prefill from 0.049 to 0.50, and one row after
        that sink token read 0.057; so the row stays as it is."""
        pieces = {}
        for key in masters.neutral:
            if key not in self.masters:
                index, start = masters.where[key][0]
                pieces[key] = agents[index].token_ids[start:_span_at(agents[index], start).end]
        if not pieces:
            return 0
        token_ids = [t for piece in pieces.values() for t in piece]
        if not self.kv.has(MasterKey()):
            self.kv.create_table(MasterKey())
        slots = self.private_slots(MasterKey(), len(token_ids))
        yield Work([ScheduledRequest(MasterKey(), token_ids, range(len(token_ids)), slots, False, None)])
        start = 0
        for key, piece in pieces.items():
            self.masters[key] = slots[start:start + len(piece)]
            start += len(piece)
        return len(token_ids)

    def blend_masters(self, agents: list["AgentPrefill"], masters: Masters) -> None:
        """Make each span that several anchors computed in full (in their own contexts:
        `masters.where`) the mean of their encodings, at the first one's positions: the base every
        other agent reuses (the anchors themselves keep their exact KV)."""
        for key, sources in masters.where.items():
            if len(sources) < 2 or key not in self.masters:
                continue
            found = [(agents[i], _span_at(agents[i], start)) for i, start in sources]
            first = found[0][1]
            slots = self.private_slots(MasterKey(), first.end - first.start)
            self.spread[key] = self.runner.blend_kv([self.kv.get_slots(a.table_id)[s.start:s.end] for a, s in found],
                                                    slots, list(range(first.start, first.end)))
            self.masters[key] = slots

    def source_slots(self, agent: "AgentPrefill", index: int) -> list[int]:
        """Base KV of a reused span: the round's master if shared, else the agent's recall. (The
        agent's own recalled KV first, before the master, was measured no better in the closed
        loop and kept less shared: docs/benchmarks.md#what-agents-say-in-the-closed-loop.)"""
        span = agent.turn.spans[index]
        if span.key in self.masters:
            return self.master_slots(span.key)
        return agent.recall[span.content]

    # ------------------------------------------------------------ forward passes (generators)

    def master_slots(self, key: bytes) -> list[int]:
        return self.masters[key]

    def check(self, agents: list[AgentPrefill]) -> Generator[Work, None, list[Checked]]:
        """Fresh keys at the check layer of every token in [prefix, L-1) of each agent, computed in
        its real context through the first check_layer+1 layers, in scratch slots."""
        scratch = []
        items = []
        try:
            for index, agent in enumerate(agents):
                table_id = ScratchKey(index)
                self.kv.create_table(table_id)
                scratch.append(table_id)
                self.kv.append_shared_slots(table_id, self.kv.get_slots(agent.table_id)[: agent.num_reused_prefix])
                new = range(agent.num_reused_prefix, agent.num_prepared)
                self.private_slots(table_id, len(new))
                slots = self.kv.get_slots(table_id)
                items.append(ScheduledRequest(table_id, agent.token_ids[new.start:new.stop], new, slots, False, None))
            if items:
                yield Work(items, num_layers=self.check_layer + 1)
            return [Checked(self.runner.read_keys(self.check_layer, item.context_slots[item.positions.start:],
                                                  list(item.positions))) for item in items]
        finally:
            for table_id in scratch:
                self.kv.free(table_id)

    def deviation(self, fresh: torch.Tensor, slots: list[int], positions: range) -> torch.Tensor:
        cached = self.runner.read_keys(self.check_layer, slots, list(positions))
        return key_deviation(fresh, cached)  # [num_tokens]

    def span_scores(self, checked: Checked, rows: slice, slots: list[int], positions: range) -> torch.Tensor:
        """What the selector ranks a reused span's tokens by, from the check pass: the span is
        `rows` of the checked tokens, its base KV `slots`, read at `positions` (key deviation)."""
        return self.deviation(checked.keys[rows], slots, positions)

    def recompute(self, agents: list[AgentPrefill], positions_of: Callable[[AgentPrefill], list[int]],
                  releases: bool = False) -> Generator[Work | Ready, None, int]:
        """Compute the given positions of each agent through all layers over its fused table, in
        the agents' order. `releases`: this completes their tables (agents with nothing to
        compute are ready once the others' passes ran: their tables may read slots those passes
        write). Returns the number of tokens computed."""
        items, idle = [], []
        for agent in agents:
            positions = positions_of(agent)
            if not positions:
                idle.append(agent)
                continue
            slots = self.kv.get_slots(agent.table_id)[: positions[-1] + 1]
            token_ids = [agent.token_ids[p] for p in positions]
            items.append(ScheduledRequest(agent.table_id, token_ids, positions, slots, False, None))
        if items:
            yield Work(items, releases=releases)
        if releases and idle:
            yield Ready(idle)
        return sum(len(i.token_ids) for i in items)


def _span_at(agent: AgentPrefill, start: int) -> Span:
    return next(s for s in agent.turn.spans if s.start == start)


def private_positions(agent: AgentPrefill) -> list[int]:
    """Positions of [prefix, L-1) that are not served from shared KV: private text and the
    selected tokens of reused spans."""
    reused = set()
    for index in agent.reused_spans:
        span = agent.turn.spans[index]
        chosen = set(agent.selected.get(index, ()))
        reused.update(span.start + o for o in range(span.end - span.start) if o not in chosen)
    return [p for p in range(agent.num_reused_prefix, agent.num_prepared) if p not in reused]


def count_reuse(agents: list[AgentPrefill], report: PrefillReport) -> None:
    for agent in agents:
        for index in agent.reused_spans:
            span = agent.turn.spans[index]
            selected = len(agent.selected.get(index, ()))
            report.recomputed_tokens += selected
            report.reused_tokens += span.end - span.start - selected
