"""Prometheus metrics in the text exposition format, without a client library.

Counters only grow, gauges hold the latest value, histograms keep cumulative bucket counts, a sum
and a count. Thread-safe: the engine thread and the HTTP event loop both record.
"""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
AGENT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
KL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.15, 0.25, 0.4, 1)
PULL_BUCKETS = (-0.5, -0.2, -0.1, 0, 0.1, 0.2, 0.3, 0.5, 0.75, 1)

# name -> (type, help, buckets for histograms)
DEFINITIONS: dict[str, tuple[str, str, tuple | None]] = {
    "tokendance_http_requests_total": ("counter", "HTTP requests answered, by endpoint and status", None),
    "tokendance_requests_in_flight": ("gauge", "engine requests (prompts x choices, round agents) admitted and not yet answered", None),
    "tokendance_requests_finished_total": ("counter", "engine requests finished, by finish reason", None),
    "tokendance_prompt_tokens_total": ("counter", "prompt tokens of finished requests", None),
    "tokendance_cached_prompt_tokens_total": ("counter", "prompt tokens served from cache or shared KV", None),
    "tokendance_generation_tokens_total": ("counter", "tokens generated", None),
    "tokendance_preemptions_total": ("counter", "requests preempted: their KV freed, to be recomputed", None),
    "tokendance_request_latency_seconds": ("histogram", "end-to-end latency of generation requests", LATENCY_BUCKETS),
    "tokendance_time_to_first_token_seconds": ("histogram", "time to the first token", LATENCY_BUCKETS),
    "tokendance_engine_running_requests": ("gauge", "requests the scheduler is running", None),
    "tokendance_engine_waiting_requests": ("gauge", "requests waiting in the scheduler", None),
    "tokendance_gather_pending_requests": ("gauge", "chat requests waiting for a round to form", None),
    "tokendance_kv_blocks_total": ("gauge", "blocks in the KV pool", None),
    "tokendance_kv_blocks_used": ("gauge", "KV blocks held by requests and agent sessions", None),
    "tokendance_kv_blocks_free": ("gauge", "KV blocks free (cached prefix blocks count as free)", None),
    "tokendance_kv_bytes_used": ("gauge", "KV bytes held by requests and agent sessions", None),
    "tokendance_agent_sessions": ("gauge", "agent sessions holding KV between rounds", None),
    "tokendance_session_evictions_total": ("counter", "agent sessions evicted under memory pressure", None),
    "tokendance_rounds_total": ("counter", "rounds run, by how they formed", None),
    "tokendance_rounds_aborted_total": ("counter", "rounds stopped because every client of them left", None),
    "tokendance_rounds_failed_total": ("counter", "rounds that failed (their requests got an error or ran alone)", None),
    "tokendance_round_extra_waves_total": ("counter", "waves rounds ran in beyond their first (their KV did not fit at once)", None),
    "tokendance_round_agents": ("histogram", "agents per round", AGENT_BUCKETS),
    "tokendance_last_round_agents": ("gauge", "agents in the last round", None),
    "tokendance_round_seconds": ("histogram", "round latency: until every agent has its output", LATENCY_BUCKETS),
    "tokendance_round_prefill_seconds": ("histogram", "round TTFT: until every agent has its first token", LATENCY_BUCKETS),
    "tokendance_round_computed_tokens_total": ("counter", "prefill tokens the rounds computed, in full-model token equivalents", None),
    "tokendance_round_reused_tokens_total": ("counter", "shared-span tokens the rounds served from shared KV", None),
    "tokendance_round_recomputed_tokens_total": ("counter", "shared-span tokens the rounds selected and recomputed", None),
    "tokendance_round_logical_kv_tokens_total": ("counter", "KV tokens in the agents' tables after each round", None),
    "tokendance_round_physical_kv_tokens_total": ("counter", "physical KV tokens (blocks x block size) holding them", None),
    "tokendance_round_repeated_replies_total": ("counter", "round members whose reply says the same words as another "
                                                "member's (agents converging on one text)", None),
    "tokendance_last_round_repeated_replies": ("gauge", "members of the last round whose reply repeats another's", None),
    "tokendance_round_compression": ("gauge", "logical / physical KV tokens of the last round", None),
    "tokendance_round_shared_compression": ("gauge", "shared-span tokens / distinct slots holding them, last round", None),
    "tokendance_round_kv_bytes_per_agent": ("gauge", "KV bytes per agent of the last round", None),
    "tokendance_probe_kl": ("histogram", "--fidelity auto: a round's probe, mean KL(exact || reused) per token of the "
                            "exact reply's first tokens, nats", KL_BUCKETS),
    "tokendance_probe_pull": ("histogram", "--fidelity auto: a round's probe, how much more its reused reply is like "
                              "another member's than its exact reply is", PULL_BUCKETS),
    "tokendance_probe_breaches_total": ("counter", "--fidelity auto: probes over the fidelity target", None),
    "tokendance_probes_skipped_total": ("counter", "--fidelity auto: sharing rounds whose probe gave no reading", None),
    "tokendance_probe_tokens_total": ("counter", "--fidelity auto: prompt tokens the probes computed beyond the rounds'", None),
    "tokendance_fidelity_level": ("gauge", "--fidelity auto: the rung of the setting the last round ran at (0: the "
                                  "ladder's cheapest)", None),
    "tokendance_fidelity_setting": ("gauge", "--fidelity auto: 1 for the setting the last round ran at, else 0", None),
}

