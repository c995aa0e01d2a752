"""`TokenDanceConnector`: collective reuse for agent rounds inside an unmodified vLLM (v1), as a
KV connector. Turn it on with

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TokenDanceConnector", "kv_role": "kv_both"}'

(the name is registered by this package's `vllm.general_plugins` entry point). Settings go in
`kv_connector_extra_config`: `recompute_ratio` (0.05), `selection` ("epic"), `check_layer`
(1), `round_timeout_s` (0.25: how long a round waits for its members), `hold_timeout_s` (30: how
long a mirror waits for its masters before it is computed exactly), `claim_tokens_per_step`
(8192: the claimed tokens one step's pass fills at most; 0 for no limit), `pass_tokens_per_step`
(0: each pass runs whole before the forward of the step that admits its mirrors; n > 0: the
mirrors wait as vLLM's asynchronous loads and, while requests decode, the workers advance the
passes by at most n full-model token equivalents per engine step), `store_gib` (0: the session
store's budget; > 0: every round member's KV is kept at rest in Master-Mirror form in the
workers' memory, and read back where vLLM's prefix cache lost it: `store.py`).

Scheduler side (engine core): the round book (`rounds.py`) holds mirrors until their masters are
computed, pins the masters' blocks (and the blocks of an agent's previous request its claim reads)
and claims each mirror's range. Worker side: one pass over the
mirrors admitted in a step, before vLLM's forward (`worker.py`). Whatever it cannot do (a model,
layout or config it does not know, a master gone, a timeout) is computed by vLLM exactly.

Approximate KV goes into vLLM's prefix cache under the mirror's own `cache_salt`: a mirror
without a salt is computed exactly, so no other request can take reused KV for an exact hit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tokendance.registry import DEFAULT_RECOMPUTE_RATIO, DEFAULT_SELECTION, SELECTIONS
from tokendance.reuse.planning import MAX_ANCHORS, valid_anchors
from tokendance.reuse.selection import SCORES, make_selector
from tokendance.vllm_plugin import handoff
from tokendance.vllm_plugin.plan import MirrorLoad
from tokendance.vllm_plugin.rounds import RoundBook, RoundParamsError, RoundTag
from tokendance.vllm_plugin.store import SaveOrder, SessionStore, StoreIndex

logger = logging.getLogger("tokendance.vllm")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class Settings:
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO  # the engine's defaults: one choice for both front doors
    selection: str = DEFAULT_SELECTION
    check_layer: int = 1
    round_timeout_s: float = 0.25
    hold_timeout_s: float = 30.0
    claim_tokens_per_step: int = 8192
    # >0: asynchronous passes, sliced while requests decode (measured slower on CPU: docs/vllm-plugin.md)
    pass_tokens_per_step: int = 0
    anchors: int = 1  # in-round anchors: each shared piece computed in full by up to this many masters
    store_gib: float = 0.0  # the session store's budget (0: no store)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "Settings":
        extra = dict(extra or {})
        unknown = set(extra) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"TokenDanceConnector: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        settings = cls(**extra)
        for name in ("check_layer", "claim_tokens_per_step", "pass_tokens_per_step", "round_timeout_s", "hold_timeout_s",
                     "store_gib"):
            value, kind = getattr(settings, name), cls.__dataclass_fields__[name].type
            numeric = (int,) if kind in (int, "int") else (int, float)
            if isinstance(value, bool) or not isinstance(value, numeric) or value < 0:
                raise ValueError(f"TokenDanceConnector: {name} must be a non-negative "
                                 f"{'integer' if numeric == (int,) else 'number'}, got {value!r}")
        if not valid_anchors(settings.anchors):
            raise ValueError(f"TokenDanceConnector: anchors must be an integer in [1, {MAX_ANCHORS}], got {settings.anchors!r}")
        selector = make_selector(settings.selection, settings.recompute_ratio)  # validates both
        if selector.score not in (None, "deviation"):  # the worker's check pass measures key deviation only
            usable = [name for name in SELECTIONS if make_selector(name, 0.0).score in (None, "deviation")]
            raise ValueError(f"TokenDanceConnector: selection {settings.selection!r} ranks tokens by "
                             f"{SCORES[selector.score]}, which the plugin does not measure; use one of {usable}")
        return settings


@dataclass
class TokenDanceMetadata(KVConnectorMetadata):
    loads: list[MirrorLoad] = field(default_factory=list)  # this step's new mirrors: one pass
    budget: float = 0  # the passes' work this step, full-model token equivalents (0: all of it)
    saves: list[SaveOrder] = field(default_factory=list)  # finished requests' KV into the store, first
    drops: list[str] = field(default_factory=list)  # store entries to forget, after the saves
    closes: list[int] = field(default_factory=list)  # rounds whose unread captured masters go, last


@dataclass
class StoreReport(KVConnectorWorkerMetadata):
    """The workers' store after a step: each new entry's own bytes and the store's total."""

    sizes: dict[str, int] = field(default_factory=dict)
    total_bytes: int = 0

    def aggregate(self, other: "StoreReport") -> "StoreReport":  # ranks hold the same entries
        return self


