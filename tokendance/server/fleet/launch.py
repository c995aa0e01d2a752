"""`tokendance serve --replicas K`: a Ray cluster, the ingress and K replicas, served until
interrupted."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import ray
from ray import serve

log = logging.getLogger("tokendance.server")
from tokendance.server.fleet.ingress import FleetConfig, Ingress
from tokendance.server.fleet.replica import EngineReplica
from tokendance.server.fleet.router import router_config


def _wait_until_routable(args, server_config, timeout_s: float = 300) -> None:
    """Until the ingress's router sees every replica (Ray reports the app ready before that, and
    a first round placed meanwhile would all land on the one it knows)."""
    import urllib.request

    headers = {"Authorization": f"Bearer {server_config.api_keys[0]}"} if server_config.api_keys else {}
    url, deadline = f"http://{args.host}:{args.port}/v1/replicas", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
                if len(json.load(response)["data"]) >= args.replicas:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    log.warning("not every replica is routable after %.0f s; serving anyway", timeout_s)


def run_replicas(args, llm_args: dict, server_config) -> int:
    """Start (or join, with --ray-address) a Ray cluster, deploy the ingress and K replicas, and
    serve until interrupted."""
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // args.replicas)
    if args.ray_address:
        ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    else:  # a Ray instance of its own: never whatever cluster RAY_ADDRESS or Ray's address file names
        os.environ.pop("RAY_ADDRESS", None)
        # one logical CPU beyond the replicas': a router's helper actor (the prefix tree of Ray's
        # PrefixCacheAffinityRouter) needs one to be placed, and without it every request waits
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
                 num_cpus=max(os.cpu_count() or 1, args.replicas * threads) + 1)
    serve.start(http_options={"host": args.host, "port": args.port})
    options = {"num_replicas": args.replicas, "ray_actor_options": {"num_cpus": threads},
               "request_router_config": router_config(args.router)}
    if args.engine == "vllm":
        from tokendance.server.fleet.vllm_replica import VllmReplica, vllm_launch

        engine = VllmReplica.options(**options).bind(vllm_launch(args, threads, server_config))
    else:
        engine = EngineReplica.options(**options).bind({**llm_args, "num_threads": threads}, server_config,
                                                       args.warm_up)
    fleet = FleetConfig(args.replicas, args.max_round_agents, server_config.gather_window_s, server_config.round_timeout_s)
    serve.run(Ingress.bind(engine, server_config, fleet), name="tokendance", route_prefix="/")
    _wait_until_routable(args, server_config)
    print(f"serving {server_config.model_name or 'the model'} on {args.replicas} {args.engine} replicas "
          f"({threads} threads each, router {args.router}) on http://{args.host}:{args.port}/v1", flush=True)
    stopped: list[int] = []  # a flag only: a handler that takes a lock can deadlock on a second signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: stopped.append(number))
    while not stopped:
        time.sleep(0.2)
    serve.shutdown()
    ray.shutdown()
    return 0
