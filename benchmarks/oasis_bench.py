"""OASIS, unmodified, against plain vLLM, vLLM with the plugin's transparent rounds and `tokendance
serve`, one server after the other (a fresh one per agent count: a server's prefix cache would
carry over between runs with the same profiles), same model, dtype and KV memory:

    make oasis    # OASIS in an environment of its own (.venv-oasis)
    python benchmarks/oasis_bench.py --agents 16 32 --steps 3
    python benchmarks/oasis_bench.py --agents 16 --model qwen2.5-coder-0.5b   # a model pack

Each run is `benchmarks/oasis_run.py` inside .venv-oasis (OASIS's own agents, Reddit platform and
tool calls; the client declares no round). Prints per server, agent count and step: the wall
time, chat requests and those that failed, OASIS's agent errors (replies it could not act on), the
agents that acted, prompt and cached tokens and the rounds the server formed; then each step's time
against plain vLLM, and step 1's prompt tokens per request, which must agree within 10% across the
servers (exit status 1 otherwise: a server rendered the tools or messages differently). Writes
benchmarks/results/oasis.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.servers import serving  # noqa: E402

from tokendance.registry import DEFAULT_RECOMPUTE_RATIO  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OASIS_PYTHON = ROOT / ".venv-oasis" / "bin" / "python"
SERVERS = ("vllm", "vllm+transparent", "tokendance")
# vLLM reads calls out of replies only with these flags. The plugin's parser (every vLLM server here
# has it: vLLM loads all installed general plugins when VLLM_PLUGINS is unset) forces one-line calls
# and keeps a cut reply's complete calls; through vLLM's `hermes` the 135M model pretty-prints its
# forced calls until max_tokens, and a reply cut there yields no call at all.
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "tokendance_hermes"]


def wait_model(port: int, timeout: float = 600) -> None:
    """Until /v1/models answers (`tokendance serve` is healthy before its model has loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("the server's model did not load")


def run(name: str, agents: int, args) -> dict:
    with serving(name, args) as port:
        wait_model(port)
        out = Path(tempfile.mkdtemp()) / "oasis.json"
        print(f"{name}, {agents} agents:", flush=True)
        driver = subprocess.run([str(OASIS_PYTHON), str(ROOT / "benchmarks" / "oasis_run.py"), "--url",
                                 f"http://127.0.0.1:{port}/v1", "--agents", str(agents), "--steps", str(args.steps),
                                 "--seed", str(args.seed), "--max-tokens", str(args.max_tokens), "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=out.parent)  # OASIS writes its logs to ./log
        # OASIS logs every agent's prompt: print the driver's step lines, and the end of the log on failure
        print("\n".join(line for line in driver.stdout.splitlines() if line.startswith("step ")), flush=True)
        if driver.returncode != 0:
            raise SystemExit(f"OASIS failed against {name}:\n{driver.stdout[-3000:]}")
        return json.loads(out.read_text())


def table(results: dict) -> str:
    lines = [f"{'server':>17} {'N':>3} {'step':>4} {'seconds':>8} {'calls':>6} {'failed':>6} {'errors':>6} "
             f"{'acted':>6} {'prompt tok':>11} {'cached':>8} {'rounds':>7}  actions"]
    for name, by_n in results.items():
        for n, run in by_n.items():
            for s in run["steps"]:
                server = s["server"]
                rounds = sum(v for k, v in server.items() if k.startswith("rounds.") and not k.endswith((".single", ".api")))
                lines.append(f"{name:>17} {n:>3} {s['step']:>4} {s['seconds']:>8.2f} {s['llm_calls']:>6} "
                             f"{s['failed_calls']:>6} {s['agent_errors']:>6} {s['agents_acted']:>6} "
                             f"{int(server.get('prompt_tokens', 0)):>11} {int(server.get('cached_tokens', 0)):>8} "
                             f"{int(rounds):>7}  " + ", ".join(f"{k} {v}" for k, v in sorted(s["actions"].items())))
    if "vllm" in results:
        lines.append("step time, plain vLLM / server:")
        for name, by_n in results.items():
            for n, run in by_n.items():
                base = results["vllm"].get(n)
                if name == "vllm" or base is None:
                    continue
                ratios = [b["seconds"] / s["seconds"] for b, s in zip(base["steps"], run["steps"])]
                lines.append(f"{name:>17} {n:>3}  " + "  ".join(f"step {i + 1} {r:.2f}x" for i, r in enumerate(ratios)))
    return "\n".join(lines)


def prompt_lengths(results: dict) -> tuple[str, bool]:
    """Step 1's prompt tokens per chat request, per server and agent count (step 1 starts from the
    same feed for every server; later steps follow the agents' actions), and whether they agree
    within 10%: the servers render the same tools and messages into the same prompt."""
    lines, agree = ["step 1 prompt tokens per request:"], True
    for n in sorted({n for by_n in results.values() for n in by_n}, key=int):
        sizes = {name: by_n[n]["steps"][0]["server"].get("prompt_tokens", 0) / max(1, by_n[n]["steps"][0]["llm_calls"])
                 for name, by_n in results.items() if n in by_n and by_n[n]["steps"]}
        spread = (max(sizes.values()) / min(sizes.values()) - 1) if sizes and min(sizes.values()) > 0 else float("inf")
        agree = agree and spread <= 0.10
        lines.append(f"{'':>17} {n:>3}  " + "  ".join(f"{k} {v:,.0f}" for k, v in sizes.items())
                     + f"  (spread {spread:.0%}{'' if spread <= 0.10 else ': OVER 10%, the servers render different prompts'})")
    return "\n".join(lines), agree


def compare(a: dict, b: dict) -> str:
    """Per server, agent count and step of both: the agents that acted in each, and the share of
    agents whose actions (which tools, in order) were the same in both runs."""
    lines = [f"{'server':>17} {'N':>3} {'step':>4} {'acted A':>8} {'acted B':>8} {'same actions':>13}"]
    for name in a.keys() & b.keys():
        for n in a[name].keys() & b[name].keys():
            for x, y in zip(a[name][n]["steps"], b[name][n]["steps"]):
                agents = range(int(n))
                same = sum(x["agent_actions"].get(str(i), []) == y["agent_actions"].get(str(i), []) for i in agents)
                lines.append(f"{name:>17} {n:>3} {x['step']:>4} {x['agents_acted']:>8} {y['agents_acted']:>8} "
                             f"{same / int(n):>12.0%}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[16])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=128, help="each reply's max_completion_tokens")
    parser.add_argument("--dtype", default=None, help="bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--kv-gib", type=int, default=4, help="KV memory of every server (GiB)")
    parser.add_argument("--ratio", type=float, default=DEFAULT_RECOMPUTE_RATIO)
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    parser.add_argument("--model", default=None,
                        help="a model pack's name (tokendance models), served by every server (default: the default model)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/oasis[-<model>].json")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                        help="compare the agents' actions of two result files (each server and agent count "
                             "in both), step by step, and exit")
    args = parser.parse_args()
    if args.compare:
        print(compare(*(json.loads(Path(p).read_text())["results"] for p in args.compare)))
        return 0
    if not OASIS_PYTHON.exists():
        raise SystemExit("OASIS's environment is missing: run `make oasis` first")
    from tokendance.model.platform import probe_cpu

    cpu = probe_cpu()
    args.dtype = args.dtype or ("bfloat16" if cpu.native_bf16 else "float32")
    args.vllm_args = TOOL_ARGS
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"oasis{'-' + args.model if args.model else ''}.json")
    fresh = {name: {str(n): run(name, n, args) for n in args.agents} for name in args.servers}
    # servers and agent counts not run now keep their last measurement, for the table
    earlier = json.loads(out.read_text())["results"] if out.exists() else {}
    results = {name: {**earlier.get(name, {}), **fresh.get(name, {})} for name in SERVERS if name in earlier or name in fresh}
    print(f"\nOASIS (Reddit, {args.steps} steps), {args.model or 'the default model'}, {args.dtype}, {args.kv_gib} GiB KV, "
          f"CPU {cpu.capability} "
          f"(measured now: {', '.join(fresh)}; others: the last run's)")
    print(table(results))
    lengths, agree = prompt_lengths(results)
    print(lengths)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "kv_gib": args.kv_gib, "cpu": cpu.capability, "steps": args.steps,
                               "results": results}, indent=2))
    print(f"results in {out}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