@dataclass
class TokenDanceStats(KVConnectorStats):
    """What the rounds and the workers' passes did since the last report (summed over intervals):
    rounds formed, members by role, held steps, tokens reused, tokens computed by reason, pass
    seconds by phase, mirrors filled and failed (the keys of `metrics.COUNTERS`). vLLM logs them
    with its KV transfer metrics and `/metrics` shows them (`vllm:tokendance_*`)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "TokenDanceStats":
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


def unsupported_reason(vllm_config) -> str | None:
    """Why this vLLM configuration gets no reuse (None: it does)."""
    model = vllm_config.model_config
    architectures = getattr(model.hf_config, "architectures", None) or []
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        return f"architecture {architectures} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        return "tensor or pipeline parallelism (not tested yet)"
    if vllm_config.cache_config.cache_dtype != "auto":
        return f"kv cache dtype {vllm_config.cache_config.cache_dtype}"
    if getattr(model.hf_config, "sliding_window", None) and getattr(model.hf_config, "use_sliding_window", True):
        return "sliding-window attention"
    if not vllm_config.cache_config.enable_prefix_caching:
        return "prefix caching is off (agents' histories and salts rely on it)"
    return None


def kv_bytes_per_token(vllm_config) -> int:
    """Bytes of K and V one token holds across the model's layers (one rank's heads)."""
    model = vllm_config.model_config
    return (2 * model.get_num_layers(vllm_config.parallel_config) * model.get_num_kv_heads(vllm_config.parallel_config)
            * model.get_head_size() * model.dtype.itemsize)


def tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError):  # no model-parallel group in this process
        return 0


class TokenDanceConnector(KVConnectorBase_V1):
    """Both roles in one class, as vLLM builds connectors: the scheduler side plans and claims, the
    worker side fills the claimed ranges."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        if self.settings.store_gib > 0 and vllm_config.device_config.device_type != "cpu":
            raise ValueError(f"TokenDanceConnector: store_gib needs vLLM-CPU for now (the session store keeps "
                             f"tensors in the workers' memory and re-rotates them there; on "
                             f"{vllm_config.device_config.device_type} it is untested); set store_gib to 0")
        self.block_size = vllm_config.cache_config.block_size
        self.disabled = unsupported_reason(vllm_config)
        if self.disabled:
            logger.warning("TokenDanceConnector: no reuse for this server: %s; every request is computed exactly",
                           self.disabled)

        # scheduler side
        self.book: RoundBook | None = None
        self.pending: dict[str, Any] = {}  # request id -> member whose claim was allocated
        self.session_pins: dict[str, list[int]] = {}  # request id -> its session's blocks its claim reads
        self.in_flight: dict[str, Any] = {}  # request id -> member whose pass the workers run
        self.store_pins: dict[str, str] = {}  # request id -> the store entry its claim reads
        self.block_pool = None
        self.store_index = None
        if role == KVConnectorRole.SCHEDULER and not self.disabled and self.settings.store_gib > 0:
            self.store_index = StoreIndex(int(self.settings.store_gib * 2**30), kv_bytes_per_token(vllm_config))
        # worker side
        self.kv_caches: dict[str, Any] = {}
        self.mirror_pass = None
        self.failed_block_ids: set[int] = set()
        self.passes: list[tuple[list[MirrorLoad], Any]] = []  # (loads, their pass's steps), first first
        self.filled: set[str] = set()  # mirrors whose pass ended since vLLM last asked
        self.store: SessionStore | None = None
        self.saved: dict[str, int] = {}  # entries saved since vLLM last asked -> their own bytes
        self.store_changed = False
        self.counts_stats = role == KVConnectorRole.SCHEDULER or tensor_parallel_rank() == 0
        self.stats = TokenDanceStats()
        if role == KVConnectorRole.SCHEDULER and not self.disabled:
            self._book()  # the boundary-token table now, not in the first round's step

    # ------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self.block_pool = gpu_block_pool

    def _book(self) -> RoundBook:
        if self.book is None:
            boundaries = handoff.boundary_token_ids(self._vllm_config.model_config)
            self.book = RoundBook(boundaries, self.settings.round_timeout_s, self.settings.hold_timeout_s,
                                  self.settings.claim_tokens_per_step, anchors=self.settings.anchors,
                                  block_size=self.block_size, lookup=self._cached_block,
                                  store=self.store_index,
                                  confirm_steps=2 if self._vllm_config.scheduler_config.async_scheduling else 1)
        return self.book

    def _cached_block(self, block_hash) -> int | None:
        """The block vLLM's prefix cache holds for a hash (one KV cache group), or None."""
        if self.block_pool is None or not self._single_group:
            return None
        blocks = self.block_pool.get_cached_block(block_hash, [0])
        return None if blocks is None else blocks[0].block_id

    @property
    def _single_group(self) -> bool:
        config = self._kv_cache_config
        return config is None or len(config.kv_cache_groups) == 1

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

    def on_new_request(self, request) -> None:
        if self.disabled:
            return
        try:
            tag = RoundTag.parse(request.kv_transfer_params)
        except RoundParamsError as exc:
            logger.warning("TokenDanceConnector: request %s computed exactly: %s", request.request_id, exc)
            return
        if tag is None:
            return
        if not request.cache_salt:
            logger.warning("TokenDanceConnector: request %s of round %r has no cache_salt: computed exactly "
                           "(reused KV enters the prefix cache only under the agent's own salt)",
                           request.request_id, tag.round_id)
            return
        self._book().add(request.request_id, tag, list(request.prompt_token_ids or []), salt=request.cache_salt)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.book is None or self.book.find(request.request_id) is None:
            return 0, False
        count = self.book.claim(request.request_id, num_computed_tokens)
        if count:
            member = self.book.find(request.request_id)
            self._pin_session(request.request_id, member.session_blocks)
            if member.store_entry is not None:
                self.store_index.pin(member.store_entry)
                self.store_pins[request.request_id] = member.store_entry
        return count, bool(count) and self.settings.pass_tokens_per_step > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        member = None if self.book is None else self.book.commit(request.request_id, num_external_tokens)
        if member is not None:
            member.block_ids[:] = blocks.get_block_ids()[0]  # before any load reads a piece it provides
            self.pending[request.request_id] = member
        else:
            self._unpin_session(request.request_id)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = TokenDanceMetadata()
        if self.book is None:
            return meta
        for request_id, member in self.pending.items():
            start, end = member.claim
            meta.loads.append(MirrorLoad(request_id, list(member.block_ids), start, member.token_ids[start:end],
                                         self.book.loads_for(member), member.tag.recompute_ratio))
            self.in_flight[request_id] = member
            pinned = self.book.sent(member)  # pieces no master computes, which later members read from its blocks
            if pinned:
                self.block_pool.touch([self.block_pool.blocks[i] for i in pinned])
        if self.store_index is not None:  # the pieces the store keeps as masters, once these passes ran
            for load in meta.loads:
                load.masters = self.book.master_pieces(self.pending[load.request_id])
                load.round_serial = self.book.round_of(load.request_id)
        self.pending.clear()
        if self.settings.pass_tokens_per_step <= 0:  # the workers run these passes whole in this step
            self._filled(list(self.in_flight))
        elif any(n == 1 for n in scheduler_output.num_scheduled_tokens.values()):
            meta.budget = self.settings.pass_tokens_per_step  # someone decodes: advance the passes by slices
        self._watch_masters(scheduler_output)
        self._release(self.book.releasable())
        self.book.next_step()
        if self.store_index is not None:
            meta.saves, meta.drops, meta.closes = self.store_index.take_orders()
        return meta

    def update_connector_output(self, connector_output) -> None:
        if self.book is not None and connector_output.invalid_block_ids:
            self.book.failed_blocks(set(connector_output.invalid_block_ids))
        self._filled(connector_output.finished_recving or ())
        if self.store_index is not None:
            report = connector_output.kv_connector_worker_meta
            self.store_index.reported(connector_output.finished_sending or (),
                                      report.sizes if isinstance(report, StoreReport) else {},
                                      report.total_bytes if isinstance(report, StoreReport) else None)

    def has_pending_push_work(self) -> bool:
        return self.store_index is not None and self.store_index.busy

    def _filled(self, request_ids) -> None:
        """The workers finished these mirrors' passes: the sources they read are free to go."""
        for request_id in request_ids:
            member = self.in_flight.pop(request_id, None)
            if member is not None:
                member.filled = True
            self._unpin_session(request_id)
        if self.book is not None:
            self._release(self.book.releasable())

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
                block_ids = self._kv_cache_manager.get_block_ids(master.request_id)[0]
                self.book.mark_ready(master.request_id, block_ids)
                self.block_pool.touch([self.block_pool.blocks[i] for i in block_ids])

    def _release(self, block_ids: list[int]) -> None:
        """Unpin, tails first: as vLLM frees a request's blocks, so a prompt's first blocks (the
        agent's session for its next round) are evicted last."""
        if block_ids:
            self.block_pool.free_blocks([self.block_pool.blocks[i] for i in reversed(block_ids)])

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        if self.book is None:
            return False, None
        member = self.book.find(request.request_id)
        self.pending.pop(request.request_id, None)
        if request.request_id not in self.in_flight:  # else its pass still reads them (vLLM keeps its blocks)
            self._unpin_session(request.request_id)
        if member is None:
            return False, None
        closed = self.book.finish(request.request_id, request.all_token_ids, request.block_hashes)
        self._release(self.book.releasable())
        claimed = 0 if member.claim is None or not member.loaded else member.claim[1] - member.claim[0]
        saving = self._save(request, member, block_ids)
        if closed is not None and self.store_index is not None:
            self.store_index.closes.append(closed)
        return saving, {"tokendance": {"role": member.role, "claimed_tokens": claimed}}

    def _save(self, request, member, block_ids: list[int]) -> bool:
        """Keep a finished member's KV in the store (its blocks held until the workers copied
        them); not a mirror whose pass is still running, nor one the store cannot name."""
        length = min(request.num_computed_tokens, len(block_ids) * self.block_size)
        if (self.store_index is None or not member.salt or length <= 0
                or request.request_id in self.in_flight or (member.role == "mirror" and member.loaded and not member.filled)):
            return False
        pieces = [(p.key, p.start, p.end) for p in member.pieces if p.end <= length]
        self.store_index.save((member.tag.namespace, member.tag.agent_id), member.salt,
                              list(request.all_token_ids[:length]), list(block_ids), pieces, request.request_id)
        return True

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches) -> None:
        self.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """This step's new mirrors join the passes (one pass per step, run in order); the passes
        advance by the step's budget, or to their end."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, TokenDanceMetadata):
            return
        if meta.saves or meta.drops or meta.closes:
            self._store_work(meta.saves, meta.drops, meta.closes)
        if meta.loads:
            self.passes.append((meta.loads, self._pass().steps(meta.loads)))
        spent = 0.0
        while self.passes and (not meta.budget or spent < meta.budget):
            loads, steps = self.passes[0]
            try:
                with torch.inference_mode():
                    spent += next(steps)
                continue
            except StopIteration as done:
                if self.counts_stats:
                    self.stats.aggregate(TokenDanceStats({"mirrors": len(loads), "passes": 1, **done.value}))
                if any(load.masters for load in loads):  # the sources they read are all written now
                    self._capture(loads)
            except Exception:  # never a wrong answer: vLLM recomputes these blocks (kv_load_failure_policy)
                logger.exception("TokenDanceConnector: the mirrors' pass failed; their blocks are reported as load errors")
                if self.counts_stats:
                    self.stats.aggregate(TokenDanceStats({"failed_mirrors": len(loads)}))
                for load in loads:
                    self.failed_block_ids.update(load.block_ids)
            self.passes.pop(0)
            self.filled.update(load.request_id for load in loads)

    def _capture(self, loads: list[MirrorLoad]) -> None:
        """The pieces these mirrors read from the members that computed them (masters, first
        holders: still pinned), into the store as those pieces' masters."""
        store, before = self._store(), self._store().nbytes
        for load in loads:
            for key, block_ids, start, length in load.masters:
                slots = self._pass()._slots(block_ids, start, start + length)
                store.capture(key, lambda index: self.mirror_pass.layouts[index].read(slots), start, start + length,
                              load.round_serial)
        self.store_changed = True
        if self.counts_stats:
            self.stats.aggregate(TokenDanceStats({"store_bytes": store.nbytes - before}))

    def _store_work(self, saves: list[SaveOrder], drops: list[str], closes: list[int]) -> None:
        """Copy finished requests' KV into the store, then forget the entries dropped and the
        closed rounds' masters no entry reads."""
        store = self._store()
        before, agents = store.nbytes, len(store.sessions)
        for order in saves:
            try:
                slots = self._pass()._slots(order.block_ids, 0, order.length)
                layouts = self._pass().layouts
                store.save(order.entry, lambda index: layouts[index].read(slots), order.length, order.pieces)
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
        if self.counts_stats:
            self.stats.aggregate(TokenDanceStats({"store_bytes": store.nbytes - before,
                                                  "store_agents": len(store.sessions) - agents}))

    def _store(self) -> SessionStore:
        if self.store is None:
            self.store = SessionStore(len(self._pass().layouts), self._pass().rotate)
            self._pass().store = self.store
        return self.store

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose KV the store took (vLLM frees their blocks now); mirrors whose pass ended
        (asynchronous loads: vLLM schedules them next)."""
        sent = set(self.saved) or None
        if self.settings.pass_tokens_per_step <= 0 or not self.filled:
            self.filled.clear()
            return sent, None
        filled, self.filled = self.filled, set()
        return sent, filled

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The store's sizes after this step's saves (the scheduler side's budget reads them)."""
        if not self.store_changed:
            return None
        report = StoreReport(dict(self.saved), self.store.nbytes)
        self.saved, self.store_changed = {}, False
        return report

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's passes (rank 0's: vLLM sums the ranks') or the scheduler's rounds since
        the last call; vLLM adds the two up before they reach its loggers and `/metrics`."""
        if self.book is not None:
            self.stats.aggregate(TokenDanceStats(self.book.take_counters()))
        if self.store_index is not None:
            self.stats.aggregate(TokenDanceStats(self.store_index.take_counters()))
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, TokenDanceStats()
        return stats

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from tokendance.vllm_plugin.metrics import TokenDancePromMetrics

        return TokenDancePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TokenDanceStats(data=dict(data or {}))

    def _pass(self):
        if self.mirror_pass is None:
            from tokendance.vllm_plugin.worker import MirrorPass

            self.mirror_pass = MirrorPass(handoff.model(), handoff.layouts(self._vllm_config, self.kv_caches),
                                          self.block_size, self.settings.selection, self.settings.recompute_ratio,
                                          self.settings.check_layer)
        return self.mirror_pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self.failed_block_ids = self.failed_block_ids, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        return
