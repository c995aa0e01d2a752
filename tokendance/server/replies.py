"""Response shapes of the OpenAI-compatible API (plus the round extension): usage, logprobs,
chat and completion bodies, round results and server-sent events."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from tokendance.outputs import RequestOutput
from tokendance.round_core.protocol import STATS_FIELDS, agent_output, round_answer
from tokendance.sampling import TokenLogprobs
from tokendance.server.tool_stream import tool_stream
from tokendance.server.tools import Tools, parse_tool_calls


def usage(outputs: list[RequestOutput], n: int = 1) -> dict:
    """Token counts of a request's choices; with n choices per prompt, each prompt counts once
    (outputs are prompt-major: every prompt's n choices in a row)."""
    prompt = sum(o.num_prompt_tokens for o in outputs[::n])
    completion = sum(o.num_generated_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs[::n])},
    }


TokenText = Callable[[int], str]  # a token id's text


def chat_logprobs(entries: list[TokenLogprobs], token_text: TokenText, hidden: frozenset[int] = frozenset()) -> dict:
    """OpenAI's chat `logprobs`; the `hidden` tokens (EOS: not part of the content) are left out."""
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries if e.token_id not in hidden]}


def completion_logprobs(entries: list[TokenLogprobs], token_text: TokenText, offset: int = 0,
                        hidden: frozenset[int] = frozenset()) -> dict:
    entries = [e for e in entries if e.token_id not in hidden]
    tokens = [token_text(e.token_id) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def prompt_logprobs_field(output: RequestOutput, token_text: TokenText | None) -> dict:
    """vLLM's `prompt_logprobs` of a choice, when asked: per prompt token (None for the first), a
    map from token id to {logprob, rank, decoded_token} holding the prompt token and the most
    likely alternatives."""
    if output.prompt_logprobs is None or token_text is None:
        return {}

    def position(entry) -> dict | None:
        if entry is None:
            return None
        found = {str(t): {"logprob": lp, "rank": rank + 1, "decoded_token": token_text(t)}
                 for rank, (t, lp) in enumerate(entry.top)}
        found[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                      "decoded_token": token_text(entry.token_id)}
        return found

    return {"prompt_logprobs": [position(entry) for entry in output.prompt_logprobs]}


def chat_message(output: RequestOutput, tools: Tools | None) -> tuple[dict, str | None]:
    """The assistant message of a choice and its finish reason (tool calls parsed out)."""
    message = {"role": "assistant", "content": output.text}
    if tools is not None:
        if output.finish_reason == "length":  # cut: a call as far as it was written, as a stream sends it
            return cut_message(output.text, tools), "length"
        content, calls = parse_tool_calls(output.text, tools)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            return message, "tool_calls" if output.finish_reason == "stop" else output.finish_reason
        if tools.forced:  # what there is is markup, not content
            message["content"] = None
    return message, output.finish_reason


def cut_message(text: str, tools: Tools) -> dict:
    """A reply cut by max_tokens, with tools: what its stream would have sent, as one message: the
    content outside calls (none when a call is forced) and each call opened, its arguments as far
    as they were written (not valid JSON)."""
    delta = tool_stream(tools).feed(text, finished=True)
    message = {"role": "assistant", "content": delta.get("content") or None}
    if delta.get("tool_calls"):
        message["tool_calls"] = [{key: value for key, value in call.items() if key != "index"}
                                 for call in delta["tool_calls"]]
    return message


def chat_response(request_id: str, model: str, outputs: list[RequestOutput], round_info: dict | None,
                  tools: Tools | None = None, token_text: TokenText | None = None,
                  hidden: frozenset[int] = frozenset()) -> dict:
    choices = []
    for i, output in enumerate(outputs):
        message, finish_reason = chat_message(output, tools)
        logprobs = chat_logprobs(output.logprobs, token_text, hidden) if token_text and output.logprobs else None
        scored = output if output.prompt_logprobs is not None else outputs[0]  # choices share the first's
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                        **prompt_logprobs_field(scored, token_text)})
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(outputs, len(outputs)),
    }
    if round_info is not None:
        body["round"] = round_info
    return body


def completion_response(request_id: str, model: str, outputs: list[RequestOutput], n: int = 1,
                        token_text: TokenText | None = None, hidden: frozenset[int] = frozenset()) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": o.text, "finish_reason": o.finish_reason,
             "logprobs": completion_logprobs(o.logprobs, token_text, 0, hidden) if token_text and o.logprobs else None,
             **prompt_logprobs_field(o if o.prompt_logprobs is not None else outputs[i - i % n], token_text)}
            for i, o in enumerate(outputs)
        ],
        "usage": usage(outputs, n),
    }


def round_output(agent_id: str, output: RequestOutput) -> dict:
    """One agent's entry of a round's answer (`round_protocol.agent_output`)."""
    failure = str(output.error) if output.finish_reason == "error" else None
    return agent_output(agent_id, output.text, output.finish_reason, usage([output]), failure)


def round_response(request_id: str, model: str, agent_ids: list[str], outputs: list[RequestOutput],
                   index: int, stats) -> dict:
    """The /v1/rounds answer, in the shape both front doors give (`round_protocol.round_answer`)."""
    return round_answer(request_id, model, [round_output(a, o) for a, o in zip(agent_ids, outputs)],
                        {name: getattr(stats, name) for name in STATS_FIELDS}, index)


def sse(data: dict | str) -> str:
    """One server-sent event; dicts are JSON-encoded."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
