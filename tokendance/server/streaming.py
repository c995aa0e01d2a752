"""Server-sent events: cumulative engine outputs turned into OpenAI-style deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from tokendance.outputs import RequestOutput
from tokendance.server.protocol import ApiError, sse
from tokendance.server.sink import Sink


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


Render = Callable[[int, str, RequestOutput], dict | None]  # None: nothing to send yet


async def events(sink: Sink, deltas: TextDeltas, render: Render,
                 tail: Callable[[list[RequestOutput]], dict] | None = None) -> AsyncIterator[str]:
    """One event per choice that got new text or finished, then `tail(outputs)` (the usage
    chunk), then [DONE]. An engine error becomes an error event. Nothing goes out before the first
    generated text: a client that times its first token at the first chunk (vLLM's `bench serve`
    does) measures the real time to first token."""
    try:
        async for changed in sink.updates():
            for index in changed:
                output = sink.outputs[index]
                text = deltas.next(index, output)
                if text or output.finished:
                    event = render(index, text, output)
                    if event is not None:
                        yield sse(event)
    except ApiError as error:
        yield sse(error.body())
    else:
        if tail is not None:
            yield sse(tail([sink.outputs[i] for i in range(sink.num_choices)]))
    yield sse("[DONE]")


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
