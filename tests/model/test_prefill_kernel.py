"""The bf16 prefill attention kernel (bf16 dot products, each query stopped at its limit) against
float32 SDPA with an explicit mask, on random tensors, and against the SDPA path on real rounds
(causal prompts, chunks over cached context, recomputed tokens over masters at other positions).
Skipped where the CPU has no AVX512-BF16 (the kernel is not built there) or no C compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import built_kernel, round_turns
from tokendance import SamplingParams
from tokendance.model import kernels

PARAMS = SamplingParams(temperature=0, max_tokens=8, return_logits=True)


@pytest.fixture
def prefill_kernel(monkeypatch):
    yield from built_kernel(monkeypatch, kernels.load_prefill, "the bf16 prefill kernel needs AVX512-BF16 and a C compiler")


def reference(q, k, v, limits):
    """softmax(q k / sqrt(D)) v in float32, query t over keys [0, limits[t])."""
    mask = torch.arange(k.shape[0])[None, :] < limits[:, None]
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                       v.float().transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("num_queries,num_keys,heads,kv_heads,layout", [
    (1, 1, 9, 3, "causal"),
    (7, 7, 9, 3, "causal"),
    (300, 300, 9, 3, "causal"),
    (40, 100, 9, 3, "scattered"),  # a round's recomputed tokens over their context
    (200, 1000, 9, 3, "tail"),  # a chunk over cached context
    (33, 70, 4, 2, "scattered"),  # a group of 2: items mix tokens differently
    (5, 37, 8, 8, "scattered"),  # no grouping
])
def test_prefill_kernel_matches_float32_attention(prefill_kernel, num_queries, num_keys, heads, kv_heads, layout):
    generator = torch.Generator().manual_seed(num_queries * 1000 + num_keys)
    q = (2 * torch.randn(num_queries, heads, 64, generator=generator)).bfloat16()
    k = (2 * torch.randn(num_keys, kv_heads, 64, generator=generator)).bfloat16()
    v = torch.randn(num_keys, kv_heads, 64, generator=generator).bfloat16()
    if layout == "scattered":
        positions = torch.sort(torch.randperm(num_keys, generator=generator)[:num_queries]).values
    else:
        positions = torch.arange(num_keys - num_queries, num_keys)
    limits = positions + 1
    got = kernels.prefill_attention_bf16(prefill_kernel, q, k, v, limits, 64 ** -0.5)
    want = reference(q, k, v, limits)
    assert got.dtype == torch.float32 and got.shape == want.shape
    bf16_sdpa = reference(q, k, v, limits).bfloat16().float()  # the output rounding SDPA in bf16 adds alone
    assert (got - want).abs().max().item() < 1e-2
    assert (got - want).abs().mean().item() < 2 * (bf16_sdpa - want).abs().mean().item() + 1e-3


def test_prefill_kernel_reads_the_pool_through_slots_and_rotates_moved_keys(prefill_kernel):
    """Keys in scattered slots of a pool, some stored for other positions than they are read at
    (shared KV): the kernel reads them in place, rotated, as the gathered, rotated copy reads."""
    from types import SimpleNamespace

    from tokendance.model.attention import PrefillKernel, gather_rotated_keys
    from tokendance.model.llama import rope_inverse_frequencies

    generator = torch.Generator().manual_seed(3)
    config = SimpleNamespace(head_dim=64, rope_theta=100000.0)
    max_shift = 500
    angles = torch.outer(torch.arange(-max_shift, max_shift + 1, dtype=torch.float32),
                         rope_inverse_frequencies(config))[:, None, :]
    kernel = PrefillKernel(prefill_kernel, *(t.reshape(2 * max_shift + 1, 32).contiguous() for t in (angles.cos(), angles.sin())),
                           max_shift)
    pool_k = torch.randn(400, 3, 64, generator=generator).bfloat16()
    pool_v = torch.randn(400, 3, 64, generator=generator).bfloat16()
    slots = torch.randperm(400, generator=generator)[:150]
    stored = torch.arange(150) + torch.randint(-40, 40, (150,), generator=generator) * (torch.arange(150) % 3 == 0)
    slot_positions = torch.zeros(400, dtype=torch.int64)
    slot_positions[slots] = stored.clamp(min=0)
    shift = torch.arange(150) - slot_positions[slots] + max_shift
    keys = gather_rotated_keys(pool_k, slots, angles.cos()[shift], angles.sin()[shift])
    q = torch.randn(50, 9, 64, generator=generator).bfloat16()
    limits = torch.sort(torch.randperm(150, generator=generator)[:50]).values + 1
    got = kernel(q, pool_k, pool_v, limits, slots, slot_positions).float()
    want = reference(q, keys, pool_v[slots], limits)
    assert (got - want).abs().max().item() < 2e-2  # bf16 output rounding included


def test_prefill_kernel_refuses_other_head_sizes(prefill_kernel):
    q, k = torch.zeros(2, 4, 128, dtype=torch.bfloat16), torch.zeros(2, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dimension 128"):
        kernels.prefill_attention_bf16(prefill_kernel, q, k, k, torch.tensor([1, 2]), 0.1)


@pytest.mark.parametrize("mode", ["prefix", "tokendance"])
def test_kernel_prefill_equals_sdpa_prefill_in_rounds(make_llm, prefill_kernel, mode, monkeypatch):
    """Round 1 prefills causally; round 2 runs chunks over sessions and the prefix cache, and
    recomputes tokens over masters read at other positions. The kernel's first-token logits are as
    close to float32's as SDPA's in bf16 are (mean over the agents of the largest difference), and
    the outputs the same as float32's about as often."""
    monkeypatch.setenv("TOKENDANCE_PREFILL_KERNEL", "1")  # the kernel even where SDPA is preferred (AMX)
    fast = make_llm(dtype="bfloat16", reuse=mode, recompute_ratio=0.3)
    assert fast.engine.runner.model.attention.prefill is not None
    slow = make_llm(dtype="bfloat16", reuse=mode, recompute_ratio=0.3)
    slow.engine.runner.model.attention.prefill = None
    exact = make_llm(dtype="float32", reuse=mode, recompute_ratio=0.3)
    for rounds in (1, 2):
        got, want, truth = (llm.run_round(round_turns(rounds), PARAMS).outputs for llm in (fast, slow, exact))
        # bf16 outputs take another path than float32's after a near tie; the kernel's as often as SDPA's
        ours_agree = sum(a.token_ids == b.token_ids for a, b in zip(got, truth))
        sdpa_agree = sum(a.token_ids == b.token_ids for a, b in zip(want, truth))
        assert ours_agree >= sdpa_agree - 1
        # over the agents: one agent's bf16 error swings 2x with rounding elsewhere in the layer
        ours_error = sum((o.logits[0].float() - r.logits[0]).abs().max().item() for o, r in zip(got, truth)) / len(got)
        sdpa_error = sum((s.logits[0].float() - r.logits[0]).abs().max().item() for s, r in zip(want, truth)) / len(got)
        assert ours_error < 1.5 * sdpa_error + 0.1
