"""The connector's worker side, in each of vLLM's workers: runs the steps' orders (`StepOrders`)
from the scheduler side, in order: the session store's saves, drops and closed rounds, then the
mirrors' pass (`worker/mirror_pass.py`), one per step, before vLLM's forward; reports the saves that ended
(`get_finished`), what failed (load errors) and what the store holds.

Nothing that fails here stops vLLM's engine or fails a request: `_failed` counts the failure by
stage (`mirrors_failed{reason}`) and logs it, and the mirrors' claimed blocks go back to vLLM as
load errors, which vLLM computes again, exactly (the connector sets `kv_load_failure_policy:
recompute`).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from tokendance.vllm_plugin import model_handoff as handoff
from tokendance.vllm_plugin.faults import Faults
from tokendance.vllm_plugin.step_plan import MirrorLoad, StepOrders
from tokendance.vllm_plugin.worker.store import RestoreError, SessionStore
from tokendance.vllm_plugin.scheduler.store_index import SaveOrder

logger = logging.getLogger("tokendance.vllm")


def claimed_block_ids(load: MirrorLoad, block_size: int) -> list[int]:
    """The blocks a load's claimed range touches (those before it hold vLLM's own prefix hit)."""
    return load.block_ids[load.start // block_size:-(-load.end // block_size)]


class WorkerSide:
    """`counts_stats`: this worker reports the passes' counts (rank 0 only: vLLM sums the ranks)."""

    def __init__(self, settings, block_size: int, vllm_config, counts_stats: bool = True):
        self.settings = settings
        self.block_size = block_size
        self.vllm_config = vllm_config
        self.counts_stats = counts_stats
        self.kv_caches: dict[str, Any] = {}
        self.mirror_pass = None
        self.failed_block_ids: set[int] = set()
        self.store: SessionStore | None = None
        self.saved: dict[str, int] = {}  # entries saved since vLLM last asked -> their own bytes
        self.store_changed = False
        self.undropped: tuple[list[str], list[int]] = ([], [])  # drops and closes a failure left for the next step
        self.counters: Counter = Counter()
        self.faults = Faults(settings.faults)  # the same draws on every rank
        self.reasons_logged: set[str] = set()  # failures logged with their traceback once

    def register_kv_caches(self, kv_caches) -> None:
        self.kv_caches = dict(kv_caches)

    def _pass(self):
        if self.mirror_pass is None:
            from tokendance.vllm_plugin.worker.mirror_pass import MirrorPass

            self.mirror_pass = MirrorPass(handoff.model(), handoff.layouts(self.vllm_config, self.kv_caches),
                                          self.block_size, self.settings.selection, self.settings.recompute_ratio,
                                          self.settings.check_layer)
            self.mirror_pass.store = self.store
        return self.mirror_pass

    def _count(self, counts: dict) -> None:
        if self.counts_stats:
            self.counters.update(counts)

    def _failed(self, reason: str, num_mirrors: int, loads: list[MirrorLoad] = ()) -> None:
        """Every failure on this side ends here (called in its `except`): counted by reason (the
        stage: `setup`, `pass`, `restore`, `capture`, `save`, `drop`), logged (with its traceback the first
        time the reason occurs), and the claimed blocks of `loads` reported as load errors, which
        vLLM computes again, exactly."""
        first = reason not in self.reasons_logged
        self.reasons_logged.add(reason)
        logger.warning("TokenDanceConnector: %s failed for %d mirror(s)%s; %s", reason, num_mirrors,
                       f" ({', '.join(load.request_id for load in loads)})" if loads else "",
                       "vLLM computes their claims exactly" if loads else "the session store goes without it",
                       exc_info=first)
        self._count({f"failed_mirrors.{reason}": num_mirrors})
        for load in loads:
            self.failed_block_ids.update(claimed_block_ids(load, self.block_size))

    def run(self, orders: StepOrders) -> None:
        """The store's work, then this step's mirrors, in one pass."""
        if orders.saves or orders.drops or orders.closes or self.undropped != ([], []):
            self._store_work(orders.saves, orders.drops, orders.closes)
        for _, block_ids in orders.failed:  # counted by the scheduler side
            self.failed_block_ids.update(block_ids)
        if not orders.loads:
            return
        loads = orders.loads
        try:
            self.faults.fire("setup")
            mirror_pass = self._pass()
        except Exception:
            self._failed("setup", len(loads), loads)
            return
        try:
            self.faults.fire("pass")
            if any(span.stored is not None for load in loads for span in load.spans):
                self.faults.fire("store_load")
            with torch.inference_mode():
                report = mirror_pass.run(loads)
        except Exception as exc:
            restore = isinstance(exc, RestoreError) or getattr(exc, "stage", None) == "store_load"
            self._failed("restore" if restore else "pass", len(loads), loads)
            return
        self._count({"mirrors": len(loads), "passes": 1, **report})
        if any(load.masters for load in loads):  # the sources they read are all written now
            self._capture(loads)

    def _capture(self, loads: list[MirrorLoad]) -> None:
        """The pieces these mirrors read from the members that computed them (masters, first
        holders: still pinned), into the store as those pieces' masters (without them, the first
        agent saved holding a piece is its master)."""
        self.store_changed = True
        try:
            self.faults.fire("capture")
            store = self._store()
            before = store.nbytes
            layouts = self._pass().layouts
            for load in loads:
                for key, block_ids, start, length in load.masters:
                    slots = self._pass()._slots(block_ids, start, start + length)
                    store.capture(key, lambda index: layouts[index].read(slots), start, start + length,
                                  load.round_serial)
        except Exception:
            self._failed("capture", len(loads))
            return
        self._count({"store_bytes": store.nbytes - before})

    def _store_work(self, saves: list[SaveOrder], drops: list[str], closes: list[int]) -> None:
        """Copy finished requests' KV into the store, then forget the entries dropped and the
        closed rounds' masters no entry reads. A save that fails is reported as such (-1): the
        agent's next request computes what it lacks."""
        self.store_changed = True
        before = 0 if self.store is None else self.store.nbytes
        agents = 0 if self.store is None else len(self.store.sessions)
        for order in saves:
            try:
                self.faults.fire("store_save")
                store, layouts = self._store(), self._pass().layouts
                slots = self._pass()._slots(order.block_ids, 0, order.length)
                store.save(order.entry, lambda index: layouts[index].read(slots), order.length, order.pieces)
                self.saved[order.entry] = store.sessions[order.entry].nbytes
            except Exception:
                self._failed("save", 1)
                if self.store is not None:
                    self.store.drop(order.entry)
                self.saved[order.entry] = -1
        if self.store is None:  # none could be made: nothing to drop or close
            return
        drops, closes = self.undropped[0] + list(drops), self.undropped[1] + list(closes)
        try:
            self.faults.fire("store_drop")
            for entry in drops:
                self.store.drop(entry)
            for serial in closes:
                self.store.close_round(serial)
            self.undropped = ([], [])
        except Exception:  # done again at the next step's store work (a second drop frees nothing)
            self.undropped = (drops, closes)
            self._failed("drop", 1)
        self._count({"store_bytes": self.store.nbytes - before, "store_agents": len(self.store.sessions) - agents})

    def _store(self) -> SessionStore:
        if self.store is None:
            self.store = SessionStore(len(self._pass().layouts), self._pass().rotate)
            self._pass().store = self.store
        return self.store

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose KV the store took (vLLM frees their blocks now); no loads are asynchronous."""
        return set(self.saved) or None, None

    def store_report(self) -> tuple[dict[str, int], int] | None:
        """The store's entries saved since the last call (their own bytes; -1: failed) and its
        total bytes; None if nothing changed."""
        if not self.store_changed:
            return None
        report = (dict(self.saved), 0 if self.store is None else self.store.nbytes)
        self.saved, self.store_changed = {}, False
        return report

    def take_load_errors(self) -> set[int]:
        failed, self.failed_block_ids = self.failed_block_ids, set()
        return failed

    def take_counters(self) -> dict[str, float]:
        self._count(self.faults.take_counts())
        counters, self.counters = self.counters, Counter()
        return dict(counters)
