"""Request bodies of the OpenAI-compatible API (plus the round extension); their replies are
`server/replies.py`.

Validation happens in layers: the round fields and a round's shape first, by the round protocol
both front doors share (`round_core.protocol`, run on the raw body by `round_rules`), then pydantic
checks presence and types (a 400 naming the field), then `SamplingParams` and the engine check
values (a 400 naming the field, or a code such as `context_length_exceeded`). Fields a client
may send that this server cannot honour (best_of, echo, suffix, ...) are rejected, never
silently ignored, and the error names the field without repeating its value.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from tokendance.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    TokenDanceError,
)
from tokendance.round_core.protocol import (RoundFieldError, check_chat_fields, check_completion_fields,
                                       check_round_request)
from tokendance.sampling import MAX_TOP_LOGPROBS, SamplingParams
from tokendance.tool_formats import ToolFormat
from tokendance.server.tools import HERMES, ToolError, Tools, render_tool_calls, template_tool_calls
from tokendance.structured import StructuredOutput

ROLES = ("system", "user", "assistant", "developer", "tool")
Number = StrictInt | StrictFloat  # JSON numbers only: "0.5" or true are rejected, as OpenAI does
MAX_STOP_STRINGS = 64
MAX_PROMPTS = 128  # prompts in one /v1/completions request
MAX_ECHO = 64  # characters of a client's value repeated in an error message
MAX_N = 16  # choices per request
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs`, as OpenAI caps it
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                   "prompt_logprobs")


class ApiError(Exception):
    """An error answered with an OpenAI-style body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_engine(cls, exc: TokenDanceError, param: str | None = None) -> ApiError:
        """The status and code of an engine error (all of them are the caller's fault)."""
        if isinstance(exc, ContextLengthError):
            return cls(400, str(exc), param=param, code="context_length_exceeded")
        if isinstance(exc, CapacityError):
            return cls(400, str(exc), param=param, code="kv_capacity_exceeded")
        return cls(400, str(exc), param=getattr(exc, "param", None) or param, code="invalid_value")


# ---------------------------------------------------------------- requests


def round_rules(check):
    """A model's "before" validator: `check` (a `round_core.protocol` check) on the raw body, its
    refusal answered as the server's 400. The round fields' annotations below only type what it
    has already checked."""

    def validate(cls, data):
        try:
            check(data)
        except RoundFieldError as exc:  # (an ApiError passes through pydantic to the app's handler)
            raise ApiError(400, exc.message, param=exc.param, code=exc.code) from None
        return data

    return model_validator(mode="before")(classmethod(validate))


def echo(value) -> str:
    """A client's value as an error message may repeat it: bounded."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "..."


def check_text(text: str, param: str) -> str:
    """Strings go to the tokenizer as UTF-8: a lone surrogate (valid as a JSON escape) is a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode (it holds a lone surrogate)", param=param,
                       code="invalid_value") from None
    return text


