"""Where a request should run when several engine replicas serve one endpoint (`tokendance serve
--replicas K`): the routing key of a request, and the policy that maps keys to replicas. Plain
Python, no Ray: the Ray Serve request router (`server/replicas.py`) applies it, and tests check
it alone.

Sharing only pays when the agents of a round meet on one replica, and an agent's session only
helps if its next turn returns there. So:

- a round (`/v1/rounds`, or chat requests with a `round_id`) goes whole to one replica: the one
  that already owns the round, else the one holding most of its agents' sessions, else the least
  loaded;
- an agent's turn (`agent_id`) goes to the replica holding its session;
- anything else goes by prefix affinity with bounded load: the replica its prompt's opening hashes
  to (rendezvous hashing, so it sticks as replicas come and go), unless that replica runs
  `PREFIX_SLACK` more requests than the least loaded one.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PREFIX_CHARS = 512  # the opening of a prompt that prefix affinity hashes
PREFIX_SLACK = 4  # requests a preferred replica may run beyond the least loaded before it is passed over
MAX_OWNED_KEYS = 100_000  # rounds and agents whose replica the router remembers (least recent forgotten)


@dataclass(frozen=True)
class Route:
    """How to route one request. `kind`: "round" | "session" | "prefix" | "any" | "replica".
    `agents` are the agents whose sessions the request reads (namespaced); `replica` picks one
    replica by its rank (broadcasts to every replica)."""

    kind: str
    key: str = ""
    agents: tuple[str, ...] = ()
    replica: int | None = None


def cache_namespace(tenant: str | None, cache_salt: str | None) -> str:
    """The cache namespace of a request: its `cache_salt`, within its API key's tenant. Requests
    in different namespaces never share KV."""
    return f"{tenant}/{cache_salt or ''}" if tenant else cache_salt or ""


def agent_key(namespace: str, agent_id: str) -> str:
    """The engine's (and the router's) name for a client's agent: scoped by cache namespace, so
    tenants that pick the same agent id never share a session."""
    scope = hashlib.sha256(namespace.encode()).hexdigest()[:16] if namespace else ""
    return f"agent:{scope}:{agent_id}"


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/rounds")


def route_for(method: str, path: str, body: bytes, namespace: str) -> Route:
    """The route of an HTTP request, from its body's routing fields (a body that is not JSON, or
    not an object, routes anywhere: the replica answers its error)."""
    if method != "POST" or path not in GENERATION_PATHS:
        return Route("any")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return Route("any")
    if not isinstance(data, dict):
        return Route("any")
    salt = data.get("cache_salt")
    scope = cache_namespace(namespace, salt if isinstance(salt, str) else None)
    if path == "/v1/rounds":
        agents = data.get("agents")
        ids = [a.get("agent_id") for a in agents if isinstance(a, dict)] if isinstance(agents, list) else []
        names = tuple(agent_key(scope, a) for a in ids if isinstance(a, str))
        return Route("round", f"{scope}|round|{'|'.join(sorted(names))}", names)
    agent, round_id = data.get("agent_id"), data.get("round_id")
    agents = (agent_key(scope, agent),) if isinstance(agent, str) else ()
    if isinstance(round_id, str):
        return Route("round", f"{scope}|round|{round_id}", agents)
    if agents:
        return Route("session", agents[0], agents)
    return Route("prefix", f"{scope}|{_opening(data)}")


def _opening(data: dict) -> str:
    """The first characters of a request's prompt: its messages' texts (a response's
    instructions and input items), or its prompt."""
    messages, parts = data.get("messages"), []
    if "input" in data:
        instructions, items = data.get("instructions"), data.get("input")
        messages = [{"content": instructions}] * isinstance(instructions, str) + (
            items if isinstance(items, list) else [{"content": items}])
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            parts.append(content if isinstance(content, str) else json.dumps(content, sort_keys=True))
            if sum(map(len, parts)) >= PREFIX_CHARS:
                break
    else:
        prompt = data.get("prompt")
        parts.append(prompt if isinstance(prompt, str) else json.dumps(prompt)[:PREFIX_CHARS])
    return "\n".join(parts)[:PREFIX_CHARS]


def rendezvous(key: str, replicas: Sequence[str]) -> list[str]:
    """Replicas ranked for `key` by highest random weight: a key keeps its replica when others
    join or leave."""
    def weight(replica: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()

    return sorted(replicas, key=weight, reverse=True)


class Placement:
    """The routing policy over replica names. Invariant: `owner` maps round keys and agents to a
    replica that was alive when they were placed there (a dead one is forgotten as soon as it is
    missing from the candidates)."""

    def __init__(self):
        self.owner: OrderedDict[str, str] = OrderedDict()

    def choose(self, route: Route, replicas: Sequence[str], load: Callable[[str], int]) -> list[str]:
        """`replicas` alive now (in a stable order); `load(r)`: requests running on r. Returns the
        replicas in order of preference (the first is where the request should run)."""
        replicas = list(replicas)
        if not replicas:
            return []
        if route.kind == "replica":
            return [replicas[route.replica % len(replicas)]]
        if route.kind in ("round", "session"):
            chosen = self._owned(route, replicas, load)
            for key in (route.key, *route.agents):
                self._remember(key, chosen)
        elif route.kind == "prefix":
            preferred = rendezvous(route.key, replicas)[0]
            least = min(replicas, key=load)
            chosen = preferred if load(preferred) <= load(least) + PREFIX_SLACK else least
        else:
            chosen = min(replicas, key=load)
        return [chosen] + [r for r in replicas if r != chosen]

    def _owned(self, route: Route, replicas: list[str], load: Callable[[str], int]) -> str:
        alive = set(replicas)
        owner = self.owner.get(route.key)
        if owner in alive:
            return owner
        votes: dict[str, int] = {}
        for agent in route.agents:
            holder = self.owner.get(agent)
            if holder in alive:
                votes[holder] = votes.get(holder, 0) + 1
        if votes:  # where most of its agents' sessions are
            return max(rendezvous(route.key, replicas), key=lambda r: votes.get(r, 0))
        owned = {r: 0 for r in replicas}
        for holder in self.owner.values():
            if holder in owned:
                owned[holder] += 1
        # the least loaded, counting what it already owns; ties go by the key's hash
        return min(rendezvous(route.key, replicas), key=lambda r: (load(r), owned[r]))

    def _remember(self, key: str, replica: str) -> None:
        self.owner[key] = replica
        self.owner.move_to_end(key)
        while len(self.owner) > MAX_OWNED_KEYS:
            self.owner.popitem(last=False)
