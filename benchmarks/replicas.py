"""Two simulations at once through one engine vs two replicas on Ray Serve, on this machine.

For each setup, starts the server on a free port of 127.0.0.1, runs two `tokendance bench
--target` clients at the same time (generative-agents, declared rounds, each simulation its own
seed and cache_salt), and reports per simulation and round the latency, the tokens generated per
second over both, the cached prompt tokens, and which replicas served each round:

    python benchmarks/replicas.py --agents 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.servers import free_port, replicas_up, wait_ready  # noqa: E402

SETUPS = {
    "1 engine (2 threads)": ["--num-threads", "2", "--reuse", "tokendance"],
    "2 replicas (1 thread each)": ["--replicas", "2", "--num-threads", "1", "--reuse", "tokendance"],
}


def run_setup(name: str, extra: list[str], args, out: Path) -> dict:
    port = free_port()
    log = tempfile.TemporaryFile()
    server = subprocess.Popen([sys.executable, "-m", "tokendance.cli", "serve", "--port", str(port), *extra],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(port, server, log, replicas_up(2 if "--replicas" in extra else 1), timeout_s=600)
        started = time.perf_counter()
        clients = [subprocess.Popen([sys.executable, "-m", "tokendance.cli", "bench", "--target",
                                     f"http://127.0.0.1:{port}/v1", "--workload", "generative-agents",
                                     "--agents", str(args.agents), "--rounds", str(args.rounds), "--declare-rounds",
                                     "--seed", str(sim), "--cache-salt", f"sim{sim}",
                                     "--out", str(out / f"{name[:1]}-sim{sim}.json")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for sim in (0, 1)]
        if any(client.wait() != 0 for client in clients):
            raise SystemExit(f"{name}: a client failed")
        wall = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(60)
    sims = [json.loads((out / f"{name[:1]}-sim{sim}.json").read_text())["rounds"] for sim in (0, 1)]
    tokens = sum(r["completion_tokens"] for rounds in sims for r in rounds)
    return {"name": name, "wall": wall, "tokens_per_s": tokens / wall, "sims": sims}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    out = Path(tempfile.mkdtemp())
    results = [run_setup(name, extra, args, out) for name, extra in SETUPS.items()]
    print(f"generative-agents, 2 simulations x {args.agents} agents x {args.rounds} rounds at once; "
          f"CPU {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} cores")
    for result in results:
        print(f"\n{result['name']}: {result['wall']:.1f} s for both, {result['tokens_per_s']:.1f} generated tokens/s")
        print(f"{'sim':>4} {'rd':>3} {'round s':>8} {'TTFT s':>7} {'prompt':>7} {'cached':>7}  replicas")
        for sim, rounds in enumerate(result["sims"]):
            for r in rounds:
                print(f"{sim:>4} {r['round']:>3} {r['round_seconds']:>8.2f} {r['prefill_seconds']:>7.2f} "
                      f"{r['prompt_tokens']:>7} {r['cached_tokens']:>7}  {','.join(r.get('replicas', [])) or '-'}")
    one, two = results
    print(f"\n2 replicas vs 1 engine: {two['tokens_per_s'] / one['tokens_per_s']:.2f}x tokens/s, "
          f"{one['wall'] / two['wall']:.2f}x wall time")


if __name__ == "__main__":
    main()
