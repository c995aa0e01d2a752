"""The HTTP server as clients see it: a real `tokendance serve` process on 127.0.0.1, driven by the
official `openai` client (raw HTTP for what that client cannot send), plus unit tests of how chat
requests are gathered into rounds."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.helpers import Server, disconnect, serving, kv_bytes, long_chat, open_stream, read_events, salt, wait_until
from tokendance.convergence import repeated_replies
from tokendance.server.gate import Admission
from tokendance.round_core.gathering import ChatTurn, RoundGatherer, overlaps
from tokendance.model.platform import probe_cpu
from tokendance.server.metrics import Metrics
from tokendance.server.protocol import ApiError

SHARED = [
    "Ada says: the bridge over the river is closed for repairs until the end of next week.",
    "Bo says: the market opens at nine tomorrow and the bakery will sell fresh rye bread.",
]


@pytest.fixture(scope="module")
def server(model_weights):
    yield from serving("--gather-window-ms", "300", "--kv-cache-bytes", kv_bytes(8736), "--max-body-bytes", "1000000")


@pytest.fixture(scope="module")
def guarded(model_weights):
    yield from serving("--api-key", "sesame", "--max-concurrent-requests", "1", "--gather-window-ms", "0",
                       "--kv-cache-bytes", kv_bytes(2912), api_key="sesame")


@pytest.fixture(scope="module")
def tenants(model_weights):
    yield from serving("--api-key", "key-a", "--api-key", "key-b", "--gather-window-ms", "0",
                       "--kv-cache-bytes", kv_bytes(2912), api_key="key-a")


def villager(i: int, task: str = "what do you do next?") -> list[dict]:
    """A persona, the shared messages in a per-agent order, a private task."""
    shared = list(SHARED)
    random.Random(i).shuffle(shared)
    system = {"role": "system", "content": f"You are villager {i}, who keeps {['goats', 'bees', 'hens', 'cows'][i % 4]}."}
    return [system, *({"role": "user", "content": s} for s in shared), {"role": "user", "content": f"Villager {i}, {task}"}]


# ---------------------------------------------------------------- basics


def test_health_models_and_metrics(server):
    cpu = probe_cpu()
    machine = {"dtype": "bfloat16" if cpu.native_bf16 else "float32", "cpu_capability": cpu.capability,
               "native_bf16": cpu.native_bf16}
    assert json.loads(server.request("GET", "/health")[2]) == {"status": "ok", **machine, "reuse": "tokendance",
                                                               "recompute_ratio": 0.05, "fidelity": "fast",
                                                               "batch_invariant": False, "warnings": []}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    assert {k: models.data[0].model_extra[k] for k in machine} == machine
    assert server.client().models.retrieve(server.model).id == server.model
    metrics = server.metrics()
    assert metrics["tokendance_kv_blocks_total"] == metrics["tokendance_kv_blocks_used"] + metrics["tokendance_kv_blocks_free"]
    assert "# TYPE tokendance_round_seconds histogram" in server.request("GET", "/metrics")[2].decode()


def test_chat_usage_and_prefix_cache(server):
    client, messages = server.client(), [{"role": "user", "content": f"Name three rivers. ({salt()})"}]
    first = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
    assert first.object == "chat.completion" and first.model == server.model
    assert first.choices[0].message.role == "assistant" and first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    u = first.usage
    assert u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # full blocks of the same prompt


def test_chat_stream_matches_non_stream(server):
    client, messages = server.client(), [{"role": "user", "content": "Describe a lighthouse in one sentence."}]
    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"cache_salt": salt()})
    chunks = list(client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": salt()}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_penalties_logit_bias_and_min_tokens_reach_the_sampler(server):
    client, messages = server.client(), [{"role": "user", "content": f"Say yes. ({salt()})"}]
    forced = client.chat.completions.create(model=server.model, messages=messages, max_tokens=4, temperature=0,
                                            logit_bias={"28": 100})  # token 28 is ","
    assert forced.choices[0].message.content == ",,,,"
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat"
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0)
    penalized = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                          frequency_penalty=2, presence_penalty=2,
                                          extra_body={"repetition_penalty": 1.5, "min_tokens": 12})
    assert penalized.choices[0].text != plain.choices[0].text
    assert penalized.usage.completion_tokens == 12


def test_completions_score_a_prompt_with_prompt_logprobs(server):
    client, prompt = server.client(), f"The bridge over the river is closed. {salt()}"
    scored = client.completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    entries = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == scored.usage.prompt_tokens and entries[0] is None
    for entry in entries[1:]:
        assert 2 <= len(entry) <= 3  # the prompt token and the 2 most likely (it may be one of them)
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str) for v in entry.values())
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    status, error = server.post("/v1/completions", {"model": server.model, "prompt": "hi", "prompt_logprobs": 1,
                                                    "stream": True})
    assert status == 400 and error["error"]["param"] == "prompt_logprobs"


def test_stop_string_is_never_streamed(server):
    client, messages = server.client(), [{"role": "user", "content": "Tell me about the sea."}]
    full = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0,
                                          extra_body={"cache_salt": salt()}).choices[0].message.content
    stop = full[6:10]
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0,
                                            stop=[stop], stream=True, extra_body={"cache_salt": salt()})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_batch_token_ids_and_stream(server):
    client = server.client()
    prompts = ["The capital of France is", "Once upon a time"]
    whole = client.completions.create(model=server.model, prompt=prompts, max_tokens=6, temperature=0,
                                      extra_body={"cache_salt": salt()})
    assert [c.index for c in whole.choices] == [0, 1] and whole.object == "text_completion"
    assert whole.usage.completion_tokens <= 12
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=server.model, prompt=prompts, max_tokens=6, temperature=0,
                                           stream=True, extra_body={"cache_salt": salt()}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    ids = client.completions.create(model=server.model, prompt=[504, 3575, 282], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.choices[0].text


# ---------------------------------------------------------------- rounds


def test_declared_round_keeps_agent_sessions(server):
    client, rid = server.client(), salt()

    def turn(i: int, messages: list[dict], round_id: str):
        return client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=6, temperature=0,
            extra_body={"agent_id": f"{rid}-{i}", "round_id": round_id, "round_size": 3})

    with ThreadPoolExecutor(3) as pool:
        first = list(pool.map(lambda i: turn(i, villager(i), rid + "-1"), range(3)))
    rounds = [r.to_dict()["round"] for r in first]
    assert {r["num_agents"] for r in rounds} == {3} and len({r["index"] for r in rounds}) == 1
    assert sorted(r["agent_id"] for r in rounds) == [f"{rid}-{i}" for i in range(3)]
    follow = [villager(i) + [{"role": "assistant", "content": first[i].choices[0].message.content},
                             {"role": "user", "content": "And after that?"}] for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        second = list(pool.map(lambda i: turn(i, follow[i], rid + "-2"), range(3)))
    for previous, now in zip(first, second):  # the session holds the whole previous prompt
        assert now.usage.prompt_tokens_details.cached_tokens >= previous.usage.prompt_tokens - 1
    assert server.metrics()['tokendance_rounds_total{source="declared"}'] >= 2
    for i in range(3):
        assert server.request("DELETE", f"/v1/agents/{rid}-{i}")[0] == 200
    assert server.request("DELETE", f"/v1/agents/{rid}-0")[0] == 404


def test_any_agent_id_can_be_deleted_and_round_sizes_cannot_conflict(server):
    client, rid = server.client(), salt()
    agent = f"team/{rid}/ada"  # a "/" in an agent id
    client.chat.completions.create(model=server.model, messages=villager(0), max_tokens=2, temperature=0,
                                   extra_body={"agent_id": agent, "round_id": rid, "round_size": 1})
    status, _, body = server.request("DELETE", f"/v1/agents/{agent}")
    assert status == 200 and json.loads(body)["agent_id"] == agent
    assert server.request("DELETE", f"/v1/agents/{agent}")[0] == 404

    def declared(size: int):
        return server.post("/v1/chat/completions", chat_body(server, temperature=0, round_id=rid + "-x",
                                                             round_size=size))

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(declared, 3)  # waits for two more (or the round timeout)
        time.sleep(0.5)
        status, error = declared(2)
        assert status == 409 and error["error"]["code"] == "round_conflict"
        assert first.result()[0] == 200  # the conflicting request did not start it early


def test_plain_concurrent_chats_sharing_messages_form_one_round(server):
    before = server.metrics()
    client, barrier = server.client(), threading.Barrier(4)

    def ask(i: int):  # agents 1 and 3 stream: their tokens arrive while the round decodes
        barrier.wait()
        if i % 2 == 0:
            reply = client.chat.completions.create(model=server.model, messages=villager(i), max_tokens=6, temperature=0)
            return reply, reply.to_dict()["round"]
        chunks = list(client.chat.completions.create(model=server.model, messages=villager(i), max_tokens=6,
                                                     temperature=0, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return chunks[-1], chunks[-2].to_dict()["round"]

    with ThreadPoolExecutor(4) as pool:
        replies, rounds = zip(*pool.map(ask, range(4)))
    assert {r["num_agents"] for r in rounds} == {4} and len({r["index"] for r in rounds}) == 1
    after = server.metrics()
    key = 'tokendance_rounds_total{source="transparent"}'
    assert after[key] - before.get(key, 0) == 1
    assert after["tokendance_round_agents_sum"] - before["tokendance_round_agents_sum"] == 4
    assert after["tokendance_last_round_agents"] == 4
    assert after["tokendance_round_shared_compression"] > 1
    assert sum(r.usage.prompt_tokens_details.cached_tokens for r in replies) > 0  # shared messages reused
    assert after["tokendance_agent_sessions"] == before["tokendance_agent_sessions"]  # anonymous: ended


def test_rounds_endpoint(server):
    agents = [{"agent_id": f"v{i}", "messages": villager(i)} for i in range(3)]
    agents[2]["max_tokens"] = 2
    before = server.metrics()
    status, body = server.post("/v1/rounds", {"model": server.model, "agents": agents, "max_tokens": 5,
                                              "temperature": 0, "cache_salt": salt()})
    assert status == 200, body
    repeated = repeated_replies([o["message"]["content"] for o in body["outputs"]])
    assert body["stats"]["repeated_replies"] == repeated
    counted = server.metrics()["tokendance_round_repeated_replies_total"]
    assert counted - before.get("tokendance_round_repeated_replies_total", 0) == repeated
    assert [o["agent_id"] for o in body["outputs"]] == ["v0", "v1", "v2"]
    assert body["outputs"][2]["usage"]["completion_tokens"] <= 2
    assert body["stats"]["num_agents"] == 3 and body["stats"]["mode"] == "tokendance"
    assert body["stats"]["shared_compression"] > 1 and body["round"]["num_agents"] == 3
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    status, body = server.post("/v1/rounds", {"model": server.model, "agents": agents[:1] * 2})
    assert status == 400 and body["error"]["param"] == "agents"
    status, body = server.post("/v1/rounds", {"model": server.model, "agents": agents, "stream": True})
    assert status == 400 and body["error"]["code"] == "unsupported_parameter"


def test_cache_salt_isolates_tenants(server):
    messages = [{"role": "system", "content": f"You are a storyteller ({salt()})."},
                {"role": "user", "content": "Tell a long story about owls, owlets and the old oak tree."}]
    client = server.client()

    def cached(**extra) -> int:
        reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    tenant = salt()
    assert cached(cache_salt=tenant) == 0
    assert cached(cache_salt=tenant) > 0
    assert cached(cache_salt=salt()) == 0
    assert cached() == 0


def test_per_agent_cache_salts_isolate_agents_of_one_round(server):
    """An agent object's own cache_salt puts its session (and its prefix-cache reads and writes) in
    that salt's namespace: deleting it needs that salt; its shared messages are not shared with
    the round's other namespace; a per-agent model is refused, naming the field."""
    own, common = salt(), salt()
    agents = [{"agent_id": "iso-0", "messages": villager(0), "cache_salt": own},
              {"agent_id": "iso-1", "messages": villager(1)}, {"agent_id": "iso-2", "messages": villager(2)}]
    status, body = server.post("/v1/rounds", {"model": server.model, "agents": agents, "max_tokens": 2,
                                              "temperature": 0, "cache_salt": common})
    assert status == 200, body
    assert server.request("DELETE", f"/v1/agents/iso-0?cache_salt={common}")[0] == 404
    assert server.request("DELETE", f"/v1/agents/iso-0?cache_salt={own}")[0] == 200
    assert server.request("DELETE", f"/v1/agents/iso-1?cache_salt={own}")[0] == 404
    assert server.request("DELETE", f"/v1/agents/iso-1?cache_salt={common}")[0] == 200
    cached = {o["agent_id"]: o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in body["outputs"]}
    assert cached["iso-0"] == 0  # nothing of the other namespace's KV reached it
    agents[1]["model"] = "gpt-4"
    status, body = server.post("/v1/rounds", {"model": server.model, "agents": agents, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "agents.1.model"


@pytest.mark.parametrize("max_tokens", [1, 24])
def test_a_call_cut_short_answers_alike_streamed_and_not(server, max_tokens):
    """tool_choice "required" with too few tokens for the call: finish_reason "length", no content
    (it would be the call's markup), and the call as far as it was written (its name once written,
    arguments not valid JSON), the same whole as streamed."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    fields = dict(model=server.model, messages=[{"role": "user", "content": "Look up the weather in Paris."}],
                  tools=[tool], tool_choice="required", max_tokens=max_tokens, temperature=0)
    whole = server.client().chat.completions.create(**fields).choices[0]
    content, calls, finish = "", {}, None
    for chunk in server.client().chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert whole.finish_reason == finish == "length"
    assert whole.message.content is None and content == ""
    got = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
    assert got == [calls[i] for i in sorted(calls)]
    if max_tokens > 1:
        assert got and got[0]["name"] == "lookup" and got[0]["arguments"].startswith("{")


# ---------------------------------------------------------------- bad input


def chat_body(server, **fields) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


BAD_CHATS = [  # (fields replacing the defaults, status, expected param, expected code)
    ({"messages": None}, 400, "messages", None),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": 123}]}, 400, "messages.0.content", None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None),
    ({"model": "gpt-5"}, 404, "model", "model_not_found"),
    ({"temperature": -1}, 400, "temperature", "invalid_value"),
    ({"temperature": "hot"}, 400, "temperature", None),
    ({"top_p": 0}, 400, "top_p", "invalid_value"),
    ({"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"stop_token_ids": [-3]}, 400, "stop_token_ids", "invalid_value"),
    ({"n": 17}, 400, "n", None),
    ({"logit_bias": {"one": 5}}, 400, "logit_bias", "invalid_value"),
    ({"logit_bias": {"1": "5"}}, 400, "logit_bias.1", None),
    ({"presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    ({"frequency_penalty": -3}, 400, "frequency_penalty", "invalid_value"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    ({"min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", "invalid_value"),
    ({"best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ({"round_size": 3}, 400, "round_size", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hello " * 9000}]}, 400, "messages", "context_length_exceeded"),
    # values the sampler or tokenizer cannot take, and loose types OpenAI rejects
    ({"temperature": 1e308}, 400, "temperature", "invalid_value"),
    ({"temperature": float("inf")}, 400, "temperature", "invalid_value"),
    ({"seed": 2**70}, 400, "seed", "invalid_value"),
    ({"seed": -(2**70)}, 400, "seed", "invalid_value"),
    ({"max_tokens": "10"}, 400, "max_tokens", None),
    ({"stream": "yes"}, 400, "stream", None),
    ({"ignore_eos": "yes"}, 400, "ignore_eos", None),
    ({"top_k": 2.5}, 400, "top_k", None),
    ({"stop": ["x"] * 65}, 400, "stop", None),
    ({"messages": [{"role": "user", "content": "hi \ud800 there"}]}, 400, "messages.0.content", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a \udfff"}]}]}, 400,
     "messages.0.content", "invalid_value"),
    ({"stop": "\ud800"}, 400, "stop", "invalid_value"),
]


@pytest.mark.parametrize("fields,status,param,code", BAD_CHATS)
def test_bad_chat_requests(server, fields, status, param, code):
    body = {k: v for k, v in {**chat_body(server), **fields}.items() if v is not None}
    got, error = server.post("/v1/chat/completions", body)
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["message"]
    assert (error["error"]["param"], error["error"]["code"]) == (param, code)


def test_hostile_values_fail_alone(server):
    """A request with a degenerate temperature runs (greedy) next to others, which all complete;
    a huge model name or a tool schema is never echoed back whole."""
    bodies = [chat_body(server, temperature=1e-39, max_tokens=4)] + [chat_body(server, temperature=0, max_tokens=4)] * 3
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: server.post("/v1/chat/completions", b), bodies))
    assert [status for status, _ in answers] == [200] * len(bodies)
    assert answers[0][1]["choices"][0]["message"]["content"] == answers[1][1]["choices"][0]["message"]["content"]
    status, error = server.post("/v1/chat/completions", chat_body(server, model="m" * 100_000))
    assert status == 404 and len(error["error"]["message"]) < 300
    tool = {"type": "function", "function": {"name": "y" * 5000, "parameters": {"type": "object"}}}
    status, error = server.post("/v1/chat/completions", chat_body(server, tools=[tool]))
    assert status == 400 and error["error"]["param"] == "tools.0.function.name", error
    assert "yyyy" not in error["error"]["message"]
    for prompt in ([True], "x \ud800", ["ok", "\udc00"]):
        status, error = server.post("/v1/completions", {"model": server.model, "prompt": prompt, "max_tokens": 2})
        assert status == 400 and error["error"]["param"].startswith("prompt"), error
    status, error = server.post("/v1/completions", {"model": server.model, "prompt": ["a"] * 129, "max_tokens": 1})
    assert status == 400 and error["error"]["param"] == "prompt"
    status, error = server.post("/v1/rounds", {"model": server.model, "max_tokens": 2, "agents": [
        {"agent_id": "ok", "messages": [{"role": "user", "content": "hi"}]},
        {"agent_id": "bad", "messages": [{"role": "user", "content": "\ud800"}]}]})
    assert status == 400 and error["error"]["param"] == "agents.1.messages.0.content"
    assert server.request("GET", "/health")[0] == 200


def test_hostile_corpus_is_answered_4xx_and_changes_nothing(server):
    """Every request of the checked-in corpus (tests/data/hostile_requests.json: malformed JSON,
    wrong types, out-of-range values, bad constraints and tools, lone surrogates, deep nesting)
    gets its 4xx with an OpenAI error body; the server stays healthy and holds no KV for them."""
    corpus = json.loads((Path(__file__).parent.parent / "data" / "hostile_requests.json").read_text())
    used_before = server.metrics()["tokendance_kv_blocks_used"]
    for case in corpus:
        if "json" in case:
            data = json.dumps(case["json"]).replace('"MODEL"', json.dumps(server.model)).encode()
        elif "raw_hex" in case:
            data = bytes.fromhex(case["raw_hex"])
        else:
            data = case["raw"].replace("MODEL", server.model).encode()
        status, _, body = server.request("POST", case["path"], data)
        assert status == case["status"], (case, body[:300])
        error = json.loads(body)["error"]
        assert error["message"] and set(error) == {"message", "type", "param", "code"}
    assert server.request("GET", "/health")[0] == 200
    assert server.metrics()["tokendance_kv_blocks_used"] == used_before


@pytest.mark.parametrize("path,raw,status,code", [
    ("/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/completions", None, 400, "invalid_value"),  # the prompt is empty
    ("/v1/chat/completions", b"x" * 1_500_000, 413, "request_too_large"),
    ("/v1/nowhere", b"{}", 404, "not_found"),
])
def test_bad_raw_requests(server, path, raw, status, code):
    if raw is None:
        raw = json.dumps({"model": server.model, "prompt": ""}).encode()
    got, _, data = server.request("POST", path, raw)
    assert got == status and json.loads(data)["error"]["code"] == code
    assert server.request("GET", "/health")[0] == 200


def test_openai_client_sees_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}], temperature=-2)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.APIStatusError) as big:
        client.completions.create(model=server.model, prompt="x" * 1_200_000)
    assert big.value.status_code == 413


# ---------------------------------------------------------------- disconnects, limits, load


def idle(server: Server, used_blocks: float):
    def check() -> bool:
        m = server.metrics()
        return (m["tokendance_requests_in_flight"] == 0 and m["tokendance_engine_running_requests"] == 0
                and m["tokendance_engine_waiting_requests"] == 0 and m["tokendance_kv_blocks_used"] == used_blocks)
    return check


def test_disconnect_aborts_and_frees_kv(server):
    baseline = server.metrics()
    connection = open_stream(server, long_chat(server.model), events=4)
    assert server.metrics()["tokendance_kv_blocks_used"] > baseline["tokendance_kv_blocks_used"]
    disconnect(connection)
    wait_until(idle(server, baseline["tokendance_kv_blocks_used"]), timeout=30)
    # a non-streaming request whose client leaves is aborted too
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v1/chat/completions", body=json.dumps({**long_chat(server.model), "stream": False}),
                       headers={"Content-Type": "application/json"})
    wait_until(lambda: server.metrics()["tokendance_engine_running_requests"] == 1, timeout=30)
    disconnect(connection)
    wait_until(idle(server, baseline["tokendance_kv_blocks_used"]), timeout=30)
    aborted = 'tokendance_requests_finished_total{finish_reason="abort"}'
    assert server.metrics()[aborted] - baseline.get(aborted, 0) == 2


def test_disconnect_inside_a_running_round_aborts_only_that_agent(server):
    baseline, rid = server.metrics(), salt()
    declared = {"round_id": rid, "round_size": 2}
    # its first chunk comes with its first token, once its round runs: only the headers now
    connection = open_stream(server, {**long_chat(server.model), "messages": villager(0), **declared}, events=0)
    status, short = server.post("/v1/chat/completions", {"model": server.model, "messages": villager(1),
                                                         "max_tokens": 4, **declared})
    assert status == 200 and short["round"]["num_agents"] == 2
    read_events(connection, 3)  # the long agent is decoding inside the round
    disconnect(connection)
    key = 'tokendance_rounds_total{source="declared"}'
    wait_until(lambda: server.metrics().get(key, 0) == baseline.get(key, 0) + 1, timeout=30)  # not 2000 tokens later
    wait_until(idle(server, baseline["tokendance_kv_blocks_used"]), timeout=30)
    after = server.metrics()
    assert after["tokendance_rounds_failed_total"] == baseline["tokendance_rounds_failed_total"]
    aborted = 'tokendance_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] - baseline.get(aborted, 0) == 1


def send_and_leave(server: Server, path: str, body: dict, after: float) -> None:
    """A client that sends a request and closes its socket `after` seconds later, unanswered."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:
        data = json.dumps(body).encode()
        raw.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after)


def test_clients_that_leave_at_any_stage_never_stop_the_engine(server):
    """While a long prompt keeps the engine busy (so jobs wait in its inbox), clients leave before
    the engine takes their job and during the prefill; then, with nothing ahead, while decoding: n > 1 chats (streamed or
    not), completions with several prompts, a declared round's agent, a /v1/rounds request. The
    engine thread survives all of it, serves the next request, and no KV stays behind."""
    baseline = server.metrics()
    busy = {"model": server.model, "prompt": " ".join(f"w{i}" for i in range(800)), "max_tokens": 16,
            "ignore_eos": True}
    # long enough that none is done when its client leaves, however fast the engine (a declared
    # agent that finished keeps its session, as it should)
    long = {"max_tokens": 400, "ignore_eos": True}
    leavers = [
        ("/v1/chat/completions", {**chat_body(server), "n": 2, **long, "temperature": 0.7}),
        ("/v1/chat/completions", {**chat_body(server), "n": 3, **long, "temperature": 0.7, "stream": True}),
        ("/v1/completions", {"model": server.model, "prompt": ["a b", "c d"], "n": 2, **long}),
        ("/v1/chat/completions", {**chat_body(server), **long, "round_id": salt(), "round_size": 1,
                                  "agent_id": "leaver"}),
        ("/v1/rounds", {"model": server.model, **long, "agents": [
            {"agent_id": "x", "messages": villager(0)}, {"agent_id": "y", "messages": villager(1)}]}),
    ]
    with ThreadPoolExecutor(1 + len(leavers)) as pool:  # the leavers all at once
        for after, ahead in ((0.05, True), (0.6, True), (2.0, False)):  # the last: nothing ahead, so they decode
            if ahead:
                keeping_busy = pool.submit(server.post, "/v1/completions", {**busy, "prompt": f"{salt()} {busy['prompt']}"})
                time.sleep(0.3)
            list(pool.map(lambda case: send_and_leave(server, *case, after), leavers))
            assert not ahead or keeping_busy.result()[0] == 200
            assert server.request("GET", "/health")[0] == 200
    status, reply = server.post("/v1/chat/completions", {**chat_body(server), "n": 2, "temperature": 0.7})
    assert status == 200 and len(reply["choices"]) == 2
    wait_until(idle(server, baseline["tokendance_kv_blocks_used"]), timeout=60)


def test_a_round_agent_that_fails_fails_alone(server):
    """An agent whose constraint cannot continue while decoding (it compiles, then its lexer
    explodes) gets its error in its own entry; the round answers 200 with the others' replies."""
    agents = [{"agent_id": f"a{i}", "messages": villager(i)} for i in range(3)]
    agents[1]["guided_regex"] = "(a{4000}){4000}"
    status, body = server.post("/v1/rounds", {"model": server.model, "max_tokens": 4, "temperature": 0,
                                              "cache_salt": salt(), "agents": agents})
    assert status == 200, body
    failed, *fine = body["outputs"][1], body["outputs"][0], body["outputs"][2]
    assert failed["finish_reason"] == "error" and failed["error"]["code"] == "agent_failed"
    assert "the output constraint" in failed["error"]["message"] and "<state>" not in failed["error"]["message"]
    assert all(o["finish_reason"] == "length" and o["message"]["content"] and "error" not in o for o in fine)
    assert server.request("GET", "/health")[0] == 200


def test_validation_is_linear_in_the_number_of_messages(server):
    """3,000 short messages (15,000 tokens) are refused for the context window, and a chat of 300
    messages is tokenized as `LLM.chat` does (message by message), not rendered once per prefix."""
    many = [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(3000)]
    status, error = server.post("/v1/chat/completions", {**chat_body(server), "messages": many})
    assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
    deep = node = {}
    for _ in range(220):
        node["items"] = {"type": "array"}
        node = node["items"]
    status, error = server.post("/v1/chat/completions", {**chat_body(server), "guided_json": deep})
    assert status == 400 and error["error"]["param"] == "guided_json", error
    status, reply = server.post("/v1/chat/completions", {**chat_body(server), "messages": many[:300], "max_tokens": 1})
    assert status == 200 and reply["usage"]["prompt_tokens"] > 1500, reply


def test_api_key_required(guarded):
    status, _, data = guarded.request("GET", "/v1/models")
    assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").chat.completions.create(model=guarded.model, messages=[{"role": "user", "content": "hi"}])
    assert guarded.client("sesame").models.list().data[0].id == guarded.model
    assert guarded.request("GET", "/health")[0] == 200  # probes need no key
    assert guarded.request("HEAD", "/health")[0] == 200
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as raw:  # two keys: neither counts
        raw.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
                    b"Authorization: Bearer sesame\r\nConnection: close\r\n\r\n")
        assert raw.recv(200).startswith(b"HTTP/1.1 401")
    assert guarded.request("GET", "/openapi.json")[0] == 401
    assert guarded.request("GET", "/openapi.json", headers={"Authorization": "Bearer sesame"})[0] == 200
    # the key is checked before the body is read: the answer comes while the body is still unsent
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=30) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 8000000\r\n\r\n" + b"x" * 1000)
        assert raw.recv(200).startswith(b"HTTP/1.1 401")


