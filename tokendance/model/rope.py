"""Rotary position embeddings of the supported families: the inverse frequency of each rotary pair
and the factor applied to cos/sin, for default RoPE and the scaled variants (linear, Llama 3,
YaRN), as Hugging Face transformers computes them (`modeling_rope_utils.py`).

Keys are stored rotated for the position they were computed at; a reader at another position
rotates them by the difference with the same frequencies (a pure rotation: the YaRN attention
factor is already in the stored key), so position correction holds for every variant here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from tokendance.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# What each variant reads from a config's `rope_scaling` / `rope_parameters`, beside `rope_type`
# (or the older `type`) and `rope_theta`. Anything else is refused: a key we ignore would change
# the model's positions without a word.
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
}


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE variant's parameters (`kind` in ROPE_TYPES, not "default"). `freq_factors`:
    per-pair divisors of the frequencies, as GGUF files of Llama 3 store them (`rope_freqs`)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    freq_factors: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, params: dict | None, max_position_embeddings: int, where: str) -> "RopeScaling | None":
        """From a config.json's `rope_scaling` or (transformers 5) `rope_parameters`; None for
        default RoPE. Unknown variants and unknown keys raise `ModelLoadError`."""
        params = dict(params or {})
        params.pop("rope_theta", None)
        if params.pop("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError(f"{where}: partial_rotary_factor != 1 is not supported")
        kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        if kind not in ROPE_TYPES:
            raise ModelLoadError(f"{where}: RoPE type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        unknown = set(params) - ROPE_KEYS[kind]
        if unknown:
            raise ModelLoadError(f"{where}: RoPE {kind!r} parameters {sorted(unknown)} are not supported "
                                 f"(known: {sorted(ROPE_KEYS[kind]) or 'none'})")
        if kind == "default":
            return None
        if kind in ("linear", "llama3") and params.get("factor") is None:
            raise ModelLoadError(f"{where}: RoPE {kind!r} needs a 'factor'")
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
        if kind == "yarn" and params.get("factor") is None:  # as transformers: the ratio of the lengths
            params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]
        known = {f.name for f in fields(cls)}
        return cls(kind=kind, **{k: v for k, v in params.items() if k in known and v is not None})

    def describe(self) -> str:
        return f"{self.kind} x{self.factor:g}"


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequency of each rotary pair [head_dim / 2] float32, factor on cos/sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling), _yarn_attention_factor(scaling)
    return inv_freq, 1.0  # freq_factors alone


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths divided by the factor, short ones kept, a smooth ramp between."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """Interpolated (divided by the factor) below the correction range, extrapolated (kept) above,
    a linear ramp across it."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)
