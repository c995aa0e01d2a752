"""Continuous batching: a per-step token budget shared by decodes and (chunked) prefills, with
preemption by recomputation when KV blocks run out, and admission that is fair between jobs (a
round's agents, a request's prompts), not between requests."""

from __future__ import annotations

from collections import Counter, deque

from tokendance.batch import ScheduledRequest, SchedulerOutput
from tokendance.engine.request import Request, RequestStatus
from tokendance.errors import CapacityError
from tokendance.kv.manager import NO_HIT, BlockCopy, KVCacheManager


class Scheduler:
    """The only writer of request state. Running requests keep arrival order: the newest is
    preempted first. KV that exists before a request runs (prefix-cache hits, a table a round
    prefill prepared) enters through `kv.find_computed` (a query) and `kv.allocate_slots` (the
    commit); the KV manager evicts idle kept tables itself when an allocation needs room.

    Admission takes, of the group (`Request.group_key`) running the fewest requests, its earliest
    waiting request; a group with more requests waiting than free slots (it queues anyway) leaves
    the last `reserved_seqs` slots to other groups. So a 300-agent round runs its agents
    `max_num_seqs - reserved_seqs` at a time, and a chat that arrives meanwhile starts at the
    next step instead of after the round."""

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 fixed_chunk: int | None = None):
        """`fixed_chunk` (batch-invariant engines): prompt chunks end at multiples of it or at the
        prompt's end, whatever else runs, and prefix-cache hits are cut to a multiple of it."""
        self.kv = kv
        self.fixed_chunk = fixed_chunk
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.reserved_seqs = max_num_seqs // 16
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, budget: int | None = None, can_wait: bool = False) -> SchedulerOutput:
        """`budget`: tokens this step may schedule (default: all); `can_wait`: other work (a round's
        preparation) will free or use the pool, so a blocked queue waits instead of failing."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens if budget is None else budget
        preemptions_before = self.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            shared = bool(self.waiting) or index < len(self.running) - 1
            limit = self._chunk(request, shared) if self.fixed_chunk is None else self.fixed_chunk
            num_new = self._aligned(request, request.num_computed_tokens,
                                    min(request.num_tokens - request.num_computed_tokens, budget, limit))
            if num_new == 0:  # its next fixed chunk does not fit this step's budget
                index += 1
                continue
            copies = self._allocate_or_preempt(request, num_new)
            if copies is None:  # the request itself was preempted
                break
            self._emit(out, request, num_new, copies)
            budget -= num_new
            index += 1
        # After a preemption, admitting new work would only thrash.
        if self.num_preemptions == preemptions_before:
            self._admit(out, budget)
        if out.is_empty and self.waiting and not self.running and not can_wait:
            self._unblock(out, budget)
        return out

    def _chunk(self, request: Request, shared: bool) -> int:
        """The most prefill tokens a running request computes this step. Deep into a long prompt
        each new token attends to more, so chunks shrink there (chunk x context at most budget x
        512: a step of ~1 s here, so a newcomer waits at most that); beside other requests, running
        or waiting, a quarter of the budget and chunk x context at most budget x 128 (a step every
        ~0.2 s: a chat beside a 7,800-token prompt answers in ~2 s instead of after it)."""
        context = max(1, request.num_computed_tokens)
        if not shared:
            return max(16, self.max_num_batched_tokens * 512 // context)
        return max(1, min(self.max_num_batched_tokens // 4, max(16, self.max_num_batched_tokens * 128 // context)))

    def _aligned(self, request: Request, start: int, num_new: int) -> int:
        """With a fixed chunk, the new tokens end at a multiple of it or at the last known token
        (0: the request waits for a step with room)."""
        end = start + num_new
        if self.fixed_chunk is None or end >= request.num_tokens:
            return num_new
        return max(0, end // self.fixed_chunk * self.fixed_chunk - start)

    def _unblock(self, out: SchedulerOutput, budget: int) -> None:
        """Nothing runs and nothing fits: waiting requests' prepared tables hold the pool. Drop
        them newest first (those requests will be computed from scratch) until one is admitted."""
        for request in list(reversed(self.waiting)):
            if self.kv.drop_prepared([request.request_id]):
                self._admit(out, budget)
                if not out.is_empty:
                    return
        raise CapacityError("the KV pool cannot make progress: nothing runs and nothing fits")

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        running = Counter(r.group_key for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._next_waiting(running)
            if request is None:
                return
            computed = self.kv.find_computed(request.request_id, request.token_ids, request.namespace)
            if request.sampling_params.prompt_logprobs is not None and computed.num_tokens > request.score_from:
                computed = computed.cut(request.score_from, self.kv.block_size)  # those tokens' logits are asked for
            if self.fixed_chunk is not None and computed.hit.block_ids:  # chunks start at multiples of it
                computed = computed.cut(computed.num_tokens // self.fixed_chunk * self.fixed_chunk, self.kv.block_size)
            num_new = self._aligned(request, computed.num_tokens, min(request.num_tokens - computed.num_tokens, budget,
                                                                      self.fixed_chunk or budget))
            if num_new == 0:
                return
            copies = self.kv.allocate_slots(request.request_id, computed.num_tokens + num_new, computed.num_tokens,
                                            computed.hit)
            if copies is None:
                return
            self.waiting.remove(request)
            running[request.group_key] += 1
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed.num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = computed.num_cached
            self.running.append(request)
            self._emit(out, request, num_new, copies)
            budget -= num_new

    def _next_waiting(self, running: Counter) -> Request | None:
        """The earliest waiting request of the group running the fewest, skipping groups that
        would take a reserved slot and still queue; None if only such groups wait."""
        free = self.max_num_seqs - len(self.running)
        waiting = Counter(r.group_key for r in self.waiting) if free <= self.reserved_seqs else None
        best = None
        for request in self.waiting:
            group = request.group_key
            if waiting is not None and waiting[group] > free:
                continue
            if best is None or running[group] < running[best.group_key]:
                best = request
                if running[group] == 0:
                    break
        return best

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[BlockCopy] | None:
        """Allocate the request's next tokens, preempting the newest running requests until it
        fits. Returns None if the request had to preempt itself."""
        while True:
            num_computed = request.num_computed_tokens
            copies = self.kv.allocate_slots(request.request_id, num_computed + num_new, num_computed, NO_HIT)
            if copies is not None:
                return copies
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_cached_tokens = None  # what its next admission finds cached, not its first
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
                history=request.token_history() if request.sampling_params.adjusts_logits
                or request.sampling_params.prompt_logprobs is not None else None,
                score_from=request.score_from,
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
        """Finish (or abort) a request. With `retain_kv`, its table stays (cut to the computed
        tokens) for the caller to keep; otherwise it is freed."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if request.retain_kv and reason not in ("abort", "error") and self.kv.has(request.request_id):
            self.kv.truncate(request.request_id, request.num_computed_tokens)
        else:
            self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
