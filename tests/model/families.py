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


GGUF_NAMES = {  # Hugging Face name (after "model.layers.N.") -> GGUF name (after "blk.N."), as llama.cpp converts
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_gguf(path: Path, model, tokenizer_gguf: Path, qtype_name: str = "F32", pre: str | None = None) -> None:
    """`model` (a transformers model of FAMILIES) as llama.cpp's converter writes it: the
    architecture's metadata, Llama 3's scaling as a `rope_freqs` tensor, Q/K rows of `llama`
    models interleaved, matrices in `qtype_name` (norms and biases in F32), and the default
    model's tokenizer metadata (its pre-tokenizer replaced by `pre`)."""
    import gguf
    import numpy as np

    from tokendance.model.rope import rope_frequencies

    config = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(config, "sliding_window", None) and config.model_type == "mistral":
        writer.add_sliding_window(config.sliding_window)
    if rope["rope_type"] in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope["rope_type"] == "llama3":
        from tokendance.model.families import config_from_hf

        ours = config_from_hf(config.to_dict(), "test")
        plain, _ = rope_frequencies(config.head_dim, rope["rope_theta"], None)
        scaled, _ = rope_frequencies(config.head_dim, rope["rope_theta"], ours.rope_scaling)
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    _copy_tokenizer_metadata(writer, tokenizer_gguf, pre)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        array = tensor.float().numpy()
        base, _, suffix = name.rpartition(".")
        if base.startswith("model.layers."):
            _, _, layer, part = base.split(".", 3)
            gguf_name = f"blk.{layer}.{GGUF_NAMES[part]}.{suffix}"
            if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if part == "self_attn.q_proj" else config.num_key_value_heads
                array = array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2)
                array = array.reshape(tensor.shape)
        else:
            gguf_name = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[base]
            gguf_name += "." + suffix
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_tokenizer_metadata(writer, source: Path, pre: str | None) -> None:
    from tokendance.model.gguf_file import read_gguf

    get = read_gguf(source)[0]
    writer.add_tokenizer_model(get["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(pre or get["tokenizer.ggml.pre"])
    writer.add_token_list(get["tokenizer.ggml.tokens"])
    writer.add_token_types(get["tokenizer.ggml.token_type"])
    writer.add_token_merges(get["tokenizer.ggml.merges"])
    writer.add_eos_token_id(get["tokenizer.ggml.eos_token_id"])
    writer.add_bos_token_id(get["tokenizer.ggml.bos_token_id"])
    writer.add_chat_template(get["tokenizer.chat_template"])
