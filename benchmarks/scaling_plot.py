"""Round latency, round TTFT, KV per agent and shared-span compression against the number of
agents, one line per in-process mode and per server, from results already measured.

    python benchmarks/scaling_plot.py --rounds benchmarks/results/bench.json \
        --target vLLM-CPU=vllm.json --target "tokendance serve"=serve.json --out docs/scaling.png

`--rounds`: a `tokendance bench` results file (its modes); `--target LABEL=FILE`: a `tokendance
bench --target` results file (what that server's clients saw, and its peak KV from /metrics).
Rounds from `--from-round` on are averaged (the first one fills caches and sessions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokendance.bench import report  # noqa: E402
from tokendance.bench.target import as_bench_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=Path, action="append", default=[], help="tokendance bench results")
    parser.add_argument("--target", action="append", default=[], metavar="LABEL=FILE", help="bench --target results")
    parser.add_argument("--from-round", type=int, default=2)
    parser.add_argument("--title", default="")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [row for path in args.rounds for row in json.loads(path.read_text())["rounds"]]
    for spec in args.target:
        label, _, path = spec.partition("=")
        if not path:
            parser.error(f"--target wants LABEL=FILE, got {spec!r}")
        rows += as_bench_rows(json.loads(Path(path).read_text()), label)
    if not rows:
        parser.error("no results: give --rounds and/or --target")
    report.plot_scaling(rows, args.out, args.title, args.from_round)
    means = report.steady_state(rows, args.from_round)
    print(f"{'N':>4} {'system':<18}{'round s':>9}{'TTFT s':>8}{'KV MB/agent':>12}{'shared x':>9}")
    for (n, mode), m in sorted(means.items()):
        kv = "-" if m["kv_bytes_per_agent"] is None else f"{m['kv_bytes_per_agent'] / report.MB:.2f}"
        shared = "-" if m["shared_compression"] is None else f"{m['shared_compression']:.2f}"
        print(f"{n:>4} {mode:<18}{m['round_seconds']:>9.2f}{m['prefill_seconds']:>8.2f}{kv:>12}{shared:>9}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
