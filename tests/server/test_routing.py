"""The replica routing policy on its own (no Ray, no model): routing keys from request bodies, and
where rounds, sessions and plain requests go as replicas load up, die and come back."""

from __future__ import annotations

import json

from tokendance.server.routing import (
    PREFIX_SLACK,
    Placement,
    Route,
    agent_key,
    cache_namespace,
    rendezvous,
    route_for,
)

REPLICAS = ["r0", "r1", "r2"]


def body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def idle(_replica: str) -> int:
    return 0


def test_routes_come_from_the_routing_fields_of_a_body():
    rounds = route_for("POST", "/v1/rounds", body(cache_salt="sim", agents=[{"agent_id": "b"}, {"agent_id": "a"}]), "")
    same = route_for("POST", "/v1/rounds", body(cache_salt="sim", agents=[{"agent_id": "a"}, {"agent_id": "b"}]), "")
    sim = cache_namespace(None, "sim")
    assert rounds.kind == "round" and rounds.key == same.key
    assert set(rounds.agents) == {agent_key(sim, "a"), agent_key(sim, "b")}  # the engine's names of the agents
    turn = route_for("POST", "/v1/chat/completions", body(cache_salt="sim", agent_id="a", round_id="r1"), "")
    assert (turn.kind, turn.agents) == ("round", (agent_key(sim, "a"),))
    tenant = route_for("POST", "/v1/chat/completions", body(agent_id="a"), "tenant")
    assert tenant.key == agent_key(cache_namespace("tenant", None), "a") != agent_key(sim, "a")
    plain = route_for("POST", "/v1/completions", body(prompt="Once upon a time"), "")
    assert plain.kind == "prefix" and plain.key.endswith("Once upon a time")
    assert route_for("POST", "/v1/chat/completions", b"{not json", "").kind == "any"
    assert route_for("POST", "/v1/chat/completions", b"[1, 2]", "").kind == "any"
    assert route_for("GET", "/v1/models", b"", "").kind == "any"


def test_a_round_goes_whole_to_one_replica_and_its_agents_follow_it():
    placement = Placement()
    agents = tuple(f"sim|agent{i}" for i in range(4))
    first = {placement.choose(Route("round", "sim|round|1", (a,)), REPLICAS, idle)[0] for a in agents}
    assert len(first) == 1  # every agent's turn of the round on one replica
    home = first.pop()
    # the next round of the same agents goes where their sessions are, even if it is busier
    busy = {home: 10}
    assert placement.choose(Route("round", "sim|round|2", agents[:1]), REPLICAS, lambda r: busy.get(r, 0))[0] == home
    assert placement.choose(Route("session", agents[2], agents[2:3]), REPLICAS, idle)[0] == home


def test_independent_simulations_spread_over_replicas():
    placement = Placement()
    homes = [placement.choose(Route("round", f"sim{s}|round", tuple(f"sim{s}|a{i}" for i in range(4))), REPLICAS, idle)[0]
             for s in range(3)]
    assert sorted(homes) == REPLICAS  # each new one on the replica owning the least


def test_a_dead_replicas_rounds_move_and_stay_together():
    placement = Placement()
    agents = ("sim|a0", "sim|a1")
    home = placement.choose(Route("round", "sim|round", agents), REPLICAS, idle)[0]
    alive = [r for r in REPLICAS if r != home]
    moved = {placement.choose(Route("round", "sim|round", (a,)), alive, idle)[0] for a in agents}
    assert len(moved) == 1 and moved != {home}
    assert placement.choose(Route("session", "sim|a0", ("sim|a0",)), REPLICAS, idle)[0] == moved.pop()


def test_prefix_affinity_sticks_until_the_replica_is_too_busy():
    placement = Placement()
    route = Route("prefix", "/|You are a helpful assistant.")
    preferred = placement.choose(route, REPLICAS, idle)[0]
    assert preferred == rendezvous(route.key, REPLICAS)[0]
    assert placement.choose(route, REPLICAS, lambda r: PREFIX_SLACK if r == preferred else 0)[0] == preferred
    other = placement.choose(route, REPLICAS, lambda r: PREFIX_SLACK + 1 if r == preferred else 0)[0]
    assert other != preferred


def test_rendezvous_moves_only_the_keys_of_a_replica_that_leaves():
    keys = [f"key{i}" for i in range(200)]
    before = {k: rendezvous(k, REPLICAS)[0] for k in keys}
    after = {k: rendezvous(k, REPLICAS[:2])[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "r2")
    assert len({before[k] for k in keys}) == 3  # and keys spread over every replica


def test_a_replica_can_be_addressed_by_rank_for_broadcasts():
    placement = Placement()
    assert [placement.choose(Route("replica", replica=i), REPLICAS, idle)[0] for i in range(4)] == REPLICAS + ["r0"]
