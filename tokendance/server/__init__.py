"""OpenAI-compatible HTTP server with round-aware sharing (`tokendance serve`).

Layout: `cli` (arguments, no heavy imports), `app` (FastAPI routes and error mapping), `gate`
(the ASGI middleware for auth, body size and admission), `protocol` (request bodies and response
shapes), `engine_loop` (the one thread that owns the engine), `sink` (outputs from that thread
to the event loop), `streaming` (SSE deltas), `metrics` (Prometheus text). Chat requests become rounds by
`tokendance/round_core/gathering.py`, the rule the vLLM plugin's endpoint follows too.
"""
