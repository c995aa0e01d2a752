"""OpenAI's Responses API (`POST /v1/responses`), stateless, over the chat pipeline.

A request is turned into the chat request it means (`instructions` as a system message, input
items as messages, function tools, `text.format` as `response_format`), served like any chat
(rounds, sessions and shared KV included), and its reply turned back into output items: a
`message` with `output_text`, and `function_call` items. Nothing is stored: `store` is accepted
but ignored, and `previous_response_id` is refused. Streaming sends the typed events of the API
(`response.created`, `response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`), each with its `sequence_number`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from tokendance.outputs import RequestOutput
from tokendance.server.protocol import ApiError, ChatCompletionRequest, Number
from tokendance.server.replies import chat_message
from tokendance.server.tool_stream import tool_stream
from tokendance.server.tools import Tools

UNSUPPORTED = {  # field -> values that are fine (the defaults); anything else is a 400
    "previous_response_id": (None,), "conversation": (None,), "background": (None, False), "reasoning": (None,),
    "include": (None, []), "prompt": (None,), "truncation": (None, "disabled"), "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}
EXTENSIONS = ("top_k", "seed", "agent_id", "round_id", "round_size", "cache_salt")  # passed to the chat request
IGNORED = ("store", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The fields of a Responses request this server serves; the chat extensions (`top_k`, `seed`,
    `agent_id`, `round_id`, `round_size`, `cache_salt`) pass through."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: StrictStr | list[dict[str, Any]] = Field(min_length=1)
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    text: dict[str, Any] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None

    def check_supported(self) -> None:
        extra = self.model_extra or {}
        for name, fine in UNSUPPORTED.items():
            if extra.get(name) not in fine:
                raise ApiError(400, f"{name} is not supported by this server (responses are not stored)"
                               if name in ("previous_response_id", "conversation") else
                               f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        unknown = sorted(set(extra) - set(UNSUPPORTED) - set(IGNORED) - set(EXTENSIONS))
        if unknown:
            raise ApiError(400, f"unknown parameter: {unknown[0]}", param=unknown[0], code="unknown_parameter")

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this response means; errors name the Responses field."""
        body = {"model": self.model, "messages": self._messages(), "stream": self.stream,
                "parallel_tool_calls": self.parallel_tool_calls}
        for name, chat_name in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                                ("top_p", "top_p")):
            if getattr(self, name) is not None:
                body[chat_name] = getattr(self, name)
        body.update({name: value for name, value in (self.model_extra or {}).items() if name in EXTENSIONS})
        if self.tools:
            body["tools"] = [chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if self.text is not None and self.text.get("format") is not None:
            body["response_format"] = response_format(self.text["format"])
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = response_param(".".join(str(part) for part in first.get("loc", ("input",))[:1]))
            raise ApiError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param) from None

    def _messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            messages.append(input_message(item, f"input.{i}", messages))
        return [m for m in messages if m is not None]


def input_message(item: dict, param: str, messages: list[dict]) -> dict | None:
    """One input item as a chat message (a function call joins the assistant message before it,
    as chat writes parallel calls: None then)."""
    kind = item.get("type", "message")
    if kind == "message" and item.get("role") in ROLES:
        return {"role": item["role"], "content": item_text(item.get("content"), f"{param}.content")}
    if kind == "function_call":
        name, arguments = item.get("name"), item.get("arguments", "{}")
        if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(item.get("call_id"), str):
            raise ApiError(400, f"{param}: a function_call needs string call_id, name and arguments", param=param,
                           code="invalid_value")
        call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
            last["tool_calls"].append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else item_text(output, f"{param}.output")
        if not isinstance(item.get("call_id"), str):
            raise ApiError(400, f"{param}: a function_call_output needs a string call_id", param=param,
                           code="invalid_value")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": text}
    if kind == "message":
        raise ApiError(400, f"{param}.role must be one of {', '.join(ROLES)}", param=f"{param}.role",
                       code="invalid_value")
    raise ApiError(400, f"{param}.type {kind!r:.40} is not supported (message, function_call and "
                   "function_call_output are)", param=f"{param}.type", code="unsupported_parameter")


