"""The vLLM plugin's token account for a workload's rounds, offline: its scheduler side (the round
book) over the workload's chat prompts, with vLLM's prefix cache modelled as what it would hold
without eviction: each agent's previous request (prompt and output) under its own salt, hit in
whole blocks, its full blocks found again by their hashes (what the connector reads back). Prints, per round, the prompt tokens by who computes them and why (the connector's
`computed_tokens` reasons) and the claimed tokens: where a round's compute goes inside vLLM,
before any forward pass (no vLLM, no model: seconds).

    python benchmarks/vllm_plugin_tokens.py --workload generative-agents --agents 16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math

from tokendance.model.loader import load_tokenizer
from tokendance.registry import DEFAULT_RECOMPUTE_RATIO
from tokendance.round_core.spans import common_prefix
from tokendance.vllm_plugin.scheduler.round_book import RoundBook
from tokendance.vllm_plugin.scheduler.members import RoundTag
from tokendance.workloads import make_workload


def run(workload_name: str, num_agents: int, rounds: int, block_size: int, seed: int, ratio: float) -> list[dict]:
    tokenizer = load_tokenizer()
    workload = make_workload(workload_name, num_agents, seed=seed)
    pool: dict[tuple, int] = {}  # block hash -> block id: every full block computed so far
    book = RoundBook(tokenizer.boundaries, round_timeout_s=1e9, hold_timeout_s=1e9, block_size=block_size,
                     lookup=pool.get)
    cache: dict[str, list[int]] = {}  # agent -> its previous request's tokens, as vLLM caches them
    rows = []
    for r in range(rounds):
        feed = [workload.synthetic_outputs(i) for i in range(r)]
        turns = workload.turns(r, feed)
        prompts = {t.agent_id: tokenizer.encode(tokenizer.apply_chat_template(list(t.messages))) for t in turns}
        for agent, ids in prompts.items():
            book.add(agent, RoundTag(f"r{r}", agent, len(prompts)), ids, now=0.0, salt=agent)
        hits = {a: block_size * (common_prefix(ids, cache.get(a, ())) // block_size) for a, ids in prompts.items()}
        for agent in prompts:  # masters first: their KV exists before any mirror claims
            if book.find(agent).role == "master":  # it claims its own history only (exact copies)
                book.commit(agent, book.claim(agent, hits[agent], now=0.0) or 0)
                book.mark_ready(agent, [0])
        selected = 0
        for agent in prompts:
            if book.find(agent).role != "master":
                member = book.commit(agent, book.claim(agent, hits[agent], now=0.0) or 0)
                if member is not None:  # the pass recomputes each span's first ceil(ratio * length)
                    selected += sum(math.ceil(ratio * s.length - 1e-9) for s in member.spans if not s.exact)
        counters = book.take_counters()
        counters["computed_tokens.selected"] = selected
        outputs = workload.synthetic_outputs(r)
        for agent, ids in prompts.items():
            said = tokenizer.encode(outputs.get(agent, ""))
            hashes = [(agent, tuple(ids + said)[:(i + 1) * block_size]) for i in range(len(ids + said) // block_size)]
            for h in hashes[:(len(ids + said) - 1) // block_size]:  # the last token has no KV yet
                pool.setdefault(h, len(pool))
            book.finish(agent, ids + said, hashes)
            cache[agent] = ids + said
        book.releasable()
        computed = sum(v for k, v in counters.items() if k.startswith("computed_tokens."))
        rows.append({"round": r + 1, "prompt_tokens": sum(map(len, prompts.values())), "computed": computed,
                     "vllm_hit_tokens": sum(hits.values()), **counters})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="generative-agents")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's block size (128 on CPU, 16 on GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratio", type=float, default=DEFAULT_RECOMPUTE_RATIO,
                        help="recompute ratio (EPIC: the connector's default selection, no check pass)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = run(args.workload, args.agents, args.rounds, args.block_size, args.seed, args.ratio)
    reasons = sorted({k for row in rows for k in row if k.startswith("computed_tokens.")})
    print(f"{args.workload} N={args.agents}, vLLM block size {args.block_size}, ratio {args.ratio}: prompt tokens "
          f"by who computes them")
    header = ["round", "prompt", "vLLM hit", "claimed", "exact copy", "recalled", "computed",
              *[k.split(".")[1] for k in reasons]]
    print("".join(f"{h:>11}" for h in header))
    for row in rows:
        values = [row["round"], row["prompt_tokens"], row["vllm_hit_tokens"], row.get("claimed_tokens", 0),
                  row.get("reused_exact_tokens", 0), row.get("recalled_tokens", 0), row["computed"],
                  *[row.get(k, 0) for k in reasons]]
        print("".join(f"{v:>11}" for v in values))
    print("(claimed: filled by the workers' pass, reused except the selected share; exact copy: claimed tokens "
          "copied as they are, no check or selection; recalled: the agents' own moved pieces, from cached blocks; "
          "computed: the sum of the reasons)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