Labels = tuple[tuple[str, str], ...]


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[str, dict[Labels, float]] = {name: {} for name in DEFINITIONS}
        self._histograms = {name: Histogram(d[2]) for name, d in DEFINITIONS.items() if d[0] == "histogram"}

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] = value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._histograms[name].observe(value)

    def render(self) -> str:
        lines = []
        with self._lock:
            for name, (kind, help_text, _) in DEFINITIONS.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                if kind == "histogram":
                    lines += _histogram_lines(name, self._histograms[name])
                    continue
                series = self._values[name] or {(): 0}
                lines += [f"{name}{_labels(key)} {_number(v)}" for key, v in sorted(series.items())]
        return "\n".join(lines) + "\n"


    # ------------------------------------------------------------ what the server records

    def record_finished(self, output) -> None:
        """A finished (or aborted) engine request's tokens."""
        self.inc("tokendance_requests_finished_total", finish_reason=output.finish_reason or "abort")
        self.inc("tokendance_prompt_tokens_total", output.num_prompt_tokens)
        self.inc("tokendance_cached_prompt_tokens_total", output.num_cached_tokens)
        self.inc("tokendance_generation_tokens_total", output.num_generated_tokens)

    def record_round(self, stats, source: str) -> None:
        """A finished round's `RoundStats`; `source` says how it formed."""
        self.inc("tokendance_rounds_total", source=source)
        self.observe("tokendance_round_agents", stats.num_agents)
        self.set("tokendance_last_round_agents", stats.num_agents)
        self.inc("tokendance_round_extra_waves_total", stats.num_waves - 1)
        self.observe("tokendance_round_seconds", stats.round_seconds)
        self.observe("tokendance_round_prefill_seconds", stats.prefill_seconds)
        self.inc("tokendance_round_computed_tokens_total", stats.computed_tokens)
        self.inc("tokendance_round_reused_tokens_total", stats.reused_tokens)
        self.inc("tokendance_round_recomputed_tokens_total", stats.recomputed_tokens)
        self.inc("tokendance_round_logical_kv_tokens_total", stats.logical_kv_tokens)
        self.inc("tokendance_round_physical_kv_tokens_total", stats.physical_kv_tokens)
        self.inc("tokendance_round_repeated_replies_total", stats.repeated_replies)
        self.set("tokendance_last_round_repeated_replies", stats.repeated_replies)
        self.set("tokendance_round_compression", stats.compression)
        self.set("tokendance_round_shared_compression", stats.shared_compression)
        self.set("tokendance_round_kv_bytes_per_agent", stats.kv_bytes_per_agent)
        if stats.fidelity is not None:
            self._record_probe(stats.fidelity)

    def _record_probe(self, step: dict) -> None:
        """A `--fidelity auto` round's step (round_core/fidelity_control.Step, as a dict)."""
        self.set("tokendance_fidelity_level", step["level"])
        with self._lock:
            series = self._values["tokendance_fidelity_setting"]
            for key in series:
                series[key] = 0
            series[(("setting", step["setting"]),)] = 1
        self.inc("tokendance_probe_tokens_total", step["probe_tokens"])
        self.inc("tokendance_probe_breaches_total", int(step["breach"]))
        if step["skipped"] is not None:
            self.inc("tokendance_probes_skipped_total")
        if step["reading"] is not None:
            self.observe("tokendance_probe_kl", step["reading"]["kl"])
            self.observe("tokendance_probe_pull", step["reading"]["pull"])

    def record_engine(self, stats, num_gathering: int) -> None:
        """The engine's gauges, from an `EngineStats` snapshot (taken on the engine thread)."""
        self.set("tokendance_kv_blocks_total", stats.num_blocks)
        self.set("tokendance_kv_blocks_used", stats.num_used_blocks)
        self.set("tokendance_kv_blocks_free", stats.num_free_blocks)
        self.set("tokendance_kv_bytes_used", stats.num_used_blocks * stats.bytes_per_block)
        self.set("tokendance_agent_sessions", stats.num_sessions)
        self.set("tokendance_session_evictions_total", stats.num_evictions)
        self.set("tokendance_preemptions_total", stats.num_preemptions)
        self.set("tokendance_engine_running_requests", stats.num_running)
        self.set("tokendance_engine_waiting_requests", stats.num_waiting)
        self.set("tokendance_gather_pending_requests", num_gathering)


def _histogram_lines(name: str, histogram: Histogram) -> list[str]:
    lines, total = [], 0
    for bound, count in zip((*histogram.buckets, "+Inf"), histogram.counts):
        total += count
        lines.append(f'{name}_bucket{{le="{bound}"}} {total}')
    return lines + [f"{name}_sum {_number(histogram.sum)}", f"{name}_count {total}"]


def _labels(key: Labels) -> str:
    if not key:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in key)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(key, escaped)) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def parse(text: str) -> dict[str, float]:
    """Sample lines of the exposition format as {'name{labels}': value} (for tests and scripts)."""
    return {series: float(value) for series, value in map(split_sample, text.splitlines())
            if series and not series.startswith("#")}


def split_sample(line: str) -> tuple[str, str]:
    """A sample line's series ('name{labels}') and its value."""
    series, _, value = line.rpartition(" ")
    return series, value


def with_label(series: str, label: str) -> str:
    """A series with one more label ('name{a="1"}' + 'b="2"' -> 'name{a="1",b="2"}')."""
    return series[:-1] + "," + label + "}" if series.endswith("}") else series + "{" + label + "}"
