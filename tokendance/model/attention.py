"""Attention over the paged KV cache: the per-step metadata (which slots each request reads,
which keys are read at other positions than they were stored for) and the kernels that run it.

Prefill (several query tokens of one request) runs in the bf16 prefill kernel where the CPU has
AVX512-BF16 and the model runs bf16 (model/kernels/prefill_bf16.c), else in PyTorch's SDPA; decode
(one query token per request, all requests at once) in the paged decode kernel
(model/kernels/paged_decode.c), else in eager gather + SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokendance.model import kernels
from tokendance.model.kv_math import rotate_pairs

@dataclass
class KeyRotation:
    """Per-key RoPE correction: a key stored for position p and read at position p + d is rotated
    by d (rotations compose). float32 cos/sin of each rotary pair: [num_keys, 1, head_dim / 2]."""

    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class PrefillAttention:
    """One request with several query tokens in this step (or any tokens not simply the next)."""

    query_start: int  # rows [query_start, query_end) of the flat batch
    query_end: int
    # Slots of every key this request attends to (cached context + the new tokens), or None when
    # the new tokens are the whole context: then the fresh K/V are used directly, causally.
    context_slots: torch.Tensor | None
    rotation: KeyRotation | None = None  # keys stored at other positions than they are read
    # With context_slots, the queries in parts by position, one attention call each: (start, end,
    # num_keys, mask) = query rows [start, end) attend within the first num_keys keys (what their
    # positions can see; mask [end - start, num_keys] bool, True = attend), so scattered queries
    # (a round's recomputed tokens) skip the keys after them.
    parts: tuple[tuple[int, int, int, torch.Tensor], ...] = ()
    # With context_slots, for the prefill kernel instead of parts: [Lq] int64, query t attends keys
    # [0, limits[t]) (its position + 1).
    limits: torch.Tensor | None = None


@dataclass
class DecodeAttention:
    """All requests with exactly one query token, attended in one batch. Column j of a row is the
    key at position j (padding points at slot 0)."""

    query_rows: torch.Tensor  # [B] rows of the flat batch
    context_slots: torch.Tensor  # [B, max_context] slots
    lengths: torch.Tensor  # [B] int64: valid columns per row
    # Eager path only (None: the paged decode kernel reads slots in place and rotates queries).
    mask: torch.Tensor | None = None  # [B, 1, 1, max_context] bool, False on padding
    # Keys in the first `num_rotated` columns are read at other positions than they were stored
    # for: `rotation` covers the flattened [B * num_rotated] keys; the other columns need none.
    # (The eager path moves each row's shifted keys first: attention is order-independent.)
    rotation: KeyRotation | None = None
    num_rotated: int = 0


@dataclass
class DecodeReads:
    """Cumulative decode-attention traffic: KV rows (one slot, one KV head, K and V) read from the
    pool, and the rows a per-request read would have read (each agent its whole context)."""

    steps: int = 0
    rows_loaded: int = 0
    rows_requested: int = 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    prefills: list[PrefillAttention]
    decode: DecodeAttention | None


def gather_rotated_keys(cache: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys of `slots` moved to the positions they are read at, rotated in float32."""
    return rotate_pairs(cache[slots].float(), cos, sin).to(cache.dtype)


class FusedKeyReader:
    """`gather_rotated_keys` compiled into one loop (torch.compile): in eager mode the gather, the
    bf16 -> fp32 conversions and the rotation are separate passes, measured ~4x slower for 64k
    keys. Falls back to eager if compilation is unavailable."""

    def __init__(self):
        self._compiled = None
        self._failed = False

    def __call__(self, cache, slots, rotation: KeyRotation | None) -> torch.Tensor:
        if rotation is None:
            return cache.index_select(0, slots)
        if not self._failed:
            try:
                if self._compiled is None:
                    self._compiled = torch.compile(gather_rotated_keys, dynamic=True)
                return self._compiled(cache, slots, rotation.cos, rotation.sin)
            except Exception as exc:  # no C++ toolchain, unsupported backend, ...
                import warnings

                warnings.warn(f"fused key rotation unavailable, using eager ops: {exc}")
                self._failed = True
        return gather_rotated_keys(cache, slots, rotation.cos, rotation.sin)


