"""The scheduler's index of the session store (`store.py`, in the workers): which agents are
stored under which salt, their bytes as the workers report them, pins (an entry is read by a claim
in flight), and the least-recently-used evictions that keep the store within its budget. The
scheduler decides, the workers execute, so every worker holds the same entries. Plain Python: the
scheduler side imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class StoredAgent:
    """What the scheduler knows of an agent's entry: the request that saved it (its name in the
    workers' store), its salt, the tokens it holds KV for, its bytes (reported by the workers; the
    dense size until then) and pins (claims in flight reading it)."""

    entry: str
    salt: str | None
    token_ids: list[int]
    nbytes: int
    saved: bool = False  # the workers hold it (they reported the save)
    pins: int = 0
    current: bool = True  # its agent's latest entry (else dropped once unpinned)


@dataclass
class SaveOrder:
    """Copy a finished request's KV (its positions [0, length) in `block_ids`) into the store."""

    entry: str
    block_ids: list[int]
    length: int
    pieces: list[tuple[bytes, int, int]] = field(default_factory=list)  # (key, start, end)


class StoreIndex:
    """The scheduler's view of the store: one current entry per agent ((namespace, agent id)),
    older entries kept while a claim reads them, least recently used first out."""

    def __init__(self, budget_bytes: int, bytes_per_token: int):
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self.latest: OrderedDict[tuple[str, str], StoredAgent] = OrderedDict()
        self.entries: dict[str, StoredAgent] = {}  # every entry the workers hold or will hold
        self.orders: list[SaveOrder] = []  # saves not sent to the workers yet
        self.drops: list[str] = []  # entries to forget, not sent yet
        self.closes: list[int] = []  # rounds whose members are all finished (their saves sent first)
        self.sending: set[str] = set()  # saves sent, not reported done
        self.total_bytes = 0  # as the workers last reported (plus estimates of saves not reported)
        # a saved entry's own bytes over its dense bytes, as last reported: what a save not reported
        # yet counts at (the masters its agent reads are mostly held already; any it adds come
        # with the next report; the store's whole bytes over dense, masters included, counted each
        # pending save ~3x over and evicted agents the budget held)
        self.ratio = 1.0
        self.counters: dict[str, int] = {}

    def save(self, agent: tuple[str, str], salt: str | None, token_ids: list[int], block_ids: list[int],
             pieces: list[tuple[bytes, int, int]], entry: str) -> None:
        """A request of `agent` finished: its KV replaces the agent's entry once saved."""
        old = self.latest.pop(agent, None)
        if old is not None:
            self._retire(old)
        # its bytes until the workers report them: dense, times what the store has saved so far
        stored = StoredAgent(entry, salt, list(token_ids), int(len(token_ids) * self.bytes_per_token * self.ratio))
        self.latest[agent] = self.entries[entry] = stored
        self.total_bytes += stored.nbytes
        self.orders.append(SaveOrder(entry, list(block_ids), len(token_ids), pieces))
        self._count("store_saving", 1)

    def find(self, agent: tuple[str, str], salt: str | None) -> StoredAgent | None:
        """The agent's saved entry under this salt (a hit refreshes it), or None."""
        stored = self.latest.get(agent)
        if stored is None or not stored.saved or stored.salt != salt:
            return None
        self.latest.move_to_end(agent)
        return stored

    def pin(self, entry: str) -> None:
        self.entries[entry].pins += 1

    def unpin(self, entry: str) -> None:
        stored = self.entries.get(entry)
        if stored is None:
            return
        stored.pins -= 1
        if stored.pins == 0 and not stored.current:
            self._retire(stored)

    def take_counters(self) -> dict[str, int]:
        counters, self.counters = self.counters, {}
        return counters

    def take_orders(self) -> tuple[list[SaveOrder], list[str], list[int]]:
        """What the workers do this step: save, then forget entries (evicted or replaced), then
        close rounds."""
        self._evict()
        orders, drops, closes = self.orders, self.drops, self.closes
        self.orders, self.drops, self.closes = [], [], []
        self.sending.update(order.entry for order in orders)
        return orders, drops, closes

    def reported(self, saved: Sequence[str], sizes: dict[str, int], total_bytes: int | None) -> None:
        """The workers finished these saves; `sizes`: their entries' own bytes (-1: the save
        failed); `total_bytes`: the store's bytes after this step's work."""
        for entry in saved:
            if entry not in self.sending:  # reported before: counted then
                continue
            self.sending.discard(entry)
            self._count("store_saving", -1)
            stored = self.entries.get(entry)
            if stored is None:
                continue
            if sizes.get(entry, 0) < 0:  # the save failed: nothing to read back
                self.latest = OrderedDict((k, s) for k, s in self.latest.items() if s is not stored)
                self._retire(stored)
                continue
            stored.saved = True
            self._count("store_saves", 1)
        for entry, nbytes in sizes.items():
            if entry in self.entries and nbytes >= 0:
                self.entries[entry].nbytes = nbytes
        if total_bytes is not None:
            saved = [s for s in self.entries.values() if s.saved]
            dense = sum(len(s.token_ids) for s in saved) * self.bytes_per_token
            self.ratio = min(1.0, sum(s.nbytes for s in saved) / dense) if dense else 1.0
            estimated = sum(s.nbytes for s in self.entries.values() if not s.saved and s.entry not in self.sending)
            self.total_bytes = total_bytes + estimated

    def abandon(self, saved: Sequence[str]) -> None:
        """A report of these saves could not be read: they are over, and none is read back (their
        entries are retired, as a failed save's)."""
        for entry in saved:
            if entry in self.sending:
                self.sending.discard(entry)
                self._count("store_saving", -1)
                stored = self.entries.get(entry)
                if stored is not None:
                    self.latest = OrderedDict((k, s) for k, s in self.latest.items() if s is not stored)
                    self._retire(stored)

    def _count(self, key: str, value: int) -> None:
        self.counters[key] = self.counters.get(key, 0) + value

    @property
    def busy(self) -> bool:
        """Saves the workers have not reported: vLLM must keep stepping."""
        return bool(self.orders or self.sending)

    def _retire(self, stored: StoredAgent) -> None:
        """An entry no agent's next claim will read: forgotten once no claim in flight reads it
        (the workers save before they drop, so a save still on its way is dropped after it)."""
        stored.current = False
        if stored.pins:
            return
        self.entries.pop(stored.entry, None)
        self.total_bytes -= stored.nbytes
        self.drops.append(stored.entry)

    def _evict(self) -> None:
        """Least recently used agents out until the store fits its budget (pinned ones stay)."""
        for agent in list(self.latest):
            if self.total_bytes <= self.budget_bytes:
                return
            stored = self.latest[agent]
            if stored.pins or not stored.saved:
                continue
            del self.latest[agent]
            self._retire(stored)
            self._count("store_evictions", 1)
