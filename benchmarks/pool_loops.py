"""Pools the degeneration measure of several `tokendance bench --fidelity --out F` runs (seeds): per
setting, the replies that loop over all runs, with a 95% Wilson interval, and the exact settings
(`full` in both dtypes, `prefix`, ratio 1.0) pooled as one baseline.

    python benchmarks/pool_loops.py benchmarks/results/loops-open-s*.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from tokendance.bench.quality import wilson

EXACT = ("full", "prefix", "tokendance@1")  # and the floor: `full` in the other dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="--out files of `tokendance bench --fidelity`")
    args = parser.parse_args()
    looped, replies, per_run = defaultdict(int), defaultdict(int), defaultdict(list)
    for path in args.files:
        report = json.load(open(path))["fidelity"]
        count = report["agents"] * report["rounds"]
        rows = [{"setting": "full", **report["reference_quality"]}, *report["rows"]]
        for row in rows:
            name = "full (floor dtype)" if row["setting"] == report["floor"] else row["setting"]
            hits = round(row["loop_fraction"] * count)
            looped[name] += hits
            replies[name] += count
            per_run[name].append(f"{row['loop_fraction']:.0%}")
    exact = [name for name in looped if name in EXACT or name == "full (floor dtype)"]
    looped["exact settings, pooled"] = sum(looped[n] for n in exact)
    replies["exact settings, pooled"] = sum(replies[n] for n in exact)
    print(f"{'setting':<28}{'per run':<26}{'loops':>7}  95% interval  replies")
    for name in looped:
        low, high = wilson(looped[name], replies[name])
        runs = " / ".join(per_run.get(name, []))
        print(f"{name:<28}{runs:<26}{looped[name] / replies[name]:>7.0%}  {low:>4.0%}-{high:<4.0%}      {replies[name]}")


if __name__ == "__main__":
    main()
