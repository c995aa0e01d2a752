"""AgentSociety-style social simulation: many agents with long profiles and memories; each round
every agent reads the same environment report and the feed of every agent's last message."""

from __future__ import annotations

from tokendance.reuse.segments import AgentTurn
from tokendance.workloads import text
from tokendance.workloads.base import History, Workload

CITY = "Harbor City"


class AgentSociety(Workload):
    """Per agent and round: [profile ~220 tok][20 memory lines ~40 tok each][own chat history,
    +~25 tok per round][~40-token environment block, shared][feed: every agent's last message,
    ~21 tok each, same order for all][instruction]; says 20-70 tokens."""

    name = "agent-society"
    default_agents = 100
    default_order = "same"

    def __init__(self, num_agents=None, seed=0, order=None, num_memories: int = 20):
        super().__init__(num_agents, seed, order)
        self.num_memories = num_memories
        self.profiles = {a: self._profile(a) for a in self.agents}
        self.memory_text = {a: self._memories(a) for a in self.agents}

    def _profile(self, agent: str) -> str:
        rng = self.rng("profile", agent)
        words = text.lognormal_int(rng, 170, 140, 230, sigma=0.12)
        return text.take_words(text.persona_sentences(rng, self.names[agent], CITY), words)

    def _memories(self, agent: str) -> str:
        rng = self.rng("memories", agent)
        names = [n for a, n in self.names.items() if a != agent] or [self.names[agent]]
        lines = []
        for i in range(self.num_memories):
            clock = text.clock(rng, 1 + i // 4)
            lines.append(f"{clock} {text.memory_line(rng, names)} {text.memory_line(rng, names)}")
        return "Memories:\n" + "\n".join(lines)

    def environment(self, round_index: int) -> str:
        rng = self.rng("environment", round_index)
        return (
            f"Environment, day {round_index + 1}: the weather is {rng.choice(['sunny', 'rainy', 'windy', 'cold', 'hot'])}; "
            f"news: {rng.choice(text.TOPICS)} and {rng.choice(text.TOPICS)}; prices are "
            f"{rng.choice(['rising', 'stable', 'falling'])}; {rng.choice(text.PLACES)} is crowded and {rng.choice(text.PLACES)} is closed for repairs."
        )

    def instruction(self, agent: str) -> str:
        first = self.names[agent].split()[0]
        return f"You are {first}. Post one short message to the feed about your day or a reply to someone."

    def turns(self, round_index: int, history: History) -> list[AgentTurn]:
        self.check_history(round_index, history)
        said = history[round_index - 1] if round_index else self.synthetic_outputs(-1)
        environment = {"role": "user", "content": self.environment(round_index)}
        turns = []
        for agent in self.agents:
            own = [{"role": "assistant", "content": history[r][agent]} for r in range(round_index)]
            messages = [
                {"role": "system", "content": self.profiles[agent]},
                {"role": "user", "content": self.memory_text[agent]},
                *own,
                environment,
                *self.gathered(agent, said, round_index),
                {"role": "user", "content": self.instruction(agent)},
            ]
            turns.append(AgentTurn(agent, messages))
        return turns

    def output_tokens(self, agent: str, round_index: int) -> int:
        return self.rng("output-length", agent, round_index).randint(20, 70)

    def synthetic_output(self, agent: str, round_index: int) -> str:
        rng = self.rng("post", agent, round_index)
        others = [n for a, n in self.names.items() if a != agent] or [self.names[agent]]
        return text.utterance(rng, text.lognormal_int(rng, 12, 6, 30, sigma=0.25), others)
