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
round recomputes would estimate), and after subtracting one mean per agent. With `--anchors k`
(in-round anchors), it asks the same of a patch fitted to the anchors' offsets (KVCOMM's idea, the
low-rank patch of the anchors' span): per span, layer and KV head, the reader's deviation from the
base modelled as a weighted sum of the anchors' encodings minus the base, the k weights fitted by
least squares on the same sample, and the residual on the other tokens; beside it the same fit on
every token (the best such a patch can do) and the anchor nearest on the sample (a patch that
costs no memory: the reader would read that anchor's encoding instead of the mean).
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
                yield layer, kind, [(span / energy).item(), (after_sample / sampled).item(), (agent / energy).item()]


class AnchorPatch:
    """Per (layer, kind): the deviation's energy on the unsampled tokens and on all, and what is
    left after each anchor patch (see the module's doc)."""

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio, self.rng = ratio, random.Random(seed)
        self.sums = defaultdict(lambda: torch.zeros(5, dtype=torch.float64))

    def add(self, layer: int, kind: str, deviation: torch.Tensor, offsets: torch.Tensor) -> None:
        """deviation: fresh minus reused KV of a span's reused tokens [T, H, D]; offsets: each
        anchor's encoding of the same tokens minus the reused KV [k, T, H, D]."""
        d, o = deviation.double(), offsets.double()
        sample = self.rng.sample(range(len(d)), max(1, round(self.ratio * len(d))))
        rest = [i for i in range(len(d)) if i not in set(sample)]
        entry = self.sums[(layer, kind)]
        for head in range(d.shape[1]):
            y, x = d[:, head], o[:, :, head]  # [T, D], [k, T, D]
            fitted = _fit(x[:, sample], y[sample])
            best = _fit(x, y)
            nearest = min(range(len(x)), key=lambda a: (y[sample] - x[a, sample]).pow(2).sum().item())
            entry += torch.stack([y[rest].pow(2).sum(), (y[rest] - _apply(x[:, rest], fitted)).pow(2).sum(),
                                  y.pow(2).sum(), (y - _apply(x, best)).pow(2).sum(),
                                  (y[rest] - x[nearest, rest]).pow(2).sum()])

    def rows(self):
        for (layer, kind), (rest, fitted, energy, best, nearest) in sorted(self.sums.items()):
            if rest > 0:
                yield layer, kind, [(fitted / rest).item(), (best / energy).item(), (nearest / rest).item()]


class LowRankPatch:
    """Per (layer, kind): a rank-m linear patch from an agent's reused KV to its deviation (Kamera's
    idea), per agent, layer and KV head over all its reused tokens, fitted (ridge, reduced rank) on
    a sample: the energy left on the other tokens, for each rank, and fitted on every token (bound)."""

    RANKS = (1, 4, 16)

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio, self.rng = ratio, random.Random(seed)
        self.sums = defaultdict(lambda: torch.zeros(2 + 2 * len(self.RANKS), dtype=torch.float64))

    def add(self, layer: int, kind: str, base: torch.Tensor, deviation: torch.Tensor) -> None:
        """base, deviation: [T, H, D] over every reused token of one agent."""
        if len(base) < 8:
            return
        sample = self.rng.sample(range(len(base)), max(2, round(self.ratio * len(base))))
        rest = [i for i in range(len(base)) if i not in set(sample)]
        entry = self.sums[(layer, kind)]
        for head in range(base.shape[1]):
            x = torch.cat([base[:, head].double(), torch.ones(len(base), 1, dtype=torch.float64)], dim=1)
            y = deviation[:, head].double()
            left = [y[rest].pow(2).sum(), y.pow(2).sum()]
            for rank in self.RANKS:
                left.append((y[rest] - x[rest] @ _reduced_rank(x[sample], y[sample], rank)).pow(2).sum())
                left.append((y - x @ _reduced_rank(x, y, rank)).pow(2).sum())
            entry += torch.stack(left)

    def rows(self):
        for (layer, kind), sums in sorted(self.sums.items()):
            if sums[0] > 0:
                yield layer, kind, [(sums[2 + 2 * i] / sums[0]).item() for i in range(len(self.RANKS))] + \
                    [(sums[3 + 2 * i] / sums[1]).item() for i in range(len(self.RANKS))]


def _reduced_rank(x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
    """Ridge regression of y on x (lambda: a tenth of x's mean squared column norm), its fitted
    values' top `rank` directions kept: [x columns, y columns]."""
    gram = x.T @ x
    weights = torch.linalg.solve(gram + 0.1 * gram.diagonal().mean() * torch.eye(len(gram), dtype=x.dtype), x.T @ y)
    directions = torch.linalg.svd(x @ weights, full_matrices=False).Vh[:rank]  # [rank, D]
    return weights @ directions.T @ directions


def _fit(offsets: torch.Tensor, deviation: torch.Tensor) -> torch.Tensor:
    """Weights w [k] minimizing |deviation - sum_a w_a offsets_a|^2 (least norm where offsets tie)."""
    return torch.linalg.lstsq(offsets.flatten(1).T, deviation.flatten()[:, None], driver="gelsd").solution[:, 0]


def _apply(offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.einsum("a,a...->...", weights, offsets)


def encodings(llm: LLM, tokenized) -> dict[bytes, list[tuple[str, list[int]]]]:
    """span key -> (agent, slots) of every agent whose table holds the span computed in its own
    context (no token read from another agent's slots): the round's anchors and masters."""
    cache, found = llm.engine.runner.kv_cache, defaultdict(list)
    for turn in tokenized:
        session = llm.engine.kv.get_slots(SessionKey(turn.agent_id))
        for span in turn.spans:
            end = min(span.end, len(turn.token_ids) - 1)
            if span.key is None or end - span.start < 4:
                continue
            slots = session[span.start:end]
            if bool((cache.positions[torch.tensor(slots)] == torch.arange(span.start, end)).all()):
                found[span.key].append((turn.agent_id, slots))
    return found


def measure(llm: LLM, turns, shifts: ShiftCorrection, patch: AnchorPatch | None = None,
            low_rank: LowRankPatch | None = None) -> tuple[dict, dict, int, int]:
    engine, runner = llm.engine, llm.engine.runner
    cache = runner.kv_cache
    layers = len(cache.keys)
    by_layer = defaultdict(lambda: [0.0, 0.0, 0])  # layer -> [key rel err sum, value rel err sum, count]
    by_offset = defaultdict(lambda: [0.0, 0.0, 0])  # offset bucket -> same, over all layers
    reused = total = 0
    tokenized = tokenize_round(engine.tokenizer, turns)
    anchors = encodings(llm, tokenized) if patch is not None else {}
    for turn in tokenized:
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
                for span in turn.spans if patch is not None else ():
                    ps = [p for p in range(span.start, min(span.end, len(prompt))) if p in moved_set]
                    sources = [slots for agent, slots in anchors.get(span.key, ()) if agent != turn.agent_id]
                    if len(ps) < 4 or not sources:
                        continue
                    got = [session[p] for p in ps]
                    read = [[source[p - span.start] for p in ps] for source in sources]
                    base_k, base_v = runner.read_keys(layer, got, ps), cache.values[layer][torch.tensor(got)].float()
                    patch.add(layer, "K", runner.read_keys(layer, [reference[p] for p in ps], ps) - base_k,
                              torch.stack([runner.read_keys(layer, r, ps) - base_k for r in read]))
                    patch.add(layer, "V", cache.values[layer][torch.tensor([reference[p] for p in ps])].float() - base_v,
                              torch.stack([cache.values[layer][torch.tensor(r)].float() - base_v for r in read]))
                got_k = runner.read_keys(layer, [session[p] for p in moved], moved)
                ref_k = runner.read_keys(layer, [reference[p] for p in moved], moved)
                got_v = cache.values[layer][slots[moved]].float()
                ref_v = cache.values[layer][torch.tensor([reference[p] for p in moved])].float()
                if low_rank is not None:
                    low_rank.add(layer, "K", got_k, ref_k - got_k)
                    low_rank.add(layer, "V", got_v, ref_v - got_v)
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
    parser.add_argument("--anchors", type=int, default=None, help="in-round anchors (and the anchor-patch table)")
    parser.add_argument("--low-rank", action="store_true", help="the low-rank patch table")
    args = parser.parse_args()
    loaded = load_model(None)
    workload = make_workload(args.workload, args.agents, seed=0)
    extra = {k: v for k, v in {"recompute_ratio": args.ratio, "selection": args.selection,
                               "anchors": args.anchors}.items() if v is not None}
    llm = LLM(loaded, dtype=args.dtype, reuse="tokendance",
              kv_cache_bytes=2 * kv_budget(loaded, workload, args.rounds, args.dtype), **extra)
    simulation = Simulation(workload, {"tokendance": llm}, closed_loop=False)
    for _ in range(args.rounds):
        simulation.step()
    last = args.rounds - 1
    turns = workload.turns(last, [workload.synthetic_outputs(i) for i in range(last)])
    shifts = ShiftCorrection(llm.engine.config.recompute_ratio)
    patch = AnchorPatch(llm.engine.config.recompute_ratio) if args.anchors else None
    low_rank = LowRankPatch(llm.engine.config.recompute_ratio) if args.low_rank else None
    by_layer, by_offset, reused, total = measure(llm, turns, shifts, patch, low_rank)
    print(f"{args.workload}, {args.agents} agents, round {args.rounds}, {llm.engine.dtype}, CPU "
          f"{torch.backends.cpu.get_cpu_capability()}: {reused} of {total} prompt tokens read from masters")
    print("\nlayer  key rel. error  value rel. error")
    for layer, (k, v, n) in sorted(by_layer.items()):
        print(f"{layer:5d}  {k / n:13.4f}  {v / n:16.4f}")
    print("\noffset in span  tokens  key rel. error  value rel. error (mean over layers)")
    for name, (k, v, n) in sorted(by_offset.items(), key=lambda item: int(item[0].split("-")[0].rstrip("+"))):
        print(f"{name:>14}  {round(n):6d}  {k / n:13.4f}  {v / n:16.4f}")
    energy_table(f"a shift correction (spans of >= 4 reused tokens; sample: {shifts.ratio:g} of each span)",
                 ["span's own mean", "mean of the sample", "agent's mean"], shifts.rows())
    if patch is not None:
        energy_table(f"an anchor patch ({args.anchors} anchors; spans of >= 4 reused tokens; weights fitted on a "
                     f"{patch.ratio:g} sample, left: on the other tokens)",
                     ["weights fitted on the sample", "weights fitted on all (bound)", "nearest anchor on the sample"],
                     patch.rows())
    if low_rank is not None:
        energy_table(f"a rank-m patch from the reused KV (per agent, layer and KV head; fitted on a {low_rank.ratio:g} "
                     f"sample, left: on the other tokens; bound: fitted on all)",
                     [f"m={m} sample" for m in LowRankPatch.RANKS] + [f"m={m} bound" for m in LowRankPatch.RANKS],
                     low_rank.rows())


def energy_table(what: str, columns: list[str], rows) -> None:
    """Per layer and K/V, the share of the deviation's energy left, then its mean over layers >= 1."""
    print(f"\nshare of the deviation's energy left after {what}")
    print("layer  K/V  " + "  ".join(columns))
    means = defaultdict(list)
    for layer, kind, values in rows:
        print(f"{layer:5d}  {kind:>3}  " + "  ".join(f"{v:{len(c)}.3f}" for v, c in zip(values, columns)))
        if layer > 0:
            means[kind].append(values)
    for kind, values in sorted(means.items()):
        mean = [sum(column) / len(column) for column in zip(*values)]
        print(f"{'mean':>5}  {kind:>3}  " + "  ".join(f"{v:{len(c)}.3f}" for v, c in zip(mean, columns)))


if __name__ == "__main__":
    main()
