"""`tokendance serve --replicas K`: one OpenAI-compatible endpoint in front of K engine replicas,
deployed with Ray Serve (`pip install 'tokendance[ray]'`).

    HTTP -> Ray Serve proxy -> Ingress (auth, body limit, routing key)
                                  -> KVAffinityRouter (a Ray Serve request router: router.py over routing.py)
                                  -> EngineReplica x K (each: an LLM and the single-process app)

Every replica runs the same FastAPI app `tokendance serve` runs alone, driven in-process over
ASGI, so endpoints, errors, streaming, admission and metrics are the same; the ingress forwards
the request and streams the replica's ASGI messages back. A replica that dies is restarted by Ray;
a request whose replica died before answering is retried once on another one, then answered 503.
`/metrics` merges every replica's metrics with a `replica` label; `/v1/replicas` lists them.

Modules: `launch` (the command), `ingress`, `router` (and `ray_routers`, Ray Serve's own), `replica`
(the engine's), `vllm_replica` (a vLLM server with the plugin), `routing` (the policy, pure Python),
`supervise` (a replica's process session).
"""
