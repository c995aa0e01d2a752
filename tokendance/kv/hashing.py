"""Chained, namespace-salted block hashes for automatic prefix caching.

hash(block i) = sha256(hash(block i-1) || token ids of block i), with the chain's root salted by the
cache namespace, so equal hashes mean equal token prefixes in the same namespace, and requests in
different namespaces never share a block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def root_hash(namespace: str) -> BlockHash:
    return hashlib.sha256(b"tokendance-namespace\0" + namespace.encode()).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, namespace: str
) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `hashes`."""
    parent = hashes[-1] if hashes else root_hash(namespace)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
