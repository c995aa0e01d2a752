"""What this machine offers, probed once: the CPU's vector capability, whether bf16 runs natively,
and how much memory is free. The engine picks its dtype, linear kernels and KV pool size from it.

bf16 is only fast where the CPU has bf16 dot products (AVX512-BF16 or AMX): there oneDNN's packed
bf16 weights measured 2-6x faster than fp32. On an AVX2-only CPU bf16 GEMMs ran ~8x slower than
fp32 and oneDNN refuses packed bf16 weights outright, so "auto" means float32 there (an explicit
bf16 computes its products in float32: model/linear.py `UpcastBF16Linear`).

`TOKENDANCE_NATIVE_BF16=0` forces the "no native bf16" answer (`=1` forces "yes"; packing is still
probed). Running under `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` simulates an AVX2-only
CPU for torch's kernels, oneDNN and this probe alike.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("tokendance")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")

AUTO_KV_SHARE = 0.25  # of the memory available at start
AUTO_KV_MAX = 4 * 2**30  # vLLM-CPU's default KV space
AUTO_KV_MIN = 64 * 2**20


@dataclass(frozen=True)
class CpuInfo:
    """`capability` is torch's ("AVX512", "AVX2", ...); `native_bf16`: bf16 dot products in
    hardware; `packed_bf16`: oneDNN's pre-packed bf16 linear runs here (checked by running one)."""

    capability: str
    native_bf16: bool
    packed_bf16: bool
    amx_bf16: bool = False  # AMX tiles: oneDNN's bf16 matmuls, and so SDPA's, run on them

    @property
    def prefers_prefill_kernel(self) -> bool:
        """Prefill attention in the bf16 C kernel (dot products in AVX512-BF16) rather than SDPA:
        where there is no AMX. With AMX, SDPA measured 2-3x faster on prefill shapes and plain
        serving 1.19x faster end to end (benchmarks/prefill_kernel.py, benchmarks/roofline.py);
        without it the kernel measured 3.4-4.4x faster than SDPA. `TOKENDANCE_PREFILL_KERNEL=1`
        (or 0) forces the choice."""
        forced = os.environ.get("TOKENDANCE_PREFILL_KERNEL")
        if forced is not None:
            return forced.strip().lower() not in ("0", "false", "no", "")
        return not self.amx_bf16

    def describe(self) -> str:
        return f"{self.capability}, {'native' if self.native_bf16 else 'no native'} bf16"


def probe_cpu() -> CpuInfo:
    capability = torch.backends.cpu.get_cpu_capability()
    forced = os.environ.get("TOKENDANCE_NATIVE_BF16")
    if forced is not None:
        native = forced.strip().lower() not in ("0", "false", "no", "")
    else:
        native = capability.startswith("AVX512") and any(flag in cpu_flags() for flag in BF16_FLAGS)
    return CpuInfo(capability, native, native and packed_bf16_runs(), native and "amx_bf16" in cpu_flags())


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def packed_bf16_runs() -> bool:
    """One tiny packed bf16 matmul, checked against fp32: True only if it runs and is right."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(4, 64), torch.randn(32, 64)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 4)
        y = torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed, None, "none", [], "")
        return bool(torch.allclose(y.float(), x @ w.T, rtol=0.05, atol=0.5))
    except RuntimeError:
        return False


def resolve_dtype(requested: str, cpu: CpuInfo, device: str = "cpu") -> torch.dtype:
    """"auto" -> bfloat16 where it runs natively (or off the CPU), else float32. An explicit
    bfloat16 without native support works, unpacked, after one warning."""
    on_cpu = torch.device(device).type == "cpu"
    if requested == "auto":
        return torch.bfloat16 if (cpu.native_bf16 or not on_cpu) else torch.float32
    if requested == "bfloat16" and on_cpu and not cpu.native_bf16:
        warn_slow_bf16(cpu.capability)
    return DTYPES[requested]


@functools.cache
def warn_slow_bf16(capability: str) -> None:
    logger.warning(
        "dtype=bfloat16 on a CPU without native bf16 (%s): bf16 arithmetic is emulated (matrix "
        "products run in float32 and are rounded), no faster than float32; dtype='auto' picks float32",
        capability)


def describe_machine(dtype: str, cpu: CpuInfo | None = None) -> dict:
    """What a published figure needs next to it: the dtype it ran in and the CPU's capability."""
    cpu = cpu or probe_cpu()
    return {"dtype": dtype, "cpu_capability": cpu.capability, "native_bf16": cpu.native_bf16}


def dtype_name(requested: str, device: str = "cpu") -> str:
    """The dtype an engine asked for `requested` runs in, as a name ("float32", "bfloat16")."""
    return str(resolve_dtype(requested, probe_cpu(), device)).removeprefix("torch.")


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_kv_cache_bytes(available: int | None = None) -> int:
    """A fixed share of the memory available now, capped at 4 GiB (and at least 64 MiB)."""
    available = available_memory_bytes() if available is None else available
    return int(max(AUTO_KV_MIN, min(AUTO_KV_MAX, AUTO_KV_SHARE * available)))
