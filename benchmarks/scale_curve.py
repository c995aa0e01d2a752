"""The scale curve: what reuse changes in what agents say, against the prompt tokens it computes,
one curve per model, from `tokendance bench quality` reports (closed-loop runs over seeds, each
setting beside full computation and the dtype floor):

    python benchmarks/scale_curve.py 135M=q135m.json 0.5B=q05b.json --out docs/scale-curve.png

Per workload and model, each setting's convergence excess (reply pairs the same, points over
full's in the same run) and distinct-2 change (setting - full, same run), with 95% intervals over
runs, at the share of the prompts' tokens it computed. Settings with neutral masters are joined
by a line (fast: ratio 0.05, then 0.15, 0.3); agent masters are drawn apart; the floor (full in
float32) sits at 100%. Prints the same as a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokendance.bench.quality_report import FLOOR, REFERENCE, summarize  # noqa: E402

NEUTRAL = ("fast", "r15", "r30")  # the neutral-master settings, by ratio (0.05, 0.15, 0.3)
MEASURES = (("identical_pairs_excess", "reply pairs the same, points over full", 100),
            ("distinct_2_excess", "distinct-2, setting - full (x100)", 100))


def load(specs: list[str]) -> dict[str, dict]:
    """model label -> summarize()'s report over the runs of its files (`LABEL=FILE[,FILE]`)."""
    reports = {}
    for spec in specs:
        label, files = spec.split("=", 1)
        runs = [run for path in files.split(",") for run in json.loads(Path(path).read_text())["runs"]]
        settings = [s for s in runs[0]["settings"] if s not in (REFERENCE, FLOOR)]
        reports[label] = {"report": summarize(runs, settings), "settings": settings}
    return reports


def table(reports: dict[str, dict]) -> str:
    lines = ["| model | workload | runs | setting | prompt tokens computed | pairs the same, points over full "
             "| distinct-2 over full | loops over full | runs worse d2 / loops |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for label, found in reports.items():
        for workload, entry in found["report"]["workloads"].items():
            for setting, row in entry["settings"].items():
                lines.append(f"| {label} | {workload} | {entry['runs']} | {setting} | {100 * row['computed_share'][0]:.1f}% "
                             f"| {_fmt(row['identical_pairs_excess'])} | {_fmt(row['distinct_2_excess'], 1.0, 3)} "
                             f"| {_fmt(row['loop_fraction_excess'])} "
                             f"| {row['distinct_2_worse_runs']} / {row['loop_fraction_worse_runs']} |")
    return "\n".join(lines)


def _fmt(value, scale: float = 100.0, digits: int = 1) -> str:
    mean, low, high = (scale * v for v in value)
    return f"{mean:+.{digits}f}" if math.isnan(low) else f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def plot(reports: dict[str, dict], path: Path, cpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(w for found in reports.values() for w in found["report"]["workloads"]))
    fig, axes = plt.subplots(len(MEASURES), len(workloads), figsize=(5.2 * len(workloads), 7.6), squeeze=False)
    colors = dict(zip(reports, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for column, workload in enumerate(workloads):
        for row_index, (measure, label, scale) in enumerate(MEASURES):
            ax = axes[row_index][column]
            for model, found in reports.items():
                entry = found["report"]["workloads"].get(workload)
                if entry is None:
                    continue
                rows = entry["settings"]

                def point(setting):
                    mean, low, high = (scale * v for v in rows[setting][measure])
                    return 100 * rows[setting]["computed_share"][0], mean, low, high

                line = [point(s) for s in NEUTRAL if s in rows] + [(100.0, 0.0, 0.0, 0.0)]  # full: 0 at 100%
                ax.plot([p[0] for p in line], [p[1] for p in line], "-o", color=colors[model],
                        label=f"{model} ({entry['runs']} runs)")
                for x, mean, low, high in line[:-1]:
                    if not math.isnan(low):
                        ax.errorbar([x], [mean], yerr=[[mean - low], [high - mean]], color=colors[model], capsize=3)
                for setting in rows:
                    if setting in NEUTRAL:
                        continue
                    x, mean, low, high = point(setting)
                    marker = "s" if setting == FLOOR else "^"
                    ax.errorbar([x], [mean], yerr=None if math.isnan(low) else [[mean - low], [high - mean]],
                                fmt=marker, color=colors[model], capsize=3, alpha=0.7)
                    ax.annotate(setting, (x, mean), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if row_index == 0:
                ax.axhline(5, linestyle=":", color="tab:red", linewidth=0.8)
            ax.axhline(0, color="black", linewidth=0.5)
            ax.set(xlabel="prompt tokens computed (% of the prompts)", ylabel=label, title=workload)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("What reuse changes in what agents say, by model (closed loop; lines: neutral masters at ratios "
                 f"0.05, 0.15, 0.3, then full at 100%;\ntriangles: agent masters; squares: the floor, full in float32; "
                 f"bars: 95% intervals over runs; red: +5 points) CPU {cpu}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="LABEL=FILE[,FILE...]: a model's quality reports")
    parser.add_argument("--out", default="docs/scale-curve.png")
    args = parser.parse_args()
    reports = load(args.reports)
    first = json.loads(Path(args.reports[0].split("=", 1)[1].split(",")[0]).read_text())
    print(table(reports))
    plot(reports, Path(args.out), first.get("config", {}).get("cpu", ""))
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
