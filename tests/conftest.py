"""Shared fixtures: the default model is loaded once per session and shared by the engines."""

from __future__ import annotations

import pytest
import torch

from tokendance import LLM
from tokendance.model.loader import default_model_path, load_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def loaded_model():
    return load_model()


@pytest.fixture(scope="session")
def llm_fp32(loaded_model):
    """An fp32 engine: the configuration compared bit-for-bit-ish against transformers."""
    return LLM(loaded_model, dtype="float32")


@pytest.fixture(scope="session")
def make_llm(loaded_model):
    def make(**engine_args) -> LLM:
        return LLM(loaded_model, **engine_args)

    return make


@pytest.fixture(scope="session")
def plain_server():
    """A `tokendance serve` process that forms no rounds by itself (no gather window)."""
    from tests.helpers import Server, kv_bytes

    server = Server("--gather-window-ms", "0", "--kv-cache-bytes", kv_bytes(8736))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own GGUF loader and Llama implementation: the independent reference."""
    from transformers import AutoModelForCausalLM, GgufConfig

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    return model.eval()


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about a lighthouse keeper who befriends a seagull during a storm.",
    "Explain in detail how a paged KV cache works in an LLM serving engine, and why it helps.",
    "List three fruits.",
]
