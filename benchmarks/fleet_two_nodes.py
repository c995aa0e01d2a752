"""One simulation served by replicas on two Ray nodes: a two-node Ray cluster on the loopback (Ray's
own `cluster_utils.Cluster`: a head node and a second node, each with one CPU and a raylet of its
own), `tokendance serve --engine vllm --replicas 2 --ray-address` joined to it, and a Generative
Agents simulation with declared rounds through the one endpoint, each round split in two groups
(`--max-round-agents` N/2), one per replica. Prints the node of each replica and the replicas of
each round:

    python benchmarks/fleet_two_nodes.py --agents 8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ray.cluster_utils import Cluster

from vllm_fleet import ROOT, VLLM_PYTHON, free_port, get, stop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    args = parser.parse_args()
    from tokendance.vllm_plugin.model_folder import default_model_folder

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    port, log = free_port(), tempfile.TemporaryFile()
    server = subprocess.Popen(
        [sys.executable, "-m", "tokendance.cli", "serve", "--engine", "vllm", "--replicas", "2", "--num-threads", "1",
         "--ray-address", cluster.address, "--port", str(port), "--model",
         str(default_model_folder(ROOT / ".venv-vllm" / "smollm2-hf")), "--served-model-name", "smollm2",
         "--vllm-python", args.vllm_python, "--vllm-arg=--enforce-eager", "--kv-cache-bytes", str(2**30),
         "--max-round-agents", str(max(1, args.agents // 2))],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                replicas = get(port, "/v1/replicas")["data"]
                if len(replicas) == 2:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise SystemExit(f"the fleet did not start:\n{log.read().decode(errors='replace')[-3000:]}")
            time.sleep(2)
        nodes = {r["replica"]: r["node"] for r in replicas}
        for replica, node in nodes.items():
            print(f"replica {replica} on node {node[:12]}")
        print(f"{len(set(nodes.values()))} nodes serve {len(nodes)} replicas", flush=True)
        out = Path(tempfile.mkdtemp()) / "sim.json"
        subprocess.run([sys.executable, "-m", "tokendance.cli", "bench", "--target", f"http://127.0.0.1:{port}/v1",
                        "--workload", "generative-agents", "--agents", str(args.agents), "--rounds", str(args.rounds),
                        "--declare-rounds", "--cache-salt", "two-nodes", "--out", str(out)], check=True,
                       stdout=subprocess.DEVNULL)
        for r in json.loads(out.read_text())["rounds"]:
            print(f"round {r['round']}: {r['round_seconds']:.1f} s, cached {r['cached_tokens']} of {r['prompt_tokens']} "
                  f"prompt tokens, replicas {r['replicas']} on nodes {sorted({nodes[x][:12] for x in r['replicas']})}")
    finally:
        stop(server)
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
