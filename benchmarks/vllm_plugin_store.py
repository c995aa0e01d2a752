"""The session store inside vLLM (`store_gib`: Master-Mirror storage of agents at rest), side by
side with the plugin without it, one engine after the other in one process:

    .venv-vllm/bin/python benchmarks/vllm_plugin_store.py --workload generative-agents --agents 16 32

For each N (a namespace of its own): round 1 (closed loop, the agents' real outputs); the KV at
rest, dense (every agent's prompt and output, as vLLM's pool holds it) against the store's bytes
(its `vllm:tokendance_store_bytes` gauge); then other requests take the whole pool (a flood, as
other tenants or agents would between two turns), and round 2 runs: its wall time, its tokens
restored from the store and those computed because the pool lost them (`history`, `moved`).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="generative-agents")
    parser.add_argument("--agents", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--store-gib", type=float, default=4.0)
    parser.add_argument("--pool-blocks", type=int, default=400, help="vLLM's KV pool, in 128-token blocks")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rest-only", action="store_true",
                        help="only the KV at rest after round 1, with the store (no flood, no round 2, no store-off run)")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from tokendance.model.platform import probe_cpu
    from tokendance.vllm_plugin.model_folder import default_model_folder
    from tokendance.workloads import make_workload

    from tokendance.vllm_plugin.worker import store as store_module

    restoring = [0.0]  # seconds reading the store back (vLLM's in-process metrics keep counters whole)
    rows = store_module.SessionStore.rows

    def timed_rows(self, *args):
        started = time.perf_counter()
        try:
            return rows(self, *args)
        finally:
            restoring[0] += time.perf_counter() - started

    store_module.SessionStore.rows = timed_rows
    cpu = probe_cpu()
    dtype = "bfloat16" if cpu.native_bf16 else "float32"
    results = []
    for store_gib in (args.store_gib,) if args.rest_only else (0.0, args.store_gib):
        llm = LLM(model=str(default_model_folder()), dtype=dtype, max_model_len=8192, enable_prefix_caching=True,
                  enforce_eager=True, seed=0, disable_log_stats=False, num_gpu_blocks_override=args.pool_blocks,
                  kv_transfer_config=KVTransferConfig(kv_connector="TokenDanceConnector", kv_role="kv_both",
                                                      kv_connector_extra_config={"store_gib": store_gib}))
        tokenizer = llm.get_tokenizer()
        config = llm.llm_engine.vllm_config.model_config
        per_token = 2 * config.get_num_layers(llm.llm_engine.vllm_config.parallel_config) * config.get_num_kv_heads(
            llm.llm_engine.vllm_config.parallel_config) * config.get_head_size() * config.dtype.itemsize

        def metrics() -> dict:
            found = {}
            for m in llm.get_metrics():
                if m.name.startswith("vllm:tokendance_"):
                    label = next((v for k, v in m.labels.items() if k in ("reason", "phase", "role", "formed")), None)
                    key = (m.name.removeprefix("vllm:tokendance_"), label) if label else m.name.removeprefix("vllm:tokendance_")
                    found[key] = found.get(key, 0) + m.value
            return found

        def run_round(n: int, index: int, history: list, salt: str) -> tuple[dict, float, list]:
            workload = make_workload(args.workload, n, seed=n)
            turns = workload.turns(index, history)
            prompts = [list(tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]) for t in turns]
            requests = [TokensPrompt(prompt_token_ids=p, cache_salt=f"{salt}-{t.agent_id}") for p, t in zip(prompts, turns)]
            params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, extra_args={"kv_transfer_params": {"tokendance": {
                "round_id": f"{salt}-r{index}", "round_size": n, "agent_id": t.agent_id, "namespace": salt}}})
                for t in turns]
            started = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            said = {t.agent_id: o.outputs[0].text.strip() or "..." for t, o in zip(turns, outputs)}
            held = sum(len(p) + len(o.outputs[0].token_ids) - 1 for p, o in zip(prompts, outputs))
            ttft = max(o.metrics.first_token_latency for o in outputs)
            return said, seconds, [held, ttft]

        def settle() -> None:  # one more engine step: the saves of the last finished requests
            llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=1), use_tqdm=False)

        def flood() -> float:
            """More tokens than the pool holds (LRU evicts every cached block); seconds per token."""
            rng = random.Random(0)
            size = args.pool_blocks * 128 + 4096
            prompts = [[rng.randrange(1000, 40000) for _ in range(2048)] for _ in range(size // 2048 + 1)]
            started = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=p, cache_salt=f"flood{time.time()}") for p in prompts],
                         SamplingParams(max_tokens=1), use_tqdm=False)
            return (time.perf_counter() - started) / sum(map(len, prompts))

        for n in args.agents:
            salt = f"n{n}-store{store_gib:g}"
            before = metrics()
            said, _, (held, _) = run_round(n, 0, [], salt)
            settle()
            after = metrics()
            stored = after.get("store_bytes", 0) - before.get("store_bytes", 0)
            agents = after.get("store_agents", 0) - before.get("store_agents", 0)
            if args.rest_only:
                results.append({"store_gib": store_gib, "agents": n, "dense_mb": held * per_token / MB / n,
                                "store_mb": (stored / agents / MB) if agents else None})
                continue
            prefill = flood()
            start = metrics()
            restoring[0] = 0.0
            _, seconds, (_, ttft) = run_round(n, 1, [said], salt)
            settle()
            end = metrics()
            delta = {k: v - start.get(k, 0) for k, v in end.items()}
            results.append({"store_gib": store_gib, "agents": n, "dense_mb": held * per_token / MB / n,
                            "store_mb": (stored / agents / MB) if agents else None, "round2_s": seconds,
                            "restored": delta.get("restored_tokens", 0), "prefill_ms": prefill * 1e6,
                            "restore_ms": restoring[0] * 1e6 / max(1, delta.get("restored_tokens", 0)), "ttft": ttft,
                            "lost": delta.get(("computed_tokens", "history"), 0) + delta.get(("computed_tokens", "moved"), 0),
                            "computed": sum(v for k, v in delta.items()
                                            if isinstance(k, tuple) and k[0] == "computed_tokens" and k[1] != "check")})
        del llm
        gc.collect()
    print(f"{args.workload}, {dtype}, CPU {cpu.describe()}, pool {args.pool_blocks} blocks, "
          f"{args.max_tokens} output tokens")
    if args.rest_only:
        for r in results:
            print(f"N={r['agents']}: {r['dense_mb']:.2f} MB/agent dense, {r['store_mb']:.2f} MB/agent in the store "
                  f"({r['dense_mb'] / r['store_mb']:.2f}x smaller)")
        return 0
    print(f"{'store':>6}{'N':>5}{'dense MB/agent':>16}{'store MB/agent':>16}{'smaller':>9}"
          f"{'round 2 s':>11}{'TTFT s':>8}{'restored':>10}{'lost':>8}{'computed':>10}")
    for r in results:
        stored = "-" if r["store_mb"] is None else f"{r['store_mb']:.2f}"
        smaller = "-" if r["store_mb"] is None else f"{r['dense_mb'] / r['store_mb']:.2f}x"
        print(f"{r['store_gib']:>6g}{r['agents']:>5}{r['dense_mb']:>16.2f}{stored:>16}{smaller:>9}"
              f"{r['round2_s']:>11.2f}{r['ttft']:>8.2f}{r['restored']:>10.0f}{r['lost']:>8.0f}{r['computed']:>10.0f}")
    for n in args.agents:
        off, on = (next(r for r in results if r["agents"] == n and (r["store_gib"] > 0) == s) for s in (False, True))
        print(f"N={n}: round 2 after the flood {off['round2_s'] / on['round2_s']:.2f}x faster with the store "
              f"(TTFT {off['ttft'] / on['ttft']:.2f}x), {off['computed'] / max(1, on['computed']):.2f}x fewer tokens "
              f"computed; reading the store back {on['restore_ms']:.1f} ms per 1k tokens against "
              f"{on['prefill_ms']:.0f} ms to prefill them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
