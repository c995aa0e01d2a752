"""What some of `tokendance bench`'s options mean, for the modules that run it (kept out of the
argument parser, `bench/cli.py`, which imports them)."""

from __future__ import annotations

from tokendance import registry

CAPACITY_KV_BYTES = 160 * 2**20  # capacity's default budget


def capacity_modes() -> list[str]:
    """The modes the capacity search compares by default: those that keep or share KV."""
    return [name for name, choice in registry.REUSE_POLICIES.items() if choice.reuses]


def kv_bytes(args) -> int | None:
    """The KV pool the bench was given, None for its default ("auto" included)."""
    return None if args.kv_cache_bytes in (None, "auto") else args.kv_cache_bytes
