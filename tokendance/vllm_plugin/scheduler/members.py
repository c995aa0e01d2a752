"""The scheduler side's rounds, in four modules: the round and its members here (the tag a request
joins by, what each member is and holds); the round book, membership and arrival, claims and pins
(`scheduler/round_book.py`); the plugin's side of the plan (`scheduler/sources.py`, on the round core's
`round_core/planning.py`, which the engine plans with too); and the token account
(`scheduler/account.py`). Plain Python over token ids; no forward passes, no vLLM types.

A request joins a round through its `kv_transfer_params`:
    {"tokendance": {"round_id": "r7", "round_size": 16, "agent_id": "alice", "namespace": ""}}
Its prompt is cut into pieces as `tokendance serve` cuts messages into segments (each line of
each message, the template's header with its first line: `round_core.spans.cut_spans`); a piece
found in two or more prompts of the round is shared. Once every member arrived (or
`round_timeout_s` passed), the round is planned by the round core, under the engine's rules:
masters compute their prompts in full; every other member (a mirror) is held until the masters
holding its shared pieces have been computed, then claims its prompt up to the end of its last
reused piece. The message a member answers is never reused. With in-round anchors (`anchors` >
1), each shared piece is computed in full by up to that many masters, and a mirror reuses the
mean of their encodings.

A mirror also reads back its agent's previous request (its session) from blocks vLLM's prefix
cache still holds, found by their hashes (`lookup`, under the same salt): the history past vLLM's
block-aligned hit at the same positions, copied exactly, and pieces of its previous prompt that
moved, re-rotated like a master's. Spans at the same positions after an identical prefix (the
session's history, a master's identical system prompt) are copied exactly: no check, no selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from tokendance.registry import MAX_ANCHORS, valid_anchors
from tokendance.round_core.planning import Role
from tokendance.round_core.spans import Span
from tokendance.vllm_plugin.step_plan import ReusedSpan


class RoundParamsError(ValueError):
    """`kv_transfer_params["tokendance"]` is malformed."""


@dataclass(frozen=True)
class RoundTag:
    round_id: str
    agent_id: str
    round_size: int | None
    namespace: str = ""
    recompute_ratio: float | None = None  # None: the connector's setting
    anchors: int | None = None  # in-round anchors of its round (the first member's); None: the connector's
    # a member the endpoint gathered (`http/gathering.py`), identified by its prompt's first message: it
    # needs no salt of its own (vLLM's block hashes chain its tokens from position 0)
    transparent: bool = False

    @classmethod
    def parse(cls, params) -> "RoundTag | None":
        """The tag in a request's kv_transfer_params, None if it has none."""
        tag = (params or {}).get("tokendance") if isinstance(params, dict) else None
        if tag is None:
            return None
        if not isinstance(tag, dict):
            raise RoundParamsError("kv_transfer_params.tokendance must be an object")
        round_id, agent_id, size = tag.get("round_id"), tag.get("agent_id"), tag.get("round_size")
        namespace = tag.get("namespace", "")
        if not isinstance(round_id, str) or not round_id or not isinstance(agent_id, str) or not agent_id:
            raise RoundParamsError("kv_transfer_params.tokendance needs string round_id and agent_id")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise RoundParamsError("kv_transfer_params.tokendance.round_size must be a positive integer")
        if not isinstance(namespace, str):
            raise RoundParamsError("kv_transfer_params.tokendance.namespace must be a string")
        ratio = tag.get("recompute_ratio")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1):
            raise RoundParamsError("kv_transfer_params.tokendance.recompute_ratio must be a number in [0, 1]")
        anchors = tag.get("anchors")
        if anchors is not None and not valid_anchors(anchors):
            raise RoundParamsError(f"kv_transfer_params.tokendance.anchors must be an integer in [1, {MAX_ANCHORS}]")
        transparent = tag.get("transparent", False)
        if not isinstance(transparent, bool):
            raise RoundParamsError("kv_transfer_params.tokendance.transparent must be true or false")
        unknown = set(tag) - {"round_id", "agent_id", "round_size", "namespace", "recompute_ratio", "anchors",
                              "transparent"}
        if unknown:
            raise RoundParamsError(f"kv_transfer_params.tokendance: unknown fields {sorted(unknown)}")
        return cls(round_id, agent_id, size, namespace, None if ratio is None else float(ratio), anchors, transparent)


