"""`tokendance bench [rounds|capacity]`: a workload against the reuse modes side by side.

    tokendance bench --workload generative-agents --agents 4 8 16 --rounds 4      # modes side by side
    tokendance bench capacity --kv-cache-bytes 96M --slo-seconds 8                # max resident agents
    tokendance bench --target http://127.0.0.1:8000/v1 --agents 8                 # any OpenAI-compatible server
    tokendance bench capacity --target http://127.0.0.1:8000/v1 --slo-seconds 60  # its max agents
    tokendance bench --fidelity --sweep-agents 8 --rounds 3                       # KL against the noise floor

This module only builds the parser; the work is imported when a command runs.
"""

from __future__ import annotations

import argparse

from tokendance import registry
from tokendance.bench.options import CAPACITY_KV_BYTES, capacity_modes
from tokendance.cli_types import mebibytes, parse_bytes
from tokendance.errors import InvalidRequestError
from tokendance.workloads import WORKLOADS

def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", nargs="?", default="rounds", choices=["rounds", "capacity", "quality"],
                        help="rounds: modes side by side per round (default); capacity: max agents per mode; "
                             "quality: closed-loop runs over seeds, each setting beside full and the numeric floor")
    parser.add_argument("--workload", default="generative-agents",
                        choices=list(WORKLOADS), help="the multi-agent workload (fact-recall: a task graded against its ground truth)")
    parser.add_argument("--agents", type=int, nargs="+", default=None,
                        help="numbers of agents (default: 4 8 16; debate: 3)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per simulation")
    parser.add_argument("--modes", nargs="+", default=None, choices=list(registry.REUSE_POLICIES),
                        help="reuse modes (default: all; capacity: those that reuse, "
                             f"{' '.join(capacity_modes())}): {registry.describe(registry.REUSE_POLICIES)}")
    parser.add_argument("--loop", default="open", choices=["open", "closed"],
                        help="open: fixed synthetic outputs feed the next round; closed: the model's own")
    parser.add_argument("--order", default=None, choices=["same", "shuffle", "exclude-self"],
                        help="order of the shared blocks in each prompt (default: the workload's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload's text")
    parser.add_argument("--model", default=None, help="GGUF file, Hugging Face folder or model pack (default model if omitted)")
    parser.add_argument("--dtype", default=registry.DEFAULT_DTYPE, choices=list(registry.DTYPES),
                        help=registry.describe(registry.DTYPES))
    parser.add_argument("--max-tokens", type=int, default=None, help="cap on every agent's output length")
    parser.add_argument("--recompute-ratio", "--ratio", dest="ratio", type=float,
                        default=registry.DEFAULT_RECOMPUTE_RATIO,
                        help="share of each reused span's tokens recomputed, in pic and tokendance (as serve's)")
    parser.add_argument("--selection", default=registry.DEFAULT_SELECTION, choices=list(registry.SELECTIONS),
                        help="which tokens of a reused span are recomputed")
    parser.add_argument("--masters", default=registry.DEFAULT_MASTERS, choices=list(registry.MASTERS),
                        help="where tokendance's shared spans get their base KV: " + registry.describe(registry.MASTERS))
    parser.add_argument("--kv-cache-bytes", type=parse_bytes, default=None, metavar="SIZE",
                        help="KV pool per engine, e.g. 256M, as serve's (default: rounds, every agent's prompts "
                             f"privately x1.3; capacity, {CAPACITY_KV_BYTES >> 20}M, the fixed budget)")
    parser.add_argument("--kv-cache-mb", "--kv-budget-mb", dest="kv_cache_bytes", type=mebibytes, metavar="MIB",
                        default=argparse.SUPPRESS, help="--kv-cache-bytes in MiB (the older names)")
    parser.add_argument("--sweep-ratios", type=float, nargs="*", default=[0.0, 0.05, 0.15, 0.3],
                        help="fidelity-vs-ratio sweep of tokendance at --sweep-agents (none: skip)")
    parser.add_argument("--sweep-selections", nargs="+", default=["epic", "cacheblend"],
                        choices=list(registry.SELECTIONS),
                        help="selection policies of the sweep")
    parser.add_argument("--sweep-anchors", type=int, nargs="*", default=[],
                        help="--fidelity: also tokendance with each of these in-round anchor counts (> 1), with each "
                             "--sweep-selections at each --sweep-ratios")
    parser.add_argument("--sweep-masters", nargs="*", default=[], choices=list(registry.MASTERS),
                        help="--fidelity: also the sweep with masters computed this way (beside --masters)")
    parser.add_argument("--sweep-agents", type=int, default=8, help="agents of the sweep's and --fidelity's simulation")
    parser.add_argument("--fidelity", action="store_true",
                        help="the noise-floor report at --sweep-agents instead of the sweep: every mode and "
                             "tokendance at each --sweep-ratios against full, teacher-forced on full's output, beside "
                             "full in the other dtype (runs alone unless --agents is given)")
    parser.add_argument("--slo-seconds", type=float, default=10.0, help="capacity: the round-latency SLO")
    parser.add_argument("--max-agents", type=int, default=64, help="capacity: upper end of the search")
    parser.add_argument("--target", default=None, metavar="URL",
                        help="drive an OpenAI-compatible server (base URL ending in /v1) instead of in-process engines "
                             "(rounds and capacity)")
    parser.add_argument("--target-model", default=None, help="model name to send to --target (default: its first)")
    parser.add_argument("--api-key", default="EMPTY", help="API key for --target")
    parser.add_argument("--request-timeout", type=float, default=1800.0, metavar="SECONDS",
                        help="with --target: how long a request may wait for its server's next bytes (a server "
                             "that queues a large round sends an agent nothing until its turn)")
    parser.add_argument("--declare-rounds", action="store_true",
                        help="with --target: send TokenDance's agent_id/round_id/round_size fields")
    parser.add_argument("--cache-salt", default=None,
                        help="with --target: send this cache_salt (one per simulation keeps simulations apart)")
    parser.add_argument("--out", default=None, help="JSON results (default: benchmarks/results/<experiment>.json)")
    parser.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots into DIR (e.g. docs)")
    parser.add_argument("--workloads", nargs="+", default=["generative-agents", "agent-society", "debate"],
                        choices=list(WORKLOADS), help="quality: the workloads, each run at every seed")
    parser.add_argument("--seeds", type=int, default=8, help="quality: runs per workload (seeds --seed, --seed+1, ...)")
    parser.add_argument("--settings", nargs="+", default=["fast"], metavar="SETTING",
                        help="quality: settings beside full and the floor: fidelity presets "
                             f"({', '.join(registry.FIDELITY)}), reuse modes, or LABEL=FIELD:VALUE,... (engine fields)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                        help="quality: report over the runs these files hold (runs split over processes)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="quality: torch threads of each engine (default: one per core)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip each in-process engine's two untimed warm-up rounds (then the first timed round "
                             "also pays for compiling kernels)")


def run_bench(args) -> int:
    if args.target and args.experiment == "quality":  # it ran the latency bench silently before
        raise InvalidRequestError("bench quality runs in process (each setting an engine beside full and the floor); "
                                  "it does not drive a server yet: drop --target, or run `tokendance bench --target "
                                  "URL --loop closed` for a server's closed loop", "target")
    if args.target and args.experiment != "capacity":
        from tokendance.bench.target import run_target

        return run_target(args)
    if args.experiment == "quality":
        from tokendance.bench.quality_report import run_quality

        return run_quality(args)
    if args.experiment == "capacity":
        from tokendance.bench.capacity import run_capacity

        return run_capacity(args)
    from tokendance.bench.rounds import run_rounds

    return run_rounds(args)
