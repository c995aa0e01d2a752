"""The engine thread: the one thread that adds, steps and aborts requests and submits rounds.

HTTP handlers never touch the engine's state: they validate a request (`make_request` is free of
side effects), put a job on the inbox and await a `Sink`, which the engine thread fills through
the event loop's `call_soon_threadsafe`. The thread's loop is the engine's only driver: it takes
new jobs and aborts, starts gathered turns, submits formed rounds (the engine prepares and runs
them in its steps, beside every other request) and steps the engine. An agent of a round whose
client left is aborted alone, and a round whose clients all left stops.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokendance.engine.rounds import RoundAborted
from tokendance.errors import InvalidRequestError, TokenDanceError
from tokendance.outputs import RequestOutput
from tokendance.reuse.segments import AgentTurn
from tokendance.round_core.gathering import ChatTurn, RoundConflictError, RoundGatherer
from tokendance.server.metrics import Metrics
from tokendance.server.protocol import ApiError
from tokendance.server.fleet.routing import agent_key
from tokendance.server.sink import Sink
from tokendance.structured import StructuredOutputError

log = logging.getLogger("tokendance.server")


@dataclass
class Delivery:
    """Where an engine request's outputs go."""

    sink: Sink
    index: int
    round_info: dict | None = None
    started: bool = False


@dataclass
class GenerateJob:
    requests: list  # validated engine Requests, one per choice
    sink: Sink
    # n choices of one prompt (consecutive requests with the same prompt): the first computes the
    # prompt, the others are added once it has (its first token), and find it in the prefix cache
    share_prompt: bool = False


@dataclass
class TurnJob:
    turn: ChatTurn


@dataclass
class WholeRoundJob:
    turns: list[ChatTurn]


@dataclass
class AbortJob:
    sink: Sink


@dataclass
class CallJob:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


_STOP = object()


