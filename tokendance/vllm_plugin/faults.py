"""Planted faults: a named failpoint at each stage of the connector, which fails with a set
probability (`kv_connector_extra_config` `"faults": {"<stage>": p}`, `"all"` for every stage; off by
default), so that a run shows what the connector's own failures cost: time, never an answer, a
block or a pin. Each planted fault is raised where a real failure of that stage would be, handled
by the same code, and counted apart from real ones (`faults_planted{stage}` on `/metrics`).
Plain Python, shared by the scheduler side and the workers; every rank draws the same sequence."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping

# stage -> where it fires
STAGES = {
    "plan": "a request joins its round (the round book's planning)",
    "claim": "a member claims its range (vLLM asks what it finds)",
    "commit": "vLLM allocated a claim (the round book commits it)",
    "step_end": "the scheduler side ends a step (the workers' orders, pins released)",
    "report": "the scheduler side reads the workers' report (saves done, blocks that failed)",
    "finish": "a member's request finishes (its session kept, its save ordered)",
    "setup": "the workers build their pass (the model and KV layouts vLLM hands over)",
    "pass": "the workers' pass over a step's mirrors",
    "capture": "the store takes the pieces a pass read as their masters",
    "store_save": "the store copies a finished request's KV",
    "store_load": "a pass reads an agent's history back from the store",
    "store_drop": "the store forgets an entry or a closed round",
}


class PlantedFault(RuntimeError):
    """A fault planted at `stage` (`Faults.fire`)."""

    def __init__(self, stage: str):
        super().__init__(f"planted fault at stage {stage!r}")
        self.stage = stage


def check_rates(rates) -> dict[str, float]:
    """The rates by stage, refused by name where a stage is unknown or a rate is not in [0, 1]."""
    if not isinstance(rates, Mapping):
        raise ValueError(f"TokenDanceConnector: faults must be an object of stage -> probability, got {rates!r}")
    for stage, rate in rates.items():
        if stage != "all" and stage not in STAGES:
            raise ValueError(f"TokenDanceConnector: faults: unknown stage {stage!r}; known: all, {', '.join(STAGES)}")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"TokenDanceConnector: faults.{stage} must be a probability in [0, 1], got {rate!r}")
    return {stage: float(rates.get(stage, rates.get("all", 0.0))) for stage in STAGES}


class Faults:
    """`fire(stage)` raises `PlantedFault` with the stage's probability; `planted`: how many fired
    by stage since `take_counts` last asked."""

    def __init__(self, rates: Mapping[str, float] | None = None, seed: int = 0):
        self.rates = check_rates(rates or {})
        self.random = random.Random(seed)
        self.planted: Counter = Counter()

    def fire(self, stage: str) -> None:
        rate = self.rates[stage]
        if rate and (rate >= 1 or self.random.random() < rate):
            self.planted[stage] += 1
            raise PlantedFault(stage)

    def take_counts(self) -> dict[str, int]:
        counts, self.planted = {f"faults_planted.{s}": n for s, n in self.planted.items()}, Counter()
        return counts
