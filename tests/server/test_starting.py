"""`tokendance serve` from its first second: arguments refused before the model loads, the port
answering 503 while it loads, a failed load reported in one line, and the operator's max_tokens
policy (`--default-max-tokens`, `--max-tokens-limit`)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import openai
import pytest
import uvicorn

from tests.helpers import kv_bytes, serving
from tokendance.cli import main
from tokendance.server.app import create_app
from tokendance.server.config import ServerConfig
from tokendance.server.starting import StartingApp


class Background:
    """uvicorn serving `app` on a free port of 127.0.0.1 from a thread."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn did not start"
            self.thread.join(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def get(self, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
        import http.client

        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request(method, path)
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_the_port_answers_503_until_the_app_is_built_then_serves_it(make_llm):
    release, failures = threading.Event(), []

    def build():
        release.wait(60)
        return create_app(make_llm(), ServerConfig(model_name="m"))

    starting = StartingApp(build, failures.append)
    server = Background(starting)
    try:
        status, headers, body = server.get("/health")
        assert (status, json.loads(body)) == (503, {"status": "loading"}) and headers["retry-after"].isdigit()
        assert server.get("/health", "HEAD")[:1] == (503,)
        status, headers, body = server.get("/v1/models")
        assert status == 503 and json.loads(body)["error"]["code"] == "model_loading" and "retry-after" in headers
        release.set()
        starting._loader.join(120)
        assert not failures and starting.app is not None
        status, _, body = server.get("/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "m"
        assert server.get("/health")[0] == 200
    finally:
        release.set()
        server.stop()
    assert not starting.app.state.engine_loop.is_alive  # stopped with the server


def test_a_failed_build_is_reported_and_nothing_is_served():
    failures = []

    def build():
        raise RuntimeError("no such weights")

    starting = StartingApp(build, failures.append)
    server = Background(starting)
    try:
        starting._loader.join(30)
        assert [str(f) for f in failures] == ["no such weights"] and starting.app is None
        assert server.get("/health")[0] == 503
    finally:
        server.stop()


@pytest.mark.parametrize("argv, message", [
    (["serve", "--recompute-ratio", "3"], "recompute_ratio must be in [0, 1]"),
    (["serve", "--model", "no/such/model.gguf"], "model path does not exist"),
    (["serve", "--default-max-tokens", "9", "--max-tokens-limit", "8"], "default_max_tokens (9) is above"),
    (["serve", "--max-num-seqs", "0"], "max_num_seqs"),
    (["serve", "--fidelity", "exact", "--reuse", "full"], "drop one of them"),
    (["generate", "--max-tokens", "-3", "hi"], "max_tokens must be an integer >= 1"),
    (["generate", ""], "the prompt is empty"),
    (["chat", "--model", "no/such/folder", "-m", "hi"], "model path does not exist"),
])
def test_bad_arguments_are_one_line_before_anything_loads(capsys, argv, message):
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert "loading" not in out  # refused before the load began (and no port was bound)
    with pytest.raises(Exception, match=message.split("(")[0].split("[")[0]):
        main(["--debug", *argv])  # --debug: the exception itself, traceback and all


def test_a_model_that_fails_to_load_stops_the_server_with_one_line(tmp_path):
    """The folder passes the quick checks (a supported config, the files are there); its weights
    do not load: the server, which bound its port and said it is loading, exits with status 1."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    result = subprocess.run([sys.executable, "-m", "tokendance.cli", "serve", "--port", "0", "--model", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "loading" in result.stdout and "serving" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def capped(model_weights):
    """Started as a user starts one: warmed up before it is ready (the other servers of the tests
    start without warm-up)."""
    yield from serving("--default-max-tokens", "5", "--max-tokens-limit", "8", "--gather-window-ms", "0",
                       "--kv-cache-bytes", kv_bytes(2912), warm_up=True)


LONG = [{"role": "user", "content": "Write a long story about a dragon who learns to sing."}]


def test_a_server_warms_up_before_it_is_ready_unless_told_not_to(plain_server, capped):
    warmed, cold = capped.output(tail=None), plain_server.output(tail=None)
    assert "warming up (compiling the kernels)" in warmed and "ready in" in warmed
    assert warmed.index("warming up") < warmed.index("ready in")
    assert "ready in" in cold and "warming up" not in cold and "--no-warm-up: the first requests" in cold


def test_default_max_tokens_caps_requests_that_send_none(capped):
    client = capped.client()
    chat = client.chat.completions.create(model=capped.model, messages=LONG, temperature=0)
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    response = client.responses.create(model=capped.model, input=LONG[0]["content"], temperature=0)
    assert response.usage.output_tokens == 5 and response.status == "incomplete"
    asked = client.chat.completions.create(model=capped.model, messages=LONG, temperature=0, max_tokens=7)
    assert asked.usage.completion_tokens == 7  # a request's own max_tokens, up to the limit, is kept
    completion = client.completions.create(model=capped.model, prompt="Once upon a time", temperature=0)
    assert completion.usage.completion_tokens <= 8  # the legacy default of 16, held to the limit


@pytest.mark.parametrize("route, fields, param", [
    ("/v1/chat/completions", {"messages": LONG, "max_tokens": 9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": LONG, "max_completion_tokens": 100}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 9}, "max_tokens"),
    ("/v1/responses", {"input": "Once", "max_output_tokens": 9}, "max_output_tokens"),
    ("/v1/rounds", {"agents": [{"agent_id": "a", "messages": LONG, "max_tokens": 9}]}, "agents.0.max_tokens"),
    ("/v1/rounds", {"max_tokens": 9, "agents": [{"agent_id": "a", "messages": LONG}]}, "max_tokens"),
])
def test_a_request_above_the_limit_is_400_naming_its_field(capped, route, fields, param):
    status, body = capped.post(route, {"model": capped.model, **fields})
    assert status == 400 and body["error"]["param"] == param and "--max-tokens-limit" in body["error"]["message"]
    assert capped.metrics().get("tokendance_requests_in_flight", 0) == 0


def test_the_sdk_sees_the_limit_as_a_bad_request(capped):
    with pytest.raises(openai.BadRequestError, match="at most 8 tokens"):
        capped.client().chat.completions.create(model=capped.model, messages=LONG, max_tokens=50)
