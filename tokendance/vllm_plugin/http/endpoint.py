"""The HTTP side of the plugin for `vllm serve` (a `vllm.endpoint_plugins` entry point, loaded when
`VLLM_PLUGINS` names `tokendance`):

- `RoundFields`, a middleware: a chat or completions body with `tokendance serve`'s round fields
  (`agent_id`, `round_id`, `round_size`) is rewritten for the connector: the fields go into
  `kv_transfer_params.tokendance`, and the request gets the agent's own cache salt (within the
  client's `cache_salt`, which also names the round's namespace). Existing clients and
  `tokendance bench --target URL --declare-rounds` work unchanged against `vllm serve`. With the
  connector's `transparent_rounds`, it also gathers chat requests that name no round into rounds
  (`http/gathering.py`). A round tag the client wrote itself (`kv_transfer_params.tokendance`) is
  checked in any request body, whatever its route: every route vLLM has that forwards
  `kv_transfer_params` (chat, completions, responses, `/v1/messages`, `/cohere/v2/chat`,
  `/inference/v1/generate`) and any it adds.
- `POST /v1/rounds`: a whole round in one request, as `tokendance serve` answers it. Each agent's
  turn is one chat request to this same server (through the middleware), all at once.

Both speak `tokendance serve`'s round protocol (`tokendance/round_core/protocol.py`): its checks run on
vLLM's body before vLLM reads it, so a mistake gets the same 400 (message, `param`, `code`) through
either door; the agent's own `cache_salt` over the round's; the same answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from tokendance.convergence import repeated_replies
from tokendance.round_core.protocol import (RESERVED_AGENT_PREFIXES, ROUND_FIELDS, RoundFieldError, agent_output,
                                       agent_salt, check_chat_fields, check_completion_fields, check_round_request,
                                       round_answer, turn_salt, turn_usage)
from tokendance.vllm_plugin.http.gathering import Gathering
from tokendance.vllm_plugin.scheduler.members import RoundParamsError, RoundTag
from tokendance.vllm_plugin.settings import Settings

TAGGED_PATHS = ("/v1/chat/completions", "/v1/completions")
GUARDED_PATHS = (*TAGGED_PATHS, "/v1/responses", "/v1/rounds")
ROUND_ONLY = ("agents", "cache_salt")  # /v1/rounds fields that are not chat fields
FORM_TYPES = (b"multipart/form-data", b"application/x-www-form-urlencoded")  # no JSON object, no tag

logger = logging.getLogger("tokendance.vllm")


def tag_body(body: dict, chat: bool = True) -> dict:
    """The body with its round fields moved where the connector reads them, once the round protocol
    has checked them (`check_chat_fields`; on a completion, `chat` False, `check_completion_fields`
    refuses them). A RoundFieldError names the field refused, also in a tag the client wrote itself
    (`kv_transfer_params.tokendance`, which the connector would otherwise only log before computing
    the request exactly). A round member without an agent_id is an agent of its own, keeping no
    session (as in `tokendance serve`)."""
    (check_chat_fields if chat else check_completion_fields)(body)
    fields = {name: body.pop(name) for name in ROUND_FIELDS if body.get(name) is not None}
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and "tokendance" in params:
        check_own_tag(params, body.get("cache_salt"), fields)
    if not fields:
        return body
    round_id, size, salt = fields.get("round_id"), fields.get("round_size"), body.get("cache_salt")
    agent_id = fields.get("agent_id") or f"anonymous-{uuid.uuid4().hex}"  # (no agent_id: a round_id, checked)
    body["cache_salt"] = agent_salt(agent_id, salt)
    if round_id is not None:
        params = body.get("kv_transfer_params") or {}
        if not isinstance(params, dict):
            raise RoundFieldError("kv_transfer_params must be an object", "kv_transfer_params")
        tag = {"round_id": round_id, "agent_id": agent_id, "namespace": salt or ""}
        if size is not None:
            tag["round_size"] = size
        body["kv_transfer_params"] = {**params, "tokendance": tag}
    return body


def check_own_tag(params: dict, salt, fields: dict) -> None:
    """A round tag the client wrote (the plugin's own door: `tokendance serve` has no
    `kv_transfer_params`): refused with the field named if the connector could not use it."""
    param = "kv_transfer_params.tokendance"
    if isinstance(params["tokendance"], dict) and "transparent" in params["tokendance"]:
        raise RoundFieldError(f"{param}.transparent is the server's own (a gathered member); declare a round with "
                              f"{', '.join(ROUND_FIELDS)} instead", param)
    if fields:
        raise RoundFieldError(f"give a round either as {', '.join(ROUND_FIELDS)} or as {param}, not both", param)
    agent_id = params["tokendance"].get("agent_id") if isinstance(params["tokendance"], dict) else None
    if isinstance(agent_id, str) and agent_id.startswith(RESERVED_AGENT_PREFIXES):
        raise RoundFieldError(f"{param}.agent_id may not start with {' or '.join(RESERVED_AGENT_PREFIXES)}: the "
                              "server names its own agents so", param)
    try:
        RoundTag.parse(params)
    except RoundParamsError as exc:
        raise RoundFieldError(str(exc), param) from None
    if not isinstance(salt, str) or not salt:
        raise RoundFieldError(f"a request with {param} needs a cache_salt of the agent's own (reused KV is read "
                              "back only under it)", "cache_salt")


def own_tag_error(body) -> RoundFieldError | None:
    """Why the round tag a client wrote itself (`kv_transfer_params.tokendance`) is refused (None:
    it has none, or the connector can use it), in a body of any route: vLLM forwards
    `kv_transfer_params` from many, and will from more."""
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if not isinstance(params, dict) or "tokendance" not in params:
        return None
    try:
        check_own_tag(params, body.get("cache_salt"), {n: body[n] for n in ROUND_FIELDS if body.get(n) is not None})
    except RoundFieldError as exc:
        return exc
    return None


def error_body(message: str, param: str | None, code: str | int = 400) -> bytes:
    """An error as vLLM answers one (its code: the status), or as the round protocol does."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": code}}).encode()


