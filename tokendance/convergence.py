"""Agents saying the same thing: which replies of a round repeat another member's. The failure
approximate reuse can add to a simulation (every mirror reading the shared text as one agent's
context made it, and answering as that agent would), counted by the engine for every round and by
`tokendance bench quality` over runs. Plain Python over strings."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

WORD = re.compile(r"\w+(?:'\w+)?")
# A speaker's label before the reply ("Hana:", "Viktor Nguyen:"): up to four words and a colon
LABEL = re.compile(r"^\s*(?:\w+[\w'.-]*\s+){0,3}\w+[\w'.-]*\s*:")


def reply_words(text: str, speaker: str | None = None) -> tuple[str, ...]:
    """The reply's words, lower-cased, without a leading label ("Hana: ...", whoever it names: a
    copy of another agent's line keeps that agent's label) and, when the speaker is known, without
    the words of its own name wherever they stand."""
    text = LABEL.sub("", text, count=1)
    dropped = set() if speaker is None else {w.lower() for w in WORD.findall(speaker)}
    return tuple(w for w in (x.lower() for x in WORD.findall(text)) if w not in dropped)


def repeated_replies(texts: Sequence[str], speakers: Sequence[str] | None = None) -> int:
    """How many replies say the same words as at least one other reply of the round (empty
    replies never count)."""
    words = [reply_words(t, s) for t, s in zip(texts, speakers or [None] * len(texts))]
    counts = Counter(w for w in words if w)
    return sum(1 for w in words if w and counts[w] > 1)
