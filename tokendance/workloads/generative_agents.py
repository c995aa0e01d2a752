"""Generative Agents (Park et al.): a town of agents; each round every agent sees its persona, the
memories its retrieval returned, every agent's last utterance and an instruction, and says what it
does next."""

from __future__ import annotations

from functools import lru_cache

from tokendance.reuse.segments import AgentTurn
from tokendance.workloads import text
from tokendance.workloads.base import History, Workload

TOWN = "Willow Creek"


class GenerativeAgents(Workload):
    """Per agent and round: [persona ~150 tok][30-45 memory lines, ~30% new each round]
    [every agent's last utterance, per-agent shuffled][~70-token instruction]; says 30-60 tokens."""

    name = "generative-agents"
    default_agents = 25
    default_order = "shuffle"

    def __init__(self, num_agents=None, seed=0, order=None, memory_change: float = 0.3,
                 memory_lines: tuple[int, int] = (30, 45)):
        super().__init__(num_agents, seed, order)
        self.memory_change, self.memory_lines = memory_change, memory_lines
        self.personas = {a: self._persona(a) for a in self.agents}

    def _persona(self, agent: str) -> str:
        rng = self.rng("persona", agent)
        words = text.lognormal_int(rng, 105, 85, 150, sigma=0.15)
        return text.take_words(text.persona_sentences(rng, self.names[agent], TOWN), words)

    @lru_cache(maxsize=None)
    def memories(self, agent: str, round_index: int) -> tuple[str, ...]:
        """What retrieval returns this round: the previous round's lines with ~memory_change of
        them replaced by new ones (appended, as newer memories are)."""
        names = [n for a, n in self.names.items() if a != agent] or [self.names[agent]]
        low, high = self.memory_lines
        rng = self.rng("memories", agent, round_index)
        if round_index == 0:
            return tuple("- " + text.memory_line(rng, names) for _ in range(rng.randint(low, high)))
        lines = list(self.memories(agent, round_index - 1))
        for _ in range(round(self.memory_change * len(lines))):
            lines.pop(rng.randrange(len(lines)))
        target = rng.randint(low, high)
        lines += ["- " + text.memory_line(rng, names) for _ in range(max(0, target - len(lines)))]
        return tuple(lines)

    def instruction(self, agent: str, round_index: int) -> str:
        rng = self.rng("instruction", agent, round_index)
        name = self.names[agent]
        first = name.split()[0]
        return (
            f"It is day {round_index + 1}, {rng.randrange(7, 22):02d}:00. {name} is at {rng.choice(text.PLACES)}, "
            f"feeling {rng.choice(text.FEELINGS)}. Given {first}'s memories and what everyone just said, what does "
            f"{first} say next? Answer as {first}, in the first person, in one or two short sentences, "
            "and do not repeat what others said."
        )

    def turns(self, round_index: int, history: History) -> list[AgentTurn]:
        self.check_history(round_index, history)
        said = history[round_index - 1] if round_index else self.synthetic_outputs(-1)
        turns = []
        for agent in self.agents:
            memories = "\n".join(self.memories(agent, round_index))
            messages = [
                {"role": "system", "content": self.personas[agent]},
                {"role": "user", "content": f"Relevant memories of {self.names[agent]}:\n{memories}"},
                *self.gathered(agent, said, round_index),
                {"role": "user", "content": self.instruction(agent, round_index)},
            ]
            turns.append(AgentTurn(agent, messages))
        return turns

    def output_tokens(self, agent: str, round_index: int) -> int:
        return self.rng("output-length", agent, round_index).randint(30, 60)

    def synthetic_output(self, agent: str, round_index: int) -> str:
        rng = self.rng("utterance", agent, round_index)
        others = [n for a, n in self.names.items() if a != agent] or [self.names[agent]]
        return text.utterance(rng, text.lognormal_int(rng, 15, 5, 60), others)