def refusal_body(exc: RoundFieldError) -> bytes:
    return error_body(exc.message, exc.param, exc.code)


def too_deep(body) -> str | None:
    """The field of a body nesting deeper than a JSON parser's recursion allows: the body itself
    (""), or a tool call's `arguments` string, which vLLM parses while it renders the prompt (and
    answered 500 for). None if there is none."""
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            arguments = value.get("arguments")
            if isinstance(arguments, str):
                try:
                    json.loads(arguments)
                except RecursionError:
                    return f"{path}.arguments".lstrip(".")
                except ValueError:
                    pass
            stack += [(v, f"{path}.{k}") for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{path}.{i}") for i, v in enumerate(value)]
    return None


class RoundFields:
    """ASGI middleware on every HTTP request with a body: rewrites tagged chat/completions bodies
    (see `tag_body`); refuses, with a 400 naming the field, a round tag the client wrote itself that
    the connector could not use, on any route (`own_tag_error`), and a body of the JSON endpoints
    nesting too deeply (`too_deep`); with transparent rounds on (`endpoint.gathering`), gathers
    chat requests that name no round into rounds and reads what chat replies wrote. Everything
    else passes untouched."""

    def __init__(self, app, endpoint: "RoundsEndpoint | None" = None):
        self.app = app
        self.endpoint = endpoint

    async def __call__(self, scope, receive, send):
        content_type = dict(scope.get("headers") or []).get(b"content-type", b"")
        if scope["type"] != "http" or content_type.lower().startswith(FORM_TYPES):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw) if raw else None
        except RecursionError:
            return await _reply(send, 400, error_body("the body nests too deeply", None))
        except ValueError:
            body = None
        refused = own_tag_error(body)
        if refused is not None:
            return await _reply(send, 400, refusal_body(refused))
        if scope["method"] != "POST" or scope["path"] not in GUARDED_PATHS:
            return await self.app(scope, replay_of(raw, receive), send)
        deep = too_deep(body)
        if deep is not None:
            return await _reply(send, 400, error_body(f"{deep or 'the body'} nests too deeply", deep or None))
        chat = scope["path"] == "/v1/chat/completions"
        gathering = self.endpoint.gathering if self.endpoint is not None and chat else None
        if gathering is None:
            return await self._send_on(scope, receive, send, raw, body, None)
        with gathering.serving():  # until its answer ends: a request that comes meanwhile is not alone
            return await self._send_on(scope, receive, send, raw, body, gathering)

    async def _send_on(self, scope, receive, send, raw: bytes, body, gathering):
        """A guarded route's body, its round fields checked and moved (held first, where the
        gathering holds it), on to vLLM."""
        chat = scope["path"] == "/v1/chat/completions"
        if scope["path"] in TAGGED_PATHS and isinstance(body, dict):
            try:
                if gathering is not None and gathering.may_join(body):
                    tag_body(dict(body))  # a malformed field is refused before the request waits
                    admitted = await until_disconnected(receive, gathering.admit(body))
                    if admitted is None:  # its client left while it was held: it left its round before it formed
                        return
                    if admitted is not body:  # a round member, tagged by the gathering
                        raw, body = json.dumps(admitted).encode(), {}
                rewrite = any(name in body for name in ROUND_FIELDS) or "kv_transfer_params" in body
                tagged = tag_body(body, chat=chat)  # every body's round fields are checked
                if rewrite:
                    raw = json.dumps(tagged).encode()
            except RoundFieldError as exc:
                return await _reply(send, 400, refusal_body(exc))
        if gathering is not None:
            send = gathering.reading_replies(send)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        return await self.app(scope, replay_of(raw, receive), send)


