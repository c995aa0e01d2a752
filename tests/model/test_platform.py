"""The machine probe: dtype and KV pool chosen from what the CPU and memory offer, with the
"no native bf16" answer forced to check the fallback on any CPU."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest
import torch

from tokendance import LLM, SamplingParams
from tokendance.errors import InvalidRequestError
from tokendance.model.linear import DenseLinear, PackedBF16Linear, UpcastBF16Linear
from tokendance.model.platform import CpuInfo, auto_kv_cache_bytes, cpu_flags, probe_cpu, resolve_dtype, warn_slow_bf16

GREEDY = SamplingParams(temperature=0, max_tokens=8)
GiB = 2**30


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setenv("TOKENDANCE_NATIVE_BF16", "0")
    warn_slow_bf16.cache_clear()
    yield
    warn_slow_bf16.cache_clear()


def test_probe_agrees_with_torch_capability():
    cpu = probe_cpu()
    assert cpu.capability == torch.backends.cpu.get_cpu_capability()
    if cpu.native_bf16:
        assert cpu.capability.startswith("AVX512") or "TOKENDANCE_NATIVE_BF16" in __import__("os").environ
    assert not cpu.packed_bf16 or cpu.native_bf16


def test_auto_dtype_follows_the_cpu():
    native = CpuInfo("AVX512", native_bf16=True, packed_bf16=True)
    avx2 = CpuInfo("AVX2", native_bf16=False, packed_bf16=False)
    assert resolve_dtype("auto", native) is torch.bfloat16
    assert resolve_dtype("auto", avx2) is torch.float32
    assert resolve_dtype("float32", native) is torch.float32
    assert resolve_dtype("auto", avx2, device="meta") is torch.bfloat16  # off the CPU: bf16


def test_prefill_attention_runs_in_the_kernel_only_without_amx(monkeypatch):
    monkeypatch.delenv("TOKENDANCE_PREFILL_KERNEL", raising=False)
    amx = CpuInfo("AVX512", native_bf16=True, packed_bf16=True, amx_bf16=True)
    bf16_dots = CpuInfo("AVX512", native_bf16=True, packed_bf16=True)
    assert not amx.prefers_prefill_kernel and bf16_dots.prefers_prefill_kernel
    monkeypatch.setenv("TOKENDANCE_PREFILL_KERNEL", "1")
    assert amx.prefers_prefill_kernel
    monkeypatch.setenv("TOKENDANCE_PREFILL_KERNEL", "0")
    assert not bf16_dots.prefers_prefill_kernel
    assert probe_cpu().amx_bf16 == (probe_cpu().native_bf16 and "amx_bf16" in cpu_flags())


def test_forced_no_native_bf16_loads_in_float32(no_native_bf16, loaded_model, llm_fp32):
    assert not probe_cpu().native_bf16 and not probe_cpu().packed_bf16
    llm = LLM(loaded_model, kv_cache_bytes=64 * 2**20)
    assert llm.engine.dtype == "float32"
    assert isinstance(llm.engine.runner.model.linear, DenseLinear)
    prompt = "The three primary colors are"
    assert llm.generate(prompt, GREEDY)[0].token_ids == llm_fp32.generate(prompt, GREEDY)[0].token_ids


def test_explicit_bf16_without_native_support_runs_upcast_and_warns_once(no_native_bf16, loaded_model, caplog):
    with caplog.at_level(logging.WARNING, logger="tokendance"):
        first = LLM(loaded_model, dtype="bfloat16", kv_cache_bytes=64 * 2**20)
        LLM(loaded_model, dtype="bfloat16", kv_cache_bytes=64 * 2**20)
    warnings = [r for r in caplog.records if "without native bf16" in r.getMessage()]
    assert len(warnings) == 1
    assert first.engine.dtype == "bfloat16"
    assert isinstance(first.engine.runner.model.linear, UpcastBF16Linear)
    (output,) = first.generate("The three primary colors are", GREEDY)
    assert output.num_generated_tokens == 8


@pytest.mark.parametrize("rows", [1, 3, 4, 40])
def test_upcast_bf16_linear_rounds_as_a_bf16_gemm(rows):
    """bf16 inputs, float32 products and sums, one bf16 rounding: within a bf16 unit in the last
    place of the exact (float64) product of the same bf16 values, as a bf16 GEMM is; a weight over
    2**19 elements a row (here up to 4 rows) stays in bf16."""
    torch.manual_seed(rows)
    x, small, big = torch.randn(rows, 576).bfloat16(), torch.randn(1536, 576).bfloat16(), torch.randn(2**18 + 8, 8).bfloat16()
    for weight in (small, big):
        got = UpcastBF16Linear()(x[:, :weight.shape[1]], weight)
        exact = x[:, :weight.shape[1]].double() @ weight.double().T
        assert got.dtype == torch.bfloat16 and got.shape == exact.shape
        ulp = exact.abs().clamp_min(1e-3) * 2.0**-7
        assert ((got.double() - exact).abs() <= ulp).all()


@pytest.mark.skipif(not probe_cpu().packed_bf16, reason="packed bf16: this CPU has no native bf16 (AVX512-BF16/AMX)")
def test_auto_dtype_is_packed_bf16_where_native(make_llm):
    llm = make_llm(kv_cache_bytes=64 * 2**20)
    assert llm.engine.dtype == "bfloat16"
    assert isinstance(llm.engine.runner.model.linear, PackedBF16Linear)


def test_auto_kv_pool_is_a_capped_share_of_available_memory(make_llm):
    assert auto_kv_cache_bytes(available=1 * GiB) == GiB // 4
    assert auto_kv_cache_bytes(available=64 * GiB) == 4 * GiB
    assert auto_kv_cache_bytes(available=100 * 2**20) == 64 * 2**20
    engine = make_llm().engine
    assert 64 * 2**20 <= engine.kv_cache_bytes <= 4 * GiB
    assert engine.stats().num_blocks == engine.kv_cache_bytes // engine.bytes_per_block


@pytest.mark.parametrize("bad", [{"dtype": "float16"}, {"kv_cache_bytes": "lots"}, {"kv_cache_bytes": 0},
                                 {"kv_cache_bytes": True}])
def test_bad_dtype_or_pool_size_is_a_clear_error(bad, loaded_model):
    with pytest.raises(InvalidRequestError, match=next(iter(bad))):
        LLM(loaded_model, **bad)


def test_server_on_a_busy_port_exits_with_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "tokendance.cli", "serve", "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "serving" not in result.stdout