class SamplingFields(BaseModel):
    """Sampling fields shared by every generation request. `top_k`, `stop_token_ids`,
    `ignore_eos`, `repetition_penalty`, `min_tokens` and `prompt_logprobs` are extensions (vLLM spells them the same
    way). `logit_bias` maps token ids, written as JSON object keys, to biases. Types are strict: a
    number must be a JSON number, a flag a JSON boolean."""

    model_config = ConfigDict(extra="allow")

    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    max_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[StrictInt] | None = Field(default=None, max_length=1024)
    ignore_eos: StrictBool | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    min_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    # structured output: OpenAI's response_format, and vLLM's guided_* extensions
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = Field(default=None, min_length=1, max_length=1024)
    guided_grammar: StrictStr | None = None

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """The one constraint the request asks for, if any, and the field that asked for it."""
        asked = {}
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                asked["response_format"] = StructuredOutput(json_object=True)
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema", {}) if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                                   param="response_format", code="invalid_value")
                asked["response_format"] = schema
            elif kind != "text":
                raise ApiError(400, 'response_format.type must be "text", "json_object" or "json_schema"',
                               param="response_format", code="invalid_value")
        asked.update({name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                             "guided_grammar") if getattr(self, name) is not None})
        if len(asked) > 1:
            raise ApiError(400, f"at most one of response_format and guided_* per request, got {', '.join(asked)}",
                           param=next(iter(asked)), code="invalid_value")
        if not asked:
            return None, None
        (param, value), = asked.items()
        if isinstance(value, StructuredOutput):
            return value, param
        field = {"guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}.get(param, "json")
        try:
            return StructuredOutput(**{field: value}), param
        except InvalidRequestError as exc:
            raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_value") from None

    def sampling_params(self, default_max_tokens: int | None, defaults: dict | None = None, **overrides) -> SamplingParams:
        """`defaults`: the model's sampling (generation_config.json) for the fields the request leaves out."""
        values = {**(defaults or {}), **{k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}}
        values.setdefault("max_tokens", default_max_tokens)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values.get("logit_bias") is not None:
            values["logit_bias"] = token_biases(values["logit_bias"])
        temperature = values.get("temperature")
        if isinstance(temperature, (int, float)) and not 0 <= temperature <= 2:
            raise ApiError(400, f"temperature must be in [0, 2], got {echo(temperature)}", param="temperature",
                           code="invalid_value")
        for stop in [values["stop"]] if isinstance(values.get("stop"), str) else values.get("stop") or []:
            check_text(stop, "stop")
        try:
            return SamplingParams(**values)
        except InvalidRequestError as exc:
            raise ApiError.from_engine(exc) from None

    def check_supported(self) -> None:
        """Reject features this server does not implement instead of ignoring them."""
        extra = self.model_extra or {}
        unsupported = {
            "best_of": lambda v: v not in (None, 1),
            "echo": lambda v: bool(v),
            "suffix": lambda v: v is not None,
            "functions": lambda v: bool(v),
        }
        for name, rejected in unsupported.items():
            if name in extra and rejected(extra[name]):
                raise ApiError(400, f"{name} is not supported by this server", param=name,
                               code="unsupported_parameter")
        if self.prompt_logprobs is not None and getattr(self, "stream", False):
            raise ApiError(400, "prompt_logprobs is not served while streaming", param="prompt_logprobs",
                           code="unsupported_parameter")


def token_biases(logit_bias: dict) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}) with integer keys; a key that is no token id is a 400."""
    biases = {}
    for key, bias in logit_bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise ApiError(400, f"logit_bias keys must be token ids (digits), got {echo(key)}", param="logit_bias",
                           code="invalid_value")
        biases[int(key)] = bias
    return biases


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool result's call
    name: StrictStr | None = None

    def as_dict(self, index: int, tool_format: ToolFormat = HERMES, calls_in_template: bool = False) -> dict:
        if self.role not in ROLES:
            raise ApiError(400, f"messages[{index}].role must be one of {', '.join(ROLES)}",
                           param=f"messages.{index}.role")
        content = self.content
        if isinstance(content, list):
            if not all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, "only text content parts are supported", param=f"messages.{index}.content")
            content = "".join(p["text"] for p in content)
        calls = None
        if self.role == "assistant" and self.tool_calls:
            param = f"messages.{index}.tool_calls"
            try:
                if calls_in_template:
                    calls, content = template_tool_calls(self.tool_calls, param), content or ""
                else:
                    content = (content or "") + render_tool_calls(self.tool_calls, param, tool_format)
            except (ToolError, ValueError) as exc:
                raise ApiError(400, str(exc), param=getattr(exc, "param", param), code="invalid_value") from None
        if content is None:
            raise ApiError(400, f"messages[{index}].content is required", param=f"messages.{index}.content")
        check_text(content, f"messages.{index}.content")
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return message if calls is None else {**message, "tool_calls": calls}


class ChatCompletionRequest(SamplingFields):
    """`agent_id`, `round_id`, `round_size` and `cache_salt` are the round and tenancy extensions
    (`round_core.protocol.check_chat_fields`)."""

    _round_fields = round_rules(check_chat_fields)
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    agent_id: str | None = None
    round_id: str | None = None
    round_size: int | None = None
    cache_salt: str | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True

    def chat_messages(self, tool_format: ToolFormat = HERMES, calls_in_template: bool = False) -> list[dict]:
        return [m.as_dict(i, tool_format, calls_in_template) for i, m in enumerate(self.messages)]

    def tool_set(self, tool_format: ToolFormat = HERMES) -> Tools | None:
        try:
            return Tools.from_request(self.tools, self.tool_choice, tool_format)
        except ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    """No round fields (`round_core.protocol.check_completion_fields`); `cache_salt` is the tenancy extension."""

    _round_fields = round_rules(check_completion_fields)
    model: str
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        prompts = [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}",
                           param="prompt", code="invalid_value")
        return [check_text(p, "prompt") if isinstance(p, str) else p for p in prompts]


class RoundAgent(SamplingFields):
    """One agent of a /v1/rounds request; its sampling fields override the round's. Its shape is
    checked with the round's (`RoundRequest`)."""

    agent_id: str
    messages: list[ChatMessage]
    # The agent's own tenancy (over the round's: `round_core.protocol.turn_salt`): its session and
    # prefix-cache reads and writes in this salt's namespace; shared spans are reused only among
    # the round's agents of one namespace.
    cache_salt: str | None = None


class RoundRequest(SamplingFields):
    """A whole round; its agents, their ids, the fields a round refuses and the salts:
    `round_core.protocol.check_round_request`."""

    _round_shape = round_rules(check_round_request)
    model: str
    agents: list[RoundAgent]
    cache_salt: str | None = None


# ---------------------------------------------------------------- responses
