"""The fleet's ingress: auth, body limit and routing key for each request, rounds split into
groups, and every replica's answer streamed back."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from ray import serve
from ray.serve.context import _set_request_context
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tokendance.round_core.gathering import Door
from tokendance.round_core.protocol import RoundFieldError, check_round_request, merge_round_answers
from tokendance.server.fleet.routing import (MAX_OWNED_KEYS, GroupFill, PromptView, Route, TransparentHold,
                                             cache_namespace, fill_groups, group_routes, group_sizes, route_for,
                                             shared_placement)
from tokendance.server.gate import OPEN_PATHS, non_finite_field, read_body, tenant_of
from tokendance.server.metrics import split_sample, with_label
from tokendance.server.protocol import ApiError

log = logging.getLogger("tokendance.server")
from tokendance.server.fleet.replica import REPLICA_FAILURES, REPLICA_HEADER, ROUND_GROUP_HEADER, ReplicaGone


@dataclass(frozen=True)
class FleetConfig:
    """What the endpoint adds to routing: `max_round_agents`, the most agents one replica serves in a
    round (a larger round is split into groups; None: never split); `gather_window_s` > 0: chat
    requests that name no round are gathered for a window (`RoundGatherer`, the replicas' own rule),
    and those sharing text are sent to one replica as one round."""

    num_replicas: int
    max_round_agents: int | None = None
    gather_window_s: float = 0.0
    round_timeout_s: float = 2.0


@serve.deployment(max_ongoing_requests=8192, ray_actor_options={"num_cpus": 0})
class Ingress:
    """The endpoint: checks the API key and body size (before and while reading the body), picks
    each request's route, forwards it and streams the replica's answer back."""

    def __init__(self, engine, server_config, fleet: FleetConfig):
        self.engine = engine
        self.config = server_config
        self.fleet = fleet
        self.num_replicas = fleet.num_replicas
        self.door = Door()  # chat requests at the endpoint (held, or sent and not answered yet)
        self.hold = TransparentHold(fleet, self.door) if fleet.gather_window_s > 0 else None
        self.declared: OrderedDict[str, GroupFill] = OrderedDict()  # split declared rounds still filling
        self.restored: int | None = None  # keys read back from the replicas at start (None: not yet)

    async def __call__(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        tenant = None
        if self.config.api_keys and path not in OPEN_PATHS:
            tenant = tenant_of([v.encode() for v in request.headers.getlist("authorization")], self.config.api_keys)
            if tenant is None:
                return _error(ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                       code="invalid_api_key"))
        body = await read_body(request.receive, self.config.max_body_bytes)
        if body is None:
            return Response(status_code=499)  # the client left while sending
        if isinstance(body, ApiError):
            return _error(body)
        if self.restored is None:
            await self._restore_placement()
        if path == "/metrics":
            return PlainTextResponse(await self._metrics(), media_type="text/plain; version=0.0.4")
        if path == "/v1/replicas":
            return JSONResponse({"object": "list", "data": await self._broadcast_json("pid"),
                                 "router": {"pid": os.getpid(), "restored_keys": self.restored}})
        if method == "DELETE" and path.startswith("/v1/agents/"):  # wherever its session is
            return await self._delete(request, body)
        route = route_for(method, path, body, tenant or "")
        data = _json_object(body) if route.kind != "any" else None
        field = None if data is None else non_finite_field(data)
        if field is not None:  # a replica's vLLM may never answer one (its parser takes NaN too)
            return _error(ApiError(400, f"{field}: NaN and Infinity are not JSON numbers", param=field,
                                   code="invalid_value"))
        if path == "/v1/rounds" and data is not None and len(group_sizes(len(route.agents), self.fleet.max_round_agents)) > 1:
            return await self._split_round(request, data, route)
        if path != "/v1/chat/completions" or data is None:
            return await self._forward(request, body, route, PromptView(data))
        self.door.enter()
        try:
            headers = {}
            if route.kind == "round":
                body, route, headers = self._declared_group(data, body, route)
            elif route.kind == "prefix" and self.hold is not None and self.door.holds():
                salt = data.get("cache_salt")
                route = await self.hold.route(data, route, cache_namespace(tenant or "", salt if isinstance(salt, str) else None))
            response = await self._forward(request, body, route, PromptView(data), headers)
        except BaseException:
            self.door.leave()
            raise
        return _when_sent(response, self.door.leave)

    async def _forward(self, request: Request, body: bytes, route: Route, view=None, headers: dict | None = None,
                       replica: int | None = None) -> Response:
        if replica is not None:
            route = Route("replica", replica=replica)
        args = (request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body,
                view or PromptView(None))
        for attempt in (1, 2):  # a replica that died before answering: once more, elsewhere
            stream = self.engine.options(stream=True).http.remote(*args, route=route)
            try:
                start = await stream.__anext__()
            except REPLICA_FAILURES as exc:
                log.warning("replica failed before answering (attempt %d): %s", attempt, exc)
                if isinstance(exc, ReplicaGone):
                    route = dataclasses.replace(route, avoid=(*route.avoid, exc.replica))
                continue
            return StreamingResponse(_bodies(stream), status_code=start["status"],
                                     headers={**_headers(start), **(headers or {})})
        return _error(ApiError(503, "no engine replica could answer this request; retry later",
                               type="server_error", code="replica_unavailable"), retry_after=True)

    def _declared_group(self, data: dict, body: bytes, route: Route) -> tuple[bytes, Route, dict]:
        """A chat member of a declared round larger than a replica takes: the group it joins
        (`GroupFill`: the one on its session's replica where it can), renamed `<round_id>~<group>`
        with the group's size."""
        size = data.get("round_size")
        sizes = group_sizes(size, self.fleet.max_round_agents) if isinstance(size, int) else [0]
        if len(sizes) == 1:
            return body, route, {}
        fill = self.declared.pop(route.key, None) or GroupFill(sizes)
        placement = shared_placement()
        holder = placement.owner.get(route.agents[0]) if route.agents else None
        group = fill.join(holder, [placement.owner.get(f"{route.key}~{g}") for g in range(len(sizes))])
        if not fill.full:
            self.declared[route.key] = fill
            while len(self.declared) > MAX_OWNED_KEYS:
                self.declared.popitem(last=False)
        data = {**data, "round_id": f"{data['round_id']}~{group}", "round_size": sizes[group]}
        placed = dataclasses.replace(group_routes(route, [()] * len(sizes))[group], agents=route.agents)
        return json.dumps(data).encode(), placed, {ROUND_GROUP_HEADER: f"{group}/{len(sizes)}"}

    async def _split_round(self, request: Request, data: dict, route: Route) -> Response:
        """A /v1/rounds request with more agents than a replica takes: one round per group, each on
        its replica, sent at once; the answer is theirs merged, with `split` saying which agents
        each replica served."""
        try:
            check_round_request(data)
        except RoundFieldError:  # the replica answers the mistake
            return await self._forward(request, json.dumps(data).encode(), route, PromptView(data))
        sizes, agents, placement = group_sizes(len(route.agents), self.fleet.max_round_agents), data["agents"], shared_placement()
        groups = fill_groups(route, [placement.owner.get(a) for a in route.agents], sizes, placement)
        routes = group_routes(route, [[route.agents[i] for i in g] for g in groups])

        async def group(g: int):
            _set_request_context(_internal_request_id=uuid.uuid4().hex)  # a call of its own for Ray's router
            members = [agents[i] for i in groups[g]]
            response = await self._forward(request, json.dumps({**data, "agents": members}).encode(), routes[g],
                                           PromptView(data))
            return response, b"".join([chunk async for chunk in response.body_iterator])

        answers = await asyncio.gather(*(group(g) for g in range(len(sizes))))
        failed = next(((r, b) for r, b in answers if r.status_code != 200), None)
        if failed is not None:
            return Response(failed[1], status_code=failed[0].status_code, media_type="application/json")
        parts = [json.loads(b) for _r, b in answers]
        replicas = [r.headers.get(REPLICA_HEADER, "") for r, _b in answers]
        return JSONResponse(merge_round_answers(parts, replicas, [a["agent_id"] for a in agents]))

    async def _restore_placement(self) -> None:
        """Once, at the first request: read back where rounds and agents were placed from the
        replicas (the endpoint may be a restarted one), so that no agent loses its replica."""
        self.restored = 0
        logs = {found["replica"]: found["keys"] for found in await self._broadcast_json("placements")}
        self.restored = shared_placement().restore(logs)
        if self.restored:
            log.info("placement restored from the replicas: %d round and agent keys", self.restored)

    async def _replies(self, method: str, path: str) -> list[tuple[int, dict, bytes]]:
        """(status, headers, body) from every replica, once each."""
        async def one(index: int):
            stream = self.engine.options(stream=True).http.remote(method, path, b"", [], b"", PromptView(None),
                                                                 route=Route("replica", replica=index))
            start, body = None, b""
            async for message in stream:
                if message["type"] == "http.response.start":
                    start = message
                else:
                    body += message.get("body", b"")
            return start["status"], _headers(start), body

        seen, replies = set(), []
        for result in await _each_replica(one, self.num_replicas):
            name = result[1].get(REPLICA_HEADER)
            if name not in seen:
                seen.add(name)
                replies.append(result)
        return replies

    async def _broadcast_json(self, method_name: str) -> list[dict]:
        async def one(index: int):
            return await self.engine.options(method_name=method_name).remote(route=Route("replica", replica=index))

        found = {result["replica"]: result for result in await _each_replica(one, self.num_replicas)}
        return sorted(found.values(), key=lambda r: r["replica"])

    async def _metrics(self) -> str:
        """Every replica's metrics, each sample labelled with its replica, grouped by family."""
        families: dict[str, list[str]] = {}  # "# HELP" line -> its "# TYPE" line and samples, in order
        for _status, headers, body in await self._replies("GET", "/metrics"):
            label, family = f'replica="{headers.get(REPLICA_HEADER, "")}"', None
            for line in body.decode().splitlines():
                if line.startswith("# HELP"):
                    family = families.setdefault(line, [])
                elif line.startswith("# TYPE"):
                    if line not in family:
                        family.insert(0, line)
                elif line and family is not None:
                    series, value = split_sample(line)
                    family.append(f"{with_label(series, label)} {value}")
        return "".join(f"{help_line}\n" + "".join(f"{line}\n" for line in lines) for help_line, lines in families.items())

    async def _delete(self, request: Request, body: bytes) -> Response:
        answers = []
        for index in range(self.num_replicas):
            answers.append(await self._forward(request, body, Route("replica", replica=index)))
        found = [a for a in answers if a.status_code == 200]
        return found[0] if found else answers[0]


async def _each_replica(call, num_replicas: int) -> list:
    """`call(rank)` for every replica rank, one after the other (calls made while one HTTP request
    is handled share its request id, which Ray Serve's router matches replies by), skipping those
    that fail."""
    results = []
    for rank in range(num_replicas):
        try:
            results.append(await asyncio.wait_for(call(rank), timeout=30))
        except (asyncio.TimeoutError, *REPLICA_FAILURES) as exc:
            log.warning("replica rank %d did not answer: %s", rank, exc)
    return results


def _json_object(body: bytes) -> dict | None:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _when_sent(response: Response, done) -> Response:
    """`response`, calling `done()` once its body was sent (or the client left)."""
    if not isinstance(response, StreamingResponse):
        done()
        return response
    inner = response.body_iterator

    async def body():
        try:
            async for chunk in inner:
                yield chunk
        finally:
            done()

    response.body_iterator = body()
    return response


async def _bodies(stream):
    try:
        async for message in stream:
            if message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]
    except REPLICA_FAILURES as exc:  # mid-answer: nothing can be retried; the client sees the stream end
        log.warning("replica failed while answering: %s", exc)
    finally:
        stream.cancel()


def _headers(start: dict) -> dict:
    return {bytes(k).decode("latin-1"): bytes(v).decode("latin-1") for k, v in start.get("headers", [])
            if bytes(k).lower() not in (b"content-length", b"transfer-encoding")}


def _error(error: ApiError, retry_after: bool = False) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers={"Retry-After": "1"} if retry_after else None)
