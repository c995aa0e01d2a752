"""Every supported family (Llama 3.x with its RoPE scalings, Qwen2/2.5, Qwen3, Mistral) against
transformers: random-weight models written by transformers with the family's own config class,
loaded from the folder, logits compared at the prefill and every decode step; rounds at recompute
ratio 1.0 against full prefill; and what the loader must refuse rather than ignore."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import LOGIT_ATOL, round_turns
from tests.model.families import FAMILIES, save_tokenizer, write_family, write_gguf
from tokendance import LLM, SamplingParams
from tokendance.errors import ModelLoadError
from tokendance.model.llama import apply_rope, rope_inverse_frequencies, rope_tables
from tokendance.model.kv_math import rotate_pairs
from tokendance.model.loader import load_model

pytestmark = pytest.mark.model  # random weights, but whole models run

BF16_KL = 0.02  # bf16 against the float32 reference: the default model's bound (test_model_reference.py)
ROUND = SamplingParams(temperature=0, max_tokens=8, return_logits=1)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory, tokenizer):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"), tokenizer)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory, tokenizer_folder):
    """family -> (folder, transformers model), written once per module."""
    made = {}

    def get(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(family.split()[0])
            made[family] = folder, write_family(folder, family, tokenizer_folder)
        return made[family]

    return get


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def kl(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return torch.nn.functional.kl_div(ours.float().log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                      reduction="sum").item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family_models, family, dtype):
    folder, reference = family_models(family)
    llm = LLM(load_model(folder), dtype=dtype)
    prompts = [llm.tokenizer.encode("The weather in Paris today is " * 4),
               llm.tokenizer.encode("Agents gather in the square and talk about the harvest " * 30)]  # ~300 tokens
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True))
    for prompt, output in zip(prompts, outputs):
        expected = reference_logits(reference, prompt + output.token_ids)
        for step, logits in enumerate(output.logits):  # the prefill, then each decode step
            want = expected[len(prompt) - 1 + step]
            if dtype == "float32":
                diff = (logits - want).abs().max().item()
                assert diff < LOGIT_ATOL, f"{family}, step {step}: max |logit diff| {diff}"
            else:
                assert kl(logits, want) < BF16_KL, f"{family}, step {step}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_rounds(family_models, family):
    """Collective reuse on the family: at recompute ratio 1.0 a round is full prefill, token for
    token; at 0.3 master-mirror reads (keys rotated at attention time, in the kernels) equal pic's
    private copies rotated in place, for every RoPE variant."""
    folder, _ = family_models(family)
    loaded = load_model(folder)
    turns = round_turns(1)
    full = LLM(loaded, dtype="float32", reuse="full").run_round(turns, ROUND)
    exact = LLM(loaded, dtype="float32", reuse="tokendance", recompute_ratio=1.0).run_round(turns, ROUND)
    assert exact.stats.reused_tokens == 0 and exact.stats.recomputed_tokens > 0
    for ours, ref in zip(exact.outputs, full.outputs):
        assert ours.token_ids == ref.token_ids
        assert (ours.logits[0] - ref.logits[0]).abs().max().item() < LOGIT_ATOL
    # pic's base KV is each span's first holder's: tokendance with agent masters computes the same
    mirror = LLM(loaded, dtype="float32", reuse="tokendance", recompute_ratio=0.3, masters="agent").run_round(
        turns, ROUND)
    copies = LLM(loaded, dtype="float32", reuse="pic", recompute_ratio=0.3).run_round(turns, ROUND)
    assert mirror.stats.reused_tokens > 0
    for ours, ref in zip(mirror.outputs, copies.outputs):
        assert ours.token_ids == ref.token_ids
        assert (ours.logits[0] - ref.logits[0]).abs().max().item() < LOGIT_ATOL


def test_ignoring_the_rope_scaling_would_be_caught(family_models, tmp_path):
    """The comparison above can fail: the Llama 3 model with its scaling dropped from config.json
    (what the loader used to do with transformers 5's `rope_parameters`) is far from transformers."""
    folder, reference = family_models("llama-3 (llama3 RoPE)")
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(load_model(tmp_path), dtype="float32")
    prompt = llm.tokenizer.encode("Agents gather in the square and talk about the harvest " * 30)
    logits = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, return_logits=True))[0].logits[0]
    assert (logits - reference_logits(reference, prompt)[-1]).abs().max().item() > 100 * LOGIT_ATOL


def write_config(tmp_path, **changes) -> None:
    """A Llama config.json with `changes` (None deletes a key), beside weights that match it."""
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))


