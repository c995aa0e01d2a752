"""`vllm serve` with the TokenDance connector in a subprocess on a free port of 127.0.0.1, for the
tests that go through vLLM's HTTP server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager

import pytest

CONNECTOR = {"kv_connector": "TokenDanceConnector", "kv_role": "kv_both"}


@contextmanager
def vllm_serving(folder, name: str, extra_config: dict | None = None, *args: str, start_timeout_s: float = 400):
    """The server's URL while it runs (float32, prefix caching, enforce_eager, seed 0, 1 GiB of
    KV); stopped after. `args`: more of `vllm serve`'s arguments."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {**CONNECTOR, **({"kv_connector_extra_config": extra_config} if extra_config else {})}
    env = {**os.environ, "VLLM_PLUGINS": "tokendance", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", name,
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
         "--enable-prefix-caching", "--enforce-eager", "--seed", "0", *args, "--kv-transfer-config", json.dumps(config)],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                log.seek(0)
                pytest.fail(f"vllm serve did not start:\n{log.read().decode(errors='replace')[-4000:]}")
            time.sleep(1)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)
