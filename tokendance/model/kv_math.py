"""The KV arithmetic of reuse, pure torch, one module for both front doors (our engine and the vLLM
plugin): moving keys between positions (RoPE re-rotation), the mean of several encodings of the
same tokens (in-round anchors), and how far a cached key is from a fresh one (the selection's
deviation)."""

from __future__ import annotations

import torch


def rotate_pairs(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate each rotary pair (j, j + r/2) of float keys [N, H, D] by angles with cos/sin
    [N, 1, r/2] (neox pairing); r = `rotary_dim` (all of D if None), dimensions past it kept."""
    rotary_dim = keys.shape[-1] if rotary_dim is None else rotary_dim
    half = rotary_dim // 2
    first, second = keys[..., :half], keys[..., half:rotary_dim]
    rotated = [first * cos - second * sin, second * cos + first * sin]
    if rotary_dim < keys.shape[-1]:
        rotated.append(keys[..., rotary_dim:])
    return torch.cat(rotated, dim=-1)


def angles_between(table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, 1, r/2] (float32) of the rotation R(dst) R(src)^T, from a RoPE table of cos | sin
    per position ([max_position, r], float64 for the division): exact for any fixed-frequency
    table (default, linear, llama3, YaRN: a table's magnitude cancels)."""
    half = table.shape[-1] // 2
    c0, s0 = table[src, :half], table[src, half:]
    c1, s1 = table[dst, :half], table[dst, half:]
    norm = c0 * c0 + s0 * s0
    return ((c1 * c0 + s1 * s0) / norm).float()[:, None, :], ((s1 * c0 - c1 * s0) / norm).float()[:, None, :]


def weighted_mean(parts: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    """sum_e weights[e][:, None, None] * parts[e] in float32: the encodings' mean of each token
    ([N, H, D] parts, [N] weights summing to 1 per token)."""
    total = 0.0
    for part, weight in zip(parts, weights):
        total = total + part.float() * weight[:, None, None]
    return total


def key_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """[N]: the squared distance of each token's cached keys from its fresh ones ([N, H, D] each),
    over heads and dimensions, in float32: what CacheBlend-style selections rank."""
    return (fresh.float() - cached.float()).pow(2).sum(dim=(1, 2))
