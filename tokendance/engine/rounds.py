"""Rounds of agent turns: a round is a job that the engine's step advances, like any request.

A round is a set of agent turns submitted together. The reuse policy (one per mode, see
`reuse/policy.py`) decides how each agent's prompt KV is prepared before the scheduler computes
its last token and decodes:

- full:       nothing reused (no prefix caching, no sessions)
- prefix:     automatic prefix caching only (the vLLM baseline)
- pic:        prefix caching + per-request position-independent reuse of shared spans (CacheBlend)
- tokendance: agent sessions + the KV Collector with Master-Mirror tables

A policy's prefill is a generator of forward passes (`Work`) and of agents whose tables are
complete (`Ready`); it runs no pass itself. At each step the engine asks the round's job for a
group of those passes within the step's token budget (`RoundJob.next_group`) and runs it in the
same forward as every other request's decodes and prefill chunks; an agent whose table is ready
is added to the engine at once (`take_ready`) and decodes in the next steps, beside the next
groups of its round's preparation. Prepared KV enters the scheduler through the KV manager
(`mark_prepared`, then the scheduler's `find_computed` query); agent sessions are kept tables of
the KV manager (`SessionKey`), evicted by it, least recently kept first, when an allocation
needs room.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence

from tokendance.config import AUTO, EngineConfig
from tokendance.engine.llm_engine import LLMEngine
from tokendance.engine.request import Request
from tokendance.engine.round_probe import SHADOW, AutoRound, RoundProbe
from tokendance.engine.round_job import RoundAborted, RoundContext, RoundJob, RoundResult, RoundTooLarge
from tokendance.errors import InvalidRequestError
from tokendance.kv.manager import SessionKey
from tokendance.outputs import RequestOutput
from tokendance.reuse.policy import ReusePolicy, make_policy
from tokendance.reuse.round_kv import RoundKV
from tokendance.round_core.fidelity_control import PULL_TOKENS, Controller, check_target
from tokendance.round_core.spans import Session
from tokendance.reuse.segments import AgentTurn, TokenizedTurn, tokenize_round
from tokendance.reuse.selection import make_selector
from tokendance.sampling import SamplingParams

__all__ = ["RoundAborted", "RoundResult", "RoundRunner", "RoundTooLarge"]


class RoundRunner:
    """Submits rounds to an engine with one reuse policy, and drains them (`run`). Holds no KV:
    sessions live in the engine's KV manager."""

    def __init__(self, engine: LLMEngine, policy: ReusePolicy, ladder: dict[str, ReusePolicy] | None = None):
        self.engine = engine
        self.policy = policy
        # --fidelity auto: a policy per rung of the ladder, and a controller per simulation (namespace)
        self.ladder = ladder
        self.controllers: dict[str, Controller] = {}
        self.round_index = 0
        c = engine.model_config
        row_bytes = engine.bytes_per_block // engine.config.block_size // c.num_layers // c.num_kv_heads
        self.context = RoundContext(policy, engine.kv, engine.runner.model, engine.bytes_per_block, row_bytes,
                                    engine.account, engine.peaks)
        self._jobs: list[RoundJob] = []  # submitted and not done, in order

    @classmethod
    def for_engine(cls, engine: LLMEngine) -> RoundRunner:
        c = engine.config
        if c.fidelity != AUTO:
            return cls(engine, _policy(engine, c))
        ladder = {name: _policy(engine, EngineConfig(fidelity=name, check_layer=c.check_layer)) for name in c.fidelity_ladder}
        return cls(engine, ladder[c.fidelity_ladder[0]], ladder)

    def controller(self, namespace: str = "") -> Controller | None:
        """The `--fidelity auto` controller of a simulation (None for other settings)."""
        if self.ladder is None:
            return None
        if namespace not in self.controllers:
            c = self.engine.config
            self.controllers[namespace] = Controller(c.fidelity_ladder, check_target(c.fidelity_target))
        return self.controllers[namespace]

    # ------------------------------------------------------------ sessions

    def sessions(self) -> dict[str, Session]:
        """Agents whose KV is kept, with what it holds."""
        return {key.agent_id: session for key, session in self.engine.kv.find_kept(SessionKey).items()}

    def is_running(self, agent_id: str) -> bool:
        """The agent has a turn in a round submitted and not done."""
        return self._job_of(agent_id) is not None

    def end_agent(self, agent_id: str) -> bool:
        """Drop an agent's session; False if it has none. An agent whose turn is running keeps
        its turn, and its KV is dropped when the round ends instead of kept."""
        job = self._job_of(agent_id)
        if job is not None:
            job.ending.add(agent_id)
            return True
        key = SessionKey(agent_id)
        if not self.engine.kv.has(key):
            return False
        self.engine.kv.free(key)
        return True

    def abort(self, agent_id: str, job: RoundJob | None = None) -> RequestOutput | None:
        """Abort one agent's turn (its client left) in `job` (by default the first round holding
        it). Its KV is freed at once (masters it computed stay while others hold them), the other
        agents go on, and the round's output for it has finish_reason "abort" and it keeps no
        session. Returns that output if the agent's request was running; an agent whose KV is
        still being prepared is never started (None now). If every agent of a round is aborted
        while the round prepares, the round stops there (`RoundAborted`)."""
        job = job or self._job_of(agent_id)
        request_id = None if job is None else job.request_id_of(agent_id)
        if request_id is None:
            return None
        if request_id in self.engine.requests:
            output = self.engine.abort_request(request_id)
            job.record_abort(output)
            return output
        job.abandon(agent_id)
        return None

    # ------------------------------------------------------------ a round

    def submit(self, turns: Sequence[AgentTurn], params: SamplingParams | Sequence[SamplingParams]) -> RoundJob:
        """Validate a round and hand it to the engine, which prepares and runs it in its steps
        (after the rounds submitted before it). `params`: one for all turns or one per turn."""
        tokenized, params = self._validate(turns, params)
        engine = self.engine
        for turn, p in zip(tokenized, params):  # every request is valid before any is made
            engine.make_request(turn.token_ids, p, namespace=turn.namespace)
        # The round runs in an order of its contents (then agent ids), not of arrival: masters,
        # selection, release order and batch composition, hence the outputs, do not depend on the
        # order the turns came in.
        order = sorted(range(len(tokenized)),
                       key=lambda i: (tokenized[i].namespace, tokenized[i].token_ids, tokenized[i].agent_id))
        index = self.round_index
        self.round_index += 1
        requests = [
            engine.make_request(tokenized[i].token_ids, params[i], request_id=f"round{index}:{tokenized[i].agent_id}",
                                namespace=tokenized[i].namespace, agent_id=tokenized[i].agent_id, retain_kv=True,
                                group=f"round{index}", score_from=tokenized[i].num_prepared)
            for i in order
        ]
        turns_in_order = [tokenized[i] for i in order]
        auto = self._auto_round(requests, turns_in_order)
        context = self.context if auto is None else dataclasses.replace(self.context, policy=self.ladder[auto.setting])
        job = RoundJob(context, index, requests, turns_in_order, order, auto)
        self._jobs.append(job)
        engine.add_job(job)
        return job

    def run(self, turns: Sequence[AgentTurn], params: SamplingParams | Sequence[SamplingParams],
            on_output: Callable[[RequestOutput], None] | None = None) -> RoundResult:
        """Submit a round and step the engine until it is done. `on_output` sees every output the
        engine produces meanwhile (streaming, and requests outside the round that share the
        engine); outputs of the round carry `agent_id`. Raises what failed the round."""
        job = self.submit(turns, params)
        while not job.done:
            for output in self.engine.step():
                if on_output is not None:
                    on_output(output)
        return self.collect(job)

    def collect(self, job: RoundJob) -> RoundResult:
        """A done round's result, outputs in the order its turns were submitted; raises its error."""
        if job.error is not None:
            raise job.error
        outputs = [None] * len(job.requests)
        for position, index in enumerate(job.turn_order):
            outputs[index] = job.result.outputs[position]
        return RoundResult(outputs, job.result.stats)

    def _auto_round(self, requests: list[Request], tokenized: list[TokenizedTurn]) -> AutoRound | None:
        """The round's setting under `--fidelity auto`, and its probe: the member whose turn it is
        computed exactly, and its shadow, decoded greedily from the reused KV."""
        controller = self.controller(tokenized[0].namespace)
        if controller is None:
            return None
        auto = AutoRound(controller, controller.setting)
        probed = controller.probe_agent([t.agent_id for t in tokenized])
        if probed is not None:
            k = next(k for k, t in enumerate(tokenized) if t.agent_id == probed)
            exact, turn = requests[k], tokenized[k]
            shadow = self.engine.make_request(
                turn.token_ids, dataclasses.replace(SHADOW, max_tokens=min(PULL_TOKENS, exact.max_tokens)),
                request_id=f"{exact.request_id}#probe", namespace=turn.namespace, retain_kv=True, group=exact.group,
                score_from=turn.num_prepared)
            auto.probe = RoundProbe(auto.setting, turn, exact, shadow)
        return auto

    def _job_of(self, agent_id: str) -> RoundJob | None:
        self._jobs = [j for j in self._jobs if not j.done]
        return next((j for j in self._jobs if j.request_id_of(agent_id) is not None), None)

    def _validate(self, turns, params) -> tuple[list[TokenizedTurn], list[SamplingParams]]:
        if not isinstance(turns, Sequence) or isinstance(turns, str) or not turns:
            raise InvalidRequestError("a round needs a non-empty list of AgentTurn")
        if not all(isinstance(t, AgentTurn) for t in turns):
            raise InvalidRequestError("every turn of a round must be an AgentTurn")
        ids = [t.agent_id for t in turns]
        duplicates = sorted(a for a, count in Counter(ids).items() if count > 1)
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
        tokenized = tokenize_round(self.engine.tokenizer, turns)
        for turn, p in zip(tokenized, params):
            turn.score_tail = p.prompt_logprobs is not None
        return tokenized, list(params)


def _policy(engine: LLMEngine, c: EngineConfig) -> ReusePolicy:
    round_kv = RoundKV(engine.kv, engine.runner, make_selector(c.selection, c.recompute_ratio), c.check_layer)
    return make_policy(c.reuse, round_kv, c.anchors, c.masters)
