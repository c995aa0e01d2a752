"""The round protocol both front doors speak, `tokendance serve` and `vllm serve` with the plugin:
the round fields of a chat request (`agent_id`, `round_id`, `round_size`, `cache_salt`) and
`POST /v1/rounds`: their limits, what a round refuses, whose cache salt an agent's turn takes, and
the shape of the answer. Plain Python, no server.

Every rule on a round field or a round's shape is written here once: `check_chat_fields`,
`check_completion_fields` and `check_round_request` read a request's JSON body before anything
else does (the server's pydantic models call them before they read the body; the plugin's
endpoint calls them on vLLM's body), and refuse one mistake at a time with a `RoundFieldError`
naming its field, which each door answers as its 400."""

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
# Agent ids the servers give agents of their own (the plugin's gathered conversations and round
# members without an agent_id): a client's agent may not take one, whichever door it uses.
RESERVED_AGENT_PREFIXES = ("conversation-", "anonymous-")
# The answer's `stats`, the same fields through both doors; a figure a door cannot know is null.
STATS_FIELDS = ("mode", "num_agents", "num_waves", "round_seconds", "prefill_seconds", "prompt_tokens",
                "computed_tokens", "reused_tokens", "kv_bytes_per_agent", "compression", "shared_compression",
                "diff_blocks", "repeated_replies")


SUMMED_STATS = ("num_waves", "prompt_tokens", "computed_tokens", "reused_tokens", "diff_blocks", "repeated_replies")


class RoundFieldError(Exception):
    """A round field or a round's shape that a front door refuses with a 400: the message, the field
    it names (`param`, dotted as `agents.1.cache_salt`; None: the body) and the error code
    (`invalid_value`, or `unsupported_parameter` for a field a round does not serve)."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


# ---------------------------------------------------------------- the checks


def check_chat_fields(body: Any) -> None:
    """A chat request's round fields (a body that is no JSON object is left to the door)."""
    if not isinstance(body, Mapping):
        return
    _check_text(body, "cache_salt", MAX_SALT_CHARS)
    _check_agent_id(body, "", required=False)
    _check_text(body, "round_id", MAX_ID_CHARS)
    size = body.get("round_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_AGENTS):
        raise RoundFieldError(f"round_size must be an integer in [1, {MAX_AGENTS}]", "round_size")
    if size is not None and body.get("round_id") is None:
        raise RoundFieldError("round_size needs a round_id (it counts the turns of a declared round)", "round_size")
    if body.get("agent_id") is None and body.get("round_id") is None:
        return
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise RoundFieldError("n must be 1 for an agent's turn (agent_id, round_id)", "n")
    if body.get("prompt_logprobs") is not None:
        raise RoundFieldError("prompt_logprobs is not served in rounds (agent_id, round_id)", "prompt_logprobs",
                              "unsupported_parameter")


def check_completion_fields(body: Any) -> None:
    """A completion's: no round field (rounds are declared on chat requests), a well-formed salt."""
    if not isinstance(body, Mapping):
        return
    name = next((n for n in ROUND_FIELDS if body.get(n) is not None), None)
    if name is not None:
        raise RoundFieldError(completion_refusal(name), name, "unsupported_parameter")
    _check_text(body, "cache_salt", MAX_SALT_CHARS)


def check_round_request(body: Any) -> None:
    """A /v1/rounds body: 1 to MAX_AGENTS agents, each an object with a distinct agent_id and a
    non-empty messages list; no refused field and n 1, in the round and in each agent; well-formed
    salts; an agent's model, if any, the round's. The messages themselves are each door's."""
    if not isinstance(body, Mapping):
        raise RoundFieldError("the body must be a JSON object", None)
    agents = body.get("agents")
    if not isinstance(agents, list) or not 0 < len(agents) <= MAX_AGENTS:
        raise RoundFieldError(f"agents must be a list of 1 to {MAX_AGENTS} agents ({{agent_id, messages}})", "agents")
    _check_turn(body, "")
    for i, agent in enumerate(agents):
        prefix = f"agents.{i}."
        if not isinstance(agent, Mapping):
            raise RoundFieldError(f"agents.{i} must be an object {{agent_id, messages}}", f"agents.{i}")
        _check_agent_id(agent, prefix, required=True)
        messages = agent.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RoundFieldError(f"{prefix}messages must be a non-empty list", f"{prefix}messages")
        _check_turn(agent, prefix)
        if agent.get("model") is not None and agent["model"] != body.get("model"):
            raise RoundFieldError("model cannot differ per agent: a round runs on the request's model",
                                  f"{prefix}model", "unsupported_parameter")
    agent_ids = [agent["agent_id"] for agent in agents]
    if len(set(agent_ids)) != len(agent_ids):
        raise RoundFieldError("agent ids of a round must be distinct", "agents")


def _check_turn(fields: Mapping, prefix: str) -> None:
    """What a round and each of its agents share: no refused field, n 1, a well-formed salt."""
    name = refused_field(fields)
    if name is not None:
        raise RoundFieldError(refusal(name), prefix + name, "unsupported_parameter")
    if fields.get("n") not in (None, 1) or isinstance(fields.get("n"), bool):
        raise RoundFieldError("n must be 1 in a round (one turn per agent)", f"{prefix}n", "unsupported_parameter")
    _check_text(fields, "cache_salt", MAX_SALT_CHARS, prefix)


def _check_agent_id(fields: Mapping, prefix: str, required: bool) -> None:
    agent_id = fields.get("agent_id")
    if agent_id is None and required:
        raise RoundFieldError(f"{prefix}agent_id is required (it names the agent's session)", f"{prefix}agent_id")
    _check_text(fields, "agent_id", MAX_ID_CHARS, prefix)
    if agent_id is not None and agent_id.startswith(RESERVED_AGENT_PREFIXES):
        raise RoundFieldError(f"{prefix}agent_id may not start with {' or '.join(RESERVED_AGENT_PREFIXES)}: the "
                              "server names its own agents so", f"{prefix}agent_id")


def _check_text(fields: Mapping, name: str, limit: int, prefix: str = "") -> None:
    """`name`, if given, a string of 1 to `limit` characters."""
    value = fields.get(name)
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= limit):
        raise RoundFieldError(f"{prefix}{name} must be a string of 1 to {limit} characters", prefix + name)


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


