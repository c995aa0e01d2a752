"""The engine thread: the one thread that adds, steps and aborts requests and runs rounds.

HTTP handlers never touch the engine's state: they validate a request (`make_request` is free of
side effects), put a job on the inbox and await a `Sink`, which the engine thread fills through
the event loop's `call_soon_threadsafe`. While a round runs (`RoundRunner.run` steps the engine
itself), the thread keeps serving the inbox from the round's output hook, so ordinary requests
are added and aborted as usual, and an agent of the round whose client left is aborted alone;
only the next round waits for this one to end.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tokendance.errors import InvalidRequestError, TokenDanceError
from tokendance.outputs import RequestOutput
from tokendance.reuse.segments import AgentTurn
from tokendance.server.gather import ChatTurn, RoundGatherer
from tokendance.server.metrics import Metrics
from tokendance.server.protocol import ApiError

log = logging.getLogger("tokendance.server")


def engine_agent_id(namespace: str, agent_id: str) -> str:
    """The engine's name for a client's agent: scoped by cache namespace, so tenants that pick the
    same agent id never share a session."""
    scope = hashlib.sha256(namespace.encode()).hexdigest()[:16] if namespace else ""
    return f"agent:{scope}:{agent_id}"


class Sink:
    """The outputs of one HTTP request on their way from the engine thread to the event loop.

    The engine thread calls `put`, `put_stats` and `fail`; the event loop reads. Outputs are
    cumulative, so only the latest of each choice is kept: a slow reader costs O(choices).
    `closed` (set by the event loop when the client is gone) makes the engine drop its outputs.
    """

    def __init__(self, key: str, num_choices: int, wants_stats: bool = False):
        self.key = key
        self.num_choices = num_choices
        self.wants_stats = wants_stats  # a /v1/rounds request: done once the round's stats arrived
        self.loop = asyncio.get_running_loop()
        self.outputs: dict[int, RequestOutput] = {}
        self.round_info: dict[int, dict] = {}
        self.stats = None
        self.error: Exception | None = None
        self.closed = False
        self.first_output_time: float | None = None
        self._changed: set[int] = set()
        self._event = asyncio.Event()

    # ------------------------------------------------------------ engine thread

    def put(self, index: int, output: RequestOutput, round_info: dict | None = None) -> None:
        self._call(self._on_put, index, output, round_info)

    def put_stats(self, stats) -> None:
        self._call(self._on_stats, stats)

    def fail(self, error: Exception) -> None:
        self._call(self._on_fail, error)

    def _call(self, fn: Callable, *args) -> None:
        if self.closed:
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    # ------------------------------------------------------------ event loop

    def _on_put(self, index: int, output: RequestOutput, round_info: dict | None) -> None:
        if self.first_output_time is None:
            self.first_output_time = time.perf_counter()
        self.outputs[index] = output
        if round_info is not None:
            self.round_info[index] = round_info
        self._changed.add(index)
        self._event.set()

    def _on_stats(self, stats) -> None:
        self.stats = stats
        self._event.set()

    def _on_fail(self, error: Exception) -> None:
        self.error = error
        self._event.set()

    @property
    def done(self) -> bool:
        finished = sum(o.finished for o in self.outputs.values())
        return finished == self.num_choices and (self.stats is not None or not self.wants_stats)

    async def updates(self) -> AsyncIterator[list[int]]:
        """Yield the indices of choices with new output until all finished; raise the error if
        the engine reported one."""
        while not self.done:
            await self._event.wait()
            self._event.clear()
            if self.error is not None:
                raise self.error
            changed, self._changed = sorted(self._changed), set()
            if changed:
                yield changed

    async def final(self) -> list[RequestOutput]:
        async for _ in self.updates():
            pass
        return [self.outputs[i] for i in range(self.num_choices)]


@dataclass
class Route:
    """Where an engine request's outputs go."""

    sink: Sink
    index: int
    round_info: dict | None = None
    started: bool = False


@dataclass
class GenerateJob:
    requests: list  # validated engine Requests, one per choice
    sink: Sink


@dataclass
class TurnJob:
    turn: ChatTurn


