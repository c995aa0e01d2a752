"""Rounds of agent turns: agent sessions, the reuse modes, and round statistics.

A round is a set of agent turns submitted together. The mode decides how each agent's prompt KV
is prepared before the scheduler computes its last token and decodes:

- full:       nothing reused (no prefix caching, no sessions)
- prefix:     automatic prefix caching only (the vLLM baseline)
- pic:        prefix caching + per-request position-independent reuse of shared spans (CacheBlend)
- tokendance: agent sessions + the KV Collector with Master-Mirror tables
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokendance.engine.modes import make_mode
from tokendance.engine.request import Request
from tokendance.errors import CapacityError, InvalidRequestError
from tokendance.outputs import RequestOutput
from tokendance.reuse.collector import PrefillReport, RoundKV
from tokendance.reuse.segments import AgentTurn, PromptSpan, TokenizedTurn, tokenize_round
from tokendance.reuse.selection import make_selector
from tokendance.sampling import SamplingParams


@dataclass
class Session:
    """An agent's KV kept between rounds: a table holding `token_ids` (prompt + output so far)."""

    table_id: str
    token_ids: list[int]
    last_round: int
    spans: list[PromptSpan] = field(default_factory=list)  # segments of its last prompt


@dataclass
class AgentKVStats:
    agent_id: str
    logical_tokens: int  # tokens in the agent's table
    private_blocks: int  # blocks no other agent of the round holds
    diff_blocks: int  # private blocks holding tokens of shared spans (the mirror's diff)
    kv_bytes: float  # private blocks + shared blocks split evenly among their holders


@dataclass
class RoundStats:
    round_index: int
    mode: str
    num_agents: int
    round_seconds: float = 0.0  # until every agent has its whole output
    prefill_seconds: float = 0.0  # round TTFT: until every agent has its first token
    decode_seconds: float = 0.0
    lookup_seconds: float = 0.0  # base KV of shared spans (+ position-corrected copies in pic)
    selection_seconds: float = 0.0
    recompute_seconds: float = 0.0
    private_prefill_seconds: float = 0.0  # the rest of the prefill (scheduler-side)
    prompt_tokens: int = 0
    computed_tokens: float = 0.0  # prefill tokens computed, in full-model token equivalents
    reused_tokens: int = 0  # shared-span tokens served from shared KV
    recomputed_tokens: int = 0  # shared-span tokens selected for recompute
    logical_kv_tokens: int = 0
    physical_kv_blocks: int = 0
    physical_kv_tokens: int = 0
    kv_bytes: int = 0
    kv_bytes_per_agent: float = 0.0
    compression: float = 0.0  # logical KV tokens / physical KV tokens (blocks x block size)
    shared_logical_tokens: int = 0  # tokens of shared spans over all agents
    shared_physical_tokens: int = 0  # distinct slots holding them (master + diffs)
    shared_compression: float = 0.0
    diff_blocks: int = 0
    num_waves: int = 1  # > 1: the pool could not hold the round at once; it ran in parts
    agents: list[AgentKVStats] = field(default_factory=list)


class RoundTooLarge(CapacityError):
    """The pool cannot hold a round's prepared KV at once (nothing of it ran yet)."""


@dataclass
class RoundResult:
    outputs: list[RequestOutput]  # in the order of the turns
    stats: RoundStats


