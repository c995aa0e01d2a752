"""Small C kernels for what torch has no fused op for, built at first use with the machine's C
compiler (`gcc -O3 -march=native -fopenmp`; AVX2 where torch runs AVX2 kernels) into a
per-machine cache and called through ctypes.
Where no compiler is found or the build fails, `load()` returns None and callers use eager ops.

Three kernels: paged decode attention (paged_decode.c, any x86-64), prefill attention in bf16
dot products (prefill_bf16.c, built only where the CPU has AVX512-BF16), and a layer's element-wise
steps fused (pointwise.c: residual add + RMSNorm, RoPE, SiLU * up). All are on by default;
`TOKENDANCE_KERNELS=0` turns them off (eager gather + SDPA, eager element-wise ops). benchmarks/decode.py and
benchmarks/prefill_kernel.py measure each against SDPA side by side.
`TOKENDANCE_CACHE` moves the build cache (default ~/.cache/tokendance).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tokendance.model.platform import cpu_flags

logger = logging.getLogger("tokendance")

SOURCE = Path(__file__).with_name("paged_decode.c")
FLAGS = ["-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-shared", "-fPIC"]


def arch_flags() -> list[str]:
    """The instruction set torch uses here: native where it uses AVX-512, AVX2 (x86-64-v3) where
    it was told or found only AVX2, so a simulated AVX2 run (ATEN_CPU_CAPABILITY=avx2) builds an
    AVX2 kernel too."""
    capability = torch.backends.cpu.get_cpu_capability()
    if os.uname().machine != "x86_64" or capability.startswith("AVX512"):
        return ["-march=native"]
    return ["-march=x86-64-v3"] if capability == "AVX2" else ["-march=x86-64"]


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENDANCE_CACHE") or Path.home() / ".cache" / "tokendance") / "kernels"


def _build(stem: str, flags: list[str]) -> ctypes.CDLL | None:
    """The library built from `stem`.c with `flags`, from the cache or compiled now (None: off,
    no compiler, or the build failed; the reason is logged)."""
    if os.environ.get("TOKENDANCE_KERNELS", "1").strip().lower() in ("0", "false", "no", ""):
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        logger.warning("no C compiler found: %s runs in eager torch ops", stem.replace("_", " "))
        return None
    source_path = SOURCE.with_name(f"{stem}.c")
    try:
        # an installation without the sources falls back like a failed build; the headers they include are in the key
        source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCE.parent.glob("*.h")))
        # -march=native: the binary is only valid on this kind of CPU, so the CPU is in the key
        key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
        library = cache_dir() / f"{stem}-{key}.so"
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
                built = Path(tmp) / library.name
                subprocess.run([compiler, *flags, str(source_path), "-o", str(built), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(built, library)  # atomic: concurrent builders never see half a file
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building %s failed, using eager torch ops: %s", stem.replace("_", " "), detail)
        return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The paged decode kernel."""
    lib = _build("paged_decode", FLAGS + arch_flags())
    if lib is None:
        return None
    fn = lib.paged_decode_attention  # limits: MAX_HEADS, MAX_GROUP, MAX_DIM (checked by supports())
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + \
        [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


PREFILL_DIM = 64  # the head size prefill_bf16.c is built for


@functools.cache
def load_prefill() -> ctypes.CDLL | None:
    """The bf16 prefill attention kernel, where torch runs AVX-512 kernels on a CPU with bf16 dot
    products (AVX512-BF16); None elsewhere (attention runs in SDPA)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512") or "avx512_bf16" not in cpu_flags():
        return None
    lib = _build("prefill_bf16", FLAGS + ["-march=native"])
    if lib is None:
        return None
    fn = lib.prefill_attention_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5 + \
        [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    return lib


@functools.cache
def load_pointwise() -> ctypes.CDLL | None:
    """The element-wise steps of a layer fused (pointwise.c): residual add + RMSNorm, RoPE, SiLU * up."""
    lib = _build("pointwise", FLAGS + arch_flags())
    if lib is None:
        return None
    lib.add_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.rope.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + \
        [ctypes.c_int, ctypes.c_int]
    lib.silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_int]
    for fn in (lib.add_rms_norm, lib.rope, lib.silu_mul):
        fn.restype = ctypes.c_int
    return lib


POINTWISE_DTYPES = (torch.bfloat16, torch.float32)  # what pointwise.c reads and writes
POINTWISE_MAX_DIM = 256  # the largest head size its RoPE takes (MAX_DIM in pointwise.c)


def pointwise_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether pointwise.c takes a model of this dtype and head size (eager ops otherwise)."""
    return dtype in POINTWISE_DTYPES and head_dim % 2 == 0 and head_dim <= POINTWISE_MAX_DIM


def add_rms_norm(lib: ctypes.CDLL, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """hidden += delta in place (rows [T, H] contiguous, one dtype), and returns RMSNorm(hidden) * weight."""
    assert hidden.is_contiguous() and (delta is None or delta.dtype == hidden.dtype)
    out = torch.empty_like(hidden)
    delta = None if delta is None else delta.contiguous()
    lib.add_rms_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                     out.data_ptr(), hidden.shape[0], hidden.shape[1], eps, hidden.dtype == torch.bfloat16,
                     torch.get_num_threads())
    return out


def rope(lib: ctypes.CDLL, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, H, D] (heads and dimensions contiguous, any token stride) in place for
    positions [T] int64, with tables cos/sin [max_len, 1, D] float32."""
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == dim and cos.dtype == torch.float32, "heads and dimensions contiguous"
    status = lib.rope(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads,
                      dim, x.dtype == torch.bfloat16, torch.get_num_threads())
    _check(status, "rope", heads, heads, dim)


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, for gate_up [T, 2 I] contiguous (gate then up in each row): [T, I]."""
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty((tokens, width), dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), tokens, width, gate_up.dtype == torch.bfloat16,
                 torch.get_num_threads())
    return out


