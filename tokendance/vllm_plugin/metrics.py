"""The connector's counters on vLLM's `/metrics`, under vLLM's own prefix (`vllm:tokendance_*`).

The stats reach here as one flat dict per engine step (`TokenDanceStats.data`: the workers' passes,
rank 0's only, plus the scheduler side's rounds); a key `name.label` is counter `name` with that
label value. Every counter is a running total since the server started; the gauges (the session
store's size) move by the changes the stats carry."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

# stats key (before any ".label") -> (metric name, label name or None, help)
COUNTERS: dict[str, tuple[str, str | None, str]] = {
    "rounds_complete": ("rounds", "formed", "rounds planned, by how they formed (complete: every member came; timeout; "
                                            "single: a round of one, a conversation's turn outside any round)"),
    "rounds_timed_out": ("rounds", "formed", ""),
    "rounds_single": ("rounds", "formed", ""),
    "members": ("members", "role", "round members, by role (master: computed in full; mirror: reuses; exact)"),
    "mirrors": ("mirrors_filled", None, "mirrors whose claimed range a pass filled"),
    "failed_mirrors": ("mirrors_failed", "reason", "failures of the connector, by stage (plan: the scheduler side's "
                                                   "planning or claim, per request; setup: building the pass; pass; "
                                                   "restore: a read from the session store; capture and save: the "
                                                   "store's, per mirror and per request; drop: the store's forgetting "
                                                   "of a step's entries, done again next step; bookkeeping: the scheduler "
                                                   "side's around them, at a step's end, a report or a finish): the "
                                                   "requests concerned are computed exactly by vLLM"),
    "faults_planted": ("faults_planted", "stage", "faults planted on purpose (the connector's `faults` setting), by "
                                                  "stage; each is also counted in mirrors_failed as a real failure of "
                                                  "that stage would be"),
    "passes": ("passes", None, "passes run by the workers"),
    "held_steps": ("held_steps", None, "engine steps a member was held (its round forming, its masters computing, "
                                       "or the step's claim budget spent)"),
    "unpinned_holders": ("unpinned_holders", None, "first holders whose pieces were not pinned for later readers "
                                                   "(pins take at most half of the pool and leave room for the "
                                                   "round's largest member): those readers computed the pieces"),
    "claimed_tokens": ("claimed_tokens", None, "prompt tokens mirrors claimed (filled by the pass)"),
    "pass_tokens": ("pass_tokens", None, "claimed tokens the workers' passes filled"),
    "reused_tokens": ("reused_tokens", None, "prompt tokens served from masters' or the agent's own earlier KV "
                                             "(keys re-rotated) or copied exactly"),
    "reused_exact_tokens": ("reused_exact_tokens", None, "reused tokens copied as they are, no check or selection "
                                                         "(the agent's own history past vLLM's block-aligned hit, "
                                                         "an identical prefix)"),
    "recalled_tokens": ("recalled_tokens", None, "claimed tokens of the agent's own earlier pieces that moved, "
                                                 "read from blocks vLLM's prefix cache still holds"),
    "computed_tokens": ("computed_tokens", "reason", "prompt tokens computed beyond vLLM's prefix hit, by reason "
                                                     "(master, exact, private, no_master, history, prefix, "
                                                     "selected; check: reused tokens' check layers in full-model "
                                                     "token equivalents)"),
    "pass_seconds": ("pass_seconds", "phase", "seconds in the workers' passes, by phase (check, select, copy, "
                                              "recompute; attention is part of check and recompute; "
                                              "restore: reads from the session store)"),
    "restored_tokens": ("restored_tokens", None, "claimed tokens of the agent's own history read back from the "
                                                 "session store (gone from vLLM's prefix cache)"),
    "store_saves": ("store_saves", None, "finished requests whose KV the session store took"),
    "store_evictions": ("store_evictions", None, "agents the session store let go to stay within store_gib"),
}
# stats key -> (gauge name, help): the stats carry their changes
GAUGES: dict[str, tuple[str, str]] = {
    "store_bytes": ("store_bytes", "bytes the session store holds (masters, diffs, own rows)"),
    "store_agents": ("store_agents", "agents the session store holds"),
    "store_saving": ("store_saving", "finished requests whose KV the workers are still copying into the store "
                                     "(0: the store's gauges and the counters are settled)"),
}
LABEL_OF = {"rounds_complete": "complete", "rounds_timed_out": "timeout", "rounds_single": "single"}


def split_key(key: str) -> tuple[str, str | None]:
    """("computed_tokens.selected") -> ("computed_tokens", "selected")."""
    name, _, label = key.partition(".")
    return name, label or LABEL_OF.get(name)


class TokenDancePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per name of `COUNTERS`, with vLLM's labels (model, engine) and the
    counter's own (reason, phase, role, formed)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for key, (name, label, documentation) in COUNTERS.items():
            if name in self.counters:
                continue
            self.counters[name] = self._counter_cls(
                name=f"vllm:tokendance_{name}", documentation=documentation,
                labelnames=self._labelnames + ([label] if label else []))
        self.labels = {name: label for name, label, _ in COUNTERS.values()}
        self.gauges = {key: self._gauge_cls(name=f"vllm:tokendance_{name}", documentation=documentation,
                                            labelnames=self._labelnames, multiprocess_mode="mostrecent")
                       for key, (name, documentation) in GAUGES.items()}
        self.levels: dict[tuple[str, int], float] = {}  # (gauge key, engine) -> its level

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if key in self.gauges and value:
                self.levels[key, engine_idx] = self.levels.get((key, engine_idx), 0) + value
                self.gauges[key].labels(*engine).set(self.levels[key, engine_idx])
                continue
            stat, label_value = split_key(key)
            if stat not in COUNTERS or not value:
                continue
            name = COUNTERS[stat][0]
            values = [*engine, label_value] if self.labels[name] else engine
            self.counters[name].labels(*values).inc(value)
