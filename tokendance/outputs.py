"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache, a session or shared KV
    num_generated_tokens: int
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    logits: list = field(default_factory=list, repr=False)  # float32 [vocab] per generated token
    logprobs: list = field(default_factory=list, repr=False)  # TokenLogprobs per generated token, if asked
    prompt_logprobs: list | None = field(default=None, repr=False)  # TokenLogprobs per prompt token (None at 0)
    # prompt position -> float32 [vocab] logits that scored its token (prompt_logprobs with return_logits)
    prompt_logits: dict = field(default_factory=dict, repr=False)
    agent_id: str | None = None  # set for the turn of an agent in a round
    error: str | None = None  # why, when finish_reason is "error" (its computation raised)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
