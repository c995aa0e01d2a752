"""The step loop: add_request -> step (schedule -> run model -> update) -> outputs.

Results re-enter the engine in one place, `step`, and only the scheduler changes request state.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence

import torch

from tokendance.config import EngineConfig
from tokendance.engine.request import Request, RequestStatus
from tokendance.engine.rounds import RoundRunner
from tokendance.model.runner import ModelRunner
from tokendance.engine.scheduler import Scheduler
from tokendance.errors import CapacityError, ContextLengthError, InvalidRequestError
from tokendance.kv.manager import KVCacheManager
from tokendance.model.llama import KVCacheTensors, LlamaModel
from tokendance.model.loader import LoadedModel, load_model
from tokendance.model.platform import auto_kv_cache_bytes, probe_cpu, resolve_dtype
from tokendance.outputs import RequestOutput
from tokendance.sampling import SamplingParams

logger = logging.getLogger("tokendance")


class LLMEngine:
    """Owns the model, the KV pool, the scheduler and the round runner; `step` is the only place
    results re-enter the engine."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """`loaded` reuses weights already in memory (several engines over one model)."""
        self.config = config
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        loaded = loaded or load_model(config.model)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_model_len, loaded.config.max_model_len)
        self.cpu = probe_cpu()
        dtype = resolve_dtype(config.dtype, self.cpu, config.device)
        self.dtype = str(dtype).removeprefix("torch.")
        model = LlamaModel(loaded.config, loaded.weights, dtype, config.device, config.max_num_batched_tokens,
                           packed_bf16=self.cpu.packed_bf16)
        self.bytes_per_block = KVCacheTensors.bytes_per_slot(loaded.config, dtype) * config.block_size
        self.kv_cache_bytes = auto_kv_cache_bytes() if config.kv_cache_bytes == "auto" else config.kv_cache_bytes
        num_blocks = self.kv_cache_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise InvalidRequestError(
                f"kv_cache_bytes={self.kv_cache_bytes} holds no block of {self.bytes_per_block} bytes"
            )
        logger.info("%s: dtype %s (asked %s), CPU %s; KV pool %d MiB = %d blocks of %d tokens%s",
                    loaded.name, self.dtype, config.dtype, self.cpu.describe(), self.kv_cache_bytes >> 20,
                    num_blocks, config.block_size, " (auto)" if config.kv_cache_bytes == "auto" else "")
        kv_tensors = KVCacheTensors.allocate(loaded.config, num_blocks * config.block_size, dtype, config.device)
        prefix_caching = config.enable_prefix_caching and config.reuse != "full"
        self.kv = KVCacheManager(num_blocks, config.block_size, prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_batched_tokens, config.max_num_seqs, reclaim=lambda: self.rounds.reclaim()
        )
        self.runner = ModelRunner(model, kv_tensors, config.block_size)
        if not 0 <= config.check_layer < loaded.config.num_layers:
            raise InvalidRequestError(f"check_layer must be in [0, {loaded.config.num_layers}), got {config.check_layer}")
        self.rounds = RoundRunner(
            self, config.reuse, config.selection, config.recompute_ratio, config.check_layer, config.collective_selection
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------ requests in

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: str = "",
    ) -> Request:
        """Validate and tokenize; no side effect, so a batch can be checked before any is added."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, token_ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            if any(t < 0 or t >= vocab for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        else:
            raise InvalidRequestError("a prompt must be a string or a list of token ids")
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(
                f"prompt has {len(token_ids)} tokens; the context window is {self.max_model_len} "
                "and at least one token must be generated"
            )
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        needed = self.kv.num_blocks_needed(len(token_ids) + max_tokens)
        if needed > self.kv.pool.num_blocks:
            raise CapacityError(
                f"request needs {needed} KV blocks ({len(token_ids)} prompt + {max_tokens} new tokens) "
                f"but the cache holds {self.kv.pool.num_blocks}; raise kv_cache_bytes or lower max_tokens"
            )
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif request_id in self.requests or self.kv.has(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            max_tokens=max_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
            namespace=namespace,
            prompt=text,
            arrival_time=time.perf_counter(),
        )

    def add(self, request: Request) -> str:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None, namespace: str = "") -> str:
        return self.add(self.make_request(prompt, params, request_id, namespace))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, "abort")
        self.runner.release(request_id)
        return self._output(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns an output for every request that got a token (finished or not)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        result = self.runner.execute(out)
        now = time.perf_counter()
        for request_id, logits in result.logits.items():
            request = self.requests[request_id]
            wanted = request.sampling_params.return_logits
            if wanted is True or len(request.logits) < wanted:
                request.logits.append(logits)
        advanced = self.scheduler.update_from_output(out, result.sampled, self.requests)
        outputs = []
        for request in advanced:
            if request.first_token_time is None:
                request.first_token_time = now
            self._check_stop_strings(request)
            if request.status is RequestStatus.FINISHED:
                request.finish_time = now
                del self.requests[request.request_id]
                self.runner.release(request.request_id)
            outputs.append(self._output(request))
        return outputs

    def _check_stop_strings(self, request: Request) -> None:
        stops = request.sampling_params.stop_strings
        if not stops or request.status is RequestStatus.FINISHED:
            return
        text = self.tokenizer.decode(request.output_token_ids)
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            request.stop_text_end = min(found)
            self.scheduler.finish(request, "stop")

    def _output(self, request: Request) -> RequestOutput:
        text = self.tokenizer.decode(request.output_token_ids)
        if request.stop_text_end is not None:
            text = text[: request.stop_text_end]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_generated_tokens=len(request.output_token_ids),
            num_preemptions=request.num_preemptions,
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
            logits=list(request.logits),
        )
