"""Server settings, passed explicitly to the app and the engine loop (never kept in globals)."""

from __future__ import annotations

from dataclasses import dataclass

from tokendance.errors import InvalidRequestError
from tokendance.tool_formats import TOOL_CALL_FORMATS


@dataclass(frozen=True)
class ServerConfig:
    """`gather_window_s` 0 disables transparent rounds; `round_timeout_s` bounds the wait of a
    declared round (`round_id` + `round_size`) for its missing members. Each of `api_keys` is a
    tenant: its requests' cache namespace is scoped by the key (none: no key is required).
    `tool_call_format`: "auto" (from the model's chat template) or a name of TOOL_CALL_FORMATS.
    `default_max_tokens`: the cap of a chat, responses or round request that sends no max_tokens
    (None: up to the context window, as OpenAI); `max_tokens_limit`: a request asking for more is
    refused, one asking for none gets at most this."""

    model_name: str
    api_keys: tuple[str, ...] = ()
    gather_window_s: float = 0.05
    round_timeout_s: float = 2.0
    max_concurrent_requests: int = 1024
    max_body_bytes: int = 8 * 2**20
    tool_call_format: str = "auto"
    default_max_tokens: int | None = None
    max_tokens_limit: int | None = None

    def __post_init__(self) -> None:
        if self.gather_window_s < 0 or self.round_timeout_s < 0:
            raise InvalidRequestError("the gather window and the round timeout must be >= 0")
        if any(not key for key in self.api_keys):
            raise InvalidRequestError("an API key must not be empty")
        if self.max_concurrent_requests < 1 or self.max_body_bytes < 1:
            raise InvalidRequestError("max_concurrent_requests and max_body_bytes must be >= 1")
        if self.tool_call_format not in ("auto", *TOOL_CALL_FORMATS):
            raise InvalidRequestError(f"tool_call_format must be auto or one of {', '.join(TOOL_CALL_FORMATS)}")
        for name in ("default_max_tokens", "max_tokens_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}", name)
        if None not in (self.default_max_tokens, self.max_tokens_limit) and self.default_max_tokens > self.max_tokens_limit:
            raise InvalidRequestError(f"default_max_tokens ({self.default_max_tokens}) is above max_tokens_limit "
                                      f"({self.max_tokens_limit})", "default_max_tokens")
