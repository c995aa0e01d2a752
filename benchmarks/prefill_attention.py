"""Prefill attention over a round's scattered queries: one attention call per request over all
its keys, against the call cut by position (each part over only the keys its queries can see),
side by side on the same Generative Agents round.

    python benchmarks/prefill_attention.py --agents 32

Prints, per setting, round 2's latency and the time spent in scaled_dot_product_attention, and
the ratios. The cut is `tokendance.model.runner.MAX_CHUNKS` (1 = one call). This is SDPA's path:
where the bf16 prefill kernel runs instead (bf16 on a CPU with AVX512-BF16), give `--dtype float32`;
benchmarks/prefill_kernel.py measures the kernel against SDPA.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch.nn.functional as F

import tokendance.model.runner as runner
from tokendance import LLM
from tokendance.bench.simulation import Simulation, warm_up
from tokendance.model.loader import load_model
from tokendance.model.platform import describe_machine, dtype_name
from tokendance.workloads import make_workload


class TimedAttention:
    """scaled_dot_product_attention, timed."""

    def __init__(self):
        self.seconds = 0.0
        self.attention = F.scaled_dot_product_attention

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        out = self.attention(*args, **kwargs)
        self.seconds += time.perf_counter() - started
        return out


def measure(loaded, agents: int, max_chunks: int, dtype: str) -> tuple[float, float]:
    """(round 2 seconds, attention seconds in it) with prefill attention cut in `max_chunks`."""
    runner.MAX_CHUNKS = max_chunks
    llm = LLM(loaded, dtype=dtype, reuse="tokendance", kv_cache_bytes=64 * agents * 2**20)
    warm_up([llm])
    simulation = Simulation(make_workload("generative-agents", agents, seed=0), {"tokendance": llm},
                            closed_loop=False)
    simulation.step()
    timed = TimedAttention()
    with mock.patch.object(F, "scaled_dot_product_attention", timed):
        started = time.perf_counter()
        simulation.step()
        return time.perf_counter() - started, timed.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    loaded = load_model()
    machine = describe_machine(dtype_name(args.dtype))
    results = {chunks: measure(loaded, args.agents, chunks, args.dtype) for chunks in (1, runner.MAX_CHUNKS)}
    print(f"Generative Agents N={args.agents}, round 2, {machine['dtype']}, CPU {machine['cpu_capability']}")
    for chunks, (round_seconds, attention) in results.items():
        print(f"  prefill attention in up to {chunks} call(s): round {round_seconds:.2f} s, attention {attention:.2f} s")
    (one, one_attention), (cut, cut_attention) = results.values()
    print(f"  cut by position: round {one / cut:.2f}x faster, attention {one_attention / cut_attention:.2f}x")


if __name__ == "__main__":
    main()
