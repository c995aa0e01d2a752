"""The token account of a round's members: every prompt token beyond vLLM's own prefix hit, by who
computes it and why (`computed_tokens.<reason>`) or how a claim fills it. The round book counts
each member once, when vLLM first allocates it (`scheduler/round_book.py`); the connector reports the sums
on /metrics.
"""

from __future__ import annotations

from collections import Counter

from tokendance.round_core.planning import Role
from tokendance.round_core.spans import Session, common_prefix, overlap
from tokendance.vllm_plugin.scheduler.members import Member


def count_tokens(member: Member, session: Session | None, min_piece_tokens: int) -> Counter:
    """A member's prompt tokens beyond vLLM's own prefix hit, given its agent's previous request
    (`session`). A mirror's claimed spans are left to the workers, which split them into reused and
    selected tokens (spans copied exactly are `reused_exact_tokens`, its session's moved pieces
    `recalled_tokens`); its other tokens are:
    - `history`: what its agent's previous request held at the same positions, exactly, and
      no cached block holds any more (evicted, or the previous request's unfinished last block);
      for a master or exact member too (its own history past its claim);
    - `prefix`: what a master of its round holds at the same positions (an identical prefix,
      such as the system prompt, under another salt);
    - `no_master`: pieces other members share but no master computes;
    - `moved`: pieces its agent's previous request held at other positions, no longer cached;
    - `private`: the rest (its own text, the tail after its last reused piece)."""
    history = common_prefix(member.token_ids, session.token_ids) if session else 0
    if member.role != Role.MIRROR or member.claim is None:
        counts = _computed_in_full(member, history)
    else:
        counts = _computed_beside_claim(member, session, history, min_piece_tokens)
    if member.claim is not None:
        counts["reused_exact_tokens"] += sum(r.length for r in member.spans if r.exact)
        counts["recalled_tokens"] += sum(r.length for r in member.spans if r.recalled)
        counts["restored_tokens"] += sum(r.length for r in member.spans if r.stored)
        counts["claimed_tokens"] += member.claim[1] - member.claim[0]
    return counts


def _computed_in_full(member: Member, history: int) -> Counter:
    """A master's or exact member's tokens past its claim: its own history among them (the first
    `history` tokens) computed again."""
    counts: Counter = Counter()
    start, total = member.num_computed, len(member.token_ids)
    claimed = 0 if member.claim is None else member.claim[1] - member.claim[0]
    lost = overlap(start + claimed, total, 0, history)
    counts[f"computed_tokens.{'master' if member.role == Role.MASTER else 'exact'}"] += total - start - claimed - lost
    counts["computed_tokens.history"] += lost
    return counts


def _computed_beside_claim(member: Member, session: Session | None, history: int, min_piece_tokens: int) -> Counter:
    """A mirror's tokens between and after its claimed spans, by reason."""
    counts: Counter = Counter()
    moved = [(p.start, p.end) for p in member.pieces
             if session and p.key in session.starts and p.end - p.start >= min_piece_tokens]
    masters = {id(h.member): h.member for r in member.reusable for h in r.sources}
    prefix = max((common_prefix(member.token_ids, m.token_ids) for m in masters.values()), default=0)
    prefix = max(prefix, history)
    unmastered = [(p.start, p.end) for p in member.pieces if p.key in member.unmastered]
    for a, b in _gaps(member, member.num_computed, len(member.token_ids)):
        exact_h = overlap(a, b, 0, history)
        exact_p = overlap(a, b, 0, prefix) - exact_h
        no_master = sum(overlap(max(a, prefix), b, s, e) for s, e in unmastered)
        recalled = sum(overlap(max(a, prefix), b, s, e) for s, e in moved) - sum(
            overlap(max(a, prefix), b, s, e) for s, e in unmastered if (s, e) in moved)
        counts["computed_tokens.history"] += exact_h
        counts["computed_tokens.prefix"] += exact_p
        counts["computed_tokens.no_master"] += no_master
        counts["computed_tokens.moved"] += recalled
        counts["computed_tokens.private"] += (b - a) - exact_h - exact_p - no_master - recalled
    return counts


def _gaps(member: Member, start: int, total: int) -> list[tuple[int, int]]:
    """The ranges of [start, total) its claimed spans leave to vLLM."""
    gaps, at = [], start
    for span in member.spans:
        if span.start > at:
            gaps.append((at, span.start))
        at = span.start + span.length
    gaps.append((at, total))
    return gaps
