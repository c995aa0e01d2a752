"""`tokendance bench quality`: what a user reads, in the closed loop, with each run as one sample.

Every run is one workload at one seed, simulated for several rounds in closed loop (each setting
fed what it said itself) beside `full` (no reuse) and the numeric floor (`full` in the other
dtype: a change everyone accepts as exact). Per run and setting it measures, pooled over rounds:
the agents' convergence (pairs of replies that are the same text once each speaker's own name is
dropped; word 3-gram overlap), loops, distinct-2, graded accuracy where the workload has a ground
truth, and the compute and compression the setting keeps. Loops and distinct-2 are compared as
drift from `full` beside the floor's own drift (closed loops are chaotic: the dtype alone moves
them); convergence as excess over `full`'s. Intervals are 95% t-intervals over runs, not replies.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from tokendance import registry
from tokendance.config import AUTO, EngineConfig
from tokendance.errors import InvalidRequestError
from tokendance.bench.quality import convergence, degeneration
from tokendance.bench.simulation import Simulation, kv_budget, warm_up
from tokendance.llm import LLM
from tokendance.model.loader import load_model
from tokendance.model.platform import dtype_name, probe_cpu
from tokendance.workloads import make_workload

REFERENCE, FLOOR = "full", "floor"  # the two settings every report computes
# Two-sided 95% Student t quantiles by degrees of freedom (1-30); the normal's beyond.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` (one per run) and its 95% t-interval."""
    if not values:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    t = _T95[len(values) - 2] if len(values) - 1 <= len(_T95) else 1.96
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


@dataclass
class RunFigures:
    """One setting in one run, pooled over its rounds (the first included)."""

    identical_pairs: float  # share of reply pairs, over all rounds' pairs, that are the same text
    worst_round_identical_pairs: float
    ngram_overlap: float
    loop_fraction: float
    distinct_2: float  # mean over rounds
    accuracy: float | None  # share of graded replies right (None: the workload has no ground truth)
    computed_share: float  # prompt tokens computed / prompt tokens
    shared_compression: float  # mean over rounds where something was shared
    replies: list[dict[str, str]] = field(default_factory=list)  # per round: agent id -> what it said


def run_figures(simulation: Simulation, mode: str) -> RunFigures:
    workload, trace = simulation.workload, simulation.traces[mode]
    speakers = [workload.names[a] for a in workload.agents]
    rounds = []
    for r, result in enumerate(trace.results):
        texts = [o.text for o in result.outputs]
        grades = [workload.grade(a, r, t) for a, t in zip(workload.agents, texts)]
        rounds.append({**convergence(texts, speakers), **degeneration(texts), "grades": grades,
                       "computed": result.stats.computed_tokens, "prompt": result.stats.prompt_tokens,
                       "compression": result.stats.shared_compression})
    graded = [g for r in rounds for g in r["grades"] if g is not None]
    pairs = [r["identical_pairs"] for r in rounds]
    compressions = [r["compression"] for r in rounds if r["compression"] > 0]
    return RunFigures(
        identical_pairs=statistics.fmean(pairs), worst_round_identical_pairs=max(pairs),
        ngram_overlap=statistics.fmean(r["ngram_overlap"] for r in rounds),
        loop_fraction=statistics.fmean(r["loop_fraction"] for r in rounds),
        distinct_2=statistics.fmean(r["distinct_2"] for r in rounds),
        accuracy=sum(graded) / len(graded) if graded else None,
        computed_share=sum(r["computed"] for r in rounds) / max(1, sum(r["prompt"] for r in rounds)),
        shared_compression=statistics.fmean(compressions) if compressions else 1.0,
        replies=trace.history,
    )


def other_dtype(dtype: str) -> str:
    return "float32" if dtype == "bfloat16" else "bfloat16"


