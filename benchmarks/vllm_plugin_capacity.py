"""Agents kept per KV budget inside vLLM, where agents rest between their turns: N agents of which
K act in each round (a simulation that activates a few agents per step), each agent acting every
N/K rounds, so its history must survive N/K - 1 rounds of other agents. At an equal budget B of
KV memory, one engine after the other in one process:

- plain vLLM-CPU, its pool B (prefix caching);
- vLLM + the plugin, its pool B, no session store;
- vLLM + the plugin, a pool P (the running round) and the session store B - P.

    .venv-vllm/bin/python benchmarks/vllm_plugin_capacity.py --agents 32 --active 8 --budget-gib 0.75 --pool-gib 0.4

Prints, over every agent's second turn: the tokens of its history (what its previous request
held at the same positions) each setting served from memory (vLLM's prefix cache, the plugin's
copies from cached blocks or the store) against those it computed again, and the rounds' TTFT.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="generative-agents")
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--active", type=int, default=8, help="agents acting in each round")
    parser.add_argument("--budget-gib", type=float, default=0.75, help="KV budget B of every setting")
    parser.add_argument("--pool-gib", type=float, default=0.4, help="the pool P of the setting with the store")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.agents % args.active:
        parser.error("--agents must be a multiple of --active")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from tokendance.model.platform import probe_cpu
    from tokendance.vllm_plugin.model_folder import default_model_folder
    from tokendance.workloads import make_workload

    def counter(llm, name: str, reason: str | None = None) -> float:
        return sum(m.value for m in llm.get_metrics()
                   if m.name == f"vllm:tokendance_{name}" and (reason is None or m.labels.get("reason") == reason))

    def history_computed(llm) -> float:
        """The plugin's `computed_tokens{reason="history"}`: history no cached block nor the store held."""
        return counter(llm, "computed_tokens", "history")

    cpu = probe_cpu()
    dtype = "bfloat16" if cpu.native_bf16 else "float32"
    folder = default_model_folder()
    hf = json.loads((folder / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * (2 if dtype == "bfloat16" else 4)
    workload = make_workload(args.workload, args.agents, seed=0)
    groups = args.agents // args.active
    settings = [("plain vLLM", args.budget_gib, None), ("plugin, no store", args.budget_gib, {}),
                (f"plugin, pool {args.pool_gib:g} + store {args.budget_gib - args.pool_gib:g} GiB", args.pool_gib,
                 {"store_gib": args.budget_gib - args.pool_gib})]
    results = []
    for name, pool_gib, extra in settings:
        config = None if extra is None else KVTransferConfig(kv_connector="TokenDanceConnector", kv_role="kv_both",
                                                             kv_connector_extra_config=extra)
        llm = LLM(model=str(folder), dtype=dtype, max_model_len=8192, enable_prefix_caching=True, enforce_eager=True,
                  seed=0, disable_log_stats=False, kv_transfer_config=config, num_gpu_blocks_override=int(pool_gib * 2**30 / (128 * per_token)))
        tokenizer = llm.get_tokenizer()
        history, previous = [], {}  # synthetic outputs per round; agent -> its previous request's tokens
        served = computed = ttft = 0.0
        for r in range(2 * groups):
            turns = workload.turns(r, [workload.synthetic_outputs(i) for i in range(r)])
            active = turns[(r % groups) * args.active:(r % groups + 1) * args.active]
            prompts = [list(tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]) for t in active]
            tag = lambda t: {"kv_transfer_params": {"tokendance": {"round_id": f"r{r}", "round_size": len(active),  # noqa: E731
                                                                   "agent_id": t.agent_id}}}
            params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                     extra_args=None if extra is None else tag(t)) for t in active]
            requests = [TokensPrompt(prompt_token_ids=p, cache_salt=f"agent-{t.agent_id}") for p, t in zip(prompts, active)]
            lost_before = history_computed(llm)
            outputs = llm.generate(requests, params, use_tqdm=False)
            if r >= groups:  # every agent's second turn: how much of its history came back
                ttft += max(o.metrics.first_token_latency for o in outputs)
                owns = []
                for t, p, o in zip(active, prompts, outputs):
                    before = previous[t.agent_id]
                    owns.append(next((i for i, (a, b) in enumerate(zip(p, before)) if a != b), min(len(p), len(before))))
                if extra is None:  # plain vLLM: its prefix-cache hit is what came back
                    lost = [own - min(o.num_cached_tokens, own) for own, o in zip(owns, outputs)]
                else:  # the plugin's claims count as cached, computed or not: its own count of lost history
                    lost = [history_computed(llm) - lost_before]
                served += sum(owns) - sum(lost)
                computed += sum(lost)
            for t, p, o in zip(active, prompts, outputs):
                previous[t.agent_id] = p + list(o.outputs[0].token_ids)
        store = {key: counter(llm, key) for key in ("restored_tokens", "store_evictions", "store_agents", "store_bytes")}
        results.append((name, served, computed, ttft, store))
        del llm
        gc.collect()
    print(f"{args.workload}: {args.agents} agents, {args.active} acting per round (each again after "
          f"{groups - 1} rounds of others), budget {args.budget_gib:g} GiB each, {dtype}, CPU {cpu.describe()}")
    print(f"{'setting':>44}{'history tokens served':>23}{'recomputed':>12}{'2nd-turn TTFT s':>17}")
    for name, served, computed, ttft, store in results:
        print(f"{name:>44}{served:>23.0f}{computed:>12.0f}{ttft:>17.2f}" + (
            f"   store: {store['store_agents']:.0f} agents, {store['store_bytes'] / 2**20:.0f} MB, "
            f"{store['store_evictions']:.0f} evicted, {store['restored_tokens']:.0f} tokens restored"
            if store["store_agents"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