def turn_usage(prompt: int | None, completion: int | None, cached: int | None) -> dict:
    """One agent's usage as a chat answer has it (cached tokens in `prompt_tokens_details`); null:
    a count the server did not report."""
    total = None if prompt is None or completion is None else prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sum_usage(usages: list[Mapping[str, Any]]) -> dict:
    """A round's usage: its agents' token counts summed (a count not reported counts 0)."""
    return turn_usage(sum(u.get("prompt_tokens") or 0 for u in usages),
                      sum(u.get("completion_tokens") or 0 for u in usages),
                      sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages))


def agent_output(agent_id: str, content: str, finish_reason: str | None, usage: Mapping[str, Any],
                 failure: str | None = None) -> dict:
    """One agent's entry of a round's answer. An agent whose computation failed (`failure`: why)
    carries its error and finish_reason "error" while the others carry their replies: a round
    answers 200 unless the request itself is refused."""
    entry = {"agent_id": agent_id, "message": {"role": "assistant", "content": content},
             "finish_reason": "error" if failure is not None else finish_reason, "usage": dict(usage)}
    if failure is not None:
        entry["error"] = {"message": f"the engine failed on this agent ({failure})", "type": "server_error",
                          "param": None, "code": "agent_failed"}
    return entry


def round_answer(round_id: str, model: str, outputs: list[dict], stats: Mapping[str, Any],
                 index: int | None = None) -> dict:
    """The answer to /v1/rounds: `outputs`, one per agent in the request's order (`agent_output`),
    `round` ({round_id, num_agents, index}: the server's count of rounds, null where it keeps
    none), their `usage` summed, and `stats` with every field of STATS_FIELDS (null where the door
    cannot know it). `model`: the server's configured model name."""
    assert set(stats) <= set(STATS_FIELDS), set(stats) - set(STATS_FIELDS)
    return {"id": round_id, "object": "round", "created": int(time.time()), "model": model,
            "round": {"round_id": round_id, "num_agents": len(outputs), "index": index},
            "outputs": outputs, "usage": sum_usage([o["usage"] for o in outputs]),
            "stats": {name: stats.get(name) for name in STATS_FIELDS}}


def merge_round_answers(parts: list[dict], replicas: list[str], order: list[str] | None = None) -> dict:
    """One /v1/rounds answer from the answers of its groups (a round split over replicas), in the
    request's agent order (`order`, its agent ids; None: the groups' order), with `split`: which
    agents each replica served. Stats: counts summed, times the longest group's, ratios and
    per-agent sizes the agents' mean, a field some group does not know (or a mode the groups
    disagree on) null."""
    outputs = [o for part in parts for o in part["outputs"]]
    if order is not None:
        position = {agent: i for i, agent in enumerate(order)}
        outputs.sort(key=lambda o: position.get(o["agent_id"], len(order)))
    sizes = [len(part["outputs"]) for part in parts]
    stats = {"num_agents": len(outputs)}
    for name in set(STATS_FIELDS) - {"num_agents"}:
        values = [part["stats"].get(name) for part in parts]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            stats[name] = values[0] if all(v == values[0] for v in values) else None
        elif name.endswith("seconds"):
            stats[name] = max(values)
        elif name in SUMMED_STATS:
            stats[name] = sum(values)
        else:  # per agent or a ratio: the agents' mean
            stats[name] = sum(v * n for v, n in zip(values, sizes)) / len(outputs)
    answer = round_answer(parts[0]["id"], parts[0]["model"], outputs, stats, parts[0]["round"].get("index"))
    answer["split"] = [{"replica": replica, "agents": [o["agent_id"] for o in part["outputs"]]}
                       for part, replica in zip(parts, replicas)]
    return answer
