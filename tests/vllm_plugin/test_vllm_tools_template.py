"""The model folder vLLM serves renders a request's tools as `tokendance serve` does: the same
prompt text through either door, with tools, earlier calls and tool results, and without tools."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

TOOLS = [{"type": "function", "function": {"name": "follow", "description": "Follow a user.",
                                           "parameters": {"type": "object", "properties": {"followee_id": {"type": "integer"}},
                                                          "required": ["followee_id"]}}},
         {"type": "function", "function": {"name": "do_nothing"}}]  # no description, no parameters
CHAT = [{"role": "system", "content": "You are Ann, a user of a social network."},
        {"role": "user", "content": "Your feed: Bob posted \"Bridges need rope.\" Pick an action."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "follow", "arguments": "{\"followee_id\": 7}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"success\": true}"},
        {"role": "user", "content": "Anything else? Ünïcode stays as it is."}]


def served_by_tokendance(messages: list[dict], tools: list[dict] | None) -> str:
    from tokendance.model.loader import load_tokenizer
    from tokendance.server.protocol import ChatMessage
    from tokendance.server.tools import Tools, render_messages

    rendered = [ChatMessage(**m).as_dict(i) for i, m in enumerate(messages)]
    return load_tokenizer().apply_chat_template(render_messages(rendered, Tools.from_request(tools, None) if tools else None))


def served_by_vllm(folder, messages: list[dict], tools: list[dict] | None) -> str:
    """As vLLM's chat endpoint renders a HF template: an assistant's call arguments decoded first."""
    import json

    from transformers import AutoTokenizer

    decoded = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                    for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    return AutoTokenizer.from_pretrained(folder).apply_chat_template(decoded, tools=tools, add_generation_prompt=True,
                                                                     tokenize=False)


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_both_doors_render_the_same_prompt(model_folder, tools):
    chat = CHAT if tools else CHAT[:2]
    got = served_by_vllm(model_folder, chat, tools)
    assert got == served_by_tokendance(chat, tools)
    if tools:
        # the preamble names the tags and gives an example; the earlier call
        assert got.count("<tool_call>") == 3 and '"name": "do_nothing"' in got and "followee_id\": 7" in got


def test_a_folder_written_before_tools_gets_the_tool_aware_template(model_folder, tmp_path):
    import shutil

    from tokendance.vllm_plugin.model_folder import default_model_folder

    old = tmp_path / "smollm2"
    shutil.copytree(model_folder, old)
    template = old / "chat_template.jinja"
    own = template.read_text().split("{%- set messages = rendered.messages -%}\n")[-1]
    template.write_text(own)
    assert default_model_folder(old) == old and "tools" in template.read_text()
    assert served_by_vllm(old, CHAT, TOOLS) == served_by_vllm(model_folder, CHAT, TOOLS)
