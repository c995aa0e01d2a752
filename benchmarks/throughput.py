"""Prefill and decode throughput of the engine vs transformers on the same model, in one run.

    .venv/bin/python benchmarks/throughput.py [--dtypes bfloat16 float32] [--out benchmarks/results/throughput.json]

Default dtypes: bfloat16 and float32 where the CPU has native bf16, else float32 only (bf16 there is
several times slower and not what the engine picks). The CPU capability is printed with the table.

Prefill: 8 prompts x 512 tokens, one new token each. Decode: batch 1 and batch 16, 128 new tokens
after a 64-token prompt; decode rate = extra tokens / extra time over a 1-token run, so prefill is
excluded. Also measures this machine's matmul peak and reports prefill as a fraction of it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokendance import LLM, SamplingParams  # noqa: E402
from tokendance.model.loader import default_model_path, load_model  # noqa: E402
from tokendance.model.platform import probe_cpu  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PREFILL_BATCH, PREFILL_LEN = 8, 512
DECODE_PROMPT, DECODE_NEW = 64, 128


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    """Best GFLOP/s of a square matmul."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def flops_per_token(config, context: int) -> float:
    """Matmul FLOPs of one prefill token: projections + MLP + attention over `context` keys
    (the LM head runs once per sequence, not per token)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    proj = h * (config.num_heads + 2 * config.num_kv_heads) * d + config.num_heads * d * h
    mlp = 3 * h * i
    attention = 2 * config.num_heads * d * context
    return 2 * config.num_layers * (proj + mlp + attention / 2)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (count, length), generator=g).tolist()


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_engine(loaded, dtype: str, repeats: int) -> dict:
    llm = LLM(loaded, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=4096)
    vocab = loaded.config.vocab_size
    prefill_prompts = random_prompts(PREFILL_BATCH, PREFILL_LEN, vocab, 0)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prefill_prompts[:2], one)  # warm-up
    prefill_s = best_of(lambda: llm.generate(prefill_prompts, one), repeats)
    result = {"prefill_tok_s": PREFILL_BATCH * PREFILL_LEN / prefill_s}
    for batch in (1, 16):
        prompts = random_prompts(batch, DECODE_PROMPT, vocab, batch)
        many = SamplingParams(temperature=0, max_tokens=DECODE_NEW + 1, ignore_eos=True)
        short = best_of(lambda: llm.generate(prompts, one), repeats)
        full = best_of(lambda: llm.generate(prompts, many), max(1, repeats - 1))
        result[f"decode_b{batch}_tok_s"] = batch * DECODE_NEW / (full - short)
    return result


def bench_transformers(dtype: str, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM, GgufConfig

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name,
        quantization_config=GgufConfig(dequantize=True), dtype=DTYPES[dtype],
    ).eval()
    vocab = model.config.vocab_size
    prefill = torch.tensor(random_prompts(PREFILL_BATCH, PREFILL_LEN, vocab, 0))
    with torch.inference_mode():
        model(prefill[:2])
        prefill_s = best_of(lambda: model(prefill), repeats)
        result = {"prefill_tok_s": PREFILL_BATCH * PREFILL_LEN / prefill_s}
        for batch in (1, 16):
            ids = torch.tensor(random_prompts(batch, DECODE_PROMPT, vocab, batch))

            def gen(n):
                return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)

            short = best_of(gen(1), repeats)
            full = best_of(gen(DECODE_NEW + 1), max(1, repeats - 1))
            result[f"decode_b{batch}_tok_s"] = batch * DECODE_NEW / (full - short)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    cpu = probe_cpu()
    dtypes = args.dtypes or (["bfloat16", "float32"] if cpu.native_bf16 else ["float32"])

    loaded = load_model()
    flops = flops_per_token(loaded.config, PREFILL_LEN // 2)
    rows = []
    for dtype in dtypes:
        peak = matmul_peak(DTYPES[dtype])
        systems = {"tokendance": bench_engine(loaded, dtype, args.repeats)}
        if not args.skip_transformers:
            systems["transformers"] = bench_transformers(dtype, args.repeats)
        for system, r in systems.items():
            r.update(system=system, dtype=dtype, matmul_peak_gflops=peak,
                     prefill_peak_fraction=r["prefill_tok_s"] * flops / 1e9 / peak)
            rows.append(r)
    print(f"CPU capability {cpu.capability} ({cpu.describe()}), {torch.get_num_threads()} threads")
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "cpu_capability": cpu.capability,
                                "native_bf16": cpu.native_bf16, "results": rows}, indent=2))
    print(f"\nwrote {out}")


def print_table(rows: list[dict]) -> None:
    header = f"{'system':<13}{'dtype':<10}{'prefill tok/s':>14}{'decode b1':>11}{'decode b16':>12}{'% of peak':>11}{'peak GF/s':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['system']:<13}{r['dtype']:<10}{r['prefill_tok_s']:>14.0f}{r['decode_b1_tok_s']:>11.1f}"
              f"{r['decode_b16_tok_s']:>12.1f}{100 * r['prefill_peak_fraction']:>10.1f}%{r['matmul_peak_gflops']:>11.0f}")
    for dtype in sorted({r["dtype"] for r in rows}):
        ours = next((r for r in rows if r["dtype"] == dtype and r["system"] == "tokendance"), None)
        ref = next((r for r in rows if r["dtype"] == dtype and r["system"] == "transformers"), None)
        if ours and ref:
            print(f"{dtype}: tokendance / transformers  prefill {ours['prefill_tok_s'] / ref['prefill_tok_s']:.2f}x"
                  f"  decode b1 {ours['decode_b1_tok_s'] / ref['decode_b1_tok_s']:.2f}x"
                  f"  decode b16 {ours['decode_b16_tok_s'] / ref['decode_b16_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
