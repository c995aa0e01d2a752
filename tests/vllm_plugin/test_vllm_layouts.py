"""The plugin's KV layout readers/writers and key rotation, on tensors of each layout: the GPU
flash layout on CPU tensors (no GPU here), every vLLM-CPU layout against vLLM's own write op,
the rotation against vLLM's own RoPE for each scaling it applies."""

import pytest
import torch

from tests.helpers import has_avx512
from tokendance.vllm_plugin.worker.layouts import FlashLayout

NUM_BLOCKS, HEADS, BLOCK, DIM = 6, 3, 16, 64


def slots_and_kv(num: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:num]
    return slots, torch.randn(num, HEADS, DIM, generator=g), torch.randn(num, HEADS, DIM, generator=g)


@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_flash_layout_reads_and_writes_what_flash_attention_sees(physical):
    """vLLM's FlashAttention backend splits [B, H, N, 2D] as kv.transpose(1, 2).split(D, -1) into
    key and value caches of [B, N, H, D]; the layout must agree whatever the physical order."""
    if physical == "HND":
        cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)
    else:
        cache = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, 2 * DIM).permute(0, 2, 1, 3)
    slots, k, v = slots_and_kv()
    layout = FlashLayout(cache, BLOCK, DIM)
    layout.write(slots, k, v)
    key_cache, value_cache = cache.transpose(1, 2).split(DIM, dim=-1)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    assert torch.equal(key_cache[blocks, offsets], k) and torch.equal(value_cache[blocks, offsets], v)
    read_k, read_v = layout.read(slots)
    assert torch.equal(read_k, k) and torch.equal(read_v, v)
    untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    untouched[slots] = False
    assert layout.read(untouched.nonzero().flatten())[0].abs().sum() == 0  # nothing else written


AMX_WRITE = pytest.mark.skipif(not has_avx512(), reason="vLLM-CPU builds its AMX write op for AVX-512 CPUs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["vec", "vec16", pytest.param("amx", marks=AMX_WRITE)])
def test_cpu_layout_reads_and_writes_as_vllms_cpu_write_op(isa, dtype):
    """Every ISA vLLM-CPU's write op serves, the AMX-packed bf16 cache included (its write op runs
    on any x86 CPU; only its attention needs AMX): the probed layout reads what the op wrote, and
    its own write lays the bytes out exactly as the op does."""
    ops = pytest.importorskip("vllm._custom_ops")
    from tokendance.vllm_plugin.worker.layouts import CpuLayout, probe_cpu_regions

    block = 32  # the AMX layout needs a multiple of 32
    cache = torch.zeros(NUM_BLOCKS, HEADS, block, 2 * DIM, dtype=dtype)
    key_cache, value_cache = cache.view(NUM_BLOCKS, HEADS, block * 2, DIM).chunk(2, dim=2)
    g = torch.Generator().manual_seed(2)
    slots = torch.randperm(NUM_BLOCKS * block, generator=g)[:70]
    k, v = (torch.randn(70, HEADS, DIM, generator=g).to(dtype) for _ in range(2))
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    regions = probe_cpu_regions(isa, dtype, block, HEADS, DIM)
    assert regions is not None
    layout = CpuLayout(cache, block, DIM, regions)
    read_k, read_v = layout.read(slots)
    assert torch.equal(read_k, k) and torch.equal(read_v, v)
    again = torch.zeros_like(cache)
    CpuLayout(again, block, DIM, regions).write(slots, k, v)
    assert torch.equal(again, cache)


@AMX_WRITE
def test_the_amx_packed_bf16_cache_is_laid_out_unlike_the_vec_one():
    """The probe learns a layout, it does not assume one: bf16 keys under AMX are packed in pairs
    of dims, so reading that cache as `vec` would be wrong."""
    pytest.importorskip("vllm._custom_ops")
    from tokendance.vllm_plugin.worker.layouts import probe_cpu_regions

    amx = probe_cpu_regions("amx", torch.bfloat16, 32, HEADS, DIM)
    vec = probe_cpu_regions("vec", torch.bfloat16, 32, HEADS, DIM)
    assert amx[0] != vec[0] and amx[0].dim[-1] == (2, 1)  # two dims side by side
    assert probe_cpu_regions("vec", torch.bfloat16, 256, HEADS, DIM) is not None  # codes up to 256: exact
    assert probe_cpu_regions("vec", torch.bfloat16, 512, HEADS, DIM) is None  # codes past bf16's exact integers


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rotated_keys_equal_keys_computed_at_the_new_position(name):
    """A key computed at position p and moved to q equals the key computed at q (vLLM's RoPE with
    that scaling), to float32 rounding."""
    rope_module = pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
    from vllm.config import VllmConfig, set_current_vllm_config

    from tokendance.vllm_plugin.worker.mirror_pass import KeyRotator

    with set_current_vllm_config(VllmConfig()):
        rope = rope_module.get_rope(DIM, 4096, is_neox_style=True, rope_parameters=ROPES[name], dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(40, HEADS * DIM, generator=g)
    src = torch.randint(0, 4000, (40,), generator=g)
    dst = torch.randint(0, 4000, (40,), generator=g)

    def keys_at(positions):
        _, k = rope.forward_native(positions, torch.zeros(40, HEADS * DIM), raw.clone())
        return k.view(40, HEADS, DIM)

    moved = KeyRotator(rope)(keys_at(src), src, dst)
    expected = keys_at(dst)
    assert (moved - expected).norm() / expected.norm() < 1e-5


def test_anchor_sources_read_the_mean_of_their_encodings_at_the_readers_positions():
    """`Sources` of two encodings (in-round anchors): keys re-rotated to the reader's positions,
    then averaged, values averaged; a span with one encoding, padded beside it, reads that one."""
    rope_module = pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
    from vllm.config import VllmConfig, set_current_vllm_config

    from tokendance.vllm_plugin.worker.mirror_pass import KeyRotator, Sources

    with set_current_vllm_config(VllmConfig()):
        rope = rope_module.get_rope(DIM, 4096, is_neox_style=True, rope_parameters=ROPES["default"], dtype=torch.float32)
    rotate = KeyRotator(rope)
    layout = FlashLayout(torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM), BLOCK, DIM)
    slots, k, v = slots_and_kv(30)
    layout.write(slots, k, v)
    a, b, alone = slots[:8], slots[8:16], slots[16:24]
    pa, pb, pc, at = torch.arange(100, 108), torch.arange(7, 15), torch.arange(60, 68), torch.arange(300, 308)
    half = torch.full((8,), 0.5)
    keys, values = Sources.cat([Sources([a, b], [pa, pb], [half, half]),
                                Sources([alone], [pc], [torch.ones(8)])]).read(layout, rotate, torch.cat([at, at]))
    expected = (rotate(k[:8], pa, at) + rotate(k[8:16], pb, at)) / 2
    torch.testing.assert_close(keys[:8], expected)
    torch.testing.assert_close(values[:8], (v[:8] + v[8:16]) / 2)
    torch.testing.assert_close(keys[8:], rotate(k[16:24], pc, at))
    torch.testing.assert_close(values[8:], v[16:24])