def quality_settings(names: Sequence[str]) -> dict[str, dict]:
    """Engine arguments of each setting: a fidelity preset's name, a reuse mode's, or
    `LABEL=FIELD:VALUE,...` (engine fields, e.g. `r15=reuse:tokendance,recompute_ratio:0.15`)."""
    found = {}
    for name in names:
        if "=" in name:
            label, fields = name.split("=", 1)
            pairs = [f.split(":", 1) for f in fields.split(",")]
            if not label or any(len(p) != 2 for p in pairs):
                raise InvalidRequestError(f"setting {name!r}: write LABEL=FIELD:VALUE,FIELD:VALUE", "settings")
            found[label] = {k: _value(v) for k, v in pairs}
        elif name in registry.FIDELITY or name == AUTO:
            found[name] = {"fidelity": name}
        else:
            found[name] = {"reuse": registry.check("setting", name, registry.REUSE_POLICIES)}
        try:  # the engine's own checks, before the long runs
            EngineConfig(**found[name.split("=", 1)[0]])
        except TypeError as error:
            raise InvalidRequestError(f"setting {name!r}: {error}", "settings") from None
    if {REFERENCE, FLOOR} & found.keys():
        raise InvalidRequestError(f"{REFERENCE!r} and {FLOOR!r} are computed beside every setting: name it otherwise",
                                  "settings")
    return found


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def run_quality(args) -> int:
    """Runs every (workload, seed) in closed loop with every setting beside full and the floor,
    prints the report and writes the per-run figures as JSON (after each run: a run the file
    already holds is not run again). `--merge FILE...`: the report of runs already written."""
    if args.merge:
        return merge_reports(args.merge, args.out, args.plots)
    loaded = load_model(args.model)
    dtype = dtype_name(args.dtype)
    settings = quality_settings(args.settings)
    out = Path(args.out or "benchmarks/results/quality.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = json.loads(out.read_text()).get("runs", []) if out.exists() else []
    done = {(r["workload"], r["seed"]) for r in runs}
    config = {"dtype": dtype, "floor_dtype": other_dtype(dtype), "rounds": args.rounds, "cpu": probe_cpu().describe(),
              "settings": settings}
    started = time.perf_counter()
    # seed by seed, every workload at each: what has run is a sample of all of them
    jobs = [(w, s) for s in range(args.seed, args.seed + args.seeds) for w in args.workloads if (w, s) not in done]
    engines_of: dict[str, dict[str, LLM]] = {}
    with tqdm(total=len(jobs), desc="closed-loop runs", unit="run") as bar:
        for workload_name, seed in jobs:
            workload = make_workload(workload_name, _agents(args, workload_name), seed=seed)
            if workload_name not in engines_of:  # one set of engines per workload, sized for it
                budget = kv_budget(loaded, workload, args.rounds, dtype, headroom=2.0)
                engines_of[workload_name] = _engines(loaded, dtype, settings, budget, args.num_threads)
                if args.warm_up:
                    warm_up(list(engines_of[workload_name].values()))
            engines = engines_of[workload_name]
            simulation = Simulation(workload, engines, closed_loop=True, max_tokens=args.max_tokens)
            for _ in range(args.rounds):
                simulation.step(on_mode=lambda mode: bar.set_postfix_str(f"{workload_name} seed {seed} {mode}"))
            runs.append({"workload": workload_name, "seed": seed, "agents": len(workload.agents),
                         "settings": {mode: run_figures(simulation, mode).__dict__ for mode in engines}})
            for llm in engines.values():  # the next run's agents have the same ids: no session carries over
                for agent in workload.agents:
                    llm.end_agent(agent)
            out.write_text(json.dumps({"runs": runs, "config": config}, indent=1))
            bar.update(1)
    return _report(runs, {**config, "seconds": time.perf_counter() - started}, out, args.plots)


def _report(runs: list[dict], config: dict, out: Path, plots: str | None = None) -> int:
    if not runs:
        raise InvalidRequestError("no closed-loop run to report (--seeds 0, or empty files)", "seeds")
    report = summarize(runs, [s for s in runs[0]["settings"] if s not in (REFERENCE, FLOOR)])
    report["config"] = config
    print(format_report(report))
    out.write_text(json.dumps({"report": report, "runs": runs, "config": config}, indent=1))
    print(f"\nper-run figures and replies: {out}")
    if plots:
        plot_quality(runs, report, Path(plots) / "closed-loop-convergence.png")
        print(f"plot: {Path(plots) / 'closed-loop-convergence.png'}")
    return 0


def merge_reports(paths: Sequence[str], out: str | None, plots: str | None = None) -> int:
    """One report over the runs of several files (runs split over processes), the first run of
    each (workload, seed) kept."""
    runs, seen, config = [], set(), {}
    for path in paths:
        found = json.loads(Path(path).read_text())
        config = found.get("config") or config
        for run in found["runs"]:
            if (run["workload"], run["seed"]) not in seen:
                seen.add((run["workload"], run["seed"]))
                runs.append(run)
    return _report(runs, config, Path(out or "benchmarks/results/quality.json"), plots)


def _agents(args, workload_name: str) -> int | None:
    return args.agents[0] if args.agents and workload_name != "debate" else None


def _engines(loaded, dtype: str, settings: dict[str, dict], budget: int, num_threads: int | None) -> dict[str, LLM]:
    common = {"num_threads": num_threads, "kv_cache_bytes": budget}
    engines = {REFERENCE: LLM(loaded, dtype=dtype, reuse="full", **common),
               FLOOR: LLM(loaded, dtype=other_dtype(dtype), reuse="full", **{**common, "kv_cache_bytes": budget * 2})}
    for name, engine_args in settings.items():
        engines[name] = LLM(loaded, dtype=dtype, **common, **engine_args)
    return engines


MEASURES = ("identical_pairs", "ngram_overlap", "loop_fraction", "distinct_2", "accuracy")


def summarize(runs: list[dict], settings: list[str]) -> dict:
    """Per workload and setting: each measure's mean and 95% interval over runs; convergence as
    excess over full's in the same run, loops and distinct-2 as absolute drift from full's in the
    same run, beside the floor's drift; and the verdicts of the issue's targets."""
    report: dict = {"workloads": {}}
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload]
        table = {}
        for setting in [FLOOR, *settings]:
            row = {}
            for measure in MEASURES:
                pairs = [(r["settings"][setting][measure], r["settings"][REFERENCE][measure]) for r in mine]
                if any(v is None for pair in pairs for v in pair):
                    continue
                row[measure] = interval([v for v, _ in pairs])
                row[f"{measure}_full"] = interval([f for _, f in pairs])
                row[f"{measure}_excess"] = interval([v - f for v, f in pairs])
                row[f"{measure}_drift"] = interval([abs(v - f) for v, f in pairs])
            for measure, worse in (("distinct_2", -1), ("loop_fraction", 1)):  # runs where it is worse than full
                row[f"{measure}_worse_runs"] = sum(
                    worse * (r["settings"][setting][measure] - r["settings"][REFERENCE][measure]) > 0 for r in mine)
            excess = [r["settings"][setting]["worst_round_identical_pairs"]
                      - r["settings"][REFERENCE]["worst_round_identical_pairs"] for r in mine]
            row["worst_run_identical_excess"] = max(r["settings"][setting]["identical_pairs"]
                                                    - r["settings"][REFERENCE]["identical_pairs"] for r in mine)
            row["worst_round_identical_excess"] = max(excess)
            row["computed_share"] = interval([r["settings"][setting]["computed_share"] for r in mine])
            row["shared_compression"] = interval([r["settings"][setting]["shared_compression"] for r in mine])
            table[setting] = row
        for setting in settings:
            table[setting]["verdict"] = verdict(table[setting], table[FLOOR])
        report["workloads"][workload] = {"runs": len(mine), "settings": table}
    return report


