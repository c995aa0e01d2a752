"""TokenDance: a serving engine for multi-agent LLM applications.

The public names are imported on first use (`tokendance.LLM` loads the engine, and torch with it),
so a module of the package that needs no engine (the vLLM plugin's scheduler side, the round
protocol) imports without one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and the API reference (docs/python-api.md) read
    from tokendance.config import EngineConfig
    from tokendance.engine.round_stats import RoundStats
    from tokendance.engine.rounds import RoundResult
    from tokendance.errors import CapacityError, ContextLengthError, InvalidRequestError, ModelLoadError, TokenDanceError
    from tokendance.llm import LLM
    from tokendance.outputs import RequestOutput
    from tokendance.reuse.segments import AgentTurn, Segment
    from tokendance.sampling import SamplingParams

# Each public name and the module that defines it (the imports above, made on first use).
_EXPORTS = {
    "LLM": "tokendance.llm",
    "SamplingParams": "tokendance.sampling",
    "RequestOutput": "tokendance.outputs",
    "AgentTurn": "tokendance.reuse.segments",
    "Segment": "tokendance.reuse.segments",
    "RoundResult": "tokendance.engine.rounds",
    "RoundStats": "tokendance.engine.round_stats",
    "EngineConfig": "tokendance.config",
    "TokenDanceError": "tokendance.errors",
    "InvalidRequestError": "tokendance.errors",
    "ContextLengthError": "tokendance.errors",
    "CapacityError": "tokendance.errors",
    "ModelLoadError": "tokendance.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokendance' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once: the next lookup finds it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
