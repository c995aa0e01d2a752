"""The planning of a round's spans and their sources, on token ids: where a prompt is cut into
pieces, who computes in full (masters, chosen by the engine's planning code, `reuse/planning.py`),
what each mirror reuses from whom, and what fills a claim: its agent's history at the same
positions, its masters' pieces, its own pieces that moved. Functions that read members and return
plans; the round book (`round_book.py`) applies them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from tokendance.reuse.planning import choose_anchors, common_prefix, segment_key
from tokendance.vllm_plugin.plan import ReusedSpan
from tokendance.vllm_plugin.rounds import Member, Piece, Session
from tokendance.vllm_plugin.store_index import StoredAgent

# (mirror start, length, [(source member, source start), ...]): a piece and every member computing it
Sourced = tuple[int, int, list[tuple[Member, int]]]


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


@dataclass
class MemberPlan:
    """A member's part in its round's plan: its role (master | mirror | exact); a mirror's pieces
    it reuses, each with every member (anchor) that computes it; its shared pieces no master
    holds, and those of them it computes first (the later holders read them from it)."""

    role: str
    reusable: list[Sourced] = field(default_factory=list)
    unmastered: set[bytes] = field(default_factory=set)
    provides: list[Piece] = field(default_factory=list)


def plan_round(members: Sequence[Member], anchors: int, min_piece_tokens: int) -> list[MemberPlan]:
    """Each member's plan: masters by the engine's planning code; each mirror's reusable pieces
    from them. A shared piece no master holds is computed by its first holder and reused by the
    others (a later member, so no cycle): in the first holder's pass, or the one after."""
    shared_of = _shared_pieces(members, min_piece_tokens)
    masters = choose_anchors(shared_of, anchors)
    where = _anchor_sources([members[i] for i in masters], anchors)
    provided: dict[bytes, tuple[Member, int]] = {}
    plans = []
    for index, (member, shared) in enumerate(zip(members, shared_of)):
        if index in masters:
            plans.append(MemberPlan("master"))
            continue
        plan = MemberPlan("mirror", unmastered={key for key in shared if key not in where})
        provides: list[Piece] = []
        for p in member.pieces:
            if p.key not in shared:
                continue
            source = where.get(p.key) or ([provided[p.key]] if p.key in provided else None)
            if source is not None:
                plan.reusable.append((p.start, p.end - p.start, source))
            elif all(q.key != p.key for q in provides):
                provides.append(p)
        if not plan.reusable:  # nothing to reuse: computed in full, a master of what it holds
            plan.role = "master" if provides else "exact"
            for p in provides:
                where[p.key] = [(member, p.start)]
        else:
            for p in provides:
                provided[p.key] = (member, p.start)
            plan.provides = provides
        plans.append(plan)
    return plans


def _shared_pieces(members: Sequence[Member], min_piece_tokens: int) -> list[dict[bytes, int]]:
    """Each member's pieces that another member holds too, long enough to reuse: key -> length."""
    holders: dict[bytes, int] = {}
    for member in members:
        for key in {p.key for p in member.pieces}:
            holders[key] = holders.get(key, 0) + 1
    return [{p.key: p.end - p.start for p in m.pieces if holders[p.key] > 1 and p.end - p.start >= min_piece_tokens}
            for m in members]


def _anchor_sources(masters: Sequence[Member], anchors: int) -> dict[bytes, list[tuple[Member, int]]]:
    """Each piece's encodings: its first occurrence in up to `anchors` masters (a line repeated in
    every master, such as a JSON field, is read once, not averaged over all of them)."""
    where: dict[bytes, list[tuple[Member, int]]] = {}
    for master in masters:
        for piece in master.pieces:
            held = where.setdefault(piece.key, [])
            if len(held) < anchors and all(m is not master for m, _ in held):
                held.append((master, piece.start))
    return where


@dataclass
class Recall:
    """What a claim may read back of its agent's previous request: `session` (None: none under
    this salt, or no block lookup), `cached` (per full block of it, the id of the block vLLM's
    prefix cache still holds, -1 if gone) and `stored` (its session store entry, or None)."""

    session: Session | None = None
    cached: list[int] = field(default_factory=list)
    stored: StoredAgent | None = None


