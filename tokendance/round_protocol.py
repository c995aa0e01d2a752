"""The round protocol both front doors speak, `tokendance serve` and `vllm serve` with the plugin:
the round fields of a chat request (`agent_id`, `round_id`, `round_size`, `cache_salt`) and
`POST /v1/rounds`: their limits, what a round refuses, whose cache salt an agent's turn takes, and
the shape of the answer. Plain Python, no server: each front door validates with it and builds
its answer with it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

MAX_AGENTS = 4096  # agents of one /v1/rounds request, and a chat request's round_size
MAX_ID_CHARS = 256  # agent_id, round_id
MAX_SALT_CHARS = 1024  # cache_salt
# A chat request's round fields. Only chat requests take them: a completion with one is refused.
ROUND_FIELDS = ("agent_id", "round_id", "round_size")
# Fields a /v1/rounds request (or one of its agents) does not serve; it never ignores them silently
# (and n must be 1). Its round is the request itself: no round_id or round_size of the client's.
REFUSED = ("tools", "tool_choice", "stream", "logprobs", "top_logprobs", "prompt_logprobs", "round_id", "round_size")


def refused_field(fields: Mapping[str, Any]) -> str | None:
    """The first field of a round's (or one agent's) body that a round does not serve, or None."""
    for name in REFUSED:
        value = fields.get(name)
        if not (value is None or value is False or value == [] or value == ""):
            return name
    return None


def refusal(name: str) -> str:
    """Why `name` is refused, and what to send instead."""
    if name in ROUND_FIELDS:
        return (f"/v1/rounds does not take {name}: the request is one round, answered under its own id; declare "
                "a round of chat requests with round_id and round_size instead")
    hint = (" stream each agent's chat request instead (with round_id and round_size)" if name == "stream"
            else " send the agent's turn as a chat request with round_id and round_size")
    return f"/v1/rounds does not support {name};{hint}"


def completion_refusal(name: str) -> str:
    """Why a completion with a round field is refused."""
    return f"{name} is a chat request's round field: rounds are declared on /v1/chat/completions (or /v1/rounds)"


def agent_salt(agent_id: str, client_salt: str | None) -> str:
    """The cache salt of one agent's requests inside vLLM (the plugin): reused KV is read back only
    by that agent."""
    return f"tokendance:{agent_id}" if client_salt is None else f"{client_salt}:tokendance:{agent_id}"


def turn_salt(round_salt: str | None, agent_salt: str | None) -> str | None:
    """The cache salt an agent's turn in /v1/rounds takes: its own, else the round's."""
    return agent_salt if agent_salt is not None else round_salt


def sum_usage(usages: list[Mapping[str, Any]]) -> dict:
    """A round's usage: its agents' token counts summed, cached tokens in `prompt_tokens_details`
    as a chat answer has them."""
    prompt = sum(u.get("prompt_tokens") or 0 for u in usages)
    completion = sum(u.get("completion_tokens") or 0 for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def round_answer(round_id: str, model: str, outputs: list[dict], stats: dict, **round_info) -> dict:
    """The answer to /v1/rounds: `outputs`, one per agent in the request's order ({agent_id,
    message, finish_reason, usage}, and `error` for an agent that failed), `round` ({round_id,
    num_agents} and what the server adds), their `usage` summed, and the server's `stats`."""
    return {"id": round_id, "object": "round", "created": int(time.time()), "model": model,
            "round": {"round_id": round_id, "num_agents": len(outputs), **round_info},
            "outputs": outputs, "usage": sum_usage([o["usage"] for o in outputs]), "stats": stats}
