"""A round planned once, for both front doors: pure Python over token ids (no torch, no vLLM).

- `spans.py`: what names a span (its tokens and namespace, wherever it sits) and where a prompt is
  cut into spans;
- `planning.py`: which spans each member reuses (the rules), who computes them in full (masters:
  neutral or agents), and who computes a shared span no master holds first.

The engine's KV Collector (`reuse/collector.py`) executes a plan over its own block tables; the
vLLM plugin's round book (`vllm_plugin/scheduler/round_book.py`) over vLLM's requests. A policy change made
here reaches both.
"""
