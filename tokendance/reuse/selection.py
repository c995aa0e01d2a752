"""Which reused tokens to recompute in a new context: selection policies as strategy objects.

A policy sees one reused span at a time (its length and, per token, the score it ranks by: see
`Selector.score`) and returns the offsets to recompute. Tokens that were not reused are always
computed; that is not the policy's business.
"""

from __future__ import annotations

import math

import torch

from tokendance import registry
from tokendance.errors import InvalidRequestError


SCORES = {  # what a selector ranks a span's tokens by; the check pass computes all but "spread"
    "deviation": "how far the cached key is from a fresh one at the check layer",
    "spread": "how much the span's in-round anchors disagree (RoundKV.spread)",
}


class Selector:
    score: str | None = None  # a key of SCORES, None: ranks nothing

    @property
    def needs_check_pass(self) -> bool:
        return self.score is not None and self.score != "spread"

    def __init__(self, ratio: float):
        if not (isinstance(ratio, (int, float)) and 0.0 <= ratio <= 1.0):
            raise InvalidRequestError(f"recompute_ratio must be in [0, 1], got {ratio!r}", "recompute_ratio")
        self.ratio = float(ratio)

    def budget(self, length: int) -> int:
        return min(length, math.ceil(self.ratio * length - 1e-9))

    def select(self, length: int, scores: torch.Tensor | None) -> list[int]:
        """Offsets to recompute in a reused span of `length` tokens, given each token's `score`.
        `scores` is None where there are none (no check pass ran, no anchors): every policy then
        recomputes the span's first tokens (as EPIC does)."""
        raise NotImplementedError

    def first_tokens(self, length: int) -> list[int]:
        return list(range(self.budget(length)))


class CacheBlendSelector(Selector):
    """Top-r fraction of tokens by squared key deviation at the check layer (CacheBlend)."""

    score = "deviation"

    def select(self, length: int, scores: torch.Tensor | None) -> list[int]:
        k = self.budget(length)
        if k == 0 or scores is None:
            return self.first_tokens(length)
        return sorted(torch.topk(scores, k).indices.tolist())


class AnchorSpreadSelector(CacheBlendSelector):
    """Top-r fraction of tokens by how much the span's in-round anchors disagree (the encodings
    of the span computed in full in several agents' contexts; `anchors` > 1): the tokens whose KV
    depends most on the context. No check pass; spans without anchors fall back to EPIC's."""

    score = "spread"


class EpicSelector(Selector):
    """The first k tokens of each reused span (EPIC): they wrongly act as attention sinks when a
    span is encoded on its own. k = ceil(ratio * span length). No check pass."""

    def select(self, length: int, scores: torch.Tensor | None) -> list[int]:
        return self.first_tokens(length)


def make_selector(name: str, ratio: float) -> Selector:
    """The selector registered as `name` (tokendance.registry.SELECTIONS)."""
    return registry.load(registry.SELECTIONS[registry.check("selection", name, registry.SELECTIONS)])(ratio)
