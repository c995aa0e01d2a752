"""Fidelity of a reuse mode against `full` at temperature 0 (DESIGN.md §5)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokendance.outputs import RequestOutput
from tokendance.reuse.segments import common_prefix


@dataclass
class Fidelity:
    num_agents: int
    identical_fraction: float  # agents whose whole output is token-identical
    mean_common_prefix: float  # mean length of the common prefix of the outputs, in tokens
    top1_agreement: float | None  # same greedy choice at the end of the prompt (needs logits)
    mean_kl: float | None  # KL(reference || other) of the next-token distribution there


def compare(reference: Sequence[RequestOutput], other: Sequence[RequestOutput]) -> Fidelity:
    """Outputs in the same agent order; logits present when sampled with return_logits >= 1."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference outputs vs {len(other)}")
    prefixes = [common_prefix(a.token_ids, b.token_ids) for a, b in zip(reference, other)]
    identical = [a.token_ids == b.token_ids for a, b in zip(reference, other)]
    top1 = kl = None
    if all(o.logits for o in reference) and all(o.logits for o in other):
        ref = torch.stack([o.logits[0] for o in reference]).float()
        got = torch.stack([o.logits[0] for o in other]).float()
        top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        ref_log, got_log = ref.log_softmax(-1), got.log_softmax(-1)
        kl = (ref_log.exp() * (ref_log - got_log)).sum(-1).mean().item()
    n = max(1, len(reference))
    return Fidelity(len(reference), sum(identical) / n, sum(prefixes) / n, top1, kl)
