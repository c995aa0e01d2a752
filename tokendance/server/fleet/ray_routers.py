"""Ray Serve's own request routers, for comparison with the round-aware one (`--router prefix`,
`--router pow2`): their policy for every request with a prompt; the endpoint's per-replica calls
(/metrics, /v1/replicas, the placement logs) go to the replica they name whatever the router, so
that every router sees the same fleet, and a request without a body (GET /v1/models) to any. Classes at module level: Ray imports a router
by its module path."""

from __future__ import annotations

# Ray's public path for this router (ray.serve.llm) imports pyarrow, which Ray Serve does not need
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica


class RankAware:
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route = pending_request.kwargs.get("route") if pending_request is not None else None
        if route is not None and route.kind == "replica":
            ranked = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ranked[route.replica % len(ranked)]]] if ranked else []
        if route is not None and route.kind == "any":  # no prompt (GET /v1/models): any replica
            return [candidate_replicas]  # (Ray's prefix router finds no replica for an empty prompt)
        return await super().choose_replicas(candidate_replicas, pending_request)


class PrefixRouter(RankAware, PrefixCacheAffinityRouter):
    """Ray Serve's PrefixCacheAffinityRouter (it reads the prompt from the call's `PromptView`)."""


class Pow2Router(RankAware, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router: the shorter queue of two replicas drawn at random."""
