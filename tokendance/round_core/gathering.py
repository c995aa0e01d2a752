"""Turning chat requests into rounds, by one rule for both front doors: `tokendance serve`
(`server/app.py`, `server/engine_loop.py`) and the vLLM plugin's endpoint (`vllm_plugin/http/gathering.py`).

Three ways into a round:

- declared: requests with the same `round_id` (and cache namespace) form one round, run as soon
  as `round_size` of them arrived, or after `round_timeout` with those that did;
- transparent: chat requests pending together form one round with every other pending request
  they *overlap* with. The gathering closes when no request has come for a window (a burst of N
  agents' requests, parsed and tokenized one after the other, keeps it open), or `round_timeout`
  after its first request. Two requests overlap when they share a line of a message
  (same role, same line of content, at least `MIN_SHARED_CHARS` long) outside their common prefix
  of such lines: lines are the engine's segments (`chat_segments`), a shared prefix is served
  exactly by prefix caching, and a line repeated at another position is what the KV Collector is
  for. Requests that carry an `agent_id` join the round too (their session is kept between
  requests), the rest are served as ordinary requests. With `release_unshared` (the vLLM plugin's
  endpoint, where a held request waits outside the engine), a request that overlaps no other
  pending one a window after it came leaves at once as an ordinary request, so that one sharing
  nothing waits a window, not the round timeout, however busy the door is;
- whole: a /v1/rounds request is a ready round of its own.

A front door that holds requests outside the engine (the plugin's endpoint, the fleet's) holds a
chat request only while another is at the door, or as the first of the next burst (`Door`), and
drives its gatherer on its event loop with `HeldTurns`; an agent no client named is its
conversation (`conversation_id`) at both.

The gatherer is plain data: its owner (serve's engine thread, a door's `HeldTurns`) calls
`pop_ready` and runs what it returns.
Invariant: every turn added leaves exactly once, through `pop_ready` or `remove`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokendance.errors import InvalidRequestError
from tokendance.round_core.spans import common_prefix


class RoundConflictError(InvalidRequestError):
    """A request names a declared round with another size than the round's first request."""

MIN_SHARED_CHARS = 32  # shorter shared lines ("OK", separators) are not worth a round (~ a KV block)
NEXT_BURST_S = 5.0  # after a burst that formed a round, a lone chat request is held this long


class Door:
    """The chat requests at a front door that holds them (held, or sent on and not answered yet),
    and whether one more should be held: while another is at the door, since it may share text
    with it; or, alone, as the first of the next round's burst: a multi-agent app sends a round's
    requests together and the next round as soon as the last one's replies are in, so a request
    that comes within `next_burst_s` of the door emptying after a burst that formed a round is
    held too (at most one gather window when nothing joins it). Otherwise a lone request goes on
    at once."""

    def __init__(self, next_burst_s: float = NEXT_BURST_S, clock=time.monotonic):
        self.next_burst_s = next_burst_s
        self.clock = clock
        self.at_door = 0
        self._formed = False  # a round formed since the door was last empty
        self._emptied = float("-inf")  # when the door emptied after a burst that formed a round

    def enter(self) -> None:
        self.at_door += 1

    def leave(self) -> None:
        self.at_door -= 1
        if self.at_door == 0 and self._formed:
            self._formed, self._emptied = False, self.clock()

    def formed_round(self) -> None:
        self._formed = True

    def holds(self) -> bool:
        """Whether the request that entered last should be held (call after `enter`)."""
        return self.at_door > 1 or self.clock() - self._emptied < self.next_burst_s


@dataclass
class ChatTurn:
    """One agent's chat request waiting for a round. `request` is its validated prompt, served as
    an ordinary request if no round forms; `sink` and `index` say where its outputs go."""

    key: str
    messages: list[dict]
    params: Any  # SamplingParams
    request: Any  # engine Request (validated, not yet added)
    sink: Any
    index: int = 0
    namespace: str = ""
    agent_id: str | None = None  # as the client named it; None: an anonymous agent
    round_id: str | None = None
    round_size: int | None = None
    arrival: float = 0.0
    tools: list[dict] | None = None  # for a template that renders them (server/tools.py)
    lines: list[tuple[str, str]] = field(init=False, repr=False)  # (role, line) per line of every message
    sharing: bool = field(default=False, init=False, repr=False)  # seen overlapping another pending turn

    def __post_init__(self) -> None:
        self.lines = [(m["role"], line) for m in self.messages for line in m["content"].split("\n")]

    @property
    def agent_key(self) -> tuple[str, str] | None:
        return None if self.agent_id is None else (self.namespace, self.agent_id)