@dataclass(frozen=True)
class Held:
    """A member that computes a piece, and where the piece starts in its prompt."""

    member: "Member"
    start: int


@dataclass(frozen=True)
class Reusable:
    """A piece a mirror reuses: where it starts in the mirror's prompt, its length, and every member
    that computes it (`sources`: the first is read, the others are the anchors averaged with it)."""

    start: int
    length: int
    sources: list[Held]


class Stage(IntEnum):
    """How far a member's claim has gone, in order (only the round book moves it)."""

    ARRIVED = 0  # in its round; no claim allocated (it may hold a claim vLLM has not taken yet)
    COMMITTED = 1  # vLLM allocated its claim: its load goes to the workers in this step
    SENT = 2  # its load went to the workers, whose pass fills it before vLLM's forward of that step


@dataclass
class Member:
    """One request of a round, written by the round book only. `role`: its part in the plan;
    `stage`: its claim's progress; `ready`: its KV is computed (a master's prompt, a first holder's
    pass sent); `failed`: its pass failed or it left its round on a failure (it provides nothing);
    `finished`: vLLM finished the request. A mirror's `reusable`: each piece it reuses, with its
    sources."""

    request_id: str
    tag: RoundTag
    token_ids: list[int]
    arrived: float
    pieces: list[Span] = field(default_factory=list)  # its prompt cut (`round_core.spans.cut_spans`)
    role: Role = Role.WAITING  # -> master | mirror | exact (a mirror may end exact)
    stage: Stage = Stage.ARRIVED
    reusable: list[Reusable] = field(default_factory=list)
    unmastered: set[bytes] = field(default_factory=set)  # a mirror's shared pieces no master holds
    ready: bool = False  # a master whose prompt has been computed (its KV exists)
    claim: tuple[int, int] | None = None  # its claimed range [start, end)
    sent_step: int = -1  # the book's step its load was sent in
    failed: bool = False
    # a first holder whose pieces are not pinned for later steps (the pool's pin limit): a member
    # admitted in a later step computes them
    unpinned: bool = False
    finished: bool = False
    block_ids: list[int] = field(default_factory=list)  # a ready master's blocks (pinned)
    num_computed: int = 0  # vLLM's own prefix hit at the latest claim
    counted: bool = False  # its tokens are in the book's counters (once, preemptions aside)
    salt: str | None = None
    provides: list[tuple[int, int]] = field(default_factory=list)  # pieces no master computes, it first
    provides_end: int = 0  # where the last of them ends
    spans: list[ReusedSpan] = field(default_factory=list)  # a mirror's claim: what fills it, by source
    session_blocks: list[int] = field(default_factory=list)  # its session's blocks the claim reads
    store_entry: str | None = None  # the session store's entry the claim reads

    @property
    def provides_later(self) -> bool:
        """Members admitted in a later step may read the pieces it computes from its blocks."""
        return not (self.failed or self.unpinned)

    @property
    def needs_masters(self) -> bool:
        """A mirror whose pass has not read its sources yet (a request that ended first never will)."""
        return self.role == Role.MIRROR and self.stage < Stage.SENT and not self.finished


@dataclass
class Round:
    key: tuple[str, str]
    size: int | None
    latest: float  # when its latest member arrived
    members: dict[str, Member] = field(default_factory=dict)
    planned: bool = False
    pinned: list[int] = field(default_factory=list)  # block ids held for the masters
    serial: int = 0  # unique for the book's life (a round id may come again)
    largest_blocks: int = 0  # the blocks its largest member may take (set when planned)

    def is_complete(self, now: float, timeout: float) -> bool:
        """All its members came, or none came for `timeout`: a large round's members reach the
        scheduler one after the other (each rendered and tokenized by the API server first), so a
        round still filling is waited for."""
        return (self.size is not None and len(self.members) >= self.size) or now - self.latest >= timeout
