"""The quality a user reads, beside "identical to full": how sure an accuracy is (a Wilson interval)
and whether free text degenerates (loops, repeated n-grams, little variety), measured on the words
of the replies themselves. Plain Python over strings; no model."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

from tokendance.convergence import WORD, reply_words

SENTENCE = re.compile(r"[^.!?\n]+[.!?]?")
LOOP_REPEATS = 3  # a sentence (or a 4-word run) written this many times in one reply is a loop


def wilson(right: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion `right / total` ((0, 1) when total is 0)."""
    if total == 0:
        return 0.0, 1.0
    p = right / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def ngrams(words: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def loops(text: str) -> bool:
    """A reply that says the same sentence, or the same run of 4 words, `LOOP_REPEATS` times or more
    ("I'm glad to hear that." six times)."""
    sentences = Counter(s.strip().lower() for s in SENTENCE.findall(text) if len(WORD.findall(s)) >= 2)
    if sentences and max(sentences.values()) >= LOOP_REPEATS:
        return True
    runs = Counter(ngrams([w.lower() for w in WORD.findall(text)], 4))
    return bool(runs) and max(runs.values()) >= LOOP_REPEATS


def degeneration(texts: Sequence[str]) -> dict:
    """Over a setting's replies: the share that loop, the share of 4-word runs repeated within their
    own reply, and distinct-2 (distinct word pairs over all pairs, across the replies)."""
    words = [[w.lower() for w in WORD.findall(t)] for t in texts]
    runs = [ngrams(w, 4) for w in words]
    repeated = sum(len(r) - len(set(r)) for r in runs)
    pairs = [p for w in words for p in ngrams(w, 2)]
    return {"loop_fraction": sum(map(loops, texts)) / len(texts) if texts else 0.0,
            "repeated_4grams": repeated / max(1, sum(map(len, runs))),
            "distinct_2": len(set(pairs)) / max(1, len(pairs))}


def convergence(texts: Sequence[str], speakers: Sequence[str], n: int = 3) -> dict:
    """How much a round's agents say the same as each other: over all pairs of replies, the share
    that are the same text once a leading label and each speaker's own name are dropped
    (`identical_pairs`; two empty replies are never the same), and the mean Jaccard overlap of
    their word `n`-grams (`ngram_overlap`, a softer measure; 0 for an empty reply)."""
    words = [reply_words(t, s) for t, s in zip(texts, speakers)]
    grams = [set(ngrams(list(w), n)) or ({w} if w else set()) for w in words]
    pairs = [(i, j) for i in range(len(words)) for j in range(i + 1, len(words))]
    if not pairs:
        return {"identical_pairs": 0.0, "ngram_overlap": 0.0}
    same = sum(bool(words[i]) and words[i] == words[j] for i, j in pairs)
    overlap = sum(len(grams[i] & grams[j]) / max(1, len(grams[i] | grams[j])) for i, j in pairs)
    return {"identical_pairs": same / len(pairs), "ngram_overlap": overlap / len(pairs)}
