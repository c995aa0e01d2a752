"""Multi-agent debate (Du et al.): agents answer one question; from the second round each agent
sees every other agent's previous answer (not its own) and revises."""

from __future__ import annotations

from tokendance.errors import InvalidRequestError
from tokendance.reuse.segments import AgentTurn
from tokendance.workloads import text
from tokendance.workloads.base import History, Workload

QUESTIONS = (
    "Should a small town spend its budget on a new library or on repairing its roads?",
    "Is it better for a city to ban cars from its centre or to build more parking?",
    "Should schools replace homework with longer school days?",
    "Would a four-day work week make a town's shops more or less successful?",
    "Should the river be dammed to produce electricity for the town?",
)
STANCES = ("a cautious economist", "an optimistic engineer", "a sceptical historian", "a pragmatic mayor",
           "an idealistic student", "a careful doctor", "a thrifty shopkeeper", "a curious scientist")


class Debate(Workload):
    """3-8 agents; round 1: [role][question]; round r: + its own earlier answers and the other
    agents' answers of each earlier round (exclude-self), then "revise"; answers 150-300 tokens."""

    name = "debate"
    default_agents = 3
    default_order = "exclude-self"

    def __init__(self, num_agents=None, seed=0, order=None):
        super().__init__(num_agents, seed, order)
        if not 2 <= len(self.agents) <= len(STANCES):
            raise InvalidRequestError(f"debate: 2 to {len(STANCES)} agents, got {len(self.agents)}")
        self.question = self.rng("question").choice(QUESTIONS)

    def turns(self, round_index: int, history: History) -> list[AgentTurn]:
        self.check_history(round_index, history)
        turns = []
        for i, agent in enumerate(self.agents):
            messages = [
                {"role": "system", "content": f"You are {self.names[agent]}, {STANCES[i]}, in a debate. Give reasons."},
                {"role": "user", "content": self.question},
            ]
            for r in range(round_index):
                messages.append({"role": "assistant", "content": history[r][agent]})
                messages += self.gathered(agent, history[r], r)
                messages.append({"role": "user", "content": "These are the other debaters' answers. Revise your answer."})
            turns.append(AgentTurn(agent, messages))
        return turns

    def output_tokens(self, agent: str, round_index: int) -> int:
        return self.rng("output-length", agent, round_index).randint(150, 300)

    def synthetic_output(self, agent: str, round_index: int) -> str:
        rng = self.rng("answer", agent, round_index)
        others = [n for a, n in self.names.items() if a != agent]
        return text.utterance(rng, text.lognormal_int(rng, 150, 110, 210, sigma=0.2), others)
