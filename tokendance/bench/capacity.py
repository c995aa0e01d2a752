"""`tokendance bench capacity`: with a fixed KV budget and a round-latency SLO, the largest number
of agents each reuse mode keeps resident while meeting the SLO.

A mode "fits" N agents when, over `--rounds` rounds of the workload (open loop), no request was
preempted, the KV each mode keeps between rounds survived (tokendance: no session evicted;
prefix/pic: each agent's history prefix still served from the prefix cache), and every round
after the first met the SLO. Agents that do not fit are evicted and recomputed by the engine, as
always — the run goes on, it just does not count as fitting.

With `--target URL` the same search drives any OpenAI-compatible server (vLLM, `tokendance
serve`), whose KV budget is set where it is served (vLLM: `--kv-cache-memory-bytes` or
`VLLM_CPU_KVCACHE_SPACE`; `tokendance serve --kv-cache-bytes`). Only what a client sees is judged
there: N fits when no request failed, the server's Prometheus counters of memory pressure did
not grow (vLLM: preemptions; `tokendance serve`: preemptions, evicted sessions, rounds split in
waves) and every round after the first met the SLO. Each trial sends its own `cache_salt`, so no
trial is served from an earlier one's cache.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from tokendance.bench.options import CAPACITY_KV_BYTES, capacity_modes, kv_bytes
from tokendance.bench.simulation import Simulation, warm_up
from tokendance.errors import CapacityError
from tokendance.llm import LLM
from tokendance.model.loader import load_model
from tokendance.model.platform import describe_machine, dtype_name
from tokendance.round_core.spans import common_prefix
from tokendance.workloads import make_workload

def find_max_agents(fits: Callable[[int], bool], low: int = 1, high: int = 64) -> tuple[int, dict[int, bool]]:
    """Largest n in [low, high] with fits(n), for a predicate that is true up to some n and false
    after: doubling from `low`, then bisection. Returns (0, tried) if not even `low` fits. Calls
    `fits` O(log high) times, never twice for the same n."""
    tried: dict[int, bool] = {}

    def check(n: int) -> bool:
        if n not in tried:
            tried[n] = fits(n)
        return tried[n]

    if not check(low):
        return 0, tried
    good, bad = low, None
    while bad is None:
        n = min(good * 2, high)
        if n == good:
            return good, tried
        if check(n):
            good = n
        else:
            bad = n
    while bad - good > 1:
        mid = (good + bad) // 2
        if check(mid):
            good = mid
        else:
            bad = mid
    return good, tried


@dataclass
class Trial:
    mode: str
    agents: int
    fits: bool
    round_seconds: list[float] = field(default_factory=list)
    preemptions: int = 0
    evictions: int = 0
    extra_waves: int = 0  # rounds whose prepared KV did not fit at once ran in waves
    history_hit: float = 1.0  # prefix/pic: cached tokens / expected history prefix tokens
    reason: str = ""


def run_trial(loaded, mode: str, num_agents: int, args) -> Trial:
    """Run the workload with `num_agents` in `mode` under the budget and judge whether it fits."""
    workload = make_workload(args.workload, num_agents, seed=args.seed, order=args.order)
    llm = LLM(loaded, dtype=args.dtype, reuse=mode, kv_cache_bytes=kv_bytes(args) or CAPACITY_KV_BYTES,
              recompute_ratio=args.ratio, selection=args.selection)
    if args.warm_up:  # a trial is timed against the SLO: compiled before its first round, unless told not to
        warm_up([llm])
    evictions_before = llm.engine.stats().num_evictions
    trial = Trial(mode, num_agents, fits=False)
    simulation = Simulation(workload, {mode: llm}, closed_loop=False, max_tokens=args.max_tokens)
    try:
        for _ in range(args.rounds):
            (result,) = simulation.step().values()
            trial.round_seconds.append(result.stats.round_seconds)
            trial.preemptions += sum(o.num_preemptions for o in result.outputs)
            trial.extra_waves += result.stats.num_waves - 1
        trial.evictions = llm.engine.stats().num_evictions - evictions_before
        if mode != "tokendance":
            trial.history_hit = history_hit_rate(simulation.traces[mode].results, llm.engine.stats().block_size)
        trial.fits, trial.reason = judge(trial, args.slo_seconds)
    except CapacityError as exc:
        trial.reason = f"capacity: {exc}"
    finally:
        simulation.engines.clear()
        del llm
        gc.collect()
    return trial


def history_hit_rate(results, block_size: int) -> float:
    """Prefix-cache hits of rounds >= 2 over what a resident history would give (the common
    prefix with the agent's previous prompt, in whole blocks)."""
    expected = hits = 0
    for r in range(1, len(results)):
        for before, now in zip(results[r - 1].outputs, results[r].outputs):
            shared = common_prefix(before.prompt_token_ids, now.prompt_token_ids)
            expected += shared // block_size * block_size
            hits += min(now.num_cached_tokens, shared // block_size * block_size)
    return hits / expected if expected else 1.0


def judge(trial: Trial, slo_seconds: float) -> tuple[bool, str]:
    steady = trial.round_seconds[1:] or trial.round_seconds
    if trial.preemptions:
        return False, f"{trial.preemptions} preemptions"
    if trial.evictions:
        return False, f"{trial.evictions} sessions evicted"
    if trial.extra_waves:
        return False, "a round did not fit at once (ran in waves)"
    if trial.history_hit < 0.99:
        return False, f"history prefix hit rate {trial.history_hit:.2f}"
    if max(steady) > slo_seconds:
        return False, f"round latency {max(steady):.1f}s > SLO {slo_seconds}s"
    return True, "fits"


def run_target_trial(client, num_agents: int, args) -> Trial:
    """`args.rounds` open-loop rounds of `num_agents` against a server, judged like an in-process
    trial on what the server reports: its memory counters (`target.MEMORY_COUNTERS`) did not grow,
    and the SLO."""
    from tokendance.bench.target import run_round

    workload = make_workload(args.workload, num_agents, seed=args.seed, order=args.order)
    trial = Trial(client.model, num_agents, fits=False)
    salted = argparse.Namespace(**{**vars(args), "cache_salt": f"capacity-{num_agents}-{time.time_ns()}"})
    history: list = []
    before = client.memory_counters()
    try:
        for r in range(args.rounds):
            trial.round_seconds.append(run_round(client, workload, r, history, salted)["round_seconds"])
    except OSError as exc:  # a refused or failed request: the server could not serve N agents
        trial.reason = f"request failed: {exc}"
        return trial
    finally:
        if args.declare_rounds:  # the trial's agents end: the next trial starts from a server without them
            for agent in workload.agents:
                client.end_agent(agent, salted.cache_salt)
    after = client.memory_counters()
    if before is not None and after is not None:
        for kind, value in after.items():
            setattr(trial, kind, int(value - before.get(kind, 0.0)))
    trial.fits, trial.reason = judge(trial, args.slo_seconds)
    if after is None:
        trial.reason += " (the server exports no /metrics: judged on the SLO only)"
    return trial


def run_capacity(args) -> int:
    if args.target:
        from tokendance.bench.target import Client

        client = Client(args.target, args.api_key, args.target_model, args.request_timeout)
        return search(args, [client.model], lambda mode, n: run_target_trial(client, n, args),
                      {"target": args.target, "budget": "set on the server"})
    loaded = load_model(args.model)
    return search(args, args.modes or capacity_modes(), lambda mode, n: run_trial(loaded, mode, n, args),
                  describe_machine(dtype_name(args.dtype)))


def search(args, modes: list[str], trial_of: Callable[[str, int], Trial], machine: dict) -> int:
    """The largest fitting N of each mode (doubling, then bisection), with a line per trial."""
    out = Path(args.out or "benchmarks/results/capacity.json")
    started = time.perf_counter()
    results: dict = {"args": {k: v for k, v in vars(args).items() if k != "api_key"}, "machine": machine, "modes": {}}
    with tqdm(desc="capacity", unit="trial") as bar:
        for mode in modes:
            trials: list[Trial] = []

            def fits(n: int) -> bool:
                bar.set_postfix_str(f"{mode} N={n}")
                trial = trial_of(mode, n)
                trials.append(trial)
                bar.update(1)
                bar.write(f"{mode:<11} N={n:<4} {'fits' if trial.fits else 'no  '} {trial.reason}; rounds "
                          + " ".join(f"{s:.1f}s" for s in trial.round_seconds))
                return trial.fits

            best, _ = find_max_agents(fits, 1, args.max_agents)
            results["modes"][mode] = {"max_agents": best, "trials": [t.__dict__ for t in trials]}
            results["seconds"] = time.perf_counter() - started
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2))
    where = f"{args.target}" if args.target else f"{machine['dtype']}, CPU {machine['cpu_capability']}"
    print(format_capacity(results["modes"], args) + f"\n  ({where})")
    print(f"results in {out}")
    return 0


def format_capacity(modes: dict, args) -> str:
    budget = "the server's KV budget" if args.target else f"KV budget {(kv_bytes(args) or CAPACITY_KV_BYTES) / 2**20:g} MiB"
    lines = [f"{budget}, round SLO {args.slo_seconds:g} s, {args.workload}, {args.rounds} rounds"]
    for mode, r in modes.items():
        lines.append(f"  {mode:<11} max agents {r['max_agents']}")
    td, prefix = modes.get("tokendance"), modes.get("prefix")
    if td and prefix and prefix["max_agents"]:
        lines.append(f"  tokendance fits {td['max_agents'] / prefix['max_agents']:.2f}x the agents of prefix")
    return "\n".join(lines)
