"""`tokendance serve --model <folder or GGUF>` for each supported family (random-weight models
written by transformers, tests/model/families.py): the openai client's chat, a forced tool call in
the family's format (streamed and not) and a round, answered as for the default model."""

from __future__ import annotations

import json

import pytest

from tests.helpers import Server
from tests.model.families import FAMILIES, save_tokenizer, write_family, write_gguf

pytestmark = pytest.mark.model

SERVED = {  # family: (served from, tool-call format)
    "qwen2": ("folder", "hermes"),
    "qwen3": ("gguf", "hermes"),
    "llama-3 (llama3 RoPE)": ("gguf", "llama3_json"),
    "mistral": ("folder", "mistral"),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="module", params=list(SERVED))
def family_server(request, tmp_path_factory, tokenizer, model_weights):
    family = request.param
    folder = tmp_path_factory.mktemp(family.split()[0])
    model = write_family(folder, family, save_tokenizer(tmp_path_factory.mktemp("tokenizer"), tokenizer))
    path, (source, tool_format) = folder, SERVED[family]
    if source == "gguf":
        path = folder / f"{family.split()[0]}.gguf"
        write_gguf(path, model, model_weights, "Q8_0")
    server = Server("--model", str(path), "--gather-window-ms", "0", "--kv-cache-bytes", str(64 << 20),
                    "--tool-call-format", tool_format)
    yield family, server
    server.stop()


def test_family_serves_chat_tools_and_rounds(family_server):
    family, server = family_server
    client = server.client()
    assert server.model.startswith(family.split()[0])
    messages = [{"role": "system", "content": "You are a villager."}, {"role": "user", "content": "Hello there!"}]
    reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens > 0 and reply.choices[0].finish_reason in ("stop", "length")
    ask = dict(model=server.model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
               tool_choice="required", parallel_tool_calls=False, max_tokens=40, temperature=0)
    called = client.chat.completions.create(**ask)
    assert called.choices[0].message.tool_calls, called.choices[0]
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert called.choices[0].finish_reason == "tool_calls"
    streamed = {"name": "", "arguments": "", "content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        streamed["content"] += delta.content or ""
        for piece in delta.tool_calls or []:
            streamed["name"] += piece.function.name or ""
            streamed["arguments"] += piece.function.arguments or ""
    assert streamed == {"name": call.function.name, "arguments": call.function.arguments, "content": ""}
    agents = [{"agent_id": f"v{i}", "messages": [
        {"role": "system", "content": f"You are villager {i}."},
        *({"role": "user", "content": f"Villager {j} said: the bridge needs {j + 2} planks."} for j in range(3)),
        {"role": "user", "content": f"Villager {i}, what do you do next?"}]} for i in range(3)]
    status, body = server.post("/v1/rounds", {"model": server.model, "agents": agents, "max_tokens": 4,
                                              "temperature": 0})
    assert status == 200, body
    assert [o["agent_id"] for o in body["outputs"]] == ["v0", "v1", "v2"]
    assert body["stats"]["num_agents"] == 3 and body["stats"]["shared_compression"] > 1
