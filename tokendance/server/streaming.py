"""Server-sent events: cumulative engine outputs turned into OpenAI-style deltas (chat and
completion chunks)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from tokendance.outputs import RequestOutput
from tokendance.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from tokendance.server.replies import TokenText, chat_logprobs, completion_logprobs, sse, usage
from tokendance.server.sink import Sink
from tokendance.server.tool_stream import tool_stream
from tokendance.server.tools import Tools


class TextDeltas:
    """Cuts cumulative texts into deltas, holding back what may still change before the request
    finishes: a trailing incomplete UTF-8 character, and with stop strings the last
    len(longest stop) - 1 characters (a stop string found later is cut from the text). Invariant:
    the deltas sent for a choice concatenate to a prefix of its final text."""

    def __init__(self, stops: tuple[str, ...]):
        self.holdback = max(map(len, stops), default=1) - 1
        self.sent: dict[int, str] = {}

    def next(self, index: int, output: RequestOutput) -> str:
        sent, text = self.sent.get(index, ""), output.text
        if not output.finished:
            text = text.rstrip("\ufffd")
            text = text[: max(0, len(text) - self.holdback)]
        if len(text) <= len(sent) or not text.startswith(sent):
            return ""
        self.sent[index] = text
        return text[len(sent):]


Render = Callable[[int, str, RequestOutput], list[dict]]  # the events for a choice's new text (maybe none)


async def events(sink: Sink, deltas: TextDeltas, render: Render, head: list[dict] = (),
                 tail: Callable[[list[RequestOutput]], dict] | None = None) -> AsyncIterator[str]:
    """The `head` events (a Responses stream's `response.created`), then the events of each choice
    that got new text or finished, then `tail(outputs)` (the usage chunk), then [DONE]. An engine
    error becomes an error event. A chat or completion stream sends nothing before the first
    generated text: a client that times its first token at the first chunk (vLLM's `bench serve`
    does) measures the real time to first token."""
    for event in head:
        yield sse(event)
    try:
        async for changed in sink.updates():
            for index in changed:
                output = sink.outputs[index]
                text = deltas.next(index, output)
                if text or output.finished:
                    for event in render(index, text, output):
                        yield sse(event)
    except ApiError as error:
        yield sse(error.body())
    else:
        if tail is not None:
            yield sse(tail([sink.outputs[i] for i in range(sink.num_choices)]))
    yield sse("[DONE]")


def chat_chunks(key: str, model: str, sink: Sink, body: ChatCompletionRequest, tools: Tools | None,
            token_text: TokenText, hidden: frozenset[int]) -> tuple[Render, Callable | None]:
    """Content deltas as they come (with the logprobs of their tokens); with tools, tool calls
    are cut out of the content and their arguments stream as `tool_calls` deltas."""
    created = int(time.time())
    reported: dict[int, int] = {}  # tokens whose logprobs went out, per choice
    streams: dict[int, ToolCallStream] = {}
    opened: set[int] = set()

    def chunk(index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
        return {"id": key, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish_reason}]}

    def render(index: int, text: str, output: RequestOutput) -> list[dict]:
        logprobs, finish_reason = None, output.finish_reason
        if output.logprobs:
            done = reported.get(index, 0)
            reported[index] = len(output.logprobs)
            logprobs = chat_logprobs(output.logprobs[done:], token_text, hidden)
        if tools is None:
            delta = {"content": text} if text else {}
        else:
            stream = streams.setdefault(index, tool_stream(tools))
            delta = stream.feed(text, output.finished)
            if not delta and not output.finished and not logprobs:
                return []  # held back: it may be the start of a call
            if stream.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if index not in opened:  # a choice's first chunk carries the role with its first text
            opened.add(index)
            delta = {"role": "assistant", "content": "", **delta}
        body = chunk(index, delta, finish_reason, logprobs)
        if output.finished and 0 in sink.round_info:
            body["round"] = sink.round_info[0]
        return [body]

    def tail(outputs):
        return {**chunk(0, {}), "choices": [], "usage": usage(outputs, len(outputs))}

    include_usage = body.stream_options and body.stream_options.include_usage
    return render, tail if include_usage else None

def completion_chunks(key: str, model: str, body: CompletionRequest, token_text: TokenText,
                  hidden: frozenset[int]) -> tuple[Render, Callable | None]:
    created = int(time.time())
    reported: dict[int, tuple[int, int]] = {}  # per choice: tokens whose logprobs went out, text offset

    def render(index: int, text: str, output: RequestOutput) -> list[dict]:
        logprobs = None
        if output.logprobs:
            done, offset = reported.get(index, (0, 0))
            logprobs = completion_logprobs(output.logprobs[done:], token_text, offset, hidden)
            reported[index] = (len(output.logprobs), offset + sum(map(len, logprobs["tokens"])))
        return [{"id": key, "object": "text_completion", "created": created, "model": model,
                 "choices": [{"index": index, "text": text, "logprobs": logprobs,
                              "finish_reason": output.finish_reason}]}]

    def tail(outputs):
        return {"id": key, "object": "text_completion", "created": created, "model": model,
                "choices": [], "usage": usage(outputs, body.n)}

    return render, tail if body.stream_options and body.stream_options.include_usage else None


class EventStream(StreamingResponse):
    """An SSE response that calls `on_close` however it ends: finished, failed, or abandoned by
    the client, even before the first event (when the body iterator never starts)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
