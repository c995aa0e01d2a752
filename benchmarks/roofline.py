"""Plain serving against the machine's roofline: the shape of `vllm bench serve --random-input-len
1024 --random-output-len 128 --num-prompts 32 --max-concurrency 16`, in process, with the engine's
account (model/roofline.py) of where the forward time goes.

    .venv/bin/python benchmarks/roofline.py [--prompts 32] [--concurrency 16] [--input 1024] [--output 128]

Prompts are random token ids (as vLLM's random dataset), greedy, ignore_eos, `--concurrency` at a
time. Prints per kind of forward (prefill, decode) its work, time, roofline time and efficiency,
the sampler's and the rest's time, and the TPOT (decode time per output token of a request).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokendance import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input", type=int, default=1024)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/roofline.json")
    args = parser.parse_args()
    llm = LLM(max_num_seqs=args.concurrency)
    llm.warm_up()
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(1000, vocab) for _ in range(args.input)] for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    before = engine.account.snapshot()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)  # the scheduler runs max_num_seqs at a time
    seconds = time.perf_counter() - started
    work = engine.account.since(before)
    peaks = engine.peaks
    tpot = sum((o.finish_time - o.first_token_time) / (o.num_generated_tokens - 1) for o in outputs) / len(outputs)
    ttft = sum(o.first_token_time - o.arrival_time for o in outputs) / len(outputs)
    print(f"{engine.dtype}, CPU {engine.cpu.describe()}; peaks: {peaks.describe()}")
    print(f"{args.prompts} prompts x {args.input} in / {args.output} out, {args.concurrency} at a time: "
          f"{seconds:.2f} s, mean TTFT {ttft * 1000:.0f} ms, mean TPOT {tpot * 1000:.1f} ms")
    print(f"{'kind':<9}{'rows':>8}{'lin GF':>9}{'attn GF':>9}{'MB':>9}{'s':>8}{'roof s':>8}{'eff':>6}")
    rows = {}
    for kind, w in work.kinds.items():
        if not w.rows:
            continue
        roof = w.roofline_seconds(peaks)
        rows[kind] = {**w.__dict__, "roofline_seconds": roof}
        print(f"{kind:<9}{w.rows:>8}{w.linear_flops / 1e9:>9.0f}{w.attention_flops / 1e9:>9.0f}"
              f"{(w.weight_bytes + w.kv_bytes) / 1e6:>9.0f}{w.seconds:>8.2f}{roof:>8.2f}{roof / w.seconds:>6.0%}")
    total = work.total()
    roof = sum(r["roofline_seconds"] for r in rows.values())
    print(f"{'all':<9}{'':>35}{seconds:>8.2f}{roof:>8.2f}{roof / seconds:>6.0%}  (forward {total.seconds:.2f} s, "
          f"sampler {work.sampling_seconds:.2f} s, other {seconds - total.seconds - work.sampling_seconds:.2f} s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpu": engine.cpu.describe(), "dtype": engine.dtype,
                               "peaks": peaks.__dict__, "seconds": seconds, "ttft_s": ttft, "tpot_s": tpot,
                               "kinds": rows, "sampling_seconds": work.sampling_seconds}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
