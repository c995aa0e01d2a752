"""`vllm serve` with the plugin, through the official openai client: the endpoint plugin's
`/v1/rounds` and round fields on chat requests (tokendance serve's API) reach the connector, at
recompute ratio 1.0 a round answers exactly what plain chat requests answer, `tokendance bench
--target` reads the session store's gauges, and the round protocol's contract: the same requests,
good and bad, answered alike by `tokendance serve` and by vLLM with the plugin."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

pytest.importorskip("vllm")
import openai  # noqa: E402

from tests.helpers import kv_bytes, serving  # noqa: E402
from tests.vllm_plugin.conftest import generative_agents  # noqa: E402
from tests.vllm_plugin.serving import vllm_serving  # noqa: E402

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(model_folder):
    settings = {"recompute_ratio": 1.0, "store_gib": 0.5,
                # a wider window than the default 0.05 s: on a busy 2-core machine a burst's
                # requests can come 50 ms apart
                "transparent_rounds": True, "gather_window_s": 0.2}
    with vllm_serving(model_folder, MODEL, settings, "--enable-prompt-tokens-details", start_timeout_s=300) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def serve(model_weights):
    """`tokendance serve`, the other front door, for the contract test."""
    yield from serving("--gather-window-ms", "0", "--kv-cache-bytes", kv_bytes(2912))


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of a POST, whatever its status."""
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def prometheus(client) -> dict[str, float]:
    """The server's /metrics: {'name{label="value"}': value} over the labels other than vLLM's
    own (model_name, engine), summed."""
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        sample = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$", line)
        if not sample:
            continue
        labels = [pair for pair in (sample.group(2) or "").split(",") if pair and not pair.startswith(("model_name=", "engine="))]
        key = sample.group(1) + (f"{{{','.join(labels)}}}" if labels else "")
        found[key] = found.get(key, 0.0) + float(sample.group(3))
    return found


def agents(num: int, seed: int) -> list[dict]:
    workload = generative_agents(num, seed)
    return [{"agent_id": t.agent_id, "messages": list(t.messages)} for t in workload.turns(0, [])]


def chat(client, messages, max_tokens: int = 12, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra or None)


def test_a_round_through_v1_rounds_answers_what_plain_chat_answers(server):
    turns = agents(4, seed=10)
    reply = server.post("/rounds", cast_to=object, body={"model": MODEL, "agents": turns, "max_tokens": 12,
                                                         "temperature": 0})
    assert [o["agent_id"] for o in reply["outputs"]] == [t["agent_id"] for t in turns]
    assert reply["object"] == "round" and reply["stats"]["num_agents"] == 4
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the mirrors' claimed tokens
    assert reply["round"]["num_agents"] == 4 and reply["round"]["round_id"] == reply["id"]
    plain = [chat(server, t["messages"], cache_salt=f"plain-{t['agent_id']}") for t in turns]
    assert [o["message"]["content"] for o in reply["outputs"]] == [p.choices[0].message.content for p in plain]


def test_chat_requests_with_round_fields_form_a_round(server):
    turns = agents(3, seed=11)
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda t: chat(server, t["messages"], agent_id=t["agent_id"], round_id="declared-1",
                                               round_size=3), turns))
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    # two mirrors claimed their shared messages (the master claims only its own history, exactly,
    # where an earlier request of its agent left one)
    assert sum(c > 0 for c in cached) >= 2
    # /metrics shows the connector's counters under vLLM's prefix (ratio 1.0: every reused-piece
    # token selected, none reused)
    metrics = prometheus(server)
    assert metrics["vllm:tokendance_mirrors_filled_total"] >= 2
    assert metrics['vllm:tokendance_members_total{role="master"}'] >= 1
    assert metrics['vllm:tokendance_computed_tokens_total{reason="selected"}'] > 0
    assert metrics['vllm:tokendance_pass_seconds_total{phase="recompute"}'] > 0
    plain = [chat(server, t["messages"], cache_salt=f"plain-{t['agent_id']}") for t in turns]
    assert [r.choices[0].message.content for r in replies] == [p.choices[0].message.content for p in plain]


@contextmanager
def another_chat_in_flight(client):
    """A streamed chat decoding while the block runs, so that the chat requests sent meanwhile are
    not alone at the endpoint (a lone request is never held); its client leaves at the end."""
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3000, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))
    try:
        yield
    finally:
        stream.close()


