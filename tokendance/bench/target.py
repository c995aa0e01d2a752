"""`tokendance bench --target URL`: the same workload against any OpenAI-compatible server (for
example vLLM or `tokendance serve`), each round's agents sent concurrently as streamed chat
completions; round latency and round TTFT measured here, on the client side."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from tokendance.bench.simulation import SILENT
from tokendance.errors import InvalidRequestError
from tokendance.model.platform import probe_cpu
from tokendance.workloads import make_workload

# Counters that say a server ran out of KV memory, by the name each server exports on /metrics:
# requests preempted (KV freed, recomputed later), agent sessions evicted, rounds split in waves.
MEMORY_COUNTERS = {
    "vllm:num_preemptions_total": "preemptions",
    "tokendance_preemptions_total": "preemptions",
    "tokendance_session_evictions_total": "evictions",
    "tokendance_round_extra_waves_total": "extra_waves",
}
# What a server says its rounds computed and reused, by the name each exports (both counters):
# `tokendance serve`'s rounds, and the vLLM plugin's (`computed_tokens` by reason).
REUSE_COUNTERS = {
    "tokendance_round_computed_tokens_total": "computed",
    "tokendance_round_reused_tokens_total": "reused",
    "vllm:tokendance_computed_tokens_total": "computed",
    "vllm:tokendance_reused_tokens_total": "reused",
    "vllm:tokendance_pass_seconds_total": "pass_seconds",
    "vllm:tokendance_restored_tokens_total": "restored",
}
# The vLLM plugin's session store now (gauges).
STORE_GAUGES = {"vllm:tokendance_store_bytes": "store_bytes", "vllm:tokendance_store_agents": "store_agents"}
# The plugin's saves still being copied: its gauges and counters move until this is 0.
SAVING = "vllm:tokendance_store_saving"
REASON = re.compile(r'(?:reason|phase)="([^"]+)"')
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+.eE0-9naNinfINF]+)$")


@dataclass
class Reply:
    text: str
    submitted: float
    first_token: float | None
    finished: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str | None = None  # which engine replica answered (`tokendance serve --replicas`)


class Client:
    """A minimal streaming chat client over the standard library (no extra dependency)."""

    def __init__(self, base_url: str, api_key: str, model: str | None, timeout: float = 600.0):
        self.base_url, self.api_key, self.timeout = base_url.rstrip("/"), api_key, timeout
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict | None = None, method: str | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=self.timeout)

    def model_cards(self) -> list[dict]:
        """/v1/models; TokenDance's cards also say the dtype and CPU capability it runs with."""
        with self._request("/models") as response:
            return json.load(response)["data"]

    def metrics(self) -> list[tuple[str, str, float]] | None:
        """The server's Prometheus /metrics (next to /v1) as (name, labels, value) samples; None
        where it exports none."""
        try:
            with urllib.request.urlopen(self.base_url.removesuffix("/v1") + "/metrics", timeout=self.timeout) as response:
                text = response.read().decode()
        except OSError:
            return None
        return [(m.group(1), m.group(2) or "", float(m.group(3))) for m in map(SAMPLE.match, text.splitlines()) if m]

    def end_agent(self, agent_id: str, cache_salt: str | None = None) -> None:
        """DELETE /v1/agents/{id}: a declared agent's session ends (what a simulation's client does
        when it is over); a server without sessions answers 404, which is fine."""
        query = f"?cache_salt={urllib.parse.quote(cache_salt)}" if cache_salt else ""
        try:
            self._request(f"/agents/{urllib.parse.quote(agent_id, safe='')}{query}", method="DELETE").close()
        except OSError:  # HTTPError included: 404 where the server keeps no sessions
            pass

    def memory_counters(self) -> dict[str, float] | None:
        """The server's `MEMORY_COUNTERS`, summed over labels and by what they count."""
        samples = self.metrics()
        if samples is None:
            return None
        found: dict[str, float] = {}
        for name, _, value in samples:
            if name in MEMORY_COUNTERS:
                found[MEMORY_COUNTERS[name]] = found.get(MEMORY_COUNTERS[name], 0.0) + value
        return found

    def reuse_counters(self) -> dict[str, float]:
        """The server's `REUSE_COUNTERS` now, summed over labels, with the plugin's computed tokens
        also by reason ("computed.<reason>") and its pass seconds by phase ("pass_seconds.<phase>");
        empty where the server exports none."""
        found: dict[str, float] = {}
        for name, labels, value in self.metrics() or []:
            kind = REUSE_COUNTERS.get(name)
            if kind is None:
                continue
            found[kind] = found.get(kind, 0.0) + value
            reason = REASON.search(labels)
            if reason:
                key = f"{kind}.{reason.group(1)}"
                found[key] = found.get(key, 0.0) + value
        return found

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait (up to `timeout_s`) until the plugin's workers have copied every finished request's
        KV into its store: vLLM does that a step after a reply's last token, so what /metrics says
        right after a round lags it. Returns at once where the server has no store."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            saving = sum(value for name, _, value in self.metrics() or [] if name == SAVING)
            if saving <= 0:
                return
            time.sleep(0.05)

    def store_state(self) -> dict[str, float] | None:
        """The plugin's session store (`STORE_GAUGES`), None where the server has none."""
        found: dict[str, float] = {}
        for name, _, value in self.metrics() or []:
            if name in STORE_GAUGES:
                found[STORE_GAUGES[name]] = found.get(STORE_GAUGES[name], 0.0) + value
        return found or None

    def kv_bytes_used(self) -> float | None:
        """KV bytes the server holds for requests (and agent sessions) now: `tokendance serve`'s
        tokendance_kv_bytes_used, vLLM's kv_cache_usage_perc x its kv_cache_memory_bytes."""
        samples = self.metrics() or []
        named = {name: (labels, value) for name, labels, value in samples}
        if "tokendance_kv_bytes_used" in named:
            return named["tokendance_kv_bytes_used"][1]
        if "vllm:kv_cache_usage_perc" in named and "vllm:cache_config_info" in named:
            budget = re.search(r'kv_cache_memory_bytes="(\d+)"', named["vllm:cache_config_info"][0])
            if budget:
                return named["vllm:kv_cache_usage_perc"][1] * int(budget.group(1))
        return None

    def _first_model(self) -> str:
        models = self.model_cards()
        if not models:
            raise InvalidRequestError(f"{self.base_url} serves no model")
        return models[0]["id"]

    def chat(self, messages: list[dict], max_tokens: int, extra: dict) -> Reply:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, **extra}
        reply = Reply("", time.perf_counter(), None, 0.0)
        with self._request("/chat/completions", body) as response:
            reply.replica = response.headers.get("x-tokendance-replica")
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        reply.first_token = reply.first_token or time.perf_counter()
                        reply.text += delta
                usage = chunk.get("usage")
                if usage:
                    reply.prompt_tokens = usage.get("prompt_tokens", 0)
                    reply.completion_tokens = usage.get("completion_tokens", 0)
                    reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        reply.finished = time.perf_counter()
        reply.first_token = reply.first_token or reply.finished
        return reply


