"""Which reused tokens to recompute in a new context: selection policies as strategy objects.

A policy sees one reused span at a time (its length and, if it asked for a check pass, the
deviation of each token's cached key from a fresh one at the check layer) and returns the offsets
to recompute. Tokens that were not reused are always computed; that is not the policy's business.
"""

from __future__ import annotations

import math

import torch

from tokendance import registry
from tokendance.errors import InvalidRequestError


class Selector:
    needs_check_pass: bool = False
    uses_anchor_spread: bool = False  # its deviation is the anchors' disagreement (RoundKV.spread)

    def __init__(self, ratio: float):
        if not (isinstance(ratio, (int, float)) and 0.0 <= ratio <= 1.0):
            raise InvalidRequestError(f"recompute_ratio must be in [0, 1], got {ratio!r}", "recompute_ratio")
        self.ratio = float(ratio)

    def budget(self, length: int) -> int:
        return min(length, math.ceil(self.ratio * length - 1e-9))

    def select(self, length: int, deviation: torch.Tensor | None) -> list[int]:
        """Offsets to recompute in a reused span of `length` tokens. `deviation` is None where no
        check pass ran: every policy then recomputes the span's first tokens (as EPIC does)."""
        raise NotImplementedError

    def first_tokens(self, length: int) -> list[int]:
        return list(range(self.budget(length)))


class CacheBlendSelector(Selector):
    """Top-r fraction of tokens by squared key deviation at the check layer (CacheBlend)."""

    needs_check_pass = True

    def select(self, length: int, deviation: torch.Tensor | None) -> list[int]:
        k = self.budget(length)
        if k == 0 or deviation is None:
            return self.first_tokens(length)
        return sorted(torch.topk(deviation, k).indices.tolist())


class BlockAwareSelector(Selector):
    """Like CacheBlend but in whole groups of `group` consecutive tokens ranked by their summed
    deviation, so the recomputed tokens cluster (fewer touched blocks for the same budget)."""

    needs_check_pass = True

    def __init__(self, ratio: float, group: int = 16):
        super().__init__(ratio)
        self.group = group

    def select(self, length: int, deviation: torch.Tensor | None) -> list[int]:
        k = self.budget(length)
        if k == 0 or deviation is None:
            return self.first_tokens(length)
        groups = [(start, min(start + self.group, length)) for start in range(0, length, self.group)]
        scores = torch.stack([deviation[a:b].sum() for a, b in groups])
        chosen: list[int] = []
        for index in torch.argsort(scores, descending=True).tolist():
            a, b = groups[index]
            chosen.extend(range(a, b))
            if len(chosen) >= k:
                break
        return sorted(chosen[:k] if self.ratio < 1.0 else chosen)


class AnchorSpreadSelector(CacheBlendSelector):
    """Top-r fraction of tokens by how much the span's in-round anchors disagree (the encodings
    of the span computed in full in several agents' contexts; `anchors` > 1): the tokens whose KV
    depends most on the context. No check pass; spans without anchors fall back to EPIC's."""

    needs_check_pass = False
    uses_anchor_spread = True


class EpicSelector(Selector):
    """The first k tokens of each reused span (EPIC): they wrongly act as attention sinks when a
    span is encoded on its own. k = ceil(ratio * span length). No check pass."""

    def select(self, length: int, deviation: torch.Tensor | None) -> list[int]:
        return self.first_tokens(length)


def make_selector(name: str, ratio: float) -> Selector:
    """The selector registered as `name` (tokendance.registry.SELECTIONS)."""
    return registry.load(registry.SELECTIONS[registry.check("selection", name, registry.SELECTIONS)])(ratio)
