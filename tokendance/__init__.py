"""TokenDance: a serving engine for multi-agent LLM applications."""

from tokendance.config import EngineConfig
from tokendance.engine.round_stats import RoundStats
from tokendance.engine.rounds import RoundResult
from tokendance.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
    TokenDanceError,
)
from tokendance.llm import LLM
from tokendance.outputs import RequestOutput
from tokendance.reuse.segments import AgentTurn, Segment
from tokendance.sampling import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "AgentTurn",
    "Segment",
    "RoundResult",
    "RoundStats",
    "EngineConfig",
    "TokenDanceError",
    "InvalidRequestError",
    "ContextLengthError",
    "CapacityError",
    "ModelLoadError",
]
