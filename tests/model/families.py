"""Small random-weight models of each supported family, written by transformers with that
family's config class (a few layers, GQA, realistic head sizes), with the default model's
tokenizer: the tests' stand-ins for Qwen2.5, Qwen3, Llama 3.x and Mistral checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch

COMMON = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, eos_token_id=2,
              tie_word_embeddings=False)

FAMILIES = {  # name: (config class, its arguments beyond COMMON)
    "llama-3 (llama3 RoPE)": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama (linear RoPE)": ("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                  "factor": 4.0})),
    "llama (YaRN)": ("LlamaConfig", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                          "original_max_position_embeddings": 256})),
    "qwen2": ("Qwen2Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": ("Qwen3Config", dict(head_dim=128, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=512)),
}


def write_family(folder: Path, family: str, tokenizer_folder: Path, seed: int = 0):
    """The family's random model saved in `folder` (safetensors + config.json + the tokenizer);
    returns the transformers model (float32, eval)."""
    import transformers

    class_name, extra = FAMILIES[family]
    config_class = getattr(transformers, class_name)
    config = config_class(**{**COMMON, **extra})
    model_class = getattr(transformers, class_name.replace("Config", "ForCausalLM"))
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # attention far from uniform, peaked next-token distributions, biases and norms not trivial
        for name, parameter in model.named_parameters():
            if "proj" in name:
                parameter.normal_(0, 0.08)
            elif "embed_tokens" in name or "lm_head" in name:
                parameter.normal_(0, 0.3)
            elif "q_norm" in name or "k_norm" in name:
                parameter.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_folder / name).read_bytes())
    return model


def save_tokenizer(folder: Path, tokenizer) -> Path:
    """The default model's tokenizer, as the folder format stores it."""
    tokenizer._tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))  # ChatML, as SmolLM2
    return folder
