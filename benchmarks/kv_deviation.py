"""Where the error of reused KV is: per layer and per offset in its span, the deviation of the KV
that agents read from shared masters against the KV a full prefill of their own prompt computes.

Runs `--rounds` open-loop rounds of a workload in `tokendance` mode (the last one is measured),
then, for every agent, computes its whole prompt again from scratch into spare slots of the same
pool and compares, token by token, the keys (rotated to the agent's positions) and values of
every token its table reads from another agent's slots (a master), in float32 by default:

    python benchmarks/kv_deviation.py --workload generative-agents --agents 8

It also asks whether the deviation could be corrected cheaply: per span, layer and KV head, the
share of its energy left after subtracting the span's mean deviation (the best one shift per span
can do), after subtracting the mean of a recompute-ratio sample of its tokens (what the tokens a
round recomputes would estimate), and after subtracting one mean per agent.
"""

from __future__ import annotations

import argparse
import random
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


class ShiftCorrection:
    """Per (layer, kind): energy of the deviation, and what is left after each shift correction."""

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio, self.rng = ratio, random.Random(seed)
        self.sums = defaultdict(lambda: torch.zeros(5, dtype=torch.float64))

    def add(self, layer: int, kind: str, deviations: list[torch.Tensor]) -> None:
        """deviations: per span, fresh minus reused KV [tokens, heads, dim] of its reused tokens."""
        agent_mean = torch.cat(deviations).mean(0)
        entry = self.sums[(layer, kind)]
        for d in deviations:
            d = d.double()
            sample = self.rng.sample(range(len(d)), max(1, round(self.ratio * len(d))))
            rest = [i for i in range(len(d)) if i not in set(sample)]
            entry += torch.stack([d.pow(2).sum(), (d - d.mean(0)).pow(2).sum(), d[rest].pow(2).sum(),
                                  (d[rest] - d[sample].mean(0)).pow(2).sum(), (d - agent_mean).pow(2).sum()])

    def rows(self):
        for (layer, kind), (energy, span, sampled, after_sample, agent) in sorted(self.sums.items()):
            if energy > 0 and sampled > 0:
                yield layer, kind, (span / energy).item(), (after_sample / sampled).item(), (agent / energy).item()


def measure(llm: LLM, turns, shifts: ShiftCorrection) -> tuple[dict, dict, int, int]:
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
        moved_set = set(moved)
        spans = [ps for s in turn.spans if len(ps := [p for p in range(s.start, min(s.end, len(prompt))) if p in moved_set]) >= 4]
        reference = full_kv(llm, prompt)
        try:
            for layer in range(layers):
                if spans:
                    shifts.add(layer, "K", [runner.read_keys(layer, [reference[p] for p in ps], ps)
                                            - runner.read_keys(layer, [session[p] for p in ps], ps) for ps in spans])
                    shifts.add(layer, "V", [cache.values[layer][torch.tensor([reference[p] for p in ps])].float()
                                            - cache.values[layer][torch.tensor([session[p] for p in ps])].float()
                                            for ps in spans])
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
    shifts = ShiftCorrection(llm.engine.config.recompute_ratio)
    by_layer, by_offset, reused, total = measure(llm, turns, shifts)
    print(f"{args.workload}, {args.agents} agents, round {args.rounds}, {llm.engine.dtype}, CPU "
          f"{torch.backends.cpu.get_cpu_capability()}: {reused} of {total} prompt tokens read from masters")
    print("\nlayer  key rel. error  value rel. error")
    for layer, (k, v, n) in sorted(by_layer.items()):
        print(f"{layer:5d}  {k / n:13.4f}  {v / n:16.4f}")
    print("\noffset in span  tokens  key rel. error  value rel. error (mean over layers)")
    for name, (k, v, n) in sorted(by_offset.items(), key=lambda item: int(item[0].split("-")[0].rstrip("+"))):
        print(f"{name:>14}  {round(n):6d}  {k / n:13.4f}  {v / n:16.4f}")
    print(f"\nshare of the deviation's energy left after a shift correction (spans of >= 4 reused tokens; "
          f"sample: {shifts.ratio:g} of each span)")
    print("layer  K/V  span's own mean  mean of the sample  agent's mean")
    for layer, kind, span, sampled, agent in shifts.rows():
        print(f"{layer:5d}  {kind:>3}  {span:15.3f}  {sampled:18.3f}  {agent:12.3f}")


if __name__ == "__main__":
    main()
