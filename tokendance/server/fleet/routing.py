"""Where a request should run when several engine replicas serve one endpoint (`tokendance serve
--replicas K`): the routing key of a request, and the policy that maps keys to replicas. Plain
Python, no Ray: the Ray Serve request router (`server/fleet/router.py`) applies it, and tests check
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

The same policy serves both engines' fleets (`tokendance serve --replicas K`, with `--engine
vllm` a fleet of vLLM servers with the connector). Two more rules come from the endpoint
(`replicas.py`): undeclared chat requests that share text are gathered into one round before they
are routed (`transparent_route`), and a round with more agents than a replica takes
(`--max-round-agents`) is split into groups (`group_sizes`), each group a round of its own.
Each replica logs the keys it was sent (`KeyLog`), so a restarted endpoint rebuilds its placement
from them (`Placement.restore`).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokendance.round_core.gathering import ChatTurn, Door, HeldTurns, ReadyWork, chat_lines, conversation_id

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
    avoid: tuple[str, ...] = ()  # replicas that already failed this request
    siblings: tuple[str, ...] = ()  # the other groups of a split round: placed apart where they can be


class PromptView:
    """What Ray Serve's own prefix-aware router reads of a request: its `messages` (a chat) or its
    `prompt` (anything else), as an argument of the replica's call."""

    def __init__(self, data):
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list):
            self.messages = messages
        else:
            self.prompt = _opening(data) if isinstance(data, dict) else ""


def cache_namespace(tenant: str | None, cache_salt: str | None) -> str:
    """The cache namespace of a request: its `cache_salt`, within its API key's tenant. Requests
    in different namespaces never share KV."""
    return f"{tenant}/{cache_salt or ''}" if tenant else cache_salt or ""


def agent_key(namespace: str, agent_id: str) -> str:
    """The engine's (and the router's) name for a client's agent: scoped by cache namespace, so
    tenants that pick the same agent id never share a session."""
    scope = hashlib.sha256(_utf8(namespace)).hexdigest()[:16] if namespace else ""
    return f"agent:{scope}:{agent_id}"


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/rounds")


def route_for(method: str, path: str, body: bytes, namespace: str) -> Route:
    """The route of an HTTP request, from its body's routing fields (a body that is not JSON, or
    not an object, routes anywhere: the replica answers its error)."""
    if method != "POST" or path not in GENERATION_PATHS:
        return Route("any")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # the replica answers what is wrong
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


def transparent_route(namespace: str, conversations: Sequence[str]) -> Route:
    """The route of a transparent round's members (one round: one replica), placed where most of
    their conversations were."""
    names = tuple(sorted(set(conversations)))
    digest = hashlib.sha256(_utf8("|".join(names))).hexdigest()[:16]
    return Route("round", f"{namespace}|transparent|{digest}", names)


def group_routes(route: Route, groups: Sequence[Sequence[str]]) -> list[Route]:
    """The routes of a round split in `groups` (each its agents' names, or empty where they are not
    known yet): each group a round of its own, placed apart from the others where the replicas allow."""
    keys = [f"{route.key}~{g}" for g in range(len(groups))]
    return [Route("round", key, tuple(groups[g]), siblings=tuple(k for k in keys if k != key))
            for g, key in enumerate(keys)]


