"""Logit adjustments (penalties, logit_bias, min_tokens) against transformers' logits processors
and OpenAI's written formula, model-free and through the engine."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tokendance import SamplingParams
from tokendance.errors import InvalidRequestError
from tokendance.sampling import TokenHistory, adjust_logits, draw


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's definition, token by token: logit -= count * frequency + (count > 0) * presence,
    counting the generated tokens only."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        for row in range(len(input_ids)):
            for token, count in Counter(input_ids[row, self.prompt_length:].tolist()).items():
                scores[row, token] -= count * self.frequency + self.presence
        return scores


def reference_processors(params: SamplingParams, prompt_length: int, stop_ids: list[int]) -> LogitsProcessorList:
    """The same adjustments from transformers, in vLLM's order: min_tokens and logit_bias, then
    the penalties."""
    processors = LogitsProcessorList()
    if params.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, params.min_tokens, stop_ids))
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias.items()}))
    if params.repetition_penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    processors.append(OpenAIPenalties(prompt_length, params.presence_penalty, params.frequency_penalty))
    return processors


ADJUSTMENTS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5),
    SamplingParams(min_tokens=4, logit_bias={3: 5.0, 7: -100.0, 11: 2.5}),
    SamplingParams(min_tokens=2, repetition_penalty=1.1, presence_penalty=0.3, logit_bias={5: -1.0}),
]


def test_adjusted_logits_equal_the_reference_processors_row_by_row():
    generator = torch.Generator().manual_seed(0)
    vocab, stop_ids = 40, [0, 9]
    logits = torch.randn(len(ADJUSTMENTS) + 1, vocab, generator=generator) * 4
    histories = [TokenHistory(torch.randint(vocab, (7,), generator=generator).tolist(),
                              torch.randint(vocab, (row % 5,), generator=generator).tolist(), stop_ids)
                 for row in range(len(ADJUSTMENTS))]
    rows = list(range(1, len(ADJUSTMENTS) + 1))  # row 0 is not adjusted and must stay as it was
    adjusted = adjust_logits(logits.bfloat16(), ADJUSTMENTS, histories, rows)
    assert adjusted.dtype == torch.float32
    assert torch.equal(adjusted[0], logits.bfloat16()[0].float())
    for row, params, history in zip(rows, ADJUSTMENTS, histories):
        ids = torch.tensor([[*history.prompt_token_ids, *history.output_token_ids]])
        processors = reference_processors(params, len(history.prompt_token_ids), stop_ids)
        expected = processors(ids, logits.bfloat16()[row:row + 1].float().clone())[0]
        torch.testing.assert_close(adjusted[row], expected, rtol=1e-6, atol=1e-5)
        assert not torch.equal(adjusted[row], logits.bfloat16()[row].float())  # the row did change


@pytest.mark.parametrize("fields, field", [
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"1": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
])
def test_invalid_adjustments_are_refused_naming_the_field(fields, field):
    with pytest.raises(InvalidRequestError, match=f"^{field} "):
        SamplingParams(**fields)


def test_engine_with_adjustments_matches_transformers_generate(llm_fp32, hf_model):
    """One batch, each request with its own adjustments (one without any), greedy, against
    transformers' greedy generate with the reference processors."""
    prompts = ["The cat sat on the mat. The cat sat on the mat. The cat", "List the numbers: 1, 2, 3,",
               "Write one word:", "Repeat after me: apple apple apple apple"]
    params = [SamplingParams(temperature=0, max_tokens=12, **fields) for fields in (
        {"repetition_penalty": 1.5}, {"frequency_penalty": 2.0, "presence_penalty": 2.0},
        {"min_tokens": 10, "logit_bias": {28: 3.0}}, {})]
    outputs = llm_fp32.generate(prompts, params)
    stop_ids = list(llm_fp32.engine.model_config.eos_token_ids)
    plain = llm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, p, output, unadjusted in zip(prompts, params, outputs, plain):
        ids = torch.tensor([llm_fp32.tokenizer.encode(prompt)])
        with torch.no_grad():
            reference = hf_model.generate(ids, max_new_tokens=12, do_sample=False, num_beams=1,
                                          logits_processor=reference_processors(p, ids.shape[1], stop_ids),
                                          eos_token_id=stop_ids, pad_token_id=stop_ids[0])
        expected = reference[0, ids.shape[1]:].tolist()
        assert output.token_ids == expected, prompt
        if p.adjusts_logits:
            assert output.token_ids != unadjusted.token_ids, f"{prompt}: the adjustment changed nothing"
    assert len(outputs[2].token_ids) >= 10  # min_tokens held EOS back