class KVPeak:
    """The most KV a server held while a block ran: its /metrics polled every `interval` s on a
    thread (None where the server does not report its KV)."""

    def __init__(self, client: Client, interval: float = 0.25):
        self.client, self.interval, self.peak = client, interval, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "KVPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while True:
            used = self.client.kv_bytes_used()
            if used is not None:
                self.peak = max(self.peak or 0.0, used)
            if self._stop.wait(self.interval):
                return


def run_target(args) -> int:
    """The bench against a server; a server that cannot be reached or refuses is one line, exit 1."""
    try:
        return _run_target(args)
    except urllib.error.HTTPError as exc:
        print(f"error: {args.target} answered {exc.code} {exc.reason}: check --target, --target-model and "
              "--api-key", file=sys.stderr)
    except (urllib.error.URLError, ConnectionError) as exc:
        print(f"error: cannot reach {args.target} ({getattr(exc, 'reason', exc)}): is the server up? Start it "
              "with `tokendance serve`, or check --target", file=sys.stderr)
    return 1


def _run_target(args) -> int:
    client = Client(args.target, args.api_key, args.target_model, args.request_timeout)
    agent_counts = args.agents or ([3] if args.workload == "debate" else [4, 8, 16])
    rows = []
    with tqdm(total=len(agent_counts) * args.rounds, desc=f"bench {client.model}", unit="round") as bar:
        for n in agent_counts:
            workload = make_workload(args.workload, n, seed=args.seed, order=args.order)
            history: list[dict[str, str]] = []
            for r in range(args.rounds):
                bar.set_postfix_str(f"N={n} round {r + 1}")
                rows.append(run_round(client, workload, r, history, args))
                bar.update(1)
    print(format_target(rows, client))
    out = Path(args.out or "benchmarks/results/target.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    card = next((c for c in client.model_cards() if c["id"] == client.model), {})
    served = {"dtype": card.get("dtype"), "cpu_capability": card.get("cpu_capability") or probe_cpu().capability}
    print(f"(server dtype {served['dtype'] or 'not reported'}, CPU {served['cpu_capability']})")
    out.write_text(json.dumps({"target": args.target, "model": client.model, "machine": served, "rounds": rows},
                              indent=2))
    print(f"results in {out}")
    return 0


def run_round(client: Client, workload, round_index: int, history: list, args) -> dict:
    """All agents of the round at once; the history grows by what they said (closed loop) or by
    the workload's synthetic outputs (open loop)."""
    closed = args.loop == "closed"
    feed = history if closed else [workload.synthetic_outputs(i) for i in range(round_index)]
    turns = workload.turns(round_index, feed)
    round_id = f"{workload.name}-{len(workload.agents)}-{args.seed}-{round_index}"

    def send(turn) -> Reply:
        extra = {"agent_id": turn.agent_id, "round_id": round_id, "round_size": len(turns)} if args.declare_rounds else {}
        if args.cache_salt:
            extra["cache_salt"] = args.cache_salt
        max_tokens = min(workload.output_tokens(turn.agent_id, round_index), args.max_tokens or 1 << 30)
        return client.chat(list(turn.messages), max_tokens, extra)

    before = client.reuse_counters()
    started = time.perf_counter()
    with KVPeak(client) as kv, ThreadPoolExecutor(max_workers=len(turns)) as pool:
        replies = list(pool.map(send, turns))
    client.settle()
    after = client.reuse_counters()
    history.append({t.agent_id: (reply.text.strip() or SILENT) for t, reply in zip(turns, replies)})
    return {
        "workload": workload.name, "agents": len(turns), "round": round_index + 1, "loop": args.loop,
        "round_seconds": max(x.finished for x in replies) - started,
        "first_token_seconds": min(x.first_token for x in replies) - started,
        "prefill_seconds": max(x.first_token for x in replies) - started,
        # a reply's own decode (first token to last), averaged: the tail without the round's spread
        "reply_decode_seconds": sum(x.finished - x.first_token for x in replies) / len(replies),
        "prompt_tokens": sum(x.prompt_tokens for x in replies),
        "cached_tokens": sum(x.cached_tokens for x in replies),
        "completion_tokens": sum(x.completion_tokens for x in replies),
        "kv_peak_bytes": kv.peak,  # the most KV the server held during the round (None: not reported)
        "replicas": sorted({x.replica for x in replies if x.replica}),
        # what the server says the round computed and reused (None: it does not say)
        "server_tokens": {key: after[key] - before.get(key, 0.0) for key in after} or None,
        "store": client.store_state(),  # the plugin's session store after the round (None: none)
    }


def format_target(rows: list[dict], client: Client) -> str:
    lines = [f"{client.base_url} ({client.model})",
             f"{'N':>4} {'rd':>2}{'round s':>9}{'1st tok':>8}{'TTFT s':>8}{'tail s':>7}{'prompt tok':>11}{'cached':>8}"
             f"{'out tok':>8}{'computed':>9}{'reused':>8}{'KV MB/agent':>12}  replicas"]
    for r in rows:
        server = r.get("server_tokens") or {}
        lines.append(f"{r['agents']:>4} {r['round']:>2}{r['round_seconds']:>9.2f}{r['first_token_seconds']:>8.2f}"
                     f"{r['prefill_seconds']:>8.2f}{r['round_seconds'] - r['prefill_seconds']:>7.2f}"
                     f"{r['prompt_tokens']:>11}{r['cached_tokens']:>8}{r['completion_tokens']:>8}"
                     f"{_count(server.get('computed')):>9}{_count(server.get('reused')):>8}"
                     f"{_per_agent_mb(r):>12}  "
                     f"{','.join(name[-6:] for name in r.get('replicas', [])) or '-'}")
    reasons = [(r, {k.removeprefix("computed."): v for k, v in (r.get("server_tokens") or {}).items()
                    if k.startswith("computed.") and v}) for r in rows]
    if any(by_reason for _, by_reason in reasons):
        lines.append("computed tokens by reason (the server's count; check: reused tokens' check layers, "
                     "in full-model token equivalents):")
        for r, by_reason in reasons:
            lines.append(f"{r['agents']:>4} {r['round']:>2}  " + ", ".join(
                f"{reason} {_count(value)}" for reason, value in sorted(by_reason.items(), key=lambda kv: -kv[1])))
    phases = [(r, {k.removeprefix("pass_seconds."): v for k, v in (r.get("server_tokens") or {}).items()
                   if k.startswith("pass_seconds.")}) for r in rows]
    if any(by_phase for _, by_phase in phases):
        lines.append("the mirrors' pass, seconds by phase (attention: inside check and recompute):")
        for r, by_phase in phases:
            lines.append(f"{r['agents']:>4} {r['round']:>2}  " + ", ".join(
                f"{phase} {value:.2f}" for phase, value in by_phase.items()))
    stores = [(r, r["store"]) for r in rows if r.get("store") and r["store"].get("store_agents")]
    if stores:
        lines.append("the session store after the round (all agents it holds; restored: history read back from it):")
        for r, store in stores:
            lines.append(f"{r['agents']:>4} {r['round']:>2}  {store['store_agents']:.0f} agents, "
                         f"{store['store_bytes'] / 2**20:.1f} MB ({store['store_bytes'] / store['store_agents'] / 2**20:.2f} "
                         f"MB/agent), restored {_count((r.get('server_tokens') or {}).get('restored'))} tokens")
    return "\n".join(lines)


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _per_agent_mb(row: dict) -> str:
    peak = row.get("kv_peak_bytes")
    return "-" if peak is None else f"{peak / row['agents'] / 2**20:.2f}"


def as_bench_rows(results: dict, label: str) -> list[dict]:
    """A `--target` run's rounds (its JSON) as rows of the in-process bench under the name `label`,
    for the same tables and plots: what a client sees (latency, TTFT) and the server's peak KV."""
    return [{"agents": r["agents"], "round": r["round"], "mode": label, "round_seconds": r["round_seconds"],
             "prefill_seconds": r["prefill_seconds"], "decode_seconds": r["round_seconds"] - r["prefill_seconds"],
             "kv_bytes_per_agent": None if r.get("kv_peak_bytes") is None else r["kv_peak_bytes"] / r["agents"],
             "prompt_tokens": r["prompt_tokens"]} for r in results["rounds"]]
