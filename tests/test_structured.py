"""Structured output (JSON schema, JSON object, regex, choice), logprobs, n and tool calling: in
the engine, and through a real server driven by the official `openai` client."""

from __future__ import annotations

import json
import re
import string

import jsonschema
import openai
import pytest

from tokendance import SamplingParams
from tokendance.errors import InvalidRequestError
from tokendance.structured import GrammarCompiler, StructuredOutput

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

# 20 schemas of varied shape; strings and arrays bounded so a small model cannot run past max_tokens
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "angry", "calm"]}}, "required": ["mood"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"],
     "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "country": {"type": "string", "maxLength": 20}},
     "required": ["city", "country"]},
    {"type": "object", "properties": {"plan": {"type": "array", "maxItems": 3, "minItems": 1,
                                               "items": {"type": "object", "properties": {
                                                   "step": {"type": "integer"},
                                                   "action": {"type": "string", "maxLength": 20}},
                                                   "required": ["step", "action"]}}},
     "required": ["plan"]},
    {"type": "object", "properties": {"speaker": {"const": "Ada"}, "text": {"type": "string", "maxLength": 40}},
     "required": ["speaker", "text"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
     "required": ["value"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "string", "maxLength": 30},
    {"type": "integer", "minimum": 1, "maximum": 5},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"location": {"type": "object", "properties": {
        "lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat", "lon"]}},
     "required": ["location"]},
    {"type": "object", "properties": {"vote": {"enum": ["yes", "no"]}, "reason": {"type": "string", "maxLength": 40}},
     "required": ["vote", "reason"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["apple", "pear", "plum"]},
                                                "maxItems": 3}}, "required": ["items"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0,
                                                                            "maximum": 1000}},
     "required": ["ok", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"next_action": {"enum": ["talk", "walk", "sleep", "work"]},
                                      "target": {"type": "string", "maxLength": 16}},
     "required": ["next_action", "target"]},
]


def strict(schema):
    """Objects closed to undeclared properties (as OpenAI's strict mode) and integers bounded: a
    small model would otherwise add free-text properties, or digits, until max_tokens."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
        if schema.get("type") == "integer":
            schema.setdefault("minimum", -1000)
            schema.setdefault("maximum", 1000)
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


SCHEMAS = [strict(s) for s in SCHEMAS]


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schema_outputs_validate_and_free_rows_are_unchanged(llm_fp32):
    """20 schemas constrained in one batch with two free requests: every constrained output
    parses and validates; the free ones equal their outputs when run alone."""
    free = [ask("Name three colors."), ask("What is 2 + 2?")]
    free_params = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.token_ids for o in llm_fp32.chat(free, free_params)]
    prompts = [ask(f"Answer as JSON. Question {i}: describe your day.") for i in range(len(SCHEMAS))] + free
    params = [SamplingParams(temperature=0, max_tokens=160, structured=StructuredOutput(json=s)) for s in SCHEMAS]
    outputs = llm_fp32.chat(prompts, params + [free_params] * 2)
    for schema, output in zip(SCHEMAS, outputs):
        assert output.finish_reason == "stop", (schema, output.text)
        jsonschema.validate(json.loads(output.text), schema)
    assert [o.token_ids for o in outputs[len(SCHEMAS):]] == alone


def test_json_object_regex_and_choice(llm_fp32):
    params = [
        SamplingParams(temperature=0, max_tokens=120, structured=StructuredOutput(json_object=True)),
        SamplingParams(temperature=0, max_tokens=20, structured=StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}")),
        SamplingParams(temperature=0.9, seed=3, max_tokens=10, structured=StructuredOutput(choice=["yes", "no", "a.b"])),
    ]
    prompts = [ask('Reply with this JSON object: {"ok": true}'), ask("Give me a phone number."),
               ask("Is the sky blue?")]
    obj, phone, choice = llm_fp32.chat(prompts, params)
    assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text)
    assert choice.text in ("yes", "no", "a.b")
    assert obj.finish_reason == phone.finish_reason == choice.finish_reason == "stop"


@pytest.mark.parametrize("spec", [dict(regex="("), dict(grammar="start: nope"), dict(json='{"type": 5}')])
def test_bad_constraints_are_rejected_before_running(llm_fp32, spec):
    with pytest.raises(InvalidRequestError):
        llm_fp32.engine.make_request("hi", SamplingParams(structured=StructuredOutput(**spec)))
    assert not llm_fp32.engine.has_unfinished


def test_choices_with_any_punctuation_compile_and_match_only_themselves(tokenizer):
    """`<` and `>` escaped are word boundaries in llguidance's regex syntax: they stay as they are."""
    choices = [string.punctuation, "<tool_call>", "a<b>c"]
    compiler = GrammarCompiler(tokenizer, (tokenizer.token_to_id(tokenizer.eos_token),))
    for choice in choices:
        matcher = compiler.matcher(StructuredOutput(choice=choices))
        assert all(matcher.consume_token(t) for t in tokenizer.encode(choice)) and matcher.is_accepting()
    matcher = compiler.matcher(StructuredOutput(choice=choices))
    assert not all(matcher.consume_token(t) for t in tokenizer.encode("a<b>d"))


