"""The ASGI middleware every HTTP request passes first: body size, API key, admission, counts.

Admission is a bound, not a queue, and it counts engine work, not HTTP requests: up to
`max_concurrent_requests` engine requests are in flight at once (each prompt x choice of a
request, each agent of a `/v1/rounds` counts one; they queue inside the engine's scheduler, which
runs `max_num_seqs` of them per step). A request that would pass the bound is answered 429 at
once with `Retry-After`, so an overloaded server sheds load instead of building an unbounded
backlog of open connections; one larger than the bound counts as half of it (its engine
requests queue in the scheduler, fairly shared between jobs), so it never shuts others out.
"""

from __future__ import annotations

import hashlib
import hmac
import math

from starlette.responses import JSONResponse

from tokendance.server.config import ServerConfig
from tokendance.server.metrics import Metrics
from tokendance.server.protocol import ApiError
from tokendance.server.fleet.routing import GENERATION_PATHS

OPEN_PATHS = ("/health", "/metrics")  # what needs no API key
KNOWN_PATHS = GENERATION_PATHS + ("/v1/models", "/health", "/metrics")
MAX_DRAIN_FACTOR = 8  # an oversized body is read (and dropped) up to this many times the limit


class Admission:
    """Invariant: `in_flight` is the sum of the units (engine requests) that generation requests
    hold between admission and the end of their response (finished, streamed to the end, failed
    or abandoned by the client). A request's units are in its ASGI scope's state."""

    def __init__(self, limit: int, metrics: Metrics):
        self.limit = limit
        self.metrics = metrics
        self.in_flight = 0

    def claim(self, scope, units: int) -> None:
        """Hold `units` for the request (replacing what it held: the gate claims 1 before the body
        is parsed, the handler the request's real size after); ApiError 429 if they do not fit."""
        # A request larger than the bound counts as half of it: its engine requests queue in the
        # scheduler, which shares slots fairly between jobs, so others are admitted beside it.
        if units > self.limit:
            units = max(1, self.limit // 2)
        state = scope.setdefault("state", {})
        held = state.get("admitted_units", 0)
        others = self.in_flight - held
        if others + units > self.limit and (others > 0 or units <= self.limit):
            raise ApiError(429, f"too many concurrent requests (at most {self.limit} prompts, choices and round agents "
                           f"in flight; this request holds {units}); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        state["admitted_units"] = units
        self._set(others + units)

    def release(self, scope) -> None:
        self._set(self.in_flight - scope.get("state", {}).pop("admitted_units", 0))

    def _set(self, in_flight: int) -> None:
        self.in_flight = in_flight
        self.metrics.set("tokendance_requests_in_flight", in_flight)


class Gate:
    def __init__(self, app, config: ServerConfig, metrics: Metrics, admission: Admission):
        self.app = app
        self.config = config
        self.metrics = metrics
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, counted_send)
        finally:
            # 499: the client went away before an answer started (nginx's convention)
            self.metrics.inc("tokendance_http_requests_total", endpoint=_endpoint(scope["path"]),
                             status=str(status.get("code", 499)))

    async def _handle(self, scope, receive, send) -> None:
        # The key first: an unauthenticated client never gets its body read (nor buffered).
        if self.config.api_keys and _needs_key(scope["path"]):
            tenant = self._tenant(scope)
            if tenant is None:
                await _answer(scope, send, ApiError(401, "missing or invalid API key (send 'Authorization: Bearer "
                                                    "<key>')", code="invalid_api_key"))
                return
            scope.setdefault("state", {})["tenant"] = tenant
        body = await read_body(receive, self.config.max_body_bytes)
        if body is None:
            return  # the client disconnected while sending
        if isinstance(body, ApiError):
            await _answer(scope, send, body)
            return
        replay = _replay(body, receive)
        if scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, replay, send)
            return
        try:
            self.admission.claim(scope, 1)
        except ApiError as error:
            await _answer(scope, send, error)
            return
        try:
            await self.app(scope, replay, send)
        finally:
            self.admission.release(scope)

    def _tenant(self, scope) -> str | None:
        return tenant_of([value for name, value in scope["headers"] if name == b"authorization"], self.config.api_keys)


async def read_body(receive, limit: int) -> bytes | ApiError | None:
    """The whole body of an ASGI request, or a 413 error if it is over `limit` bytes (after
    reading and dropping the rest, so the client gets to read the answer), or None if the client
    disconnected."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        data = message.get("body", b"")
        size += len(data)
        if size <= limit:
            chunks.append(data)
        if not message.get("more_body", False) or size > MAX_DRAIN_FACTOR * limit:
            break
    if size > limit:
        return ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    return b"".join(chunks)


def non_finite_field(data) -> str | None:
    """The first place (a dotted path, `body` for the whole) where a parsed JSON body holds NaN or
    an infinity, which Python's parser accepts and JSON has no number for; None if nowhere."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path or "body"
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((f"{path}.{key}" if path else str(key), item) for key, item in reversed(list(items)))
    return None


def tenant_of(authorizations: list[bytes], api_keys: tuple[str, ...]) -> str | None:
    """The tenant of a request's Authorization header's key (a digest of the key, never the key),
    or None if the key is missing or unknown, or if there are several Authorization headers
    (which one a proxy would honour is ambiguous, so none is). Every key is compared, in constant
    time."""
    if len(authorizations) != 1:
        return None
    authorization = authorizations[0]
    tenant = None
    for key in api_keys:
        if hmac.compare_digest(authorization, f"Bearer {key}".encode()):
            tenant = hashlib.sha256(key.encode()).hexdigest()[:16]
    return tenant


def _endpoint(path: str) -> str:
    """The route a path belongs to (a bounded set of metric labels)."""
    if path in KNOWN_PATHS:
        return path
    for prefix, route in (("/v1/models/", "/v1/models/{model}"), ("/v1/agents/", "/v1/agents/{agent_id}")):
        if path.startswith(prefix):
            return route
    return "other"


def _replay(body: bytes, receive):
    """A receive channel that yields the buffered body once, then the client's next messages
    (so a handler can still learn that the client disconnected)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


async def _answer(scope, send, error: ApiError) -> None:
    async def no_receive():
        return {"type": "http.disconnect"}

    await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, no_receive, send)


def _needs_key(path: str) -> bool:
    """Everything but liveness and metrics: the API, and the OpenAPI schema and docs pages."""
    return path not in OPEN_PATHS
