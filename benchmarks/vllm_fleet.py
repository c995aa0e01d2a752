"""A fleet of vLLM + TokenDance replicas on Ray Serve (`tokendance serve --engine vllm`), routed
three ways over the same replicas, and one replica alone, on the same workloads.

For each setup it starts a fresh fleet (`--replicas`, one core each; the single replica gets every
core), runs each workload as one `tokendance bench --target` simulation (open loop: the same
prompts for every setup) with rounds declared, then (`--transparent-setups`, `--transparent-workloads`) undeclared
(transparent rounds: the endpoint gathers requests that share text), each simulation under a
cache salt of its own, and reads the
fleet's merged /metrics around each. The single replica has the fleet's KV memory in all. Per setup and simulation it reports the share of prompt
tokens served from cache (prefix hits and the connector's reuse), the prompt tokens computed,
the round time, how many rounds one replica served whole, and the tokens restored from the
session stores:

    python benchmarks/vllm_fleet.py --agents 32 --rounds 3

Setups: `tokendance` (the round-aware router), `split` (the same, each round split in one group
per replica: `--max-round-agents` N / replicas), `prefix` (Ray Serve's PrefixCacheAffinityRouter),
`pow2` (Ray Serve's default), `single` (one replica, the round-aware router).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.servers import ROOT, VLLM_PYTHON, free_port, replicas_up, wait_ready  # noqa: E402

SETUPS = ("tokendance", "split", "prefix", "pow2", "single")
COUNTERS = ("vllm:tokendance_restored_tokens_total", "vllm:tokendance_reused_tokens_total")


def get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as response:
        body = response.read()
    return json.loads(body) if path.startswith("/v1") else body.decode()


def counters(port: int) -> dict[str, float]:
    """The connector's counters summed over the fleet's replicas."""
    found = dict.fromkeys(COUNTERS, 0.0)
    for line in get(port, "/metrics").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
    return found


def start(setup: str, port: int, args, log, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """A fleet of `setup` (SETUPS) serving on `port`; `extra`: more arguments of `tokendance serve`."""
    from tokendance.vllm_plugin.model_folder import default_model_folder

    # one replica: every core and the fleet's KV in all
    replicas, threads = (1, os.cpu_count()) if setup == "single" else (args.replicas, 1)
    kv = args.kv_gib * (args.replicas if setup == "single" else 1)
    command = [sys.executable, "-m", "tokendance.cli", "serve", "--engine", "vllm", "--port", str(port),
               "--replicas", str(replicas), "--num-threads", str(threads),
               "--router", setup if setup in ("prefix", "pow2") else "tokendance",
               "--model", str(default_model_folder(ROOT / ".venv-vllm" / "smollm2-hf")), "--served-model-name", "smollm2",
               "--vllm-python", str(args.vllm_python), "--dtype", args.dtype, "--kv-cache-bytes", str(int(kv * 2**30)),
               "--store-gib", str(args.store_gib), "--max-model-len", "8192", "--vllm-arg=--enforce-eager",
               "--gather-window-ms", str(args.gather_ms)]
    if setup == "split":  # each round in one group per replica: the whole fleet works on it
        command += ["--max-round-agents", str(-(-args.agents // args.replicas))]
    return subprocess.Popen(command + list(extra), stdout=log, stderr=subprocess.STDOUT)


def simulate(port: int, workload: str, declared: bool, args, out: Path) -> dict:
    salt = f"{workload}-{'declared' if declared else 'transparent'}"
    before = counters(port)
    command = [sys.executable, "-m", "tokendance.cli", "bench", "--target", f"http://127.0.0.1:{port}/v1",
               "--workload", workload, "--agents", str(args.agents), "--rounds", str(args.rounds),
               "--loop", "open", "--cache-salt", salt, "--out", str(out)]
    subprocess.run(command + ["--declare-rounds"] * declared, check=True, stdout=subprocess.DEVNULL)
    after = counters(port)
    rounds = json.loads(out.read_text())["rounds"]
    prompt, cached = sum(r["prompt_tokens"] for r in rounds), sum(r["cached_tokens"] for r in rounds)
    return {"workload": workload, "declared": declared, "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached, "cached_share": cached / prompt,
            "round_seconds": [r["round_seconds"] for r in rounds],
            "whole_rounds": sum(len(r["replicas"]) == 1 for r in rounds), "rounds": len(rounds),
            "replicas_per_round": [len(r["replicas"]) for r in rounds],
            "restored_tokens": after[COUNTERS[0]] - before[COUNTERS[0]],
            "reused_tokens": after[COUNTERS[1]] - before[COUNTERS[1]]}


def run_setup(setup: str, args, out: Path) -> list[dict]:
    port = free_port()
    with tempfile.TemporaryFile() as log:
        server = start(setup, port, args, log)
        try:
            ready = wait_ready(port, server, log, replicas_up(1 if setup == "single" else args.replicas), timeout_s=1200)
            print(f"{setup}: ready after {ready:.0f} s", flush=True)
            results = []
            for workload in args.workloads:
                undeclared = setup in args.transparent_setups and workload in args.transparent_workloads
                for declared in (True, False)[:1 + undeclared]:
                    result = simulate(port, workload, declared, args, out / f"{setup}-{workload}-{declared}.json")
                    results.append({"setup": setup, **result})
                    print(row(results[-1]), flush=True)
            return results
        finally:
            stop(server)


def stop(server: subprocess.Popen) -> None:
    """The fleet's server, and with it its Ray instance and replicas (SIGTERM; SIGKILL after 2 min)."""
    server.terminate()
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()


