"""One reuse policy per mode, chosen once when the engine's round runner is built."""

from __future__ import annotations

from tokendance.config import REUSE_MODES
from tokendance.errors import InvalidRequestError
from tokendance.reuse.collector import KVCollector
from tokendance.reuse.per_request import PerRequestReuse
from tokendance.reuse.round_kv import ReusePolicy, RoundKV


def make_policy(name: str, round_kv: RoundKV, collective_scope: str = "agent") -> ReusePolicy:
    if name not in REUSE_MODES:
        raise InvalidRequestError(f"reuse must be one of {', '.join(REUSE_MODES)}, got {name!r}")
    if collective_scope not in ("agent", "block"):
        raise InvalidRequestError(f"collective_selection must be 'agent' or 'block', got {collective_scope!r}")
    if name == "pic":
        return PerRequestReuse(round_kv)
    if name == "tokendance":
        return KVCollector(round_kv, collective_scope)
    return ReusePolicy(name, round_kv)  # full, prefix: the scheduler computes whole prompts
