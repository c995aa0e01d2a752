"""Request bodies of the OpenAI-compatible API (plus the round extension) and the response shapes.

Validation happens in two layers: pydantic checks presence and types (a 400 naming the field),
`SamplingParams` and the engine check values (a 400 naming the field, or a code such as
`context_length_exceeded`). Fields a client may send that this server cannot honour (n > 1,
logprobs, tools, ...) are rejected, never silently ignored.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokendance.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    TokenDanceError,
)
from tokendance.outputs import RequestOutput
from tokendance.sampling import SamplingParams

ROLES = ("system", "user", "assistant", "developer", "tool")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos")


class ApiError(Exception):
    """An error answered with an OpenAI-style body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_engine(cls, exc: TokenDanceError, param: str | None = None) -> ApiError:
        """The status and code of an engine error (all of them are the caller's fault)."""
        if isinstance(exc, ContextLengthError):
            return cls(400, str(exc), param=param, code="context_length_exceeded")
        if isinstance(exc, CapacityError):
            return cls(400, str(exc), param=param, code="kv_capacity_exceeded")
        words = str(exc).split(" ", 1)
        field = words[0] if words[0] in SAMPLING_FIELDS else param
        return cls(400, str(exc), param=field, code="invalid_value")


# ---------------------------------------------------------------- requests


class SamplingFields(BaseModel):
    """Sampling fields shared by every generation request. `top_k`, `stop_token_ids` and
    `ignore_eos` are extensions (vLLM spells them the same way)."""

    model_config = ConfigDict(extra="allow")

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None

    def sampling_params(self, default_max_tokens: int | None, **overrides) -> SamplingParams:
        values = {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}
        values.setdefault("max_tokens", default_max_tokens)
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return SamplingParams(**values)
        except InvalidRequestError as exc:
            raise ApiError.from_engine(exc) from None

    def check_supported(self) -> None:
        """Reject features this server does not implement instead of ignoring them."""
        extra = self.model_extra or {}
        unsupported = {
            "n": lambda v: v not in (None, 1),
            "best_of": lambda v: v not in (None, 1),
            "logprobs": lambda v: v not in (None, False),
            "top_logprobs": lambda v: v is not None,
            "echo": lambda v: bool(v),
            "suffix": lambda v: v is not None,
            "tools": lambda v: bool(v),
            "functions": lambda v: bool(v),
            "logit_bias": lambda v: bool(v),
            "presence_penalty": lambda v: v not in (None, 0),
            "frequency_penalty": lambda v: v not in (None, 0),
            "response_format": lambda v: v not in (None, {"type": "text"}),
        }
        for name, rejected in unsupported.items():
            if name in extra and rejected(extra[name]):
                raise ApiError(400, f"{name}={extra[name]!r} is not supported by this server", param=name,
                               code="unsupported_parameter")


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_dict(self, index: int) -> dict[str, str]:
        if self.role not in ROLES:
            raise ApiError(400, f"messages[{index}].role must be one of {', '.join(ROLES)}",
                           param=f"messages.{index}.role")
        content = self.content
        if isinstance(content, list):
            if not all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, "only text content parts are supported", param=f"messages.{index}.content")
            content = "".join(p["text"] for p in content)
        if content is None:
            raise ApiError(400, f"messages[{index}].content is required", param=f"messages.{index}.content")
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    """`agent_id`, `round_id`, `round_size` and `cache_salt` are the round and tenancy extensions."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    agent_id: str | None = Field(default=None, min_length=1, max_length=256)
    round_id: str | None = Field(default=None, min_length=1, max_length=256)
    round_size: int | None = Field(default=None, ge=1, le=4096)
    cache_salt: str | None = Field(default=None, min_length=1)

    def chat_messages(self) -> list[dict[str, str]]:
        return [m.as_dict(i) for i, m in enumerate(self.messages)]


class CompletionRequest(SamplingFields):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class RoundAgent(SamplingFields):
    """One agent of a /v1/rounds request; its sampling fields override the round's."""

    agent_id: str = Field(min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)


class RoundRequest(SamplingFields):
    model: str
    agents: list[RoundAgent] = Field(min_length=1, max_length=4096)
    cache_salt: str | None = Field(default=None, min_length=1)

    def check_supported(self) -> None:
        super().check_supported()
        if (self.model_extra or {}).get("stream"):
            raise ApiError(400, "/v1/rounds does not stream; stream each agent's chat request instead "
                           "(with round_id and round_size)", param="stream", code="unsupported_parameter")


# ---------------------------------------------------------------- responses


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(o.num_prompt_tokens for o in outputs)
    completion = sum(o.num_generated_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
    }


def chat_response(request_id: str, model: str, output: RequestOutput, round_info: dict | None) -> dict:
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": output.text},
            "logprobs": None,
            "finish_reason": output.finish_reason,
        }],
        "usage": usage([output]),
    }
    if round_info is not None:
        body["round"] = round_info
    return body


def completion_response(request_id: str, model: str, outputs: list[RequestOutput]) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
            for i, o in enumerate(outputs)
        ],
        "usage": usage(outputs),
    }


def round_response(request_id: str, model: str, agent_ids: list[str], outputs: list[RequestOutput],
                   round_info: dict, stats) -> dict:
    return {
        "id": request_id,
        "object": "round",
        "created": int(time.time()),
        "model": model,
        "round": round_info,
        "outputs": [
            {"agent_id": a, "message": {"role": "assistant", "content": o.text},
             "finish_reason": o.finish_reason, "usage": usage([o])}
            for a, o in zip(agent_ids, outputs)
        ],
        "usage": usage(outputs),
        "stats": {
            "mode": stats.mode,
            "num_agents": stats.num_agents,
            "num_waves": stats.num_waves,
            "round_seconds": stats.round_seconds,
            "prefill_seconds": stats.prefill_seconds,
            "prompt_tokens": stats.prompt_tokens,
            "computed_tokens": stats.computed_tokens,
            "reused_tokens": stats.reused_tokens,
            "kv_bytes_per_agent": stats.kv_bytes_per_agent,
            "compression": stats.compression,
            "shared_compression": stats.shared_compression,
            "diff_blocks": stats.diff_blocks,
        },
    }


def sse(data: dict | str) -> str:
    """One server-sent event; dicts are JSON-encoded."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
