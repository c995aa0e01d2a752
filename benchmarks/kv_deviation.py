"""Where the error of reused KV is: per layer and per offset in its span, the deviation of the KV
that agents read from shared masters against the KV a full prefill of their own prompt computes.

Runs `--rounds` open-loop rounds of a workload in `tokendance` mode (the last one is measured),
then, for every agent, computes its whole prompt again from scratch into spare slots of the same
pool and compares, token by token, the keys (rotated to the agent's positions) and values of
every token its table reads from another agent's slots (a master), in float32 by default:

    python benchmarks/kv_deviation.py --workload generative-agents --agents 8
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from tokendance import LLM
from tokendance.batch import ScheduledRequest, SchedulerOutput
from tokendance.bench.simulation import Simulation, kv_budget
from tokendance.kv.manager import ScratchKey, SessionKey
from tokendance.model.loader import load_model
from tokendance.reuse.segments import tokenize_round
from tokendance.workloads import make_workload

OFFSET_BUCKETS = [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 1 << 30)]


def bucket(offset: int) -> str:
    low, high = next(b for b in OFFSET_BUCKETS if b[0] <= offset < b[1])
    return f"{low}" if high == low + 1 else f"{low}-{high - 1}" if high < 1 << 30 else f"{low}+"


def full_kv(llm: LLM, token_ids: list[int]) -> list[int]:
    """Slots holding a full prefill of `token_ids` (a scratch table; the caller frees it)."""
    engine = llm.engine
    table = ScratchKey("deviation")
    engine.kv.create_table(table)
    slots = engine.kv.append_private_slots(table, len(token_ids))
    item = ScheduledRequest(table, token_ids, range(len(token_ids)), slots, False, None)
    engine.runner.compute_kv(SchedulerOutput(scheduled=[item]))
    return slots


def measure(llm: LLM, turns) -> tuple[dict, dict, int, int]:
    engine, runner = llm.engine, llm.engine.runner
    cache = runner.kv_cache
    layers = len(cache.keys)
    by_layer = defaultdict(lambda: [0.0, 0.0, 0])  # layer -> [key rel err sum, value rel err sum, count]
    by_offset = defaultdict(lambda: [0.0, 0.0, 0])  # offset bucket -> same, over all layers
    reused = total = 0
    for turn in tokenize_round(engine.tokenizer, turns):
        session = engine.kv.get_slots(SessionKey(turn.agent_id))
        prompt = turn.token_ids[:-1]  # the last prompt token is always computed by the scheduler
        positions = torch.arange(len(prompt))
        slots = torch.tensor(session[: len(prompt)])
        moved = (cache.positions[slots] != positions).nonzero().flatten().tolist()  # read from a master
        total += len(prompt)
        reused += len(moved)
        if not moved:
            continue
        offsets = {}
        for span in turn.spans:
            for p in range(span.start, min(span.end, len(prompt))):
                offsets[p] = p - span.start
        reference = full_kv(llm, prompt)
        try:
            for layer in range(layers):
                got_k = runner.read_keys(layer, [session[p] for p in moved], moved)
                ref_k = runner.read_keys(layer, [reference[p] for p in moved], moved)
                got_v = cache.values[layer][slots[moved]].float()
                ref_v = cache.values[layer][torch.tensor([reference[p] for p in moved])].float()
                k_err = (got_k - ref_k).flatten(1).norm(dim=1) / ref_k.flatten(1).norm(dim=1)
                v_err = (got_v - ref_v).flatten(1).norm(dim=1) / ref_v.flatten(1).norm(dim=1)
                entry = by_layer[layer]
                entry[0] += k_err.sum().item()
                entry[1] += v_err.sum().item()
                entry[2] += len(moved)
                for i, p in enumerate(moved):
                    entry = by_offset[bucket(offsets.get(p, 0))]
                    entry[0] += k_err[i].item() / layers
                    entry[1] += v_err[i].item() / layers
                    entry[2] += 1 / layers
        finally:
            engine.kv.free(ScratchKey("deviation"))
    return by_layer, by_offset, reused, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="generative-agents")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ratio", type=float, default=None, help="recompute ratio (default: the engine's)")
    parser.add_argument("--selection", default=None)
    args = parser.parse_args()
    loaded = load_model(None)
    workload = make_workload(args.workload, args.agents, seed=0)
    extra = {k: v for k, v in {"recompute_ratio": args.ratio, "selection": args.selection}.items() if v is not None}
    llm = LLM(loaded, dtype=args.dtype, reuse="tokendance",
              kv_cache_bytes=2 * kv_budget(loaded, workload, args.rounds, args.dtype), **extra)
    simulation = Simulation(workload, {"tokendance": llm}, closed_loop=False)
    for _ in range(args.rounds):
        simulation.step()
    last = args.rounds - 1
    turns = workload.turns(last, [workload.synthetic_outputs(i) for i in range(last)])
    by_layer, by_offset, reused, total = measure(llm, turns)
    print(f"{args.workload}, {args.agents} agents, round {args.rounds}, {llm.engine.dtype}, CPU "
          f"{torch.backends.cpu.get_cpu_capability()}: {reused} of {total} prompt tokens read from masters")
    print("\nlayer  key rel. error  value rel. error")
    for layer, (k, v, n) in sorted(by_layer.items()):
        print(f"{layer:5d}  {k / n:13.4f}  {v / n:16.4f}")
    print("\noffset in span  tokens  key rel. error  value rel. error (mean over layers)")
    for name, (k, v, n) in sorted(by_offset.items(), key=lambda item: int(item[0].split("-")[0].rstrip("+"))):
        print(f"{name:>14}  {round(n):6d}  {k / n:13.4f}  {v / n:16.4f}")


if __name__ == "__main__":
    main()
