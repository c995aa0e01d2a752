"""What every workload generator provides: rounds of agent turns as chat messages.

A workload is a pure function of its seed and of the outputs of the earlier rounds (`history`):
closed-loop simulations pass what the model said, open-loop runs pass `synthetic_outputs`, so
every reuse mode sees exactly the same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from tokendance.errors import InvalidRequestError
from tokendance.reuse.segments import AgentTurn
from tokendance.workloads.text import full_name

ORDERS = ("same", "shuffle", "exclude-self")
History = Sequence[Mapping[str, str]]  # per earlier round: agent id -> what it said


class Workload:
    """Base of the generators: agent ids, display names, the ordering policy of shared blocks and
    the per-round output lengths. Subclasses build `turns` from their own segments."""

    name = "workload"
    default_agents = 8
    default_order = "shuffle"

    def __init__(self, num_agents: int | None = None, seed: int = 0, order: str | None = None):
        num_agents = self.default_agents if num_agents is None else num_agents
        order = order or self.default_order
        if not isinstance(num_agents, int) or num_agents < 1:
            raise InvalidRequestError(f"{self.name}: the number of agents must be a positive integer, got {num_agents!r}")
        if order not in ORDERS:
            raise InvalidRequestError(f"{self.name}: order must be one of {', '.join(ORDERS)}, got {order!r}")
        self.seed, self.order = seed, order
        self.agents = [f"agent{i:03d}" for i in range(num_agents)]
        names_rng = self.rng("names")
        self.names: dict[str, str] = {}
        for agent in self.agents:
            name = full_name(names_rng)
            while name in self.names.values():
                name = full_name(names_rng)
            self.names[agent] = name

    def rng(self, *key) -> random.Random:
        """A generator fixed by the seed and `key` (string seeds are hashed deterministically)."""
        return random.Random("|".join(map(str, (self.name, self.seed, *key))))

    # ------------------------------------------------------------ what subclasses define

    def turns(self, round_index: int, history: History) -> list[AgentTurn]:
        raise NotImplementedError

    def output_tokens(self, agent: str, round_index: int) -> int:
        """How many tokens the agent says in this round (open loop decodes exactly this many)."""
        raise NotImplementedError

    def synthetic_output(self, agent: str, round_index: int) -> str:
        raise NotImplementedError

    def grade(self, agent: str, round_index: int, output: str) -> bool | None:
        """Whether the agent's output is right, for workloads with a ground truth (else None)."""
        return None

    # ------------------------------------------------------------ shared helpers

    def synthetic_outputs(self, round_index: int) -> dict[str, str]:
        return {a: self.synthetic_output(a, round_index) for a in self.agents}

    def check_history(self, round_index: int, history: History) -> None:
        if round_index < 0 or len(history) < round_index:
            raise InvalidRequestError(f"round {round_index} needs the outputs of the {round_index} rounds before it")
        for r in range(round_index):
            missing = [a for a in self.agents if a not in history[r]]
            if missing:
                raise InvalidRequestError(f"round {r} history lacks agents {', '.join(missing[:3])}")

    def gathered(self, agent: str, said: Mapping[str, str], round_index: int) -> list[dict]:
        """The All-Gather block `agent` sees: one user message per speaker, ordered by the policy."""
        speakers = [a for a in self.agents if a in said and not (self.order == "exclude-self" and a == agent)]
        if self.order == "shuffle":
            self.rng("order", agent, round_index).shuffle(speakers)
        return [{"role": "user", "content": f"{self.names[a]}: {said[a]}"} for a in speakers]
