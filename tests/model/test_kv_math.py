"""The KV arithmetic both front doors share (`model/kv_math.py`): re-rotation between positions
from a RoPE table composes, moves nothing to its own position (bit for bit: the session store
relies on it), and matches a direct rotation; deviation and the encodings' mean."""

import torch

from tokendance.model.kv_math import angles_between, key_deviation, rotate_pairs, weighted_mean


def table(positions: int = 512, dim: int = 64, base: float = 10000.0, scale: float = 1.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * scale  # a YaRN-like magnitude cancels


def test_re_rotation_composes_matches_a_direct_rotation_and_leaves_a_key_at_its_position_as_is():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(6, 3, 64, generator=g)
    cos_sin = table(scale=1.3)
    a, b, c = torch.tensor([0, 5, 17, 100, 3, 250]), torch.tensor([9, 40, 2, 300, 3, 7]), torch.tensor([1, 2, 3, 4, 3, 500])

    def move(k, src, dst):
        return rotate_pairs(k, *angles_between(cos_sin, src, dst))

    assert torch.equal(move(keys, a, a), keys)
    assert torch.allclose(move(move(keys, a, b), b, c), move(keys, a, c), atol=1e-5)
    plain = table()
    shift = (c - a).double()[:, None] * (1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))[None, :]
    direct = rotate_pairs(keys, shift.cos().float()[:, None, :], shift.sin().float()[:, None, :])
    assert torch.allclose(rotate_pairs(keys, *angles_between(plain, a, c)), direct, atol=1e-5)
    # partial rotary: the dimensions past rotary_dim are kept
    half_table = table(dim=32)
    moved = rotate_pairs(keys, *angles_between(half_table, a, c), rotary_dim=32)
    assert torch.equal(moved[..., 32:], keys[..., 32:]) and not torch.equal(moved[..., :32], keys[..., :32])


def test_deviation_and_the_mean_of_encodings():
    fresh = torch.zeros(2, 1, 4)
    cached = torch.tensor([[[1.0, 1.0, 0.0, 0.0]], [[0.0, 0.0, 0.0, 3.0]]])
    assert key_deviation(fresh, cached).tolist() == [2.0, 9.0]
    one, two = torch.ones(2, 1, 4), 3 * torch.ones(2, 1, 4)
    half = torch.full((2,), 0.5)
    assert torch.equal(weighted_mean([one, two], [half, half]), 2 * torch.ones(2, 1, 4))