def test_api_keys_are_tenants_that_never_share_kv(tenants):
    """Without any cache_salt, a prompt cached for one key is not cached for the other (no probing
    another tenant's prompts through cached_tokens), and agents are scoped by key."""
    a, b = tenants.client("key-a"), tenants.client("key-b")
    messages = [{"role": "system", "content": "You are the archivist of a very secret library. " * 8},
                {"role": "user", "content": "Which book is on the top shelf?"}]

    def cached(client, **extra) -> int:
        reply = client.chat.completions.create(model=tenants.model, messages=messages, max_tokens=2, **extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached(a) == 0 and cached(a) > 0  # the same tenant shares its prefix cache
    assert cached(b) == 0 and cached(b) > 0  # the other tenant starts cold
    cached(a, extra_body={"agent_id": "scribe"})
    auth = {"Authorization": "Bearer key-b"}
    assert tenants.request("DELETE", "/v1/agents/scribe", headers=auth)[0] == 404  # not b's agent
    assert tenants.request("DELETE", "/v1/agents/scribe", headers={"Authorization": "Bearer key-a"})[0] == 200
    assert tenants.request("GET", "/v1/models", headers={"Authorization": "Bearer key-c"})[0] == 401


def test_too_many_concurrent_requests_get_429(guarded):
    auth = {"Authorization": "Bearer sesame"}
    connection = open_stream(guarded, long_chat(guarded.model), events=2, headers=auth)
    status, headers, data = guarded.request("POST", "/v1/chat/completions", chat_body(guarded), headers=auth)
    assert status == 429 and headers.get("retry-after") == "1"
    assert json.loads(data)["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        guarded.client("sesame").chat.completions.create(model=guarded.model, messages=[{"role": "user", "content": "hi"}])
    connection.close()
    wait_until(lambda: guarded.metrics()["tokendance_requests_in_flight"] == 0, timeout=30)
    # no max_tokens: up to what the (small) KV pool holds, not a capacity error
    reply = guarded.client("sesame").chat.completions.create(
        model=guarded.model, messages=[{"role": "user", "content": "hi"}], stop=[" ", "\n"])
    assert reply.choices[0].finish_reason == "stop"


def test_admission_counts_engine_requests_not_http_requests():
    admission, a, b, c = Admission(4, Metrics()), {}, {}, {}
    admission.claim(a, 1)  # the gate, before the body is parsed
    admission.claim(a, 3)  # the handler: three prompts
    with pytest.raises(ApiError) as refused:
        admission.claim(b, 2)
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    admission.claim(b, 1)
    assert admission.in_flight == 4
    admission.release(a)
    admission.release(b)
    assert admission.in_flight == 0
    admission.claim(c, 9)  # larger than the bound: it counts as half of it, others still fit beside it
    assert admission.in_flight == 2
    admission.claim(a, 2)
    with pytest.raises(ApiError):
        admission.claim(b, 1)
    admission.release(c)
    admission.release(a)
    assert admission.in_flight == 0


def test_round_larger_than_the_kv_pool_still_answers_every_agent(guarded):
    """Three ~1,000-token private prompts do not fit the 2,912-token pool together: the engine runs the
    round in waves, and every agent's reply still reaches its client."""
    def notes(i: int) -> str:
        rng = random.Random(i)
        return " ".join(f"w{rng.randint(0, 9999)}" for _ in range(220))  # ~1,070 tokens

    agents = [{"agent_id": f"big{i}", "messages": [{"role": "user", "content": notes(i)}]} for i in range(3)]
    status, body = guarded.post("/v1/rounds", {"model": guarded.model, "agents": agents, "max_tokens": 2},
                                headers={"Authorization": "Bearer sesame"}, timeout=300)
    assert status == 200, body
    assert [o["agent_id"] for o in body["outputs"]] == ["big0", "big1", "big2"] and body["stats"]["num_waves"] > 1
    assert all(o["usage"]["prompt_tokens"] > 900 and o["finish_reason"] for o in body["outputs"])


@pytest.mark.parametrize("num_requests,num_clients", [(100, 32), pytest.param(1000, 64, marks=pytest.mark.slow)])
def test_load_from_concurrent_clients(server, num_requests, num_clients):
    """A mix of streamed and plain chats, completions and agent-like requests: every one answers,
    rounds form under load, and afterwards the pool and the sessions are back to where they were
    (the 1,000-request soak is marked slow)."""
    baseline = server.metrics()
    client = server.client()

    def one(i: int):
        kind = i % 4
        if kind == 0:
            stream = client.chat.completions.create(model=server.model, max_tokens=8, temperature=0.8, seed=i, stream=True,
                                                    messages=[{"role": "user", "content": f"Say something about {i}."}])
            chunks = list(stream)
            return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
        if kind == 3:  # agent-like: shares messages with its concurrent peers, so rounds form under load
            reply = client.chat.completions.create(model=server.model, messages=villager(i, f"request {i}?"), max_tokens=8)
        elif kind == 1:
            reply = client.chat.completions.create(model=server.model, max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": f"Count to {i}."}])
        else:
            reply = client.completions.create(model=server.model, prompt=f"Item {i}:", max_tokens=8, temperature=0.5)
            return reply.choices[0].text, reply.choices[0].finish_reason
        assert reply.usage.completion_tokens <= 8
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(num_clients) as pool:
        results = list(pool.map(one, range(num_requests)))
    assert len(results) == num_requests
    assert all(isinstance(text, str) and reason in ("stop", "length") for text, reason in results)
    wait_until(idle(server, baseline["tokendance_kv_blocks_used"]), timeout=30)
    after = server.metrics()
    assert after["tokendance_agent_sessions"] == baseline["tokendance_agent_sessions"]
    ok = sum(v for k, v in after.items() if k.startswith("tokendance_http_requests_total") and 'status="200"' in k)
    ok_before = sum(v for k, v in baseline.items() if k.startswith("tokendance_http_requests_total") and 'status="200"' in k)
    assert ok - ok_before >= num_requests
    assert after["tokendance_rounds_total{source=\"transparent\"}"] > baseline.get('tokendance_rounds_total{source="transparent"}', 0)


# ---------------------------------------------------------------- gathering (no server)


def turn(key: str, messages: list[str], arrival: float = 0.0, **fields) -> ChatTurn:
    """A chat turn of user messages; one-letter names stand for lines long enough to share."""
    msgs = [{"role": "user", "content": "\n".join(LINE.get(x, x) for x in m.split("\n"))} for m in messages]
    return ChatTurn(key, msgs, None, None, None, arrival=arrival, **fields)


LINE = {c: f"{c}: a line long enough to be worth sharing across agents" for c in "xyz"}


def test_overlap_ignores_common_prefix_namespaces_and_short_lines():
    assert overlaps(turn("a", ["sys A", "x", "task a"]), turn("b", ["sys B", "x", "task b"]))
    assert not overlaps(turn("a", ["sys", "x", "task a"]), turn("b", ["sys", "x", "task b"]))  # prefix caching's job
    assert overlaps(turn("a", ["sys", "x", "y", "a"]), turn("b", ["sys", "y", "x", "b"]))
    assert overlaps(turn("a", ["sys A", "news:\nx\ny"]), turn("b", ["sys B", "feed:\ny"]))  # a shared line
    assert not overlaps(turn("a", ["sys A", "OK", "a"]), turn("b", ["sys B", "OK", "b"]))  # too short to matter
    assert not overlaps(turn("a", ["p", "x"], namespace="t1"), turn("b", ["q", "x"], namespace="t2"))


def test_gatherer_windows_rounds_and_ordinary():
    g = RoundGatherer(window_s=0.05, round_timeout_s=1.0)
    g.add(turn("a", ["pa", "x", "ta"], 0.0))
    g.add(turn("b", ["pb", "x", "tb"], 0.01))
    g.add(turn("c", ["pc", "tc"], 0.02))
    g.add(turn("d", ["pd", "td"], 0.02, agent_id="dora"))
    g.add(turn("e", ["pe", "te"], 0.03, agent_id="dora"))  # the same agent twice: waits a window
    assert g.next_deadline() == pytest.approx(0.08)  # a window after the last arrival
    assert g.pop_ready(0.07).rounds == []
    work = g.pop_ready(0.08)
    assert [[t.key for t in r] for r in work.rounds] == [["a", "b", "d"]]
    assert [t.key for t in work.ordinary] == ["c"]
    assert [t.key for t in g.pop_ready(0.13).rounds[0]] == ["e"] and len(g) == 0


def test_gatherer_waits_out_a_burst_up_to_the_round_timeout():
    """The window restarts with every arrival: a burst longer than the window is one round."""
    g = RoundGatherer(window_s=0.05, round_timeout_s=0.3)
    for i in range(8):  # one every 40 ms: 280 ms in all
        g.add(turn(str(i), [f"p{i}", "x", f"t{i}"], 0.04 * i))
        assert g.pop_ready(min(0.04 * i + 0.039, 0.299)).rounds == []
    assert g.next_deadline() == pytest.approx(0.3)  # not 0.33: capped at the round timeout after the first
    assert [[t.key for t in r] for r in g.pop_ready(0.3).rounds] == [[str(i) for i in range(8)]]
    g.add(turn("a", ["pa", "x"], 1.0))
    g.add(turn("b", ["pb", "x"], 1.01))
    assert g.next_deadline() == pytest.approx(1.06) and g.pop_ready(1.059).rounds == []
    assert [[t.key for t in r] for r in g.pop_ready(1.06).rounds] == [["a", "b"]] and len(g) == 0


def test_gatherer_declared_rounds():
    g = RoundGatherer(window_s=0.05, round_timeout_s=1.0)
    g.add(turn("a", ["x"], 0.0, round_id="r", round_size=2, agent_id="ann"))
    with pytest.raises(ValueError):
        g.add(turn("b", ["y"], 0.1, round_id="r", round_size=2, agent_id="ann"))
    g.add(turn("c", ["z"], 0.1, round_id="r", round_size=2, namespace="other"))  # another tenant's round
    g.add(turn("d", ["w"], 0.2, round_id="r", round_size=2))
    assert [[t.key for t in r] for r in g.pop_ready(0.2).rounds] == [["a", "d"]]
    assert g.pop_ready(0.5).rounds == [] and g.next_deadline() == pytest.approx(1.1)
    assert [t.key for t in g.remove("c")] == ["c"] and len(g) == 0
