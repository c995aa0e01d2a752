"""Fidelity of the vLLM plugin's reuse against vLLM's own full computation, teacher-forced:

    .venv-vllm/bin/python benchmarks/vllm_plugin_fidelity.py --agents 16 --ratios 1.0 0.05 --anchors 1 2 \
        [--selection cacheblend]

For each agent of a Generative Agents round: vLLM computes its prompt in full and writes a greedy
continuation C (the reference, with the top-20 log-probs at each step); then the round's prompts
with C appended are sent again as one tagged round (each agent its own salt), asking vLLM for the
prompt log-probs of C, which it computes over the connector's KV (`skip_reading_prefix_cache`
False: the claimed range is read, C is computed). Reported per ratio and in-round anchor count
(each pair its own round): KL(full || reused) over the
top-20 tokens both sides returned (renormalized; a lower bound of the full KL), its p99, top-1
agreement and the continuation's mean log-prob change. In-process `vllm.LLM`, enforce_eager.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def kl(reference: dict, reused: dict) -> float:
    """KL over the tokens both top-k lists hold, each side renormalized on them."""
    common = [t for t in reference if t in reused]
    p = [math.exp(reference[t]) for t in common]
    q = [math.exp(reused[t]) for t in common]
    zp, zq = sum(p), sum(q)
    return sum(a / zp * math.log((a / zp) / (b / zq)) for a, b in zip(p, q) if a > 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="continuation length scored per agent")
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 0.05])
    parser.add_argument("--selection", default=None, help="the connector's selection (default: its own)")
    parser.add_argument("--anchors", type=int, nargs="+", default=[1], help="in-round anchor counts")
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from tokendance.model.platform import probe_cpu
    from tokendance.vllm_plugin.model_folder import default_model_folder
    from tokendance.workloads import make_workload

    cpu = probe_cpu()
    dtype = args.dtype or ("bfloat16" if cpu.native_bf16 else "float32")
    extra = {} if args.selection is None else {"selection": args.selection}
    llm = LLM(model=str(default_model_folder()), dtype=dtype, max_model_len=8192, enable_prefix_caching=True,
              enforce_eager=True, seed=0, kv_transfer_config=KVTransferConfig(
                  kv_connector="TokenDanceConnector", kv_role="kv_both", kv_connector_extra_config=extra))
    from tokendance.vllm_plugin.connector import Settings

    selection = Settings.from_extra(extra).selection
    tokenizer = llm.get_tokenizer()
    workload = make_workload("generative-agents", args.agents, seed=0)
    turns = workload.turns(0, [])
    prompts = [list(tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]) for t in turns]
    full = llm.generate([TokensPrompt(prompt_token_ids=p, cache_salt=f"full-{t.agent_id}") for p, t in zip(prompts, turns)],
                        SamplingParams(temperature=0, max_tokens=args.tokens, logprobs=20, ignore_eos=True), use_tqdm=False)
    print(f"generative-agents N={args.agents}, {dtype}, CPU {cpu.describe()}, selection {selection}; "
          f"{args.tokens} teacher-forced tokens per agent")
    print(f"{'ratio':>6}{'anchors':>8}{'KL mean':>10}{'KL p99':>10}{'top-1 agree':>13}{'logprob change':>16}{'mirrors':>9}")
    settings = [(ratio, anchors) for ratio in args.ratios for anchors in args.anchors]
    for round_index, (ratio, anchors) in enumerate(settings):
        scored = []
        for p, t, f in zip(prompts, turns, full):
            tag = {"round_id": f"fid-{round_index}", "round_size": len(turns), "agent_id": t.agent_id,
                   "recompute_ratio": ratio, "anchors": anchors}
            scored.append((TokensPrompt(prompt_token_ids=p + list(f.outputs[0].token_ids), cache_salt=f"r{round_index}-{t.agent_id}"),
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20, skip_reading_prefix_cache=False, detokenize=False,
                                          extra_args={"kv_transfer_params": {"tokendance": tag}})))
        outputs = llm.generate([s[0] for s in scored], [s[1] for s in scored], use_tqdm=False)
        kls, agree, change, mirrors = [], 0, [], 0
        for p, f, o in zip(prompts, full, outputs):
            mirrors += ((o.kv_transfer_params or {}).get("tokendance") or {}).get("role") == "mirror"
            generated = list(f.outputs[0].token_ids)
            for step, token in enumerate(generated):
                reference = {t: lp.logprob for t, lp in f.outputs[0].logprobs[step].items()}
                at = o.prompt_logprobs[len(p) + step]  # the distribution that predicts this token
                reused = {t: lp.logprob for t, lp in at.items()}
                kls.append(kl(reference, reused))
                agree += max(reference, key=reference.get) == max(reused, key=reused.get)
                change.append(reused.get(token, float("nan")) - reference[token])
        kls.sort()
        print(f"{ratio:>6.2f}{anchors:>8}{sum(kls) / len(kls):>10.4f}{kls[int(0.99 * (len(kls) - 1))]:>10.4f}"
              f"{agree / len(kls):>13.3f}{sum(change) / len(change):>16.4f}{mirrors:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