class EngineLoop:
    """Invariants: only the engine thread changes the engine; every submitted request's sink gets
    all its outputs or an error; an aborted request's KV is freed before the next step."""

    def __init__(self, llm, gatherer: RoundGatherer, metrics: Metrics, exit_on_failure: bool = True):
        self.llm = llm
        self.exit_on_failure = exit_on_failure
        self.engine = llm.engine
        self.gatherer = gatherer
        self.metrics = metrics
        self.error: BaseException | None = None  # why the thread died, if it did
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deliveries: dict[str, Delivery] = {}  # engine request id -> where its outputs go (rounds' agents too)
        self._round_agents: dict[str, tuple[Any, str]] = {}  # a round agent's request id -> (its round, agent id)
        self._rounds: dict[Any, tuple[list[ChatTurn], list[str]]] = {}  # submitted rounds -> (turns, agent ids)
        self._anonymous = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tokendance-engine", daemon=True)

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job) -> None:
        if not self.is_alive:
            raise ApiError(503, "the engine is not running", type="server_error", code="engine_unavailable")
        self._inbox.put(job)

    def abort(self, sink: Sink) -> None:
        """The client is gone: drop its outputs and free its requests (also before they ran)."""
        sink.closed = True
        self._inbox.put(AbortJob(sink))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread (for anything that reads or changes engine state)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.submit(CallJob(fn, loop, future))
        return await future

    # ------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox(block=not self.engine.has_unfinished)
                self._start_ready()
                if self.engine.has_unfinished:
                    self._step()
                self._end_rounds()
                self._publish()
        except BaseException as exc:  # a bug outside any one request: nobody can be served any more
            self.error = exc
            log.exception("the engine thread died")
            for delivery in self._deliveries.values():
                delivery.sink.fail(ApiError(500, "engine failure", type="server_error"))
            if self.exit_on_failure:  # a server that answers 503 forever helps nobody: let a supervisor restart it
                time.sleep(0.5)  # the failures above reach their clients
                os._exit(70)
            raise

    def _start_ready(self) -> None:
        """Gathered turns whose wait is over: ordinary ones start now, rounds are submitted."""
        work = self.gatherer.pop_ready(time.monotonic())
        for turn in work.ordinary:
            self._add(turn.request, Delivery(turn.sink, turn.index))
        for turns in work.rounds:
            self._submit_round(turns)

    def _drain_inbox(self, block: bool) -> None:
        timeout = None
        if block:
            deadline = self.gatherer.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            job = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            while True:
                self._handle(job)
                job = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, job) -> None:
        """One job; whatever goes wrong with it fails its request alone."""
        try:
            self._handle_job(job)
        except Exception:
            log.exception("a request failed on the engine thread")
            for sink in _sinks(job):
                self._abort(sink)  # nothing of it stays in the engine
                sink.fail(ApiError(500, "the engine failed on this request", type="server_error"))

    def _handle_job(self, job) -> None:
        if job is _STOP:
            self._stopping = True
        elif isinstance(job, GenerateJob):
            self._add_generate(job)
        elif isinstance(job, TurnJob):
            try:
                self.gatherer.add(job.turn)
            except RoundConflictError as exc:
                job.turn.sink.fail(ApiError(409, str(exc), param="round_size", code="round_conflict"))
            except InvalidRequestError as exc:
                job.turn.sink.fail(ApiError.from_engine(exc, param="agent_id"))
        elif isinstance(job, WholeRoundJob):
            self.gatherer.add_round(job.turns)
        elif isinstance(job, AbortJob):
            self._abort(job.sink)
        elif isinstance(job, CallJob):
            self._call(job)

    def _call(self, job: CallJob) -> None:
        def resolve(value=None, error=None):
            if not job.future.done():
                job.future.set_exception(error) if error else job.future.set_result(value)

        try:
            value = job.fn()
        except Exception as exc:
            job.loop.call_soon_threadsafe(resolve, None, exc)
        else:
            job.loop.call_soon_threadsafe(resolve, value)

    def _add_generate(self, job: GenerateJob) -> None:
        """Every choice starts now, except the n-1 sibling choices of a shared prompt: the engine
        holds them until the first has computed the prompt, then they find it in the prefix cache."""
        leader, leader_added = None, False
        for index, request in enumerate(job.requests):
            delivery = Delivery(job.sink, index)
            if job.share_prompt and leader is not None and leader.prompt_token_ids == request.prompt_token_ids:
                # (a leader that never started, its client gone or refused: no wait)
                self._add(request, delivery, after=leader.request_id if leader_added else None)
                continue
            leader = request
            leader_added = self._add(request, delivery)

    def _add(self, request, delivery: Delivery, after: str | None = None) -> bool:
        """Start one request; False if it did not (its client left, or the engine refused it)."""
        if delivery.sink.closed:
            return False
        try:
            self.engine.add(request, after=after)
        except InvalidRequestError as exc:
            delivery.sink.fail(ApiError.from_engine(exc))
            return False
        self._deliveries[request.request_id] = delivery
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug in a step: fail what runs, keep serving
            log.exception("engine step failed")
            self.engine.abort_all(exc)
            for request_id, delivery in list(self._deliveries.items()):
                if request_id not in self._round_agents:  # (rounds fail in _end_rounds)
                    del self._deliveries[request_id]
                    delivery.sink.fail(ApiError(500, "engine failure", type="server_error"))
            return
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        delivery = self._deliveries.get(output.request_id)
        if delivery is None:
            return
        delivery.started = True
        if output.finished:
            del self._deliveries[output.request_id]
            self.metrics.record_finished(output)
        if output.finish_reason == "error" and not delivery.sink.wants_stats:  # its computation raised: it alone fails
            if not (output.error or "").startswith(StructuredOutputError.__name__):
                delivery.sink.fail(ApiError(500, f"the engine failed on this request ({output.error})", type="server_error"))
                return  # (an agent of a /v1/rounds request: its entry of the round's answer carries the error)
            if output.num_generated_tokens == 0:  # a constraint that compiled but cannot be followed: the input's
                message = output.error.split(": ", 1)[-1]
                delivery.sink.fail(ApiError(400, f"the output constraint cannot be followed: {message}",
                                            param=delivery.sink.constraint_param, code="invalid_value"))
                return  # (after some tokens the reply ends there, with finish_reason "error")
        delivery.sink.put(delivery.index, output, delivery.round_info)

    def _abort(self, sink: Sink) -> None:
        self.gatherer.remove(sink.key)
        if sink.wants_stats:  # a /v1/rounds client left: none of its agents got a reply, none keeps a session
            for turns, agent_ids in [entry for entry in self._rounds.values() if entry[0][0].sink is sink]:
                for agent_id in agent_ids:
                    self.llm.end_agent(agent_id)
        for request_id in [r for r, delivery in self._deliveries.items() if delivery.sink is sink]:
            del self._deliveries[request_id]
            if request_id in self._round_agents:  # the round goes on without it
                job, agent_id = self._round_agents[request_id]
                self._aborted(self.llm.rounds.abort(agent_id, job))
            else:
                self._aborted(self.engine.abort_request(request_id))

    def _aborted(self, output: RequestOutput | None) -> None:
        if output is not None:
            self.metrics.record_finished(output)

    # ------------------------------------------------------------ rounds

    def _submit_round(self, turns: list[ChatTurn]) -> None:
        """Hand a formed round to the engine; its agents' outputs come through the steps."""
        turns = [t for t in turns if not t.sink.closed]
        if not turns:
            return
        agent_ids = [
            f"anon:{next(self._anonymous)}" if t.agent_id is None else agent_key(t.namespace, t.agent_id)
            for t in turns
        ]
        agent_turns = [AgentTurn(a, messages=t.messages, namespace=t.namespace, tools=t.tools)
                       for a, t in zip(agent_ids, turns)]
        try:
            job = self.llm.rounds.submit(agent_turns, [t.params for t in turns])
        except Exception as exc:
            self._round_failed(turns, [None] * len(turns), exc)
            return
        for agent_id, turn in zip(agent_ids, turns):
            request_id = job.request_id_of(agent_id)
            info = {"index": job.index, "agent_id": turn.agent_id, "num_agents": len(turns)}
            self._deliveries[request_id] = Delivery(turn.sink, turn.index, info)
            self._round_agents[request_id] = (job, agent_id)
        self._rounds[job] = (turns, agent_ids)

    def _end_rounds(self) -> None:
        """Rounds the engine is done with: their statistics, or their failure."""
        for job in [j for j in self._rounds if j.done]:
            turns, agent_ids = self._rounds.pop(job)
            for request_id in job.request_ids:
                self._round_agents.pop(request_id, None)
            for agent_id in agent_ids:
                if agent_id.startswith("anon:"):  # nobody can name it again: free its session
                    self.llm.end_agent(agent_id)
            try:
                result = self.llm.rounds.collect(job)
            except RoundAborted:
                self.metrics.inc("tokendance_rounds_aborted_total")
                continue
            except Exception as exc:
                self._round_failed(turns, [job.request_id_of(a) for a in agent_ids], exc)
                continue
            if all(t.sink.closed for t in turns):  # it ended as its clients left: nobody got it
                self.metrics.inc("tokendance_rounds_aborted_total")
                continue
            self.metrics.record_round(result.stats, _source(turns))
            for sink in {id(t.sink): t.sink for t in turns if t.sink.wants_stats}.values():
                sink.put_stats(result.stats)

    def _round_failed(self, turns: list[ChatTurn], request_ids: list[str | None], exc: BaseException) -> None:
        """Turns that had no output yet are served alone (a transparent round is an optimisation,
        not a contract); the others, and whole /v1/rounds requests, get the error."""
        self.metrics.inc("tokendance_rounds_failed_total")
        if isinstance(exc, TokenDanceError):
            error = ApiError.from_engine(exc, param="messages")
        else:
            log.error("round failed: %s", exc)
            error = ApiError(500, "the round failed in the engine", type="server_error")
        for request_id, turn in zip(request_ids, turns):
            delivery = self._deliveries.pop(request_id, None) if request_id else Delivery(turn.sink, turn.index)
            if delivery is None:
                continue  # it finished before the failure
            if isinstance(exc, TokenDanceError) and not delivery.started and not turn.sink.wants_stats:
                self._add(turn.request, Delivery(turn.sink, turn.index))
            else:
                turn.sink.fail(error)

    def _publish(self) -> None:
        self.metrics.record_engine(self.engine.stats(), len(self.gatherer))


def _sinks(job) -> list[Sink]:
    """The clients a job answers (none for a call or a stop)."""
    if isinstance(job, (GenerateJob, AbortJob)):
        return [job.sink]
    if isinstance(job, TurnJob):
        return [job.turn.sink]
    if isinstance(job, WholeRoundJob):
        return [t.sink for t in job.turns]
    return []


def _source(turns: list[ChatTurn]) -> str:
    """How a round formed, as /metrics labels it."""
    if any(t.sink.wants_stats for t in turns):
        return "api"
    if any(t.round_id is not None for t in turns):
        return "declared"
    return "transparent"