@dataclass
class ReadyWork:
    rounds: list[list[ChatTurn]] = field(default_factory=list)  # each runs as one engine round
    ordinary: list[ChatTurn] = field(default_factory=list)


def message_text(content) -> str | None:
    """A chat message's text (string content, or text parts only); None otherwise: a prompt with an
    image or audio part is never tagged (its token ids do not say what the part holds)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return None


def chat_lines(messages) -> list[dict] | None:
    """The messages as `{role, content}` text (what the gatherer compares), None if malformed."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for m in messages:
        text = message_text(m.get("content")) if isinstance(m, dict) else None
        if text is None or not isinstance(m.get("role"), str):
            return None
        out.append({"role": m["role"], "content": text})
    return out


def overlaps(a: ChatTurn, b: ChatTurn) -> bool:
    """Same namespace and a line (long enough to matter) in common outside their common prefix."""
    if a.namespace != b.namespace:
        return False
    start = common_prefix(a.lines, b.lines)
    common = set(a.lines[start:]).intersection(b.lines[start:])
    return any(len(line.strip()) >= MIN_SHARED_CHARS for _, line in common)


def overlapping(turns: Sequence[ChatTurn]) -> set[int]:
    """Indices of the turns that `overlaps` another, without trying every pair. Each long line is
    indexed with where it sits: its index and the lines up to it (a prefix "class"). Two turns
    holding a line in the same classes hold it inside their common prefix, so only holders in
    another class are tried, and a turn stops at its first overlap: with N turns quoting the same
    replies at different positions, about N checks instead of N^2 / 2."""
    holders: dict[tuple, dict[int, set]] = {}  # (namespace, line) -> turn index -> its classes of the line
    for i, turn in enumerate(turns):
        prefix = hash(turn.namespace)
        for at, line in enumerate(turn.lines):
            prefix = hash((prefix, line))
            if len(line[1].strip()) >= MIN_SHARED_CHARS:
                holders.setdefault((turn.namespace, line), {}).setdefault(i, set()).add((at, prefix))
    joined: set[int] = set()
    for held in holders.values():
        if len(held) < 2:
            continue
        groups: dict[frozenset, list[int]] = {}
        for i, classes in held.items():
            groups.setdefault(frozenset(classes), []).append(i)
        if len(groups) < 2:  # every holder has the line inside one common prefix
            continue
        for key, members in groups.items():
            for i in members:
                if i in joined:
                    continue
                other = next((j for k, js in groups.items() if k != key for j in js
                              if overlaps(turns[i], turns[j])), None)
                if other is not None:
                    joined.update((i, other))
    return joined


