"""The plugin's tool parser `tokendance_hermes` against vLLM's `hermes`, both as vLLM's chat
endpoint builds them (`ParserManager`, the model folder's tokenizer): a forced call's grammar
(compiled by xgrammar, as vLLM's structured output backend does) holds the call to one line and
refuses pretty-printed arguments, and a reply cut at max_tokens keeps its complete calls."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

TOOLS = [{"type": "function", "function": {"name": "create_post", "description": "Create a post.",
                                           "parameters": {"type": "object", "properties": {"content": {"type": "string"}},
                                                          "required": ["content"]}}},
         {"type": "function", "function": {"name": "like_post",
                                           "parameters": {"type": "object", "properties": {"post_id": {"type": "integer"}},
                                                          "required": ["post_id"]}}},
         {"type": "function", "function": {"name": "do_nothing"}}]
LIKE = '<tool_call>{"name": "like_post", "arguments": {"post_id": 3}}</tool_call>'
CUT = '<tool_call>{"name": "create_post", "arguments": {"content": "Bridges ne'  # max_tokens ran out here


@pytest.fixture(scope="module")
def tokenizer(model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))


def chat_parser(name: str, tokenizer):
    """The parser vLLM's chat endpoint uses with `--enable-auto-tool-choice --tool-call-parser name`."""
    from vllm.parser.parser_manager import ParserManager
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as every vLLM process does: registers `tokendance_hermes`
    return ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, tokenizer=tokenizer)(tokenizer, TOOLS)


def adjusted(name: str, tokenizer, tool_choice: str = "required"):
    """(parser, the request after the parser adjusted it) for a chat with TOOLS."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    parser = chat_parser(name, tokenizer)
    request = ChatCompletionRequest(model="smollm2", messages=[{"role": "user", "content": "Pick an action."}],
                                    tools=TOOLS, tool_choice=tool_choice)
    return parser, parser.adjust_request(request)


def test_a_forced_call_has_one_line_form_with_whitespace_capped(tokenizer):
    _, request = adjusted("tokendance_hermes", tokenizer)
    tags = json.loads(request.structured_outputs.structural_tag)["format"]["tags"]
    assert [t["begin"] for t in tags] == [f'<tool_call>{{"name": "{t["function"]["name"]}", "arguments": '
                                          for t in TOOLS]
    assert {t["end"] for t in tags} == {"}</tool_call>"}
    assert {t["content"]["max_whitespace_cnt"] for t in tags} == {1}
    _, hermes = adjusted("hermes", tokenizer)  # vLLM's own: a second, newline form of each
    assert len(json.loads(hermes.structured_outputs.structural_tag)["format"]["tags"]) == 2 * len(TOOLS)


def test_auto_without_strict_tools_stays_unconstrained(tokenizer):
    _, request = adjusted("tokendance_hermes", tokenizer, tool_choice="auto")
    assert request.structured_outputs is None


@pytest.mark.parametrize("reply, hermes, compact", [
    (LIKE, True, True),
    (LIKE + LIKE, True, True),
    ('<tool_call>{"name": "create_post", "arguments": {"content": "Ropes  hold.\\n\\nOk"}}</tool_call>', True, True),
    ('<tool_call>{"name": "like_post", "arguments": {\n  "post_id": 3\n}}</tool_call>', True, False),
    ('<tool_call>\n{"name": "like_post", "arguments": {"post_id": 3}}\n</tool_call>', True, False),
], ids=["call", "two-calls", "spaces-in-a-string", "pretty-printed", "newline-form"])
def test_the_grammar_refuses_pretty_printed_arguments(tokenizer, compiler, reply, hermes, compact):
    import xgrammar as xgr

    for name, accepted in (("hermes", hermes), ("tokendance_hermes", compact)):
        _, request = adjusted(name, tokenizer)
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(request.structured_outputs.structural_tag))
        assert (matcher.accept_string(reply) and matcher.is_completed()) == accepted, name


def test_a_reply_cut_at_max_tokens_keeps_its_complete_call(tokenizer):
    parser, request = adjusted("tokendance_hermes", tokenizer)
    _, content, calls = parser.parse("Liking it. " + LIKE + CUT, request, enable_auto_tools=True)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("like_post", {"post_id": 3})]
    assert content == "Liking it. "  # the text before the first block, as vLLM gives it
    hermes, request = adjusted("hermes", tokenizer)  # vLLM's own drops the whole reply
    assert hermes.parse(LIKE + CUT, request, enable_auto_tools=True)[2] is None


def test_a_reply_without_a_complete_call_is_content(tokenizer):
    parser, request = adjusted("tokendance_hermes", tokenizer, tool_choice="auto")
    assert parser.parse(CUT, request, enable_auto_tools=True)[1:] == (CUT, None)
