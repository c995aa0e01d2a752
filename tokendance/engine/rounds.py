"""Rounds of agent turns on an engine: waves, the drain loop, aborts and statistics.

A round is a set of agent turns submitted together. The reuse policy (one per mode, see
`reuse/policy.py`) decides how each agent's prompt KV is prepared before the scheduler computes
its last token and decodes:

- full:       nothing reused (no prefix caching, no sessions)
- prefix:     automatic prefix caching only (the vLLM baseline)
- pic:        prefix caching + per-request position-independent reuse of shared spans (CacheBlend)
- tokendance: agent sessions + the KV Collector with Master-Mirror tables

Prepared KV enters the scheduler through the KV manager (`mark_prepared`, then the scheduler's
`find_computed` query); agent sessions are kept tables of the KV manager (`SessionKey`), evicted
by it, least recently kept first, when an allocation needs room.
"""

from __future__ import annotations

import dataclasses

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokendance.engine.llm_engine import LLMEngine
from tokendance.engine.request import Request
from tokendance.engine.round_stats import RoundStats, fill_kv, fill_reads, fill_times, merge_waves
from tokendance.errors import CapacityError, InvalidRequestError, TokenDanceError
from tokendance.kv.manager import SessionKey
from tokendance.outputs import RequestOutput
from tokendance.reuse.policy import make_policy
from tokendance.reuse.round_kv import PrefillReport, ReusePolicy, RoundKV, Session
from tokendance.reuse.segments import AgentTurn, TokenizedTurn, tokenize_round
from tokendance.reuse.selection import make_selector
from tokendance.sampling import SamplingParams


class RoundTooLarge(CapacityError):
    """The pool cannot hold a round's prepared KV at once (nothing of it ran yet)."""


class RoundAborted(TokenDanceError):
    """Every agent of the round was aborted while its KV was prepared: the round stopped, and
    nothing of it stays behind."""


@dataclass
class RoundResult:
    outputs: list[RequestOutput]  # in the order of the turns
    stats: RoundStats


