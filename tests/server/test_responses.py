"""`POST /v1/responses` through the openai SDK's `client.responses` against a real server: text,
instructions, streaming events, function tools and their outputs, `text.format`, and 400s that
name the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from openai.lib._pydantic import to_strict_json_schema


WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"]}}
INSTRUCTIONS = "You are a terse assistant."


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server


def test_text_response_equals_the_chat_reply(server):
    client = server.client()
    response = client.responses.create(model=server.model, instructions=INSTRUCTIONS, input="Name three rivers.",
                                       max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=server.model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name three rivers."}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    assert response.status == {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # message items as input (text parts), as frameworks send a conversation
    again = client.responses.create(model=server.model, max_output_tokens=12, temperature=0, input=[
        {"role": "system", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name three rivers."}]}])
    assert again.output_text == response.output_text


def test_streamed_events_add_up_to_the_response(server):
    client = server.client()
    fields = dict(model=server.model, instructions=INSTRUCTIONS, input="Describe a lighthouse.", max_output_tokens=20,
                  temperature=0)
    whole = client.responses.create(**fields)
    kinds, deltas = [], []
    with client.responses.stream(**fields) as stream:  # the SDK's helper checks the events' order and ids
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        # a response cut by max_output_tokens ends with response.incomplete, which the helper does not finalize
        final = stream.get_final_response() if whole.status == "completed" else event.response
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    assert final.output_text == whole.output_text == "".join(deltas) and len(deltas) > 3
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    raw = list(client.responses.create(**fields, stream=True))
    assert [e.sequence_number for e in raw] == list(range(len(raw)))


def test_function_calls_stream_and_their_outputs_go_back_in(server):
    client = server.client()
    fields = dict(model=server.model, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                  temperature=0, max_output_tokens=60)
    response = client.responses.create(**fields)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    pieces = []
    with client.responses.stream(**fields) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
        (streamed,) = [i for i in stream.get_final_response().output if i.type == "function_call"]
    assert len(pieces) > 2 and json.loads("".join(pieces)) == json.loads(streamed.arguments) == json.loads(call.arguments)
    follow = client.responses.create(model=server.model, tools=[WEATHER], tool_choice="none", temperature=0,
                                     max_output_tokens=30, input=[
                                         {"role": "user", "content": "What is the weather in Paris?"},
                                         {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                          "arguments": call.arguments},
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": "Sunny, 21 degrees."}])
    assert [item.type for item in follow.output] == ["message"] and "<tool_call>" not in follow.output_text


class City(pydantic.BaseModel):  # bounded fields: a complete object always fits in max_output_tokens
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)


class Census(pydantic.BaseModel):  # an unbounded integer: sampled, its digits can run to the token limit
    name: str
    population: int


def test_text_format_is_constrained_exactly_as_chats_response_format(server):
    """`parse` through responses and through chat sample the same constraint: with the same seed
    they write the same text (a parse that fails on one fails on the other)."""
    client = server.client()
    schema = {"type": "json_schema", "name": "Census", "strict": True, "schema": to_strict_json_schema(Census)}
    for seed in range(3):
        chat = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Describe the city of Lyon."}], seed=seed,
            max_tokens=40, response_format={"type": "json_schema", "json_schema": {
                k: v for k, v in schema.items() if k != "type"}})
        response = client.responses.create(model=server.model, input="Describe the city of Lyon.", text={
            "format": schema}, max_output_tokens=40, extra_body={"seed": seed})
        assert response.output_text == chat.choices[0].message.content


def test_text_format_json_schema_through_the_sdks_parse(server):
    parsed = server.client().responses.parse(model=server.model, input="Describe the city of Lyon.", text_format=City,
                                             temperature=0, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, City)


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"input": []}, "input"),
])
def test_bad_responses_are_400_naming_the_field(server, fields, param):
    body = {"model": server.model, "input": "hi", **fields}
    status, error = server.post("/v1/responses", body)
    assert status == 400, error
    assert error["error"]["param"] == param
    known = {k: v for k, v in body.items() if k != "frobnicate"}
    with pytest.raises(openai.BadRequestError):
        server.client().responses.create(**known, extra_body={k: v for k, v in body.items() if k not in known})


def test_chat_extensions_pass_through(server):
    status, error = server.post("/v1/responses", {"model": server.model, "input": "hi", "seed": "7"})
    assert status == 400 and error["error"]["param"] == "seed"
    response = server.client().responses.create(model=server.model, input="Say one word.", max_output_tokens=4,
                                                 extra_body={"top_k": 1, "cache_salt": "x", "agent_id": "ada"})
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens >= 1
