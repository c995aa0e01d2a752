"""The engine's forward pass against transformers loading the same GGUF (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import CHAT_QUESTIONS, LOGIT_ATOL
from tokendance import LLM, SamplingParams
from tokendance.model.platform import probe_cpu



def long_prompt(llm: LLM) -> list[int]:
    text = " ".join(
        f"Agent {i} reports that the market in district {i % 7} sold {i * 3} apples and {i + 11} pears."
        for i in range(80)
    )
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 1000
    return ids


def reference_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def test_prefill_and_decode_logits_match_transformers(llm_fp32, hf_model):
    prompts = [llm_fp32.tokenizer.encode(llm_fp32.render_chat([{"role": "user", "content": q}])) for q in CHAT_QUESTIONS[:2]]
    prompts.append(long_prompt(llm_fp32))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True)
    outputs = llm_fp32.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        full = prompt + output.token_ids
        ref = reference_logits(hf_model, full)
        assert len(output.logits) == 6
        for step, logits in enumerate(output.logits):  # step 0 = end of prefill, then decode steps
            position = len(prompt) - 1 + step
            diff = (logits - ref[position]).abs().max().item()
            assert diff < LOGIT_ATOL, f"step {step}: max |logit diff| {diff}"


def test_chunked_prefill_matches_transformers(make_llm, hf_model, loaded_model):
    llm = make_llm(dtype="float32", max_num_batched_tokens=97, enable_prefix_caching=False)
    prompt = long_prompt(llm)[:400]
    (output,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, return_logits=True))
    ref = reference_logits(hf_model, prompt + output.token_ids)
    assert (output.logits[0] - ref[len(prompt) - 1]).abs().max().item() < LOGIT_ATOL
    assert (output.logits[1] - ref[len(prompt)]).abs().max().item() < LOGIT_ATOL


def test_batched_greedy_generation_is_token_identical(llm_fp32, hf_model):
    conversations = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=40)
    outputs = llm_fp32.chat(conversations, params)  # prompts of different lengths share steps
    assert len({o.num_prompt_tokens for o in outputs}) > 1
    for output in outputs:
        with torch.no_grad():
            generated = hf_model.generate(
                torch.tensor([output.prompt_token_ids]), max_new_tokens=40, do_sample=False,
                eos_token_id=2, pad_token_id=2,
            )[0, output.num_prompt_tokens:].tolist()
        assert output.token_ids == generated
        assert output.num_generated_tokens >= 8


@pytest.mark.skipif(not probe_cpu().native_bf16, reason="packed bf16: this CPU has no native bf16 (AVX512-BF16/AMX)")
def test_bf16_stays_close_to_the_fp32_reference(make_llm, hf_model):
    """bf16 (the auto dtype on CPUs with native bf16) changes the next-token distribution by a KL of ~1e-3; its greedy
    choice may differ from fp32 only where the reference itself is a near-tie."""
    llm = make_llm(dtype="bfloat16")
    prompts = [llm.tokenizer.encode(llm.render_chat([{"role": "user", "content": q}])) for q in CHAT_QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=1, return_logits=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        ref = reference_logits(hf_model, prompt)[-1]
        ours = output.logits[0]
        kl = torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum")
        assert kl.item() < 0.02
        margin = ref.max() - ref[ours.argmax()]  # 0 when the greedy choices agree
        assert margin.item() < 0.1


def test_hugging_face_folder_loads_the_same_model(tmp_path, hf_model, llm_fp32):
    from transformers import AutoTokenizer

    from tokendance.model.loader import default_model_path

    path = default_model_path()
    hf_model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    prompt = CHAT_QUESTIONS[1]
    assert llm.tokenizer.encode(prompt) == llm_fp32.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=12, return_logits=True)
    ours = llm.chat([{"role": "user", "content": prompt}], params)[0]
    base = llm_fp32.chat([{"role": "user", "content": prompt}], params)[0]
    assert ours.token_ids == base.token_ids
    assert (ours.logits[0] - base.logits[0]).abs().max().item() < LOGIT_ATOL
