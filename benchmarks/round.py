"""Multi-round All-Gather: the four reuse modes side by side, a recompute-ratio sweep, fp32 vs bf16.

    .venv/bin/python benchmarks/round.py                      # N = 4, 8, 16 agents x 4 rounds
    .venv/bin/python benchmarks/round.py --agents 4 8 16 32   # add N = 32 (several minutes more)

Each agent: a ~200-token persona; in every round its prompt is its whole history (persona, every
earlier round's messages and its own earlier outputs) + this round's shared block (every agent's
previous output, ~48 tokens each, in a per-agent shuffled order) + a ~30-token task; 32 new
tokens. Open loop: the outputs that feed the next round are fixed synthetic texts, so every mode
sees exactly the same prompts and fidelity against `full` is exact per round.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokendance import LLM, AgentTurn, SamplingParams  # noqa: E402
from tokendance.model.llama import KVCacheTensors  # noqa: E402
from tokendance.model.loader import load_model  # noqa: E402
from tokendance.reuse.fidelity import compare  # noqa: E402

MODES = ("full", "prefix", "pic", "tokendance")
WORDS = (
    "market harvest festival bread mill river lantern storm neighbour rumour council well bridge orchard "
    "wagon tavern letter promise debt weather school library garden fence ferry price winter cart plan "
    "baker smith teacher mayor doctor fisher tailor guard child elder stranger traveller merchant"
).split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class AllGather:
    """Deterministic synthetic All-Gather workload (open loop)."""

    def __init__(self, num_agents: int, seed: int = 0, persona_words=150, output_words=36, task_words=20):
        self.agents = [f"agent{i:02d}" for i in range(num_agents)]
        rng = random.Random(seed)
        self.personas = {a: f"You are {a}. " + text(rng, persona_words) for a in self.agents}
        self.output_words, self.task_words, self.seed = output_words, task_words, seed

    def output(self, agent: str, round_index: int) -> str:
        return f"{agent}: " + text(random.Random(f"{self.seed}-{agent}-{round_index}"), self.output_words)

    def task(self, agent: str, round_index: int) -> str:
        return f"Round {round_index}, {agent}: " + text(random.Random(f"task-{agent}-{round_index}"), self.task_words) + "?"

    def turns(self, round_index: int) -> list[AgentTurn]:
        turns = []
        for agent in self.agents:
            order = random.Random(f"order-{agent}")
            messages = [{"role": "system", "content": self.personas[agent]}]
            for r in range(round_index + 1):
                shared = [self.output(a, r - 1) for a in self.agents] if r else [self.output(a, -1) for a in self.agents]
                order.shuffle(shared)
                messages += [{"role": "user", "content": s} for s in shared]
                messages.append({"role": "user", "content": self.task(agent, r)})
                if r < round_index:
                    messages.append({"role": "assistant", "content": self.output(agent, r)})
            turns.append(AgentTurn(agent, messages))
        return turns


def kv_budget(loaded, dtype: str, num_tokens: int, num_agents: int) -> int:
    """Enough KV for every agent's whole last-round prompt held privately, plus headroom."""
    per_token = KVCacheTensors.bytes_per_slot(loaded.config, getattr(torch, dtype))
    return int(1.3 * (num_tokens + 64 * num_agents) * per_token) + 64 * 2**20


def run_modes(loaded, num_agents: int, rounds: int, args, bar) -> list[dict]:
    workload = AllGather(num_agents, seed=args.seed)
    tokenizer = loaded.tokenizer
    last = workload.turns(rounds - 1)
    num_tokens = sum(len(tokenizer.encode(tokenizer.apply_chat_template(t.messages))) for t in last)
    budget = kv_budget(loaded, args.dtype, num_tokens, num_agents)
    engines = {
        mode: LLM(loaded, dtype=args.dtype, reuse=mode, kv_cache_bytes=budget,
                  recompute_ratio=args.ratio, selection=args.selection)
        for mode in MODES
    }
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, return_logits=1)
    warm_up(engines.values())
    rows = []
    for r in range(rounds):
        turns = workload.turns(r)
        results = {}
        for mode, llm in engines.items():
            bar.set_postfix_str(f"N={num_agents} round {r + 1} {mode}")
            results[mode] = llm.run_round(turns, params)
            bar.update(1)
        for mode, result in results.items():
            fidelity = compare(results["full"].outputs, result.outputs)
            stats = asdict(result.stats)
            stats.pop("agents")
            rows.append({"agents": num_agents, "round": r + 1, **stats, "fidelity": asdict(fidelity)})
    release(engines)
    return rows


def release(engines) -> None:
    """Drop engines now: their KV pools are large and engines hold reference cycles."""
    engines.clear()
    gc.collect()


