"""`tokendance bench --fidelity`: every reuse setting against `full` on the numeric noise floor.

Each setting runs the workload twice on fresh engines. First free-running (greedy), which gives
its identical outputs and its shared-span compression. Then teacher-forced: every agent's prompt
of each round is followed by `full`'s own output as a private segment, scored in the round over
the KV the setting prepared (`SamplingParams(prompt_logprobs=...)`). Every setting is so compared
with `full` position by position on the same tokens. `full` in the other dtype is the floor: a
change that everyone accepts as exact. Each metric is also given as a ratio to it.
"""

from __future__ import annotations

import gc

import torch

from tokendance.bench.quality import degeneration, wilson
from tokendance.bench.simulation import Simulation
from tokendance.model.platform import dtype_name
from tokendance.config import EngineConfig
from tokendance.registry import FIDELITY, REUSE_POLICIES
from tokendance.reuse.fidelity import ForcedScores, compare
from tokendance.reuse.segments import with_continuation
from tokendance.sampling import SamplingParams

SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, return_logits=True)


def floor_dtype(dtype: str) -> str:
    """The other dtype than the one `dtype` runs in: its `full` is the noise floor."""
    return "float32" if dtype_name(dtype) == "bfloat16" else "bfloat16"


def variants(args) -> dict[str, dict]:
    """label -> engine arguments: `full` first (the reference), the floor, every mode at the
    bench's ratio, tokendance at each sweep (selection, ratio) and (selection, anchors, ratio),
    every fidelity preset, and tokendance at 1.0 (exact by construction)."""
    floor = floor_dtype(args.dtype)
    found = {"full": {"reuse": "full"}, f"full-{floor}": {"reuse": "full", "dtype": floor}}
    for mode in args.modes or list(REUSE_POLICIES):
        if mode != "full":
            found[mode] = {"reuse": mode}
    for selection in args.sweep_selections:
        for ratio in args.sweep_ratios or ():
            found[f"{selection}@{ratio:g}"] = {"reuse": "tokendance", "selection": selection, "recompute_ratio": ratio}
    for selection in args.sweep_selections:
        for anchors in args.sweep_anchors:
            for ratio in args.sweep_ratios or ():
                found[f"{selection}+anchors{anchors}@{ratio:g}"] = {
                    "reuse": "tokendance", "selection": selection, "anchors": anchors, "recompute_ratio": ratio}
    for masters in getattr(args, "sweep_masters", ()):  # the same sweep with masters computed elsewhere
        for selection in args.sweep_selections:
            for ratio in args.sweep_ratios or ():
                found[f"{selection}@{ratio:g}/{masters}"] = {"reuse": "tokendance", "selection": selection,
                                                             "recompute_ratio": ratio, "masters": masters}
    present = {EngineConfig(**settings).fidelity_name for settings in found.values()}
    for name, preset in FIDELITY.items():
        if name not in present:
            ratio = preset.settings.get("recompute_ratio")
            plain = preset.settings.keys() <= {"reuse", "recompute_ratio"}  # else named by the preset
            label = preset.settings["reuse"] + ("" if ratio is None else f"@{ratio:g}") if plain else name
            found[label] = dict(preset.settings)
    found["tokendance@1"] = {"reuse": "tokendance", "recompute_ratio": 1.0}
    return found