@dataclass
class RoundJob:
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

    def __init__(self, llm, gatherer: RoundGatherer, metrics: Metrics):
        self.llm = llm
        self.engine = llm.engine
        self.gatherer = gatherer
        self.metrics = metrics
        self.error: BaseException | None = None  # why the thread died, if it did
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, Route] = {}
        self._in_round: set[str] = set()
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
                work = self.gatherer.pop_ready(time.monotonic())
                for turn in work.ordinary:
                    self._add(turn.request, Route(turn.sink, turn.index))
                for turns in work.rounds:
                    self._run_round(turns)
                if self.engine.has_unfinished:
                    self._step()
                self._publish()
        except BaseException as exc:  # a bug: say so to every waiting client, then die loudly
            self.error = exc
            log.exception("the engine thread died")
            for route in self._routes.values():
                route.sink.fail(ApiError(500, f"engine failure: {exc}", type="server_error"))
            raise

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
        if job is _STOP:
            self._stopping = True
        elif isinstance(job, GenerateJob):
            for index, request in enumerate(job.requests):
                self._add(request, Route(job.sink, index))
        elif isinstance(job, TurnJob):
            try:
                self.gatherer.add(job.turn)
            except InvalidRequestError as exc:
                job.turn.sink.fail(ApiError.from_engine(exc, param="agent_id"))
        elif isinstance(job, RoundJob):
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

    def _add(self, request, route: Route) -> None:
        if route.sink.closed:
            return
        try:
            self.engine.add(request)
        except InvalidRequestError as exc:
            route.sink.fail(ApiError.from_engine(exc))
            return
        self._routes[request.request_id] = route

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug in a step: fail what runs, keep serving
            log.exception("engine step failed")
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
                route = self._routes.pop(request_id, None)
                if route is not None:
                    route.sink.fail(ApiError(500, f"engine failure: {exc}", type="server_error"))
            return
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        route = self._routes.get(output.request_id)
        if route is None:
            return
        route.started = True
        if output.finished:
            del self._routes[output.request_id]
            self._count_finished(output)
        route.sink.put(route.index, output, route.round_info)

    def _abort(self, sink: Sink) -> None:
        self.gatherer.remove(sink.key)
        for request_id, route in list(self._routes.items()):
            if route.sink is sink:
                del self._routes[request_id]
                if request_id in self._in_round:  # the round goes on without it
                    output = self.engine.rounds.abort(request_id)
                else:
                    output = self.engine.abort_request(request_id)
                if output is not None:
                    self._count_finished(output)

    # ------------------------------------------------------------ rounds

    def _run_round(self, turns: list[ChatTurn]) -> None:
        turns = [t for t in turns if not t.sink.closed]
        if not turns:
            return
        index = self.engine.rounds.round_index
        agent_ids = [
            f"anon:{next(self._anonymous)}" if t.agent_id is None else engine_agent_id(t.namespace, t.agent_id)
            for t in turns
        ]
        request_ids = [f"round{index}:{a}" for a in agent_ids]
        for request_id, turn in zip(request_ids, turns):
            info = {"index": index, "agent_id": turn.agent_id, "num_agents": len(turns)}
            self._routes[request_id] = Route(turn.sink, turn.index, info)
        self._in_round = set(request_ids)
        agent_turns = [AgentTurn(a, messages=t.messages, namespace=t.namespace) for a, t in zip(agent_ids, turns)]
        try:
            result = self.engine.rounds.run(agent_turns, [t.params for t in turns], on_output=self._on_round_output)
        except Exception as exc:
            self._round_failed(turns, request_ids, exc)
            return
        finally:
            self._in_round = set()
            for agent_id in agent_ids:
                if agent_id.startswith("anon:"):  # nobody can name it again: free its session
                    self.llm.end_agent(agent_id)
        self._record_round(turns, result.stats)
        for sink in {id(t.sink): t.sink for t in turns if t.sink.wants_stats}.values():
            sink.put_stats(result.stats)

    def _on_round_output(self, output: RequestOutput) -> None:
        self._deliver(output)
        self._drain_inbox(block=False)
        self._publish()

    def _round_failed(self, turns: list[ChatTurn], request_ids: list[str], exc: Exception) -> None:
        """Turns that had no output yet are served alone (a transparent round is an optimisation,
        not a contract); the others, and whole /v1/rounds requests, get the error."""
        self.metrics.inc("tokendance_rounds_failed_total")
        if isinstance(exc, TokenDanceError):
            error = ApiError.from_engine(exc, param="messages")
        else:
            log.exception("round failed", exc_info=exc)
            error = ApiError(500, f"round failed: {exc}", type="server_error")
        for request_id, turn in zip(request_ids, turns):
            route = self._routes.pop(request_id, None)
            if route is None:
                continue  # it finished before the failure
            if isinstance(exc, TokenDanceError) and not route.started and not turn.sink.wants_stats:
                self._add(turn.request, Route(turn.sink, turn.index))
            else:
                turn.sink.fail(error)

    # ------------------------------------------------------------ metrics

    def _record_round(self, turns: list[ChatTurn], stats) -> None:
        m = self.metrics
        if any(t.sink.wants_stats for t in turns):
            source = "api"
        elif any(t.round_id is not None for t in turns):
            source = "declared"
        else:
            source = "transparent"
        m.inc("tokendance_rounds_total", source=source)
        m.observe("tokendance_round_agents", stats.num_agents)
        m.set("tokendance_last_round_agents", stats.num_agents)
        m.observe("tokendance_round_seconds", stats.round_seconds)
        m.observe("tokendance_round_prefill_seconds", stats.prefill_seconds)
        m.inc("tokendance_round_logical_kv_tokens_total", stats.logical_kv_tokens)
        m.inc("tokendance_round_physical_kv_tokens_total", stats.physical_kv_tokens)
        m.set("tokendance_round_compression", stats.compression)
        m.set("tokendance_round_shared_compression", stats.shared_compression)
        m.set("tokendance_round_kv_bytes_per_agent", stats.kv_bytes_per_agent)

    def _count_finished(self, output: RequestOutput) -> None:
        m = self.metrics
        m.inc("tokendance_requests_finished_total", finish_reason=output.finish_reason or "abort")
        m.inc("tokendance_prompt_tokens_total", output.num_prompt_tokens)
        m.inc("tokendance_cached_prompt_tokens_total", output.num_cached_tokens)
        m.inc("tokendance_generation_tokens_total", output.num_generated_tokens)

    def _publish(self) -> None:
        engine, m = self.engine, self.metrics
        pool = engine.kv.pool
        m.set("tokendance_kv_blocks_total", pool.num_blocks)
        m.set("tokendance_kv_blocks_used", pool.num_used)
        m.set("tokendance_kv_blocks_free", pool.num_free)
        m.set("tokendance_agent_sessions", len(engine.rounds.sessions))
        m.set("tokendance_session_evictions_total", engine.rounds.num_evictions)
        m.set("tokendance_engine_running_requests", len(engine.scheduler.running))
        m.set("tokendance_engine_waiting_requests", len(engine.scheduler.waiting))
        m.set("tokendance_gather_pending_requests", len(self.gatherer))