def warm_up(engines) -> None:
    """One small untimed round per engine: compiles the fused key-rotation kernel, fills caches."""
    turns = AllGather(2, seed=12345).turns(0)
    for llm in engines:
        llm.run_round(turns, SamplingParams(temperature=0, max_tokens=2))
        for turn in turns:
            llm.end_agent(turn.agent_id)


def sweep(loaded, args, bar) -> list[dict]:
    """Recompute ratio x selection policy at N agents, last round: fidelity vs speed vs compression."""
    workload = AllGather(args.sweep_agents, seed=args.seed)
    rounds = args.rounds
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, return_logits=1)
    budget = 1 * 2**30
    reference = LLM(loaded, dtype=args.dtype, reuse="full", kv_cache_bytes=budget)
    ref = reference.run_round(workload.turns(rounds - 1), params)
    release([reference])
    rows = []
    for selection in args.sweep_selections:
        for ratio in args.sweep_ratios:
            llm = LLM(loaded, dtype=args.dtype, reuse="tokendance", kv_cache_bytes=budget,
                      recompute_ratio=ratio, selection=selection)
            warm_up([llm])
            result = llm.run_round(workload.turns(rounds - 1), params)
            bar.update(1)
            f = compare(ref.outputs, result.outputs)
            rows.append({"selection": selection, "ratio": ratio, "prefill_seconds": result.stats.prefill_seconds,
                         "full_prefill_seconds": ref.stats.prefill_seconds,
                         "shared_compression": result.stats.shared_compression,
                         "kv_bytes_per_agent": result.stats.kv_bytes_per_agent,
                         "diff_blocks": result.stats.diff_blocks, "fidelity": asdict(f)})
            release([llm])
    return rows


def scope_ablation(loaded, args, bar) -> list[dict]:
    """KV Collector selection scope: one batched check pass with per-agent selection ("agent") vs
    one check pass per distinct span applied to every agent ("block"), multi-round with sessions."""
    workload = AllGather(args.sweep_agents, seed=args.seed)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, return_logits=1)
    engines = {scope: LLM(loaded, dtype=args.dtype, reuse="tokendance", kv_cache_bytes=2**30,
                          recompute_ratio=args.ratio, selection=args.selection, collective_selection=scope)
               for scope in ("agent", "block")}
    engines["full"] = LLM(loaded, dtype=args.dtype, reuse="full", kv_cache_bytes=2**30)
    warm_up(engines.values())
    rows = []
    for r in range(args.rounds):
        results = {name: llm.run_round(workload.turns(r), params) for name, llm in engines.items()}
        bar.update(1)
        for scope in ("agent", "block"):
            s, f = results[scope].stats, compare(results["full"].outputs, results[scope].outputs)
            rows.append({"round": r + 1, "scope": scope, "prefill_seconds": s.prefill_seconds,
                         "selection_seconds": s.selection_seconds, "fidelity": asdict(f)})
    release(engines)
    return rows


