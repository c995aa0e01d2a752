"""Where the plugin's decode tail comes from. A round's tail (its last reply minus its last first
token) behind the plugin is vLLM decoding every agent at once: the pass gives them their first
tokens within a step or two of each other. Plain vLLM's agents get theirs spread over its prefill,
so some finish decoding before the last one starts. This runs, one server after the other:

- plain vLLM, rounds 1..R, then round R again, every prompt now in its prefix cache (all agents
  decode together, as behind the plugin);
- vLLM with the plugin, rounds 1..R declared;

and prints each round's TTFT, tail and a reply's own decode (first token to last, averaged):

    python benchmarks/vllm_decode_tail.py --workload agent-society --agents 32 --rounds 3

If plain vLLM's replayed round has the plugin's tail, the tail is vLLM's decode of dense KV, which
no connector changes. Needs .venv-vllm (`make vllm`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.servers import serving  # noqa: E402
from tokendance.bench.target import Client, run_round  # noqa: E402
from tokendance.model.platform import probe_cpu  # noqa: E402
from tokendance.registry import DEFAULT_RECOMPUTE_RATIO  # noqa: E402
from tokendance.workloads import make_workload  # noqa: E402


def rounds(name: str, args) -> list[tuple[str, dict]]:
    declared = name == "vllm+tokendance"
    client_args = SimpleNamespace(loop="open", declare_rounds=declared, cache_salt=None, max_tokens=None, seed=0)
    workload = make_workload(args.workload, args.agents, seed=0)
    out, history = [], []
    with serving(name, args) as port:
        client = Client(f"http://127.0.0.1:{port}/v1", "EMPTY", None)
        for r in range(args.rounds):
            out.append((f"{r + 1}", run_round(client, workload, r, history, client_args)))
        if not declared:  # the same prompts again: all cached, all agents decode at once
            out.append((f"{args.rounds} again", run_round(client, workload, args.rounds - 1, history, client_args)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="agent-society")
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-gib", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=DEFAULT_RECOMPUTE_RATIO)
    args = parser.parse_args()
    cpu = probe_cpu()
    args.dtype = "bfloat16" if cpu.native_bf16 else "float32"
    print(f"{args.workload} N={args.agents}, {args.dtype}, {args.kv_gib} GiB KV, CPU {cpu.capability}")
    print(f"{'server':>16} {'round':>8}{'round s':>9}{'TTFT s':>8}{'tail s':>8}{'reply decode s':>16}"
          f"{'cached':>8}{'out tok':>8}")
    for name in ("vllm", "vllm+tokendance"):
        for label, r in rounds(name, args):
            print(f"{name:>16} {label:>8}{r['round_seconds']:>9.2f}{r['prefill_seconds']:>8.2f}"
                  f"{r['round_seconds'] - r['prefill_seconds']:>8.2f}{r['reply_decode_seconds']:>16.2f}"
                  f"{r['cached_tokens']:>8}{r['completion_tokens']:>8}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
