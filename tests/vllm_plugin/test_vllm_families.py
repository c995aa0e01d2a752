"""The connector's pass on the model families it accepts, each a small random-weight model
written by transformers with that family's config class (biases in Qwen2's q/k/v, Qwen3's
per-head q/k norms, Llama 3's scaled RoPE): at recompute ratio 1.0 a round's first-token
log-probs equal vLLM's exact computation (each model in a vLLM of its own, in a subprocess)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

from tests.helpers import has_avx512  # noqa: E402

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


def write_model(family: str, model_folder, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    config = configs()[family]
    config.vocab_size = 49152  # the default model's tokenizer, copied beside the weights
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(model_folder) / name).exists():
            shutil.copy(Path(model_folder) / name, folder / name)
    return folder


def run_round(folder: Path, out: Path, settings: dict, engine: dict | None = None, env: dict | None = None,
              sampling: dict | None = None) -> dict:
    script = Path(__file__).with_name("family_round.py")
    done = subprocess.run([sys.executable, str(script), str(folder), str(out), json.dumps(settings), json.dumps(engine or {}),
                           json.dumps(sampling or {})],
                          capture_output=True, text=True, timeout=600, env=None if env is None else {**os.environ, **env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


# Qwen3 (per-head q/k norms) runs in `make test`; Qwen2's biases and Llama 3's
# scaled RoPE, each a vLLM of its own (~13 s), in `make test-slow`.
@pytest.mark.parametrize("family", [pytest.param("qwen2", marks=pytest.mark.slow), "qwen3",
                                    pytest.param("llama3", marks=pytest.mark.slow)])
def test_ratio_one_round_matches_exact_logprobs(family, model_folder, tmp_path):
    folder = write_model(family, model_folder, tmp_path / family)
    result = run_round(folder, tmp_path / "round.json", {})
    reused, exact = result["reused"], result["exact"]
    assert sorted(a["role"] for a in reused.values()) == ["master", "mirror", "mirror", "mirror"]
    assert all(a["claimed"] > 0 for a in reused.values() if a["role"] == "mirror")
    for agent, got in reused.items():
        want = exact[agent]["first"]
        assert set(got["first"]) == set(want)
        assert max(abs(got["first"][t] - want[t]) for t in want) < 1e-3, (family, agent)


def test_a_round_larger_than_the_pool_preempts_and_stays_exact_on_qwen2(model_folder, tmp_path):
    """Qwen2's round (q/k/v biases), four agents decoding 160 tokens each in a pool of 24 blocks
    (768 tokens): vLLM preempts, and the round still gives vLLM's exact tokens at
    ratio 1.0. (The default model's version of this, 9 agents in the shared engine, is `slow`.)"""
    folder = write_model("qwen2", model_folder, tmp_path / "qwen2")
    result = run_round(folder, tmp_path / "round.json", {}, {"num_gpu_blocks_override": 24, "max_model_len": 512,
                                                                "disable_log_stats": False},
                       sampling={"max_tokens": 160, "ignore_eos": True})
    reused, exact = result["reused"], result["exact"]
    assert result["preemptions"] > 0
    roles = [a["role"] for a in reused.values()]
    assert "master" in roles and "mirror" in roles  # (members the pool could not hold are exact)
    assert {a: r["tokens"] for a, r in reused.items()} == {a: r["tokens"] for a, r in exact.items()}
    assert all(len(r["tokens"]) == 160 for r in reused.values())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores (vLLM-CPU's all-reduce spins)")
@pytest.mark.skipif(not has_avx512(), reason="vLLM-CPU's AVX2 build has no shared-memory all-reduce (TP untried there)")
def test_tensor_parallel_ranks_select_the_same_tokens_and_reuse_as_one_rank_does(model_folder, tmp_path):
    """Under tensor parallelism (vLLM-CPU, 2 ranks, each holding one of the 2 KV heads) every rank
    ranks its own heads' key deviations: unless they agree, ranks recompute different tokens and
    the pass's all-reduces sum rows of different tokens (ranking each rank's own heads failed this
    test). With CacheBlend at ratio 0.3 (a selection by deviation) its first-token log-probs equal
    one rank's run of the same round, reuse included; the exact run agrees too (the numerics of
    the split)."""
    folder = write_model("qwen2", model_folder, tmp_path / "qwen2")
    settings = {"selection": "cacheblend", "recompute_ratio": 0.3}
    cores = sorted(os.sched_getaffinity(0))
    bind = f"{cores[0]}|{cores[1]}"  # one core per rank (vLLM-CPU wants it said)
    split = run_round(folder, tmp_path / "tp2.json", settings, {"tensor_parallel_size": 2},
                      {"VLLM_CPU_OMP_THREADS_BIND": bind})
    whole = run_round(folder, tmp_path / "tp1.json", settings)
    for kind in ("reused", "exact"):
        for agent, want in whole[kind].items():
            got = split[kind][agent]
            assert (got["role"], got["claimed"]) == (want["role"], want["claimed"])
            common = set(got["first"]) & set(want["first"])
            assert len(common) >= 4
            assert max(abs(got["first"][t] - want["first"][t]) for t in common) < 1e-3, (kind, agent)
    assert sum(a["claimed"] for a in split["reused"].values()) > 0


def test_every_model_runner_of_this_vllm_hands_its_model_over():
    """The handoff wraps `load_model` of each runner vLLM may pick, Model Runner V2's GPU runner
    (vLLM's default wherever Triton is installed) included; on a GPU without it every pass would
    fail. (Only the CPU runner loads a model here: no GPU.)"""
    from tokendance.vllm_plugin import model_handoff as handoff

    handoff.install()
    names = {f"{cls.__module__}.{cls.__name__}": cls for cls in handoff.runner_classes()}
    assert {"vllm.v1.worker.gpu_model_runner.GPUModelRunner", "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
            "vllm.v1.worker.cpu_model_runner.CPUModelRunner"} <= set(names)
    assert all(getattr(cls.__dict__.get("load_model"), "_tokendance_handoff", False) for cls in names.values())
