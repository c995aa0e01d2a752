"""The families' tool-call formats (no model): parsing whole replies, writing earlier calls back,
the held stream for formats without closing tags, and the format picked from a chat template."""

from __future__ import annotations

import json

import pytest

from tokendance.tool_formats import FORMATS, detect
from tokendance.server.tool_stream import tool_stream
from tokendance.server.tools import Tools, parse_tool_calls, render_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

REPLIES = {  # format: [(reply, expected content, expected [(name, arguments)])]
    "hermes": [
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', None,
         [("get_weather", {"city": "Paris"})]),
        ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me check.",
         [("get_weather", {"city": "Rome"}), ("get_time", {})]),
        ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', None, None),  # unknown tool: content
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", '
         '"parameters": {}}', None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
        ('It is {"name": "get_weather"} I think', None, None),  # not a reply that is a call
        ('{"name": "get_weather", "parameters": {"city": "Paris"}} and more', None, None),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
         [("get_weather", {"city": "Paris"})]),
        ('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
         '{"name": "get_time", "arguments": {}}]', "Checking.", [("get_weather", {"city": "Rome"}), ("get_time", {})]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": "Paris"}]', None, None),  # arguments not an object
    ],
}
CASES = [(name, *case) for name, cases in REPLIES.items() for case in cases]


def tools_in(format_name: str) -> Tools:
    return Tools.from_request([WEATHER, TIME], "auto", FORMATS[format_name])


@pytest.mark.parametrize("format_name, reply, content, calls", CASES)
def test_replies_parse_in_their_format(format_name, reply, content, calls):
    got_content, got_calls = parse_tool_calls(reply, tools_in(format_name))
    if calls is None:
        assert got_calls == [] and got_content == reply
        return
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls


@pytest.mark.parametrize("format_name, reply, content, calls", CASES)
def test_streamed_replies_give_what_whole_replies_give(format_name, reply, content, calls):
    """Fed a few characters at a time, the stream sends the same content and calls as parsing the
    whole reply; nothing of a call leaks into the content first."""
    tools = tools_in(format_name)
    stream, sent, streamed_calls = tool_stream(tools), "", []
    for start in range(0, len(reply), 3):
        delta = stream.feed(reply[start:start + 3], start + 3 >= len(reply))
        sent += delta.get("content", "")
        streamed_calls += delta.get("tool_calls", [])
    whole_content, whole_calls = parse_tool_calls(reply, tools)
    assert sent.strip() == (whole_content or "").strip()
    names = [c["function"]["name"] for c in streamed_calls if "name" in c["function"]]
    assert names == [c["function"]["name"] for c in whole_calls]


@pytest.mark.parametrize("format_name", list(FORMATS))
def test_earlier_calls_are_written_back_in_the_format(format_name):
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    text = render_tool_calls(calls, format=FORMATS[format_name])
    _, parsed = parse_tool_calls(text, tools_in(format_name))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]


@pytest.mark.parametrize("format_name", list(FORMATS))
def test_forced_call_grammars_accept_the_formats_calls(format_name, tokenizer):
    """The grammar of tool_choice "required" (parallel) accepts calls as the format writes them."""
    import llguidance

    from tokendance.structured import GrammarCompiler

    tools = Tools.from_request([WEATHER, TIME], "required", FORMATS[format_name])
    grammar = tools.constraint(parallel=True).llguidance_grammar
    compiler = GrammarCompiler(tokenizer, (2,))
    matcher = llguidance.LLMatcher(compiler._llguidance_tokenizer(), grammar, log_level=0)
    text = FORMATS[format_name].render([("get_weather", {"city": "Oslo"}), ("get_time", {})])
    for token in tokenizer.encode(text):
        assert matcher.consume_token(token), (format_name, text)
    assert matcher.is_accepting()


@pytest.mark.parametrize("template, expected", [
    ("{{ '<|im_start|>' }}{% if tools %}<tool_call>{% endif %}", "hermes"),
    ("{{ '<|start_header_id|>' }}{{ '<|python_tag|>' }}", "llama3_json"),
    ('<|start_header_id|>{"name": function name, "parameters": dictionary}', "llama3_json"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    (None, "hermes"),
])
def test_the_format_is_picked_from_the_chat_template(template, expected):
    assert detect(template).name == expected
