"""The model families that load, and how a Hugging Face config.json or GGUF metadata becomes a
`ModelConfig`. What a config says and the engine cannot do is refused with `ModelLoadError`,
never ignored: a silently ignored RoPE scaling or bias gives wrong log-probs without a word.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokendance.config import ModelConfig
from tokendance.errors import ModelLoadError
from tokendance.model.rope import ROPE_TYPES, RopeScaling

logger = logging.getLogger("tokendance")


@dataclass(frozen=True)
class Family:
    """What sets a family apart from plain Llama."""

    name: str
    qkv_bias: bool = False  # q/k/v projections carry biases (o_proj none)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaved the Q/K rows' rotary pairs


FAMILIES = {
    "llama": Family("llama", gguf_permuted_qk=True),
    "mistral": Family("mistral", gguf_permuted_qk=True),
    "qwen2": Family("qwen2", qkv_bias=True),
    "qwen3": Family("qwen3", qk_norm=True),
}
SUPPORTED = (f"families {', '.join(FAMILIES)} (RoPE {', '.join(ROPE_TYPES)})")


def find_family(name: str | None, where: str) -> Family:
    if name not in FAMILIES:
        raise ModelLoadError(f"{where}: unsupported architecture {name!r} (supported: {SUPPORTED})")
    return FAMILIES[name]


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    """A config.json (transformers 4 or 5) as a ModelConfig."""
    family = find_family(hf.get("model_type"), where)
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("mlp_bias"):
        raise ModelLoadError(f"{where}: mlp_bias is not supported")
    if hf.get("attention_bias") and not family.qkv_bias:
        raise ModelLoadError(f"{where}: attention_bias is not supported for {family.name}")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise ModelLoadError(f"{where}: quantized checkpoints ({method}) are not supported: use the unquantized "
                             "folder or a GGUF file")
    # transformers 4 writes `rope_scaling` and `rope_theta`; transformers 5 `rope_parameters` holding both.
    rope_parameters = hf.get("rope_parameters") or {}
    rope = {**(hf.get("rope_scaling") or {}), **rope_parameters}
    if "partial_rotary_factor" in hf:
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    theta = float(rope_parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))
    max_positions = int(hf.get("max_position_embeddings", 2048))
    num_heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_model_len=_context_limit(hf, family, max_positions, where),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        architecture=family.name,
        attention_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        rope_scaling=RopeScaling.from_hf(rope, max_positions, where),
    )


def _context_limit(hf: dict, family: Family, max_positions: int, where: str) -> int:
    """max_position_embeddings, or the sliding window where the model slides one: within its window
    sliding-window attention is full attention, and longer contexts are refused."""
    layer_types = set(hf.get("layer_types") or ()) - {"full_attention"}
    if layer_types - {"sliding_attention"}:
        raise ModelLoadError(f"{where}: layer types {sorted(layer_types)} are not supported")
    slides = (hf.get("sliding_window") is not None if family.name == "mistral"
              else bool(hf.get("use_sliding_window")) or bool(layer_types))
    return _within_window(max_positions, hf.get("sliding_window") if slides else None, where)


def _within_window(max_positions: int, window, where: str) -> int:
    """The context limit of a model that slides a window (None: none): sliding-window attention is
    not implemented, and within its window it equals full attention."""
    if window is None or int(window) >= max_positions:
        return max_positions
    logger.warning("%s: sliding-window attention (window %d) is not implemented: contexts are limited to the "
                   "window, within which it equals full attention", where, int(window))
    return int(window)


def config_from_gguf(get, arch: str, vocab_size: int, tensor_names: set[str], where: str) -> ModelConfig:
    """GGUF metadata (`get(key, default)`) as a ModelConfig. Llama 3's scaling comes as a
    `rope_freqs` tensor (added by the loader); linear and YaRN scaling as metadata."""
    family = find_family(arch, where)
    num_heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    max_positions = _within_window(int(get(f"{arch}.context_length", 2048)),
                                   get(f"{arch}.attention.sliding_window"), where)
    eos, bos = get("tokenizer.ggml.eos_token_id"), get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(get(f"{arch}.vocab_size", vocab_size)),
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(get(f"{arch}.attention.key_length", hidden // num_heads)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_model_len=max_positions,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        architecture=family.name,
        attention_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        rope_scaling=_gguf_rope_scaling(get, arch, where),
    )


def _gguf_rope_scaling(get, arch: str, where: str) -> RopeScaling | None:
    kind = get(f"{arch}.rope.scaling.type", "none")
    factor = get(f"{arch}.rope.scaling.factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"{where}: GGUF rope.scaling.type {kind!r} is not supported (linear, yarn)")
    original = get(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and (original is None or get(f"{arch}.rope.scaling.attn_factor") is not None):
        raise ModelLoadError(f"{where}: GGUF YaRN scaling needs rope.scaling.original_context_length and no "
                             "attn_factor (llama.cpp's own factor is not supported)")
    return RopeScaling(kind=kind, factor=float(factor),
                       original_max_position_embeddings=None if original is None else int(original),
                       beta_fast=float(get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                       beta_slow=float(get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)))