class PagedDecodeKernel:
    """Decode attention in one C kernel (model/kernels/paged_decode.c): each request's keys and
    values are read in place from the pool (no gather copy), and keys stored for another position
    are corrected by rotating the query once per run of equally shifted keys, not every key."""

    def __init__(self, lib, shift_cos: torch.Tensor, shift_sin: torch.Tensor, max_shift: int):
        self.lib = lib
        self.shift_cos, self.shift_sin = shift_cos, shift_sin  # [2 * max_shift + 1, D / 2]
        self.max_shift = max_shift

    @classmethod
    def load(cls, shift_cos: torch.Tensor, shift_sin: torch.Tensor, max_shift: int) -> "PagedDecodeKernel | None":
        """`shift_cos`, `shift_sin`: [2 * max_shift + 1, 1, D / 2], the rotation by each shift."""
        lib = kernels.load()
        if lib is None:
            return None
        flat = (shift_cos.shape[0], shift_cos.shape[-1])
        return cls(lib, shift_cos.reshape(flat).contiguous(), shift_sin.reshape(flat).contiguous(), max_shift)

    def __call__(self, q, key_cache, value_cache, d: DecodeAttention, positions: torch.Tensor,
                 reads: DecodeReads | None = None) -> torch.Tensor:
        query = q[d.query_rows].float().contiguous()  # [B, Hq, D]
        counts = torch.zeros(2, dtype=torch.int64)
        out = kernels.paged_decode_attention(
            self.lib, query, key_cache, value_cache, d.context_slots, d.lengths, positions,
            self.shift_cos, self.shift_sin, self.max_shift, query.shape[-1] ** -0.5, counts)
        if reads is not None:
            loaded, requested = counts.tolist()
            reads.rows_loaded += loaded
            reads.rows_requested += requested
        return out.to(q.dtype)  # [B, Hq, D]


def split_decode(d: DecodeAttention) -> list[DecodeAttention]:
    """Each request of a decode batch alone, its slots cut to its own length (no rotation)."""
    found = []
    for b, length in enumerate(d.lengths.tolist()):
        mask = None if d.mask is None else d.mask[b:b + 1, :, :, :length]
        found.append(DecodeAttention(d.query_rows[b:b + 1], d.context_slots[b:b + 1, :length], d.lengths[b:b + 1], mask))
    return found


class PrefillKernel:
    """Prefill attention of one request in bf16 dot products (model/kernels/prefill_bf16.c): keys
    and values read from the pool through the request's slots (shared keys rotated as they are
    read), each query stopped at its position: no gathered copies, no mask tensor."""

    def __init__(self, lib, shift_cos: torch.Tensor, shift_sin: torch.Tensor, max_shift: int):
        self.lib = lib
        self.shift_cos, self.shift_sin, self.max_shift = shift_cos, shift_sin, max_shift

    @classmethod
    def load(cls, dtype: torch.dtype, head_dim: int, shift_cos: torch.Tensor, shift_sin: torch.Tensor,
             max_shift: int) -> "PrefillKernel | None":
        """`shift_cos`, `shift_sin`: [2 * max_shift + 1, 1, D / 2], the rotation by each shift."""
        lib = kernels.load_prefill() if dtype == torch.bfloat16 and head_dim == kernels.PREFILL_DIM else None
        if lib is None:
            return None
        flat = (shift_cos.shape[0], shift_cos.shape[-1])
        return cls(lib, shift_cos.reshape(flat).contiguous(), shift_sin.reshape(flat).contiguous(), max_shift)

    def __call__(self, q, keys, values, limits: torch.Tensor, slots: torch.Tensor | None = None,
                 slot_positions: torch.Tensor | None = None) -> torch.Tensor:  # [Lq, Hq, D] in q's dtype
        """Over `keys`/`values` themselves (key j at position j), or with `slots` over the pool."""
        paged = None if slots is None else kernels.Paged(slots, slot_positions, self.shift_cos, self.shift_sin,
                                                         self.max_shift)
        out = kernels.prefill_attention_bf16(self.lib, q.contiguous(), keys, values, limits, q.shape[-1] ** -0.5,
                                             paged)
        return out.to(q.dtype)


