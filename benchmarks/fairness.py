"""Fairness under a large round: how long a plain 8-token chat takes while a big `/v1/rounds`
runs on the same server, and how quickly an abandoned round lets go of the engine.

Starts `tokendance serve` on a free port of 127.0.0.1 (the model loads once), then:
1. idle: the 8-token chat's latency with nothing else running (median of 3);
2. busy: a round of `--agents` agents (a private persona, shared town news in a per-agent order,
   a question; greedy, `--round-tokens` tokens each) is sent, and from `--delay` seconds in, one
   chat at a time until the round answers: each chat's latency;
3. abandoned: the same round again, its client gone after `--delay` seconds: how long until the
   engine holds no request of it.

    python benchmarks/fairness.py --agents 300
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

NEWS = [
    "Ada says: the bridge over the river is closed for repairs until the end of next week.",
    "Bo says: the market opens at nine tomorrow and the bakery will sell fresh rye bread.",
    "Cy says: the library will host a reading night on Friday with tea and cake for everyone.",
    "Di says: a storm is coming tonight, so bring the chairs in from the square before dark.",
    "Ed says: the school play needs two more actors and someone who can paint the scenery.",
    "Fay says: the mayor will speak at the town hall on Sunday about the new bus line.",
]
PETS = ["goats", "bees", "hens", "cows", "cats", "ducks"]


class Server:
    def __init__(self, args: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.TemporaryFile()
        command = [sys.executable, "-m", "tokendance.cli", "serve", "--port", str(self.port), *args]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise SystemExit(f"the server did not start:\n{self.log.read().decode()[-3000:]}")
            time.sleep(0.3)
        self.model = json.loads(self.request("GET", "/v1/models")[1])["data"][0]["id"]

    def request(self, method: str, path: str, body=None, timeout: float = 3600) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body=None if body is None else json.dumps(body),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def gauge(self, name: str) -> float:
        text = self.request("GET", "/metrics")[1].decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def agent(i: int) -> dict:
    news = list(NEWS)
    random.Random(i).shuffle(news)
    persona = f"You are villager {i}, who keeps {PETS[i % len(PETS)]} and likes to talk about the weather."
    messages = [{"role": "system", "content": persona}, *({"role": "user", "content": n} for n in news),
                {"role": "user", "content": f"Villager {i}, what do you do next? Answer in one sentence."}]
    return {"agent_id": f"villager-{i}", "messages": messages}


def chat(server: Server) -> float:
    started = time.perf_counter()
    status, body = server.request("POST", "/v1/chat/completions", {
        "model": server.model, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Name three colours."}]})
    assert status == 200, body[:300]
    return time.perf_counter() - started


def round_body(server: Server, num_agents: int, max_tokens: int, salt: str) -> dict:
    return {"model": server.model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt, "agents": [agent(i) for i in range(num_agents)]}


def busy(server: Server, args) -> None:
    result = {}

    def run_round():
        started = time.perf_counter()
        status, body = server.request("POST", "/v1/rounds", round_body(server, args.agents, args.round_tokens, "busy"))
        result["seconds"], result["status"] = time.perf_counter() - started, status
        result["error"] = None if status == 200 else body[:300]

    thread = threading.Thread(target=run_round)
    started = time.perf_counter()
    thread.start()
    time.sleep(args.delay)
    latencies = []
    while thread.is_alive():
        sent = time.perf_counter() - started
        latency = chat(server)
        latencies.append(latency)
        print(f"  chat sent at {sent:5.1f} s into the round: {latency:6.2f} s", flush=True)
    thread.join()
    if result["status"] != 200:
        raise SystemExit(f"the round failed: {result['status']} {result['error']}")
    print(f"round of {args.agents} agents: {result['seconds']:.1f} s; chats during it: {len(latencies)}, "
          f"median {statistics.median(latencies):.2f} s, max {max(latencies):.2f} s")


def abandoned(server: Server, args) -> None:
    before = server.gauge("tokendance_rounds_aborted_total")
    try:
        server.request("POST", "/v1/rounds", round_body(server, args.agents, args.round_tokens, "gone"),
                       timeout=args.delay)
    except (TimeoutError, socket.timeout):
        pass
    latency = chat(server)
    stopped = server.gauge("tokendance_rounds_aborted_total") > before
    print(f"abandoned round (client gone after {args.delay:.0f} s): a chat sent then took {latency:.2f} s; "
          f"the round {'stopped in its prefill' if stopped else 'was not stopped in its prefill'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=300)
    parser.add_argument("--round-tokens", type=int, default=32)
    parser.add_argument("--delay", type=float, default=3.0, help="seconds into the round the first chat is sent")
    parser.add_argument("--serve-args", default="",
                        help="extra arguments for tokendance serve")
    args = parser.parse_args()
    server = Server(args.serve_args.split())
    try:
        import torch

        print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
        chat(server)  # warm
        idle = statistics.median(chat(server) for _ in range(3))
        print(f"idle: 8-token chat {idle:.2f} s")
        busy(server, args)
        abandoned(server, args)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
