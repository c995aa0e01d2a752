"""Reliability probe against any OpenAI-compatible server, in waves: the hostile corpus (with the
round protocol's own bad fields), clients that leave at every stage, concurrent rounds whose
tenants, agents and round ids cross, and a soak with disconnects. After each wave: whether the
server still answers a plain chat within 2 s, and whether what it holds is back to idle (from its
`/metrics`: `tokendance serve`'s KV blocks, or vLLM's running requests and KV usage).

    python benchmarks/probe.py                                # tokendance serve, started here
    python benchmarks/probe.py --servers vllm+tokendance vllm # vllm serve with and without the plugin
    python benchmarks/probe.py --target http://127.0.0.1:8000 # a server already running
    python benchmarks/probe.py --servers vllm-fleet           # two vLLM + plugin replicas on Ray Serve
    python benchmarks/probe.py --servers vllm+tokendance --faults 0.05  # every stage of the plugin failing at 5%

Servers are started one after the other (never two at once) with 1 GiB of KV; vLLM's need
.venv-vllm (`make vllm`). `vllm-fleet` is `tokendance serve --engine vllm --replicas 2` (one core,
1 GiB of KV and the store each, the round-aware router, transparent rounds with a 50 ms window). Bounded: `--soak` requests (1,000 by default, `--leave` of them from
clients that leave), `--timeout` seconds per request (an unanswered request counts as a hang).
Writes benchmarks/results/probe-<server>.json; exits 1 on any 5xx, hang, slow health check or
state left behind.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import random
import re
import socket
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import vllm_fleet  # noqa: E402
from benchmarks.fairness import agent  # noqa: E402
from benchmarks.servers import free_port, replicas_up, start, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "hostile_requests.json"
HEALTHY_S = 2.0  # a plain chat after each wave answers within this
SOAK_KINDS = ["chat", "stream", "completions_n2", "choice", "schema", "tools", "chat_n3", "declared", "rounds", "invalid"]
INVALID = [
    {"guided_regex": "[^\\s\\S]"}, {"guided_grammar": "start: start"}, {"guided_json": {"$ref": "#"}},
    {"temperature": "hot"}, {"max_tokens": -1}, {"top_p": 0},
    {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": "x"}]}]},
    {"tools": [{"type": "function", "function": {"name": "t"}}], "tool_choice": {"type": "function", "function": "t"}},
]


class Target:
    """One server on 127.0.0.1: requests with a deadline, requests whose client leaves, /metrics."""

    def __init__(self, url: str, timeout: float):
        parts = urlsplit(url)
        self.host, self.port, self.timeout = parts.hostname or "127.0.0.1", parts.port or 80, timeout
        self.model = json.loads(self.request("GET", "/v1/models")[1])["data"][0]["id"]
        names = self.metrics()
        self.kind = "tokendance" if "tokendance_kv_blocks_used" in names else "vllm"

    def request(self, method: str, path: str, data: bytes | None = None, timeout: float | None = None) -> tuple:
        """(status, body); status "hang" when nothing came back within the timeout."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        try:
            connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        except (TimeoutError, socket.timeout):
            return "hang", b""
        except (ConnectionError, http.client.HTTPException) as exc:
            return f"closed ({type(exc).__name__})", b""
        finally:
            connection.close()

    def post(self, path: str, body: dict, timeout: float | None = None) -> tuple:
        return self.request("POST", path, json.dumps(body).encode(), timeout)

    def leave(self, path: str, data: bytes, stage: str, after: float) -> str:
        """Send a request and close the connection unanswered: `upload` halfway through the body,
        `waiting` `after` seconds once it is sent, `streaming` after the first streamed event."""
        try:
            return self._leave(path, data, stage, after)
        except OSError as exc:
            return f"closed ({type(exc).__name__})"

    def _leave(self, path: str, data: bytes, stage: str, after: float) -> str:
        with socket.create_connection((self.host, self.port), timeout=self.timeout) as raw:
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
            if stage == "upload":
                raw.sendall(head + data[:len(data) // 2])
                time.sleep(after)
                return "left"
            raw.sendall(head + data)
            if stage == "streaming":
                seen = b""
                while b"data:" not in seen:
                    chunk = raw.recv(4096)
                    if not chunk:
                        return "answered before leaving"
                    seen += chunk
            else:
                time.sleep(after)
        return "left"

    def samples(self) -> list[tuple[str, str, float]]:
        """/metrics as (name, labels, value) samples."""
        status, body = self.request("GET", "/metrics", timeout=30)
        lines = body.decode(errors="replace").splitlines() if status == 200 else []
        return [(m.group(1), m.group(2) or "", float(m.group(3)))
                for m in map(re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$").match, lines) if m]

    def metrics(self) -> dict[str, float]:
        """{name: value} summed over labels."""
        found: dict[str, float] = collections.defaultdict(float)
        for name, _, value in self.samples():
            found[name] += value
        return found

    def busy(self) -> float:
        """Requests the engine holds now."""
        m = self.metrics()
        if self.kind == "tokendance":
            return m["tokendance_requests_in_flight"] + m["tokendance_engine_running_requests"]
        return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]

    def held(self) -> dict[str, float]:
        """What the server holds once idle: KV blocks (tokendance serve) or KV usage (vLLM, where a
        free block the prefix cache keeps counts as free), sessions and the session store."""
        m = self.metrics()
        if self.kind == "tokendance":
            return {"kv_blocks_used": m["tokendance_kv_blocks_used"], "agent_sessions": m["tokendance_agent_sessions"]}
        return {"kv_usage": m["vllm:kv_cache_usage_perc"], "store_agents": m.get("vllm:tokendance_store_agents", 0.0),
                "store_saving": m.get("vllm:tokendance_store_saving", 0.0)}

    def planted(self) -> dict[str, float]:
        """The plugin's planted faults so far, by stage (`--faults`)."""
        found: dict[str, float] = collections.defaultdict(float)
        for name, labels, value in self.samples():
            stage = re.search(r'stage="(\w+)"', labels)
            if name == "vllm:tokendance_faults_planted_total" and stage:
                found[stage.group(1)] += value
        return dict(found)


def chat(target: Target, text: str, **fields) -> dict:
    return {"model": target.model, "messages": [{"role": "user", "content": text}], "max_tokens": 8, **fields}


# ---------------------------------------------------------------- wave 1: the hostile corpus


def round_cases(model: str) -> list[dict]:
    """Bad round fields and round shapes: each refused with a 400 naming its field by both
    TokenDance front doors (plain vLLM ignores the fields it does not know)."""
    hi = [{"role": "user", "content": "hi"}]
    one = {"agent_id": "a", "messages": hi}
    cases = []

    def case(path, body, param):
        # a tag written by the client is vLLM's field: tokendance serve does not read it
        only = "vllm+tokendance" if "kv_transfer_params" in body else None
        cases.append({"path": path, "json": {"model": model, "max_tokens": 2, **body}, "status": 400, "param": param,
                      "only": only})

    for fields, param in [
        ({"agent_id": 5}, "agent_id"), ({"agent_id": ""}, "agent_id"), ({"agent_id": "x" * 300}, "agent_id"),
        ({"agent_id": "a", "round_id": 7}, "round_id"),
        ({"agent_id": "a", "round_size": 4}, "round_size"),
        ({"agent_id": "a", "round_id": "r", "round_size": 0}, "round_size"),
        ({"agent_id": "a", "round_id": "r", "round_size": True}, "round_size"),
        ({"agent_id": "a", "round_id": "r", "round_size": 10**9}, "round_size"),
        ({"agent_id": "a", "round_id": "r", "round_size": "4"}, "round_size"),
        ({"agent_id": "a", "cache_salt": "s" * 2000}, "cache_salt"), ({"agent_id": "a", "cache_salt": 3}, "cache_salt"),
        ({"agent_id": "a", "round_id": "r", "kv_transfer_params": "x"}, "kv_transfer_params"),
    ]:
        case("/v1/chat/completions", {"messages": hi, **fields}, param)
    tag = {"round_id": "r", "agent_id": "a", "round_size": 2}
    for params, extra, param in [
        ({"tokendance": "x"}, {"cache_salt": "s"}, "kv_transfer_params.tokendance"),
        ({"tokendance": {"round_id": "r"}}, {"cache_salt": "s"}, "kv_transfer_params.tokendance"),
        ({"tokendance": {**tag, "recompute_ratio": 2}}, {"cache_salt": "s"}, "kv_transfer_params.tokendance"),
        ({"tokendance": {**tag, "who": 1}}, {"cache_salt": "s"}, "kv_transfer_params.tokendance"),
        ({"tokendance": tag}, {}, "cache_salt"),
        ({"tokendance": tag}, {"cache_salt": "s", "agent_id": "a", "round_id": "r"}, "kv_transfer_params.tokendance"),
    ]:
        case("/v1/chat/completions", {"messages": hi, "kv_transfer_params": params, **extra}, param)
    case("/v1/completions", {"prompt": "hi", "agent_id": 5}, "agent_id")
    for body, param in [
        ({"agents": "a"}, "agents"), ({"agents": []}, "agents"), ({"agents": [one] * 4097}, "agents"),
        ({"agents": [one, one]}, "agents"), ({"agents": [{"agent_id": "a"}]}, "agents.0.messages"),
        ({"agents": [one, {"agent_id": "b", "messages": []}]}, "agents.1.messages"),
        ({"agents": [{**one, "n": 2}]}, "agents.0.n"), ({"agents": [one], "stream": True}, "stream"),
        ({"agents": [{**one, "model": "other"}]}, "agents.0.model"),
        ({"agents": [{**one, "agent_id": 3}]}, "agents.0.agent_id"),
        ({"agents": [one], "cache_salt": ""}, "cache_salt"), ({"agents": [one], "round_id": "r"}, "round_id"),
        ({"agents": [{**one, "round_size": 2}]}, "agents.0.round_size"),
    ]:
        case("/v1/rounds", body, param)
    return cases


def corpus_wave(target: Target, args) -> dict:
    """Every case once, in order: its status (and field, where the case names one)."""
    cases = json.loads(CORPUS.read_text()) + round_cases(target.model)
    statuses, unexpected = collections.Counter(), []
    for case in cases:
        if "json" in case:
            body = case["json"]
            if isinstance(body, dict) and not {"max_tokens", "max_completion_tokens", "max_output_tokens"} & set(body):
                body = {**body, "max_tokens": 16}  # vLLM would run an accepted case to the context's end
            data = json.dumps(body).replace('"MODEL"', json.dumps(target.model)).encode()
        elif "raw_hex" in case:
            data = bytes.fromhex(case["raw_hex"])
        else:
            data = case["raw"].replace("MODEL", target.model).encode()
        status, body = target.request("POST", case["path"], data)
        statuses[str(status)] += 1
        param = error_param(body)
        if case.get("only") and target.kind == "tokendance" and status == 200:
            continue  # tokendance serve does not read vLLM's own kv_transfer_params
        if status != case["status"] or ("param" in case and param != case["param"]):
            unexpected.append({"path": case["path"], "request": data[:1000].decode(errors="replace"),
                               "expected": [case["status"], case.get("param")],
                               "got": [status, param], "body": body[:200].decode(errors="replace")})
    return {"cases": len(cases), "statuses": statuses, "unexpected": unexpected, "cut_tool_call": cut_call(target),
            "sessions": [("a", "s"), ("a", None)]}


def cut_call(target: Target) -> dict:
    """A forced tool call cut by max_tokens, answered whole and streamed: (content, calls, finish
    reason) of each, the stream's deltas added up as a client does."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    body = chat(target, "Look up the weather in Paris.", tools=[tool], tool_choice="required", max_tokens=24,
                temperature=0)
    status, data = target.post("/v1/chat/completions", body)
    if status != 200:
        return {"whole": [status, data[:200].decode(errors="replace")]}
    choice = json.loads(data)["choices"][0]
    whole = [choice["message"].get("content") or "", [[c["function"]["name"], c["function"]["arguments"]]
             for c in choice["message"].get("tool_calls") or []], choice["finish_reason"]]
    status, data = target.post("/v1/chat/completions", {**body, "stream": True})
    content, calls, finish = "", {}, None
    for line in data.decode(errors="replace").splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:]).get("choices") or []:
            content += c["delta"].get("content") or ""
            for call in c["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call.get("index", 0), ["", ""])
                entry[0] += (call.get("function") or {}).get("name") or ""
                entry[1] += (call.get("function") or {}).get("arguments") or ""
            finish = c.get("finish_reason") or finish
    streamed = [content, [calls[i] for i in sorted(calls)], finish]
    return {"whole": whole, "streamed": streamed, "alike": whole == streamed}


def error_param(body: bytes):
    try:
        error = json.loads(body).get("error")
        return error.get("param") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        return None


# ---------------------------------------------------------------- wave 2: clients that leave


def leave_wave(target: Target, args) -> dict:
    """Clients leaving at every stage, for every kind of request (a declared round's members among
    them: those who stay are still answered); then how long the agents of an abandoned
    `/v1/rounds` keep running."""
    long = {"max_tokens": 96, "ignore_eos": True, "temperature": 0.7}
    kinds = {
        "chat": ("/v1/chat/completions", lambda i: chat(target, f"Tell me about {i}.", **long)),
        "stream": ("/v1/chat/completions", lambda i: chat(target, f"Tell me about {i}.", stream=True, **long)),
        "completions_n2": ("/v1/completions", lambda i: {"model": target.model, "prompt": f"Item {i}:", "n": 2, **long}),
        "rounds": ("/v1/rounds", lambda i: {"model": target.model, "cache_salt": uuid.uuid4().hex, **long,
                                            "agents": [agent(i * 10 + j) for j in range(3)]}),
    }
    plan = []
    for kind, (path, body) in kinds.items():
        for stage, after in [("upload", 0.0), ("upload", 1.0), ("waiting", 0.0), ("waiting", 0.3), ("waiting", 2.0),
                             ("streaming", 0.0)]:
            if stage == "streaming" and kind != "stream":
                continue
            plan.append((kind, stage, after, path, json.dumps(body(len(plan))).encode()))
    declared = []  # a round of 4 declared agents: two leave, two wait for their answers
    round_id, salt = uuid.uuid4().hex, uuid.uuid4().hex
    for j in range(4):
        declared.append({**chat(target, "", **long), **agent(900 + j), "round_id": round_id, "round_size": 4,
                         "cache_salt": salt, "max_tokens": 16})
    sessions = [(b["agent_id"], salt) for b in declared]
    for kind, _, _, path, data in plan:
        if kind == "rounds":
            body = json.loads(data)
            sessions += [(a["agent_id"], body["cache_salt"]) for a in body["agents"]]
    results = collections.Counter()
    with ThreadPoolExecutor(len(plan) + 4) as pool:
        left = [pool.submit(target.leave, path, data, stage, after) for _, stage, after, path, data in plan]
        left += [pool.submit(target.leave, "/v1/chat/completions", json.dumps(b).encode(), "waiting", 0.3)
                 for b in declared[:2]]
        stayed = [pool.submit(target.post, "/v1/chat/completions", b) for b in declared[2:]]
        for (kind, stage, after, _, _), future in zip(plan, left):
            results[f"{kind}/{stage}/{after:g}s: {future.result()}"] += 1
        answers = collections.Counter(str(f.result()[0]) for f in stayed)
    settle(target)
    # an abandoned round: its agents should stop with their client, not run to max_tokens
    body = {"model": target.model, "cache_salt": uuid.uuid4().hex, "max_tokens": 400, "ignore_eos": True,
            "agents": [agent(950 + j) for j in range(4)]}
    sessions += [(a["agent_id"], body["cache_salt"]) for a in body["agents"]]
    target.leave("/v1/rounds", json.dumps(body).encode(), "waiting", 1.5)
    left_at = time.monotonic()
    while target.busy() and time.monotonic() - left_at < args.timeout:
        time.sleep(0.1)
    return {"left": dict(results), "statuses": answers, "abandoned_round_running_s": round(time.monotonic() - left_at, 2),
            "sessions": sessions}


# ---------------------------------------------------------------- wave 3: crossing rounds


def rounds_wave(target: Target, args) -> dict:
    """At once: three tenants running the same round id with the same agent ids, an agent in two
    rounds, a round one member short of its size (answered at the round timeout), and three
    `/v1/rounds`. Every request answers 200."""
    round_id, requests, sessions = uuid.uuid4().hex, [], []
    for tenant in (uuid.uuid4().hex for _ in range(3)):
        for j in range(4):
            requests.append(("/v1/chat/completions", {**chat(target, ""), **agent(j), "round_id": round_id,
                                                      "round_size": 4, "cache_salt": tenant, "temperature": 0}))
            sessions.append((f"villager-{j}", tenant))
    twice = uuid.uuid4().hex
    for r in range(2):
        for j in range(2):
            requests.append(("/v1/chat/completions", {**chat(target, ""), **agent(20 + j + r), "cache_salt": twice,
                                                      "round_id": f"{twice}-{r}", "round_size": 2}))
            sessions.append((f"villager-{20 + j + r}", twice))
    short = uuid.uuid4().hex
    for j in range(3):
        requests.append(("/v1/chat/completions", {**chat(target, ""), **agent(40 + j), "cache_salt": short,
                                                  "round_id": short, "round_size": 4}))
        sessions.append((f"villager-{40 + j}", short))
    for r in range(3):
        salt = uuid.uuid4().hex
        requests.append(("/v1/rounds", {"model": target.model, "max_tokens": 8, "cache_salt": salt,
                                        "agents": [agent(60 + j) for j in range(4)]}))
        sessions += [(f"villager-{60 + j}", salt) for j in range(4)]
    started = time.monotonic()
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda r: target.post(*r), requests))
    statuses = collections.Counter(str(status) for status, _ in answers)
    return {"requests": len(requests), "statuses": statuses, "seconds": round(time.monotonic() - started, 2),
            "sessions": sessions}


# ---------------------------------------------------------------- wave 4: the soak


def soak_body(kind: str, i: int, model: str, round_ids: dict) -> tuple[str, dict]:
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
        group = i // (4 * len(SOAK_KINDS))
        round_id = round_ids.setdefault(group, uuid.uuid4().hex)
        return "/v1/chat/completions", {**base, **agent(i), "round_id": round_id, "round_size": 4,
                                        "cache_salt": round_id}
    if kind == "rounds":
        return "/v1/rounds", {"model": model, "max_tokens": 6, "cache_salt": uuid.uuid4().hex,
                              "agents": [agent(i * 10 + j) for j in range(3)]}
    return "/v1/chat/completions", {**base, **INVALID[i % len(INVALID)]}


def soak_wave(target: Target, args) -> dict:
    """`--soak` requests of every kind from `--clients` clients; `--leave` of them (never a declared
    round's member, whose peers would wait for it) leave at a random moment."""
    rng, round_ids, plan, sessions = random.Random(args.seed), {}, [], []
    for i in range(args.soak):
        kind = SOAK_KINDS[i % len(SOAK_KINDS)]
        path, body = soak_body(kind, i, target.model, round_ids)
        leave = rng.uniform(0.01, 3.0) if kind != "declared" and rng.random() < args.leave else None
        plan.append((kind, path, body, leave))
        if kind == "declared":
            sessions.append((body["agent_id"], body["cache_salt"]))
        elif kind == "rounds":
            sessions += [(a["agent_id"], body["cache_salt"]) for a in body["agents"]]

    def one(item):
        kind, path, body, leave = item
        if leave is not None:
            return kind, target.leave(path, json.dumps(body).encode(), "waiting", leave)
        return kind, target.post(path, body)[0]

    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    started = time.monotonic()
    with ThreadPoolExecutor(args.clients) as pool:
        for kind, status in pool.map(one, plan):
            counts[kind][str(status)] += 1
    return {"requests": args.soak, "clients": args.clients, "seconds": round(time.monotonic() - started, 1),
            "statuses": sum(counts.values(), collections.Counter()), "by_kind": {k: dict(v) for k, v in counts.items()},
            "sessions": sessions}


# ---------------------------------------------------------------- after each wave


def settle(target: Target, limit: float = 120) -> float:
    """Seconds until the server holds no request."""
    started = time.monotonic()
    while target.busy() and time.monotonic() - started < limit:
        time.sleep(0.25)
    return time.monotonic() - started


def check(target: Target, wave: dict, idle: dict) -> dict:
    """Once the server holds no request: a plain chat's status and latency, then what is still held
    (tokendance serve: after ending the sessions the wave's agents kept)."""
    settled = settle(target)
    started = time.monotonic()
    status, _ = target.post("/v1/chat/completions", chat(target, "Name three colours.", temperature=0))
    health_s = time.monotonic() - started
    if target.kind == "tokendance":
        for agent_id, salt in wave.pop("sessions", []):
            target.request("DELETE", f"/v1/agents/{agent_id}" + (f"?cache_salt={salt}" if salt else ""), timeout=30)
    wave.pop("sessions", None)
    held = target.held()
    back = {k: v for k, v in held.items() if k in ("kv_blocks_used", "kv_usage", "agent_sessions", "store_saving")}
    return {"settled_s": round(settled, 2), "health": [status, round(health_s, 2)], "held": held,
            "idle": all(v - idle.get(k, 0.0) < 1e-9 for k, v in back.items())}  # no more than at the start


WAVES = {"corpus": corpus_wave, "leave": leave_wave, "rounds": rounds_wave, "soak": soak_wave}


class Canary(threading.Thread):
    """Another tenant, sending a plain 8-token chat under its own cache salt every half second
    while the waves run: its statuses and latencies, by wave."""

    def __init__(self, target: Target):
        super().__init__(daemon=True)
        self.target, self.wave, self.stopped = target, "idle", threading.Event()
        self.lock = threading.Lock()  # held while its chat is in flight: `check` waits for it
        self.seen: dict[str, list] = collections.defaultdict(list)  # wave -> [(status, seconds)]

    def run(self) -> None:
        body = chat(self.target, "Name a colour.", temperature=0, cache_salt=f"canary-{uuid.uuid4().hex}")
        while not self.stopped.wait(0.5):
            with self.lock:
                wave, started = self.wave, time.monotonic()
                status, _ = self.target.post("/v1/chat/completions", body, timeout=60)
                self.seen[wave].append((str(status), time.monotonic() - started))

    def summary(self, wave: str) -> dict:
        seen = self.seen.get(wave)
        if not seen:  # a wave shorter than its period
            return {"statuses": {}, "p50_s": None, "max_s": None}
        seconds = sorted(s for _, s in seen)
        return {"statuses": collections.Counter(s for s, _ in seen), "p50_s": round(seconds[len(seconds) // 2], 2),
                "max_s": round(seconds[-1], 2)}


def probe(url: str, args) -> dict:
    target = Target(url, args.timeout)
    settle(target)
    target.post("/v1/chat/completions", chat(target, "warm up"))
    idle = target.held()
    report = {"server": target.kind, "model": target.model, "idle": idle, "waves": {}}
    planted = target.planted() if args.faults else {}
    canary = Canary(target)
    canary.start()
    time.sleep(3)  # its latency on an idle server first
    for name in args.waves:
        started, canary.wave = time.monotonic(), name
        try:
            wave = WAVES[name](target, args)
            with canary.lock:
                wave["after"] = check(target, wave, idle)
        except OSError as exc:  # the server is gone: the report says so, and no later wave runs
            report["waves"][name] = {"error": repr(exc)}
            print(f"\n[{name}] FAIL: {exc!r}")
            break
        wave["wall_s"] = round(time.monotonic() - started, 1)
        wave["canary"] = canary.summary(name)
        if args.faults:  # the faults planted during the wave, by stage
            now = target.planted()
            wave["planted"], planted = {k: now[k] - planted.get(k, 0) for k in now}, now

        report["waves"][name] = wave
        print_wave(name, wave)
    canary.stopped.set()
    report["canary_idle"] = canary.summary("idle")
    print(f"the other tenant's chat, idle: {report['canary_idle']}")
    return report


def failures(wave: dict) -> list[str]:
    """What fails the wave: a 5xx, a hang or a connection the server closed, a slow or failed
    health check, state left behind."""
    if "error" in wave:
        return [wave["error"]]
    found = [f"{n} x {s}" for s, n in wave["statuses"].items() if s == "hang" or s.startswith(("closed", "5"))]
    found += [f"the other tenant's chat: {n} x {s}" for s, n in wave["canary"]["statuses"].items() if s != "200"]
    after = wave["after"]
    if after["health"][0] != 200 or after["health"][1] > HEALTHY_S:
        found.append(f"health {after['health']}")
    if not after["idle"]:
        found.append(f"not idle: {after['held']}")
    return found


def print_wave(name: str, wave: dict) -> None:
    after = wave["after"]
    print(f"\n[{name}] {wave['wall_s']} s; settled in {after['settled_s']} s; plain chat {after['health'][0]} in "
          f"{after['health'][1]} s; held once idle {after['held']} ({'idle' if after['idle'] else 'NOT IDLE'})")
    if name == "corpus":
        print(f"  {wave['cases']} cases: {dict(wave['statuses'])}; {len(wave['unexpected'])} not as tokendance serve answers")
        for case in wave["unexpected"]:
            if not str(case["got"][0]).startswith(("4", "2")):
                print(f"    {case['path']}: expected {case['expected']}, got {case['got']}: {case['body'][:160]}\n"
                      f"      {case['request'][:300]}")
        cut = wave["cut_tool_call"]
        print(f"  a forced tool call cut by max_tokens: whole {cut['whole']}, streamed {cut.get('streamed')}: "
              f"{'alike' if cut.get('alike') else 'DIFFERENT'}")
    elif name == "leave":
        print(f"  {len(wave['left'])} requests left at every stage; the declared members who stayed: "
              f"{dict(wave['statuses'])}; an abandoned /v1/rounds held the engine "
              f"{wave['abandoned_round_running_s']} s after its client left")
    elif name == "rounds":
        print(f"  {wave['requests']} requests at once: {dict(wave['statuses'])} in {wave['seconds']} s")
    else:
        print(f"  {wave['requests']} requests from {wave['clients']} clients in {wave['seconds']} s")
        for kind, statuses in wave["by_kind"].items():
            print(f"    {kind:<16}{' '.join(f'{s}:{n}' for s, n in sorted(statuses.items()))}")
    if "planted" in wave:
        print(f"  faults planted: {sum(wave['planted'].values()):.0f} ({', '.join(f'{k} {v:.0f}' for k, v in sorted(wave['planted'].items()))})")
    canary = wave["canary"]
    print(f"  the other tenant's chat meanwhile: {dict(canary['statuses'])}, p50 {canary['p50_s']} s, max {canary['max_s']} s")
    problems = failures(wave)
    print(f"  {'FAIL: ' + '; '.join(problems) if problems else 'ok: no 5xx, no hang, healthy, back to idle'}")


def start_server(name: str, port: int, args, log):
    """The server `name` started on `port`, and the seconds until it was ready."""
    if name != "vllm-fleet":
        server = start(name, port, args, log)
        return server, wait_ready(port, server, log)
    fleet = argparse.Namespace(replicas=2, kv_gib=args.kv_gib, store_gib=args.store_gib, dtype=args.dtype,
                               vllm_python=str(vllm_fleet.VLLM_PYTHON), gather_ms=50.0, agents=0)
    server = vllm_fleet.start("tokendance", port, fleet, log, extra=tuple(f"--vllm-arg={a}" for a in args.vllm_args))
    return server, wait_ready(port, server, log, replicas_up(fleet.replicas), timeout_s=1200)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="URL of a running server (default: start --servers one after the other)")
    parser.add_argument("--servers", nargs="+", default=["tokendance"],
                        choices=["tokendance", "vllm+tokendance", "vllm", "vllm-fleet"])
    parser.add_argument("--waves", nargs="+", default=list(WAVES), choices=list(WAVES))
    parser.add_argument("--soak", type=int, default=1000, help="requests of the soak")
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--leave", type=float, default=0.2, help="share of the soak's clients that leave")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before an unanswered request is a hang")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--store-gib", type=float, default=0.5, help="the plugin's session store")
    parser.add_argument("--dtype", default=None, help="bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more argument of the vLLM servers")
    parser.add_argument("--faults", type=float, default=0.0,
                        help="vllm+tokendance: plant a fault at every stage of the plugin with this probability")
    args = parser.parse_args()
    from tokendance.model.platform import probe_cpu
    from tokendance.registry import DEFAULT_RECOMPUTE_RATIO

    cpu = probe_cpu()
    args.dtype = args.dtype or ("bfloat16" if cpu.native_bf16 else "float32")
    args.ratio = DEFAULT_RECOMPUTE_RATIO
    args.vllm_args = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", *args.vllm_arg]  # the model's format
    reports = {}
    if args.target:
        reports["target"] = probe(args.target.rstrip("/").removesuffix("/v1"), args)
    for name in [] if args.target else args.servers:
        port = free_port()
        with tempfile.TemporaryFile() as log:
            server, ready = start_server(name, port, args, log)
            try:
                print(f"\n=== {name}: ready after {ready:.0f} s ({args.dtype}, CPU {cpu.capability})")
                reports[name] = probe(f"http://127.0.0.1:{port}", args)
            finally:
                reports.setdefault(name, {"waves": {}})["alive"] = server.poll() is None
                if server.poll() is not None:  # its whole log, for the cause
                    log.seek(0)
                    saved = ROOT / "benchmarks" / "results" / f"probe-{name.replace('+', '-')}.log"
                    saved.write_bytes(log.read())
                    reports[name]["log"] = str(saved.relative_to(ROOT))
                    print(f"{name} EXITED with {server.returncode}: its log is in {reports[name]['log']}")
                vllm_fleet.stop(server)
    failed = False
    for name, report in reports.items():
        problems = [p for wave in report["waves"].values() for p in failures(wave)]
        failed |= bool(problems) or report.get("alive") is False
        out = ROOT / "benchmarks" / "results" / f"probe-{name.replace('+', '-')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "cpu": cpu.describe(), **report},
                                  indent=2, default=str))
        print(f"{name}: {'FAILED: ' + '; '.join(problems) if problems else 'passed'} -> {out.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