def test_prompt_logprobs_are_teacher_forced_and_computed_whole(make_llm, hf_model):
    """Every prompt token's log-probability given the tokens before it, equal to transformers'
    log-softmax at fp32, whatever was cached or however the prompt was chunked."""
    llm = make_llm(dtype="float32", max_num_batched_tokens=64)  # the prompt spans several chunks
    prompt = llm.tokenizer.encode("The river flooded the lower market overnight, and the bridge was closed. " * 4)
    llm.generate(prompt, SamplingParams(max_tokens=1))  # its blocks are in the prefix cache now
    (output,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    assert output.num_cached_tokens == 0  # computed whole, cache or not
    entries = output.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position in range(1, len(prompt)):
        entry, expected = entries[position], reference[position - 1]
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - expected[prompt[position]].item()) < 2e-3
        chosen = expected[prompt[position]]
        assert int((expected > chosen + 2e-3).sum()) + 1 <= entry.rank <= int((expected > chosen - 2e-3).sum()) + 1
        best = expected.topk(2)
        assert abs(entry.top[0][1] - best.values[0].item()) < 2e-3 and len(entry.top) == 3
        if best.values[0] - best.values[1] > 4e-3:  # no near tie: the same most likely token
            assert entry.top[0][0] == best.indices[0].item()
    with pytest.raises(InvalidRequestError, match="^prompt_logprobs "):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("penalty", [1e-300, 1e-45, 1e-38, 1e300])
def test_penalties_beyond_float32_are_sampled_safely(penalty):
    """A repetition_penalty that is 0 or inf in float32 sends seen tokens to the bottom or top
    without inf - inf: finite logits, a valid token for greedy and sampled rows alike."""
    from tokendance.sampling import Sampler

    generator = torch.Generator().manual_seed(1)
    vocab = 50
    logits = torch.randn(2, vocab, generator=generator) * 5
    params = [SamplingParams(temperature=0, repetition_penalty=penalty, min_tokens=3),
              SamplingParams(temperature=0.8, seed=7, repetition_penalty=penalty, min_tokens=3)]
    histories = [TokenHistory(list(range(0, 20)), [21, 22], [0])] * 2
    adjusted = adjust_logits(logits, params, histories, [0, 1])
    assert not adjusted.isnan().any() and not adjusted.isposinf().any()
    tokens = Sampler("cpu").sample(logits, ["a", "b"], params, histories)
    assert all(0 < t < vocab for t in tokens)  # EOS (0) held back by min_tokens


def test_min_tokens_yield_to_a_constraint_that_can_only_end(llm_fp32):
    """min_tokens beyond what a constraint allows: once the constraint can only end, it ends (the
    reply is what the constraint allows, never a token it forbids)."""
    from tokendance.structured import StructuredOutput

    for temperature in (0, 0.8):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=30, min_tokens=20,
                                structured=StructuredOutput(regex="ab|cd"))
        output = llm_fp32.generate(["Say ab or cd:"], params)[0]
        assert output.text in ("ab", "cd") and output.finish_reason == "stop"


def test_n_choices_score_the_prompt_once(llm_fp32):
    """With n > 1, only the first choice scores the prompt (computed whole); the others read it
    from the prefix cache and carry the same prompt_logprobs."""
    prompt = llm_fp32.tokenizer.encode("The old oak tree stood at the edge of the village, " * 6)
    outputs = llm_fp32.generate([prompt], SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=3,
                                                         prompt_logprobs=2))
    assert len(outputs) == 3 and outputs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens > 0 for o in outputs[1:])  # the prompt computed once
    first = [(e.token_id, e.logprob) for e in outputs[0].prompt_logprobs[1:]]
    assert len(first) == len(prompt) - 1
    for output in outputs[1:]:
        assert [(e.token_id, e.logprob) for e in output.prompt_logprobs[1:]] == first


def test_request_fields_override_the_models_sampling_defaults():
    """The server's requests: the model's generation_config.json sampling for the fields a request
    leaves out, the request's own values where it sets them."""
    from tokendance.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    params = body.sampling_params(None, {"temperature": 0.7, "top_p": 0.8, "top_k": 20})
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.5, 20)
    assert body.sampling_params(None).temperature == SamplingParams().temperature  # no defaults: OpenAI's


def test_draws_follow_the_probabilities_and_never_pick_an_impossible_token():
    probs = torch.softmax(torch.randn(12, generator=torch.Generator().manual_seed(0)) * 2, dim=-1)
    probs[[0, 5, 11]] = 0.0  # the first, a middle and the last token cannot be drawn
    probs /= probs.sum()
    generator = torch.Generator().manual_seed(1)
    counts = Counter(draw(probs, generator) for _ in range(20000))
    assert not {0, 5, 11} & counts.keys()
    observed = torch.tensor([counts[i] / 20000 for i in range(12)])
    assert (observed - probs).abs().max() < 0.015  # ~4 standard deviations of the largest cell
    a, b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    assert [draw(probs, a) for _ in range(20)] == [draw(probs, b) for _ in range(20)]  # a seed replays its draws
    assert draw(torch.tensor([0.0, 0.0, 1.0]), None) == 2