def row(r: dict) -> str:
    rounds = " ".join(f"{s:.1f}" for s in r["round_seconds"])
    return (f"{r['setup']:<11}{r['workload']:<18}{'declared' if r['declared'] else 'transparent':<12}"
            f"{r['cached_share']:>7.1%}{r['computed_tokens']:>10}{r['whole_rounds']:>4}/{r['rounds']:<3}"
            f"{r['restored_tokens']:>9.0f}   {rounds}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    parser.add_argument("--workloads", nargs="+", default=["generative-agents", "agent-society"])
    parser.add_argument("--transparent-setups", nargs="*", default=["tokendance", "pow2"], choices=SETUPS,
                        help="setups that also run a workload undeclared (transparent rounds)")
    parser.add_argument("--transparent-workloads", nargs="*", default=["generative-agents"],
                        help="workloads also run undeclared in those setups")
    parser.add_argument("--dtype", default="auto", help="the replicas' dtype (auto: bfloat16 where native)")
    parser.add_argument("--kv-gib", type=float, default=1.0, help="each replica's KV pool")
    parser.add_argument("--store-gib", type=float, default=0.5, help="each replica's session store")
    parser.add_argument("--gather-ms", type=float, default=50.0, help="the transparent rounds' gather window")
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    parser.add_argument("--out", default=None, help="write every result here (JSON)")
    args = parser.parse_args()
    from tokendance.model.platform import probe_cpu

    print(f"CPU capability: {probe_cpu().capability}; {args.replicas} replicas x 1 core vs 1 replica x "
          f"{os.cpu_count()} cores; N={args.agents}, {args.rounds} rounds, open loop", flush=True)
    print(f"{'setup':<11}{'workload':<18}{'rounds':<12}{'cached':>7}{'computed':>10}{'whole':>8}{'restored':>9}   "
          f"round seconds", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for setup in args.setups:
            results += run_setup(setup, args, Path(scratch))
            if args.out:  # after each setup: a long run stopped midway keeps what it measured
                Path(args.out).write_text(json.dumps(results, indent=1))
    print("\ncomputed tokens against Ray Serve's default router (pow2), and cached share against one replica:")
    for r in results:
        base = next((b for b in results if b["setup"] == "pow2" and b["workload"] == r["workload"]
                     and b["declared"] == r["declared"]), None)
        single = next((b for b in results if b["setup"] == "single" and b["workload"] == r["workload"]
                       and b["declared"] == r["declared"]), None)
        fewer = f"{base['computed_tokens'] / r['computed_tokens']:.2f}x fewer" if base else "-"
        gap = f"{100 * (r['cached_share'] - single['cached_share']):+.1f} points" if single else "-"
        print(f"  {r['setup']:<11}{r['workload']:<18}{'declared' if r['declared'] else 'transparent':<12}"
              f"{fewer:>14}{gap:>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