@dataclass
class AttentionKernels:
    """What runs attention: the key reader (gathers and rotates shared keys), and the C kernels
    where this machine has them (None: SDPA / eager ops)."""

    read_keys: FusedKeyReader
    decode: PagedDecodeKernel | None = None
    prefill: PrefillKernel | None = None


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D] new queries
    k: torch.Tensor,  # [T, Hkv, D] new keys (already written to the cache)
    v: torch.Tensor,
    key_cache: torch.Tensor,  # [num_slots, Hkv, D]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    run: AttentionKernels,
    slot_positions: torch.Tensor | None = None,  # [num_slots]: the position each key is rotated for
    reads: DecodeReads | None = None,  # decode traffic is added here
    alone: bool = False,  # each decode attended on its own (batch-invariant): no shared reads, no padding
) -> torch.Tensor:  # [T, Hq * D]
    out = torch.empty_like(q)
    for p in meta.prefills:
        rows = slice(p.query_start, p.query_end)
        out[rows] = prefill_attention(q[rows], k[rows], v[rows], key_cache, value_cache, p, run, slot_positions)
    d = meta.decode
    if d is not None and alone and d.rotation is None:  # each request alone: no padding, no shared reads
        for row, decode in zip(d.query_rows.tolist(), split_decode(d)):
            out[row] = decode_attention(q, key_cache, value_cache, decode, run, slot_positions, reads)[0]
    elif d is not None:
        out[d.query_rows] = decode_attention(q, key_cache, value_cache, d, run, slot_positions, reads)
    return out.flatten(1)


def prefill_attention(q, k, v, key_cache, value_cache, p: PrefillAttention, run: AttentionKernels,
                      slot_positions: torch.Tensor | None = None) -> torch.Tensor:
    """One request's queries [Lq, Hq, D] against its context: [Lq, Hq, D]."""
    if p.context_slots is None:  # the new tokens are the whole context: causal
        if run.prefill is not None:
            return run.prefill(q, k.contiguous(), v.contiguous(), torch.arange(1, q.shape[0] + 1))
        # SDPA gets 4-D inputs: only those take the fused (flash) CPU kernel with GQA.
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)
    if run.prefill is not None and p.limits is not None:
        return run.prefill(q, key_cache, value_cache, p.limits, p.context_slots, slot_positions)
    keys = run.read_keys(key_cache, p.context_slots, p.rotation)  # [Lk, Hkv, D]
    values = value_cache.index_select(0, p.context_slots)
    query, keys, values = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    parts = [F.scaled_dot_product_attention(query[:, :, start:end], keys[:, :, :num_keys], values[:, :, :num_keys],
                                            attn_mask=mask, enable_gqa=True)
             for start, end, num_keys, mask in p.parts]
    o = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return o[0].transpose(0, 1)


def decode_attention(q, key_cache, value_cache, d: DecodeAttention, run: AttentionKernels, slot_positions,
                     reads: DecodeReads | None) -> torch.Tensor:
    """One query token per request of `d`: [B, Hq, D], in the kernel, or eager where `d` has a mask."""
    if d.mask is None:
        return run.decode(q, key_cache, value_cache, d, slot_positions, reads)
    if reads is not None:  # every request reads its whole context
        rows = int(d.lengths.sum()) * key_cache.shape[1]
        reads.rows_loaded += rows
        reads.rows_requested += rows
    batch, max_context = d.context_slots.shape
    flat_slots = d.context_slots.reshape(-1)
    # [B * Lk, Hkv, D] -> [B, Lk, Hkv, D]
    keys = key_cache.index_select(0, flat_slots).view(batch, max_context, *key_cache.shape[1:])
    if d.rotation is not None:
        rotated = d.context_slots[:, : d.num_rotated].reshape(-1)
        keys[:, : d.num_rotated] = run.read_keys(key_cache, rotated, d.rotation).view(batch, d.num_rotated, *key_cache.shape[1:])
    values = value_cache.index_select(0, flat_slots).view(batch, max_context, *key_cache.shape[1:])
    # Each KV head's query group as Lq rows: [B, Hkv, Hq/Hkv, D]. Measured 1.8x faster than
    # SDPA's enable_gqa for one query per request, with identical results.
    num_kv_heads, head_dim = key_cache.shape[1:]
    query = q[d.query_rows].view(batch, num_kv_heads, -1, head_dim)
    o = F.scaled_dot_product_attention(query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=d.mask)
    return o.reshape(batch, -1, head_dim)
