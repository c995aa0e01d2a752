"""`tokendance demo` (`make demo`): a small closed-loop Generative Agents simulation: prefix caching
(the default, exact) and collective reuse (`tokendance`, `--fidelity fast`) beside `full` (no
reuse), the fidelity reference."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from tokendance.bench.simulation import Simulation, kv_budget, warm_up
from tokendance.llm import LLM
from tokendance.model.loader import load_model
from tokendance.workloads import GenerativeAgents

MB = 2**20


def run_demo(args) -> int:
    started = time.perf_counter()
    loaded = load_model(args.model)
    workload = GenerativeAgents(args.agents, seed=args.seed)
    budget = kv_budget(loaded, workload, args.rounds, args.dtype)
    engines = {mode: LLM(loaded, dtype=args.dtype, reuse=mode, kv_cache_bytes=budget)
               for mode in ("full", "prefix", "tokendance")}
    engine = engines["full"].engine
    print(f"model {loaded.name} ({engine.dtype}, CPU {engine.cpu.describe()}), loaded in {time.perf_counter() - started:.1f}s; "
          f"closed-loop generative-agents: {args.agents} agents x {args.rounds} rounds")
    warm_up(list(engines.values()))
    simulation = Simulation(workload, engines, closed_loop=True)
    with tqdm(total=args.rounds * len(engines), desc="simulating", unit="round") as bar:
        for r in range(args.rounds):
            simulation.step(on_mode=lambda mode: (bar.set_postfix_str(f"round {r + 1} {mode}"), bar.update(1)))
    rows = simulation.rows()
    print(format_demo(rows))
    show_outputs(simulation, workload)
    return 0


def format_demo(rows: list[dict]) -> str:
    lines = [f"\n{'round':>5}  {'mode':<11}{'latency s':>10}{'TTFT s':>8}{'tokens computed':>16}{'KV MB/agent':>12}"
             f"{'same as full':>13}{'loops':>7}{'distinct-2':>11}{'repeats':>9}"]
    for r in sorted(rows, key=lambda r: (r["round"], r["mode"] != "full", r["mode"])):
        lines.append(f"{r['round']:>5}  {r['mode']:<11}{r['round_seconds']:>10.2f}{r['prefill_seconds']:>8.2f}"
                     f"{r['computed_tokens']:>9.0f} / {r['prompt_tokens']:<5}{r['kv_bytes_per_agent'] / MB:>12.1f}"
                     f"{r['trace']['identical_outputs']:>12.0%}{r['quality']['loop_fraction']:>7.0%}"
                     f"{r['quality']['distinct_2']:>11.2f}{r['repeated_replies'] / r['agents']:>9.0%}")
    by = {(r["round"], r["mode"]): r for r in rows}
    last = max(r["round"] for r in rows)
    td, prefix = by[(last, "tokendance")], by[(last, "prefix")]
    lines.append(
        f"\nround {last}: tokendance (--fidelity fast) {prefix['round_seconds'] / td['round_seconds']:.2f}x the speed of "
        "prefix caching (the default, exact) "
        f"(TTFT {prefix['prefill_seconds'] / td['prefill_seconds']:.2f}x), "
        f"{prefix['kv_bytes_per_agent'] / td['kv_bytes_per_agent']:.2f}x less KV per agent; "
        "'same as full': share of the agents' outputs so far identical to the no-reuse trace; 'loops': share "
        "of the round's replies repeating a sentence or a 4-word run 3 times or more; 'distinct-2': distinct "
        "word pairs over all pairs of the round's replies; 'repeats': share of the agents whose reply says the "
        "same words as another agent's")
    return "\n".join(lines)


def show_outputs(simulation: Simulation, workload, count: int = 3) -> None:
    last = simulation.round_index - 1
    print(f"\nround {last + 1}, what some agents said (prefix caching, the default, says what full computation says"
          f"{'' if _same(simulation, 'prefix', last) else ' except where a near tie rounds differently'}):")
    for agent in workload.agents[:count]:
        for mode, label in (("full", "full"), ("tokendance", "fast")):
            print(f"  {workload.names[agent]:<18} [{label}] {simulation.traces[mode].history[last][agent]}")


def _same(simulation: Simulation, mode: str, last: int) -> bool:
    return simulation.traces[mode].history[: last + 1] == simulation.traces["full"].history[: last + 1]