def replay_of(raw: bytes, receive):
    """An ASGI receive that gives the body read already, then what the client sends next."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return replay


async def until_disconnected(receive, work):
    """`work`'s answer, or None once the client has left (`receive`: the request's ASGI receive):
    `work` is then cancelled (a held chat leaves the gathering; a round's agents' loopback
    connections close, and vLLM aborts a request whose client is gone). The body has been read, so
    what the client sends next can only be its disconnect."""
    task = asyncio.ensure_future(work)

    async def left() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(left())
    done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    for pending in (task, watch):
        pending.cancel()
    return task.result() if task in done else None


async def _reply(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def connector_settings(config) -> Settings | None:
    """The TokenDance connector's settings in vLLM's `--kv-transfer-config` (an object, a dict or
    its JSON), None if it names another connector or none."""
    if isinstance(config, str):
        config = json.loads(config)
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    if get("kv_connector") != "TokenDanceConnector":
        return None
    return Settings.from_extra(get("kv_connector_extra_config"))


_TRANSPARENT_COUNTER = None


def transparent_counter():
    """`vllm:tokendance_transparent_requests_total{outcome}` on the API server's /metrics: chat
    requests passed at once, held and sent as round members or alone, and rounds formed."""
    global _TRANSPARENT_COUNTER
    if _TRANSPARENT_COUNTER is None:
        from prometheus_client import Counter

        _TRANSPARENT_COUNTER = Counter("vllm:tokendance_transparent_requests",
                                       "transparent rounds: chat requests by outcome (passed: not held, alone "
                                       "at the endpoint or not what the rule holds; member; "
                                       "alone: held, no round; left: its client left while held), and rounds "
                                       "formed (outcome rounds)", ["outcome"])
    return _TRANSPARENT_COUNTER


class RoundsEndpoint:
    """`vllm.endpoint_plugins` entry point: the middleware and `POST /v1/rounds`."""

    name = "tokendance"
    required_tasks = ("generate",)

    def __init__(self):
        self.base_url = None
        self.model_name = None  # the first name vLLM serves the model under, as /v1/rounds answers it
        self.gathering: Gathering | None = None  # transparent rounds (the connector's `transparent_rounds`)

    def attach_router(self, app) -> None:
        app.add_middleware(RoundFields, endpoint=self)

        @app.post("/v1/rounds")
        async def rounds(request: Request):
            try:
                body = await request.json()
            except ValueError:
                return JSONResponse(json.loads(error_body("the body is not JSON", None)), status_code=400)
            try:
                requests = round_requests(body)
            except RoundFieldError as exc:
                return JSONResponse(json.loads(refusal_body(exc)), status_code=400)
            authorization = request.headers.get("authorization")
            return await until_disconnected(request.receive, self._run_round(body, requests, authorization))

    async def init_state(self, engine_client, state, args) -> None:
        host = getattr(args, "host", None) or "127.0.0.1"
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.base_url = f"http://{host}:{getattr(args, 'port', 8000)}"
        names = getattr(args, "served_model_name", None) or [getattr(args, "model", None)]
        self.model_name = names if isinstance(names, str) else names[0]
        settings = connector_settings(getattr(args, "kv_transfer_config", None))
        if settings is not None and settings.transparent_rounds:
            self.gathering = Gathering(settings.gather_window_s, settings.round_timeout_s, settings.transparent_rule,
                                       metric=transparent_counter())
            if (getattr(args, "api_server_count", None) or 1) > 1:
                logger.warning("TokenDance transparent rounds: each of the %d API server processes gathers the "
                               "requests it receives alone; a round forms only among those", args.api_server_count)

    async def _run_round(self, body: dict, requests: list[dict], authorization: str | None):
        """Every agent's turn as a chat request to this server, all at once. An agent's 4xx refuses
        the round, as `tokendance serve` refuses a round with a bad agent; an agent that fails
        otherwise fails alone (its entry carries the error)."""
        import httpx

        started = time.perf_counter()
        headers = {"authorization": authorization} if authorization else {}
        async with httpx.AsyncClient(base_url=self.base_url, timeout=None, headers=headers) as client:
            replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=r) for r in requests),
                                           return_exceptions=True)
        for i, reply in enumerate(replies):
            if isinstance(reply, Exception) and not isinstance(reply, httpx.HTTPError):
                raise reply
            if isinstance(reply, httpx.Response) and 400 <= reply.status_code < 500:
                return JSONResponse(agent_refusal(reply.json(), body, i), status_code=reply.status_code)
        answers = [reply.json() if isinstance(reply, httpx.Response) and reply.status_code == 200
                   else failure_of(reply) for reply in replies]
        return JSONResponse(round_response(requests[0]["round_id"], self.model_name, requests, answers,
                                           time.perf_counter() - started))


def round_requests(body) -> list[dict]:
    """One chat body per agent, once the round protocol has checked the round
    (`check_round_request`): the round's fields, the agent's over them, its messages, and the
    round fields the middleware turns into the connector's tag."""
    check_round_request(body)
    round_id = f"round-{uuid.uuid4().hex}"
    shared = {k: v for k, v in body.items() if k not in ROUND_ONLY}
    requests = []
    for i, agent in enumerate(body["agents"]):
        request = {**shared, **agent, "round_id": round_id, "round_size": len(body["agents"])}
        salt = turn_salt(body.get("cache_salt"), agent.get("cache_salt"))
        if salt is not None:
            request["cache_salt"] = salt
        try:
            tag_body(dict(request))  # the plugin's own rules (a tag of the client's), before any agent runs
        except RoundFieldError as exc:
            raise RoundFieldError(exc.message, f"agents.{i}.{exc.param}", exc.code) from None
        requests.append(request)
    return requests


