"""Spans of a prompt: tokens [start, end) named by their content, so that a message found in
several prompts of a round has one name wherever it sits."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


@dataclass
class Span:
    """A prompt's tokens [start, end). `key` names them if they are shared with other members of
    the round (None: private); `content` names them always (an agent's session finds the spans of
    its previous prompt by it)."""

    start: int
    end: int
    key: bytes | None = None
    content: bytes | None = None

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class Session:
    """An agent's latest request, kept for its next: its tokens (prompt and output) and its
    prompt's spans, which a span that moved since is recalled by. The plugin also finds its KV by
    its cache salt and vLLM's hashes of its full blocks (the engine keeps it in a table)."""

    token_ids: list[int]
    spans: list[Span] = field(default_factory=list)
    salt: str | None = None
    block_hashes: list[Any] = field(default_factory=list)

    @cached_property
    def starts(self) -> dict[bytes, int]:
        """Where the first span of each shared name started."""
        starts: dict[bytes, int] = {}
        for span in self.spans:
            if span.key is not None:
                starts.setdefault(span.key, span.start)
        return starts


def segment_key(token_ids: Sequence[int], namespace: str) -> bytes:
    """Content name of a span, salted by the cache namespace."""
    return hashlib.sha256(namespace.encode() + b"\0" + array("q", token_ids).tobytes()).digest()


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (token ids, lines)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def overlap(a: int, b: int, c: int, d: int) -> int:
    """Length of [a, b) within [c, d)."""
    return max(0, min(b, d) - max(a, c))


@dataclass(frozen=True)
class Boundaries:
    """A tokenizer's ids that cut a prompt: those holding a line break, and its special tokens."""

    line_breaks: frozenset[int]
    specials: frozenset[int] = frozenset()


def cut_spans(token_ids: Sequence[int], boundaries: Boundaries, namespace: str) -> list[Span]:
    """A prompt in spans, as the engine cuts a chat into segments (`reuse/segments.py`: each line of
    each message, the template's header with the first line, its trailer with the last), from its
    token ids alone: a span ends after a token holding a line break, or between two special tokens
    (a trailer without a line break, then the next header); a header's own line break
    (`<|im_start|>user\\n`) does not end the span it opens. Every span is keyed by its content."""
    line_breaks, specials = boundaries.line_breaks, boundaries.specials
    spans, start = [], 0
    for position, token in enumerate(token_ids):
        next_token = token_ids[position + 1] if position + 1 < len(token_ids) else None
        header_only = token_ids[start] in specials and all(
            t not in line_breaks for t in token_ids[start:position])
        ends = ((token in line_breaks and not (header_only and position > start))
                or (token in specials and next_token in specials) or next_token is None)
        if ends:
            key = segment_key(token_ids[start:position + 1], namespace)
            spans.append(Span(start, position + 1, key, key))
            start = position + 1
    return spans
