"""A round's plan, on token ids, span names and lengths only: what names a span (its tokens and
namespace, wherever it sits), which agents compute their prompts in full so that their shared
spans become the masters everyone else reuses, and which agents' check pass covers every distinct
span. Pure Python, no KV: the engine's KV Collector (`reuse/collector.py`) and the vLLM plugin
(`vllm_plugin/round_planning.py`) plan with the same functions."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence


def segment_key(token_ids: Sequence[int], namespace: str) -> bytes:
    """Content name of a shared segment, salted by the cache namespace."""
    return hashlib.sha256(namespace.encode() + b"\0" + array("q", token_ids).tobytes()).digest()


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (token ids, lines)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


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


def first_holders(keys_of: Sequence[set[bytes]]) -> list[int]:
    """Indices of a small set of agents whose spans cover every distinct span (greedy, in order)."""
    seen: set[bytes] = set()
    holders = []
    for index, keys in enumerate(keys_of):
        if keys - seen:
            holders.append(index)
            seen |= keys
    return holders