def agent_refusal(content, body: dict, index: int):
    """An agent's refused chat request as the round's answer: the field named where the client
    wrote it, in the agent (`agents.i.max_tokens`) or in the round (`max_tokens`), as `tokendance
    serve` names it."""
    error = content.get("error") if isinstance(content, dict) else None
    if isinstance(error, dict):
        param = error.get("param")
        field = param.split(".")[0] if isinstance(param, str) else None
        if field is None or field in body["agents"][index] or field not in body:
            error["param"] = f"agents.{index}.{param}" if param else f"agents.{index}"
    return content


def failure_of(reply) -> str:
    """Why an agent's chat request failed (an exception, or a reply other than 200 or 4xx)."""
    if isinstance(reply, Exception):
        return f"{type(reply).__name__}: {reply}"
    try:
        message = reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = reply.text[:200]
    return f"{reply.status_code}: {message}"


def round_response(round_id: str, model: str, requests: list[dict], answers: list[dict | str],
                   seconds: float) -> dict:
    """The round's answer (`round_protocol.round_answer`) from each agent's chat answer, or why it
    failed (a str). The stats the connector keeps inside vLLM's engine (computed and reused tokens,
    KV bytes, compression, waves, round TTFT) are null here; its /metrics has them."""
    entries = []
    for request, answer in zip(requests, answers):
        if isinstance(answer, str):
            entries.append(agent_output(request["agent_id"], "", None, turn_usage(None, None, None), failure=answer))
            continue
        choice, usage = answer["choices"][0], answer.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        entries.append(agent_output(request["agent_id"], choice["message"].get("content") or "",
                                    choice["finish_reason"],
                                    turn_usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), cached)))
    prompt = [e["usage"]["prompt_tokens"] for e in entries]
    stats = {"mode": "vllm+tokendance", "num_agents": len(entries), "round_seconds": seconds,
             "prompt_tokens": None if None in prompt else sum(prompt),
             "repeated_replies": repeated_replies([e["message"]["content"] for e in entries])}
    return round_answer(round_id, model, entries, stats)