class RoundRunner:
    """Runs rounds on an engine with one reuse policy. Holds no KV: sessions live in the engine's
    KV manager. Invariant: `_running` maps each agent of the running round to its request id."""

    def __init__(self, engine: LLMEngine, policy: ReusePolicy):
        self.engine = engine
        self.policy = policy
        self.round_index = 0
        self._running: dict[str, str] = {}
        self._ending: set[str] = set()  # agents of the running round whose session ends with it
        self._aborted: dict[str, RequestOutput] = {}
        self._agents: set[str] = set()  # every agent of the running round (all its waves)
        self._abandoned: set[str] = set()  # agents aborted before their request reached the engine

    @classmethod
    def for_engine(cls, engine: LLMEngine) -> RoundRunner:
        c = engine.config
        round_kv = RoundKV(engine.kv, engine.runner, make_selector(c.selection, c.recompute_ratio), c.check_layer,
                           c.max_num_batched_tokens)
        return cls(engine, make_policy(c.reuse, round_kv, c.collective_selection))

    # ------------------------------------------------------------ sessions

    def sessions(self) -> dict[str, Session]:
        """Agents whose KV is kept, with what it holds."""
        return {key.agent_id: session for key, session in self.engine.kv.find_kept(SessionKey).items()}

    def is_running(self, agent_id: str) -> bool:
        """The agent has a turn in the round running now."""
        return agent_id in self._running

    def end_agent(self, agent_id: str) -> bool:
        """Drop an agent's session; False if it has none. An agent whose turn is running keeps
        its turn, and its KV is dropped when the round ends instead of kept."""
        if agent_id in self._running:
            self._ending.add(agent_id)
            return True
        key = SessionKey(agent_id)
        if not self.engine.kv.has(key):
            return False
        self.engine.kv.free(key)
        return True

    def abort(self, agent_id: str) -> RequestOutput | None:
        """Abort one agent of the running round (e.g. from `on_output` or `poll`: its client left).
        Its KV is freed at once (masters it created stay while others hold them), the other agents
        go on, and the round returns its output with finish_reason "abort" and keeps no session
        for it. An agent whose KV is still being prepared is aborted when the prefill ends (None
        now); if every agent of the round is, the round stops there (`RoundAborted`)."""
        request_id = self._running.get(agent_id)
        if request_id is not None and request_id in self.engine.requests:
            output = self.engine.abort_request(request_id)
            self._aborted[request_id] = output
            return output
        if agent_id in self._agents:
            self._abandoned.add(agent_id)
        return None

    # ------------------------------------------------------------ a round

    def run(
        self,
        turns: Sequence[AgentTurn],
        params: SamplingParams | Sequence[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None = None,
        poll: Callable[[], None] | None = None,
    ) -> RoundResult:
        """`params` is one SamplingParams for all turns or one per turn. `on_output` sees every
        output the engine produces while the round runs (streaming, and requests outside the
        round that share the engine, as in the server); outputs of the round carry `agent_id`.

        Requests outside the round keep running while its KV is prepared: between the prefill's
        forward groups (cut smaller while they run) they take a step. `poll` is called there
        first: the caller's chance to add requests and abort agents."""
        tokenized, params = self._validate(turns, params)
        for turn, p in zip(tokenized, params):  # every request is valid before any wave starts
            self.engine.make_request(turn.token_ids, p, namespace=turn.namespace)
        # The round runs in an order of its contents (then agent ids), not of arrival: masters,
        # selection, waves and batch composition, hence the outputs, do not depend on the order
        # the turns came in.
        order = sorted(range(len(tokenized)),
                       key=lambda i: (tokenized[i].namespace, tokenized[i].token_ids, tokenized[i].agent_id))
        tokenized, params = [tokenized[i] for i in order], [params[i] for i in order]
        started = time.perf_counter()
        self._agents, self._abandoned = {t.agent_id for t in tokenized}, set()
        try:
            waves = self._run_waves(tokenized, params, on_output, poll)
        finally:
            self._agents, self._abandoned = set(), set()
        if len(waves) == 1:
            result = waves[0]
        else:
            stats = merge_waves([(w.outputs, w.stats) for w in waves], started)
            result = RoundResult([o for w in waves for o in w.outputs], stats)
        outputs = [None] * len(order)
        for position, index in enumerate(order):
            outputs[index] = result.outputs[position]
        return RoundResult(outputs, result.stats)

    def _run_waves(self, tokenized, params, on_output, poll) -> list[RoundResult]:
        """The whole round at once or, when the pool cannot hold the round's prepared KV, in two
        halves (recursively). A later wave may evict an earlier wave's sessions (LRU), never its
        outputs."""
        try:
            return [self._run_wave(tokenized, params, on_output, poll)]
        except RoundTooLarge:
            if len(tokenized) == 1:
                raise
        half = len(tokenized) // 2
        return (self._run_waves(tokenized[:half], params[:half], on_output, poll)
                + self._run_waves(tokenized[half:], params[half:], on_output, poll))

    def _run_wave(self, tokenized: list[TokenizedTurn], params: list[SamplingParams], on_output,
                  poll) -> RoundResult:
        engine = self.engine
        requests = [
            engine.make_request(t.token_ids, p, request_id=f"round{self.round_index}:{t.agent_id}",
                                namespace=t.namespace, agent_id=t.agent_id, retain_kv=True,
                                group=f"round{self.round_index}")
            for t, p in zip(tokenized, params)
        ]
        stats = RoundStats(self.round_index, self.policy.name, len(tokenized))
        self._running = {r.agent_id: r.request_id for r in requests}
        model = engine.runner.model
        reads_before = dataclasses.replace(model.decode_reads)
        started = time.perf_counter()
        try:
            self.policy.round_kv.pause = lambda: self._pause(on_output, poll)
            try:
                report = self._prefill(requests, tokenized)
            except CapacityError as exc:  # nothing was added to the engine yet: a smaller wave may fit
                raise RoundTooLarge(str(exc)) from exc
            finally:
                self.policy.round_kv.pause = None
            for request in requests:
                engine.add(request)
            self._aborted = {}
            for request in requests:  # aborted while the prefill ran
                if request.agent_id in self._abandoned:
                    self.abort(request.agent_id)
            outputs = self._drain({r.request_id for r in requests}, on_output)
        except BaseException:
            for request in requests:  # nothing of a failed round stays behind
                if engine.abort_request(request.request_id) is None:
                    engine.kv.free(request.request_id)
            self.policy.end_round()
            self._running, self._ending = {}, set()
            raise
        results = [outputs[r.request_id] for r in requests]
        fill_times(stats, report, results, started, self.policy.prepares_tables)
        fill_kv(stats, engine.kv, engine.bytes_per_block, [r.request_id for r in requests], tokenized)
        fill_reads(stats, reads_before, model.decode_reads, engine.bytes_per_block // engine.config.block_size
                   // engine.model_config.num_layers // engine.model_config.num_kv_heads)
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
        """Prepare every agent's table for [0, L-1) and tell the KV manager, where the scheduler
        finds it when it admits the request."""
        if not self.policy.prepares_tables:
            return PrefillReport()
        agents = [self.policy.open_table(r.request_id, t) for r, t in zip(requests, tokenized)]
        report = self.policy.prefill(agents)
        for request, agent in zip(requests, agents):
            self.policy.finish(agent)
            self.engine.kv.mark_prepared(request.request_id, agent.num_prepared, agent.num_cached)
        return report

    def _pause(self, on_output, poll) -> bool:
        """Between prefill groups: `poll`, then one step of the requests outside the round (the
        round's own are not in the engine yet). True while such requests run."""
        if poll is not None:
            poll()
        if self._agents <= self._abandoned:
            raise RoundAborted("every agent of the round was aborted")
        if not self.engine.has_unfinished:
            return False
        for output in self.engine.step():
            if on_output is not None:
                on_output(output)
        return self.engine.has_unfinished

    def _drain(self, request_ids: set[str], on_output) -> dict[str, RequestOutput]:
        """Step the engine until every request of the round finished; other requests sharing the
        engine advance too and their outputs go to `on_output`. A finished agent's table is kept
        (unpinned: evicted under memory pressure before any running request is preempted)."""
        done: dict[str, RequestOutput] = {}
        kv = self.engine.kv
        while True:
            for request_id in request_ids & self._aborted.keys():
                done[request_id] = self._aborted.pop(request_id)
            if len(done) == len(request_ids):
                break
            for output in self.engine.step():
                if on_output is not None:
                    on_output(output)
                if output.finished and output.request_id in request_ids:
                    done[output.request_id] = output
                    if kv.has(output.request_id):
                        kv.keep(output.request_id)
        self._aborted = {}
        return done

    def _finish_round(self, requests: list[Request], tokenized: list[TokenizedTurn]) -> None:
        kv = self.engine.kv
        for request, turn in zip(requests, tokenized):
            if not kv.has(request.request_id):
                continue  # aborted, or its kept table was evicted under memory pressure
            if self.policy.keeps_sessions and turn.agent_id not in self._ending:
                computed = request.token_ids[: request.num_computed_tokens]
                session = Session(computed, self.round_index, turn.spans)
                kv.keep(request.request_id, key=SessionKey(turn.agent_id), payload=session)
            else:
                kv.free(request.request_id)
        self.policy.end_round()
        self._running, self._ending = {}, set()
        self.round_index += 1
