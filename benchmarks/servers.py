"""What the benchmarks share: free ports, the servers they compare started as a user starts them
(`tokendance serve` by its default and with `--fidelity fast`, plain `vllm serve`, `vllm serve`
with the plugin), and waiting until one is ready."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVERS = ("vllm", "vllm+tokendance", "vllm+transparent", "tokendance", "serve", "serve-fast")
# `tokendance serve` as a user starts it: its default (exact), and --fidelity fast
SERVE_FLAGS = {"serve": [], "serve-fast": ["--fidelity", "fast"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, port: int, args, log) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    model = getattr(args, "model", None)  # a pack's name; None: the default model
    if name in ("tokendance", *SERVE_FLAGS):
        command = [sys.executable, "-m", "tokendance.cli", "serve", "--port", str(port), "--dtype", args.dtype,
                   "--kv-cache-bytes", f"{args.kv_gib}GiB", *(["--model", model] if model else [])]
        # "tokendance": collective reuse with masters in agents' contexts, as the plugin plans them (parity)
        command += SERVE_FLAGS[name] if name in SERVE_FLAGS else ["--reuse", "tokendance", "--masters", "agent",
                                                                  "--recompute-ratio", str(args.ratio)]
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    from tokendance.vllm_plugin.model_folder import model_folder

    env.update(VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               VLLM_NO_USAGE_STATS="1")
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder(model)),
               "--served-model-name", model or "smollm2", "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
               "--max-model-len", "8192", "--enable-prefix-caching", "--seed", "0", "--enable-prompt-tokens-details"]
    command += getattr(args, "vllm_args", [])
    if name in ("vllm+tokendance", "vllm+transparent"):
        env["VLLM_PLUGINS"] = "tokendance"
        config = {"kv_connector": "TokenDanceConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"recompute_ratio": args.ratio,
                                                "store_gib": getattr(args, "store_gib", 0),
                                                "transparent_rounds": name == "vllm+transparent"}}
        if getattr(args, "faults", 0):  # planted faults at every stage (vllm_plugin/faults.py)
            config["kv_connector_extra_config"]["faults"] = {"all": args.faults}
        command += ["--kv-transfer-config", json.dumps(config)]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def healthy(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
        return response.status == 200


def replicas_up(count: int) -> Callable[[int], bool]:
    """Ready once a fleet lists `count` replicas (a single server: once healthy)."""
    def ready(port: int) -> bool:
        if count <= 1:
            return healthy(port)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/replicas", timeout=10) as response:
            return len(json.load(response)["data"]) >= count
    return ready


def wait_ready(port: int, server: subprocess.Popen, log, ready: Callable[[int], bool] = healthy,
               timeout_s: float = 900) -> float:
    """Seconds until `ready(port)`; SystemExit with the server's log if it exits or the time runs out."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if server.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited:\n{log.read().decode(errors='replace')[-3000:]}")
        try:
            if ready(port):
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server was not ready after {timeout_s / 60:.0f} minutes")


@contextmanager
def serving(name: str, args):
    """A fresh server `name`, ready; yields its port, and stops it after."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        server = start(name, port, args, log)
        try:
            ready = wait_ready(port, server, log)
            print(f"{name}: ready after {ready:.0f} s", flush=True)
            yield port
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
