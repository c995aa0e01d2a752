"""The fused element-wise kernels (residual add + RMSNorm, RoPE, SiLU * up) against the eager torch
ops they replace: on random tensors in both dtypes, and in the model's forward pass. Skipped where
no C compiler builds them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import built_kernel, round_turns
from tokendance import SamplingParams
from tokendance.config import ModelConfig
from tokendance.model import kernels
from tokendance.model.llama import apply_rope, rms_norm, rope_tables

PARAMS = SamplingParams(temperature=0, max_tokens=6, return_logits=True)


@pytest.fixture
def lib(monkeypatch):
    yield from built_kernel(monkeypatch, kernels.load_pointwise, "the element-wise kernels could not be built here")


def one_ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The largest rounding difference of two float32 -> dtype roundings of values up to `magnitude`."""
    return magnitude * (2**-7 if dtype == torch.bfloat16 else 2**-20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 runs on several threads
def test_add_rms_norm_equals_eager(lib, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    hidden, delta = (torch.randn(rows, 576, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=g).to(dtype)
    residual = hidden.clone()
    out = kernels.add_rms_norm(lib, residual, delta, weight, 1e-5)
    assert torch.equal(residual, hidden + delta)  # the residual stream, added in place
    want = rms_norm(hidden + delta, weight, 1e-5)
    assert (out.float() - want.float()).abs().max() <= 2 * one_ulp(dtype, want.float().abs().max().item())
    alone = kernels.add_rms_norm(lib, hidden.clone(), None, weight, 1e-5)  # no residual: the norm only
    assert (alone.float() - rms_norm(hidden, weight, 1e-5).float()).abs().max() <= 2 * one_ulp(dtype, want.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_equals_eager(lib, dtype):
    gate_up = (4 * torch.randn(300, 2 * 1536, generator=torch.Generator().manual_seed(0))).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -88.0, 88.0, 200.0])  # far tails: exp clamped, no inf or nan
    gate, up = gate_up.chunk(2, dim=-1)
    want = (F.silu(gate) * up).float()
    got = kernels.silu_mul(lib, gate_up).float()
    assert got.isfinite().all()
    assert (got - want).abs().max() <= 2 * one_ulp(dtype, want.abs().max().item()) + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_in_place_equals_eager_on_a_strided_view(lib, dtype):
    """q and k are a view of the fused projection (q, k and v in each row): rotated in place, v untouched."""
    config = ModelConfig(vocab_size=8, hidden_size=576, intermediate_size=8, num_layers=1, num_heads=9, num_kv_heads=3,
                         head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_model_len=4096,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(0,))
    cos, sin = rope_tables(config, "cpu")
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(50, 15 * 64, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (50,), generator=g)
    qk, v_before = qkv[:, :12 * 64].view(-1, 12, 64), qkv[:, 12 * 64:].clone()
    want = apply_rope(qk.clone(), cos[positions].to(dtype), sin[positions].to(dtype)).float()
    kernels.rope(lib, qk, positions, cos, sin)
    assert (qk.float() - want).abs().max() <= 4 * one_ulp(dtype, want.abs().max().item())
    assert torch.equal(qkv[:, 12 * 64:], v_before)


def test_forward_with_fused_steps_equals_eager(make_llm, lib):
    """float32, where the two differ only by float32 rounding: the same outputs, logits within 1e-3."""
    fused, eager = make_llm(dtype="float32"), make_llm(dtype="float32")
    assert fused.engine.runner.model.pointwise.lib is not None
    eager.engine.runner.model.pointwise.lib = None
    for rounds in (1, 2):
        got, want = (llm.run_round(round_turns(rounds), PARAMS).outputs for llm in (fused, eager))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want):
            assert max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits)) < 1e-3


def test_only_shapes_the_kernel_takes_are_given_to_it():
    """Its RoPE holds a head of at most POINTWISE_MAX_DIM: larger or odd heads stay in eager ops."""
    assert kernels.pointwise_fits(torch.bfloat16, 64) and kernels.pointwise_fits(torch.float32, kernels.POINTWISE_MAX_DIM)
    assert not kernels.pointwise_fits(torch.bfloat16, kernels.POINTWISE_MAX_DIM + 2)
    assert not kernels.pointwise_fits(torch.bfloat16, 63)
    assert not kernels.pointwise_fits(torch.float16, 64)