class RoundRunner:
    """Runs rounds on an engine and owns its agent sessions (tokendance mode)."""

    def __init__(self, engine, mode: str, selection: str, recompute_ratio: float,
                 check_layer: int, collective_scope: str):
        self.engine = engine
        self.round_kv = RoundKV(
            engine.kv, engine.runner, make_selector(selection, recompute_ratio), check_layer,
            engine.config.max_num_batched_tokens, self.reclaim,
        )
        self.mode = make_mode(mode, self.round_kv, collective_scope)
        self.sessions: dict[str, Session] = {}
        self.active: set[str] = set()
        self.round_index = 0
        self.num_evictions = 0
        self._finished_tables: list[str] = []
        self._aborted: dict[str, RequestOutput] = {}

    # ------------------------------------------------------------ sessions

    def reclaim(self) -> bool:
        """Free KV nobody is computing with: the least recently used idle session first, then the
        kept tables of this round's agents that already finished (their statistics and session
        are lost, never their output). False if there is nothing left to free."""
        idle = [s for agent, s in self.sessions.items() if agent not in self.active]
        if not idle:
            while self._finished_tables:
                table_id = self._finished_tables.pop()
                if self.engine.kv.has(table_id):
                    self.engine.kv.free(table_id)
                    self.num_evictions += 1
                    return True
            return False
        victim = min(idle, key=lambda s: s.last_round)
        agent = next(a for a, s in self.sessions.items() if s is victim)
        self.end_agent(agent)
        self.num_evictions += 1
        return True

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort one request of the running round (e.g. from `on_output`: its client left). Its KV
        is freed at once (masters it created stay while others hold them), the other agents go on,
        and the round returns its output with finish_reason "abort" and keeps no session for it."""
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._aborted[request_id] = output
        return output

    def end_agent(self, agent_id: str) -> bool:
        session = self.sessions.pop(agent_id, None)
        if session is None:
            return False
        self.engine.kv.free(session.table_id)
        return True

    # ------------------------------------------------------------ a round

    def run(
        self,
        turns: Sequence[AgentTurn],
        params: SamplingParams | Sequence[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> RoundResult:
        """`params` is one SamplingParams for all turns or one per turn. `on_output` sees every
        output the engine produces while the round runs (streaming, and requests outside the
        round that share the engine, as in the server)."""
        tokenized, params = self._validate(turns, params)
        for turn, p in zip(tokenized, params):  # every request is valid before any wave starts
            self.engine.make_request(turn.token_ids, p, namespace=turn.namespace)
        started = time.perf_counter()
        waves = self._run_waves(tokenized, params, on_output)
        return waves[0] if len(waves) == 1 else merge_waves(waves, started)

    def _run_waves(self, tokenized, params, on_output) -> list[RoundResult]:
        """The whole round at once or, when the pool cannot hold the round's prepared KV, in two
        halves (recursively). A later wave may evict an earlier wave's sessions (LRU), never its
        outputs."""
        try:
            return [self._run_wave(tokenized, params, on_output)]
        except RoundTooLarge:
            if len(tokenized) == 1:
                raise
        half = len(tokenized) // 2
        return (self._run_waves(tokenized[:half], params[:half], on_output)
                + self._run_waves(tokenized[half:], params[half:], on_output))

    def _run_wave(self, tokenized: list[TokenizedTurn], params: list[SamplingParams], on_output) -> RoundResult:
        requests = [
            self.engine.make_request(t.token_ids, p, request_id=f"round{self.round_index}:{t.agent_id}", namespace=t.namespace)
            for t, p in zip(tokenized, params)
        ]
        stats = RoundStats(self.round_index, self.mode.name, len(tokenized))
        self.active = {t.agent_id for t in tokenized}
        started = time.perf_counter()
        try:
            try:
                report = self._prefill(requests, tokenized)
            except CapacityError as exc:  # nothing was added to the engine yet: a smaller wave may fit
                raise RoundTooLarge(str(exc)) from exc
            for request in requests:
                request.retain_kv = True
                self.engine.add(request)
            outputs = self._drain({r.request_id for r in requests}, on_output)
        except BaseException:
            for request in requests:  # nothing of a failed round stays behind
                if self.engine.abort_request(request.request_id) is None:
                    self.engine.kv.free(request.request_id)
            self.round_kv.release_masters()
            self.active = set()
            self._finished_tables = []
            raise
        results = [outputs[r.request_id] for r in requests]
        self._fill_times(stats, report, results, started)
        self._fill_kv(stats, requests, tokenized)
        self._finish_round(requests, tokenized)
        return RoundResult(results, stats)

    def _validate(self, turns, params) -> tuple[list[TokenizedTurn], list[SamplingParams]]:
        if not isinstance(turns, Sequence) or isinstance(turns, str) or not turns:
            raise InvalidRequestError("a round needs a non-empty list of AgentTurn")
        if not all(isinstance(t, AgentTurn) for t in turns):
            raise InvalidRequestError("every turn of a round must be an AgentTurn")
        ids = [t.agent_id for t in turns]
        duplicates = sorted({a for a in ids if ids.count(a) > 1})
        if duplicates:
            raise InvalidRequestError(f"duplicate agent ids in the round: {', '.join(map(str, duplicates))}")
        if not all(isinstance(a, str) and a for a in ids):
            raise InvalidRequestError("agent ids must be non-empty strings")
        if isinstance(params, SamplingParams):
            params = [params] * len(turns)
        if not isinstance(params, Sequence) or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidRequestError("sampling params must be SamplingParams or one per turn")
        if len(params) != len(turns):
            raise InvalidRequestError(f"{len(params)} sampling params for {len(turns)} turns")
        return tokenize_round(self.engine.tokenizer, turns), list(params)

    def _prefill(self, requests: list[Request], tokenized: list[TokenizedTurn]) -> PrefillReport:
        if not self.mode.prepares_tables:
            return PrefillReport()
        agents = []
        for request, turn in zip(requests, tokenized):
            agents.append(self.mode.open_table(self, request, turn))
        report = self.mode.prefill(agents)
        for request, agent in zip(requests, agents):
            request.prepared = True
            request.num_computed_tokens = agent.num_prepared
            reused = sum(agent.turn.spans[i].end - agent.turn.spans[i].start - len(agent.selected.get(i, ())) for i in agent.reused_spans)
            request.num_cached_tokens = agent.num_reused_prefix + reused
            self.mode.after_prefill(self, request, agent)
        return report

    def _drain(self, request_ids: set[str], on_output) -> dict[str, RequestOutput]:
        """Step the engine until every request of the round finished; other requests sharing the
        engine advance too and their outputs go to `on_output`."""
        done: dict[str, RequestOutput] = {}
        self._aborted = {}
        while len(done) < len(request_ids):
            outputs = self.engine.step()
            if not outputs and not self.engine.scheduler.running:
                self._unprepare_waiting()
            for output in outputs:
                if on_output is not None:
                    on_output(output)
                if output.finished and output.request_id in request_ids:
                    done[output.request_id] = output
                    self._finished_tables.append(output.request_id)
            for request_id in request_ids & self._aborted.keys():
                done[request_id] = self._aborted.pop(request_id)
        self._aborted = {}
        return done

    def _unprepare_waiting(self) -> None:
        """Nothing could run: waiting round requests hold prepared tables the pool needs. Drop
        them; the requests are recomputed like any preempted request (never lost)."""
        stuck = [r for r in self.engine.scheduler.waiting if r.prepared]
        if not stuck:
            raise CapacityError("the KV pool cannot make progress on this round")
        for request in stuck:
            self.engine.kv.free(request.request_id)
            request.prepared = False
            request.num_computed_tokens = 0

    def _finish_round(self, requests: list[Request], tokenized: list[TokenizedTurn]) -> None:
        for request, turn in zip(requests, tokenized):
            if not self.engine.kv.has(request.request_id):
                continue  # its kept table was reclaimed under memory pressure
            if self.mode.keeps_sessions:
                table_id = f"session:{turn.agent_id}"
                self.engine.kv.rename(request.request_id, table_id)
                computed = request.token_ids[: request.num_computed_tokens]
                self.sessions[turn.agent_id] = Session(table_id, computed, self.round_index, turn.spans)
            else:
                self.engine.kv.free(request.request_id)
        self.round_kv.release_masters()
        self.active = set()
        self._finished_tables = []
        self.round_index += 1

    # ------------------------------------------------------------ statistics

    def _fill_times(self, stats: RoundStats, report: PrefillReport, outputs: list[RequestOutput], started: float) -> None:
        # aborted agents may have no first token and have no finish time
        stats.prefill_seconds = max((o.first_token_time or started for o in outputs), default=started) - started
        stats.round_seconds = max((o.finish_time or started for o in outputs), default=started) - started
        stats.decode_seconds = stats.round_seconds - stats.prefill_seconds
        stats.lookup_seconds = report.lookup_seconds
        stats.selection_seconds = report.selection_seconds
        stats.recompute_seconds = report.recompute_seconds
        stats.private_prefill_seconds = max(
            0.0, stats.prefill_seconds - report.lookup_seconds - report.selection_seconds - report.recompute_seconds
        )
        stats.prompt_tokens = sum(o.num_prompt_tokens for o in outputs)
        if not self.mode.prepares_tables:
            scheduler_side = sum(o.num_prompt_tokens - o.num_cached_tokens for o in outputs)
        else:  # the round prefill prepared all but the last prompt token
            scheduler_side = len(outputs)
        stats.computed_tokens = report.computed_tokens + scheduler_side
        stats.reused_tokens = report.reused_tokens
        stats.recomputed_tokens = report.recomputed_tokens

    def _fill_kv(self, stats: RoundStats, requests: list[Request], tokenized: list[TokenizedTurn]) -> None:
        kv = self.engine.kv
        tables = [r.request_id for r in requests if kv.has(r.request_id)]
        holders: dict[int, int] = {}
        for table in tables:
            for block in kv.get_block_ids(table):
                holders[block] = holders.get(block, 0) + 1
        bytes_per_block = self.engine.bytes_per_block
        shared_slots: set[int] = set()
        for request, turn in zip(requests, tokenized):
            if not kv.has(request.request_id):
                continue
            slots = kv.get_slots(request.request_id)
            span_slots = [slots[p] for s in turn.shared_spans for p in range(s.start, min(s.end, len(slots)))]
            stats.shared_logical_tokens += len(span_slots)
            shared_slots.update(span_slots)
            blocks = kv.get_block_ids(request.request_id)
            private = {b for b in blocks if holders[b] == 1}
            stats.agents.append(AgentKVStats(
                agent_id=turn.agent_id,
                logical_tokens=len(slots),
                private_blocks=len(private),
                diff_blocks=len({kv.block_of(s) for s in span_slots} & private),
                kv_bytes=sum(bytes_per_block / holders[b] for b in blocks),
            ))
        stats.logical_kv_tokens = sum(a.logical_tokens for a in stats.agents)
        stats.physical_kv_blocks = len(holders)
        stats.physical_kv_tokens = len(holders) * kv.block_size
        stats.kv_bytes = len(holders) * bytes_per_block
        stats.kv_bytes_per_agent = stats.kv_bytes / max(1, len(stats.agents))
        stats.compression = stats.logical_kv_tokens / max(1, stats.physical_kv_tokens)
        stats.shared_physical_tokens = len(shared_slots)
        stats.shared_compression = stats.shared_logical_tokens / max(1, stats.shared_physical_tokens)
        stats.diff_blocks = sum(a.diff_blocks for a in stats.agents)



def merge_waves(waves: list[RoundResult], started: float) -> RoundResult:
    """One round's result from the waves it ran in: outputs in turn order, times from the start
    of the first wave, counts summed (each wave had its own masters, so physical KV adds up)."""
    outputs = [o for w in waves for o in w.outputs]
    stats = RoundStats(waves[0].stats.round_index, waves[0].stats.mode, len(outputs), num_waves=len(waves))
    stats.prefill_seconds = max(o.first_token_time or started for o in outputs) - started
    stats.round_seconds = max(o.finish_time or started for o in outputs) - started
    stats.decode_seconds = stats.round_seconds - stats.prefill_seconds
    summed = ("lookup_seconds", "selection_seconds", "recompute_seconds", "private_prefill_seconds", "prompt_tokens",
              "computed_tokens", "reused_tokens", "recomputed_tokens", "logical_kv_tokens", "physical_kv_blocks",
              "physical_kv_tokens", "kv_bytes", "shared_logical_tokens", "shared_physical_tokens", "diff_blocks")
    for name in summed:
        setattr(stats, name, sum(getattr(w.stats, name) for w in waves))
    stats.agents = [a for w in waves for a in w.stats.agents]
    stats.kv_bytes_per_agent = stats.kv_bytes / max(1, len(stats.agents))
    stats.compression = stats.logical_kv_tokens / max(1, stats.physical_kv_tokens)
    stats.shared_compression = stats.shared_logical_tokens / max(1, stats.shared_physical_tokens)
    return RoundResult(outputs, stats)
