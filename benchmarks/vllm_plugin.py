"""Plain `vllm serve` vs `vllm serve` with the TokenDance plugin vs `tokendance serve`, one after
the other on this machine, same model, dtype and KV memory, each driven by the same client
(`tokendance bench --target`; declared rounds for the two that form rounds, none for
`vllm+transparent`, the plugin gathering rounds itself):

    python benchmarks/vllm_plugin.py --workload generative-agents --agents 16 --rounds 3
    python benchmarks/vllm_plugin.py --model qwen2.5-coder-0.5b --servers vllm vllm+tokendance serve serve-fast

Needs .venv-vllm (`make vllm`) for the vLLM servers. Prints each round's latency and TTFT per
server and the ratios; writes benchmarks/results/vllm_plugin-<workload>-<N>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.servers import ROOT, SERVERS, serving  # noqa: E402
from tokendance.registry import DEFAULT_RECOMPUTE_RATIO  # noqa: E402

DEFAULT_SERVERS = ("vllm", "vllm+tokendance", "tokendance")
DECLARING = ("vllm+tokendance", "tokendance", "serve", "serve-fast")  # servers the bench declares rounds to


def run(name: str, args) -> list[dict]:
    with serving(name, args) as port:
        out = Path(tempfile.mkdtemp()) / "target.json"
        command = [sys.executable, "-m", "tokendance.cli", "bench", "--target", f"http://127.0.0.1:{port}/v1",
                   "--workload", args.workload, "--agents", str(args.agents), "--rounds", str(args.rounds),
                   "--loop", args.loop, "--out", str(out)]
        if name in DECLARING:
            command.append("--declare-rounds")
        subprocess.run(command, check=True)
        return json.loads(out.read_text())["rounds"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="generative-agents")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--kv-gib", type=int, default=4, help="KV memory of every server (GiB)")
    parser.add_argument("--loop", choices=("open", "closed"), default="open",
                        help="closed: each round quotes what the agents said (what vllm+transparent gathers on; "
                             "open: the workload's synthetic outputs, which the server never wrote)")
    parser.add_argument("--ratio", type=float, default=DEFAULT_RECOMPUTE_RATIO,
                        help="recompute ratio of both TokenDance servers (their default selection: EPIC)")
    parser.add_argument("--servers", nargs="+", default=list(DEFAULT_SERVERS), choices=SERVERS,
                        help="vllm+transparent: the plugin with transparent_rounds, the bench declaring no round; "
                             "tokendance: collective reuse with agent masters at --ratio (the plugin's plan); serve, "
                             "serve-fast: `tokendance serve` by its default (exact) and with --fidelity fast")
    parser.add_argument("--model", default=None,
                        help="a model pack's name (tokendance models), served by every server (default: the default model)")
    args = parser.parse_args()
    from tokendance.model.platform import probe_cpu

    cpu = probe_cpu()
    args.dtype = args.dtype or ("bfloat16" if cpu.native_bf16 else "float32")
    model = f"-{args.model}" if args.model else ""
    out = ROOT / "benchmarks" / "results" / \
        f"vllm_plugin-{args.workload}-{args.agents}{'-closed' * (args.loop == 'closed')}{model}.json"
    earlier = json.loads(out.read_text())["rounds"] if out.exists() else {}
    fresh = {name: run(name, args) for name in args.servers}
    # servers not run now keep their last measurement (same workload and size), for the table
    results = {name: fresh.get(name) or earlier.get(name) for name in SERVERS if fresh.get(name) or earlier.get(name)}
    print(f"\n{args.workload} N={args.agents}, {args.model or 'the default model'}, {args.dtype}, {args.kv_gib} GiB KV, "
          f"CPU {cpu.capability}"
          f" (measured now: {', '.join(fresh)}; earlier: {', '.join(set(results) - set(fresh)) or 'none'})")
    print(f"{'round':>5}" + "".join(f"{name + ' s':>20}{'TTFT':>7}" for name in results)
          + "".join(f"{'vllm/' + name:>22}" for name in results if name != "vllm"))
    for index in range(min(len(r) for r in results.values())):
        row = {name: rounds[index] for name, rounds in results.items()}
        line = f"{index + 1:>5}" + "".join(f"{r['round_seconds']:>20.2f}{r['prefill_seconds']:>7.2f}" for r in row.values())
        if "vllm" in row:
            line += "".join(f"{row['vllm']['round_seconds'] / r['round_seconds']:>21.2f}x"
                            for name, r in row.items() if name != "vllm")
        if "vllm+tokendance" in row and "vllm+transparent" in row:
            line += f"   transparent/declared {row['vllm+transparent']['round_seconds'] / row['vllm+tokendance']['round_seconds']:.2f}x"
        print(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": args.workload, "agents": args.agents, "model": args.model, "dtype": args.dtype,
                               "kv_gib": args.kv_gib, "cpu": cpu.capability, "ratio": args.ratio,
                               "rounds": results}, indent=2))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