class GroupFill:
    """How the members of a split round fill its groups (of `sizes`), one at a time: a member joins
    the group on the replica that holds its session while it has room (the first member from a
    replica claims an unplaced group for it), else the group with the most room left. Every group
    ends with exactly its size, and a round's members keep their replicas from round to round."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.count = [0] * len(sizes)
        self.claimed: list[str | None] = [None] * len(sizes)  # the replica a group's first member came from

    def join(self, holder: str | None, placed: Sequence[str | None]) -> int:
        """The group of a member whose session is on `holder` (None: nowhere yet); `placed`: the
        replica each group was placed on (None: not yet)."""
        where = [p or c for p, c in zip(placed, self.claimed)]
        room = [g for g, size in enumerate(self.sizes) if self.count[g] < size]
        group = next((g for g in room if holder is not None and where[g] == holder), None)
        if group is None and holder is not None and holder not in where:
            group = next((g for g in room if where[g] is None), None)
            if group is not None:
                self.claimed[group] = holder
        if group is None:
            group = max(room, key=lambda g: (self.sizes[g] - self.count[g], -g))
        self.count[group] += 1
        return group

    @property
    def full(self) -> bool:
        return self.count == self.sizes


def fill_groups(route: Route, holders: Sequence[str | None], sizes: list[int],
                placement: Placement) -> list[list[int]]:
    """The members (indices into `holders`, each member's session replica) of each group of a split
    round, in their order: members whose replica is known join first (`GroupFill`)."""
    fill = GroupFill(sizes)
    placed = [placement.owner.get(f"{route.key}~{g}") for g in range(len(sizes))]
    groups: list[list[int]] = [[] for _ in sizes]
    for i in sorted(range(len(holders)), key=lambda i: holders[i] is None):
        groups[fill.join(holders[i], placed)].append(i)
    return [sorted(group) for group in groups]


def group_sizes(num_agents: int, most: int | None) -> list[int]:
    """How a round of `num_agents` is split so that no group has more than `most` (None: one
    group): the fewest groups, as even as they come, larger groups first."""
    if not most or num_agents <= most:
        return [num_agents]
    groups = -(-num_agents // most)
    base, extra = divmod(num_agents, groups)
    return [base + (i < extra) for i in range(groups)]


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


def _utf8(text: str) -> bytes:
    """`text`'s bytes for hashing, a lone surrogate (`"\\ud800"` in a JSON body) included."""
    return text.encode("utf-8", "surrogatepass")


def rendezvous(key: str, replicas: Sequence[str]) -> list[str]:
    """Replicas ranked for `key` by highest random weight: a key keeps its replica when others
    join or leave."""
    def weight(replica: str) -> bytes:
        return hashlib.blake2b(_utf8(f"{key}\0{replica}"), digest_size=8).digest()

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
        replicas = [r for r in replicas if r not in route.avoid] or list(replicas)
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
        owner = self.owner.get(route.key)
        if owner in replicas:
            return owner
        groups = [self.owner.get(key) for key in route.siblings]
        fewest = min(groups.count(r) for r in replicas)
        replicas = [r for r in replicas if groups.count(r) == fewest]  # apart from its round's other groups
        votes: dict[str, int] = {}
        for agent in route.agents:
            holder = self.owner.get(agent)
            if holder in replicas:
                votes[holder] = votes.get(holder, 0) + 1
        if votes:  # where most of its agents' sessions are
            return max(rendezvous(route.key, replicas), key=lambda r: votes.get(r, 0))
        owned = {r: 0 for r in replicas}
        for holder in self.owner.values():
            if holder in owned:
                owned[holder] += 1
        # the least loaded, counting what it already owns; ties go by the key's hash
        return min(rendezvous(route.key, replicas), key=lambda r: (load(r), owned[r]))

    def restore(self, logs: dict[str, list[tuple[str, float]]]) -> int:
        """Rebuild the placement from the replicas' `KeyLog`s ({replica: [(key, when)]}): a key
        sent to several replicas belongs to the latest. Keys placed since are kept. Returns the
        keys restored."""
        last: dict[str, tuple[float, str]] = {}
        for when, key, replica in sorted((w, k, r) for r, keys in logs.items() for k, w in keys):
            last[key] = (when, replica)
        restored = 0
        for key, (_when, replica) in sorted(last.items(), key=lambda item: item[1][0]):
            if key not in self.owner:
                self._remember(key, replica)
                restored += 1
        return restored

    def _remember(self, key: str, replica: str) -> None:
        self.owner[key] = replica
        self.owner.move_to_end(key)
        while len(self.owner) > MAX_OWNED_KEYS:
            self.owner.popitem(last=False)


_PLACEMENT: list[Placement] = []


def shared_placement() -> Placement:
    """The process's one placement, which every request router of a handle (Ray makes one per
    handle) and the endpoint share. Looked up when called: Ray may pickle the endpoint's class by
    value, and a module global it named would travel as a copy."""
    if not _PLACEMENT:
        _PLACEMENT.append(Placement())
    return _PLACEMENT[0]


class KeyLog:
    """The round and agent keys routed to one replica, with when they were last: what a restarted
    endpoint rebuilds its `Placement` from. Bounded as the placement is."""

    def __init__(self):
        self._keys: OrderedDict[str, float] = OrderedDict()

    def note(self, route: Route | None) -> None:
        if route is None or route.kind not in ("round", "session"):
            return
        now = time.time()
        for key in (route.key, *route.agents):
            self._keys[key] = now
            self._keys.move_to_end(key)
        while len(self._keys) > MAX_OWNED_KEYS:
            self._keys.popitem(last=False)

    def keys(self) -> list[tuple[str, float]]:
        return list(self._keys.items())


class TransparentHold:
    """Chat requests that name no round, held at the endpoint for a gather window by the replicas'
    own rule (`RoundGatherer`): those that share text leave together with one round route (split
    into groups of at most `max_round_agents`), the others with the route they came with. The
    caller holds only a request its `Door` holds (told by `door` when a round formed)."""

    def __init__(self, fleet, door: Door | None = None):
        self.door = door
        self.held = HeldTurns(fleet.gather_window_s, fleet.round_timeout_s, self._close)
        self.most = fleet.max_round_agents
        self.fallbacks: dict[str, Route] = {}  # a held request's key -> the route it came with

    async def route(self, data: dict, fallback: Route, namespace: str) -> Route:
        """The route of a chat request (`data`) in cache namespace `namespace`, once its gathering
        closed."""
        messages = chat_lines(data.get("messages"))
        if messages is None:
            return fallback
        key = uuid.uuid4().hex
        namespace = json.dumps([namespace, str(data.get("model"))])  # a round runs on one model
        self.fallbacks[key] = fallback
        try:
            return await self.held.hold(ChatTurn(key, messages, None, None, None, namespace=namespace,
                                                 arrival=time.monotonic()))
        finally:
            self.fallbacks.pop(key, None)

    def _close(self, work: ReadyWork) -> None:
        for turn in work.ordinary:
            self._answer(turn.key, None)
        for members in work.rounds:
            if self.door is not None:
                self.door.formed_round()
            names = [agent_key(t.namespace, conversation_id(t.namespace, t.messages)) for t in members]
            whole, sizes = transparent_route(members[0].namespace, names), group_sizes(len(members), self.most)
            if len(sizes) == 1:
                for turn in members:
                    self._answer(turn.key, whole)
                continue
            placement = shared_placement()
            groups = fill_groups(whole, [placement.owner.get(n) for n in names], sizes, placement)
            for route, group in zip(group_routes(whole, [[names[i] for i in g] for g in groups]), groups):
                for i in group:
                    self._answer(members[i].key, route)

    def _answer(self, key: str, route: Route | None) -> None:
        self.held.answer(key, route or self.fallbacks.get(key))
