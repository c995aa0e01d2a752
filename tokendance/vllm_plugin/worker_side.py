"""The connector's worker side, in each of vLLM's workers: runs the steps' orders (`StepOrders`)
from the scheduler side, in order: the session store's saves, drops and closed rounds, then the
mirrors' passes (`worker.py`), one per step, whole or advanced by the step's budget; reports what
ended (`get_finished`), what failed (load errors) and what the store holds.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from tokendance.vllm_plugin import handoff
from tokendance.vllm_plugin.plan import MirrorLoad, StepOrders
from tokendance.vllm_plugin.store import SaveOrder, SessionStore

logger = logging.getLogger("tokendance.vllm")


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
        self.passes: list[tuple[list[MirrorLoad], Any]] = []  # (loads, their pass's steps), first first
        self.filled: set[str] = set()  # mirrors whose pass ended since vLLM last asked
        self.store: SessionStore | None = None
        self.saved: dict[str, int] = {}  # entries saved since vLLM last asked -> their own bytes
        self.store_changed = False
        self.counters: Counter = Counter()

    def register_kv_caches(self, kv_caches) -> None:
        self.kv_caches = dict(kv_caches)

    def _pass(self):
        if self.mirror_pass is None:
            from tokendance.vllm_plugin.worker import MirrorPass

            self.mirror_pass = MirrorPass(handoff.model(), handoff.layouts(self.vllm_config, self.kv_caches),
                                          self.block_size, self.settings.selection, self.settings.recompute_ratio,
                                          self.settings.check_layer)
        return self.mirror_pass

    def _count(self, counts: dict) -> None:
        if self.counts_stats:
            self.counters.update(counts)

    def run(self, orders: StepOrders) -> None:
        """The store's work, then this step's new mirrors join the passes (one pass per step, run in
        order); the passes advance by the step's budget, or to their end."""
        if orders.saves or orders.drops or orders.closes:
            self._store_work(orders.saves, orders.drops, orders.closes)
        if orders.loads:
            self.passes.append((orders.loads, self._pass().steps(orders.loads)))
        spent = 0.0
        while self.passes and (not orders.budget or spent < orders.budget):
            loads, steps = self.passes[0]
            try:
                with torch.inference_mode():
                    spent += next(steps)
                continue
            except StopIteration as done:
                self._count({"mirrors": len(loads), "passes": 1, **done.value})
                if any(load.masters for load in loads):  # the sources they read are all written now
                    self._capture(loads)
            except Exception:  # never a wrong answer: vLLM recomputes these blocks (kv_load_failure_policy)
                logger.exception("TokenDanceConnector: the mirrors' pass failed; their blocks are reported as load errors")
                self._count({"failed_mirrors": len(loads)})
                for load in loads:
                    self.failed_block_ids.update(load.block_ids)
            self.passes.pop(0)
            self.filled.update(load.request_id for load in loads)

    def _capture(self, loads: list[MirrorLoad]) -> None:
        """The pieces these mirrors read from the members that computed them (masters, first
        holders: still pinned), into the store as those pieces' masters."""
        store = self._store()
        before = store.nbytes
        layouts = self._pass().layouts
        for load in loads:
            for key, block_ids, start, length in load.masters:
                slots = self._pass()._slots(block_ids, start, start + length)
                store.capture(key, lambda index: layouts[index].read(slots), start, start + length, load.round_serial)
        self.store_changed = True
        self._count({"store_bytes": store.nbytes - before})

    def _store_work(self, saves: list[SaveOrder], drops: list[str], closes: list[int]) -> None:
        """Copy finished requests' KV into the store, then forget the entries dropped and the
        closed rounds' masters no entry reads."""
        store = self._store()
        before, agents = store.nbytes, len(store.sessions)
        layouts = self._pass().layouts
        for order in saves:
            try:
                slots = self._pass()._slots(order.block_ids, 0, order.length)
                ratio = self.settings.recompute_ratio if order.recompute_ratio is None else order.recompute_ratio
                store.save(order.entry, lambda index: layouts[index].read(slots), order.length, order.pieces, ratio)
                self.saved[order.entry] = store.sessions[order.entry].nbytes
            except Exception:  # never fatal: the agent's next request computes what it lacks
                logger.exception("TokenDanceConnector: saving request %s into the store failed", order.entry)
                store.drop(order.entry)
                self.saved[order.entry] = -1
        for entry in drops:
            store.drop(entry)
        for serial in closes:
            store.close_round(serial)
        self.store_changed = True
        self._count({"store_bytes": store.nbytes - before, "store_agents": len(store.sessions) - agents})

    def _store(self) -> SessionStore:
        if self.store is None:
            self.store = SessionStore(len(self._pass().layouts), self._pass().rotate)
            self._pass().store = self.store
        return self.store

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose KV the store took (vLLM frees their blocks now); mirrors whose pass ended
        (asynchronous loads: vLLM schedules them next)."""
        sent = set(self.saved) or None
        if self.settings.pass_tokens_per_step <= 0 or not self.filled:
            self.filled.clear()
            return sent, None
        filled, self.filled = self.filled, set()
        return sent, filled

    def store_report(self) -> tuple[dict[str, int], int] | None:
        """The store's entries saved since the last call (their own bytes; -1: failed) and its
        total bytes; None if nothing changed."""
        if not self.store_changed:
            return None
        report = (dict(self.saved), self.store.nbytes)
        self.saved, self.store_changed = {}, False
        return report

    def take_load_errors(self) -> set[int]:
        failed, self.failed_block_ids = self.failed_block_ids, set()
        return failed

    def take_counters(self) -> dict[str, float]:
        counters, self.counters = self.counters, Counter()
        return dict(counters)