class RoundGatherer:
    def __init__(self, window_s: float, round_timeout_s: float, release_unshared: bool = False):
        self.window_s = window_s
        self.round_timeout_s = round_timeout_s
        self.release_unshared = release_unshared
        self._pending: list[ChatTurn] = []  # transparent turns, in arrival order
        self._declared: dict[tuple[str, str], list[ChatTurn]] = {}  # (namespace, round_id) -> turns
        self._ready: list[list[ChatTurn]] = []

    def __len__(self) -> int:
        return len(self._pending) + sum(map(len, self._declared.values())) + sum(map(len, self._ready))

    def add(self, turn: ChatTurn) -> None:
        """Queue a turn; raises InvalidRequestError if its agent is already in its declared round."""
        if turn.round_id is None:
            self._pending.append(turn)
            return
        key = (turn.namespace, turn.round_id)
        group = self._declared.get(key, [])
        if turn.agent_id is not None and any(t.agent_id == turn.agent_id for t in group):
            raise InvalidRequestError(f"agent {turn.agent_id!r} is already in round {turn.round_id!r}")
        size = group[0].round_size if group else turn.round_size  # fixed by the round's first request
        if group and turn.round_size is not None and turn.round_size != size:
            raise RoundConflictError(f"round {turn.round_id!r} was declared with round_size {size}, "
                                     f"not {turn.round_size}")
        self._declared[key] = group + [turn]
        if size is not None and len(group) + 1 >= size:
            self._ready.append(self._declared.pop(key))

    def add_round(self, turns: Sequence[ChatTurn]) -> None:
        self._ready.append(list(turns))

    def remove(self, key: str) -> list[ChatTurn]:
        """Take back the turns of one HTTP request (its client went away)."""
        removed = [t for t in self._pending if t.key == key]
        self._pending = [t for t in self._pending if t.key != key]
        for groups in (list(self._declared.values()), self._ready):
            for group in groups:
                removed += [t for t in group if t.key == key]
                group[:] = [t for t in group if t.key != key]
        self._ready = [g for g in self._ready if g]
        self._declared = {k: g for k, g in self._declared.items() if g}
        return removed

    def next_deadline(self) -> float | None:
        deadlines = [self._deadline(g) for g in self._declared.values()]
        if self._pending:
            deadlines.append(self._pending_deadline())
            unchecked = [t.arrival for t in self._pending if not t.sharing]
            if self.release_unshared and unchecked:
                deadlines.append(min(unchecked) + self.window_s)
        if self._ready:
            deadlines.append(0.0)
        return min(deadlines, default=None)

    def pop_ready(self, now: float) -> ReadyWork:
        work = ReadyWork(rounds=self._ready)
        self._ready = []
        for key, group in list(self._declared.items()):
            if now >= self._deadline(group):
                work.rounds.append(self._declared.pop(key))
        if self._pending and now >= self._pending_deadline():
            members, work.ordinary = self._split(self._pending, now)
            if members:
                work.rounds.append(members)
        elif self._pending and self.release_unshared:
            work.ordinary = self._unshared(now)
        return work

    def _unshared(self, now: float) -> list[ChatTurn]:
        """Take out the pending turns that came a window ago or more and overlap no other pending
        turn. A turn once seen overlapping stays (its burst is still coming in): each pending turn
        is checked about once, not at every arrival."""
        if not any(not t.sharing and t.arrival + self.window_s <= now for t in self._pending):
            return []
        for i in overlapping(self._pending):
            self._pending[i].sharing = True
        due = [t for t in self._pending if not t.sharing and t.arrival + self.window_s <= now]
        self._pending = [t for t in self._pending if t.sharing or t.arrival + self.window_s > now]
        return due

    def _pending_deadline(self) -> float:
        """A window after the last transparent turn came, at most the round timeout after the first."""
        quiet = max(t.arrival for t in self._pending) + self.window_s
        return min(quiet, self._pending[0].arrival + max(self.round_timeout_s, self.window_s))

    def _deadline(self, group: list[ChatTurn]) -> float:
        wait = self.round_timeout_s if group[0].round_size is not None else self.window_s
        return group[0].arrival + wait

    def _split(self, turns: list[ChatTurn], now: float) -> tuple[list[ChatTurn], list[ChatTurn]]:
        """(one round: turns that overlap another or name an agent; ordinary turns). A second turn
        of an agent already in the round waits for the next window."""
        joined = {id(turns[i]) for i in overlapping(turns)}
        members, ordinary, agents = [], [], set()
        self._pending = []
        for turn in turns:
            if turn.agent_key is not None and turn.agent_key in agents:
                turn.arrival, turn.sharing = now, False
                self._pending.append(turn)
            elif turn.agent_id is not None or id(turn) in joined:
                members.append(turn)
                agents.add(turn.agent_key)
            else:
                ordinary.append(turn)
        return members, ordinary


# How a front door names agents no client named: a conversation, a member without an agent_id. A
# client's agent_id may not start so.
SERVER_AGENT_PREFIXES = ("conversation-", "anonymous-")


def conversation_id(namespace: str, messages: list[dict], model=None) -> str:
    """An agent no client named: its conversation, by its cache namespace, model and first message
    (an agent's persona, which stays while the rest of its prompt changes)."""
    first = json.dumps([namespace, str(model), messages[0]["role"], messages[0]["content"]])
    return f"conversation-{hashlib.sha256(first.encode()).hexdigest()[:24]}"


class HeldTurns:
    """A `RoundGatherer` on a front door's event loop (the plugin's endpoint, the fleet's): `hold`
    waits until a turn's gathering closes and returns what `close` answered for it (`answer`);
    `close` gets the work of every `pop_ready` and answers each turn in it. A turn whose client
    leaves while it is held is taken out of the gatherer, and given to `left`."""

    def __init__(self, window_s: float, round_timeout_s: float, close: Callable[[ReadyWork], None],
                 left: Callable[[ChatTurn], None] = lambda turn: None):
        self.gatherer = RoundGatherer(window_s, round_timeout_s, release_unshared=True)
        self.close, self.left = close, left
        self._waiting: dict[str, asyncio.Future] = {}
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self.gatherer)

    async def hold(self, turn: ChatTurn) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._waiting[turn.key] = future
        self.gatherer.add(turn)
        self._arm()
        try:
            return await future
        finally:
            if self._waiting.pop(turn.key, None) is not None:  # its client left while it waited
                self.gatherer.remove(turn.key)
                self.left(turn)

    def answer(self, key: str, value: Any) -> None:
        future = self._waiting.pop(key, None)
        if future is not None and not future.done():
            future.set_result(value)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        deadline = self.gatherer.next_deadline()
        self._timer = None if deadline is None else asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()), self._close)

    def _close(self) -> None:
        self._timer = None
        self.close(self.gatherer.pop_ready(time.monotonic()))
        self._arm()