def verdict(row: dict, floor: dict) -> dict:
    """The quality targets for one setting, read on intervals over runs: convergence excess over
    full's at most 5 points on average with the interval's upper bound at most 10 (one run cannot
    hide in a mean), and at most 20 in any run; distinct-2 below full's, and loops above full's, in
    no more runs than the floor's are, their mean drift within 1.5x the floor's; accuracy paired
    with full's run by run, the difference's interval reaching 0."""
    mean, _, high = row["identical_pairs_excess"]
    checks = {
        "convergence_mean": mean <= 0.05 and (math.isnan(high) or high <= 0.10),
        "convergence_worst_run": row["worst_run_identical_excess"] <= 0.20,
        "loops_drift": row["loop_fraction_drift"][0] <= 1.5 * floor["loop_fraction_drift"][0] + 1e-9,
        "distinct_2_drift": row["distinct_2_drift"][0] <= 1.5 * floor["distinct_2_drift"][0] + 1e-9,
        "loops_sign": row["loop_fraction_worse_runs"] <= floor["loop_fraction_worse_runs"],
        "distinct_2_sign": row["distinct_2_worse_runs"] <= floor["distinct_2_worse_runs"],
    }
    if "accuracy" in row:
        mean, low, high = row["accuracy_excess"]  # setting - full, run by run
        checks["accuracy"] = mean >= 0 or math.isnan(high) or high >= 0
    checks["passes"] = all(checks.values())
    return checks


