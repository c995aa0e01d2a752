"""The connector's pass on the model families it accepts, each a small random-weight model
written by transformers with that family's config class (biases in Qwen2's q/k/v, Qwen3's
per-head q/k norms, Llama 3's scaled RoPE): at recompute ratio 1.0 a round's first-token
log-probs equal vLLM's exact computation (each model in a vLLM of its own, in a subprocess). Qwen3's
round runs its pass as vLLM's asynchronous loads (`pass_tokens_per_step: 256`), the others
synchronously (the default)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)


def configs():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    return {
        "qwen2": Qwen2Config(**SHAPE, rope_theta=1000000.0),
        "qwen3": Qwen3Config(**SHAPE, head_dim=64, rope_theta=1000000.0),
        "llama3": LlamaConfig(**SHAPE, rope_parameters=llama3),
    }


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_ratio_one_round_matches_exact_logprobs(family, model_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    config = configs()[family]
    config.vocab_size = 49152  # the default model's tokenizer, copied beside the weights
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    folder = tmp_path / family
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(model_folder) / name).exists():
            shutil.copy(Path(model_folder) / name, folder / name)
    out = tmp_path / "round.json"
    script = Path(__file__).with_name("family_round.py")
    settings = {"pass_tokens_per_step": 256} if family == "qwen3" else {}
    done = subprocess.run([sys.executable, str(script), str(folder), str(out), json.dumps(settings)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    reused, exact = result["reused"], result["exact"]
    assert sorted(a["role"] for a in reused.values()) == ["master", "mirror", "mirror", "mirror"]
    assert all(a["claimed"] > 0 for a in reused.values() if a["role"] == "mirror")
    for agent, got in reused.items():
        want = exact[agent]["first"]
        assert set(got["first"]) == set(want)
        assert max(abs(got["first"][t] - want[t]) for t in want) < 1e-3, (family, agent)
