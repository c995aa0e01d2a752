"""Generative Agents rounds in `vllm.LLM` as the plugin is measured (benchmarks/vllm_plugin.py):
the CPU's dtype (bf16 where it is native, else float32), the connector's default settings (EPIC,
the default recompute ratio), compiled where bf16 is native (elsewhere `enforce_eager`: vLLM's
compile would take most of `make test`'s budget on the slow machines). Each round runs tagged, then
the same prompts untagged under other salts: vLLM's exact computation. Writes OUT.pt:

- `dtype`, `compiled`, and the connector's `counters` ({name{label}: value}) after all rounds;
- `rounds`, one per seed: the agents' `prompts` (token ids) and `role`s; the first token's
  `kl` (KL(exact || round) over the whole vocabulary) and `same_top1`; `layer0`: the largest
  difference of keys and of values at layer 0 between the agent's KV in the round and vLLM's
  exact KV at the same positions, relative to the largest exact value, over the prompt; and
  `shifted`: the same one position off (what a copy to the wrong position shows).

    python tests/vllm_plugin/measured_round.py MODEL_FOLDER OUT.pt NUM_AGENTS SEED[,SEED...]

Run in a subprocess (vLLM keeps one engine per process well)."""

import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from tokendance.model.platform import probe_cpu  # noqa: E402
from tokendance.workloads.generative_agents import GenerativeAgents  # noqa: E402


def main():
    folder, out, num_agents, seeds = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")]
    native_bf16 = probe_cpu().native_bf16
    dtype = "bfloat16" if native_bf16 else "float32"
    llm = LLM(model=folder, dtype=dtype, enforce_eager=not native_bf16, max_model_len=4096, enable_prefix_caching=True,
              seed=0, max_logprobs=-1, disable_log_stats=False, kv_transfer_config=KVTransferConfig(kv_connector="TokenDanceConnector", kv_role="kv_both"))
    blocks = record_blocks(llm)
    rounds = []
    for seed in seeds:
        prompts = round_prompts(llm, num_agents, seed)
        reused, tags, reused_kv = run(llm, prompts, blocks, f"reused{seed}", round_id=f"r{seed}")
        exact, _, exact_kv = run(llm, prompts, blocks, f"exact{seed}")
        kl = {a: (exact[a].exp() * (exact[a] - reused[a])).nan_to_num().sum().item() for a in prompts}
        rounds.append({"seed": seed, "prompts": prompts, "role": {a: t.get("role") for a, t in tags.items()},
                       "kl": kl, "same_top1": {a: exact[a].argmax().item() == reused[a].argmax().item() for a in prompts},
                       "layer0": {a: layer0_error(reused_kv[a], exact_kv[a]) for a in prompts},
                       "shifted": {a: layer0_error([t[1:] for t in reused_kv[a]], [t[:-1] for t in exact_kv[a]])
                                   for a in prompts}})
    torch.save({"dtype": dtype, "compiled": native_bf16, "rounds": rounds, "counters": counters(llm)}, out)


def round_prompts(llm, num_agents: int, seed: int) -> dict:
    """Round 2 of Generative Agents (round 1's synthetic outputs shared), as vLLM's chat template renders it."""
    tokenizer = llm.get_tokenizer()
    workload = GenerativeAgents(num_agents, seed=seed, memory_lines=(8, 12))
    return {t.agent_id: list(tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])
            for t in workload.turns(1, [workload.synthetic_outputs(0)])}


def record_blocks(llm) -> dict:
    """{prompt: the blocks vLLM held it in}, filled as the connector sees requests finish."""
    blocks = {}
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    finished = connector.request_finished

    def recording(request, block_ids):
        groups = block_ids if block_ids and isinstance(block_ids[0], (list, tuple)) else [block_ids]
        blocks[tuple(request.prompt_token_ids)] = [b for group in groups for b in group]
        return finished(request, block_ids)

    connector.request_finished = recording
    return blocks


def run(llm, prompts: dict, blocks: dict, salt: str, round_id: str | None = None):
    """The prompts' first tokens (a round when `round_id` is given): per agent the log-probabilities
    over the vocabulary, the connector's tag, and layer 0's K and V over the prompt (read before
    the next run takes the blocks freed; the last prompt token's KV is written with the next step)."""
    params = [SamplingParams(temperature=0, max_tokens=1, logprobs=-1, flat_logprobs=True, detokenize=False, extra_args={"kv_transfer_params": {
        "tokendance": {"round_id": round_id, "round_size": len(prompts), "agent_id": a}}} if round_id else None)
        for a in prompts]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=f"{salt}-{a}") for a, ids in prompts.items()],
                           params, use_tqdm=False)
    vocab = len(llm.get_tokenizer())
    logprobs = {}
    for agent, output in zip(prompts, outputs):
        flat = output.outputs[0].logprobs  # one position: the first output token's
        logprobs[agent] = torch.full((vocab,), float("-inf"))
        logprobs[agent][flat.token_ids] = torch.tensor(flat.logprobs)
    tags = {a: (o.kv_transfer_params or {}).get("tokendance") or {} for a, o in zip(prompts, outputs)}
    mirror_pass = get_kv_transfer_group().worker._pass()
    kv = {a: [t.clone() for t in mirror_pass.layouts[0].read(mirror_pass._slots(blocks[tuple(ids)], 0, len(ids) - 1))]
          for a, ids in prompts.items()}
    return logprobs, tags, kv


def layer0_error(got, want) -> dict:
    """The largest difference of keys and of values, relative to the largest exact value."""
    return {name: (g.float() - w.float()).abs().max().item() / w.float().abs().max().item()
            for name, g, w in zip(("keys", "values"), got, want)}


def counters(llm) -> dict:
    found = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:tokendance_") and hasattr(m, "value"):
            key = m.name + "".join(f"{{{v}}}" for k, v in m.labels.items() if k in ("reason", "phase", "role", "formed"))
            found[key] = found.get(key, 0) + m.value
    return found


if __name__ == "__main__":
    main()
