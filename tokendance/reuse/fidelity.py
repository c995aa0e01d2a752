"""Fidelity of a reuse mode against `full` at temperature 0: agreement of first tokens, KL, identical outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokendance.outputs import RequestOutput
from tokendance.round_core.spans import common_prefix


NEAR_TIE_NATS = 2.0  # a divergence where the reference's top two choices are closer is a near tie


@dataclass
class Fidelity:
    num_agents: int
    identical_fraction: float  # agents whose whole output is token-identical
    mean_common_prefix: float  # mean length of the common prefix of the outputs, in tokens
    top1_agreement: float | None  # same greedy choice at the end of the prompt (needs logits)
    mean_kl: float | None  # KL(reference || other) of the next-token distribution there
    # Outputs that differ, by the reference's margin between its top two log-probabilities at the
    # first token where they part (needs the reference's logprobs with 2 alternatives): a
    # divergence at a near tie and a confident one are different failures.
    near_tie_divergences: int | None = None
    confident_divergences: int | None = None


def divergence_margin(reference: RequestOutput, other: RequestOutput) -> float | None:
    """The reference's top-1 minus top-2 log-probability at the first token where `other` differs
    (None if identical, or if the reference has no such logprobs there)."""
    at = common_prefix(reference.token_ids, other.token_ids)
    if reference.token_ids == other.token_ids or at >= len(reference.logprobs):
        return None
    top = reference.logprobs[at].top
    return None if len(top) < 2 else top[0][1] - top[1][1]


def compare(reference: Sequence[RequestOutput], other: Sequence[RequestOutput]) -> Fidelity:
    """Outputs in the same agent order; logits present when sampled with return_logits >= 1,
    divergence margins when the reference was sampled with logprobs >= 2."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference outputs vs {len(other)}")
    prefixes = [common_prefix(a.token_ids, b.token_ids) for a, b in zip(reference, other)]
    identical = [a.token_ids == b.token_ids for a, b in zip(reference, other)]
    near = confident = None
    if all(o.logprobs for o in reference):
        margins = [m for m in (divergence_margin(a, b) for a, b in zip(reference, other)) if m is not None]
        near, confident = sum(m <= NEAR_TIE_NATS for m in margins), sum(m > NEAR_TIE_NATS for m in margins)
    top1 = kl = None
    if all(o.logits for o in reference) and all(o.logits for o in other):
        ref = torch.stack([o.logits[0] for o in reference]).float()
        got = torch.stack([o.logits[0] for o in other]).float()
        top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        ref_log, got_log = ref.log_softmax(-1), got.log_softmax(-1)
        kl = (ref_log.exp() * (ref_log - got_log)).sum(-1).mean().item()
    n = max(1, len(reference))
    return Fidelity(len(reference), sum(identical) / n, sum(prefixes) / n, top1, kl, near, confident)


@dataclass
class ForcedScores:
    """Teacher-forced positions scored against a reference (both computed on the same forced
    tokens): per position KL(reference || other), whether the most likely token is the same, and
    the reference's margin between its top two log-probabilities there."""

    kl: list[float] = field(default_factory=list)
    same_top1: list[bool] = field(default_factory=list)
    margin: list[float] = field(default_factory=list)

    def add(self, reference: torch.Tensor, other: torch.Tensor) -> None:
        """reference, other: logits [positions, vocab] at the same positions."""
        ref, got = reference.float().log_softmax(-1), other.float().log_softmax(-1)
        self.kl += (ref.exp() * (ref - got)).sum(-1).clamp(min=0).tolist()
        self.same_top1 += (ref.argmax(-1) == got.argmax(-1)).tolist()
        top = ref.topk(2, dim=-1).values
        self.margin += (top[:, 0] - top[:, 1]).tolist()

    def summary(self) -> dict:
        """top-1 agreement, KL mean and p99, and the flipped top-1 choices by the reference's
        margin there (a flip above 0.5 nats is one no numeric change of this model makes)."""
        if not self.kl:
            return {"positions": 0}
        kl = torch.tensor(self.kl, dtype=torch.float64)
        flips = [m for m, same in zip(self.margin, self.same_top1) if not same]
        return {"positions": len(self.kl), "top1_agreement": sum(self.same_top1) / len(self.kl),
                "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
                "flips_over_half_nat": sum(m > 0.5 for m in flips), "flips_over_2_nats": sum(m > NEAR_TIE_NATS for m in flips)}
