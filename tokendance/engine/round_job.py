"""One round in the engine (`RoundJob`): its agents' KV preparation as forward groups that the
engine's step runs beside every other request, its agents handed to the engine as their tables
complete, its waves, aborts and statistics. Submitted and collected by `RoundRunner`
(`engine/rounds.py`); the engine knows it only as a `KVJob`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field

from tokendance.batch import ScheduledRequest
from tokendance.convergence import repeated_replies
from tokendance.engine.jobs import KVGroup
from tokendance.engine.request import Request
from tokendance.engine.round_probe import AutoRound
from tokendance.engine.round_stats import RoundStats, fill_kv, fill_reads, fill_times, fill_work, merge_waves
from tokendance.errors import CapacityError, TokenDanceError
from tokendance.kv.manager import KVCacheManager, SessionKey
from tokendance.model.roofline import Account, Peaks
from tokendance.outputs import RequestOutput
from tokendance.reuse.policy import ReusePolicy
from tokendance.reuse.round_kv import AgentPrefill, PrefillReport, Ready, Work
from tokendance.round_core.spans import Session
from tokendance.reuse.segments import TokenizedTurn


log = logging.getLogger(__name__)


class RoundTooLarge(CapacityError):
    """The pool cannot hold even one agent's prepared KV."""


class RoundAborted(TokenDanceError):
    """Every agent of the round was aborted while its KV was prepared: the round stopped, and
    nothing of it stays behind."""


@dataclass
class RoundResult:
    outputs: list[RequestOutput]  # in the order of the turns
    stats: RoundStats


@dataclass(frozen=True)
class RoundContext:
    """What a round needs of its engine, given to it explicitly (it holds no engine)."""

    policy: ReusePolicy
    kv: KVCacheManager
    model: object  # the model, for its decode-read counters
    bytes_per_block: int
    row_bytes: int  # KV bytes of one token, one layer, one KV head
    account: Account  # the engine's work counters, read in windows (a wave's)
    peaks: Peaks


@dataclass
class _Wave:
    """Agents prepared together (the whole round, unless the pool could not hold it at once)."""

    indices: list[int]  # into the job's requests
    started: float = 0.0
    report: PrefillReport = field(default_factory=PrefillReport)
    reads_before: object = None
    account_before: Account | None = None
    stats: RoundStats | None = None


@dataclass
class _Pending:
    """A `Work` while the engine runs it in groups: what is left, and the items' table ids."""

    work: Work
    items: deque[ScheduledRequest]


