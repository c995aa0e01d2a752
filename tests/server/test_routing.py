"""The replica routing policy on its own (no Ray, no model): routing keys from request bodies, and
where rounds, sessions and plain requests go as replicas load up, die and come back; split rounds,
a placement rebuilt from the replicas' logs, and transparent rounds gathered before routing."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from tokendance.round_core.gathering import Door
from tokendance.round_core.protocol import merge_round_answers, round_answer, turn_usage
from tokendance.server.fleet.routing import (
    PREFIX_SLACK,
    GroupFill,
    KeyLog,
    Placement,
    PromptView,
    Route,
    TransparentHold,
    agent_key,
    cache_namespace,
    fill_groups,
    group_routes,
    group_sizes,
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


def test_bodies_the_replica_refuses_still_route():
    """A body nested too deeply for Python's JSON parser routes anywhere (the replica answers its
    400), and text with a lone surrogate (valid JSON: "\\ud800") hashes like any other."""
    assert route_for("POST", "/v1/chat/completions", b"[" * 100_000, "") == Route("any")
    odd = route_for("POST", "/v1/completions", b'{"model": "m", "prompt": "\\ud800", "cache_salt": "\\udfff"}', "")
    assert odd.kind == "prefix" and Placement().choose(odd, REPLICAS, idle)[0] in REPLICAS
    agent = route_for("POST", "/v1/chat/completions", body(agent_id="\ud800", messages=[]), "t")
    assert agent.kind == "session" and Placement().choose(agent, REPLICAS, idle)[0] in REPLICAS


def test_a_replica_can_be_addressed_by_rank_for_broadcasts():
    placement = Placement()
    assert [placement.choose(Route("replica", replica=i), REPLICAS, idle)[0] for i in range(4)] == REPLICAS + ["r0"]


def test_a_round_larger_than_a_replica_takes_is_split_into_even_groups_placed_apart():
    assert group_sizes(5, None) == [5] and group_sizes(3, 3) == [3]
    assert group_sizes(5, 3) == [3, 2] and group_sizes(7, 3) == [3, 2, 2] and group_sizes(9, 3) == [3, 3, 3]
    for n in range(1, 40):
        for most in range(1, 9):
            sizes = group_sizes(n, most)
            assert sum(sizes) == n and max(sizes) <= most and max(sizes) - min(sizes) <= 1
            assert len(sizes) == -(-n // most)  # the fewest groups
    whole = route_for("POST", "/v1/rounds", body(agents=[{"agent_id": f"a{i}"} for i in range(6)]), "")
    routes = group_routes(whole, [whole.agents[0:2], whole.agents[2:4], whole.agents[4:6]])
    assert [r.agents for r in routes] == [whole.agents[0:2], whole.agents[2:4], whole.agents[4:6]]
    placement, placed = Placement(), []
    for route in routes:  # placed one after the other, as the router sees them
        placed.append(placement.choose(route, REPLICAS, idle)[0])
    assert sorted(placed) == REPLICAS  # each group on a replica of its own
    two = [placement.choose(r, REPLICAS[:2], idle)[0] for r in group_routes(Route("round", "other"), [()] * 3)]
    assert sorted(two.count(r) for r in REPLICAS[:2]) == [1, 2]  # more groups than replicas: as even as they go


def test_a_split_rounds_members_keep_their_replicas_from_round_to_round():
    placement, agents = Placement(), [f"agent:{i}" for i in range(8)]

    def run_round(index: int, order: list[int]) -> dict[str, str]:
        """A declared round of the 8 agents in groups of at most 4, members arriving in `order` as
        the endpoint sees them (`GroupFill`), each group placed when its first member is routed."""
        whole, fill, where = Route("round", f"sim|round|{index}"), GroupFill(group_sizes(8, 4)), {}
        routes = group_routes(whole, [()] * 2)
        for i in order:
            placed = [placement.owner.get(r.key) for r in routes]
            group = fill.join(placement.owner.get(agents[i]), placed)
            route = Route("round", routes[group].key, (agents[i],), siblings=routes[group].siblings)
            where[agents[i]] = placement.choose(route, REPLICAS[:2], idle)[0]
        assert fill.full and fill.count == [4, 4]
        return where

    first = run_round(1, list(range(8)))
    assert sorted(first.values()) == ["r0"] * 4 + ["r1"] * 4  # the groups placed apart
    for index, order in enumerate(([7, 6, 5, 4, 3, 2, 1, 0], [1, 3, 5, 7, 0, 2, 4, 6], [0, 7, 1, 6, 2, 5, 3, 4]), 2):
        assert run_round(index, order) == first  # whatever order they come in, each agent stays put
    # a group whose agents' sessions are all on r0 still goes apart from a sibling placed there
    crowded = group_routes(Route("round", "sim|round|crowded"), [agents[:4], agents[4:]])
    assert {placement.choose(r, REPLICAS[:2], idle)[0] for r in crowded} == {"r0", "r1"}
    # /v1/rounds: all members known at once, grouped by where their sessions are, in request order
    groups = fill_groups(Route("round", "sim|round|all"), [first[a] for a in agents], [4, 4], placement)
    assert sorted(map(tuple, groups)) == sorted(tuple(i for i in range(8) if first[agents[i]] == r) for r in ("r0", "r1"))
    assert fill_groups(Route("round", "new"), [None] * 5, [3, 2], Placement()) == [[0, 1, 3], [2, 4]]


def test_a_restarted_router_rebuilds_its_placement_from_the_replicas_logs():
    logs = {r: KeyLog() for r in REPLICAS}
    first = Placement()
    moved = route_for("POST", "/v1/chat/completions", body(agent_id="moved"), "")
    for i in range(6):
        route = route_for("POST", "/v1/chat/completions", body(agent_id=f"a{i}", round_id=f"r{i % 2}"), "")
        logs[first.choose(route, REPLICAS, idle)[0]].note(route)
    logs["r0"].note(moved)
    logs["r2"].note(moved)  # sent to r2 later (r0 died meanwhile, say): r2 holds it now
    logs["r1"].note(Route("prefix", "|hello"))  # not a placement: never logged
    restarted = Placement()
    assert restarted.restore({r: json.loads(json.dumps(log.keys())) for r, log in logs.items()}) == 9
    for key, replica in first.owner.items():
        assert restarted.owner[key] == replica
    assert restarted.owner[moved.key] == "r2"
    assert restarted.choose(moved, REPLICAS, lambda r: 100 if r == "r2" else 0)[0] == "r2"


def test_a_route_avoids_the_replica_that_failed_it_and_its_agents_move():
    placement = Placement()
    route = route_for("POST", "/v1/chat/completions", body(agent_id="x"), "")
    home = placement.choose(route, REPLICAS, idle)[0]
    retry = Route(route.kind, route.key, route.agents, avoid=(home,))
    elsewhere = placement.choose(retry, REPLICAS, idle)[0]
    assert elsewhere != home
    assert placement.choose(route, REPLICAS, idle)[0] == elsewhere  # its next turn follows
    assert placement.choose(Route("any", avoid=tuple(REPLICAS)), REPLICAS, idle)  # nowhere else: anywhere


def test_ray_serves_prefix_router_reads_the_prompt_of_a_request():
    chat = PromptView({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.messages == [{"role": "user", "content": "hi"}] and not hasattr(chat, "prompt")
    completion = PromptView({"prompt": "Once upon a time"})
    assert completion.prompt == "Once upon a time" and not hasattr(completion, "messages")


@dataclass(frozen=True)
class Fleet:
    num_replicas: int = 2
    max_round_agents: int | None = 2
    gather_window_s: float = 0.05
    round_timeout_s: float = 1.0


def test_chat_requests_sharing_text_leave_the_hold_together_and_the_rest_as_they_came():
    feed = "The mill by the river burned down last night, and nobody knows why yet."

    def chat(name: str, shared: bool) -> dict:
        said = feed if shared else f"{name} has nothing to share with anybody here today, really."
        return {"model": "m", "messages": [{"role": "system", "content": f"You are {name}."},
                                           {"role": "user", "content": said}]}

    door = Door()

    async def gather():
        hold = TransparentHold(Fleet(), door)
        names = ["ann", "bob", "cid", "dan"]
        requests = [chat(n, shared=n != "dan") for n in names]
        fallbacks = [Route("prefix", f"sim|{n}") for n in names]
        return await asyncio.gather(*(hold.route(r, f, "sim") for r, f in zip(requests, fallbacks))), hold

    routes, hold = asyncio.run(gather())
    assert routes[3] == Route("prefix", "sim|dan")  # shares nothing: as it came
    assert [r.kind for r in routes[:3]] == ["round"] * 3
    assert routes[0] == routes[1] != routes[2]  # three members, at most two per replica: groups 2 + 1
    assert routes[2].key in routes[0].siblings and len(hold.fallbacks) == 0 and len(hold.held) == 0
    fresh = Door()
    fresh.enter()
    assert not fresh.holds()  # alone, and no burst before it: goes on at once
    fresh.enter()
    assert fresh.holds()  # another chat at the door
    door.enter(), door.leave(), door.enter()
    assert door.holds()  # alone, but the door just emptied after a burst that formed a round


def test_a_split_rounds_answers_merge_in_the_requests_order_with_the_split():
    def part(agents: list[str], seconds: float, computed: int) -> dict:
        outputs = [{"agent_id": a, "message": {"role": "assistant", "content": a.upper()}, "finish_reason": "stop",
                    "usage": turn_usage(10, 2, 4)} for a in agents]
        return round_answer("round-1", "m", outputs, {"mode": "vllm+tokendance", "num_agents": len(agents),
                                                      "round_seconds": seconds, "prompt_tokens": 10 * len(agents),
                                                      "computed_tokens": computed, "compression": 2.0 * len(agents)})

    merged = merge_round_answers([part(["a", "b"], 1.5, 7), part(["c"], 2.5, 3)], ["r0", "r1"])
    assert [o["agent_id"] for o in merged["outputs"]] == ["a", "b", "c"]
    mixed = merge_round_answers([part(["c", "a"], 1.5, 7), part(["b"], 2.5, 3)], ["r0", "r1"], ["a", "b", "c"])
    assert [o["agent_id"] for o in mixed["outputs"]] == ["a", "b", "c"]  # groups made by replica, not by order
    assert mixed["split"] == [{"replica": "r0", "agents": ["c", "a"]}, {"replica": "r1", "agents": ["b"]}]
    assert merged["split"] == [{"replica": "r0", "agents": ["a", "b"]}, {"replica": "r1", "agents": ["c"]}]
    assert merged["usage"] == turn_usage(30, 6, 12) and merged["round"]["num_agents"] == 3
    stats = merged["stats"]
    assert stats["num_agents"] == 3 and stats["round_seconds"] == 2.5 and stats["prompt_tokens"] == 30
    assert stats["computed_tokens"] == 10 and stats["mode"] == "vllm+tokendance"
    assert stats["compression"] == (4.0 * 2 + 2.0 * 1) / 3  # a ratio: the agents' mean
    assert stats["kv_bytes_per_agent"] is None  # no group knew it
