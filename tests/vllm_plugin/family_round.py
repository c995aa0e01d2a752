"""One round of four agents in `vllm.LLM` with the connector at recompute ratio 1.0, and the same
prompts computed exactly; writes each agent's role, claimed tokens and first-token log-probs
(both ways) as JSON. Run in a subprocess per model (vLLM keeps one engine per process well):

    python tests/vllm_plugin/family_round.py MODEL_FOLDER OUT.json [SETTINGS_JSON [ENGINE_JSON [SAMPLING_JSON]]]

(SETTINGS_JSON: more of the connector's settings, e.g. '{"recompute_ratio": 0.3}'; ENGINE_JSON:
more of `vllm.LLM`'s arguments, e.g. '{"tensor_parallel_size": 2}'; SAMPLING_JSON: of
`SamplingParams`', e.g. '{"max_tokens": 160, "ignore_eos": true}'.) Also writes each agent's output
`tokens`, `preemptions` (vLLM's count, where its stats are on: '{"disable_log_stats": false}'), and
`layer0` (where TOKENDANCE_LAYER0 is set; a model with q/k norms is not handled): layer 0's keys of a
prompt moved by the connector's rotation against keys computed there.
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

NAMES = ["Ann", "Ben", "Cal", "Dee"]


def main():
    folder, out = sys.argv[1], sys.argv[2]
    settings = {"recompute_ratio": 1.0, **json.loads(sys.argv[3] if len(sys.argv) > 3 else "{}")}
    engine = json.loads(sys.argv[4] if len(sys.argv) > 4 else "{}")
    sampling = {"max_tokens": 2, **json.loads(sys.argv[5] if len(sys.argv) > 5 else "{}")}
    engine = {"dtype": "float32", "max_model_len": 2048, "enable_prefix_caching": True, "enforce_eager": True, "seed": 0,
              "block_size": 32, **engine}
    llm = LLM(model=folder, kv_transfer_config=KVTransferConfig(kv_connector="TokenDanceConnector", kv_role="kv_both",
                                                                kv_connector_extra_config=settings), **engine)
    tokenizer = llm.get_tokenizer()
    said = "\n".join(f"[{n}]: the bridge needs {i + 2} new planks before the market, and {n} will bring rope."
                     for i, n in enumerate(NAMES))
    prompts = {}
    for i, name in enumerate(NAMES):
        messages = [{"role": "system", "content": f"You are {name}. " + "You keep bees and sell honey. " * (i + 1)},
                    {"role": "user", "content": f"Last round:\n{said}\nWhat do you do now, {name}?"}]
        prompts[name] = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])

    def run(salt, tagged):
        params = [SamplingParams(temperature=0, logprobs=5, **sampling, extra_args={"kv_transfer_params": {
            "tokendance": {"round_id": "r", "round_size": 4, "agent_id": n}}} if tagged else None) for n in NAMES]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompts[n], cache_salt=f"{salt}-{n}") for n in NAMES],
                               params, use_tqdm=False)
        return {n: {"role": ((o.kv_transfer_params or {}).get("tokendance") or {}).get("role"),
                    "claimed": ((o.kv_transfer_params or {}).get("tokendance") or {}).get("claimed_tokens", 0),
                    "first": {str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()},
                    "tokens": list(o.outputs[0].token_ids)}
                for n, o in zip(NAMES, outputs)}

    reused, exact = run("reused", True), run("exact", False)
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") \
        if llm.llm_engine.log_stats else None
    layer0 = layer0_moved(prompts) if os.environ.get("TOKENDANCE_LAYER0") else None
    json.dump({"reused": reused, "exact": exact, "preemptions": preemptions, "layer0": layer0}, open(out, "w"))


def layer0_moved(prompts: dict) -> dict:
    """Layer 0's K/V of one agent's prompt computed at its own positions, moved by the connector's
    `KeyRotator` to 517 positions later, against K/V computed there (layer 0 reads no context: its
    K/V at a position depend on the token alone): the keys' relative error, the values' max error."""
    import torch

    from tokendance.vllm_plugin import model_handoff as handoff
    from tokendance.vllm_plugin.worker.mirror_pass import KeyRotator

    model = handoff.model()
    inner = getattr(model, "model", model)
    attn = inner.layers[0].self_attn
    tokens = torch.tensor(prompts[NAMES[0]])
    src = torch.arange(len(tokens))
    dst = src + 517

    def kv_at(positions):
        with torch.no_grad():
            hidden = inner.layers[0].input_layernorm(inner.embed_tokens(tokens))
            qkv, _ = attn.qkv_proj(hidden)
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            _, k = attn.rotary_emb(positions, q, k)
        heads = attn.kv_size // attn.head_dim
        return k.view(len(tokens), heads, attn.head_dim), v

    (k_src, v_src), (k_dst, v_dst) = kv_at(src), kv_at(dst)
    moved = KeyRotator(attn.rotary_emb)(k_src, src, dst)
    return {"key_relative_error": ((moved - k_dst).norm() / k_dst.norm()).item(),
            "value_max_error": (v_src - v_dst).abs().max().item(), "tokens": len(tokens)}


if __name__ == "__main__":  # (tensor-parallel workers are spawned: they import this file)
    main()
