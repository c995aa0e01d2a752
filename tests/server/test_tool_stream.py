"""Streamed tool calls (model-free): whatever the chunking, the deltas add up to what the whole
reply parses to."""

from __future__ import annotations

import json
import random

import pytest

from tokendance.server.replies import cut_message
from tokendance.server.tool_stream import ToolCallStream
from tokendance.server.tools import Tools, parse_tool_calls

TOOLS = Tools.from_request([{"type": "function", "function": {"name": "get_weather", "parameters": {}}},
                            {"type": "function", "function": {"name": "add", "parameters": {}}}], "auto")
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris \\"}{\\" [x]", "days": [1, {"a": 2}]}}</tool_call>'
REPLIES = [
    "The weather is fine today, no tool needed.",
    CALL,
    f"Let me check.\n{CALL}",
    f'{CALL}\n<tool_call>{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}</tool_call>',
    'A < b and <tool_ is not a call; <tool_call>{"name": "unknown", "arguments": {}}</tool_call> stays.',
    '<tool_call>{"arguments": {}, "name": "add"}</tool_call> has the keys the other way round',
    f"{CALL} and then some words after",
    "trailing space kept when no call   ",
]


def streamed(reply: str, seed: int) -> tuple[str | None, list[dict]]:
    """The reply fed in random pieces; returns (content, tool_calls) as a client accumulates them."""
    rng, stream, content, calls, position = random.Random(seed), ToolCallStream(TOOLS), "", [], 0
    while position < len(reply):
        size = rng.randint(1, 6)
        piece, position = reply[position:position + size], position + size
        delta = stream.feed(piece, finished=position >= len(reply))
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["id"].startswith("call_") and call["function"]["name"]
                calls.append({"name": call["function"]["name"], "arguments": ""})
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content or None, calls


@pytest.mark.parametrize("reply", REPLIES)
@pytest.mark.parametrize("seed", range(5))
def test_streamed_deltas_add_up_to_the_parsed_reply(reply, seed):
    expected_content, expected_calls = parse_tool_calls(reply, TOOLS)
    content, calls = streamed(reply, seed)
    assert content == expected_content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
           [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected_calls]


def test_content_streams_before_the_reply_finishes_and_arguments_in_pieces():
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Let me check the weather", False) == {"content": "Let me check the weather"}
    assert stream.feed(" <tool", False) == {}  # " " and "<tool" may still belong to a call
    opened = stream.feed('_call>{"name": "get_weather", "arguments": {"ci', False)["tool_calls"]
    assert opened[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert stream.feed('ty": "Oslo"', False) == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"'}}]}
    assert stream.feed("}}</tool_call>", True) == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}


@pytest.mark.parametrize("reply", [r for r in REPLIES if "<tool_call>" in r])
@pytest.mark.parametrize("seed", range(3))
def test_a_reply_cut_anywhere_answers_what_its_stream_sent(reply, seed):
    """Cut at any character (max_tokens), the whole reply's message is what its stream added up to:
    content outside calls, each opened call with its arguments as far as they were written."""
    cut = reply[:random.Random(seed).randint(1, len(reply) - 1)]
    content, calls = streamed(cut, seed)
    message = cut_message(cut, TOOLS)
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == \
           [(c["name"], c["arguments"]) for c in calls]
