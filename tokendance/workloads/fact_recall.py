"""Fact recall, a task with a ground truth: each round every agent states three facts about
itself, every statement is gathered into every agent's prompt (shared blocks, in each agent's own
order), and each agent is asked one fact stated by another agent. `grade` says whether the
answer names it, so a reuse mode's effect on what agents get right is measured, not guessed.

The statements are the workload's own in every loop (what agents answer is graded, not fed back):
a round's prompts are the same whatever the earlier rounds said.
"""

from __future__ import annotations

import re

from tokendance.reuse.segments import AgentTurn
from tokendance.workloads import text
from tokendance.workloads.base import History, Workload

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "grey", "pink", "brown", "teal")
PETS = ("Biscuit", "Pepper", "Luna", "Milo", "Rocky", "Daisy", "Oscar", "Ziggy", "Mango", "Clover", "Pickles",
        "Juniper", "Waffles", "Nutmeg", "Sprout", "Tofu")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Denver", "Kyoto", "Dublin", "Lima", "Hanoi", "Perth", "Quebec", "Seville",
          "Tallinn", "Cusco", "Bergen", "Malaga", "Ottawa")
# attribute -> how a statement says it, what the values are
ATTRIBUTES = {
    "locker number": ("my locker number is {}", [str(n) for n in range(100, 1000)]),
    "favourite colour": ("my favourite colour is {}", list(COLOURS)),
    "dog's name": ("my dog is called {}", list(PETS)),
    "home town": ("I grew up in {}", list(CITIES)),
    "lucky number": ("my lucky number is {}", [str(n) for n in range(10, 100)]),
}
FACTS_PER_AGENT = 3


class FactRecall(Workload):
    """Per agent and round: [persona][every agent's statement, ~35 tokens each, per-agent
    shuffled][a question about another agent's fact]; answers in 16 tokens."""

    name = "fact-recall"
    default_agents = 8
    default_order = "shuffle"

    def facts(self, round_index: int) -> dict[str, dict[str, str]]:
        """agent -> attribute -> value; within a round every value of an attribute is unique while
        there are enough (so an answer naming another agent's value is wrong)."""
        rng = self.rng("facts", round_index)
        pools = {a: rng.sample(values, len(values)) for a, (_, values) in ATTRIBUTES.items()}
        found = {}
        for i, agent in enumerate(self.agents):
            chosen = rng.sample(sorted(ATTRIBUTES), FACTS_PER_AGENT)
            found[agent] = {a: pools[a][i % len(pools[a])] for a in chosen}
        return found

    def question(self, agent: str, round_index: int) -> tuple[str, str]:
        """(the agent asked about, the attribute)."""
        rng = self.rng("question", agent, round_index)
        others = [a for a in self.agents if a != agent] or [agent]
        subject = rng.choice(others)
        return subject, rng.choice(sorted(self.facts(round_index)[subject]))

    def answer(self, agent: str, round_index: int) -> str:
        subject, attribute = self.question(agent, round_index)
        return self.facts(round_index)[subject][attribute]

    def grade(self, agent: str, round_index: int, output: str) -> bool:
        """The answer's first line names the fact (a whole word, any case)."""
        first = output.strip().split("\n", 1)[0]
        return re.search(rf"\b{re.escape(self.answer(agent, round_index))}\b", first, re.IGNORECASE) is not None

    def turns(self, round_index: int, history: History) -> list[AgentTurn]:
        self.check_history(round_index, history)
        said = self.synthetic_outputs(round_index)
        turns = []
        for agent in self.agents:
            subject, attribute = self.question(agent, round_index)
            messages = [
                {"role": "system", "content": f"You are {self.names[agent]}. Your neighbours introduce themselves; "
                                              "answer questions about them from what they said."},
                *self.gathered(agent, said, round_index),
                {"role": "user", "content": f"What is {self.names[subject]}'s {attribute}? "
                                            f"Answer with the {attribute} only."},
            ]
            turns.append(AgentTurn(agent, messages))
        return turns

    def output_tokens(self, agent: str, round_index: int) -> int:
        return 16

    def synthetic_output(self, agent: str, round_index: int) -> str:
        """The agent's statement of round `round_index`: a greeting and its three facts."""
        rng = self.rng("statement", agent, round_index)
        facts = self.facts(max(round_index, 0))[agent]
        parts = [ATTRIBUTES[a][0].format(v) for a, v in facts.items()]
        return (f"Hello, I work near {rng.choice(text.PLACES)}. "
                f"{parts[0][0].upper()}{parts[0][1:]}, {parts[1]} and {parts[2]}.")
