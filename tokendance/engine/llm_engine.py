"""The step loop: add_request -> step (schedule -> run model -> update) -> outputs.

Results re-enter the engine in one place, `step`, and only the scheduler changes request state;
the engine keeps each request's output state (incremental text, times, kept logits) beside it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from collections import deque
from dataclasses import dataclass

import torch

from tokendance.config import BATCH_INVARIANT_CHUNK, EngineConfig
from tokendance.engine.detokenizer import IncrementalDetokenizer
from tokendance.engine.jobs import KVGroup, KVJob
from tokendance.engine.output_state import OutputState
from tokendance.engine.request import Request, RequestStatus
from tokendance.engine.scheduler import Scheduler
from tokendance.errors import CapacityError, ContextLengthError, InvalidRequestError
from tokendance.kv.manager import KVCacheManager, SessionKey
from tokendance.batch import SchedulerOutput
from tokendance.model.runner import ModelRunner, RunnerOutput
from tokendance.structured import GrammarCompiler
from tokendance.model.llama import KVCacheTensors, LlamaModel
from tokendance.model.loader import LoadedModel, load_model
from tokendance.model.platform import auto_kv_cache_bytes, probe_cpu, resolve_dtype
from tokendance.model.roofline import Account, ModelShape, items_work, machine_peaks
from tokendance.outputs import RequestOutput
from tokendance.reuse.policy import policy_class
from tokendance.sampling import SamplingParams

logger = logging.getLogger("tokendance")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for metrics, benchmarks and the server (they never read the
    engine's parts directly)."""

    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_sessions: int  # agents whose KV is kept between rounds
    num_evictions: int  # kept tables (sessions) evicted to make room
    bytes_per_block: int = 0  # KV bytes of one block, all layers

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


