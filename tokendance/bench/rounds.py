"""`tokendance bench` (rounds): every reuse mode on the same workload, round by round, plus a
fidelity-vs-recompute-ratio sweep of tokendance; a table, JSON and plots."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from tokendance.bench import fidelity, report
from tokendance.bench.fidelity import release
from tokendance.bench.options import kv_bytes
from tokendance.bench.simulation import Simulation, kv_budget, warm_up
from tokendance.config import REUSE_MODES
from tokendance.llm import LLM
from tokendance.model.loader import load_model
from tokendance.model.platform import describe_machine, dtype_name
from tokendance.reuse.fidelity import compare
from tokendance.workloads import make_workload


def default_agents(args) -> list[int]:
    """--fidelity alone runs only its report."""
    if args.agents or args.fidelity:
        return args.agents or []
    return [3] if args.workload == "debate" else [4, 8, 16]


def run_rounds(args) -> int:
    loaded = load_model(args.model)
    modes = args.modes or list(REUSE_MODES)
    agent_counts = default_agents(args)
    sweep_runs = len(args.sweep_ratios) * len(args.sweep_selections) + 1 if args.sweep_ratios and not args.fidelity else 0
    fidelity_runs = 2 * len(fidelity.variants(args)) if args.fidelity else 0
    out = Path(args.out or "benchmarks/results/bench.json")
    results: dict = {"args": {k: v for k, v in vars(args).items() if k != "api_key"},
                     "machine": describe_machine(dtype_name(args.dtype))}
    machine = results["machine"]
    started = time.perf_counter()

    def save() -> None:
        results["seconds"] = time.perf_counter() - started
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))

    total = (len(agent_counts) * len(modes) + sweep_runs + fidelity_runs) * args.rounds
    with tqdm(total=total, desc="bench", unit="round") as bar:
        rows = []
        for n in agent_counts:
            workload = make_workload(args.workload, n, seed=args.seed, order=args.order)
            engines = make_engines(loaded, workload, {m: {"reuse": m} for m in modes}, args)
            rows += simulate(workload, engines, args, bar, label=f"N={n}")
            results["rounds"] = rows
            save()
        bar.write(f"\n{machine['dtype']}, CPU {machine['cpu_capability']}")
        if rows:
            bar.write("\n" + report.format_rounds(rows) + "\n\n" + report.format_summary(rows))
            bar.write("\nround prefill cost by kind, beside its bound (reuse/cost.py)\n" + report.format_cost(rows))
            bar.write("\nrounds against the machine's roofline (model/roofline.py)\n" + report.format_roofline(rows))
        if sweep_runs:
            results["sweep"] = sweep(loaded, args, bar)
            save()
            bar.write("\n" + report.format_sweep(results["sweep"]))
        if fidelity_runs:
            workload = make_workload(args.workload, args.sweep_agents, seed=args.seed, order=args.order)
            results["fidelity"] = fidelity.run_fidelity(
                loaded, workload, args, lambda variants, warm=True: make_engines(loaded, workload, variants, args, warm),
                lambda text: (bar.set_postfix_str(text), bar.update(1)))
            save()
            bar.write("\n" + report.format_noise_floor(results["fidelity"]))
    if args.plots:
        write_plots(args, results, agent_counts)
    print(f"results in {out}")
    return 0


def write_plots(args, results: dict, agent_counts: list[int]) -> None:
    plots, machine, rows = Path(args.plots), results["machine"], results.get("rounds")
    if rows:
        last = max(r["round"] for r in rows)
        rounds = f"rounds {min(3, last)}-{last} of {args.rounds} averaged" if last > 3 else f"round {last}"
        report.plot_scaling(rows, plots / f"{args.workload}-scaling.png",
                            report.caption(args.workload, agent_counts, rounds, args.loop, machine))
    if results.get("sweep"):
        title = report.caption(args.workload, [args.sweep_agents], f"all {args.rounds} rounds", args.loop, machine)
        report.plot_fidelity(results["sweep"], plots / f"{args.workload}-fidelity.png", title, args.ratio)
    if results.get("fidelity"):
        title = report.caption(args.workload, [args.sweep_agents], f"{args.rounds} rounds teacher-forced",
                               args.loop, machine)
        report.plot_noise_floor(results["fidelity"], plots / f"{args.workload}-noise-floor.png", title)
    print(f"plots in {plots}/")


def make_engines(loaded, workload, variants: dict[str, dict], args, warm: bool = True) -> dict[str, LLM]:
    """One engine per variant (label -> engine arguments), all over the same loaded weights (one
    copy of them per dtype, prepared once: `LoadedModel.prepared`);
    warmed up unless `warm` is False (engines whose times nobody reads) or `--no-warm-up`."""
    budget = kv_bytes(args) or kv_budget(loaded, workload, args.rounds, args.dtype)
    common = {"dtype": args.dtype, "kv_cache_bytes": budget, "recompute_ratio": args.ratio, "selection": args.selection,
              "masters": args.masters}
    engines = {label: LLM(loaded, **{**common, **extra}) for label, extra in variants.items()}
    if warm and getattr(args, "warm_up", True):
        warm_up(list(engines.values()))
    return engines


def simulate(workload, engines: dict[str, LLM], args, bar, label: str) -> list[dict]:
    simulation = Simulation(workload, engines, closed_loop=args.loop == "closed", max_tokens=args.max_tokens)
    for r in range(args.rounds):
        simulation.step(on_mode=lambda mode: (bar.set_postfix_str(f"{label} round {r + 1} {mode}"), bar.update(1)))
    rows = simulation.rows()
    release(engines)
    return rows


def sweep(loaded, args, bar) -> list[dict]:
    """tokendance at each (selection, ratio) against full, same workload and rounds: fidelity and
    compression of the last round."""
    workload = make_workload(args.workload, args.sweep_agents, seed=args.seed, order=args.order)
    variants = {"full": {"reuse": "full"}}
    for selection in args.sweep_selections:
        for ratio in args.sweep_ratios:
            variants[f"{selection}@{ratio}"] = {"reuse": "tokendance", "selection": selection, "recompute_ratio": ratio}
    engines = make_engines(loaded, workload, variants, args)
    simulation = Simulation(workload, engines, closed_loop=args.loop == "closed", max_tokens=args.max_tokens)
    for r in range(args.rounds):
        simulation.step(on_mode=lambda label: (bar.set_postfix_str(f"sweep round {r + 1} {label}"), bar.update(1)))
    reference = simulation.traces["full"].results
    rows = []
    for label, extra in variants.items():
        if label == "full":
            continue
        for r, result in enumerate(simulation.traces[label].results):
            s = result.stats
            rows.append({"selection": extra["selection"], "ratio": extra["recompute_ratio"], "round": r + 1,
                         "agents": args.sweep_agents, "prefill_seconds": s.prefill_seconds,
                         "full_prefill_seconds": reference[r].stats.prefill_seconds,
                         "shared_compression": s.shared_compression, "kv_bytes_per_agent": s.kv_bytes_per_agent,
                         "diff_blocks": s.diff_blocks, "fidelity": asdict(compare(reference[r].outputs, result.outputs))})
    release(engines)
    return rows