MAX_KV_HEADS, MAX_GROUP, MAX_DIM = 16, 16, 256  # as paged_decode.c is compiled


def supports(num_kv_heads: int, num_heads: int, head_dim: int) -> bool:
    """Whether a model's attention shape fits the kernel's fixed-size buffers."""
    return num_kv_heads <= MAX_KV_HEADS and num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_DIM


def _cpu_signature() -> str:
    return f"{os.uname().machine} {' '.join(sorted(cpu_flags()))}"


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [B, Hq, D] float32, contiguous
    key_cache: torch.Tensor,  # [S, Hkv, D] float32 or bfloat16
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [B, W] int64, row b valid for its first lengths[b] columns
    lengths: torch.Tensor,  # [B] int64
    slot_positions: torch.Tensor,  # [S] int64
    shift_cos: torch.Tensor,  # [2 * max_shift + 1, D / 2] float32
    shift_sin: torch.Tensor,
    max_shift: int,
    scale: float,
    stats: torch.Tensor | None = None,  # [2] int64, out: KV rows loaded, and rows a per-request read loads
) -> torch.Tensor:  # [B, Hq, D] float32
    batch, num_heads, dim = q.shape
    out = torch.empty_like(q)
    stats = torch.zeros(2, dtype=torch.int64) if stats is None else stats
    status = lib.paged_decode_attention(
        q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), int(key_cache.dtype == torch.bfloat16),
        slots.data_ptr(), lengths.data_ptr(), slots.shape[1], slot_positions.data_ptr(),
        shift_cos.data_ptr(), shift_sin.data_ptr(), max_shift, batch, num_heads, key_cache.shape[1], dim,
        scale, torch.get_num_threads(), out.data_ptr(), stats.data_ptr(),
    )
    _check(status, "paged decode attention", num_heads, key_cache.shape[1], dim)
    return out


@dataclass(frozen=True)
class Paged:
    """Where a prefill's keys and values are in the KV pool: key j at `slots[j]`, stored for position
    `slot_positions[slot]` and read at position j (rotated by the difference, with the rotation
    tables [2 * max_shift + 1, D / 2] float32)."""

    slots: torch.Tensor  # [Lk] int64
    slot_positions: torch.Tensor  # [num_slots] int64
    shift_cos: torch.Tensor
    shift_sin: torch.Tensor
    max_shift: int


def prefill_attention_bf16(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [Lq, Hq, D] bf16, contiguous
    keys: torch.Tensor,  # the pool [S, Hkv, D] bf16 (with `paged`), or the context [Lk, Hkv, D], contiguous
    values: torch.Tensor,
    limits: torch.Tensor,  # [Lq] int64: query t attends keys [0, limits[t]), 1 <= limits[t] <= Lk
    scale: float,
    paged: Paged | None = None,
) -> torch.Tensor:  # [Lq, Hq, D] float32
    out = torch.empty(q.shape, dtype=torch.float32)
    if paged is None:
        num_keys, pointers, max_shift = keys.shape[0], (0, 0, 0, 0), 0
    else:
        num_keys, max_shift = paged.slots.shape[0], paged.max_shift
        pointers = tuple(t.data_ptr() for t in (paged.slots, paged.slot_positions, paged.shift_cos, paged.shift_sin))
    status = lib.prefill_attention_bf16(q.data_ptr(), keys.data_ptr(), values.data_ptr(), *pointers, max_shift,
                                        limits.data_ptr(), q.shape[0], num_keys, q.shape[1], keys.shape[1],
                                        q.shape[2], scale, torch.get_num_threads(), out.data_ptr())
    _check(status, "prefill attention", q.shape[1], keys.shape[1], q.shape[2])
    return out


def _check(status: int, kernel: str, num_heads: int, num_kv_heads: int, dim: int) -> None:
    """A kernel's return code as the error it stands for (0: fine)."""
    if status == -2:
        raise MemoryError(f"{kernel} could not allocate its work space")
    if status != 0:
        raise ValueError(f"{kernel} does not support {num_heads} heads over {num_kv_heads} KV heads of dimension {dim}")