def test_constraint_needs_exactly_one_field_and_no_ignore_eos():
    with pytest.raises(InvalidRequestError):
        StructuredOutput()
    with pytest.raises(InvalidRequestError):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError):
        SamplingParams(ignore_eos=True, structured=StructuredOutput(regex="a"))


def test_logprobs_are_the_model_distribution(llm_fp32):
    import torch

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=4, return_logits=True)
    (output,) = llm_fp32.generate(["The capital of France is"], params)
    assert len(output.logprobs) == len(output.token_ids) == len(output.logits) == 6
    for entry, token, logits in zip(output.logprobs, output.token_ids, output.logits):
        want = torch.log_softmax(logits.float(), -1)
        assert entry.token_id == token
        assert abs(entry.logprob - want[token].item()) < 1e-4
        assert len(entry.top) == 4 and entry.top[0][0] == token  # greedy: the best is the chosen one
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


# ---------------------------------------------------------------- through the server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server


def test_response_format_json_schema_and_json_object(server):
    client = server.client()
    reply = client.chat.completions.create(
        model=server.model, messages=ask("Describe a person named Klaus."), temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    assert list(json.loads(reply.choices[0].message.content)) == ["name", "age"]  # the schema's order
    reply = client.chat.completions.create(model=server.model, messages=ask('Reply with this JSON object: {"ok": true}'),
                                           temperature=0, max_tokens=120, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_forced_tool_calls_parse_and_round_trip(server):
    client = server.client()
    messages = ask("What is the weather in Paris?")
    reply = client.chat.completions.create(model=server.model, messages=messages, tools=[WEATHER, ADD],
                                           tool_choice="required", temperature=0, max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "add")
    arguments = json.loads(call.function.arguments)
    schema = WEATHER if call.function.name == "get_weather" else ADD
    jsonschema.validate(arguments, schema["function"]["parameters"])
    # a named function
    reply = client.chat.completions.create(model=server.model, messages=messages, tools=[WEATHER, ADD],
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           temperature=0, max_tokens=80)
    (named,) = reply.choices[0].message.tool_calls
    assert named.function.name == "add"
    jsonschema.validate(json.loads(named.function.arguments), ADD["function"]["parameters"])
    # the call and its result go back in; the model answers in text
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."},
    ]
    reply = client.chat.completions.create(model=server.model, messages=follow, tools=[WEATHER, ADD],
                                           tool_choice="none", temperature=0, max_tokens=30)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_arrive_in_argument_pieces_and_match_the_whole_reply(server):
    client, messages = server.client(), ask("Weather in Rome?")
    fields = dict(model=server.model, messages=messages, tools=[WEATHER, ADD], tool_choice="required", temperature=0,
                  max_tokens=60)
    whole = client.chat.completions.create(**fields).choices[0]
    pieces = []
    with client.chat.completions.stream(**fields) as stream:  # the SDK's helper accumulates the deltas
        for event in stream:
            if event.type == "chunk":
                pieces += [c for choice in event.chunk.choices for c in choice.delta.tool_calls or []]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == \
           [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert len(pieces) > 2 and pieces[0].id and pieces[0].function.name == whole.message.tool_calls[0].function.name
    assert all(p.index == 0 and p.id is None for p in pieces[1:])  # arguments as several deltas of call 0


def test_with_tools_attached_text_streams_token_by_token(server):
    client = server.client()
    chunks = list(client.chat.completions.create(
        model=server.model, messages=ask("Write two sentences about the sea."), tools=[WEATHER], tool_choice="auto",
        temperature=0, max_tokens=30, stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) > 5  # not one chunk at the end
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content  # with the 1st token
    whole = client.chat.completions.create(model=server.model, messages=ask("Write two sentences about the sea."),
                                           tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=30)
    assert "".join(contents) == whole.choices[0].message.content


def test_tool_choice_none_never_returns_call_markup(server):
    client = server.client()
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = ask("Weather in Oslo, then in Rome?") + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 8 degrees."},
        {"role": "user", "content": "Now call get_weather for Rome."}]
    for tools in ([WEATHER], None):
        reply = client.chat.completions.create(model=server.model, messages=history, tools=tools, tool_choice="none"
                                               if tools else openai.NOT_GIVEN, temperature=0, max_tokens=60)
        assert "<tool_call>" not in (reply.choices[0].message.content or "")
        assert not reply.choices[0].message.tool_calls
        assert reply.choices[0].message.content.strip()  # where it would have called, it answers in words


def test_n_choices_share_the_prompt_and_differ_by_seed(server):
    client = server.client()
    messages = ask("Tell me a one-line story about a fox and a crow in the forest, please. " * 6)
    cached_before = server.metrics()["tokendance_cached_prompt_tokens_total"]
    reply = client.chat.completions.create(model=server.model, messages=messages, n=3, temperature=1.0, seed=7,
                                           max_tokens=12)
    prompt = reply.usage.prompt_tokens
    # choices 1 and 2 start once choice 0 computed the prompt: its full blocks are cached for them
    cached = server.metrics()["tokendance_cached_prompt_tokens_total"] - cached_before
    assert cached >= 2 * 16 * ((prompt - 1) // 16)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert 3 <= reply.usage.completion_tokens <= 36
    again = client.chat.completions.create(model=server.model, messages=messages, n=3, temperature=1.0, seed=7,
                                           max_tokens=12)
    # The same seed draws the same tokens from the same logits. Choice 0 of the first request computed
    # the prompt, every later choice read it from the prefix cache; in bf16 the two paths differ in
    # the last bits, and a draw near a tie may differ (seen on AVX512-BF16 without AMX), so compare
    # the choices computed alike.
    assert [c.message.content for c in again.choices][1:] == [c.message.content for c in reply.choices][1:]
    single = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # counted once for the n choices
    status, body = server.post("/v1/completions", {"model": server.model, "prompt": ["A fox", "A crow"], "n": 2,
                                                   "max_tokens": 4, "temperature": 1.0, "seed": 1})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]


def test_logprobs_shapes(server):
    client = server.client()
    reply = client.chat.completions.create(model=server.model, messages=ask("Say hello."), max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert 1 <= len(content) <= reply.usage.completion_tokens  # EOS, if generated, is not content
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    stream = client.chat.completions.create(model=server.model, messages=ask("Say hi."), max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=3, stream=True)
    text, streamed = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            streamed += choice.logprobs.content if choice.logprobs else []
    assert streamed and "".join(t.token for t in streamed) == text
    completion = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=4,
                                           temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset[0] == 0


def test_a_round_of_agents_with_response_format(server):
    agents = [{"agent_id": f"a{i}", "messages": [
        {"role": "system", "content": f"You are agent {i} in a village."},
        {"role": "user", "content": "Ada says: the bridge over the river is closed for repairs until next week."},
        {"role": "user", "content": "What do you do next? Answer as JSON."}]} for i in range(4)]
    schema = SCHEMAS[-1]
    status, body = server.post("/v1/rounds", {
        "model": server.model, "agents": agents, "temperature": 0, "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "action", "schema": schema}}})
    assert status == 200, body
    for output in body["outputs"]:
        jsonschema.validate(json.loads(output["message"]["content"]), schema)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "(", "max_tokens": 4}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 2, "agent_id": "x"}, "n"),
    ({"n": 99}, "n"),
    ({"logit_bias": {"50256": -101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
])
def test_bad_structured_requests_are_400_naming_the_field(server, fields, param):
    secret = "a-value-that-must-not-be-echoed"
    status, body = server.post("/v1/chat/completions", {"model": server.model, "messages": ask(secret), **fields})
    assert status == 400, body
    assert body["error"]["param"] == param
    assert secret not in body["error"]["message"]