def test_transformers_4_and_5_configs_load_alike(family_models, tmp_path):
    """transformers 4 writes `rope_scaling` + `rope_theta`; transformers 5 `rope_parameters`."""
    folder, _ = family_models("llama-3 (llama3 RoPE)")
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    new_style = load_model(folder).config
    rope = json.loads((folder / "config.json").read_text())["rope_parameters"]
    write_config(tmp_path, rope_parameters=None, rope_theta=rope["rope_theta"],
                 rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    old_style = load_model(tmp_path).config
    assert old_style == new_style
    assert new_style.rope_scaling.kind == "llama3" and new_style.rope_theta == 500000.0


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gemma2"}, "unsupported architecture 'gemma2'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "RoPE type 'longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "alpha": 1}}, "['alpha']"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "needs a 'factor'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"attention_bias": True}, "attention_bias is not supported for llama"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantized checkpoints (awq)"),
    ({"layer_types": ["chunked_attention"] * 3}, "layer types ['chunked_attention']"),
])
def test_what_the_loader_cannot_do_is_refused(family_models, tmp_path, changes, message):
    folder, _ = family_models("llama (linear RoPE)")
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    write_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError) as error:
        load_model(tmp_path)
    assert message in str(error.value)


def test_tensors_the_config_does_not_explain_are_refused(family_models, tmp_path):
    """A Qwen2 checkpoint declared as llama: its q/k/v biases would be dropped silently."""
    folder, _ = family_models("qwen2")
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    write_config(tmp_path, model_type="llama")
    with pytest.raises(ModelLoadError, match=r"self_attn\.k_proj\.bias.* are not part of a llama model"):
        load_model(tmp_path)


def test_sliding_window_limits_the_context(family_models):
    """Mistral's sliding window is not implemented: contexts stop at the window, where it equals
    full attention (the logits test above runs within it), and longer prompts are refused."""
    folder, _ = family_models("mistral")
    llm = LLM(load_model(folder), dtype="float32")
    assert llm.engine.max_model_len == 512
    with pytest.raises(Exception, match="512"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rotating_a_stored_key_equals_computing_it_at_the_new_position(family_models, family):
    """Position correction with each variant's own frequencies: a key stored at p (YaRN's factor
    included) rotated by d is the key computed at p + d."""
    config = load_model(family_models(family)[0]).config
    cos, sin = rope_tables(config, "cpu")
    keys = torch.randn(50, config.num_kv_heads, config.head_dim)
    stored = 200 + torch.arange(50) * 3
    moved = stored + torch.arange(-25, 25) * 6  # 25 earlier, 25 later, within every context limit
    angles = (moved - stored).float()[:, None, None] * rope_inverse_frequencies(config)  # [50, 1, D/2]
    rotated = rotate_pairs(apply_rope(keys, cos[stored], sin[stored]), angles.cos(), angles.sin())
    assert (rotated - apply_rope(keys, cos[moved], sin[moved])).abs().max().item() < 1e-3  # float32 angles of ~500 rad


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_of_each_family_loads_the_same_model(family_models, model_weights, tmp_path, family):
    """The family written as llama.cpp's converter writes it (float32 tensors): the same logits
    as the folder, Llama 3's `rope_freqs`, YaRN metadata and Q/K row order included."""
    folder, reference = family_models(family)
    write_gguf(tmp_path / "model.gguf", reference, model_weights)
    gguf, hf = load_model(tmp_path / "model.gguf"), load_model(folder)
    assert gguf.config.architecture == {"mistral": "llama"}.get(hf.config.architecture, hf.config.architecture)
    assert (gguf.config.rope_scaling is None) == (hf.config.rope_scaling is None)
    llm_gguf, llm_hf = LLM(gguf, dtype="float32"), LLM(hf, dtype="float32")
    prompt = llm_hf.tokenizer.encode("Agents gather in the square and talk about the harvest " * 30)
    assert llm_gguf.tokenizer.encode("Agents gather in the square") == llm_hf.tokenizer.encode("Agents gather in the square")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, return_logits=True)
    ours, want = llm_gguf.generate([prompt], params)[0], llm_hf.generate([prompt], params)[0]
    assert ours.token_ids == want.token_ids
    for step, (a, b) in enumerate(zip(ours.logits, want.logits)):
        assert (a - b).abs().max().item() < LOGIT_ATOL, f"step {step}"


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q5_1", "Q4_0"])
def test_gguf_quantized_tensors_load_as_the_gguf_package_dequantizes_them(family_models, model_weights, tmp_path,
                                                                            qtype):
    """Each quantization type the gguf package can write, loaded tensor by tensor into the
    engine's dtype: every matrix equals gguf's dequantization of what was written (Q/K rows back
    in Hugging Face order), and the model stays close to the float32 one."""
    import gguf as gguf_package

    folder, reference = family_models("llama-3 (llama3 RoPE)")
    write_gguf(tmp_path / "model.gguf", reference, model_weights, qtype)
    loaded = load_model(tmp_path / "model.gguf", torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in loaded.weights.values())
    kind = gguf_package.GGMLQuantizationType[qtype]
    weight = reference.state_dict()["model.layers.1.mlp.down_proj.weight"].numpy()
    want = gguf_package.quants.dequantize(gguf_package.quants.quantize(weight, kind), kind)
    assert torch.equal(loaded.weights["model.layers.1.mlp.down_proj.weight"], torch.from_numpy(want).bfloat16())
    if qtype in ("F16", "BF16", "Q8_0"):  # 4-5 bits move these random weights' peaked logits too far to compare
        llm = LLM(load_model(tmp_path / "model.gguf"), dtype="float32")
        prompt = llm.tokenizer.encode("The weather in Paris today is " * 8)
        logits = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, return_logits=True))[0].logits[0]
        assert kl(logits, reference_logits(reference, prompt)[-1]) < 0.05