class SpanPlanner:
    """What fills a member's claim, span by span and by source. `block_size`: vLLM's (a session's
    cached blocks are read whole); `min_piece_tokens`: a shorter piece that moved is not recalled."""

    def __init__(self, block_size: int, min_piece_tokens: int):
        self.block_size = block_size
        self.min_piece_tokens = min_piece_tokens

    def claim_spans(self, member: Member, sources: list[Sourced], start: int, recall: Recall,
                    moved: bool = True) -> list[ReusedSpan]:
        """What fills a claim from `start` (vLLM's hit), in order: its session's history at the
        same positions (exact), then `sources`' pieces (exact where a source holds the same tokens
        from position 0), then, with `moved`, its session's pieces that moved."""
        out, history = self._history(member, start, recall)
        out += self._from_sources(member, sources, history)
        if moved and recall.session is not None:
            out += self._moved(member, recall, history, [(r.start, r.start + r.length) for r in out])
        out.sort(key=lambda r: r.start)
        return merge(out)

    def session_blocks(self, spans: list[ReusedSpan], cached: list[int]) -> list[int]:
        """The session's cached blocks the spans read (the connector pins them)."""
        size = self.block_size
        return sorted({cached[b] for r in spans if r.source_block_ids is cached
                       for b in range(r.source_start // size, (r.source_start + r.length - 1) // size + 1)})

    def _history(self, member: Member, start: int, recall: Recall) -> tuple[list[ReusedSpan], int]:
        """Its agent's history past `start`, exact: the same tokens from position 0, in blocks
        still cached, then the rest, gone from the pool, from the session store; and where it ends."""
        out, history, size = [], start, self.block_size
        session, cached, stored = recall.session, recall.cached, recall.stored
        if session is not None:
            limit = min(common_prefix(member.token_ids, session.token_ids), len(member.token_ids) - 1)
            while history < limit and history // size < len(cached) and cached[history // size] >= 0:
                history = min(limit, (history // size + 1) * size)
            if history > start:
                out.append(ReusedSpan(start, history - start, cached, start, exact=True))
        if stored is not None:
            limit = min(common_prefix(member.token_ids, stored.token_ids), len(member.token_ids) - 1)
            if limit > history:
                out.append(ReusedSpan(history, limit - history, [], history, exact=True, stored=stored.entry))
                history = limit
        return out, history

    def _from_sources(self, member: Member, sources: list[Sourced], start: int) -> list[ReusedSpan]:
        """The pieces its sources compute, from `start` on: copied layer by layer from a first
        holder in the same pass, exactly from sources that hold the same prefix, else re-rotated
        (the mean of every anchor's encoding)."""
        same = {id(m): common_prefix(member.token_ids, m.token_ids) for _, _, held in sources for m, _ in held}
        out = []
        for s, n, held in trim(sources, start):
            (first, at), *more = held
            if first.role != "master" and not first.ready:  # its first holder's pass is this step's
                out.append(ReusedSpan(s, n, first.block_ids, at, late=True))
            elif all(ms == s and s + n <= same[id(m)] for m, ms in held):
                out.append(ReusedSpan(s, n, first.block_ids, s, exact=True))
            else:
                out.append(ReusedSpan(s, n, first.block_ids, at, [(m.block_ids, ms) for m, ms in more]))
        return out

    def _moved(self, member: Member, recall: Recall, start: int, taken: list[tuple[int, int]]) -> list[ReusedSpan]:
        """Its pieces past `start` that its previous prompt held at other positions (none `taken`
        already): from blocks still cached, else from the session store."""
        session, cached, stored, size = recall.session, recall.cached, recall.stored, self.block_size
        out = []
        for p in member.pieces:
            was = session.pieces.get(p.key)
            n = p.end - p.start
            if (was is None or p.start < start or n < self.min_piece_tokens
                    or any(overlap(p.start, p.end, a, b) for a, b in taken)):
                continue
            if (was + n - 1) // size < len(cached) and all(b >= 0 for b in cached[was // size:(was + n - 1) // size + 1]):
                out.append(ReusedSpan(p.start, n, cached, was, recalled=True))
            elif stored is not None and stored.token_ids[was:was + n] == member.token_ids[p.start:p.end]:
                out.append(ReusedSpan(p.start, n, [], was, recalled=True, stored=stored.entry))
        return out


def trim(reusable: list[Sourced], start: int) -> list[Sourced]:
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


def overlap(a: int, b: int, c: int, d: int) -> int:
    """Length of [a, b) within [c, d)."""
    return max(0, min(b, d) - max(a, c))
