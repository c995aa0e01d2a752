"""`tokendance serve --replicas K`: a Ray cluster, the ingress and K replicas, served until
interrupted; then nothing it started is left running.

Stopping (SIGTERM or SIGINT, to this process or to its whole process group) shuts Ray Serve and
Ray down, for at most SHUTDOWN_S: a signal sent to the group has already stopped Ray's own
daemons, and Ray's shutdown then never returns. Then every process still below this one is
stopped, SIGTERM then SIGKILL: this process is their child subreaper, so a replica whose raylet
died is still found here. The vLLM replicas' supervisors also watch this process, and stop their
servers if it is killed outright."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import ray
from ray import serve

log = logging.getLogger("tokendance.server")
from tokendance.server.fleet.ingress import FleetConfig, Ingress
from tokendance.server.fleet.replica import EngineReplica
from tokendance.server.fleet.router import router_config
from tokendance.server.fleet.supervise import adopt_orphans, descendants, stop_processes

SHUTDOWN_S = 10.0  # Ray Serve's and Ray's own shutdown, before what is left is stopped


def _wait_until_routable(args, server_config, stopped: list, timeout_s: float = 300) -> None:
    """Until the ingress's router sees every replica (Ray reports the app ready before that, and
    a first round placed meanwhile would all land on the one it knows)."""
    import urllib.request

    headers = {"Authorization": f"Bearer {server_config.api_keys[0]}"} if server_config.api_keys else {}
    url, deadline = f"http://{args.host}:{args.port}/v1/replicas", time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopped:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
                if len(json.load(response)["data"]) >= args.replicas:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    if not stopped:
        log.warning("not every replica is routable after %.0f s; serving anyway", timeout_s)


def run_replicas(args, llm_args: dict, server_config) -> int:
    """Start (or join, with --ray-address) a Ray cluster, deploy the ingress and K replicas, and
    serve until interrupted."""
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // args.replicas)
    if args.engine == "vllm":  # its settings checked before any Ray process starts
        from tokendance.server.fleet.vllm_replica import VllmReplica, vllm_launch

        launch = vllm_launch(args, threads, server_config)
    if args.ray_address:
        ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    else:  # a Ray instance of its own: never whatever cluster RAY_ADDRESS or Ray's address file names
        os.environ.pop("RAY_ADDRESS", None)
        adopt_orphans()
        # one logical CPU beyond the replicas': a router's helper actor (the prefix tree of Ray's
        # PrefixCacheAffinityRouter) needs one to be placed, and without it every request waits
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
                 num_cpus=max(os.cpu_count() or 1, args.replicas * threads) + 1)
    # after ray.init (whose own handler would abort this process, leaving the replicas running)
    stopped: list[int] = []  # a flag only: a handler that takes a lock can deadlock on a second signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: stopped.append(number))
    serve.start(http_options={"host": args.host, "port": args.port})
    options = {"num_replicas": args.replicas, "ray_actor_options": {"num_cpus": threads},
               "request_router_config": router_config(args.router)}
    if args.engine == "vllm":
        engine = VllmReplica.options(**options).bind(launch)
    else:
        engine = EngineReplica.options(**options).bind({**llm_args, "num_threads": threads}, server_config,
                                                       args.warm_up)
    fleet = FleetConfig(args.replicas, args.max_round_agents, server_config.gather_window_s, server_config.round_timeout_s)
    serve.run(Ingress.bind(engine, server_config, fleet), name="tokendance", route_prefix="/")
    _wait_until_routable(args, server_config, stopped)
    print(f"serving {server_config.model_name or 'the model'} on {args.replicas} {args.engine} replicas "
          f"({threads} threads each, router {args.router}) on http://{args.host}:{args.port}/v1", flush=True)
    while not stopped:
        time.sleep(0.2)
    shut_down(own_cluster=not args.ray_address)
    return 0


def shut_down(own_cluster: bool) -> None:
    """Ray Serve and Ray, for at most SHUTDOWN_S; then, where the cluster is this process's own,
    every process still below it."""
    def shutdown() -> None:
        try:
            serve.shutdown()
            ray.shutdown()
        except Exception as exc:  # a cluster half gone (its daemons stopped by the same signal)
            log.warning("Ray's shutdown failed: %r", exc)

    worker = threading.Thread(target=shutdown, daemon=True)
    worker.start()
    worker.join(SHUTDOWN_S)
    if worker.is_alive():
        log.warning("Ray's shutdown did not finish in %.0f s; stopping its processes", SHUTDOWN_S)
    if own_cluster:
        left = stop_processes(descendants(os.getpid()))
        if left:
            log.warning("processes that could not be stopped: %s", left)