def test_gguf_qwen2_pre_tokenizer_splits_as_transformers(family_models, model_weights, tmp_path):
    """A GGUF whose pre-tokenizer is `qwen2` (digits one by one, Qwen's split) tokenizes as
    transformers' own GGUF tokenizer conversion does."""
    from transformers import AutoTokenizer

    from tokendance.model.loader import load_tokenizer

    _, reference = family_models("qwen2")
    write_gguf(tmp_path / "model.gguf", reference, model_weights, pre="qwen2")
    text = "Hello world! It's 12345 apples, they're 3.14159\n\n  and   ÄÖÜ 你好 🙂 DON'T\r\nx   \n y"
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    assert load_tokenizer(tmp_path / "model.gguf").encode(text) == theirs.encode(text, add_special_tokens=False)


def test_gguf_pre_tokenizers_the_loader_does_not_know_are_refused(family_models, model_weights, tmp_path):
    _, reference = family_models("qwen2")
    write_gguf(tmp_path / "model.gguf", reference, model_weights, pre="deepseek-coder")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'deepseek-coder' is not supported"):
        load_model(tmp_path / "model.gguf")


TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
CHAT_TEMPLATES = {  # template file: (special tokens it needs, bos, eos)
    "qwen2.5": ((), None, "<|im_end|>"),
    "llama3": (("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|begin_of_text|>",
               "<|eot_id|>"),
    "mistral": (("<s>", "</s>"), "<s>", "</s>"),
}
CHAT = [{"role": "system", "content": "You are Mira, a baker in the village.\nYou speak briefly."},
        {"role": "user", "content": "Tom said: the harvest is late.\nAnna said: rain again & <again>."},
        {"role": "assistant", "content": "Then we bake less bread."},
        {"role": "user", "content": "Round 2: Mira, what do you say next?"}]


@pytest.mark.parametrize("template", list(CHAT_TEMPLATES))
def test_family_chat_templates_render_and_segment_as_transformers(tokenizer, tmp_path, template):
    """The family's template (Qwen2.5's, Llama 3's, Mistral's) from tokenizer_config.json: the
    prompt's ids, segment by segment as rounds cut it, equal transformers' apply_chat_template."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tokenizers import Tokenizer

    from tokendance.model.loader import load_hf_tokenizer
    from tokendance.reuse.segments import chat_segments

    specials, bos, eos = CHAT_TEMPLATES[template]
    backend = Tokenizer.from_str(tokenizer.backend_json())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.save(str(tmp_path / "tokenizer.json"))
    chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": chat_template, "bos_token": bos, "eos_token": eos,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    ours = load_hf_tokenizer(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    chat = CHAT if template != "mistral" else CHAT[1:]  # Mistral's template refuses system messages
    text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat) == text
    segments = chat_segments(ours, chat)
    assert [t for segment in segments for t in segment] == theirs.encode(text, add_special_tokens=False)
    assert len(segments) > len(chat)  # cut per message and line, as rounds share them


def test_generation_config_sets_the_default_sampling(family_models, tmp_path):
    """generation_config.json's temperature, top_p, top_k and repetition_penalty are the defaults of
    requests that leave them out (as vLLM's `--generation-config auto`); a request's own values win."""
    folder, _ = family_models("qwen2")
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    generation.update(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, do_sample=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    llm = LLM(load_model(tmp_path), dtype="float32")
    defaults = llm.default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    assert llm.generate(["Hello"], greedy)[0].token_ids == LLM(load_model(folder), dtype="float32").generate(
        ["Hello"], greedy)[0].token_ids