def item_text(content, param: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{param} must be a string or a list of text parts", param=param, code="invalid_value")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{param}.{j}: only text parts are supported ({', '.join(TEXT_PARTS)})",
                           param=f"{param}.{j}", code="unsupported_parameter")
        texts.append(part["text"])
    return "".join(texts)


def chat_tool(tool: dict, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ApiError(400, f"tools[{i}].type {kind!r:.40} is not supported (function tools are)",
                       param=f"tools.{i}.type", code="unsupported_parameter")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                           param="tool_choice", code="invalid_value")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(fmt) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                       "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ApiError(400, 'text.format.type must be "text", "json_object" or "json_schema"', param="text.format",
                   code="invalid_value")


# ---------------------------------------------------------------- the response


def response_param(param: str | None) -> str | None:
    """A chat error's field as the Responses request names it."""
    if param is None:
        return None
    for chat_name, name in (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                            ("max_tokens", "max_output_tokens"), ("response_format", "text.format")):
        if param == chat_name or param.startswith(chat_name + "."):
            return name
    return param


def response_body(key: str, body: ResponsesRequest, created: int, status: str, output: list[dict],
                  result: RequestOutput | None = None) -> dict:
    """The Response object; `result` (the finished reply) gives usage and why it is incomplete."""
    response = {
        "id": key, "object": "response", "created_at": created, "status": status, "model": body.model,
        "output": output, "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls, "text": body.text or {"format": {"type": "text"}},
        "metadata": body.metadata or {}, "store": False, "usage": None,
    }
    if result is not None:
        response["usage"] = {
            "input_tokens": result.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.num_cached_tokens},
            "output_tokens": result.num_generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.num_prompt_tokens + result.num_generated_tokens}
        if result.finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        elif result.finish_reason == "error":
            response["error"] = {"code": "server_error", "message": f"the engine failed ({result.error})"}
    return response


def final_status(result: RequestOutput) -> str:
    return {"length": "incomplete", "error": "failed"}.get(result.finish_reason, "completed")


def output_items(result: RequestOutput, tools: Tools | None) -> list[dict]:
    """A finished reply as output items: its text as a message, then its calls."""
    message, _ = chat_message(result, tools)
    items = []
    if message.get("content"):
        items.append(message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed"))
    for call in message.get("tool_calls", []):
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
    return items


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseEvents:
    """The typed events of one streamed response, built from its text deltas (and, with tools,
    its streamed calls). Invariant: `items` are the output items sent so far, the last one open
    while `open` is set."""

    def __init__(self, key: str, body: ResponsesRequest, tools: Tools | None):
        self.key, self.body, self.created = key, body, int(time.time())
        self.calls = tool_stream(tools) if tools is not None else None
        self.items: list[dict] = []
        self.open = False
        self.sequence = 0

    def head(self) -> list[dict]:
        response = response_body(self.key, self.body, self.created, "in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def render(self, _index: int, text: str, result: RequestOutput) -> list[dict]:
        delta = self.calls.feed(text, result.finished) if self.calls is not None else {"content": text}
        events = []
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls", []):
            events += self._call(call)
        if result.finished:
            events += self._close()
            status = final_status(result)
            name = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status,
                                                                                              "response.failed")
            response = response_body(self.key, self.body, self.created, status, self.items, result)
            events.append(self._event(name, response=response))
        return events

    def _text(self, text: str) -> list[dict]:
        events = []
        if not (self.open and self.items[-1]["type"] == "message"):
            events += self._close()
            item = message_item(f"msg_{uuid.uuid4().hex}", None, "in_progress")
            events += self._add(item)
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part=dict(item["content"][0])))
        self.items[-1]["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                  logprobs=[]))
        return events

    def _call(self, call: dict) -> list[dict]:
        events = []
        if "id" in call:  # a call opens
            events += self._close()
            events += self._add(call_item(call["id"], call["function"]["name"], "", "in_progress"))
        arguments = call["function"]["arguments"]
        if arguments:
            self.items[-1]["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = True
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _close(self) -> list[dict]:
        if not self.open:
            return []
        self.open, item, where = False, self.items[-1], self._where()
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                      logprobs=[]))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        else:
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["arguments"]))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        return events

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return json.loads(json.dumps({"type": kind, "sequence_number": self.sequence - 1, **fields}))
