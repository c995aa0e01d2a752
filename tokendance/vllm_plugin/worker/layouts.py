"""Reading and writing one layer of vLLM's paged KV cache, per attention backend's layout.

A slot is `block_id * block_size + offset`. Every layout reads and writes K and V of a list of
slots as [num_slots, num_kv_heads, head_size] tensors with plain torch indexing, so each is
unit-tested on CPU tensors of its layout (tests/vllm_plugin/test_vllm_layouts.py). A backend whose
layout is not here gets no reuse: the connector falls back to vLLM's exact computation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

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


Digits = tuple[tuple[int, int], ...]  # mixed-radix digits (size, stride), outermost first


@dataclass(frozen=True)
class Region:
    """Where K (or V) of one block lies: its first element, and each of offset, head and dim as
    digits, so that element (o, h, d) is at base + sum(digit * stride)."""

    base: int
    offset: Digits
    head: Digits
    dim: Digits

    def view(self, cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, *offset digits, *head digits, *dim digits], a strided view of `cache`."""
        digits = self.offset + self.head + self.dim
        return cache.as_strided((cache.shape[0], *(size for size, _ in digits)),
                                (cache[0].numel(), *(stride for _, stride in digits)),
                                cache.storage_offset() + self.base)

    def index(self, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values, below = [], 1
        for size, _ in reversed(self.offset):
            values.append(torch.div(offsets, below, rounding_mode="floor") % size)
            below *= size
        return (blocks, *reversed(values))


class CpuLayout(PagedLayout):
    """vLLM-CPU's cache for any ISA its write op serves (`vec`, `vec16`, the AMX-packed bf16 one):
    where K and V lie is learned from that op (`probe_cpu_regions`), not restated here. Reading or
    writing T slots indexes T (block, offset) pairs of a strided view, as a hand-written layout
    would."""

    name = "cpu"

    def __init__(self, cache: torch.Tensor, block_size: int, head_size: int, regions: tuple[Region, Region]):
        super().__init__(cache, block_size, head_size)
        self.regions = regions
        self.views = [region.view(cache) for region in regions]

    def read(self, slots):
        blocks, offsets = self._split(slots)
        num, heads = slots.numel(), self.cache.shape[1]
        return tuple(view[region.index(blocks, offsets)].reshape(num, heads, self.head_size)
                     for view, region in zip(self.views, self.regions))

    def write(self, slots, keys, values):
        blocks, offsets = self._split(slots)
        for view, region, rows in zip(self.views, self.regions, (keys, values)):
            inner = view.shape[1 + len(region.offset):]
            view[region.index(blocks, offsets)] = rows.to(self.cache.dtype).reshape(slots.numel(), *inner)


def _digits(positions: list[int]) -> Digits | None:
    """`positions` (relative to the first) as mixed-radix digits, or None where they are not."""
    n, digits, span = len(positions), [], 1
    while span < n:
        stride, run = positions[span], 1
        while span * (run + 1) <= n and positions[span * run] == run * stride:
            run += 1
        while n % (span * run):
            run -= 1
        if run < 2:
            return None
        digits.append((run, stride))
        span *= run
    return tuple(reversed(digits))


@functools.cache
def probe_cpu_regions(isa: str, dtype: torch.dtype, block_size: int, num_heads: int,
                      head_size: int) -> tuple[Region, Region] | None:
    """Where vLLM-CPU's write op puts K and V of each (offset, head, dim) of a block, for this ISA
    and shape: it writes each coordinate (plus one) as the value into a scratch cache of two
    blocks, then factors the positions. None where they are not a strided layout, or where the
    dtype cannot hold the codes exactly."""
    from vllm import _custom_ops as ops

    shape = (block_size, num_heads, head_size)
    if max(shape) > 2 / torch.finfo(dtype).eps:  # past that, codes (1 to max(shape)) are not exact integers
        return None
    scratch = torch.zeros(2, num_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = scratch.view(2, num_heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(block_size, 2 * block_size)  # the second block: a layout must not spill
    coordinates = torch.meshgrid(*(torch.arange(size) for size in shape), indexing="ij")
    regions = []
    for side in range(2):
        at = []
        for coordinate in coordinates:
            scratch.zero_()
            code = (coordinate + 1).to(dtype)
            written = (code, torch.zeros_like(code)) if side == 0 else (torch.zeros_like(code), code)
            ops.cpu_attn_reshape_and_cache(*written, key_cache, value_cache, slots, isa)
            if scratch[0].any():
                return None
            at.append(scratch[1].flatten().long() - 1)
        where = (at[0] >= 0).nonzero().flatten()
        if where.numel() != math.prod(shape):
            return None
        position = torch.full(shape, -1, dtype=torch.long)
        position[at[0][where], at[1][where], at[2][where]] = where
        base = int(position[0, 0, 0])
        if (position < 0).any() or int(position.min()) != base:  # a coordinate never written; or not from base up
            return None
        axes = [(position[:, 0, 0] - base).tolist(), (position[0, :, 0] - base).tolist(),
                (position[0, 0, :] - base).tolist()]
        digits = [_digits(axis) if len(axis) > 1 else ((1, 0),) for axis in axes]
        if None in digits or any(stride < 0 for axis in digits for _, stride in axis):
            return None
        region = Region(base, *digits)
        rebuilt = region.view(torch.arange(scratch[0].numel()).view(1, -1))[0].reshape(shape)
        if not torch.equal(rebuilt, position):  # not a sum of the three axes: no strided view
            return None
        regions.append(region)
    return regions[0], regions[1]


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
    no reader for it (fp8 caches, other backends, a CPU layout that is not strided)."""
    if getattr(attention, "kv_cache_dtype", "auto") != "auto" or cache.dim() != 4:
        return None
    backend = type(getattr(attention, "impl", None)).__name__
    head_size = attention.head_size
    if cache.shape[-1] != 2 * head_size:
        return None
    if cache.device.type == "cpu" and getattr(attention, "isa", None) and cache.is_contiguous():
        regions = probe_cpu_regions(attention.isa, cache.dtype, block_size, cache.shape[1], head_size)
        return None if regions is None else CpuLayout(cache, block_size, head_size, regions)
    if cache.device.type == "cuda" and backend.startswith("FlashAttention"):
        return FlashLayout(cache, block_size, head_size)
    return None
