"""Where a round prefill's compute goes, by kind, beside its bound.

The bound is what collective reuse cannot avoid: every token no table held before the round,
computed once (a shared span once for all its holders), plus the recompute ratio of every token
that could be served from reuse (other holders' copies of shared spans, the agent's recalled
segments), plus each prompt's last token. Counts are in full-model token equivalents.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from tokendance.reuse.round_kv import AgentPrefill


@dataclass
class RoundCost:
    new_shared: int = 0  # shared-span tokens computed the first time in the round (a master's)
    shared_again: int = 0  # shared-span tokens computed in full by another holder
    private: int = 0  # private text: no other agent of the round holds it, no session had it
    recomputed: int = 0  # selected tokens of reused spans (shared or recalled)
    check: float = 0.0  # the check pass that selects them
    last: int = 0  # the tokens the scheduler computes: each prompt's last one (or scored tail)
    bound: float = 0.0

    @property
    def total(self) -> float:
        return self.new_shared + self.shared_again + self.private + self.recomputed + self.check + self.last

    def add(self, other: RoundCost) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def account(agents: list[AgentPrefill], ratio: float, check: float, neutral: int = 0) -> RoundCost:
    """The cost of a prefill whose agents have their reused spans and selections set; `neutral`:
    shared-span tokens computed once in no agent's context (neutral masters)."""
    cost, seen, reusable, distinct = RoundCost(check=check, new_shared=neutral), set(), 0, neutral
    for agent in agents:
        cost.last += len(agent.token_ids) - agent.num_prepared
        reused = set(agent.reused_spans)
        for index, span in enumerate(agent.turn.spans):
            count = min(span.end, agent.num_prepared) - max(span.start, agent.num_reused_prefix)
            if count <= 0:
                continue
            if index in reused:
                cost.recomputed += len(agent.selected.get(index, ()))
                reusable += count
            elif span.key is None:
                cost.private += count
                distinct += count
            elif span.key in seen:
                cost.shared_again += count
                reusable += count
            else:
                cost.new_shared += count
                distinct += count
                seen.add(span.key)
    cost.bound = distinct + ratio * reusable + cost.last
    return cost
