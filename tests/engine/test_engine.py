"""End-to-end engine behaviour on the real model: prefix caching, preemption, sampling, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import CHAT_QUESTIONS, round_turns
from tokendance import (
    LLM,
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
    SamplingParams,
)
from tokendance.model.llama import KVCacheTensors, LlamaModel
from tokendance.model.loader import load_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=24)
SYSTEM = (
    "You are agent Ada in a town simulation. You live on Elm Street, you run the bakery, and you "
    "like to talk about the weather, the harvest festival and your neighbours' gossip. Keep replies short."
)


def conversations():
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in CHAT_QUESTIONS]


def test_prefix_caching_on_and_off_give_identical_outputs(make_llm):
    with_cache = make_llm(dtype="float32", enable_prefix_caching=True)
    without = make_llm(dtype="float32", enable_prefix_caching=False)
    first_on = with_cache.chat(conversations()[:1], GREEDY)
    rest_on = with_cache.chat(conversations(), GREEDY)
    first_off = without.chat(conversations()[:1], GREEDY)
    rest_off = without.chat(conversations(), GREEDY)
    assert [o.token_ids for o in first_on + rest_on] == [o.token_ids for o in first_off + rest_off]
    assert all(o.num_cached_tokens == 0 for o in first_off + rest_off)
    assert first_on[0].num_cached_tokens == 0


def test_cached_token_counts_follow_block_arithmetic(make_llm):
    block_size = 16
    # float32: the prompt's last partial block is computed again over the cached ones, through
    # another attention path; in bf16 that may turn a near tie of a greedy step many tokens later
    llm = make_llm(block_size=block_size, dtype="float32")
    tokenizer = llm.tokenizer
    prompts = [tokenizer.encode(llm.render_chat(c)) for c in conversations()]
    (first,) = llm.generate(prompts[0], GREEDY)
    assert first.num_cached_tokens == 0
    outputs = llm.generate(prompts[1:], GREEDY)
    for prompt, output in zip(prompts[1:], outputs):
        common = next(i for i, (a, b) in enumerate(zip(prompt, prompts[0])) if a != b)
        assert output.num_cached_tokens == (common // block_size) * block_size
    # The same prompt again: every full prompt block hits, and at least one token is computed.
    (again,) = llm.generate(prompts[0], GREEDY)
    full_blocks = len(prompts[0]) // block_size
    assert again.num_cached_tokens == min(full_blocks * block_size, len(prompts[0]) - 1)
    assert again.token_ids == first.token_ids


def test_exactly_cached_prompt_uses_copy_on_write(make_llm):
    llm = make_llm(dtype="float32", block_size=8)
    prompt = llm.tokenizer.encode(llm.render_chat(conversations()[0]))
    prompt = prompt[: (len(prompt) // 8) * 8]  # a whole number of blocks
    params = SamplingParams(temperature=0, max_tokens=24, return_logits=1)
    llm.generate("An unrelated prompt that fills some blocks with other positions " * 3, params)
    (first,) = llm.generate(prompt, params)
    # Both hit every block; the first writes its last token in place, the second shares the last
    # block with it and must copy it first.
    both = llm.generate([prompt, prompt], params)
    for output in both:
        assert output.num_cached_tokens == len(prompt) - 1
        assert output.token_ids == first.token_ids
        # the copied block carries its keys' positions too, else they would be rotated when read
        assert (output.logits[0] - first.logits[0]).abs().max().item() < 1e-3
    assert llm.engine.stats().num_used_blocks == 0


def test_small_pool_preempts_and_still_matches_a_large_pool(make_llm, loaded_model):
    bytes_per_block = KVCacheTensors.bytes_per_slot(loaded_model.config, __import__("torch").float32) * 16
    small = make_llm(dtype="float32", kv_cache_bytes=12 * bytes_per_block, enable_prefix_caching=False)
    large = make_llm(dtype="float32", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS * 2]
    got = small.chat(prompts, params)
    want = large.chat(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" and o.num_generated_tokens == 24 for o in got)
    assert sum(o.num_preemptions for o in got) > 0
    assert small.engine.stats().num_used_blocks == 0 and not small.engine.has_unfinished


def test_request_that_can_never_fit_is_rejected(make_llm, loaded_model):
    import torch

    bytes_per_block = KVCacheTensors.bytes_per_slot(loaded_model.config, torch.bfloat16) * 16
    llm = make_llm(kv_cache_bytes=4 * bytes_per_block)
    with pytest.raises(CapacityError, match="KV blocks"):
        llm.generate("hello " * 60, SamplingParams(max_tokens=10))
    (ok,) = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5))
    assert ok.num_generated_tokens >= 1


def test_seeded_sampling_is_reproducible_and_batch_independent(llm_fp32):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    conv = [{"role": "user", "content": CHAT_QUESTIONS[1]}]
    (alone,) = llm_fp32.chat(conv, params)
    batched = llm_fp32.chat([conv, [{"role": "user", "content": CHAT_QUESTIONS[2]}]],
                            [params, SamplingParams(temperature=1.0, max_tokens=30)])
    assert batched[0].token_ids == alone.token_ids
    other_seed = llm_fp32.chat(conv, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24, ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids
    top1 = llm_fp32.chat(conv, SamplingParams(temperature=0.8, top_k=1, max_tokens=12))[0]
    greedy = llm_fp32.chat(conv, SamplingParams(temperature=0, max_tokens=12))[0]
    assert top1.token_ids == greedy.token_ids


def test_stop_strings_stop_tokens_eos_and_length(llm_fp32):
    conv = [{"role": "user", "content": CHAT_QUESTIONS[2]}]
    (base,) = llm_fp32.chat(conv, SamplingParams(temperature=0, max_tokens=40))
    assert base.finish_reason == "length" and base.num_generated_tokens == 40
    words = base.text.split()
    stop = " " + words[5]
    (stopped,) = llm_fp32.chat(conv, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == base.text[: base.text.index(stop)]
    third = base.token_ids[2]
    (by_id,) = llm_fp32.chat(conv, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[third]))
    assert by_id.finish_reason == "stop" and by_id.token_ids == base.token_ids[: base.token_ids.index(third) + 1]
    short = [{"role": "user", "content": "Say just the word yes."}]
    (eos,) = llm_fp32.chat(short, SamplingParams(temperature=0, max_tokens=40))
    assert eos.finish_reason == "stop" and eos.token_ids[-1] in llm_fp32.engine.model_config.eos_token_ids
    (forced,) = llm_fp32.chat(short, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert forced.finish_reason == "length" and forced.num_generated_tokens == 40


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.5},
        {"temperature": "hot"},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -3},
        {"max_tokens": 0},
        {"max_tokens": 2.5},
        {"seed": "abc"},
        {"stop": [""]},
        {"stop": 5},
        {"stop_token_ids": [-1]},
    ],
)
def test_invalid_sampling_values_raise_typed_errors(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError) and str(info.value)


def test_bad_prompts_are_rejected_and_nothing_is_lost(llm_fp32):
    engine = llm_fp32.engine
    with pytest.raises(InvalidRequestError, match="empty"):
        llm_fp32.generate("", GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm_fp32.generate(["fine prompt", ""], GREEDY)  # validated before anything is scheduled
    with pytest.raises(ContextLengthError, match="context window"):
        llm_fp32.generate([1] * engine.max_model_len, GREEDY)
    # far too long to fit: refused by its length in characters, before it is tokenized
    huge = "a" * (2 * engine.max_model_len * engine.tokenizer.max_chars_per_token + 1)
    with pytest.raises(ContextLengthError, match="characters"):
        llm_fp32.generate(huge, GREEDY)
    # every spelling in the vocabulary is at least as long as the text it stands for
    word = "tokenization " * 50
    assert len(engine.tokenizer.encode(word)) >= len(word) / engine.tokenizer.max_chars_per_token
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm_fp32.generate([[5, 10**9]], GREEDY)
    with pytest.raises(InvalidRequestError, match="role"):
        llm_fp32.chat([{"role": "user"}], GREEDY)
    assert not engine.has_unfinished and engine.stats().num_used_blocks == 0
    (ok,) = llm_fp32.generate("The sky is", GREEDY)
    assert ok.num_generated_tokens > 0


def test_unknown_or_invalid_model_paths_name_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    not_a_model = tmp_path / "notes.gguf"
    not_a_model.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LLM(str(not_a_model))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="not a model folder"):
        LLM(str(tmp_path / "empty"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        LLM(str(gpt2))
    with pytest.raises(InvalidRequestError, match="unknown engine arguments"):
        LLM(kv_cache_size=5)


def test_engines_built_from_one_loaded_model_share_its_prepared_weights(loaded_model):
    """The fused and packed weights are made once per dtype and kernel, not once per engine, and
    are what a model that made its own computes with."""
    first, second = LLM(loaded_model, dtype="float32"), LLM(loaded_model, dtype="float32")
    layers = [llm.engine.runner.model.layers[3] for llm in (first, second)]
    assert layers[0] is layers[1] and first.engine.runner.model.lm_head is second.engine.runner.model.lm_head
    own = LlamaModel(loaded_model.config, loaded_model.weights, torch.float32, "cpu")
    assert own.layers[3] is not layers[0]
    for name in ("qkv", "out", "gate_up", "down", "input_norm"):
        assert torch.equal(getattr(own.layers[3], name), getattr(layers[0], name)), name
    other = LLM(loaded_model, dtype="bfloat16").engine.runner.model
    assert other.layers[3] is not layers[0] and other.embed_tokens.dtype == torch.bfloat16
    assert [o.token_ids for o in second.generate(CHAT_QUESTIONS[:2], SamplingParams(temperature=0, max_tokens=4))] == \
        [o.token_ids for o in LLM(loaded_model, dtype="float32").generate(CHAT_QUESTIONS[:2], SamplingParams(temperature=0, max_tokens=4))]


def test_gguf_header_reads_as_the_gguf_package_reads_it(model_weights, tmp_path):
    """The loader's own GGUF reader against the `gguf` package's: the same metadata and the same
    tensors, bit for bit; a file cut short anywhere is refused by name, never read short."""
    import gguf
    import numpy as np

    from tokendance.model.gguf_file import read_gguf

    metadata, tensors = read_gguf(model_weights)
    reference = gguf.GGUFReader(str(model_weights))
    assert metadata == {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert [(t.name, t.tensor_type, list(t.shape)) for t in tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in reference.tensors]
    for ours, theirs in zip(tensors, reference.tensors):
        assert np.array_equal(gguf.quants.dequantize(ours.data, ours.tensor_type).reshape(-1),
                              gguf.quants.dequantize(theirs.data, theirs.tensor_type).reshape(-1)), ours.name
    whole = model_weights.read_bytes()
    for cut in (10, 2_000, 1_000_000, len(whole) - 1):  # the counts, the token list, a tensor, the last byte
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError, match="could not be read as GGUF"):
            LLM(str(short))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="could not be read as GGUF"):  # the tokenizer alone: no path check first
        load_tokenizer(tmp_path / "empty.gguf")


def test_a_request_that_fails_in_a_step_fails_alone(make_llm, monkeypatch):
    """A failure injected into one request's sampling: that request finishes with "error", every
    other request of the busy batch (and of a round) completes with its normal output."""
    from tokendance.sampling import Sampler

    llm = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.2)
    sampled = SamplingParams(temperature=0.7, seed=3, max_tokens=6)
    prompts = ["The sky is", "Name three rivers:", "Once upon a time", "The capital of Peru is"]
    params = [GREEDY, sampled, GREEDY, GREEDY]
    want = llm.generate(prompts, params)
    bad = llm.engine.add_request("Tell me a story", sampled)
    original = Sampler._sample_row

    def failing(self, logits, request_id, p):
        if request_id == bad or request_id.endswith(bad):
            raise RuntimeError("injected failure")
        return original(self, logits, request_id, p)

    monkeypatch.setattr(Sampler, "_sample_row", failing)
    got = llm.generate(prompts, params)  # `bad` runs in the same batches
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert not llm.engine.has_unfinished
    turns = round_turns(1)
    reference = make_llm(dtype="float32", reuse="tokendance", recompute_ratio=0.2).run_round(turns, GREEDY)
    round_params = [GREEDY, sampled, GREEDY, GREEDY]
    bad = f":{turns[1].agent_id}"  # round requests are named "round{index}:{agent}"
    result = llm.run_round(turns, round_params)
    assert result.outputs[1].finish_reason == "error" and "injected" in result.outputs[1].error
    for i in (0, 2, 3):
        assert result.outputs[i].token_ids == reference.outputs[i].token_ids


def test_n_choices_compute_the_prompt_once(make_llm):
    """`n` choices per prompt: prompt-major outputs, the choices after the first served their
    prompt from the prefix cache, seeded choices different and each reproducible."""
    llm = make_llm(dtype="float32")
    prompts = ["Once upon a time in a village by the river, " * 6, "The market opens at nine and the baker " * 6]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8)
    outputs = llm.generate(prompts, params)
    assert len(outputs) == 6
    for i, prompt in enumerate(prompts):
        first, *others = outputs[3 * i:3 * i + 3]
        assert all(o.prompt_token_ids == first.prompt_token_ids for o in others)
        block = llm.engine.config.block_size
        assert first.num_cached_tokens == 0
        length = len(first.prompt_token_ids)
        assert all(o.num_cached_tokens == min(length // block * block, length - 1) for o in others)
        assert len({tuple(o.token_ids) for o in (first, *others)}) > 1  # seeds 11, 12, 13 differ
    again = llm.generate(prompts[0], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8))
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs[:3]]
    single = llm.generate(prompts[0], SamplingParams(temperature=1.0, seed=12, max_tokens=8))
    assert single[0].token_ids == outputs[1].token_ids  # choice 1 is the prompt with seed + 1


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_batch_invariant_greedy_does_not_depend_on_the_batch(make_llm, dtype):
    """batch_invariant: a request's logits are bitwise the same alone, in a batch of others (whose
    prompts share its prefix, so decode could read shared runs), and served from the prefix
    cache, at every step; prompts are long enough to be computed in several fixed chunks."""
    from tokendance.model.platform import probe_cpu

    if dtype == "auto" and not probe_cpu().native_bf16:
        pytest.skip("auto is float32 on a CPU without native bf16: the float32 case is this one")
    llm = make_llm(dtype=dtype, batch_invariant=True, max_num_batched_tokens=512)
    story = "The old lighthouse keeper told the children about the storm of 1952. " * 40
    prompts = [story + "Then", story + "After the storm, the village", "List three facts about volcanoes."]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_logits=True)
    alone = [llm.generate([p], params)[0] for p in prompts]
    assert len(alone[0].prompt_token_ids) > 2 * 256
    batched = llm.generate(prompts, params)
    assert batched[0].num_cached_tokens > 0  # the third pass of the story found it in the cache
    for one, many in zip(alone, batched):
        assert one.token_ids == many.token_ids
        assert all(torch.equal(a, b) for a, b in zip(one.logits, many.logits))
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        make_llm(batch_invariant=True, max_num_batched_tokens=128)
