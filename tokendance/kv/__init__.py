"""KV bookkeeping: block pool, prefix hashing, per-request block tables. Pure Python, no torch."""