def dtype_comparison(loaded, args, bar) -> list[dict]:
    """fp32 vs bf16: tokendance vs full at the default ratio, one round at N = sweep_agents."""
    workload = AllGather(args.sweep_agents, seed=args.seed)
    turns = workload.turns(args.rounds - 1)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, return_logits=1)
    rows, outputs = [], {}
    for dtype in ("float32", "bfloat16"):
        for mode in ("full", "tokendance"):
            llm = LLM(loaded, dtype=dtype, reuse=mode, kv_cache_bytes=2**30, recompute_ratio=args.ratio, selection=args.selection)
            warm_up([llm])
            outputs[(dtype, mode)] = llm.run_round(turns, params)
            release([llm])
            bar.update(1)
    for (dtype, mode), result in outputs.items():
        f32 = compare(outputs[("float32", "full")].outputs, result.outputs)
        rows.append({"dtype": dtype, "mode": mode, "prefill_seconds": result.stats.prefill_seconds,
                     "round_seconds": result.stats.round_seconds, "fidelity_vs_fp32_full": asdict(f32)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--ratio", type=float, default=0.05, help="recompute ratio of pic and tokendance")
    parser.add_argument("--selection", default="epic")
    parser.add_argument("--sweep-agents", type=int, default=8)
    parser.add_argument("--sweep-ratios", type=float, nargs="+", default=[0.0, 0.05, 0.15, 0.3, 0.5])
    parser.add_argument("--sweep-selections", nargs="+", default=["cacheblend", "cacheblend-block", "epic"])
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/round.json")
    args = parser.parse_args()
    loaded = load_model()
    steps = len(args.agents) * args.rounds * len(MODES)
    if not args.skip_sweep:
        steps += len(args.sweep_ratios) * len(args.sweep_selections) + 4 + args.rounds
    started = time.perf_counter()
    results: dict = {"args": vars(args)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(key: str, rows: list[dict]) -> None:
        results[key] = rows
        results["seconds"] = time.perf_counter() - started
        out.write_text(json.dumps(results, indent=2))

    with tqdm(total=steps, desc="rounds") as bar:
        rows = [row for n in args.agents for row in run_modes(loaded, n, args.rounds, args, bar)]
        save("rounds", rows)
        bar.write(format_rounds(rows) + format_summary(rows, max(args.agents), args.rounds))
        if not args.skip_sweep:
            for key, part, fmt in (("sweep", sweep, format_sweep), ("dtypes", dtype_comparison, format_dtypes),
                                   ("scopes", scope_ablation, format_scopes)):
                part_rows = part(loaded, args, bar)
                save(key, part_rows)
                bar.write(fmt(part_rows))
    print(f"\nwrote {out}")


def format_rounds(rows: list[dict]) -> str:
    lines = [f"\n{'N':>3} {'rd':>2} {'mode':<11}{'prefill s':>10}{'round s':>9}{'computed':>10}{'in prompts':>11}"
             f"{'KV MB/agent':>12}{'shared x':>9}{'top1':>6}{'KL':>7}{'same':>6}"]
    for r in rows:
        f = r["fidelity"]
        lines.append(
            f"{r['agents']:>3} {r['round']:>2} {r['mode']:<11}{r['prefill_seconds']:>10.2f}{r['round_seconds']:>9.2f}"
            f"{r['computed_tokens']:>10.0f}{r['prompt_tokens']:>11}{r['kv_bytes_per_agent'] / 2**20:>12.2f}"
            f"{r['shared_compression']:>9.2f}{f['top1_agreement']:>6.2f}{f['mean_kl']:>7.3f}{f['identical_fraction']:>6.2f}")
    return "\n".join(lines)


def format_summary(rows: list[dict], agents: int, round_index: int) -> str:
    at = {r["mode"]: r for r in rows if r["agents"] == agents and r["round"] == round_index}
    if "tokendance" not in at:
        return ""
    td, prefix, pic = at["tokendance"], at["prefix"], at["pic"]
    return (
        f"\n\nN={agents}, round {round_index}: tokendance prefill {prefix['prefill_seconds'] / td['prefill_seconds']:.2f}x "
        f"faster than prefix, {pic['prefill_seconds'] / td['prefill_seconds']:.2f}x faster than pic; "
        f"round latency {prefix['round_seconds'] / td['round_seconds']:.2f}x vs prefix; "
        f"KV per agent {prefix['kv_bytes_per_agent'] / td['kv_bytes_per_agent']:.2f}x smaller than prefix; "
        f"shared-block compression {td['shared_compression']:.2f}x; top-1 agreement {td['fidelity']['top1_agreement']:.2f}"
        f"\ntime split (s): lookup {td['lookup_seconds']:.2f}, selection {td['selection_seconds']:.2f}, "
        f"recompute {td['recompute_seconds']:.2f}, private prefill {td['private_prefill_seconds']:.2f}, "
        f"decode {td['decode_seconds']:.2f}"
    )


def format_sweep(rows: list[dict]) -> str:
    lines = [f"\n{'selection':<17}{'ratio':>6}{'prefill s':>10}{'vs full':>8}{'shared x':>9}{'diff blk':>9}"
             f"{'top1':>6}{'KL':>7}{'same':>6}{'prefix':>7}"]
    for r in rows:
        f = r["fidelity"]
        lines.append(
            f"{r['selection']:<17}{r['ratio']:>6.2f}{r['prefill_seconds']:>10.2f}"
            f"{r['full_prefill_seconds'] / r['prefill_seconds']:>7.2f}x{r['shared_compression']:>9.2f}{r['diff_blocks']:>9}"
            f"{f['top1_agreement']:>6.2f}{f['mean_kl']:>7.3f}{f['identical_fraction']:>6.2f}{f['mean_common_prefix']:>7.1f}")
    return "\n".join(lines)


def format_dtypes(rows: list[dict]) -> str:
    lines = [f"\n{'dtype':<10}{'mode':<12}{'prefill s':>10}{'round s':>9}{'top1 vs fp32 full':>19}{'KL':>7}"]
    for r in rows:
        f = r["fidelity_vs_fp32_full"]
        lines.append(f"{r['dtype']:<10}{r['mode']:<12}{r['prefill_seconds']:>10.2f}{r['round_seconds']:>9.2f}"
                     f"{f['top1_agreement']:>19.2f}{f['mean_kl']:>7.3f}")
    return "\n".join(lines)


def format_scopes(rows: list[dict]) -> str:
    lines = [f"\n{'round':>5} {'selection scope':<16}{'prefill s':>10}{'selection s':>12}{'top1':>6}{'KL':>7}"]
    for r in rows:
        f = r["fidelity"]
        lines.append(f"{r['round']:>5} {r['scope']:<16}{r['prefill_seconds']:>10.2f}{r['selection_seconds']:>12.2f}"
                     f"{f['top1_agreement']:>6.2f}{f['mean_kl']:>7.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
