"""Prefill attention of one request, PyTorch SDPA (what runs without the kernel: causal flash, or
explicit masks in parts by position) against the bf16 prefill kernel, side by side in one run.

    .venv/bin/python benchmarks/prefill_kernel.py [--keys 1300 2900] [--repeats 5]

Shapes of the default model (9 query heads over 3 KV heads of 64), bf16, per layer:
- causal: a whole prompt of L tokens;
- chunk: the last 256 tokens of a prompt over the cached rest;
- recompute: a round's recomputed tokens (5% of the context, scattered) plus a private tail of 15%,
  over the whole context, as a reusing agent's prefill is.
Keys sit at the positions they are read at (no rotation), in slots 0..L-1 of a pool of L slots.
Needs a CPU with AVX512-BF16 (the kernel is built only there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokendance.model.attention import AttentionKernels, FusedKeyReader, PrefillAttention, PrefillKernel  # noqa: E402
from tokendance.model.attention import prefill_attention  # noqa: E402
from tokendance.model.platform import probe_cpu  # noqa: E402
from tokendance.model.roofline import best_seconds  # noqa: E402
from tokendance.model.runner import key_prefix_chunks  # noqa: E402


def query_positions(shape: str, keys: int, generator: torch.Generator) -> torch.Tensor:
    if shape == "causal":
        return torch.arange(keys)
    if shape == "chunk":
        return torch.arange(keys - 256, keys)
    tail = int(0.15 * keys)
    scattered = torch.randperm(keys - tail, generator=generator)[: int(0.05 * keys)]
    return torch.cat([torch.sort(scattered).values, torch.arange(keys - tail, keys)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[1300, 2900])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/prefill_kernel.json")
    args = parser.parse_args()
    max_shift = max(args.keys)
    no_turn = (torch.ones(2 * max_shift + 1, 1, 32), torch.zeros(2 * max_shift + 1, 1, 32))  # every key at its position
    kernel = PrefillKernel.load(torch.bfloat16, 64, *no_turn, max_shift)
    if kernel is None:
        sys.exit("the bf16 prefill kernel is not built here (it needs AVX512-BF16 and a C compiler)")
    sdpa, fast = AttentionKernels(FusedKeyReader()), AttentionKernels(FusedKeyReader(), prefill=kernel)
    generator = torch.Generator().manual_seed(0)
    print(f"bf16, CPU {probe_cpu().describe()}, {torch.get_num_threads()} threads; one layer, 9 heads over 3 KV heads")
    print(f"{'shape':>10}{'keys':>6}{'queries':>8}{'SDPA ms':>9}{'kernel ms':>10}{'speedup':>8}{'kernel GFLOP/s':>15}")
    rows = []
    for keys in args.keys:
        cache_k = torch.randn(keys, 3, 64, generator=generator).bfloat16()
        cache_v = torch.randn(keys, 3, 64, generator=generator).bfloat16()
        slots = torch.arange(keys)
        for shape in ("causal", "chunk", "recompute"):
            positions = query_positions(shape, keys, generator)
            q = torch.randn(len(positions), 9, 64, generator=generator).bfloat16()
            new_k, new_v = cache_k[positions], cache_v[positions]
            if shape == "causal":
                meta = PrefillAttention(0, len(positions), None)
            else:
                parts = tuple((a, b, n, torch.arange(n)[None, :] <= positions[a:b, None])
                              for a, b, n in key_prefix_chunks(positions.tolist()))
                meta = PrefillAttention(0, len(positions), slots, None, parts, positions + 1)
            seconds = [best_seconds(lambda run=run: prefill_attention(q, new_k, new_v, cache_k, cache_v, meta, run, slots),
                             args.repeats) for run in (sdpa, fast)]
            flops = 4 * 64 * 9 * int((positions + 1).sum())  # scores and weighted values of the keys attended
            row = {"shape": shape, "keys": keys, "queries": len(positions), "sdpa_ms": 1000 * seconds[0],
                   "kernel_ms": 1000 * seconds[1], "speedup": seconds[0] / seconds[1],
                   "kernel_gflops": flops / seconds[1] / 1e9}
            rows.append(row)
            print(f"{shape:>10}{keys:>6}{len(positions):>8}{row['sdpa_ms']:>9.2f}{row['kernel_ms']:>10.2f}"
                  f"{row['speedup']:>7.2f}x{row['kernel_gflops']:>15.0f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": probe_cpu().describe(), "threads": torch.get_num_threads(), "rows": rows},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