def run_fidelity(loaded, workload, args, engines_for, on_round) -> dict:
    """The report's rows. `engines_for(labelled variants, warm)` builds fresh engines (warmed up
    for the free pass, whose times the rows report; not for the forced one, which only scores) and
    `on_round(text)` reports progress; engines are dropped after each pass."""
    labels = variants(args)
    closed = args.loop == "closed"
    engines = engines_for(labels)
    free = Simulation(workload, engines, closed_loop=closed, max_tokens=args.max_tokens)
    for r in range(args.rounds):
        free.step(on_mode=lambda label: on_round(f"fidelity free round {r + 1} {label}"))
    release(engines)
    reference = free.traces["full"]
    scores = {label: ForcedScores() for label in labels if label != "full"}
    engines = engines_for(labels, False)
    for r in range(args.rounds):
        history = reference.history if closed else [workload.synthetic_outputs(i) for i in range(r)]
        turns = workload.turns(r, history[:r])
        forced = [with_continuation(loaded.tokenizer, t, o.token_ids) for t, o in zip(turns, reference.results[r].outputs)]
        expected = None
        for label, llm in engines.items():
            on_round(f"fidelity forced round {r + 1} {label}")
            logits = [torch.stack([o.prompt_logits[p] for p in sorted(o.prompt_logits)]) for o in
                      llm.run_round(forced, SCORE).outputs]
            if label == "full":
                expected = logits
            else:
                for ref, got in zip(expected, logits):
                    scores[label].add(ref, got)
    release(engines)
    found = rows(free, scores, labels, floor=f"full-{floor_dtype(args.dtype)}")
    right, _, graded = accuracy(workload, reference.results, reference.results)
    return {"agents": len(workload.agents), "rounds": args.rounds, "floor": f"full-{floor_dtype(args.dtype)}",
            "reference_accuracy": right, "reference_accuracy_ci": interval(right, graded),
            "reference_quality": degeneration([o.text for r in reference.results for o in r.outputs]), "rows": found}


def release(engines: dict) -> None:
    """Drop engines now: their KV pools are large and engines hold reference cycles."""
    engines.clear()
    gc.collect()


def rows(free: Simulation, scores: dict[str, ForcedScores], labels: dict[str, dict], floor: str) -> list[dict]:
    """One row per setting: identical outputs, compression, round TTFT against `full`'s and task
    accuracy of the free run, the forced scores, and each score's ratio to the floor's."""
    reference = free.traces["full"].results
    found = []
    for label, forced in scores.items():
        results = free.traces[label].results
        same = [compare(ref.outputs, result.outputs) for ref, result in zip(reference, results)]
        right, changed, graded = accuracy(free.workload, results, reference)
        found.append({"setting": label, **labels[label], "preset": EngineConfig(**labels[label]).fidelity_name,
                      "identical_fraction": sum(s.identical_fraction for s in same) / len(same),
                      "shared_compression": sum(r.stats.shared_compression for r in results) / len(results),
                      "ttft_speedup": sum(r.stats.prefill_seconds for r in reference)
                      / max(1e-9, sum(r.stats.prefill_seconds for r in results)),
                      "task_accuracy": right, "task_accuracy_ci": interval(right, graded), "changed_answers": changed,
                      **degeneration([o.text for r in results for o in r.outputs]), **forced.summary()})
    base = next(r for r in found if r["setting"] == floor)
    for row in found:
        row["kl_mean_ratio"] = _ratio(row["kl_mean"], base["kl_mean"])
        row["kl_p99_ratio"] = _ratio(row["kl_p99"], base["kl_p99"])
        row["disagreement_ratio"] = _ratio(1 - row["top1_agreement"], 1 - base["top1_agreement"])
        row["changed_answers_ratio"] = None if row["changed_answers"] is None else \
            _ratio(row["changed_answers"], base["changed_answers"])
    return found


def accuracy(workload, results, reference) -> tuple[float | None, float | None, int]:
    """For a graded workload: the share of answers right, the share whose correctness differs from
    the reference's, and how many answers were graded (None, None, 0 without a ground truth)."""
    graded = [(workload.grade(o.agent_id, r, o.text), workload.grade(o.agent_id, r, ref.text))
              for r, (result, expected) in enumerate(zip(results, reference))
              for o, ref in zip(result.outputs, expected.outputs)]
    if not graded or graded[0][0] is None:
        return None, None, 0
    return sum(g for g, _ in graded) / len(graded), sum(g != e for g, e in graded) / len(graded), len(graded)


def interval(share: float | None, total: int) -> list[float] | None:
    """The 95% interval of an accuracy measured on `total` answers."""
    return None if share is None else list(wilson(round(share * total), total))


def _ratio(value: float, floor: float) -> float | None:
    return None if floor <= 0 else value / floor