def _fmt(value: tuple[float, float, float], scale: float = 100.0, digits: int = 1) -> str:
    mean, low, high = value
    if math.isnan(low):
        return f"{mean * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f} [{low * scale:.{digits}f}, {high * scale:.{digits}f}]"


def format_report(report: dict) -> str:
    columns = [("setting", 10), ("pairs same, pts over full", 25), ("worst run", 9), ("3-gram overlap over full", 24),
               ("loops drift, pts", 24),
               ("distinct-2 drift", 24), ("runs worse d2/loops", 19), ("accuracy %", 20), ("computed %", 10),
               ("shared x", 8), ("verdict", 0)]
    lines = []
    for workload, found in report["workloads"].items():
        lines.append(f"\n{workload}: {found['runs']} closed-loop runs (95% intervals over runs)")
        lines.append("  ".join(f"{name:<{width}}" for name, width in columns).rstrip())
        for setting, row in found["settings"].items():
            checks = row.get("verdict")
            failed = [k for k, ok in (checks or {}).items() if not ok and k != "passes"]
            said = "floor" if checks is None else ("passes" if checks["passes"] else "fails: " + ", ".join(failed))
            cells = [setting, _fmt(row["identical_pairs_excess"]), f"{row['worst_run_identical_excess'] * 100:.1f}",
                     _fmt(row["ngram_overlap_excess"]), _fmt(row["loop_fraction_drift"]), _fmt(row["distinct_2_drift"], 100, 2),
                     f"{row['distinct_2_worse_runs']}/{row['loop_fraction_worse_runs']} of {found['runs']}",
                     _fmt(row["accuracy"]) if "accuracy" in row else "-", f"{row['computed_share'][0] * 100:.1f}",
                     f"{row['shared_compression'][0]:.2f}", said]
            lines.append("  ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, columns)).rstrip())
    c = report.get("config", {})
    if c.get("dtype"):
        lines.append(f"\n{c['dtype']} (floor: full in {c['floor_dtype']}), CPU {c['cpu']}, {c['rounds']} rounds a run; "
                     "pairs: share of reply pairs that are the same text once the speaker's name is dropped, minus "
                     "full's in the same run; drift: |setting - full| in the same run (the floor's row is the numeric "
                     "noise: full in the other dtype)")
    return "\n".join(lines)


def plot_quality(runs: list[dict], report: dict, path: Path) -> None:
    """Per workload, each setting at the share of prompt tokens it computed: every run's
    convergence excess over full (dots; each run a sample) and their mean with its 95% interval,
    the floor among them, the targets' 5 and 20 points drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["workloads"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(max(8.0, 5.5 * len(workloads)), 4.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        table = report["workloads"][workload]["settings"]
        mine = [r for r in runs if r["workload"] == workload]
        for setting, row in table.items():
            x = row["computed_share"][0] * 100
            excess = [100 * (r["settings"][setting]["identical_pairs"] - r["settings"][REFERENCE]["identical_pairs"])
                      for r in mine]
            ax.scatter([x] * len(excess), excess, s=14, alpha=0.45, color="gray")
            mean, low, high = (100 * v for v in row["identical_pairs_excess"])
            yerr = None if math.isnan(low) else [[mean - low], [high - mean]]
            ax.errorbar([x], [mean], yerr=yerr, fmt="o", capsize=4, markersize=7)
            ax.annotate(setting, (x, mean), textcoords="offset points", xytext=(6, 6), fontsize=8)
        for level, style in ((5, ":"), (20, "--")):
            ax.axhline(level, linestyle=style, color="tab:red", linewidth=0.8)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set(xlabel="prompt tokens computed (% of the prompts)", ylabel="reply pairs the same, points over full",
               title=f"{workload}: {len(mine)} closed-loop runs")
        ax.grid(alpha=0.3)
    c = report.get("config", {})
    fig.suptitle(f"Agents repeating each other under reuse ({c.get('dtype', '')}, CPU {c.get('cpu', '')})\n"
                 "dots: runs; bars: 95% intervals over runs; red: the targets' 5 and 20 points", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
