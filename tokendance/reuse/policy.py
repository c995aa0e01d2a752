"""The reuse policy interface, the two policies that prepare nothing, and `make_policy`.

A policy (one per engine, chosen by name from `tokendance.registry.REUSE_POLICIES`) prepares
each agent's table before the scheduler computes its last prompt token and decodes:
`open_table` (the table starts from what the agent's session or the prefix cache holds),
`prefill` (all agents of a round together: a generator of the passes it needs, `Work`, and the
agents whose tables are complete, `Ready`), `finish` (once an agent's table is complete, before
the scheduler takes it over) and `end_round`. Its class attributes say what the engine must
provide. A new policy is a subclass in a module of its own plus one line in the registry.
"""

from __future__ import annotations

from tokendance import registry
from tokendance.reuse.round_kv import AgentPrefill, Prefill, PrefillReport, Ready, RoundKV
from tokendance.reuse.segments import TokenizedTurn


class ReusePolicy:
    """How a mode prepares a round's tables. The base prepares nothing: the scheduler computes
    whole prompts."""

    name = ""  # its registry name
    prepares_tables = False  # False: the scheduler computes whole prompts
    keeps_sessions = False  # True: agents' tables are kept between rounds (SessionKey)
    enables_prefix_caching = True  # False: the engine's KV manager caches no prefix at all

    def __init__(self, round_kv: RoundKV, anchors: int = 1, masters: str = "agent"):
        self.round_kv = round_kv

    def open_table(self, request_id: str, turn: TokenizedTurn) -> AgentPrefill:
        """Create the table `request_id` holding what is reusable as a prefix; nothing computed."""
        raise NotImplementedError

    def prefill(self, agents: list[AgentPrefill]) -> Prefill:
        """Prepare every agent's table for [0, L-1): a generator of `Work` and `Ready` (every
        agent is eventually ready, through a `Ready` or a releasing `Work`); returns the report."""
        yield Ready(agents)
        return PrefillReport()

    def finish(self, agent: AgentPrefill) -> None:
        """Once the agent's table covers [0, L-1), before the scheduler takes it over."""

    def end_round(self) -> None:
        self.round_kv.release_masters()


class FullRecompute(ReusePolicy):
    """No reuse at all: every prompt is computed whole, no prefix is cached."""

    name = "full"
    enables_prefix_caching = False


class PrefixCaching(ReusePolicy):
    """Prefix caching only: exact, and blind to shared spans at other positions."""

    name = "prefix"


def policy_class(name: str) -> type[ReusePolicy]:
    return registry.load(registry.REUSE_POLICIES[registry.check("reuse", name, registry.REUSE_POLICIES)])


def make_policy(name: str, round_kv: RoundKV, anchors: int = 1, masters: str = "agent") -> ReusePolicy:
    return policy_class(name)(round_kv, anchors, masters)
