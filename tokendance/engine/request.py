"""A request's state as the scheduler sees it. Only the scheduler changes it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokendance.sampling import SamplingParams, TokenHistory


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Invariant: token_ids == prompt_token_ids + output_token_ids, and tokens
    [0, num_computed_tokens) have their KV in the request's block table."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # sampling_params.max_tokens capped by the context window
    eos_token_ids: tuple[int, ...] = ()
    namespace: str = ""
    prompt: str | None = None
    agent_id: str | None = None  # the agent of a round this request is the turn of
    retain_kv: bool = False  # keep the table when finished (agent sessions, round statistics)
    group: str | None = None  # the job it is part of (a round, a multi-prompt request): admission is fair by group
    # With prompt_logprobs: the first position whose logits are asked for (earlier tokens may come
    # from the prefix cache or a round's prepared table; a round scores its prompt's private tail)
    score_from: int = 0
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    arrival_time: float = 0.0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def group_key(self) -> str:
        return self.request_id if self.group is None else self.group

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def token_history(self) -> TokenHistory:
        p = self.sampling_params
        stops = (*(() if p.ignore_eos else self.eos_token_ids), *p.stop_token_ids)
        return TokenHistory(self.prompt_token_ids, self.output_token_ids, stops)

    def check_token_stop(self) -> str | None:
        """Finish reason implied by the last generated token, if any."""
        last = self.output_token_ids[-1]
        p = self.sampling_params
        if not p.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in p.stop_token_ids:
            return "stop"
        if len(self.output_token_ids) >= self.max_tokens:
            return "length"
        return None
