"""Multi-agent workload generators (deterministic by seed): `make_workload(name, ...)`."""

from __future__ import annotations

from tokendance.errors import InvalidRequestError
from tokendance.workloads.agent_society import AgentSociety
from tokendance.workloads.base import ORDERS, History, Workload
from tokendance.workloads.debate import Debate
from tokendance.workloads.fact_recall import FactRecall
from tokendance.workloads.generative_agents import GenerativeAgents

WORKLOADS: dict[str, type[Workload]] = {w.name: w for w in (GenerativeAgents, AgentSociety, Debate, FactRecall)}

__all__ = ["ORDERS", "WORKLOADS", "AgentSociety", "Debate", "FactRecall", "GenerativeAgents", "History", "Workload", "make_workload"]


def make_workload(name: str, num_agents: int | None = None, seed: int = 0, order: str | None = None) -> Workload:
    if name not in WORKLOADS:
        raise InvalidRequestError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](num_agents, seed=seed, order=order)
