"""How a request's outputs are built, beside its scheduling state: never read by the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokendance.engine.detokenizer import IncrementalDetokenizer
from tokendance.engine.request import Request
from tokendance.outputs import RequestOutput


@dataclass
class OutputState:
    detokenizer: IncrementalDetokenizer
    first_token_time: float | None = None
    finish_time: float | None = None
    logits: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None  # per prompt position (None at 0), when asked
    prompt_logits: dict = field(default_factory=dict)  # prompt position -> logits scoring it, when asked

    def output(self, request: Request) -> RequestOutput:
        """`token_ids` and `logits` are the request's own growing lists (no per-step copies):
        copy them to keep a snapshot of a running request."""
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=self.detokenizer.output_text,
            token_ids=request.output_token_ids,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_generated_tokens=len(request.output_token_ids),
            num_preemptions=request.num_preemptions,
            arrival_time=request.arrival_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            logits=self.logits,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            prompt_logits=self.prompt_logits,
            agent_id=request.agent_id,
        )
