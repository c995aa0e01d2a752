"""Reproducible simulations: does an agent's greedy output depend on what else is in its batch?

Runs `--rounds` open-loop rounds of a workload in an exact mode (`full` by default) twice per
round: the whole round batched, then each agent's turn alone. Counts the outputs identical token
for token (and first-token logits bitwise equal), without and with `batch_invariant`, and what the
option costs in round time:

    python benchmarks/batch_invariance.py --workload generative-agents --agents 8 --rounds 3
"""

from __future__ import annotations

import argparse
import time

import torch

from tokendance import LLM
from tokendance.bench.simulation import kv_budget, round_params
from tokendance.model.loader import load_model
from tokendance.model.platform import describe_machine, dtype_name
from tokendance.workloads import make_workload


def measure(llm: LLM, workload, rounds: int) -> dict:
    same = equal_logits = total = 0
    batched_seconds = alone_seconds = 0.0
    for r in range(rounds):
        turns = workload.turns(r, [workload.synthetic_outputs(i) for i in range(r)])
        params = round_params(workload, r, closed_loop=False)
        started = time.perf_counter()
        batched = llm.run_round(turns, params).outputs
        batched_seconds += time.perf_counter() - started
        started = time.perf_counter()
        alone = [llm.run_round([turn], [p]).outputs[0] for turn, p in zip(turns, params)]
        alone_seconds += time.perf_counter() - started
        for a, b in zip(batched, alone):
            total += 1
            same += a.token_ids == b.token_ids
            equal_logits += torch.equal(a.logits[0], b.logits[0])
    return {"identical": same, "first_logits_equal": equal_logits, "outputs": total,
            "batched_seconds": batched_seconds, "alone_seconds": alone_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="generative-agents")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reuse", default="full", choices=["full", "prefix"])
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    loaded = load_model(None)
    workload = make_workload(args.workload, args.agents, seed=0)
    budget = kv_budget(loaded, workload, args.rounds, args.dtype)
    found = {}
    for invariant in (False, True):
        llm = LLM(loaded, reuse=args.reuse, dtype=args.dtype, kv_cache_bytes=budget, batch_invariant=invariant)
        llm.warm_up()
        found[invariant] = measure(llm, workload, args.rounds)
        del llm
    machine = describe_machine(dtype_name(args.dtype))
    print(f"{args.workload}, {args.agents} agents x {args.rounds} rounds, reuse={args.reuse}, {machine['dtype']}, "
          f"CPU {machine['cpu_capability']}: each agent alone vs the round batched")
    print(f"{'batch_invariant':<16}{'identical':>10}{'1st logits equal':>17}{'batched s':>10}{'alone s':>9}")
    for invariant, r in found.items():
        print(f"{str(invariant):<16}{r['identical']:>6}/{r['outputs']:<3}{r['first_logits_equal']:>13}/{r['outputs']:<3}"
              f"{r['batched_seconds']:>10.2f}{r['alone_seconds']:>9.2f}")
    print(f"cost of batch_invariant on the batched rounds: "
          f"{found[True]['batched_seconds'] / found[False]['batched_seconds']:.2f}x the time")


if __name__ == "__main__":
    main()
