"""The plugin's side of a round's plan, on token ids: each member's reused pieces and their
sources by the round core's planning (`round_core/planning.py`, the engine's too), and what fills
a claim: its agent's history at the same positions, its masters' pieces, its own pieces that
moved. Functions that read members and return plans; the round book (`scheduler/round_book.py`) applies them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokendance.round_core import planning
from tokendance.round_core.planning import Role
from tokendance.round_core.spans import Session, common_prefix, overlap
from tokendance.vllm_plugin.step_plan import ReusedSpan
from tokendance.vllm_plugin.scheduler.members import Held, Member, Reusable
from tokendance.vllm_plugin.scheduler.store_index import StoredAgent


def plan_round(members: Sequence[Member], anchors: int, min_piece_tokens: int,
               without_session: Sequence[bool]) -> list[tuple[planning.MemberPlan, list[Reusable]]]:
    """Each member's plan by the round core, with the pieces it reuses as the plugin holds them
    (each with every member that computes it): pieces another member holds too, under the core's
    rules (`without_session`: a member whose agent left no session to read back, whose prefix then
    stays exact where that is cheap); agent masters (vLLM computes requests only: no neutral row);
    first holders in arrival order."""
    holders = Counter(key for m in members for key in {p.key for p in m.pieces})
    reused_of = []
    for member, fresh in zip(members, without_session):
        shared = [i for i, p in enumerate(member.pieces) if holders[p.key] > 1]
        chosen = planning.reusable_spans(member.pieces, shared, len(member.token_ids) - 1, fresh, min_piece_tokens)
        reused_of.append([member.pieces[i] for i in chosen])
    _, plans = planning.plan_round(reused_of, [m.pieces for m in members], anchors)
    out = []
    for spans, plan in zip(reused_of, plans):
        lengths = {s.start: s.length for s in spans}
        out.append((plan, [Reusable(start, lengths[start], [Held(members[i], at) for i, at in sources])
                           for start, sources in sorted(plan.reused.items())]))
    return out


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

    def claim_spans(self, member: Member, sources: list[Reusable], start: int, recall: Recall,
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

    def _from_sources(self, member: Member, sources: list[Reusable], start: int) -> list[ReusedSpan]:
        """The pieces its sources compute, from `start` on: copied layer by layer from a first
        holder in the same pass, exactly from sources that hold the same prefix, else re-rotated
        (the mean of every anchor's encoding)."""
        same = {id(h.member): common_prefix(member.token_ids, h.member.token_ids) for r in sources for h in r.sources}
        out = []
        for r in trim(sources, start):
            (first, *more), s, n = r.sources, r.start, r.length
            if first.member.role != Role.MASTER and not first.member.ready:  # its first holder's pass is this step's
                out.append(ReusedSpan(s, n, first.member.block_ids, first.start, late=True))
            elif all(h.start == s and s + n <= same[id(h.member)] for h in r.sources):
                out.append(ReusedSpan(s, n, first.member.block_ids, s, exact=True))
            else:
                out.append(ReusedSpan(s, n, first.member.block_ids, first.start,
                                      [(h.member.block_ids, h.start) for h in more]))
        return out

    def _moved(self, member: Member, recall: Recall, start: int, taken: list[tuple[int, int]]) -> list[ReusedSpan]:
        """Its pieces past `start` that its previous prompt held at other positions (none `taken`
        already): from blocks still cached, else from the session store."""
        session, cached, stored, size = recall.session, recall.cached, recall.stored, self.block_size
        out = []
        for p in member.pieces:
            was = session.starts.get(p.key)
            n = p.end - p.start
            if (was is None or p.start < start or p.end >= len(member.token_ids) or n < self.min_piece_tokens
                    or any(overlap(p.start, p.end, a, b) for a, b in taken)):
                continue
            if (was + n - 1) // size < len(cached) and all(b >= 0 for b in cached[was // size:(was + n - 1) // size + 1]):
                out.append(ReusedSpan(p.start, n, cached, was, recalled=True))
            elif stored is not None and stored.token_ids[was:was + n] == member.token_ids[p.start:p.end]:
                out.append(ReusedSpan(p.start, n, [], was, recalled=True, stored=stored.entry))
        return out


def trim(reusable: list[Reusable], start: int) -> list[Reusable]:
    """`reusable` pieces from position `start` on: pieces before it dropped, one across it cut (its
    sources' starts moved alike)."""
    out = []
    for r in reusable:
        if r.start + r.length <= start:
            continue
        cut = max(0, start - r.start)
        out.append(Reusable(r.start + cut, r.length - cut, [Held(h.member, h.start + cut) for h in r.sources]))
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
