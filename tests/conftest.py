"""Shared fixtures: the default model is loaded once per session and shared by the engines.

A test that runs the model (in this process or in a server it starts) asks, directly or through
another fixture, for `model_weights`; such tests get the `model` marker, so `pytest -m "not
model"` (`make test-fast`) runs every other test in seconds. The tokenizer alone (`tokenizer`)
does not count as the model.
"""

from __future__ import annotations

import pytest
import torch

from tokendance import LLM
from tokendance.model.loader import default_model_path, load_model, load_tokenizer
from tests.helpers import THREADS

torch.set_num_threads(THREADS)


def pytest_collection_modifyitems(items):
    for item in items:
        if "model_weights" in item.fixturenames:
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def model_weights():
    """The default model's file: what every test that runs the model depends on."""
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer and chat template, read without the weights."""
    return load_tokenizer()


@pytest.fixture(scope="session")
def loaded_model(model_weights):
    return load_model(model_weights)


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
def plain_server(model_weights):
    """A `tokendance serve` process that forms no rounds by itself (no gather window)."""
    from tests.helpers import kv_bytes, serving

    yield from serving("--gather-window-ms", "0", "--kv-cache-bytes", kv_bytes(8736))


@pytest.fixture(scope="session")
def hf_model(model_weights):
    """transformers' own GGUF loader and Llama implementation: the independent reference."""
    from transformers import AutoModelForCausalLM, GgufConfig

    path = model_weights
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    return model.eval()