def grew(after: dict, before: dict, name: str, label: str = "") -> float:
    """How much a /metrics sample (`name{label}`) grew."""
    key = f"{name}{{{label}}}" if label else name
    return after.get(key, 0.0) - before.get(key, 0.0)


def prefilled(replies) -> int:
    """The prompt tokens vLLM computed itself: neither prefix-cache hits nor the mirrors' claims."""
    return sum(r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens for r in replies)


TRANSPARENT = "vllm:tokendance_transparent_requests_total"


def gathered(client, turns) -> list:
    """The turns' chat requests sent together while the server is busy, no round field: the
    replies, once the endpoint gathered them into one round that formed whole, whose mirrors
    claimed shared text."""
    before = prometheus(client)
    with another_chat_in_flight(client), ThreadPoolExecutor(len(turns)) as pool:
        replies = list(pool.map(lambda t: chat(client, list(t.messages)), turns))
    after = prometheus(client)
    assert grew(after, before, TRANSPARENT, 'outcome="member"') == len(turns)
    assert grew(after, before, TRANSPARENT, 'outcome="rounds"') == 1
    assert grew(after, before, "vllm:tokendance_rounds_total", 'formed="complete"') == 1
    assert sum(r.usage.prompt_tokens_details.cached_tokens > 0 for r in replies) >= 2  # the mirrors' claims
    assert grew(after, before, "vllm:tokendance_claimed_tokens_total") > 0
    return replies


def test_undeclared_requests_sharing_text_form_rounds_whoever_wrote_it(server):
    """`transparent_rounds: true`, the `shared` rule: chat requests with no round field, as a real app
    sends them, that come together while the server is busy and share text outside their common
    prefix are gathered into one round (the endpoint's counters and the connector's). Round 1
    shares the seed conversation, which the server never wrote; round 2 also quotes the agents'
    replies. Their mirrors claim the shared text, so vLLM prefills fewer tokens than for the same
    requests in no round (each in a namespace of its own, or one by one: alone at the endpoint,
    never held), and at ratio 1.0 they answer alike."""
    workload = generative_agents(3, 14)
    first = workload.turns(0, [])
    said = gathered(server, first)
    before = prometheus(server)
    with ThreadPoolExecutor(3) as pool:  # together, but sharing nothing: another cache namespace each
        apart = list(pool.map(lambda t: chat(server, list(t.messages), cache_salt=f"apart-{t.agent_id}"), first))
    after = prometheus(server)
    assert grew(after, before, TRANSPARENT, 'outcome="member"') == 0
    assert grew(after, before, TRANSPARENT, 'outcome="passed"') + grew(after, before, TRANSPARENT, 'outcome="alone"') == 3
    assert prefilled(said) < prefilled(apart)
    assert [r.choices[0].message.content for r in said] == [r.choices[0].message.content for r in apart]

    second = workload.turns(1, [{t.agent_id: r.choices[0].message.content.strip() for t, r in zip(first, said)}])
    before = prometheus(server)
    plain = [chat(server, list(t.messages), cache_salt=f"plain-transparent-{t.agent_id}") for t in second]
    after = prometheus(server)
    # one by one, just after a burst that formed a round: each held a window (the first of a step
    # would be), none joins a round
    assert grew(after, before, TRANSPARENT, 'outcome="member"') == 0
    assert grew(after, before, TRANSPARENT, 'outcome="passed"') + grew(after, before, TRANSPARENT, 'outcome="alone"') == 3
    assert grew(after, before, "vllm:tokendance_rounds_total", 'formed="single"') == 3  # keeping its session
    replies = gathered(server, second)
    assert prefilled(replies) < prefilled(plain)
    assert [r.choices[0].message.content for r in replies] == [p.choices[0].message.content for p in plain]


