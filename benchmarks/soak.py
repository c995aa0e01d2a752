"""Soak: a bounded mix of valid, invalid and abandoned requests from many clients against one
`tokendance serve`, then what is left behind.

Starts `tokendance serve` on a free port of 127.0.0.1 and sends `--requests` requests from
`--clients` concurrent clients: plain and streamed chats, completions with n=2, structured output
(guided_choice, JSON schema), tools, n=3 chats, declared rounds of 4 agents, small `/v1/rounds`, and
invalid bodies (bad constraints, wrong types, malformed tool calls); about `--leave` of them are
sent on a raw socket that closes before the answer (at a random moment). Reports the status counts
per kind (5xx should be 0), latency p50/p95 of answered requests, whether the engine stayed alive,
the KV blocks still held once idle (should equal the idle level before) and the server's RSS.

    python benchmarks/soak.py --requests 1000 --clients 64
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import socket
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fairness import Server, agent  # noqa: E402

KINDS = ["chat", "stream", "completions_n2", "choice", "schema", "tools", "chat_n3", "declared", "rounds", "invalid"]
INVALID = [
    {"guided_regex": "[^\\s\\S]"}, {"guided_grammar": "start: start"}, {"guided_json": {"$ref": "#"}},
    {"temperature": "hot"}, {"max_tokens": -1}, {"top_p": 0},
    {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": "x"}]}]},
    {"tools": [{"type": "function", "function": {"name": "t"}}], "tool_choice": {"type": "function", "function": "t"}},
]


def body_for(kind: str, i: int, model: str, round_ids: dict) -> tuple[str, dict]:
    user = [{"role": "user", "content": f"Say something short about the number {i}."}]
    base = {"model": model, "messages": user, "max_tokens": 8, "temperature": 0.7, "seed": i}
    if kind == "chat":
        return "/v1/chat/completions", base
    if kind == "stream":
        return "/v1/chat/completions", {**base, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "completions_n2":
        return "/v1/completions", {"model": model, "prompt": f"Item {i}:", "max_tokens": 8, "n": 2, "temperature": 0.8}
    if kind == "choice":
        return "/v1/chat/completions", {**base, "guided_choice": ["yes", "no", "maybe"]}
    if kind == "schema":
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        return "/v1/chat/completions", {**base, "max_tokens": 16,
                                        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    if kind == "tools":
        tool = {"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        return "/v1/chat/completions", {**base, "max_tokens": 24, "tools": [tool],
                                        "tool_choice": random.Random(i).choice(["auto", "required"])}
    if kind == "chat_n3":
        return "/v1/chat/completions", {**base, "n": 3}
    if kind == "declared":  # every 4 consecutive declared turns share a round
        group = i // (4 * len(KINDS))
        round_id = round_ids.setdefault(group, uuid.uuid4().hex)
        return "/v1/chat/completions", {**base, **agent(i), "round_id": round_id, "round_size": 4, "max_tokens": 8}
    if kind == "rounds":
        return "/v1/rounds", {"model": model, "max_tokens": 6, "cache_salt": uuid.uuid4().hex,
                              "agents": [agent(i * 10 + j) for j in range(3)]}
    return "/v1/chat/completions", {**base, **INVALID[i % len(INVALID)]}


def send(server: Server, path: str, body: dict, leave_after: float | None) -> tuple[int | str, float]:
    """(status, seconds); a leaving client closes its socket unanswered and reports 'left'."""
    data = json.dumps(body).encode()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", server.port), timeout=600) as raw:
        raw.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        if leave_after is not None:
            time.sleep(leave_after)
            return "left", time.perf_counter() - started
        response = b""
        while chunk := raw.recv(65536):
            response += chunk
    status = int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else "no answer"
    return status, time.perf_counter() - started


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--leave", type=float, default=0.2, help="share of clients that leave before the answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    args = parser.parse_args()
    server = Server(["--gather-window-ms", "50"])
    try:
        idle_blocks, rss_before = server.gauge("tokendance_kv_blocks_used"), rss_mb(server.process.pid)
        rng, round_ids = random.Random(args.seed), {}
        plan = []
        for i in range(args.requests):
            kind = KINDS[i % len(KINDS)]
            path, body = body_for(kind, i, server.model, round_ids)
            leave = rng.uniform(0.01, 3.0) if kind != "declared" and rng.random() < args.leave else None
            plan.append((kind, path, body, leave))
        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        latencies = collections.defaultdict(list)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = pool.map(lambda p: (p[0], *send(server, p[1], p[2], p[3])), plan)
            for kind, status, seconds in results:
                counts[kind][str(status)] += 1
                if isinstance(status, int) and status < 500:
                    latencies[kind].append(seconds)
        wall = time.perf_counter() - started
        alive = server.request("GET", "/health", timeout=30)[0] == 200
        deadline = time.monotonic() + 120
        while server.gauge("tokendance_requests_in_flight") or server.gauge("tokendance_engine_running_requests"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        sessions = server.gauge("tokendance_agent_sessions")
        for kind, _, body, _ in plan:  # agents of rounds keep their sessions: end them
            if kind == "declared":
                server.request("DELETE", f"/v1/agents/{body['agent_id']}", timeout=30)
            elif kind == "rounds":
                for a in body["agents"]:
                    server.request("DELETE", f"/v1/agents/{a['agent_id']}?cache_salt={body['cache_salt']}", timeout=30)
        held = server.gauge("tokendance_kv_blocks_used") - idle_blocks
        rss_after = rss_mb(server.process.pid)
    finally:
        server.stop()
    print(f"{args.requests} requests from {args.clients} clients ({args.leave:.0%} leave) in {wall:.1f} s; "
          f"engine alive after: {alive}")
    print(f"{'kind':<16}{'statuses':<44}{'p50 s':>7}{'p95 s':>7}")
    for kind in KINDS:
        lat = sorted(latencies[kind])
        p50 = statistics.median(lat) if lat else float("nan")
        p95 = lat[int(0.95 * (len(lat) - 1))] if lat else float("nan")
        statuses = " ".join(f"{s}:{n}" for s, n in sorted(counts[kind].items()))
        print(f"{kind:<16}{statuses:<44}{p50:>7.2f}{p95:>7.2f}")
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    server_errors = sum(n for s, n in total.items() if s.isdigit() and int(s) >= 500)
    print(f"5xx: {server_errors}; KV blocks held once idle beyond the idle level: {held:.0f} "
          f"(after ending the {sessions:.0f} agent sessions kept); RSS {rss_before:.0f} -> {rss_after:.0f} MB "
          f"(the KV pool's pages count once written)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "wall_seconds": wall, "alive": alive, "statuses": counts,
                               "server_errors": server_errors, "held_blocks": held, "sessions": sessions,
                               "rss_mb": [rss_before, rss_after]}, indent=2))
    return 0 if alive and server_errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
