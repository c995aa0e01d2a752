"""The FastAPI application: routes, validation before anything reaches the engine, error bodies.

Every error is answered as {"error": {"message", "type", "param", "code"}} with its status; no
input can stop the server. Prompts are validated on a worker thread (tokenizing a long prompt
must not stall the event loop), then handed to the engine thread as a job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from contextlib import asynccontextmanager

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from tokendance.errors import TokenDanceError
from tokendance.model.platform import describe_machine
from tokendance.outputs import RequestOutput
from tokendance.reuse.segments import chat_token_ids
from tokendance.server.config import ServerConfig
from tokendance.server.engine_loop import (
    EngineLoop,
    GenerateJob,
    TurnJob,
    WholeRoundJob,
)
from tokendance.server.gate import Admission, Gate
from tokendance.round_core.gathering import ChatTurn, RoundGatherer
from tokendance.server.metrics import Metrics
from tokendance.server.protocol import (
    SAMPLING_FIELDS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    RoundRequest,
    echo,
)
from tokendance.server.replies import chat_response, completion_response, round_response
from tokendance.tool_formats import FORMATS as TOOL_FORMATS
from tokendance.tool_formats import Hermes
from tokendance.tool_formats import detect as detect_tool_format
from tokendance.server.tools import render_messages, template_tools
from tokendance.server.responses import (
    ResponseEvents,
    ResponsesRequest,
    final_status,
    output_items,
    response_body,
    response_param,
)
from tokendance.server.fleet.routing import agent_key, cache_namespace
from tokendance.server.sink import Sink
from tokendance.structured import StructuredOutput
from tokendance.server.streaming import EventStream, TextDeltas, chat_chunks, completion_chunks, events

log = logging.getLogger("tokendance.server")
UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def create_app(llm, config: ServerConfig) -> FastAPI:
    """The app over an already loaded `LLM`; its engine thread runs while the app is served."""
    metrics = Metrics()
    loop = EngineLoop(llm, RoundGatherer(config.gather_window_s, config.round_timeout_s), metrics)

    @asynccontextmanager
    async def lifespan(_app):
        loop.start()
        yield
        loop.stop()

    app = FastAPI(title="TokenDance", lifespan=lifespan, docs_url=None, redoc_url=None)
    admission = Admission(config.max_concurrent_requests, metrics)
    api = Api(llm, config, loop, metrics, admission)
    app.api_route("/health", methods=["GET", "HEAD"])(api.health)  # load balancers probe with HEAD
    app.get("/metrics")(api.metrics_text)
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model:path}")(api.model)
    app.post("/v1/chat/completions")(api.chat)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/responses")(api.responses)
    app.post("/v1/rounds")(api.rounds)
    app.delete("/v1/agents/{agent_id:path}")(api.end_agent)  # any id, "/" included, can be deleted
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(Gate, config=config, metrics=metrics, admission=admission)
    app.state.engine_loop = loop
    app.state.config = config
    return app


class Api:
    def __init__(self, llm, config: ServerConfig, loop: EngineLoop, metrics: Metrics, admission: Admission):
        self.llm = llm
        self.admission = admission
        self.engine = llm.engine
        self.config = config
        self.loop = loop
        self.metrics = metrics
        self.created = int(time.time())
        self._hidden = frozenset(self.engine.model_config.eos_token_ids)  # in logprobs, not in content
        self.tool_format = (detect_tool_format(llm.tokenizer.chat_template) if config.tool_call_format == "auto"
                            else TOOL_FORMATS[config.tool_call_format])
        # A hermes template that renders tools and calls itself (Qwen's) gets them as transformers
        # and vLLM pass them: the prompt the model was trained on, the same through both doors.
        tokenizer = llm.tokenizer  # None where the app is built without a model (its OpenAPI schema)
        self.calls_in_template = tokenizer is not None and tokenizer.knows_tools and self.tool_format.name == "hermes"
        self.marker_tokens = {} if tokenizer is None else {
            text: token for text in (Hermes.OPEN, Hermes.CLOSE) if (token := tokenizer.token_to_id(text)) is not None}

    # ------------------------------------------------------------ plain routes

    async def health(self):
        if not self.loop.is_alive:
            return JSONResponse({"status": "engine stopped", "error": str(self.loop.error)}, status_code=503)
        c = self.engine.config
        return {"status": "ok", **self._machine(), "reuse": c.reuse, "recompute_ratio": c.recompute_ratio,
                "fidelity": c.fidelity_name, "batch_invariant": c.batch_invariant, "warnings": c.warnings}

    async def metrics_text(self):
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str):
        self._check_model(model)
        return self._model_card()

    async def end_agent(self, agent_id: str, request: Request, cache_salt: str = ""):
        """Drop an agent's session (its KV); 404 if it has none."""
        name = agent_key(_namespace(request, cache_salt), agent_id)
        running, ended = await self.loop.call(lambda: (self.llm.rounds.is_running(name), self.llm.end_agent(name)))
        if not ended:
            raise ApiError(404, f"agent {echo(agent_id)} has no session", param="agent_id", code="agent_not_found")
        # in a running round: its turn finishes, then its KV is dropped instead of kept
        return {"agent_id": agent_id, "object": "agent.deleted", "deleted": True, "after_round": running}

    # ------------------------------------------------------------ generation

    async def chat(self, body: ChatCompletionRequest, request: Request):
        started = time.perf_counter()
        self._check_model(body.model)
        key = f"chatcmpl-{uuid.uuid4().hex}"
        sink, params, tools = await self._start_chat(body, request, key)
        if body.stream:
            render, tail = chat_chunks(key, self.config.model_name, sink, body, tools, self._token_text, self._hidden)
            return self._stream(sink, started, params.stop_strings, render, tail)
        outputs = await self._collect(request, sink, started)
        return chat_response(key, self.config.model_name, outputs, sink.round_info.get(0), tools, self._token_text,
                             self._hidden)

    async def responses(self, body: ResponsesRequest, request: Request):
        """OpenAI's Responses API over the chat pipeline (stateless)."""
        started = time.perf_counter()
        self._check_model(body.model)
        body.check_supported()
        key = f"resp_{uuid.uuid4().hex}"
        try:
            sink, params, tools = await self._start_chat(body.chat_request(), request, key)
        except ApiError as exc:
            exc.param = response_param(exc.param)
            raise
        if body.stream:
            stream = ResponseEvents(key, body, tools)
            return self._stream(sink, started, params.stop_strings, stream.render, None, stream.head())
        (output,) = await self._collect(request, sink, started)
        return response_body(key, body, int(time.time()), final_status(output), output_items(output, tools), output)

    async def _start_chat(self, body: ChatCompletionRequest, request: Request, key: str):
        """Validate a chat request (its round fields are, as it was read) and hand it to the engine
        thread: (sink, params, tools)."""
        body.check_supported()
        self.admission.claim(request.scope, body.n)
        tools = body.tool_set(self.tool_format)
        structured, structured_param = body.structured_output()
        if tools is not None and tools.forced:
            if structured is not None:
                raise ApiError(400, "a forced tool_choice cannot be combined with response_format or guided_*",
                               param="tool_choice")
            structured, structured_param = tools.constraint(body.parallel_tool_calls, self.marker_tokens), "tools"
        no_calls = tools is None and (body.tools or any(m.tool_calls for m in body.messages))
        if no_calls and structured is None:  # the model answers in words where it would have called
            structured, structured_param = StructuredOutput(grammar=self.tool_format.text_grammar()), "tool_choice"
        await self._compile(structured, structured_param)
        messages = render_messages(body.chat_messages(self.tool_format, self.calls_in_template), tools,
                                   self.calls_in_template)
        described = template_tools(tools) if tools and self.calls_in_template else None
        params = self._sampling(body, None, max_tokens=body.max_completion_tokens, structured=structured,
                                logprobs=body.num_logprobs())
        marker = self.tool_format.marker
        if no_calls and marker and structured_param != "tool_choice":  # under response_format: no markup as content
            params = dataclasses.replace(params, stop=[*params.stop_strings, marker])
        namespace = _namespace(request, body.cache_salt)
        sink = Sink(key, body.n, constraint_param=structured_param)
        if body.n == 1:
            prepared = await self._validate(lambda: self._chat_request(messages, params, key, namespace, tools=described),
                                            "messages")
            turn = ChatTurn(key, messages, prepared.sampling_params, prepared, sink, namespace=namespace,
                            agent_id=body.agent_id, round_id=body.round_id, round_size=body.round_size,
                            arrival=time.monotonic(), tools=described)
            may_join = (body.agent_id or body.round_id or self.config.gather_window_s > 0) and \
                params.prompt_logprobs is None  # scored prompts are computed whole, never in a round
            self.loop.submit(TurnJob(turn) if may_join else GenerateJob([prepared], sink))
        else:
            requests = await self._validate(
                lambda: [self._chat_request(messages, params.choice(i), f"{key}-{i}", namespace, group=key, tools=described)
                         for i in range(body.n)], "messages")
            self.loop.submit(GenerateJob(requests, sink, share_prompt=True))
        return sink, params, tools

    async def completions(self, body: CompletionRequest, request: Request):
        started = time.perf_counter()
        self._check(body)
        structured, structured_param = body.structured_output()
        await self._compile(structured, structured_param)
        params = self._sampling(body, 16, structured=structured, logprobs=body.logprobs)
        key, namespace = f"cmpl-{uuid.uuid4().hex}", _namespace(request, body.cache_salt)
        prompts, n = body.prompts(), body.n
        self.admission.claim(request.scope, len(prompts) * n)
        requests = await self._validate(
            lambda: [self.engine.make_request(p, params.choice(c), f"{key}-{i * n + c}", namespace, group=key)
                     for i, p in enumerate(prompts) for c in range(n)],
            "prompt",
        )
        sink = Sink(key, len(requests), constraint_param=structured_param)
        self.loop.submit(GenerateJob(requests, sink, share_prompt=n > 1))
        if body.stream:
            render, tail = completion_chunks(key, self.config.model_name, body, self._token_text, self._hidden)
            return self._stream(sink, started, params.stop_strings, render, tail)
        outputs = await self._collect(request, sink, started)
        return completion_response(key, self.config.model_name, outputs, n, self._token_text, self._hidden)

    async def rounds(self, body: RoundRequest, request: Request):
        """A whole round in one request (its shape checked as it was read): every agent's reply and
        the round's statistics."""
        started = time.perf_counter()
        self._check(body)
        agent_ids = [a.agent_id for a in body.agents]
        self.admission.claim(request.scope, len(agent_ids))
        key, namespace = f"round-{uuid.uuid4().hex}", _namespace(request, body.cache_salt)
        sink = Sink(key, len(agent_ids), wants_stats=True)
        turns = []
        for i, agent in enumerate(body.agents):
            try:
                agent.check_supported()
                messages = [m.as_dict(j, self.tool_format, self.calls_in_template) for j, m in enumerate(agent.messages)]
            except ApiError as exc:
                exc.param = f"agents.{i}.{exc.param}"
                raise
            structured, structured_param = agent.structured_output()
            if structured is None:
                structured, structured_param = body.structured_output()
            await self._compile(structured, structured_param and f"agents.{i}.{structured_param}")
            try:
                params = self._sampling(body, None, structured=structured,
                                        **{k: getattr(agent, k) for k in SAMPLING_FIELDS})
            except ApiError as exc:
                if exc.param and getattr(agent, exc.param, None) is not None:  # the agent's own value
                    exc.param = f"agents.{i}.{exc.param}"
                raise
            agent_namespace = _namespace(request, agent.cache_salt) if agent.cache_salt else namespace
            prepared = await self._validate(
                lambda: self._chat_request(messages, params, f"{key}-{i}", agent_namespace), f"agents.{i}.messages")
            turns.append(ChatTurn(key, messages, prepared.sampling_params, prepared, sink, index=i,
                                  namespace=agent_namespace, agent_id=agent.agent_id))
        self.loop.submit(WholeRoundJob(turns))
        outputs = await self._collect(request, sink, started)
        return round_response(key, self.config.model_name, agent_ids, outputs, sink.round_info[0]["index"], sink.stats)

    # ------------------------------------------------------------ helpers

    def _sampling(self, body, fallback_max_tokens: int | None, **overrides):
        """The request's sampling: the model's defaults for what it leaves out, then the server's
        max_tokens policy (`default_max_tokens` where it sends none, refused above `max_tokens_limit`)."""
        fallback = self.config.default_max_tokens if fallback_max_tokens is None else fallback_max_tokens
        limit = self.config.max_tokens_limit
        if limit is not None:
            fallback = limit if fallback is None else min(fallback, limit)
        params = body.sampling_params(fallback, self.engine.sampling_defaults, **overrides)
        if limit is not None and params.max_tokens > limit:
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
            raise ApiError(400, f"{param} is {params.max_tokens}; this server generates at most {limit} tokens "
                                "per request (--max-tokens-limit)", param=param, code="invalid_value")
        return params

    def _model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": self.created,
                "owned_by": "tokendance", "max_model_len": self.engine.max_model_len, **self._machine()}

    def _machine(self) -> dict:
        return describe_machine(self.engine.dtype, self.engine.cpu)

    async def _compile(self, structured, param: str | None) -> None:
        """A constraint compiled (and kept) before the request is queued: its errors name its field."""
        if structured is not None:
            await self._validate(lambda: self.engine.grammars.matcher(structured), param)

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise ApiError(404, f"model {echo(model)} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    def _check(self, body) -> None:
        self._check_model(body.model)
        body.check_supported()

    def _chat_request(self, messages, params, request_id: str, namespace: str, group: str | None = None,
                      tools: list[dict] | None = None):
        """Messages tokenized one by one (as rounds do), so a request gives the same ids whether it
        joins a round or not, and a shared message the same ids wherever it sits; `tools` for a
        template that renders them."""
        self.engine.check_chat_size(messages)
        token_ids = chat_token_ids(self.engine.tokenizer, messages, tools)
        if params.max_tokens is None:  # "as long as it likes": up to the context window or the KV pool
            room = min(self.engine.max_model_len, self.engine.num_kv_tokens) - len(token_ids)
            params = dataclasses.replace(params, max_tokens=max(1, room))
        return self.engine.make_request(token_ids, params, request_id=request_id, namespace=namespace, group=group)

    async def _validate(self, make, param: str):
        try:
            return await asyncio.to_thread(make)
        except TokenDanceError as exc:
            raise ApiError.from_engine(exc, param) from None
        except jinja2.TemplateError as exc:
            raise ApiError(400, f"the chat template rejected the messages: {exc}", param=param) from None

    async def _collect(self, request: Request, sink: Sink, started: float) -> list[RequestOutput]:
        """Every choice's final output; aborts the requests if the client disconnects first."""
        result = asyncio.ensure_future(sink.final())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()
                self.loop.abort(sink)
        if not result.done() or result.cancelled():
            raise ApiError(499, "the client closed the request", code="client_closed_request")
        outputs = result.result()
        self._observe(sink, started)
        return outputs

    def _stream(self, sink: Sink, started: float, stops: tuple[str, ...], render, tail, head=()) -> EventStream:
        def on_close() -> None:
            if sink.done:
                self._observe(sink, started)
            else:
                self.loop.abort(sink)

        return EventStream(events(sink, TextDeltas(stops), render, head, tail), on_close)

    def _observe(self, sink: Sink, started: float) -> None:
        now = time.perf_counter()
        self.metrics.observe("tokendance_request_latency_seconds", now - started)
        if sink.first_output_time is not None:
            self.metrics.observe("tokendance_time_to_first_token_seconds", sink.first_output_time - started)


def _namespace(request: Request, cache_salt: str | None) -> str:
    return cache_namespace(request.scope.get("state", {}).get("tenant"), cache_salt)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------- error bodies


async def _api_error(_request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _validation_error(_request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    location = []
    for part in first.get("loc", ())[1:]:  # loc[0] is "body"
        if str(part) in UNION_TAGS or "[" in str(part):
            break  # pydantic names the union member it tried; the field is what the caller sent
        location.append(str(part))
    if first.get("type") == "json_invalid":
        message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    elif not location:
        message, param = f"the body must be a JSON object ({first.get('msg', 'invalid')})", None
    else:
        message, param = f"{'.'.join(location)}: {first.get('msg', 'invalid value')}", ".".join(location)
    return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)


async def _http_error(_request, exc: HTTPException) -> JSONResponse:
    error = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _internal_error(_request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse(ApiError(500, f"internal error: {exc}", type="server_error").body(), status_code=500)
