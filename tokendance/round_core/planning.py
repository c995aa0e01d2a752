"""A round's plan, on spans only: which spans each member reuses (the rules), which members or
which neutral row compute the shared spans in full (the masters everyone else reuses), and which
member computes first a shared span no master holds (its later holders read it from that member).
The engine's KV Collector and the vLLM plugin's round book plan with these functions and differ
only in what they execute (`docs/architecture.md#one-round-core`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from tokendance.round_core.spans import Span

class Role(StrEnum):
    """A member's role in its round's plan (`WAITING`: not planned yet)."""

    WAITING = "waiting"
    MASTER = "master"  # computes its prompt in full: the sources of the shared spans
    MIRROR = "mirror"  # reuses shared spans from their sources
    EXACT = "exact"  # computes its prompt in full, a source of nothing


def reusable_spans(spans: Sequence[Span], candidates: Sequence[int], prepared: int, keeps_prefix_exact: bool,
                   min_tokens: int = 1) -> list[int]:
    """Of a member's candidate spans (indices into `spans`: shared in the round, or its own moved
    ones), those it reuses, given that it computes its prompt up to `prepared`.

    - The message it answers (its prompt's last span within `prepared`) is computed in its own
      context even where others hold it too ("Revise your answer."): it is short, and it is what the
      reply reads first (read as another context made it, it moved the first token's KL 0.13 where
      the agent's own memories were recalled: tests/reuse/test_rounds.py).
    - A span shorter than `min_tokens` is computed (the plugin's: re-rotating it costs more than
      it saves).
    - `keeps_prefix_exact` (a member whose KV starts from the prefix cache, no session): its prefix
      stays exact where that is cheap, so that the prefix cache serves its next prompt, which
      starts the same; a reused span shorter than the private text after it (a shared heading
      before an agent's own profile) is computed, since every token after a reused span is no
      longer exact."""
    last = max((i for i, s in enumerate(spans) if s.end <= prepared), default=None)
    reused = [i for i in candidates if i != last and spans[i].end <= prepared and spans[i].length >= min_tokens]
    if keeps_prefix_exact:
        while reused:
            span = spans[reused[0]]
            after = spans[reused[1]].start if len(reused) > 1 else prepared
            if after - span.end <= span.length:
                break
            reused = reused[1:]
    return reused


def choose_masters(spans_of: Sequence[Mapping[bytes, int]]) -> list[int]:
    """Indices of the agents that compute their prompts in full, given each agent's reusable
    shared spans (span key -> length). Greedy: the agent whose not-yet-covered spans save the
    others the most tokens, as long as that saving exceeds what it gives up (reusing the spans
    earlier masters already cover). A span only a few agents hold by chance is not worth a
    master: its holders compute it."""
    holders: dict[bytes, int] = {}
    for spans in spans_of:
        for key in spans:
            holders[key] = holders.get(key, 0) + 1
    covered: set[bytes] = set()

    def gain(index: int) -> int:
        spans = spans_of[index]
        saving = sum(length * (holders[key] - 1) for key, length in spans.items() if key not in covered)
        return saving - sum(length for key, length in spans.items() if key in covered)

    masters: list[int] = []
    candidates = list(range(len(spans_of)))
    while candidates:
        best = max(candidates, key=gain)
        if gain(best) <= 0:
            break
        masters.append(best)
        candidates.remove(best)
        covered |= spans_of[best].keys()
    return masters


def choose_anchors(spans_of: Sequence[Mapping[bytes, int]], anchors: int) -> list[int]:
    """`choose_masters` `anchors` times, each over the agents not chosen yet: a span that enough
    agents hold is computed in full in up to `anchors` of their contexts (the first are the
    masters of `anchors=1`)."""
    chosen: list[int] = []
    for _ in range(anchors):
        rest = [i for i in range(len(spans_of)) if i not in chosen]
        picked = choose_masters([spans_of[i] for i in rest])
        if not picked:
            break
        chosen += [rest[i] for i in picked]
    return chosen


Source = tuple[int, int]  # (member index, the start of the span in that member's prompt)


@dataclass
class Masters:
    """Who computes a round's shared spans in full: `members` (agent masters, their prompts in
    full in their own contexts), or the `neutral` row (those spans once each, in no agent's
    context); `where`: each span's encodings, by key (the neutral row's: the first holder's
    tokens)."""

    members: list[int] = field(default_factory=list)
    neutral: list[bytes] = field(default_factory=list)
    where: dict[bytes, list[Source]] = field(default_factory=dict)


def choose_round_masters(reused_of: Sequence[Sequence[Span]], held_of: Sequence[Sequence[Span]] | None = None,
                         anchors: int = 1, neutral: bool = False) -> Masters:
    """The round's masters, given each member's reused spans (`reusable_spans`) and the shared
    spans it would compute in full (`held_of`: default, its reused ones). Neutral: every shared
    span that two or more members reuse, in the order they first appear, computed in a row of its
    own. Agent masters: `choose_anchors` over the members' reused shared spans; each span a master
    computes, its message answered among them, is read from its first occurrence in up to
    `anchors` masters (a line repeated in every master, such as a JSON field, is read once, not
    averaged over all of them)."""
    reused = [[s for s in spans if s.key is not None] for spans in reused_of]
    if neutral:
        holders: dict[bytes, int] = {}
        first: dict[bytes, Source] = {}
        for index, spans in enumerate(reused):
            for span in spans:
                holders[span.key] = holders.get(span.key, 0) + 1
                first.setdefault(span.key, (index, span.start))
        keys = [key for key in first if holders[key] > 1]
        return Masters(neutral=keys, where={key: [first[key]] for key in keys})
    members = choose_anchors([{s.key: s.length for s in spans} for spans in reused], anchors)
    held_of = reused_of if held_of is None else held_of
    where: dict[bytes, list[Source]] = {}
    for index in members:
        for span in held_of[index]:
            held = where.setdefault(span.key, []) if span.key is not None else None
            if held is not None and len(held) < anchors and all(m != index for m, _ in held):
                held.append((index, span.start))
    return Masters(members, where=where)


@dataclass
class MemberPlan:
    """A member's part in its round's plan: its role; the spans it reuses (by start) with their
    sources (`Masters.where`'s, or the first holder's); the spans it computes first, which later
    holders read from it; the keys of its shared spans no master holds (computed by it or by a
    first holder: the token account's `no_master`)."""

    role: str
    reused: dict[int, list[Source]] = field(default_factory=dict)
    provides: list[Span] = field(default_factory=list)
    unmastered: set[bytes] = field(default_factory=set)


def assign_sources(reused_of: Sequence[Sequence[Span]], order: Sequence[int], masters: Masters) -> list[MemberPlan]:
    """Each member's plan, members visited in `order` (the order their passes run). A shared span
    no master holds is computed by its first holder in that order, in its own context, and reused
    by the later ones (no cycle). A member that reuses nothing computes its prompt in full: a master
    of the spans it provides, or exact. Recalled spans (no key) stay the member's own."""
    plans: list[MemberPlan | None] = [None] * len(reused_of)
    where = dict(masters.where)
    provided: dict[bytes, Source] = {}
    for index in masters.members:
        plans[index] = MemberPlan(Role.MASTER)
    for index in order:
        if plans[index] is not None:
            continue
        plan = MemberPlan(Role.MIRROR)
        for span in reused_of[index]:
            if span.key is None:
                continue
            if span.key not in where:
                plan.unmastered.add(span.key)
            source = where.get(span.key) or ([provided[span.key]] if span.key in provided else None)
            if source is not None:
                plan.reused[span.start] = source
            elif all(p.key != span.key for p in plan.provides):
                plan.provides.append(span)
        if not plan.reused:
            plan.role = Role.MASTER if plan.provides else Role.EXACT
            where.update({p.key: [(index, p.start)] for p in plan.provides})
        else:
            provided.update({p.key: (index, p.start) for p in plan.provides})
        plans[index] = plan
    return plans


def plan_round(reused_of: Sequence[Sequence[Span]], held_of: Sequence[Sequence[Span]] | None = None,
               anchors: int = 1, neutral: bool = False) -> tuple[Masters, list[MemberPlan]]:
    """The round's masters and every member's plan, members in the order given."""
    masters = choose_round_masters(reused_of, held_of, anchors, neutral)
    return masters, assign_sources(reused_of, range(len(reused_of)), masters)
