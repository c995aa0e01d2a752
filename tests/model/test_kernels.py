"""The paged decode kernel (keys read in place, queries rotated, shared runs read once) against
the eager path (gather, rotate keys, SDPA): on random tensors without the model, and on real
rounds whose agents read shared masters at other positions. Skipped where no C compiler builds
it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import LOGIT_ATOL, built_kernel, round_turns
from tokendance import SamplingParams
from tokendance.model import kernels
from tokendance.model.kv_math import rotate_pairs
from tokendance.model.platform import cpu_flags

PARAMS = SamplingParams(temperature=0, max_tokens=12, return_logits=True)  # every decode step's logits


@pytest.fixture
def kernel_enabled(monkeypatch):
    yield from built_kernel(monkeypatch, kernels.load, "the paged decode kernel could not be built here (no C compiler?)")


@pytest.mark.parametrize("mode", ["prefix", "tokendance"])
def test_kernel_decode_equals_eager_decode(make_llm, kernel_enabled, mode):
    fast = make_llm(dtype="float32", reuse=mode, recompute_ratio=0.3)
    assert fast.engine.runner.model.attention.decode is not None
    kernels.load.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENDANCE_KERNELS", "0")
        eager = make_llm(dtype="float32", reuse=mode, recompute_ratio=0.3)
    assert eager.engine.runner.model.attention.decode is None
    for rounds in (1, 2):  # round 2: sessions, recall and masters at other positions
        got = fast.run_round(round_turns(rounds), PARAMS)
        want = eager.run_round(round_turns(rounds), PARAMS)
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
        for ours, ref in zip(got.outputs, want.outputs):
            assert len(ours.logits) == len(ref.logits) > 1
            for a, b in zip(ours.logits, ref.logits):
                assert (a - b).abs().max().item() < LOGIT_ATOL


def test_the_kernel_takes_only_shapes_its_buffers_hold():
    """Llama-2-7B's 32 KV heads do not fit the kernel's buffers: such a model decodes in torch
    ops instead of failing at every step."""
    from tokendance.model import kernels

    assert kernels.supports(3, 9, 64)  # the default model
    assert not kernels.supports(32, 32, 128)  # Llama-2-7B
    assert not kernels.supports(8, 8 * 17, 64) and not kernels.supports(8, 8, 512)


def eager_decode(q, key_cache, value_cache, slots, lengths, slot_positions, shift_cos, shift_sin, max_shift):
    """The reference: each request's keys gathered, rotated to the column they are read at, then
    softmax(q k / sqrt(D)) v in float32, queries grouped over KV heads."""
    batch, num_heads, dim = q.shape
    group = num_heads // key_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(batch):
        row = slots[b, :lengths[b]]
        shift = torch.arange(len(row)) - slot_positions[row] + max_shift
        keys = rotate_pairs(key_cache[row].float(), shift_cos[shift][:, None, :], shift_sin[shift][:, None, :])
        keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = value_cache[row].float().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[b], keys) * dim ** -0.5, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", weights, values)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 8, 32), (16, 2, 128)])
def test_kernel_equals_eager_on_random_tensors(kernel_enabled, dtype, heads, kv_heads, dim):
    """No model: random keys stored for other positions than they are read at (so every read is
    shifted), requests reading shared runs of slots (masters: consecutive slots stored at
    consecutive positions, read once for all their readers) and private slots, of varied lengths,
    against the eager reference."""
    generator = torch.Generator().manual_seed(heads * dim)
    num_slots, max_shift = 4096, 4096
    key_cache = torch.randn(num_slots, kv_heads, dim, generator=generator).to(dtype)
    value_cache = torch.randn(num_slots, kv_heads, dim, generator=generator).to(dtype)
    slot_positions = torch.randint(0, 2000, (num_slots,), generator=generator)
    slot_positions[100:400], slot_positions[1000:1130] = torch.arange(300) + 50, torch.arange(130) + 700  # masters
    angles = torch.outer(torch.arange(-max_shift, max_shift + 1, dtype=torch.float32),
                         10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    shift_cos, shift_sin = angles.cos().contiguous(), angles.sin().contiguous()
    shared = [torch.arange(100, 400), torch.arange(1000, 1130)]  # runs several requests read
    rows = []
    for b in range(6):
        private = torch.randint(2000, num_slots, (37 * (b + 1),), generator=generator)
        pieces = [shared[b % 2], private] if b % 3 else [private, shared[0], shared[1]]
        rows.append(torch.cat(pieces))
    lengths = torch.tensor([len(r) for r in rows])
    slots = torch.zeros(len(rows), int(lengths.max()), dtype=torch.int64)
    for b, row in enumerate(rows):
        slots[b, :len(row)] = row
    q = torch.randn(len(rows), heads, dim, generator=generator)
    stats = torch.zeros(2, dtype=torch.int64)
    got = kernels.paged_decode_attention(kernels.load(), q, key_cache, value_cache, slots, lengths, slot_positions,
                                         shift_cos, shift_sin, max_shift, dim ** -0.5, stats)
    want = eager_decode(q, key_cache, value_cache, slots, lengths, slot_positions, shift_cos, shift_sin, max_shift)
    # bf16 pools of head size 64 on CPUs with bf16 dot products: shared runs take the queries and
    # weights in bf16 (8 bits of mantissa), as bf16 attention does
    bf16_dots = dtype == torch.bfloat16 and dim == 64 and "avx512_bf16" in cpu_flags()
    tolerance = 2e-2 if bf16_dots else 1e-4
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    loaded, requested = stats.tolist()
    assert loaded < requested  # the shared runs were read once for their readers
