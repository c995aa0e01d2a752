"""The scheduler side's rounds: which requests form a round, who computes in full (masters), what
each mirror claims and when. Plain Python over token ids; no forward passes, no vLLM types.

A request joins a round through its `kv_transfer_params`:
    {"tokendance": {"round_id": "r7", "round_size": 16, "agent_id": "alice", "namespace": ""}}
Its prompt is cut into pieces after every boundary token (a token holding a line break, or a
special token: the chat template's message boundaries), the way `tokendance serve` cuts messages
into segments; a piece found in two or more prompts of the round is shared. Once every member
arrived (or `round_timeout_s` passed), the round is planned with the engine's planning code
(`reuse/planning.py`): masters compute their prompts in full; every other member (a mirror) is
held until the masters holding its shared pieces have been computed, then claims its prompt up to
the end of its last reused piece. With in-round anchors (`anchors` > 1), each shared piece is
computed in full by up to that many masters, and a mirror reuses the mean of their encodings.

A mirror also reads back its agent's previous request (its session) from blocks vLLM's prefix
cache still holds, found by their hashes (`lookup`, under the same salt): the history past vLLM's
block-aligned hit at the same positions, copied exactly, and pieces of its previous prompt that
moved, re-rotated like a master's. Spans at the same positions after an identical prefix (the
session's history, a master's identical system prompt) are copied exactly: no check, no selection.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokendance.registry import MAX_ANCHORS, valid_anchors
from tokendance.reuse.planning import choose_anchors
from tokendance.reuse.segments import segment_key
from tokendance.vllm_plugin.plan import ReusedSpan
from tokendance.vllm_plugin.store_index import StoreIndex


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
    # a member the endpoint gathered (`gathering.py`), identified by its prompt's first message: it
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


@dataclass
class Piece:
    start: int
    end: int
    key: bytes


@dataclass
class Session:
    """An agent's latest finished request: its tokens (prompt and output), its prompt's pieces (key
    -> start), its salt, and vLLM's hashes of its full blocks (found again while the pool keeps
    them)."""

    token_ids: list[int]
    pieces: dict[bytes, int]
    salt: str | None = None
    block_hashes: list[Any] = field(default_factory=list)


@dataclass
class Member:
    """One request of a round. A mirror's `reusable`: (mirror start, length, [(master, master
    start), ...]): each piece with every master (anchor) that computes it."""

    request_id: str
    tag: RoundTag
    token_ids: list[int]
    arrived: float
    pieces: list[Piece] = field(default_factory=list)
    role: str = "waiting"  # waiting -> master | mirror | exact
    reusable: list[tuple[int, int, list[tuple["Member", int]]]] = field(default_factory=list)
    unmastered: set[bytes] = field(default_factory=set)  # a mirror's shared pieces no master holds
    ready: bool = False  # a master whose prompt has been computed (its KV exists)
    claim: tuple[int, int] | None = None  # a mirror's claimed range [start, end)
    loaded: bool = False  # a mirror whose load was sent to the workers
    sent_step: int = -1  # ... in this step of the book's
    failed: bool = False  # ... and whose pass failed (its blocks are vLLM's to recompute)
    # ... a first holder whose pieces are not pinned for later steps (the pool's pin limit): a
    # member admitted in a later step computes them
    unpinned: bool = False
    filled: bool = False  # ... and whose pass the workers finished
    finished: bool = False
    block_ids: list[int] = field(default_factory=list)  # a ready master's blocks (pinned)
    num_computed: int = 0  # vLLM's own prefix hit at the latest claim
    counted: bool = False  # its tokens are in the book's counters (once, preemptions aside)
    salt: str | None = None
    provides: list[tuple[int, int]] = field(default_factory=list)  # pieces no master computes, it first
    provides_end: int = 0  # where the last of them ends
    committed: bool = False  # vLLM allocated its claim (its pass runs in this step or ran before)
    spans: list[ReusedSpan] = field(default_factory=list)  # a mirror's claim: what fills it, by source
    session_blocks: list[int] = field(default_factory=list)  # its session's blocks the claim reads
    store_entry: str | None = None  # the session store's entry the claim reads

    @property
    def provides_later(self) -> bool:
        """Members admitted in a later step may read the pieces it computes from its blocks."""
        return not (self.failed or self.unpinned)

    @property
    def needs_masters(self) -> bool:
        """A mirror whose pass has not read its sources yet (sent to the workers and not filled,
        even if its request ended meanwhile: the workers finish a pass they started)."""
        if self.role != "mirror" or self.filled:
            return False
        return self.loaded or not self.finished


@dataclass
class Round:
    key: tuple[str, str]
    size: int | None
    opened: float
    members: dict[str, Member] = field(default_factory=dict)
    planned: bool = False
    pinned: list[int] = field(default_factory=list)  # block ids held for the masters
    serial: int = 0  # unique for the book's life (a round id may come again)
    largest_blocks: int = 0  # the blocks its largest member may take (set when planned)

    def is_complete(self, now: float, timeout: float) -> bool:
        return (self.size is not None and len(self.members) >= self.size) or now - self.opened >= timeout


def cut_pieces(token_ids: Sequence[int], boundaries: Collection[int], namespace: str, end: int,
               min_tokens: int = 1) -> list[Piece]:
    """The prompt's tokens [0, end) in pieces, each ending after a boundary token (or at `end`); a
    run shorter than `min_tokens` that ends at a boundary joins the piece before it (the chat
    template's framing between two messages, `<|im_end|>`, a line break, `<|im_start|>user` and its
    line break, goes with the message before it instead of standing alone as tokens no one
    shares)."""
    pieces, start = [], 0
    for position in range(end):
        boundary = token_ids[position] in boundaries
        if boundary or position == end - 1:
            if boundary and position + 1 - start < min_tokens and pieces:
                start = pieces.pop().start
            pieces.append(Piece(start, position + 1, segment_key(token_ids[start:position + 1], namespace)))
            start = position + 1
    return pieces


class RoundBook:
    """Every open round and its members, by request id. Invariant: a round's `pinned` blocks are
    held (one reference each) from its masters' computation until no member needs them."""

    def __init__(self, boundaries: Collection[int], round_timeout_s: float, hold_timeout_s: float,
                 claim_tokens_per_step: int = 0, min_piece_tokens: int = 4, anchors: int = 1,
                 block_size: int = 16, lookup: Callable[[Any], int | None] | None = None,
                 store: StoreIndex | None = None, confirm_steps: int = 1):
        self.boundaries = boundaries
        self.block_size = block_size
        # A block hash -> the id of the block vLLM's prefix cache holds for it, or None (None: no
        # session is read back).
        self.lookup = lookup
        self.store = store  # agents at rest outside the pool (None: no store)
        self.anchors = anchors  # a round's, unless its first member's tag says otherwise
        # At most this many claimed tokens are admitted in one step (0: no limit): the workers fill
        # a large round's mirrors over several steps, and the first ones decode meanwhile.
        self.claim_tokens_per_step = claim_tokens_per_step
        self.claimed_this_step = 0
        self.step = 0  # engine steps whose admissions are over
        # A first holder's blocks are read in a later step only once vLLM has reported the step
        # that filled them (1 step later; 2 with vLLM's asynchronous scheduling): not if it failed.
        self.confirm_steps = confirm_steps
        # vLLM's pool, in blocks (None: unknown, no limit). Pins last until a round's last mirror
        # is filled, so first holders pin their pieces only while the pins take at most half of it
        # and leave room for the round's largest member: else those of a round larger than the pool
        # could pin it full before their readers are admitted, a deadlock.
        self.pool_blocks: int | None = None
        self.round_timeout_s = round_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self.min_piece_tokens = min_piece_tokens
        self.rounds: dict[tuple[str, str], Round] = {}
        self.members: dict[str, tuple[Round, Member]] = {}
        self.closed: list[Round] = []  # rounds whose members all finished, until their pins are freed
        self.serials = 0
        # What the rounds did since the connector last reported (`take_counters`): rounds by how
        # they formed, held steps, and every member's prompt tokens by who computes them and why.
        self.counters: Counter = Counter()
        # Each agent's latest finished request, by (namespace, agent id); LRU, at most `max_sessions`.
        self.sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self.max_sessions = 4096

    def add(self, request_id: str, tag: RoundTag, token_ids: list[int], now: float | None = None,
            salt: str | None = None) -> None:
        now = time.monotonic() if now is None else now
        key = (tag.namespace, tag.round_id)
        round_ = self.rounds.get(key)
        if round_ is None or round_.planned:  # a planned round takes no one: a late member is exact
            if round_ is not None:
                self.members[request_id] = (round_, Member(request_id, tag, token_ids, now, role="exact", salt=salt))
                return
            self.serials += 1
            round_ = self.rounds[key] = Round(key, tag.round_size, now, serial=self.serials)
        member = Member(request_id, tag, token_ids, now, salt=salt)
        member.pieces = cut_pieces(token_ids, self.boundaries, tag.namespace, len(token_ids) - 1,
                                   self.min_piece_tokens)
        round_.members[request_id] = member
        self.members[request_id] = (round_, member)
        if round_.is_complete(now, self.round_timeout_s):
            self._plan(round_)

    def find(self, request_id: str) -> Member | None:
        entry = self.members.get(request_id)
        return None if entry is None else entry[1]

    def claim(self, request_id: str, num_computed: int, now: float | None = None) -> int | None:
        """Tokens a member claims beyond `num_computed` (what vLLM's prefix cache holds), None
        while it must wait (its round or its masters). A master or an exact member claims only its
        own history at the same positions (from blocks still cached or the session store: exact
        copies), never a re-rotated piece."""
        now = time.monotonic() if now is None else now
        entry = self.members.get(request_id)
        if entry is None:
            return 0
        round_, member = entry
        member.num_computed = num_computed
        if not round_.planned:
            if not round_.is_complete(now, self.round_timeout_s):
                self.counters["held_steps"] += 1
                return None
            self._plan(round_)
        if member.finished:
            return 0
        if member.role != "mirror":
            return self._claim_history(member, num_computed)
        if member.loaded:  # resumed after a preemption: its masters may be unpinned by now
            member.role = "exact"
            return 0
        spans, waiting = [], False
        for s, n, sources in trim(member.reusable, num_computed):
            first = sources[0][0]
            filled = first.ready and first.provides_later and self.step - first.sent_step >= self.confirm_steps
            if first.role == "master" or filled or (first.committed and not first.loaded):
                spans.append((s, n, sources))
            elif first.role == "mirror" and not first.finished and first.provides_later:
                waiting = True  # the piece's first holder is not admitted yet, or its pass not confirmed
            # else its first holder computed it in no pass (exact, or gone): computed here
        masters = {id(m): m for _, _, sources in spans for m, _ in sources if m.role == "master"}
        if any(m.finished and not m.ready for m in masters.values()):  # a master gone before computing
            member.role = "exact"
            return 0
        if waiting or not all(m.ready for m in masters.values()):
            if now - member.arrived > self.hold_timeout_s:
                member.role = "exact"
                return 0
            self.counters["held_steps"] += 1
            return None
        member.spans = self._spans(member, spans, num_computed)
        if not member.spans:  # all in vLLM's prefix cache already
            member.role = "exact"
            return 0
        end = max(member.spans[-1].start + member.spans[-1].length, member.provides_end)
        budget, count = self.claim_tokens_per_step, end - num_computed
        if budget and self.claimed_this_step and self.claimed_this_step + count > budget:
            self.counters["held_steps"] += 1
            member.spans, member.session_blocks, member.store_entry = [], [], None
            return None  # this step's pass is full: a later step fills this mirror
        member.claim = (num_computed, end)
        return count

    def _claim_history(self, member: Member, num_computed: int) -> int:
        """A master's or exact member's claim: its history past vLLM's hit, exact (once: not again
        after a preemption)."""
        if member.loaded:
            return 0
        member.spans = self._spans(member, [], num_computed, recall=False)
        if not member.spans:
            member.claim = None
            return 0
        end = member.spans[-1].start + member.spans[-1].length
        member.claim = (num_computed, end)
        return end - num_computed

    def _spans(self, member: Member, spans: list, start: int, recall: bool = True) -> list[ReusedSpan]:
        """What fills a mirror's claim from `start` (vLLM's hit), in order: its session's history at
        the same positions (exact), then its masters' pieces (exact where a master holds the same
        tokens from position 0), then its session's pieces that moved. Sets the session blocks
        read (the connector pins them)."""
        member.session_blocks = []
        session = self.sessions.get((member.tag.namespace, member.tag.agent_id))
        if session is not None and (session.salt != member.salt or self.lookup is None):
            session = None
        held = [] if session is None else [self.lookup(h) for h in session.block_hashes]
        cached = [-1 if b is None else b for b in held]
        out: list[ReusedSpan] = []
        history = start
        if session is not None:  # exact: the same tokens from position 0, in blocks still cached
            limit = min(common_prefix(member.token_ids, session.token_ids), len(member.token_ids) - 1)
            while history < limit and history // self.block_size < len(cached) and cached[history // self.block_size] >= 0:
                history = min(limit, (history // self.block_size + 1) * self.block_size)
            if history > start:
                out.append(ReusedSpan(start, history - start, cached, start, exact=True))
        member.store_entry = None
        stored = None if self.store is None else self.store.find((member.tag.namespace, member.tag.agent_id), member.salt)
        if stored is not None:  # the rest of its history, gone from the pool, from the session store
            limit = min(common_prefix(member.token_ids, stored.token_ids), len(member.token_ids) - 1)
            if limit > history:
                out.append(ReusedSpan(history, limit - history, [], history, exact=True, stored=stored.entry))
                member.store_entry, history = stored.entry, limit
        same = {id(m): common_prefix(member.token_ids, m.token_ids) for _, _, sources in spans for m, _ in sources}
        for s, n, sources in trim(spans, history):
            (first, at), *more = sources
            if first.role != "master" and not first.ready:  # its first holder's pass is this step's
                out.append(ReusedSpan(s, n, first.block_ids, at, late=True))
            elif all(ms == s and s + n <= same[id(m)] for m, ms in sources):
                out.append(ReusedSpan(s, n, first.block_ids, s, exact=True))
            else:
                out.append(ReusedSpan(s, n, first.block_ids, at, [(m.block_ids, ms) for m, ms in more]))
        if session is not None and recall:
            taken = [(r.start, r.start + r.length) for r in out]
            for p in member.pieces:
                was = session.pieces.get(p.key)
                n = p.end - p.start
                if (was is None or p.start < history or n < self.min_piece_tokens
                        or any(overlap(p.start, p.end, a, b) for a, b in taken)):
                    continue
                if ((was + n - 1) // self.block_size < len(cached)
                        and all(b >= 0 for b in cached[was // self.block_size:(was + n - 1) // self.block_size + 1])):
                    out.append(ReusedSpan(p.start, n, cached, was, recalled=True))
                elif stored is not None and stored.token_ids[was:was + n] == member.token_ids[p.start:p.end]:
                    out.append(ReusedSpan(p.start, n, [], was, recalled=True, stored=stored.entry))
                    member.store_entry = stored.entry
        out.sort(key=lambda r: r.start)
        used = {cached[b] for r in out if r.source_block_ids is cached
                for b in range(r.source_start // self.block_size, (r.source_start + r.length - 1) // self.block_size + 1)}
        member.session_blocks = sorted(used)
        return merge(out)

    def commit(self, request_id: str, num_external: int) -> Member | None:
        """vLLM allocated the request with `num_external` claimed tokens: the member whose load the
        workers run this step (None for any other; a mirror whose claim vLLM did not take as it
        was, its own cache covering it, is computed exactly). Only here is the step's claim budget
        spent: vLLM may ask `claim` again after an allocation that failed."""
        member = self.find(request_id)
        if member is None:
            return None
        if member.claim is not None and not member.loaded:
            if num_external and num_external == member.claim[1] - member.claim[0]:
                if member.role == "mirror":  # a history claim is a copy: not counted against the pass
                    self.claimed_this_step += num_external
                member.committed = True
                member.block_ids = []  # filled when its load is sent (a piece it provides is read from them)
                self._count(member)
                return member
            if member.role == "mirror":
                member.role = "exact"
            else:
                member.claim, member.spans = None, []
        self._count(member)
        return None

    def next_step(self) -> None:
        """The step's admissions are over (the connector built its metadata)."""
        self.claimed_this_step = 0
        self.step += 1

    def loads_for(self, member: Member) -> list[ReusedSpan]:
        """What fills a mirror's claim: its spans, by source (masters' blocks, its session's, a first
        holder's in this pass). A first holder whose blocks were not sent with it leaves its pieces
        to be computed in the mirror's claim."""
        return [span for span in member.spans if span.source_block_ids or span.stored is not None]

    def master_pieces(self, member: Member) -> list[tuple[bytes, list[int], int, int]]:
        """A mirror's pieces one member computes (a master, or the first holder of a piece no master
        holds): (key, its block ids, its start, length), the KV the session store keeps as each
        piece's master once the mirror's pass has run."""
        keys = {p.start: p.key for p in member.pieces}
        return [(keys[s], first.block_ids, at, n) for s, n, ((first, at), *more) in member.reusable
                if not more and s in keys and (first.role == "master" or (first.provides_end and first.ready
                                                                           and first.provides_later and not first.finished))]

    def round_of(self, request_id: str) -> int:
        return self.members[request_id][0].serial

    def sent(self, member: Member) -> list[int]:
        """A mirror's load goes to the workers in this step; the blocks to pin for the members that
        read the pieces it provides in later steps."""
        member.loaded, member.sent_step = True, self.step
        return self.mark_ready(member.request_id, member.block_ids) if member.provides_end else []

    def failed_blocks(self, block_ids: set[int]) -> None:
        """The workers could not fill these blocks: the mirrors holding them provide nothing."""
        for _, member in self.members.values():
            if member.loaded and not member.failed and not block_ids.isdisjoint(member.block_ids):
                member.failed = True

    def mark_ready(self, request_id: str, block_ids: list[int]) -> list[int]:
        """A master's prompt is computed in this step, or a first holder's pass is sent: the blocks
        others read (to pin) are returned: all a master's, only those holding the pieces a first
        holder provides (a round larger than the pool must not be held up by its mirrors' pins)."""
        round_, member = self.members[request_id]
        member.ready = True
        member.block_ids = list(block_ids)
        if member.role == "master":
            pinned = list(block_ids)
        else:
            size = self.block_size
            pinned = sorted({block_ids[i] for start, end in member.provides for i in range(start // size, (end - 1) // size + 1)})
            if self.pool_blocks is not None and self._pinned_blocks() + len(pinned) > self._pin_limit(round_):
                member.unpinned = True  # its later readers compute these pieces
                self.counters["unpinned_holders"] += 1
                return []
        round_.pinned.extend(pinned)
        return pinned

    def _pinned_blocks(self) -> int:
        return sum(len(r.pinned) for r in [*self.rounds.values(), *self.closed])

    def _pin_limit(self, round_: Round) -> int:
        return min(self.pool_blocks // 2, self.pool_blocks - round_.largest_blocks)

    def finish(self, request_id: str, all_token_ids: Sequence[int] | None = None,
               block_hashes: Sequence[Any] = ()) -> int | None:
        """The request is done; `all_token_ids` (its prompt and output) and `block_hashes` (vLLM's,
        of its full blocks) are its agent's session. Returns its round's serial if it was the
        round's last member."""
        entry = self.members.pop(request_id, None)
        if entry is None:
            return None
        round_, member = entry
        member.finished = True
        if all_token_ids is not None:  # its prompt's pieces were cut when it came: kept, not cut again
            key = (member.tag.namespace, member.tag.agent_id)
            pieces = {}
            for p in member.pieces:
                pieces.setdefault(p.key, p.start)
            self.sessions[key] = Session(list(all_token_ids), pieces, member.salt, list(block_hashes))
            self.sessions.move_to_end(key)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        if all(m.finished for m in round_.members.values()) and self.rounds.get(round_.key) is round_:
            del self.rounds[round_.key]
            self.closed.append(round_)
            return round_.serial
        return None

    def releasable(self) -> list[int]:
        """Pinned blocks no member needs any more (each returned once)."""
        freed = []
        for round_ in [*self.rounds.values(), *self.closed]:
            if round_.pinned and round_.planned and not any(m.needs_masters for m in round_.members.values()):
                freed.extend(round_.pinned)
                round_.pinned = []
        self.closed = [r for r in self.closed if r.pinned]
        return freed

    def masters_to_watch(self) -> list[Member]:
        return [m for _, m in self.members.values() if m.role == "master" and not m.ready and not m.finished]

    def take_counters(self) -> dict[str, int]:
        counters, self.counters = self.counters, Counter()
        return {key: value for key, value in counters.items() if value}

    def _count(self, member: Member) -> None:
        """A member's prompt tokens beyond vLLM's own prefix hit, by who computes them and why
        (`computed_tokens.<reason>`), counted once when it is first allocated. A mirror's claimed
        spans are left to the workers, which split them into reused and selected tokens (spans
        copied exactly are `reused_exact_tokens`, its session's moved pieces `recalled_tokens`);
        its other tokens are:
        - `history`: what its agent's previous request held at the same positions, exactly, and
          no cached block holds any more (evicted, or the previous request's unfinished last block);
          for a master or exact member too (its own history past its claim);
        - `prefix`: what a master of its round holds at the same positions (an identical prefix,
          such as the system prompt, under another salt);
        - `no_master`: pieces other members share but no master computes;
        - `moved`: pieces its agent's previous request held at other positions, no longer cached;
        - `private`: the rest (its own text, the tail after its last reused piece)."""
        if member.counted:
            return
        member.counted = True
        start, total = member.num_computed, len(member.token_ids)
        session = self.sessions.get((member.tag.namespace, member.tag.agent_id))
        history = common_prefix(member.token_ids, session.token_ids) if session else 0
        if member.role != "mirror" or member.claim is None:  # its own history past its claim: computed again
            claimed = 0 if member.claim is None else member.claim[1] - member.claim[0]
            lost = overlap(start + claimed, total, 0, history)
            self.counters[f"computed_tokens.{'master' if member.role == 'master' else 'exact'}"] += total - start - claimed - lost
            self.counters["computed_tokens.history"] += lost
            self._count_spans(member)
            return
        moved = [(p.start, p.end) for p in member.pieces
                 if session and p.key in session.pieces and p.end - p.start >= self.min_piece_tokens]
        masters = {id(m): m for _, _, sources in member.reusable for m, _ in sources}
        prefix = max((common_prefix(member.token_ids, m.token_ids) for m in masters.values()), default=0)
        prefix = max(prefix, history)
        spans = [(r.start, r.start + r.length) for r in member.spans]
        gaps, at = [], start
        for s, e in spans:
            if s > at:
                gaps.append((at, s))
            at = e
        gaps.append((at, total))
        unmastered = [(p.start, p.end) for p in member.pieces if p.key in member.unmastered]
        for a, b in gaps:
            exact_h = overlap(a, b, 0, history)
            exact_p = overlap(a, b, 0, prefix) - exact_h
            no_master = sum(overlap(max(a, prefix), b, s, e) for s, e in unmastered)
            recalled = sum(overlap(max(a, prefix), b, s, e) for s, e in moved) - sum(
                overlap(max(a, prefix), b, s, e) for s, e in unmastered if (s, e) in moved)
            self.counters["computed_tokens.history"] += exact_h
            self.counters["computed_tokens.prefix"] += exact_p
            self.counters["computed_tokens.no_master"] += no_master
            self.counters["computed_tokens.moved"] += recalled
            self.counters["computed_tokens.private"] += (b - a) - exact_h - exact_p - no_master - recalled
        self._count_spans(member)

    def _count_spans(self, member: Member) -> None:
        if member.claim is None:
            return
        self.counters["reused_exact_tokens"] += sum(r.length for r in member.spans if r.exact)
        self.counters["recalled_tokens"] += sum(r.length for r in member.spans if r.recalled)
        self.counters["restored_tokens"] += sum(r.length for r in member.spans if r.stored)
        self.counters["claimed_tokens"] += member.claim[1] - member.claim[0]

    def _plan(self, round_: Round) -> None:
        """Masters by the engine's planning code; each mirror's reusable pieces from them."""
        round_.planned = True
        members = list(round_.members.values())
        round_.largest_blocks = max(len(m.token_ids) // self.block_size + 2 for m in members)
        complete = round_.size is not None and len(members) >= round_.size
        self.counters["rounds_single" if round_.size == 1 else "rounds_complete" if complete else "rounds_timed_out"] += 1
        holders: dict[bytes, int] = {}
        for member in members:
            for key in {p.key for p in member.pieces}:
                holders[key] = holders.get(key, 0) + 1
        shared_of = [{p.key: p.end - p.start for p in m.pieces
                      if holders[p.key] > 1 and p.end - p.start >= self.min_piece_tokens} for m in members]
        anchors = next((m.tag.anchors for m in members if m.tag.anchors is not None), self.anchors)
        masters = [members[i] for i in choose_anchors(shared_of, anchors)]
        # each piece's encodings: its first occurrence in up to `anchors` masters (a line repeated
        # in every master, such as a JSON field, is read once, not averaged over all of them)
        where: dict[bytes, list[tuple[Member, int]]] = {}
        for master in masters:
            master.role = "master"
            for piece in master.pieces:
                held = where.setdefault(piece.key, [])
                if len(held) < anchors and all(m is not master for m, _ in held):
                    held.append((master, piece.start))
        # A shared piece no master holds is computed by its first holder and reused by the others
        # (a later member, so no cycle): in the first holder's pass, or the one after.
        provided: dict[bytes, tuple[Member, int]] = {}
        for member, shared in zip(members, shared_of):
            if member.role == "master":
                continue
            member.role = "mirror"
            member.unmastered = {key for key in shared if key not in where}
            member.reusable, provides = [], []
            for p in member.pieces:
                if p.key not in shared:
                    continue
                source = where.get(p.key) or ([provided[p.key]] if p.key in provided else None)
                if source is not None:
                    member.reusable.append((p.start, p.end - p.start, source))
                elif all(q.key != p.key for q in provides):
                    provides.append(p)
            if not member.reusable:  # nothing to reuse: computed in full, a master of what it holds
                member.role = "master" if provides else "exact"
                for p in provides:
                    where[p.key] = [(member, p.start)]
                continue
            for p in provides:
                provided[p.key] = (member, p.start)
            member.provides = [(p.start, p.end) for p in provides]
            member.provides_end = max((p.end for p in provides), default=0)
        for member in members:
            self.counters[f"members.{member.role}"] += 1


def trim(reusable: list, start: int) -> list:
    """`reusable` spans (start, length, sources) from position `start` on: spans before it dropped,
    one across it cut (its sources' starts moved alike)."""
    out = []
    for s, n, sources in reusable:
        if s + n <= start:
            continue
        cut = max(0, start - s)
        out.append((s + cut, n - cut, [(m, ms + cut) for m, ms in sources]))
    return out


def merge(spans: list[ReusedSpan]) -> list[ReusedSpan]:
    """Spans in order, those that follow each other in the mirror and in every source (the same
    blocks, the same kind) as one."""
    out: list[ReusedSpan] = []
    for span in spans:
        last = out[-1] if out else None
        if (last is not None and last.start + last.length == span.start and last.exact == span.exact
                and last.recalled == span.recalled and last.stored == span.stored
                and len(last.sources) == len(span.sources)
                and all(a is b and at + last.length == bt for (a, at), (b, bt) in zip(last.sources, span.sources))):
            last.length += span.length
        else:
            out.append(span)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` share from their first."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def overlap(a: int, b: int, c: int, d: int) -> int:
    """Length of [a, b) within [c, d)."""
    return max(0, min(b, d) - max(a, c))
