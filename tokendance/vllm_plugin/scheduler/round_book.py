"""The round book: membership and arrival of the scheduler side's rounds (`scheduler/members.py`), each
member's claim as its sources become readable, vLLM's commits, the pins that keep masters' blocks
until their readers are filled, and agents' sessions. The plans it applies are `scheduler/sources.py`'s;
the tokens it counts, `scheduler/account.py`'s.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from tokendance.round_core.planning import Role
from tokendance.round_core.spans import Boundaries, Session, cut_spans
from tokendance.vllm_plugin.step_plan import ReusedSpan
from tokendance.vllm_plugin.scheduler.account import count_tokens
from tokendance.vllm_plugin.scheduler.sources import Recall, SpanPlanner, plan_round, trim
from tokendance.vllm_plugin.scheduler.members import Member, Reusable, Round, RoundTag, Stage
from tokendance.vllm_plugin.scheduler.store_index import StoreIndex


class RoundBook:
    """Every open round and its members, by request id. Invariant: a round's `pinned` blocks are
    held (one reference each) from its masters' computation until no member needs them."""

    def __init__(self, boundaries: Boundaries, round_timeout_s: float, hold_timeout_s: float,
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
        self.planner = SpanPlanner(block_size, min_piece_tokens)

    def add(self, request_id: str, tag: RoundTag, token_ids: list[int], now: float | None = None,
            salt: str | None = None) -> None:
        now = time.monotonic() if now is None else now
        key = (tag.namespace, tag.round_id)
        round_ = self.rounds.get(key)
        if round_ is None or round_.planned:  # a planned round takes no one: a late member is exact
            if round_ is not None:
                self.members[request_id] = (round_, Member(request_id, tag, token_ids, now, role=Role.EXACT, salt=salt))
                return
            self.serials += 1
            round_ = self.rounds[key] = Round(key, tag.round_size, now, serial=self.serials)
        member = Member(request_id, tag, token_ids, now, salt=salt)
        member.pieces = cut_spans(token_ids, self.boundaries, tag.namespace)
        round_.members[request_id] = member
        round_.latest = now
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
        if member.role != Role.MIRROR:
            return self._claim_history(member, num_computed)
        if member.stage == Stage.SENT:  # resumed after a preemption: its masters may be unpinned by now
            member.role = Role.EXACT
            return 0
        return self._claim_mirror(member, num_computed, now)

    def _claim_mirror(self, member: Member, num_computed: int, now: float) -> int | None:
        """A mirror's claim once its sources are readable: up to the end of its last reused piece
        (or of the pieces it provides), within this step's claim budget."""
        sources, waiting = self._readable_sources(member, num_computed)
        masters = {id(h.member): h.member for r in sources for h in r.sources if h.member.role == Role.MASTER}
        if any(m.finished and not m.ready for m in masters.values()):  # a master gone before computing
            member.role = Role.EXACT
            return 0
        if waiting or not all(m.ready for m in masters.values()):
            if now - member.arrived > self.hold_timeout_s:
                member.role = Role.EXACT
                return 0
            self.counters["held_steps"] += 1
            return None
        self._fill(member, sources, num_computed)
        if not member.spans:  # all in vLLM's prefix cache already
            member.role = Role.EXACT
            return 0
        end = max(member.spans[-1].start + member.spans[-1].length, member.provides_end)
        budget, count = self.claim_tokens_per_step, end - num_computed
        if budget and self.claimed_this_step and self.claimed_this_step + count > budget:
            self.counters["held_steps"] += 1
            member.spans, member.session_blocks, member.store_entry = [], [], None
            return None  # this step's pass is full: a later step fills this mirror
        member.claim = (num_computed, end)
        return count

    def _readable_sources(self, member: Member, num_computed: int) -> tuple[list[Reusable], bool]:
        """A mirror's reusable pieces past `num_computed` whose first source can be read (a master,
        a first holder whose pass is confirmed or runs in this step), and whether it waits for one
        that cannot be read yet. A piece whose first holder computed it in no pass (exact, or gone)
        is computed in the mirror's claim."""
        sources, waiting = [], False
        for piece in trim(member.reusable, num_computed):
            first = piece.sources[0].member
            filled = first.ready and first.provides_later and self.step - first.sent_step >= self.confirm_steps
            if first.role == Role.MASTER or filled or first.stage == Stage.COMMITTED:
                sources.append(piece)
            elif first.role == Role.MIRROR and not first.finished and first.provides_later:
                waiting = True  # the piece's first holder is not admitted yet, or its pass not confirmed
        return sources, waiting

    def _claim_history(self, member: Member, num_computed: int) -> int:
        """A master's or exact member's claim: its history past vLLM's hit, exact (once: not again
        after a preemption)."""
        if member.stage == Stage.SENT:
            return 0
        self._fill(member, [], num_computed, moved=False)
        if not member.spans:
            member.claim = None
            return 0
        end = member.spans[-1].start + member.spans[-1].length
        member.claim = (num_computed, end)
        return end - num_computed

    def _fill(self, member: Member, sources: list[Reusable], start: int, moved: bool = True) -> None:
        """Sets what fills a member's claim from `start` (`sources.SpanPlanner`), the session
        blocks it reads (the connector pins them) and the store entry it reads."""
        recall = self._recall(member)
        member.spans = self.planner.claim_spans(member, sources, start, recall, moved)
        member.session_blocks = self.planner.session_blocks(member.spans, recall.cached)
        member.store_entry = next((r.stored for r in member.spans if r.stored is not None), None)

    def _session(self, member: Member) -> Session | None:
        """Its agent's previous request, under the same salt, while blocks are looked up."""
        session = self.sessions.get((member.tag.namespace, member.tag.agent_id))
        return None if session is None or session.salt != member.salt or self.lookup is None else session

    def _recall(self, member: Member) -> Recall:
        """What its agent's previous request left: its session (`_session`), the blocks vLLM's
        prefix cache still holds of it, its session store entry."""
        agent = (member.tag.namespace, member.tag.agent_id)
        session = self._session(member)
        held = [] if session is None else [self.lookup(h) for h in session.block_hashes]
        stored = None if self.store is None else self.store.find(agent, member.salt)
        return Recall(session, [-1 if b is None else b for b in held], stored)

    def commit(self, request_id: str, num_external: int) -> Member | None:
        """vLLM allocated the request with `num_external` claimed tokens: the member whose load the
        workers run this step (None for any other; a mirror whose claim vLLM did not take as it
        was, its own cache covering it, is computed exactly). Only here is the step's claim budget
        spent: vLLM may ask `claim` again after an allocation that failed."""
        member = self.find(request_id)
        if member is None:
            return None
        if member.claim is not None and member.stage < Stage.SENT:
            if num_external and num_external == member.claim[1] - member.claim[0]:
                if member.role == Role.MIRROR:  # a history claim is a copy: not counted against the pass
                    self.claimed_this_step += num_external
                member.stage = Stage.COMMITTED
                member.block_ids = []  # filled when its load is sent (a piece it provides is read from them)
                self._count(member)
                return member
            if member.role == Role.MIRROR:
                member.role = Role.EXACT
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
        return [(keys[r.start], r.sources[0].member.block_ids, r.sources[0].start, r.length) for r in member.reusable
                if len(r.sources) == 1 and r.start in keys and _reads_back(r.sources[0].member)]

    def round_of(self, request_id: str) -> int:
        return self.members[request_id][0].serial

    def sent(self, member: Member) -> list[int]:
        """A mirror's load goes to the workers in this step; the blocks to pin for the members that
        read the pieces it provides in later steps."""
        member.stage, member.sent_step = Stage.SENT, self.step
        return self.mark_ready(member.request_id, member.block_ids) if member.provides_end else []

    def drop(self, request_id: str) -> int | None:
        """It leaves its round on a failure: a source of nothing, finished for the book (`finish`)."""
        member = self.find(request_id)
        if member is None:
            return None
        member.failed = True
        return self.finish(request_id)

    def failed_blocks(self, block_ids: set[int]) -> None:
        """The workers could not fill these blocks: the mirrors holding them provide nothing."""
        for _, member in self.members.values():
            if member.stage == Stage.SENT and not member.failed and not block_ids.isdisjoint(member.block_ids):
                member.failed = True

    def mark_ready(self, request_id: str, block_ids: list[int]) -> list[int]:
        """A master's prompt is computed in this step, or a first holder's pass is sent: the blocks
        others read (to pin) are returned: all a master's, only those holding the pieces a first
        holder provides (a round larger than the pool must not be held up by its mirrors' pins)."""
        round_, member = self.members[request_id]
        member.ready = True
        member.block_ids = list(block_ids)
        if member.role == Role.MASTER:
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
            self.sessions[key] = Session(list(all_token_ids), member.pieces, member.salt, list(block_hashes))
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
        return [m for _, m in self.members.values() if m.role == Role.MASTER and not m.ready and not m.finished]

    def take_counters(self) -> dict[str, int]:
        counters, self.counters = self.counters, Counter()
        return {key: value for key, value in counters.items() if value}

    def _count(self, member: Member) -> None:
        """A member's prompt tokens by who computes them and why (`account.count_tokens`),
        counted once, when it is first allocated."""
        if member.counted:
            return
        member.counted = True
        session = self.sessions.get((member.tag.namespace, member.tag.agent_id))
        self.counters.update(count_tokens(member, session, self.min_piece_tokens))

    def _plan(self, round_: Round) -> None:
        """Each member's role and sources (`sources.plan_round`), applied."""
        round_.planned = True
        members = list(round_.members.values())
        round_.largest_blocks = max(len(m.token_ids) // self.block_size + 2 for m in members)
        complete = round_.size is not None and len(members) >= round_.size
        self.counters["rounds_single" if round_.size == 1 else "rounds_complete" if complete else "rounds_timed_out"] += 1
        anchors = next((m.tag.anchors for m in members if m.tag.anchors is not None), self.anchors)
        without_session = [self._session(m) is None for m in members]
        for member, (plan, reusable) in zip(members, plan_round(members, anchors, self.min_piece_tokens, without_session)):
            member.role = plan.role
            member.unmastered = plan.unmastered
            member.reusable = reusable
            member.provides = [(p.start, p.end) for p in plan.provides]
            member.provides_end = max((p.end for p in plan.provides), default=0)
            self.counters[f"members.{member.role}"] += 1


def _reads_back(first: Member) -> bool:
    """A piece's only source keeps it readable as the session store's master: a master, or a first
    holder whose pass ran and whose blocks are pinned."""
    return first.role == Role.MASTER or bool(first.provides_end and first.ready and first.provides_later and not first.finished)