class RoundJob:
    """One round in the engine. Waves run one after the other (a wave starts once the agents of
    the waves before it finished); within a wave, each agent is released to the engine as soon as
    its table is complete. Invariants: every agent ends exactly once, with an output in
    `outputs` (finished, aborted or failed); when the job is done, nothing of its prefill is held
    (masters, recalled segments, scratch tables), and each agent's KV is its session or freed."""

    def __init__(self, context: RoundContext, index: int, requests: list[Request], tokenized: list[TokenizedTurn],
                 turn_order: list[int], auto: AutoRound | None = None):
        self.context = context
        self.turn_order = turn_order  # requests[k] is the turn submitted at turn_order[k]
        self.policy: ReusePolicy = context.policy
        self.auto = auto  # --fidelity auto: the controller, and the probe (its exact member is one of `requests`)
        self.probe = None if auto is None else auto.probe
        self.kv = context.kv
        self.index = index
        self.requests = requests
        self.tokenized = tokenized
        self.outputs: dict[str, RequestOutput] = {}  # request id -> final output
        self.error: BaseException | None = None
        self.result: RoundResult | None = None
        self.ending: set[str] = set()  # agents whose session ends with the round
        self.abandoned: set[str] = set()  # agents aborted before their request reached the engine
        self.started: float | None = None  # when its first wave started preparing
        self._by_agent = {r.agent_id: i for i, r in enumerate(requests)}
        self._waves: deque[_Wave] = deque([_Wave(list(range(len(requests))))])
        self._done_waves: list[_Wave] = []
        self._wave: _Wave | None = None
        self._prefill: Generator | None = None
        self._agents: dict[str, AgentPrefill] = {}  # table id -> agent, while its table is prepared
        self._pending: _Pending | None = None
        self._released: set[str] = set()  # request ids handed to the engine
        self._ready: list[Request] = []

    # ------------------------------------------------------------ what the engine asks

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def has_work(self) -> bool:
        """Forward passes of its preparation are waiting to run."""
        return self._pending is not None

    @property
    def request_ids(self) -> list[str]:
        """Its requests in the engine or to come: the agents' and the probe's."""
        return [r.request_id for r in self.requests] + ([] if self.probe is None else self.probe.request_ids)

    def request_id_of(self, agent_id: str) -> str | None:
        """The request id of the agent's turn in this round, None if it has none."""
        index = self._by_agent.get(agent_id)
        return None if index is None else self.requests[index].request_id

    def advance(self) -> None:
        """Resume the preparation until it has passes to run (agents whose tables complete on
        the way are ready: `take_ready`)."""
        self._advance()

    def next_group(self, budget: int) -> KVGroup | None:
        """Up to `budget` tokens of the preparation's next passes (None: none to run now)."""
        self._advance()
        if self._pending is None or budget <= 0:
            return None
        pending, items, tokens = self._pending, [], 0
        while pending.items and tokens < budget:
            item = pending.items[0]
            take = min(len(item.token_ids), budget - tokens)
            if take == len(item.token_ids):
                items.append(pending.items.popleft())
            else:  # a chunk: its queries attend to the slots before it, as in chunked prefill
                last = item.positions[take - 1]
                items.append(ScheduledRequest(item.request_id, item.token_ids[:take], item.positions[:take],
                                              item.context_slots[: last + 1], False, None))
                pending.items[0] = dataclasses.replace(item, token_ids=item.token_ids[take:],
                                                       positions=item.positions[take:])
            tokens += take
        complete = {i.request_id for i in items} - {i.request_id for i in pending.items}
        return KVGroup(items, pending.work.num_layers, complete)

    def group_ran(self, group: KVGroup) -> None:
        """Its passes ran: agents whose last item it was are ready; an exhausted Work lets the
        prefill go on at the next step."""
        pending = self._pending
        if pending is None:
            return
        if pending.work.releases:
            self._release([self._agents[t] for t in group.complete if t in self._agents])
        if not pending.items:
            self._pending = None

    def take_ready(self) -> list[Request]:
        """Requests whose tables are ready, for the engine to add now."""
        ready, self._ready = self._ready, []
        return ready

    def observe(self, outputs: list[RequestOutput]) -> None:
        """The step's outputs: the round's agents that finished keep their tables (unpinned: evicted
        under memory pressure before any running request is preempted)."""
        for output in outputs:
            if output.finished and output.request_id in self._released:
                self._record(output)
                if self.kv.has(output.request_id):
                    self.kv.keep(output.request_id)
            if output.finished:
                self._probe_observe(output)
        self._end_wave_if_done()

    def _probe_observe(self, output: RequestOutput) -> None:
        """A finished output the probe may wait for (the shadow's, a score's, the probed member's)."""
        if self.probe is not None:
            self._ready += self.probe.observe(output, self.outputs.get(self.probe.exact.request_id), self.kv)

    def fail(self, error: BaseException) -> None:
        """The round cannot go on: nothing of its preparation stays behind (the engine aborts its
        requests that run)."""
        self._close_prefill()
        for request in self.requests:  # the tables of agents not running (the engine frees those)
            if request.request_id not in self._released or request.request_id in self.outputs:
                self.kv.free(request.request_id)
        self.policy.end_round()
        if self.probe is not None:
            self.probe.skip("the round failed", self.kv)
        self._drop_ending_sessions()
        self.error = error

    def _drop_ending_sessions(self) -> None:
        """Agents ended during the round keep no session, whichever wave kept one."""
        for agent_id in self.ending:
            self.kv.free(SessionKey(agent_id))

    # ------------------------------------------------------------ aborts (from the runner)

    def abandon(self, agent_id: str) -> None:
        """The agent's client left before its request reached the engine: it is never added."""
        if agent_id in self._by_agent and self.requests[self._by_agent[agent_id]].request_id not in self._released:
            self.abandoned.add(agent_id)

    def record_abort(self, output: RequestOutput) -> None:
        """The agent's request was aborted in the engine: its output, and the wave may be over."""
        self._record(output)
        self._probe_observe(output)
        self._end_wave_if_done()

    # ------------------------------------------------------------ the prefill

    def _advance(self) -> None:
        """Resume the prefill until it yields passes to run (or the wave waits for its agents)."""
        if self._prefill is not None and self._all_abandoned():
            return
        while self._pending is None and not self.done:
            if self._prefill is None:
                if not self._start_wave():
                    return
                continue
            if self._all_abandoned():
                return
            try:
                step = next(self._prefill)
            except StopIteration as stop:
                self._prefill_ended(stop.value)
            except CapacityError as exc:
                self._too_large(exc)
            else:
                if isinstance(step, Ready):
                    self._release(step.agents)
                else:
                    self._pending = _Pending(step, deque(step.items))

    def _start_wave(self) -> bool:
        """Open the next wave's tables once the agents before it finished; False if it waits (or
        no wave is left)."""
        if self._wave is not None or not self._waves:
            return False
        if any(r not in self.outputs for r in self._released):
            return False  # the wave before still decodes: its sessions may be evicted by this one
        wave = self._waves.popleft()
        for i in [i for i in wave.indices if self.requests[i].agent_id in self.abandoned]:
            self._record(self._unstarted_output(self.requests[i], "abort"))
            if self._is_exact(self.requests[i]):  # its shadow is never opened
                self.probe.skip("the probed member left", self.kv)
        wave.indices = [i for i in wave.indices if self.requests[i].agent_id not in self.abandoned]
        if not wave.indices:
            self._end_wave_if_done()
            return True
        self._wave, wave.started = wave, time.perf_counter()
        self.started = self.started or wave.started
        wave.reads_before = dataclasses.replace(self.context.model.decode_reads)
        wave.account_before = self.context.account.snapshot()
        agents, exact = [], []
        try:
            for i in wave.indices:
                request, turn = self.requests[i], self.tokenized[i]
                if self._is_exact(request):  # the probed member: computed by the scheduler, from the prefix cache
                    exact.append(AgentPrefill(request.request_id, turn, 0))
                    if not self.probe.skipped:
                        agents.append(self.policy.open_table(self.probe.shadow.request_id, turn))
                        agents[-1].max_output_tokens = self.probe.shadow.max_tokens
                    continue
                agent = self.policy.open_table(request.request_id, turn) if self.policy.prepares_tables else \
                    AgentPrefill(request.request_id, turn, 0)
                agent.max_output_tokens = request.max_tokens
                agents.append(agent)
        except CapacityError as exc:
            for agent in agents:
                self.kv.free(agent.table_id)
            self._agents = {}
            self._too_large(exc)
            return True
        self._agents = {a.table_id: a for a in agents + exact}
        self._release(exact)
        self._prefill = self.policy.prefill(agents)
        return True

    def _is_exact(self, request: Request) -> bool:
        return self.probe is not None and request is self.probe.exact

    def _release(self, agents: list[AgentPrefill]) -> None:
        for agent in agents:
            del self._agents[agent.table_id]
            if self.probe is not None and agent.table_id == self.probe.shadow.request_id:
                self._prepared(agent, self.probe.shadow)  # (not a member: its output is the probe's)
                continue
            request = self.requests[self._by_agent[agent.turn.agent_id]]
            if request.agent_id in self.abandoned:
                self.kv.free(request.request_id)
                self._record(self._unstarted_output(request, "abort"))
                continue
            if not self._is_exact(request):
                self._prepared(agent, request)
            else:
                self._ready.append(request)
            self._released.add(request.request_id)

    def _prepared(self, agent: AgentPrefill, request: Request) -> None:
        if self.policy.prepares_tables:
            self.policy.finish(agent)
            self.kv.mark_prepared(request.request_id, agent.num_prepared, agent.num_cached)
        self._ready.append(request)

    def _prefill_ended(self, report: PrefillReport) -> None:
        self._wave.report = report or PrefillReport()
        self._prefill = None
        self.policy.end_round()  # masters and recalled segments: every table of the wave is complete
        self._end_wave_if_done()

    def _too_large(self, exc: CapacityError) -> None:
        """The pool cannot hold the wave's prepared KV: its agents not released yet are prepared
        later, in a wave of their own (halved if none of the wave was released)."""
        wave = self._wave
        shadow_waits = self.probe is not None and self.probe.shadow.request_id in self._agents
        self._close_prefill()
        if shadow_waits:
            self.probe.skip("the round ran in waves", self.kv)
        waiting = [i for i in wave.indices if self.requests[i].request_id not in self._released]
        for i in waiting:
            self.kv.free(self.requests[i].request_id)
        self.policy.end_round()
        released = [i for i in wave.indices if i not in waiting]
        self._wave = None
        if not released and len(waiting) == 1:
            self.fail(RoundTooLarge(str(exc)))
            return
        if released:
            wave.indices = released
            self._done_waves.append(wave)  # ends when its released agents finished
            self._waves.appendleft(_Wave(waiting))
        else:
            half = len(waiting) // 2
            self._waves.extendleft([_Wave(waiting[half:]), _Wave(waiting[:half])])
        self._end_wave_if_done()

    def _close_prefill(self) -> None:
        if self._prefill is not None:
            self._prefill.close()  # its finally blocks free scratch and recalled tables
        self._prefill, self._pending, self._agents = None, None, {}

    def _all_abandoned(self) -> bool:
        """No client waits for an agent still to come (each left, before or after its agent
        started, or has its output): the round stops in its preparation, whatever wave it is in."""
        if not self.abandoned:  # (an agent not yet started is abandoned when it leaves: none left)
            return False
        if any(agent not in self.abandoned and self.requests[i].request_id not in self.outputs
               for agent, i in self._by_agent.items()):
            return False
        self.fail(RoundAborted("every agent of the round was aborted"))
        return True

    # ------------------------------------------------------------ the end

    def _record(self, output: RequestOutput) -> None:
        self.outputs.setdefault(output.request_id, output)

    def _end_wave_if_done(self) -> None:
        """A wave ends when its prefill ended and all its agents have their outputs; the round
        when its last wave did."""
        wave = self._wave
        if wave is not None and self._prefill is None and all(
                self.requests[i].request_id in self.outputs for i in wave.indices):
            self._finish_wave(wave)
            self._wave = None
        for wave in [w for w in self._done_waves if w.stats is None]:
            if all(self.requests[i].request_id in self.outputs for i in wave.indices):
                self._finish_wave(wave)
        if self._wave is None and not self._waves and len(self.outputs) == len(self.requests) and not self.done \
                and (self.probe is None or self.probe.done):
            self._finish_round()

    def _finish_wave(self, wave: _Wave) -> None:
        context = self.context
        requests = [self.requests[i] for i in wave.indices]
        tokenized = [self.tokenized[i] for i in wave.indices]
        outputs = [self.outputs[r.request_id] for r in requests]
        stats = RoundStats(self.index, self.policy.name, len(requests))
        fill_times(stats, wave.report, outputs, wave.started, self.policy.prepares_tables)
        fill_kv(stats, self.kv, context.bytes_per_block, [r.request_id for r in requests], tokenized)
        if wave.reads_before is not None:
            fill_reads(stats, wave.reads_before, context.model.decode_reads, context.row_bytes)
        if wave.account_before is not None:
            fill_work(stats, context.account.since(wave.account_before), context.peaks)
        wave.stats = stats
        if wave not in self._done_waves:
            self._done_waves.append(wave)
        for request, turn in zip(requests, tokenized):
            if not self.kv.has(request.request_id):
                continue  # aborted, or its kept table was evicted under memory pressure
            if self.policy.keeps_sessions and turn.agent_id not in self.ending:
                computed = request.token_ids[: request.num_computed_tokens]
                session = Session(computed, turn.spans)
                self.kv.keep(request.request_id, key=SessionKey(turn.agent_id), payload=session)
            else:
                self.kv.free(request.request_id)

    def _finish_round(self) -> None:
        waves = [w for w in self._done_waves if w.stats is not None]
        if not waves:  # every agent left before the round started
            self.fail(RoundAborted("every agent of the round was aborted before it started"))
            return
        outputs = [self.outputs[r.request_id] for r in self.requests]
        started = self.started or time.perf_counter()
        if len(waves) == 1:
            stats = waves[0].stats
        else:
            stats = merge_waves([([self.outputs[self.requests[i].request_id] for i in w.indices], w.stats)
                                 for w in waves], started)
        stats.num_agents = len(outputs)
        stats.repeated_replies = repeated_replies([o.text for o in outputs])
        if self.auto is not None:
            step = self._observe_probe(outputs)
            stats.computed_tokens += step.probe_tokens
            stats.fidelity = step.as_dict()
        stats.first_token_seconds = min((o.first_token_time for o in outputs if o.first_token_time),
                                        default=started) - started
        self._drop_ending_sessions()
        self.result = RoundResult(outputs, stats)

    def _observe_probe(self, outputs: list[RequestOutput]):
        """The controller learns the round's reading; a move is logged once, when it is made."""
        probe, reading, skipped = self.probe, None, None
        if probe is not None:
            exact = self.outputs[probe.exact.request_id]
            reading = probe.reading(exact, [o for o in outputs if o is not exact])
            skipped = probe.skipped
        step = self.auto.controller.observe(self.auto.setting, reading, skipped)
        if probe is not None:  # what the scheduler computed beyond the one last token stats count for the member
            scored = [probe.outputs[r.request_id] for r in probe.scoring if r.request_id in probe.outputs]
            step.probe_tokens = sum(o.num_prompt_tokens - (o.num_cached_tokens or 0) for o in [exact, *scored]) - 1
        if step.move is not None:
            log.info("fidelity auto: %s (round %d%s)", step.move, self.index,
                     f", probe of {reading.agent_id}: KL {reading.kl:.3f}, pull {reading.pull:+.2f}" if step.breach else "")
        return step

    def _unstarted_output(self, request: Request, reason: str) -> RequestOutput:
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, "", [], reason,
                             request.num_prompt_tokens, 0, 0, arrival_time=request.arrival_time,
                             agent_id=request.agent_id)
