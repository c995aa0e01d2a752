"""The fleet's request router: Ray Serve's hook over the round-aware policy (`routing.py`), and
the routers to compare it with (`ray_routers.py`)."""

from __future__ import annotations

import logging

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tokendance.server.fleet.routing import Route, shared_placement

log = logging.getLogger("tokendance.server")

class KVAffinityRouter(RequestRouter):
    """Ray Serve request router that sends each request where its KV lives (`routing.Placement`).
    Requests carry their `Route` as the `route` keyword argument."""

    def initialize_state(self, **kwargs) -> None:
        self.placement = shared_placement()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route = (pending_request.kwargs.get("route") if pending_request is not None else None) or Route("any")
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache

        def load(name: str) -> int:
            return cache.get(by_name[name].replica_id) or 0

        try:
            names = self.placement.choose(route, sorted(by_name), load)
        except Exception:  # a routing bug must not leave the request waiting: any replica answers it
            log.exception("routing a %r request failed; the least loaded replica takes it", route.kind)
            names = sorted(by_name, key=load)
        ranked = [by_name[name] for name in names]
        # the chosen replica first; the others only if it cannot take the request (full or gone)
        return [rank for rank in (ranked[:1], ranked[1:]) if rank]


def router_config(name: str) -> RequestRouterConfig:
    """The request router of a fleet's replicas: `tokendance` (KVAffinityRouter), `prefix` (Ray
    Serve's PrefixCacheAffinityRouter) or `pow2` (Ray Serve's default, power of two choices)."""
    if name == "tokendance":
        return RequestRouterConfig(request_router_class=KVAffinityRouter)
    if name in ("prefix", "pow2"):
        from tokendance.server.fleet import ray_routers

        return RequestRouterConfig(request_router_class=ray_routers.PrefixRouter if name == "prefix"
                                   else ray_routers.Pow2Router)
    raise ValueError(f"unknown router {name!r}; known: {ROUTERS}")


ROUTERS = ("tokendance", "prefix", "pow2")
