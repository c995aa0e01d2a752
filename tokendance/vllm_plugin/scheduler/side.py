"""The connector's scheduler side, in vLLM's engine core: the round book (`scheduler/round_book.py`) holds
mirrors until their masters are computed, pins the blocks their claims read (masters', first
holders', the agent's previous request's), claims each member's range and tells the workers, step
by step, what to fill (`StepOrders`); with the session store, it keeps the store's index
(`scheduler/store_index.py`) and orders its saves and drops.

Plain Python over the objects vLLM hands a connector (requests, the block pool, the KV cache
manager, the scheduler's output): no vLLM import, so it runs without vLLM.

No failure on this side reaches vLLM's engine. One planning or claiming a request: `_failed`
counts it (`mirrors_failed{reason="plan"}`), logs it, and takes the request out of its round; vLLM
computes it exactly (blocks vLLM already took as claimed are reported as load errors by the
workers). One in the book-keeping around it (a step's end, the workers' report, a request's
finish): `_lost` counts it (`reason="bookkeeping"`) and logs it; a finished request is then not
saved, and a member it concerned waits at most its round's hold timeout before vLLM computes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tokendance.round_core.spans import Boundaries
from tokendance.vllm_plugin.faults import Faults
from tokendance.vllm_plugin.step_plan import MirrorLoad, StepOrders
from tokendance.vllm_plugin.scheduler.round_book import RoundBook
from tokendance.vllm_plugin.scheduler.members import RoundParamsError, RoundTag, Stage
from tokendance.vllm_plugin.scheduler.store_index import StoreIndex

logger = logging.getLogger("tokendance.vllm")


class SchedulerSide:
    """`settings`: the connector's (`connector.Settings`); `boundaries`: the tokenizer's
    boundary token ids; `kv_cache_manager`: vLLM's, once bound (a getter); `single_group`: one KV
    cache group (no session is read back otherwise); `bytes_per_token`: K and V of one token over
    all layers; `confirm_steps`: steps before a first holder's filled blocks are read (2 under
    vLLM's asynchronous scheduling)."""

    def __init__(self, settings, block_size: int, boundaries: Boundaries, kv_cache_manager: Callable[[], Any],
                 single_group: bool, bytes_per_token: int, confirm_steps: int = 1):
        self.settings = settings
        self.kv_cache_manager = kv_cache_manager
        self.single_group = single_group
        self.block_pool = None  # vLLM's, once bound
        self.pending: dict[str, Any] = {}  # request id -> member whose claim was allocated
        self.session_pins: dict[str, list[int]] = {}  # request id -> its session's blocks its claim reads
        self.store_pins: dict[str, str] = {}  # request id -> the store entry its claim reads
        self.failed: list[tuple[str, list[int]]] = []  # (request id, claimed blocks) to report as load errors
        self.counters: dict[str, int] = {}
        self.logged: set[str] = set()  # failure reasons logged with their traceback
        self.faults = Faults(settings.faults)
        self.store_index = None
        if settings.store_gib > 0:
            self.store_index = StoreIndex(int(settings.store_gib * 2**30), bytes_per_token)
        self.book = RoundBook(boundaries, settings.round_timeout_s, settings.hold_timeout_s,
                              settings.claim_tokens_per_step, anchors=settings.anchors, block_size=block_size,
                              lookup=self._cached_block, store=self.store_index, confirm_steps=confirm_steps)

    def bind(self, block_pool) -> None:
        """vLLM's block pool (its size bounds the round book's pins)."""
        self.block_pool = block_pool
        self.book.pool_blocks = block_pool.num_gpu_blocks - 1  # one is vLLM's null block

    def _cached_block(self, block_hash) -> int | None:
        """The block vLLM's prefix cache holds for a hash (one KV cache group), or None."""
        if self.block_pool is None or not self.single_group:
            return None
        blocks = self.block_pool.get_cached_block(block_hash, [0])
        return None if blocks is None else blocks[0].block_id

    def _pin_session(self, request_id: str, block_ids: list[int]) -> None:
        """Hold the session blocks a claim reads (vLLM's allocation for it may evict cached blocks)
        until the workers have read them; a claim asked again drops its previous pins."""
        self._unpin_session(request_id)
        if block_ids:
            self.block_pool.touch([self.block_pool.blocks[i] for i in block_ids])
            self.session_pins[request_id] = list(block_ids)

    def _unpin_session(self, request_id: str) -> None:
        self._release(self.session_pins.pop(request_id, []))
        entry = self.store_pins.pop(request_id, None)
        if entry is not None:
            self.store_index.unpin(entry)

    def _failed(self, request_id: str, claimed_block_ids: list[int] = (), reason: str = "plan") -> None:
        """A failure planning or claiming a request (or finishing it) ends here (called in its
        `except`): counted, logged, and the request leaves its round (finished for the book: a
        source of nothing, its pins released); `claimed_block_ids`, blocks vLLM already took as
        claimed, go to the workers, which report them as load errors. vLLM computes it exactly."""
        self._lost(reason, f"request {request_id}")
        self.pending.pop(request_id, None)
        if claimed_block_ids:
            self.failed.append((request_id, list(claimed_block_ids)))
        try:
            self._unpin_session(request_id)
            closed = self.book.drop(request_id)
            if closed is not None and self.store_index is not None:
                self.store_index.closes.append(closed)
            self._release(self.book.releasable())
        except Exception:  # the book could not let it go: its round's hold timeout will
            self._lost("bookkeeping", f"taking request {request_id} out of its round")

    def _lost(self, reason: str, what: str) -> None:
        """Count a failure by `reason` and log it, with its traceback the first time (call in an `except`)."""
        logger.warning("TokenDanceConnector: %s failed (mirrors_failed reason %r); vLLM computes the requests it "
                       "concerns exactly", what, reason, exc_info=reason not in self.logged)
        self.logged.add(reason)
        self.counters[f"failed_mirrors.{reason}"] = self.counters.get(f"failed_mirrors.{reason}", 0) + 1

    def on_new_request(self, request) -> None:
        try:
            tag = RoundTag.parse(request.kv_transfer_params)
        except RoundParamsError as exc:
            logger.warning("TokenDanceConnector: request %s computed exactly: %s", request.request_id, exc)
            return
        if tag is None:
            return
        # only the endpoint's gathering writes `transparent` (it refuses a client's), and only with
        # transparent rounds on: any other unsalted member is computed exactly
        if not request.cache_salt and not (tag.transparent and self.settings.transparent_rounds):
            logger.warning("TokenDanceConnector: request %s of round %r has no cache_salt: computed exactly "
                           "(reused KV enters the prefix cache only under the agent's own salt)",
                           request.request_id, tag.round_id)
            return
        try:
            self.faults.fire("plan")
            self.book.add(request.request_id, tag, list(request.prompt_token_ids or []), salt=request.cache_salt)
        except Exception:
            self._failed(request.request_id)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.book.find(request.request_id) is None:
            return 0, False
        try:
            self.faults.fire("claim")
            count = self.book.claim(request.request_id, num_computed_tokens)
            if count:
                member = self.book.find(request.request_id)
                self._pin_session(request.request_id, member.session_blocks)
                if member.store_entry is not None:
                    self.store_index.pin(member.store_entry)
                    self.store_pins[request.request_id] = member.store_entry
        except Exception:
            self._failed(request.request_id)
            return 0, False
        return count, False  # the workers fill the claim before vLLM's forward of the step that admits it

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        try:
            self.faults.fire("commit")
            member = self.book.commit(request.request_id, num_external_tokens)
            if member is not None:
                member.block_ids[:] = blocks.get_block_ids()[0]  # before any load reads a piece it provides
                self.pending[request.request_id] = member
            else:
                self._unpin_session(request.request_id)
        except Exception:
            claimed = self.book.find(request.request_id)
            start = 0 if claimed is None or claimed.claim is None else claimed.claim[0] // self.book.block_size
            self._failed(request.request_id, blocks.get_block_ids()[0][start:] if num_external_tokens else [])

    def build_orders(self, scheduler_output) -> StepOrders:
        """This step's work for the workers; the book's step ends."""
        orders, sent = StepOrders(), []
        for request_id, member in list(self.pending.items()):
            start, end = member.claim
            load = MirrorLoad(request_id, list(member.block_ids), start, member.token_ids[start:end],
                              recompute_ratio=member.tag.recompute_ratio)
            try:
                load.spans = self.book.loads_for(member)
                pinned = self.book.sent(member)  # pieces no master computes, which later members read from its blocks
                if pinned:
                    self.block_pool.touch([self.block_pool.blocks[i] for i in pinned])
            except Exception:
                self._failed(request_id, load.block_ids[start // self.book.block_size:])
                continue
            orders.loads.append(load)
            sent.append(request_id)
        if self.store_index is not None:  # the pieces the store keeps as masters, once these passes ran
            for load in list(orders.loads):
                try:
                    load.masters = self.book.master_pieces(self.pending[load.request_id])
                    load.round_serial = self.book.round_of(load.request_id)
                except Exception:
                    orders.loads.remove(load)
                    self._failed(load.request_id, load.block_ids[load.start // self.book.block_size:])
        self.pending.clear()
        orders.failed, self.failed = self.failed, []
        try:
            self.faults.fire("step_end")
            for request_id in sent:  # the workers run these passes in this step, before vLLM's forward
                self._unpin_session(request_id)
            self._watch_masters(scheduler_output)
            self._release(self.book.releasable())
            self.book.next_step()
            if self.store_index is not None:
                orders.saves, orders.drops, orders.closes = self.store_index.take_orders()
        except Exception:
            self._lost("bookkeeping", "ending a step")
        return orders

    def update_connector_output(self, connector_output) -> None:
        try:
            self._update(connector_output)
        except Exception:
            self._lost("bookkeeping", "reading the workers' report")
            if self.store_index is not None:  # the saves it reports are over either way: none is waited for
                self.store_index.abandon(connector_output.finished_sending or ())

    def _update(self, connector_output) -> None:
        self.faults.fire("report")
        if connector_output.invalid_block_ids:
            self.book.failed_blocks(set(connector_output.invalid_block_ids))
        if self.store_index is not None:
            report = connector_output.kv_connector_worker_meta
            self.store_index.reported(connector_output.finished_sending or (), getattr(report, "sizes", {}),
                                      getattr(report, "total_bytes", None))

    def has_pending_push_work(self) -> bool:
        return self.store_index is not None and self.store_index.busy

    def _watch_masters(self, scheduler_output) -> None:
        """Masters whose prompt is computed in this step: their blocks are pinned until the round's
        mirrors have been filled (the workers run this step before any later one)."""
        cached = scheduler_output.scheduled_cached_reqs
        computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for master in self.book.masters_to_watch():
            done = computed.get(master.request_id)
            if done is None:
                continue
            done += scheduler_output.num_scheduled_tokens.get(master.request_id, 0)
            if done >= len(master.token_ids) - 1:
                block_ids = self.kv_cache_manager().get_block_ids(master.request_id)[0]
                self.book.mark_ready(master.request_id, block_ids)
                self.block_pool.touch([self.block_pool.blocks[i] for i in block_ids])

    def _release(self, block_ids: list[int]) -> None:
        """Unpin, tails first: as vLLM frees a request's blocks, so a prompt's first blocks (the
        agent's session for its next round) are evicted last."""
        if block_ids:
            self.block_pool.free_blocks([self.block_pool.blocks[i] for i in reversed(block_ids)])

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """(whether the workers still read its blocks: a save, its KV params); a failure leaves
        the request unsaved, its blocks vLLM's to free."""
        try:
            return self._finish(request, block_ids)
        except Exception:
            self._failed(request.request_id, reason="bookkeeping")  # out of its round, its pins released
            return False, None

    def _finish(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self.faults.fire("finish")
        member = self.book.find(request.request_id)
        self.pending.pop(request.request_id, None)
        self._unpin_session(request.request_id)
        if member is None:
            return False, None
        closed = self.book.finish(request.request_id, request.all_token_ids, request.block_hashes)
        self._release(self.book.releasable())
        claimed = 0 if member.claim is None or member.stage < Stage.SENT else member.claim[1] - member.claim[0]
        saving = self._save(request, member, block_ids)
        if closed is not None and self.store_index is not None:
            self.store_index.closes.append(closed)
        return saving, {"tokendance": {"role": str(member.role), "claimed_tokens": claimed}}  # a plain str crosses processes

    def _save(self, request, member, block_ids: list[int]) -> bool:
        """Keep a finished member's KV in the store (its blocks held until the workers copied
        them); not one the store cannot name."""
        length = min(request.num_computed_tokens, len(block_ids) * self.book.block_size)
        if self.store_index is None or not (member.salt or member.tag.transparent) or length <= 0:
            return False
        pieces = [(p.key, p.start, p.end) for p in member.pieces if p.end <= length]
        self.store_index.save((member.tag.namespace, member.tag.agent_id), member.salt,
                              list(request.all_token_ids[:length]), list(block_ids), pieces, request.request_id)
        return True

    def take_counters(self) -> dict[str, float]:
        """What the rounds and the store's index did since the last call."""
        counters = self.book.take_counters()
        for key, value in [*self.counters.items(), *self.faults.take_counts().items()]:
            counters[key] = counters.get(key, 0) + value
        self.counters = {}
        if self.store_index is not None:
            for key, value in self.store_index.take_counters().items():
                counters[key] = counters.get(key, 0) + value
        return counters
