"""`Sink`: how outputs cross from the engine thread to the HTTP event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from tokendance.outputs import RequestOutput


class Sink:
    """The outputs of one HTTP request on their way from the engine thread to the event loop.

    The engine thread calls `put`, `put_stats` and `fail`; the event loop reads. Outputs are
    cumulative, so only the latest of each choice is kept: a slow reader costs O(choices).
    `closed` (set by the event loop when the client is gone) makes the engine drop its outputs.
    """

    def __init__(self, key: str, num_choices: int, wants_stats: bool = False, constraint_param: str | None = None):
        self.key = key
        self.constraint_param = constraint_param  # the field of the request's output constraint, for its errors
        self.num_choices = num_choices
        self.wants_stats = wants_stats  # a /v1/rounds request: done once the round's stats arrived
        self.loop = asyncio.get_running_loop()
        self.outputs: dict[int, RequestOutput] = {}
        self.round_info: dict[int, dict] = {}
        self.stats = None
        self.error: Exception | None = None
        self.closed = False
        self.first_output_time: float | None = None
        self._changed: set[int] = set()
        self._event = asyncio.Event()

    # ------------------------------------------------------------ engine thread

    def put(self, index: int, output: RequestOutput, round_info: dict | None = None) -> None:
        self._call(self._on_put, index, output, round_info)

    def put_stats(self, stats) -> None:
        self._call(self._on_stats, stats)

    def fail(self, error: Exception) -> None:
        self._call(self._on_fail, error)

    def _call(self, fn: Callable, *args) -> None:
        if self.closed:
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    # ------------------------------------------------------------ event loop

    def _on_put(self, index: int, output: RequestOutput, round_info: dict | None) -> None:
        if self.first_output_time is None:
            self.first_output_time = time.perf_counter()
        self.outputs[index] = output
        if round_info is not None:
            self.round_info[index] = round_info
        self._changed.add(index)
        self._event.set()

    def _on_stats(self, stats) -> None:
        self.stats = stats
        self._event.set()

    def _on_fail(self, error: Exception) -> None:
        self.error = error
        self._event.set()

    @property
    def done(self) -> bool:
        finished = sum(o.finished for o in self.outputs.values())
        return finished == self.num_choices and (self.stats is not None or not self.wants_stats)

    async def updates(self) -> AsyncIterator[list[int]]:
        """Yield the indices of choices with new output until all finished; raise the error if
        the engine reported one."""
        while not self.done:
            await self._event.wait()
            self._event.clear()
            if self.error is not None:
                raise self.error
            changed, self._changed = sorted(self._changed), set()
            if changed:
                yield changed

    async def final(self) -> list[RequestOutput]:
        async for _ in self.updates():
            pass
        return [self.outputs[i] for i in range(self.num_choices)]
