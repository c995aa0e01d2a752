"""Run a workload round by round in several reuse modes side by side.

Open loop: every mode is fed the workload's synthetic outputs, so all modes see the same prompts
and decode the same number of tokens, and fidelity against `full` is exact per round. Closed
loop: each mode is fed what it generated itself (what a real simulation does), and its trace is
compared with `full`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from tokendance.bench.quality import degeneration
from tokendance.engine.rounds import RoundResult
from tokendance.llm import LLM
from tokendance.reuse.fidelity import compare
from tokendance.sampling import SamplingParams
from tokendance.workloads import Workload

SILENT = "(says nothing)"  # stands in for an empty output in the next round's prompt


@dataclass
class ModeTrace:
    """One mode's run: per round the result, and what each agent said (the history it feeds on)."""

    mode: str
    results: list[RoundResult] = field(default_factory=list)
    history: list[dict[str, str]] = field(default_factory=list)


def round_params(workload: Workload, round_index: int, closed_loop: bool, max_tokens: int | None = None) -> list[SamplingParams]:
    """Greedy; open loop decodes exactly the workload's output length (ignore_eos), closed loop
    stops at EOS or that length; `max_tokens` caps both. Logits of the first token and each
    token's top-2 logprobs are kept for fidelity."""
    return [
        SamplingParams(temperature=0, max_tokens=min(workload.output_tokens(a, round_index), max_tokens or 1 << 30),
                       ignore_eos=not closed_loop, return_logits=1, logprobs=2)
        for a in workload.agents
    ]


class Simulation:
    """`engines`: mode -> LLM over the same model. `step()` runs the next round in every mode."""

    def __init__(self, workload: Workload, engines: dict[str, LLM], closed_loop: bool, max_tokens: int | None = None):
        self.workload, self.engines, self.closed_loop = workload, engines, closed_loop
        self.max_tokens = max_tokens
        self.traces = {mode: ModeTrace(mode) for mode in engines}
        self.round_index = 0

    def step(self, on_mode: Callable[[str], None] | None = None) -> dict[str, RoundResult]:
        r = self.round_index
        params = round_params(self.workload, r, self.closed_loop, self.max_tokens)
        fixed_turns = None if self.closed_loop else self.workload.turns(r, [self.workload.synthetic_outputs(i) for i in range(r)])
        results = {}
        for mode, llm in self.engines.items():
            if on_mode:
                on_mode(mode)
            trace = self.traces[mode]
            result = llm.run_round(fixed_turns or self.workload.turns(r, trace.history), params)
            trace.results.append(result)
            trace.history.append({a: (o.text.strip() or SILENT) for a, o in zip(self.workload.agents, result.outputs)})
            results[mode] = result
        self.round_index += 1
        return results

    def rows(self, reference: str = "full") -> list[dict]:
        """One plain row per (round, mode): the round's statistics and fidelity against `reference`."""
        rows = []
        for mode, trace in self.traces.items():
            for r, result in enumerate(trace.results):
                stats = asdict(result.stats)
                stats.pop("agents")
                row = {"workload": self.workload.name, "agents": len(self.workload.agents), "round": r + 1,
                       "loop": "closed" if self.closed_loop else "open", **stats}
                row["mean_output_tokens"] = sum(o.num_generated_tokens for o in result.outputs) / len(result.outputs)
                row["quality"] = degeneration([o.text for o in result.outputs])
                if reference in self.traces:
                    row["fidelity"] = asdict(compare(self.traces[reference].results[r].outputs, result.outputs))
                    row["trace"] = self.trace_agreement(reference, mode, r)
                rows.append(row)
        return rows

    def trace_agreement(self, reference: str, mode: str, last_round: int) -> dict:
        """Closed loop: how far `mode`'s trace has drifted from `reference`'s up to `last_round`:
        the fraction of (agent, round) outputs identical so far, and agents whose whole trace is."""
        ref, got = self.traces[reference].results, self.traces[mode].results
        same = [[a.token_ids == b.token_ids for a, b in zip(ref[r].outputs, got[r].outputs)] for r in range(last_round + 1)]
        per_agent = [all(rounds[i] for rounds in same) for i in range(len(self.workload.agents))]
        cells = [x for rounds in same for x in rounds]
        return {"identical_outputs": sum(cells) / len(cells), "identical_agent_traces": sum(per_agent) / len(per_agent)}


def warm_up(engines: Sequence[LLM]) -> None:
    for llm in engines:
        llm.warm_up()


def kv_budget(loaded, workload: Workload, rounds: int, dtype: str, headroom: float = 1.3) -> int:
    """Bytes for every agent's last-round prompt and output held privately, with headroom: what
    the no-sharing modes need so that the comparison is not about eviction."""
    import torch

    from tokendance.model.llama import KVCacheTensors
    from tokendance.model.platform import dtype_name
    from tokendance.reuse.segments import tokenize_round

    tokenizer, config = loaded.tokenizer, loaded.config
    history = [workload.synthetic_outputs(i) for i in range(rounds - 1)]
    turns = tokenize_round(tokenizer, workload.turns(rounds - 1, history))
    tokens = sum(len(t.token_ids) + workload.output_tokens(t.agent_id, rounds - 1) + 16 for t in turns)
    per_token = KVCacheTensors.bytes_per_slot(config, getattr(torch, dtype_name(dtype)))
    return int(headroom * tokens * per_token) + 64 * 2**20
