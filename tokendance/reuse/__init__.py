"""Reuse layer: segments, position-independent KV reuse, the KV Collector and Master-Mirror tables."""