class LLMEngine:
    """Owns the model, the KV pool and the scheduler; `step` is the only place results re-enter
    the engine. Rounds are jobs it runs in its steps (`engine/round_job.py`)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """`loaded` reuses weights already in memory (several engines over one model)."""
        self.config = config
        if config.num_threads is not None:  # process-wide: only when asked for
            torch.set_num_threads(config.num_threads)
        self.cpu = probe_cpu()
        dtype = resolve_dtype(config.dtype, self.cpu, config.device)
        loaded = loaded or load_model(config.model, dtype)
        self.model_name = loaded.name
        self.sampling_defaults = dict(loaded.sampling_defaults)  # for requests that do not set these fields
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_model_len, loaded.config.max_model_len)
        self.dtype = str(dtype).removeprefix("torch.")
        model = LlamaModel(loaded.config, loaded.weights, dtype, config.device, config.max_num_batched_tokens,
                           cpu=self.cpu, batch_invariant=config.batch_invariant, prepared=loaded.prepared)
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
        self.num_kv_tokens = num_blocks * config.block_size  # what the pool holds, all tables together
        prefix_caching = config.enable_prefix_caching and policy_class(config.reuse).enables_prefix_caching
        self.kv = KVCacheManager(num_blocks, config.block_size, prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   BATCH_INVARIANT_CHUNK if config.batch_invariant else None)
        self.grammars = GrammarCompiler(self.tokenizer, loaded.config.eos_token_ids)
        self.runner = ModelRunner(model, kv_tensors, config.block_size, self.grammars)
        self.shape = ModelShape.of(loaded.config, dtype)
        self.peaks = machine_peaks(dtype, self.cpu.describe())  # measured once per machine, then cached
        self.account = Account()  # the work of every forward, by kind (model/roofline.py)
        if not 0 <= config.check_layer < loaded.config.num_layers:
            raise InvalidRequestError(f"check_layer must be in [0, {loaded.config.num_layers}), got {config.check_layer}")
        self.requests: dict[str, Request] = {}
        self.jobs: deque[KVJob] = deque()  # rounds, prepared one at a time in the order they came
        self._held: dict[str, list[Request]] = {}  # request id -> requests that start at its first output
        self._held_after: dict[str, str] = {}  # a held request's id -> the id it waits for
        self._outputs: dict[str, OutputState] = {}
        self._ids = itertools.count()

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free,
            block_size=self.kv.block_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_sessions=len(self.kv.find_kept(SessionKey)),
            num_evictions=self.kv.num_evictions,
            bytes_per_block=self.bytes_per_block,
        )

    # ------------------------------------------------------------ requests in

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: str = "",
        agent_id: str | None = None,
        retain_kv: bool = False,
        group: str | None = None,
        score_from: int = 0,
    ) -> Request:
        """Validate and tokenize; no side effect, so a batch can be checked before any is added.
        `retain_kv`: the request's table outlives it (a round keeps it as the agent's session).
        `group`: the job the request belongs to (a round, a request's several prompts); the
        scheduler shares its slots fairly between groups, not between requests."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if params.structured is not None:
            self.grammars.matcher(params.structured)  # compiled (and kept) now: a bad grammar is the caller's error
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
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
        if any(t >= self.model_config.vocab_size for t in params.logit_bias or ()):
            raise InvalidRequestError(f"logit_bias names token ids beyond the vocabulary ({self.model_config.vocab_size})",
                                      "logit_bias")
        choices = params.structured.choice if params.structured is not None else None
        if choices and params.min_tokens > max(len(c.encode()) for c in choices):  # a token spells >= 1 byte
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) is more than any guided_choice can be "
                                      f"({max(len(c.encode()) for c in choices)} bytes)", "min_tokens")
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
            agent_id=agent_id,
            retain_kv=retain_kv,
            group=group,
            score_from=score_from,
            arrival_time=time.perf_counter(),
        )

    def check_prompt_chars(self, num_chars: int) -> None:
        """Reject a text that cannot fit the context window before tokenizing it (a 5 MB prompt
        took seconds to tokenize only to be refused)."""
        if num_chars > 2 * self.max_model_len * self.tokenizer.max_chars_per_token:
            raise ContextLengthError(
                f"prompt has {num_chars} characters, more than any {self.max_model_len}-token context window "
                "holds with this tokenizer"
            )

    def check_chat_size(self, messages) -> None:
        """Reject a chat that cannot fit the context window before rendering it: by its characters,
        and by its number of messages (each takes at least one token)."""
        if len(messages) >= self.max_model_len:
            raise ContextLengthError(f"the chat has {len(messages)} messages; the context window is "
                                     f"{self.max_model_len} tokens")
        self.check_prompt_chars(sum(len(m["content"]) for m in messages if isinstance(m, dict)
                                    and isinstance(m.get("content"), str)))

    def add(self, request: Request, after: str | None = None) -> str:
        """Schedule a request. `after`: hold it until that request has its first output (its
        prompt computed), so a choice sharing the prompt finds it in the prefix cache instead of
        computing it beside it (the n choices of a prompt)."""
        if request.request_id in self.requests or request.request_id in self._held_after:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if after is not None and after in self.requests:
            self._held.setdefault(after, []).append(request)
            self._held_after[request.request_id] = after
            return request.request_id
        self.requests[request.request_id] = request
        self._outputs[request.request_id] = OutputState(
            IncrementalDetokenizer(self.tokenizer, request.sampling_params.stop_strings))
        self.scheduler.add(request)
        return request.request_id

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None, namespace: str = "") -> str:
        return self.add(self.make_request(prompt, params, request_id, namespace))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id in self._held_after:  # never started: it finishes without running
            held = self._held[self._held_after.pop(request_id)]
            request = next(r for r in held if r.request_id == request_id)
            held.remove(request)
            self.add(request)
        if request_id not in self.requests:
            return None
        output = self._close(request_id, "abort")
        self._release_held([output])
        return output

    def add_job(self, job: KVJob) -> None:
        """Queue a job (a round): the steps advance it after the jobs added before it."""
        self.jobs.append(job)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.jobs) or bool(self._held_after)

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one batch: the scheduler's decodes and prefill chunks, and the next forward group of
        the current job's preparation, in one forward. Returns an output for every request that
        got a token (finished or not)."""
        job = self.jobs[0] if self.jobs else None
        if job is not None:  # agents whose tables became ready since the last step run in this one
            self._job_call(job, job.advance)
            self._add_ready(job)
        budget = self.config.max_num_batched_tokens
        # a preparing job keeps half the budget from long prefills; decodes still all run
        out = self.scheduler.schedule(budget - budget // 2 if job is not None and job.has_work else budget,
                                      can_wait=job is not None)
        group = None
        if job is not None:
            room = budget - out.num_batched_tokens
            if self.scheduler.running:  # requests decode: a smaller group, so their tokens keep coming
                room = min(room, self.config.round_group_tokens)
            group = self._job_call(job, job.next_group, room)
        outputs = []
        if not out.is_empty or group is not None:
            out, result, failed, group = self._run(out, group, job)
            outputs = self._update(out, result, failed)
        if job is not None:
            outputs = self._advance_job(job, group, outputs)
        self._release_held(outputs)
        return outputs

    def _release_held(self, outputs: list[RequestOutput]) -> None:
        """Requests held after one that now has an output (or finished) start."""
        for output in outputs:
            for request in self._held.pop(output.request_id, ()):
                del self._held_after[request.request_id]
                self.add(request)

    def abort_all(self, error: BaseException) -> None:
        """Abort every request and fail every job (a driver's last resort after a bug)."""
        for job in list(self.jobs):
            self._job_call(job, job.fail, error)
            self.jobs.remove(job)
        for request_id in list(self.requests):
            self._close(request_id, "abort")
        self._held.clear()
        self._held_after.clear()

    def _run(self, out: SchedulerOutput, group: KVGroup | None, job: KVJob | None):
        """Run the step; a failure is narrowed down: the job's group alone (if it fails, the job
        does), then the requests one by one. Returns (the requests that ran, their result, (id,
        error) of the requests that failed, the group if it ran)."""
        sampling = self.runner.sampler.snapshot()
        try:
            return out, self._forward(out, group), [], group
        except Exception as exc:
            self.runner.sampler.restore(sampling)
            error = exc
        if group is not None:
            try:
                self.runner.compute_kv(SchedulerOutput(group.items), group.num_layers)
            except Exception as job_error:
                logger.exception("a round's preparation failed")
                self._job_call(job, job.fail, job_error)
                group = None
            try:
                return out, self._forward(out, None), [], group
            except Exception as exc:
                self.runner.sampler.restore(sampling)
                error = exc
        return *self._isolate(out, error), group

    def _forward(self, out: SchedulerOutput, group: KVGroup | None) -> RunnerOutput:
        items = []
        if group is not None and group.num_layers is not None:  # a partial pass (the check pass): its own
            started = time.perf_counter()
            self.runner.compute_kv(SchedulerOutput(group.items), group.num_layers)
            self._count({"check": items_work(group.items, self.shape, group.num_layers)}, group.num_layers, started)
        elif group is not None:
            items = group.items
        if not items and out.is_empty:
            return RunnerOutput({}, {})
        started, sampling = time.perf_counter(), self.runner.sampling_seconds
        result = self.runner.execute(SchedulerOutput(out.scheduled + items, out.block_copies))
        sampled = self.runner.sampling_seconds - sampling
        self.account.sampling_seconds += sampled
        parts = {"prepare": items_work(items, self.shape),
                 "decode": items_work([i for i in out.scheduled if i.is_decode], self.shape),
                 "prefill": items_work([i for i in out.scheduled if not i.is_decode], self.shape)}
        self._count(parts, None, started, sampled)
        return result

    def _count(self, parts: dict, num_layers: int | None, started: float, excluded: float = 0.0) -> None:
        """A forward's work into the account, with the time since `started` less `excluded` (the sampler's)."""
        self.account.record(parts, self.shape, num_layers, time.perf_counter() - started - excluded, self.peaks)

    def _job_call(self, job: KVJob, fn, *args):
        """Call into a job; a bug there fails that job (its round), not the engine."""
        try:
            return fn(*args)
        except Exception as exc:
            logger.exception("a round failed")
            if job.error is None:
                try:
                    job.fail(exc)
                except Exception:
                    logger.exception("a failed round could not clean up")
                    job.error = exc
            return None

    def _advance_job(self, job: KVJob, group: KVGroup | None, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """After the step: the job learns what ran and what finished, and hands over the requests
        whose KV it prepared. A failed job's requests are aborted (the caller sees `job.error`)."""
        if group is not None and job.error is None:
            self._job_call(job, job.group_ran, group)
        self._add_ready(job)
        if job.error is None:
            self._job_call(job, job.observe, outputs)
        if job.error is not None:
            ids = set(job.request_ids)
            for request_id in ids & self.requests.keys():
                self._close(request_id, "abort")
            outputs = [o for o in outputs if o.request_id not in ids]
        if job.done:
            self.jobs.remove(job)
        return outputs

    def _add_ready(self, job: KVJob) -> None:
        for request in (self._job_call(job, job.take_ready) or []) if job.error is None else []:
            self.add(request)

    def _update(self, out: SchedulerOutput, result: RunnerOutput, failed: list) -> list[RequestOutput]:
        """The step's results re-enter the engine: tokens, stops, finished requests."""
        now = time.perf_counter()
        for request_id, logits in result.logits.items():
            state, wanted = self._outputs[request_id], self.requests[request_id].sampling_params.return_logits
            if wanted is True or len(state.logits) < wanted:
                state.logits.append(logits)
        for request_id, entry in result.logprobs.items():
            self._outputs[request_id].logprobs.append(entry)
        for request_id, entries in result.prompt_logprobs.items():
            state = self._outputs[request_id]
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None] * self.requests[request_id].num_prompt_tokens
            for position, entry in entries:  # a preempted request recomputes: the same entries again
                state.prompt_logprobs[position] = entry
        for request_id, rows in result.prompt_logits.items():
            self._outputs[request_id].prompt_logits.update(rows)
        advanced = self.scheduler.update_from_output(out, result.sampled, self.requests)
        outputs = []
        for request in advanced:
            state = self._outputs[request.request_id]
            state.first_token_time = state.first_token_time or now
            state.detokenizer.update(request.output_token_ids)
            if state.detokenizer.stop_text_end is not None:
                self.scheduler.finish(request, "stop")  # no-op if a token stop finished it already
            if request.status is RequestStatus.FINISHED:
                state.finish_time = now
                state.detokenizer.finish(request.output_token_ids)
                del self.requests[request.request_id], self._outputs[request.request_id]
                self.runner.release(request.request_id)
            outputs.append(state.output(request))
        return outputs + [self._fail(request_id, error, now) for request_id, error in failed]

    def _isolate(self, out: SchedulerOutput, exc: Exception):
        """The batch failed: each request of it runs alone (`ModelRunner.execute_each`). Returns
        the batch of those that ran, their merged result, and (id, error) of the others."""
        if len(out.scheduled) <= 1:
            failed = [(item.request_id, exc) for item in out.scheduled]
            kept, result = SchedulerOutput(), RunnerOutput({}, {})
        else:
            kept, result, failed = self.runner.execute_each(out)
        for request_id, error in failed:
            logger.error("request %s failed in a step", request_id, exc_info=error)
        return kept, result, failed

    def _fail(self, request_id: str, error: Exception, now: float) -> RequestOutput:
        """Finish a request whose computation raised, with finish_reason "error" and the reason."""
        output = self._close(request_id, "error", now)
        output.error = f"{type(error).__name__}: {error}"
        return output

    def _close(self, request_id: str, reason: str, now: float | None = None) -> RequestOutput:
        """Finish a request outside the normal step (abort, error) and give its last output."""
        request = self.requests.pop(request_id)
        self.scheduler.finish(request, reason)
        self.runner.release(request_id)
        state = self._outputs.pop(request_id)
        state.finish_time = now
        state.detokenizer.finish(request.output_token_ids)
        return state.output(request)
