"""Llama shapes other than the default model's, from the Hugging Face folder format: random
weights written by transformers, loaded by the engine, logits compared with transformers'."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import LOGIT_ATOL
from tokendance import LLM, SamplingParams
from tokendance.model import kernels
from tokendance.model.loader import load_model

SHAPES = {  # name: (heads, KV heads, head size)
    "llama-2-7b heads: 32 KV heads, head size 128": (32, 32, 128),
    "GQA 8:1, head size 128": (32, 4, 128),
    "GQA 8:1, head size 64": (16, 2, 64),
}


pytestmark = pytest.mark.model  # random weights, but a whole model run per shape


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, tokenizer):
    """The default model's tokenizer, as the folder format stores it."""
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer._tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))  # ChatML, as SmolLM2
    return folder


def random_model_folder(folder, tokenizer_files, heads: int, kv_heads: int, head_dim: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(heads * 1000 + kv_heads * 10 + head_dim)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for name, parameter in model.named_parameters():
            if "proj" in name:
                parameter.normal_(0, 0.08)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_files / name).read_bytes())
    return model


@pytest.mark.parametrize("shape", list(SHAPES))
def test_llama_shapes_match_transformers(tmp_path, tokenizer_files, shape):
    heads, kv_heads, head_dim = SHAPES[shape]
    reference = random_model_folder(tmp_path, tokenizer_files, heads, kv_heads, head_dim)
    llm = LLM(load_model(tmp_path), dtype="float32", enable_prefix_caching=True)
    config = llm.engine.model_config
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (heads, kv_heads, head_dim)
    uses_kernel = llm.engine.runner.model.attention.decode is not None
    assert uses_kernel == (kernels.load() is not None and kernels.supports(kv_heads, heads, head_dim))
    prompts = [llm.tokenizer.encode("The weather in Paris today is " * 3),
               llm.tokenizer.encode("Agents gather in the square and talk about the harvest " * 6)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True))
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt + output.token_ids])).logits[0]
        for step, logits in enumerate(output.logits):  # the prefill, then decode steps
            diff = (logits - expected[len(prompt) - 1 + step]).abs().max().item()
            assert diff < LOGIT_ATOL, f"{shape}, step {step}: max |logit diff| {diff}"