def test_malformed_round_fields_are_refused_with_their_field(server):
    """The round protocol `tokendance serve` speaks (`round_core/protocol.py`): the same limits and
    refused fields, named as it names them."""
    messages = agents(1, seed=12)[0]["messages"]
    for extra, param in (({"agent_id": ""}, "agent_id"), ({"agent_id": "a", "round_size": 2}, "round_size"),
                         ({"agent_id": "a", "round_id": "r", "round_size": "two"}, "round_size"),
                         ({"agent_id": "a", "round_id": "r", "round_size": 4097}, "round_size"),
                         ({"agent_id": "a", "cache_salt": "x" * 1025}, "cache_salt")):
        with pytest.raises(openai.BadRequestError) as refused:
            chat(server, messages, **extra)
        assert refused.value.body["param"] == param
    two = agents(2, seed=12)
    for body, param in (({"stream": True}, "stream"), ({"logprobs": True}, "logprobs"), ({"n": 2}, "n"),
                        ({"agents": [{**two[0], "tools": [{"type": "function", "function": {"name": "f"}}]}, two[1]]},
                         "agents.0.tools"),
                        ({"agents": [two[0], {**two[1], "model": "other"}]}, "agents.1.model")):
        with pytest.raises(openai.BadRequestError) as refused:
            server.post("/rounds", cast_to=object, body={"model": MODEL, "agents": two, **body})
        assert refused.value.body["param"] == param
    # a tag the client wrote itself: checked as the connector reads it, not logged and dropped
    tag = {"round_id": "r", "agent_id": "a", "round_size": 2}
    for extra, param in (({"kv_transfer_params": {"tokendance": {**tag, "recompute_ratio": 2}}, "cache_salt": "s"},
                          "kv_transfer_params.tokendance"),
                         ({"kv_transfer_params": {"tokendance": tag}}, "cache_salt"),
                         ({"kv_transfer_params": {"tokendance": tag}, "cache_salt": "s", "agent_id": "a"},
                          "kv_transfer_params.tokendance")):
        with pytest.raises(openai.BadRequestError) as refused:
            chat(server, messages, **extra)
        assert refused.value.body["param"] == param


def answer_shape(answer: dict) -> dict:
    """The keys of a /v1/rounds answer, level by level."""
    outputs = answer["outputs"]
    return {"answer": sorted(answer), "round": sorted(answer["round"]), "stats": sorted(answer["stats"]),
            "usage": sorted(answer["usage"]), "details": sorted(answer["usage"]["prompt_tokens_details"]),
            "outputs": [sorted(o) for o in outputs], "messages": [sorted(o["message"]) for o in outputs],
            "agent_usage": [sorted(o["usage"]) for o in outputs]}


HI = [{"role": "user", "content": "Say hi."}]
CONTRACT = [  # (path, body without its model, compare the whole error: a round protocol rule, else status and param)
    ("/v1/chat/completions", {"messages": HI, "agent_id": ""}, True),
    ("/v1/chat/completions", {"messages": HI, "agent_id": "anonymous-1"}, True),
    ("/v1/chat/completions", {"messages": HI, "agent_id": "a", "round_size": 2}, True),
    ("/v1/chat/completions", {"messages": HI, "round_id": "r", "round_size": 4097}, True),
    ("/v1/chat/completions", {"messages": HI, "cache_salt": "x" * 1025}, True),
    ("/v1/chat/completions", {"messages": HI, "agent_id": "a", "n": 2}, True),
    ("/v1/completions", {"prompt": "hi", "round_id": "r"}, True),
    ("/v1/rounds", {"agents": [{"agent_id": "a", "messages": HI}] * 2}, True),
    ("/v1/rounds", {"agents": [{"messages": HI}]}, True),
    ("/v1/rounds", {"agents": [{"agent_id": "a", "messages": HI}], "stream": True}, True),
    ("/v1/rounds", {"agents": [{"agent_id": "a", "messages": HI, "tools": [{"type": "function"}]}]}, True),
    ("/v1/rounds", {"agents": [{"agent_id": "a", "messages": HI, "model": "other"}]}, True),
    ("/v1/rounds", {"agents": [{"agent_id": "a", "messages": HI}], "round_id": "mine"}, True),
    ("/v1/rounds", {"agents": [{"agent_id": "a", "messages": HI}], "model": "no-such-model"}, False),
]


