"""Continuous batching: a per-step token budget shared by decodes and (chunked) prefills, with
preemption by recomputation when KV blocks run out."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tokendance.engine.request import Request, RequestStatus
from tokendance.kv.manager import NO_HIT, BlockCopy, KVCacheManager
from tokendance.model.runner import ScheduledRequest, SchedulerOutput


class Scheduler:
    """Owns request state. Running requests keep arrival order: the newest is preempted first."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        reclaim: Callable[[], bool] = lambda: False,
    ):
        """`reclaim` frees idle KV held outside requests (e.g. an idle agent session) and says
        whether it freed anything; it is tried before preempting a running request."""
        self.kv = kv
        self.reclaim = reclaim
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            copies = self._allocate_or_preempt(request, num_new)
            if copies is None:  # the request itself was preempted
                break
            self._emit(out, request, num_new, copies)
            budget -= num_new
            index += 1
        # After a preemption, admitting new work would only thrash.
        preempted = self.num_preemptions > preemptions_before
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.prepared:  # a round prefill built its table and set its computed count
                hit, num_computed = NO_HIT, request.num_computed_tokens
            else:
                hit = self.kv.find_prefix_hit(request.token_ids, request.namespace)
                # A fully cached prompt still computes its last token (for the next-token logits).
                num_computed = min(hit.num_tokens(self.kv.block_size), request.num_tokens - 1)
            num_new = min(request.num_tokens - num_computed, budget)
            copies = self._allocate(request, num_computed + num_new, num_computed, hit)
            if copies is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            self.running.append(request)
            self._emit(out, request, num_new, copies)
            budget -= num_new
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[BlockCopy] | None:
        """Allocate the request's next tokens, preempting the newest running requests until it
        fits. Returns None if the request had to preempt itself."""
        while True:
            copies = self._allocate(
                request, request.num_computed_tokens + num_new, request.num_computed_tokens, NO_HIT
            )
            if copies is not None:
                return copies
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None

    def _allocate(self, request: Request, num_tokens: int, num_computed: int, hit) -> list[BlockCopy] | None:
        while True:
            copies = self.kv.allocate_slots(request.request_id, num_tokens, num_computed, hit)
            if copies is not None or not self.reclaim():
                return copies

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.prepared = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int, copies) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        out.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.token_ids[start:end],
                positions=range(start, end),
                context_slots=self.kv.get_slots(request.request_id)[:end],
                sample=end == request.num_tokens,
                sampling_params=request.sampling_params,
            )
        )
        out.block_copies.extend(copies)
        out.num_batched_tokens += num_new

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int], requests: dict[str, Request]
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that hit a token-level
        stop. Returns the requests that received a token this step."""
        advanced = []
        for item in out.scheduled:
            request = requests[item.request_id]
            request.num_computed_tokens += len(item.token_ids)
            self.kv.register_computed_blocks(
                request.request_id, request.token_ids, request.num_computed_tokens, request.namespace
            )
            token = sampled.get(item.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            advanced.append(request)
            reason = request.check_token_stop()
            if reason is not None:
                self.finish(request, reason)
        return advanced

    def finish(self, request: Request, reason: str) -> None:
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if request.retain_kv and reason != "abort":
            self.kv.truncate(request.request_id, request.num_computed_tokens)
        else:
            self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
