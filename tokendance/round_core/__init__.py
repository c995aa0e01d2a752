"""A round planned once, for both front doors: pure Python over token ids (no torch, no vLLM).

- `spans.py`: what names a span (its tokens and namespace, wherever it sits) and where a prompt is
  cut into spans;
- `planning.py`: which spans each member reuses (the rules), who computes them in full (masters:
  neutral or agents), and who computes a shared span no master holds first;
- `gathering.py`: chat requests into rounds (declared, transparent, whole), the driver of a door
  that holds them on its event loop (`HeldTurns`), and the name of an agent no client named
  (`conversation_id`);
- `protocol.py`: the round protocol both doors speak (the round fields, a round's shape, the
  `/v1/rounds` answer).

The engine's KV Collector (`reuse/collector.py`) executes a plan over its own block tables; the
vLLM plugin's round book (`vllm_plugin/scheduler/round_book.py`) over vLLM's requests. A policy change made
here reaches both.
"""