def test_round_protocol_contract_both_front_doors_answer_alike(server, serve):
    """The contract: the same requests to `tokendance serve` and to vLLM with the plugin. A round
    answers in the same shape, under each server's configured model name; each mistake in a round
    field or a round's shape gets the same 400 (message, type, param, code); a wrong model the same
    status, naming the same field."""
    vllm_url = str(server.base_url).rstrip("/").removesuffix("/v1")
    doors = ((serve.url, serve.model), (vllm_url, MODEL))
    turns = [{"agent_id": f"contract-{i}", "messages": [{"role": "system", "content": f"You are villager {i}."},
                                                        *HI]} for i in range(2)]
    answers = [post(url, "/v1/rounds", {"model": model, "agents": turns, "max_tokens": 3, "temperature": 0,
                                        "cache_salt": "contract"}) for url, model in doors]
    assert [status for status, _ in answers] == [200, 200], answers
    (_, ours), (_, theirs) = answers
    assert answer_shape(ours) == answer_shape(theirs)
    assert [ours["model"], theirs["model"]] == [serve.model, MODEL]
    for answer in (ours, theirs):
        assert answer["id"] == answer["round"]["round_id"] and answer["round"]["num_agents"] == 2
        assert [o["agent_id"] for o in answer["outputs"]] == ["contract-0", "contract-1"]
        assert answer["stats"]["num_agents"] == 2 and answer["usage"]["prompt_tokens"] > 0
    assert theirs["stats"]["computed_tokens"] is None  # the plugin cannot know it: null, not left out
    for path, body, whole in CONTRACT:
        (status, error), (vllm_status, vllm_error) = (post(url, path, {"model": model, **body}) for url, model in doors)
        assert status == vllm_status != 200, (path, body, error, vllm_error)
        if whole:
            assert error == vllm_error, (path, body)
        else:
            assert error["error"]["param"] == vllm_error["error"]["param"], (path, body, error, vllm_error)


def test_a_clients_own_round_tag_is_checked_on_v1_messages(server):
    """`/v1/messages` forwards `kv_transfer_params` as chat does: a tag the server writes itself
    (`transparent`) or one without a cache_salt is refused there too (no approximate KV in an
    unsalted prefix cache by that route), and a usable one is served."""
    url = str(server.base_url).rstrip("/") + "/messages"
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]}
    tag = {"round_id": "messages-1", "agent_id": "a", "round_size": 1}

    def post(extra: dict) -> tuple[int, dict]:
        request = urllib.request.Request(url, json.dumps({**body, **extra}).encode(),
                                         {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as refused:
            return refused.code, json.loads(refused.read())

    status, reply = post({"kv_transfer_params": {"tokendance": {**tag, "transparent": True}}, "cache_salt": "s"})
    assert status == 400 and reply["error"]["param"] == "kv_transfer_params.tokendance"
    status, reply = post({"kv_transfer_params": {"tokendance": tag}})
    assert status == 400 and reply["error"]["param"] == "cache_salt"
    status, reply = post({"kv_transfer_params": {"tokendance": tag}, "cache_salt": "messages-a"})
    assert status == 200 and reply["content"]


def test_a_round_whose_client_leaves_is_cancelled(server):
    """`POST /v1/rounds` whose client disconnects: its agents' requests are aborted, not run to their
    max_tokens (vLLM counts the tokens they generated)."""
    url = str(server.base_url).rstrip("/").removesuffix("/v1")
    generated = "vllm:generation_tokens_total"
    before = prometheus(server)[generated]
    data = json.dumps({"model": MODEL, "max_tokens": 3000, "ignore_eos": True, "agents": agents(3, seed=13)}).encode()
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as raw:
        raw.sendall(f"POST /v1/rounds HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_for(lambda: prometheus(server).get("vllm:num_requests_running", 0) >= 3)
    wait_for(lambda: prometheus(server).get("vllm:num_requests_running", 0) == 0)
    assert 3 <= prometheus(server)[generated] - before < 3000  # one agent alone would have made 3,000


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_bench_target_reads_the_session_store(server, tmp_path):
    """Declared rounds through `tokendance bench --target`: every agent's request is kept in the
    session store (its gauges on /metrics), and the bench prints what it holds."""
    out = tmp_path / "store.json"
    url = str(server.base_url).rstrip("/")
    result = subprocess.run([sys.executable, "-m", "tokendance.cli", "bench", "--target", url, "--target-model", MODEL,
                             "--workload", "generative-agents", "--agents", "3", "--rounds", "2", "--declare-rounds",
                             "--max-tokens", "8", "--cache-salt", "store-bench", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rounds"]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["store"]["store_agents"] >= 3 and r["store"]["store_bytes"] > 0 for r in rows)
    assert "the session store after the round" in result.stdout
