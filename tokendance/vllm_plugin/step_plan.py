"""What the scheduler side tells the worker side each step: the mirrors whose claimed range the
worker fills before vLLM's forward, and the session store's saves and drops (plain data, pickled
from the engine core to the workers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokendance.vllm_plugin.scheduler.store_index import SaveOrder


@dataclass
class ReusedSpan:
    """A shared span of a mirror's prompt served from its master's KV: mirror positions
    [start, start + length) hold the tokens the master holds at [source_start, ...). With in-round
    anchors, `anchors` are more masters' encodings of it, (block ids, start), and the span is
    served their mean with the master's. An `exact` span (the source holds the same tokens at the
    same positions after the same prefix) is copied in every layer, with no check or selection."""

    start: int
    length: int
    source_block_ids: list[int]
    source_start: int
    anchors: list[tuple[list[int], int]] = field(default_factory=list)
    exact: bool = False  # the same tokens at the same positions after the same prefix: copied as is
    recalled: bool = False  # from the mirror's own session (its previous request), not a master
    late: bool = False  # from another mirror of the same pass (its first holder): copied layer by layer
    stored: str | None = None  # from this entry of the session store (`store.py`), not from blocks

    @property
    def sources(self) -> list[tuple[list[int], int]]:
        return [(self.source_block_ids, self.source_start), *self.anchors]


@dataclass
class MirrorLoad:
    """Fill a mirror's positions [start, start + len(token_ids)) in its blocks: reused spans from
    their masters (keys re-rotated), the selected and private tokens computed in its context."""

    request_id: str
    block_ids: list[int]
    start: int
    token_ids: list[int]
    spans: list[ReusedSpan] = field(default_factory=list)
    recompute_ratio: float | None = None  # None: the connector's setting
    # for the session store: pieces masters computed, (key, block ids, start, length), kept as
    # those pieces' masters, and the round (serial) they belong to
    masters: list[tuple[bytes, list[int], int, int]] = field(default_factory=list)
    round_serial: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class StepOrders:
    """One engine step's work for the workers, in their order: the session store's saves, drops
    and closed rounds (`store.py`), then this step's mirrors (one pass). `failed`: requests whose claim the scheduler
    side could not plan after vLLM took it, (request id, claimed blocks): reported as load errors."""

    loads: list[MirrorLoad] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    closes: list[int] = field(default_factory=list)
    failed: list[tuple[str, list[int]]] = field(default_factory=list)
