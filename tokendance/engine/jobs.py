"""The interface between the step loop and the work it runs besides requests: a job prepares KV
for requests it then hands to the engine (a round: `engine/round_job.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokendance.batch import ScheduledRequest
from tokendance.engine.request import Request
from tokendance.outputs import RequestOutput


@dataclass
class KVGroup:
    """A job's forward passes for one step: `items` (no sampling) through the first `num_layers`
    layers (all when None); `complete` names the tables whose last item this group holds."""

    items: list[ScheduledRequest]
    num_layers: int | None = None
    complete: set = field(default_factory=set)


class KVJob(Protocol):
    """The engine runs one job at a time, in the order they were added, within its steps."""

    done: bool
    error: BaseException | None
    has_work: bool
    request_ids: list[str]

    def advance(self) -> None: ...
    def next_group(self, budget: int) -> KVGroup | None: ...
    def group_ran(self, group: KVGroup) -> None: ...
    def take_ready(self) -> list[Request]: ...
    def observe(self, outputs: list[RequestOutput]) -> None: ...
    def fail(self, error: BaseException) -> None: ...
