"""Decode attention, eager (gather + rotate keys + SDPA) against the paged decode kernel (keys
read in place, queries rotated, shared runs read once for all readers), side by side in one run.

    .venv/bin/python benchmarks/decode.py [--agents 4 16 32] [--context 256 1300 4096] [--shared 0 0.6]

Synthetic tables over the real model's KV pool and the engine's own metadata builder: each of N
agents reads a context of L tokens, of which a fraction `shared` is one master span (at another
position in every agent's prompt, so its keys are read rotated); the rest is private. Reports the
attention time of one decode step (all layers), agents' tokens per second of attention alone, and
KV bytes read from the pool per step (eager: every agent's context; kernel: what it loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

os.environ["TOKENDANCE_KERNELS"] = "1"  # what is measured, even where the environment turns it off

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokendance import LLM  # noqa: E402
from tokendance.model.attention import AttentionMetadata, paged_attention  # noqa: E402


def build_tables(runner, agents: int, context: int, shared: float, generator: torch.Generator):
    """Slot tables of `agents` requests: a master span of shared * context tokens stored at
    positions 100.. and read at agent-specific offsets, private slots elsewhere."""
    cache, block = runner.kv_cache, runner.block_size
    span = int(shared * context)
    master = list(range(block, block + span))
    cache.positions[block:block + span] = torch.arange(100, 100 + span)
    next_slot = -(-(block + span) // block) * block
    tables = []
    for a in range(agents):
        offset = (a * 37) % max(1, context - span)
        private = list(range(next_slot, next_slot + context - span))
        next_slot += -(-(context - span) // block) * block
        table = private[:offset] + master + private[offset:]
        private_columns = list(range(offset)) + list(range(offset + span, context))
        cache.positions[torch.tensor(private, dtype=torch.int64)] = torch.tensor(private_columns, dtype=torch.int64)
        tables.append(table)
    for layer in range(len(cache.keys)):
        cache.keys[layer][:next_slot].copy_(torch.randn(cache.keys[layer][:next_slot].shape, generator=generator))
        cache.values[layer][:next_slot].copy_(torch.randn(cache.values[layer][:next_slot].shape, generator=generator))
    return tables


def step_seconds(model, runner, tables, q, kernel, repeats: int) -> tuple[float, torch.Tensor, int]:
    model.attention.decode = kernel  # the runner builds eager metadata (masks) without it
    meta = AttentionMetadata(torch.empty(0, dtype=torch.int64), [], runner._decode_attention(list(range(len(tables))), tables))
    cache = runner.kv_cache
    stats = [0]

    def run():
        outs = []
        for layer in range(len(cache.keys)):
            outs.append(paged_attention(q, None, None, cache.keys[layer], cache.values[layer], meta,
                                        model.attention, cache.positions))
        return outs

    result = run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    if kernel is not None:
        from tokendance.model import kernels

        counts = torch.zeros(2, dtype=torch.int64)
        d = meta.decode
        kernels.paged_decode_attention(kernel.lib, q[d.query_rows].float().contiguous(), cache.keys[0], cache.values[0],
                                       d.context_slots, d.lengths, cache.positions, kernel.shift_cos, kernel.shift_sin,
                                       kernel.max_shift, 0.125, counts)
        stats[0] = int(counts[0]) * len(cache.keys)
    else:
        stats[0] = sum(len(t) for t in tables) * cache.keys[0].shape[1] * len(cache.keys)
    return best, result[-1], stats[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1300, 4096])
    parser.add_argument("--shared", type=float, nargs="+", default=[0.0, 0.6])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/decode.json")
    args = parser.parse_args()
    llm = LLM(kv_cache_bytes=int(1.2 * max(args.agents) * max(args.context) * 2 * 30 * 3 * 64 * 4) + 2**26)
    engine = llm.engine
    model, runner = engine.runner.model, engine.runner
    kernel = model.attention.decode
    if kernel is None:
        sys.exit("the paged decode kernel is not available here (no C compiler?)")
    config = engine.model_config
    row_bytes = 2 * config.head_dim * engine.runner.kv_cache.keys[0].element_size()  # K and V of one head
    generator = torch.Generator().manual_seed(0)
    print(f"dtype {engine.dtype}, CPU {engine.cpu.describe()}, {torch.get_num_threads()} threads; "
          "attention of one decode step over all 30 layers")
    header = (f"{'agents':>6}{'context':>8}{'shared':>7}{'eager ms':>10}{'kernel ms':>10}{'speedup':>8}"
              f"{'eager tok/s':>12}{'kernel tok/s':>13}{'eager MB':>9}{'kernel MB':>10}{'fewer':>6}")
    print(header)
    rows = []
    for agents in args.agents:
        for context in args.context:
            for shared in args.shared:
                tables = build_tables(runner, agents, context, shared, generator)
                q = torch.randn(agents, config.num_heads, config.head_dim, generator=generator).to(model.dtype)
                eager, ref, eager_rows = step_seconds(model, runner, tables, q, None, args.repeats)
                fast, got, kernel_rows = step_seconds(model, runner, tables, q, kernel, args.repeats)
                error = (ref.float() - got.float()).abs().max().item()
                row = {"agents": agents, "context": context, "shared": shared, "eager_ms": 1000 * eager,
                       "kernel_ms": 1000 * fast, "eager_mb": eager_rows * row_bytes / 2**20,
                       "kernel_mb": kernel_rows * row_bytes / 2**20, "max_abs_diff": error}
                rows.append(row)
                print(f"{agents:>6}{context:>8}{shared:>7.1f}{row['eager_ms']:>10.1f}{row['kernel_ms']:>10.1f}"
                      f"{eager / fast:>7.2f}x{agents / eager:>12.0f}{agents / fast:>13.0f}"
                      f"{row['eager_mb']:>9.1f}{row['kernel_mb']:>10.1f}{row['eager_mb'] / row['kernel_mb']:>5.1f}x",
                      flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dtype": engine.dtype, "cpu_capability": engine.cpu.capability,
                               "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
