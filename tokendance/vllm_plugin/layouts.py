"""Reading and writing one layer of vLLM's paged KV cache, per attention backend's layout.

A slot is `block_id * block_size + offset`. Every layout reads and writes K and V of a list of
slots as [num_slots, num_kv_heads, head_size] tensors with plain torch indexing, so each is
unit-tested on CPU tensors of its layout (tests/vllm_plugin/test_layouts.py). A backend whose
layout is not here gets no reuse: the connector falls back to vLLM's exact computation.
"""

from __future__ import annotations

import torch


class PagedLayout:
    """One layer's KV cache tensor as its backend lays it out."""

    name = "?"

    def __init__(self, cache: torch.Tensor, block_size: int, head_size: int):
        self.cache = cache
        self.block_size = block_size
        self.head_size = head_size

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.div(slots, self.block_size, rounding_mode="floor"), slots % self.block_size

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError


class CpuVecLayout(PagedLayout):
    """vLLM-CPU's `vec` ISA: the tensor is [num_blocks, num_kv_heads, block_size, 2 * head_size];
    within one block and head, the first block_size * head_size values are K column-major
    ([head_size, block_size]) and the next ones V row-major ([block_size, head_size])."""

    name = "cpu-vec"

    def _regions(self) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks, num_heads, block_size, _ = self.cache.shape
        flat = self.cache.view(num_blocks, num_heads, 2, block_size * self.head_size)
        keys = flat[:, :, 0].view(num_blocks, num_heads, self.head_size, block_size)
        values = flat[:, :, 1].view(num_blocks, num_heads, block_size, self.head_size)
        return keys, values

    def read(self, slots):
        blocks, offsets = self._split(slots)
        keys, values = self._regions()
        return keys[blocks, :, :, offsets], values[blocks, :, offsets, :]  # [T, H, D] each

    def write(self, slots, keys, values):
        blocks, offsets = self._split(slots)
        key_region, value_region = self._regions()
        key_region[blocks, :, :, offsets] = keys.to(self.cache.dtype)
        value_region[blocks, :, offsets, :] = values.to(self.cache.dtype)


class FlashLayout(PagedLayout):
    """vLLM's FlashAttention backend (GPU): the tensor is [num_blocks, num_kv_heads, block_size,
    2 * head_size] logically (its physical order may differ; torch indexing follows strides), K in
    the first head_size values of the last dimension and V in the next."""

    name = "flash"

    def read(self, slots):
        blocks, offsets = self._split(slots)
        rows = self.cache[blocks, :, offsets]  # [T, H, 2D]
        return rows[..., : self.head_size], rows[..., self.head_size:]

    def write(self, slots, keys, values):
        blocks, offsets = self._split(slots)
        self.cache[blocks, :, offsets] = torch.cat([keys, values], dim=-1).to(self.cache.dtype)


def find_layout(attention, cache: torch.Tensor, block_size: int) -> PagedLayout | None:
    """The layout of `cache` for vLLM attention layer `attention`, or None where this plugin has
    no reader for it (AMX-packed bf16 on CPU, fp8 caches, other backends)."""
    if getattr(attention, "kv_cache_dtype", "auto") != "auto" or cache.dim() != 4:
        return None
    backend = type(getattr(attention, "impl", None)).__name__
    head_size = attention.head_size
    if cache.shape[-1] != 2 * head_size:
        return None
    if cache.device.type == "cpu" and getattr(attention, "isa", None) == "vec":
        return CpuVecLayout(cache, block_size, head_size)
    if cache.device.type == "cuda" and backend.startswith("FlashAttention"):
        return FlashLayout(cache, block_size, head_size)
    return None
