"""The plain-data message from the scheduler to the model runner, one per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokendance.kv.manager import BlockCopy
from tokendance.sampling import SamplingParams, TokenHistory


@dataclass
class ScheduledRequest:
    """Compute `token_ids` at `positions` (increasing; each token's K/V goes to
    context_slots[position]) and attend causally over `context_slots`, one slot per position from
    0 through the last new token."""

    request_id: str
    token_ids: list[int]
    positions: list[int] | range
    context_slots: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    sampling_params: SamplingParams | None
    history: TokenHistory | None = None  # set for logit adjustments (penalties, ...) and prompt logprobs
    score_from: int = 0  # prompt logprobs: the first position whose logits are asked for

    @property
    def is_decode(self) -> bool:
        """One new token after a context: attended as a decode (a first token is a prefill)."""
        return len(self.positions) == 1 and self.positions[0] == len(self.context_slots) - 1 > 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
