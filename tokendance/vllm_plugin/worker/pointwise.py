"""The engine's fused element-wise kernels (`model/kernels/pointwise.c`) for the pass's eager
layers.

vLLM's forward runs its decoder layers compiled, where inductor fuses the native RMSNorm and
SiLU-and-multiply (a handful of elementwise ops each); the pass runs the same modules eagerly, where
those native forms took a fifth of a round's pass. `fused_pointwise(model)` runs them in the
engine's kernels for the pass only: vLLM's `rms_norm` and `fused_add_rms_norm` IR ops dispatched to
them, and each MLP's activation swapped; vLLM's own dispatch is restored after the pass (its
compiled forward never sees them).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from tokendance.model import kernels

PROVIDER = "tokendance_cpu"


def _fits(x: Tensor, weight: Tensor | None, variance_size: int | None) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() and variance_size is None
            and weight is not None and weight.dtype == x.dtype and x.dtype in kernels.POINTWISE_DTYPES)


@functools.cache
def _lib():
    """The engine's kernels, registered with vLLM's IR ops once per process (None where they do
    not build: the native forms then run)."""
    lib = kernels.load_pointwise()
    if lib is None:
        return None
    from vllm import ir

    @ir.ops.rms_norm.register_impl(
        PROVIDER, supports_args=lambda x, weight, epsilon, variance_size=None: _fits(x, weight, variance_size))
    def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        return kernels.add_rms_norm(lib, x, None, weight, epsilon)

    @ir.ops.fused_add_rms_norm.register_impl(
        PROVIDER, inplace=True,
        supports_args=lambda x, x_residual, weight, epsilon, variance_size=None: (
            _fits(x, weight, variance_size) and x_residual.is_contiguous() and x_residual.dtype == x.dtype))
    def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                           variance_size: int | None = None) -> tuple[Tensor, Tensor]:
        return kernels.add_rms_norm(lib, x_residual, x, weight, epsilon), x_residual  # residual += x in place

    return lib


@contextlib.contextmanager
def fused_pointwise(layers: list[torch.nn.Module], dtype: torch.dtype, device: torch.device):
    """Within: RMSNorm and each layer's SiLU-and-multiply run the engine's kernels (CPU only)."""
    lib = _lib() if device.type == "cpu" and dtype in kernels.POINTWISE_DTYPES else None
    if lib is None:
        yield
        return
    from vllm import ir

    acts = [a for a in (getattr(getattr(layer, "mlp", None), "act_fn", None) for layer in layers)
            if type(a).__name__ == "SiluAndMul" and hasattr(a, "_forward_method")]
    saved = [a._forward_method for a in acts]
    try:
        for act in acts:
            act._forward_method = lambda x: kernels.silu_mul(lib, x)
        with ir.ops.rms_norm.set_priority([PROVIDER, "native"]), \
                ir.ops.fused_add_rms_norm.set_priority([PROVIDER, "native"]):
            yield
    finally:
        for act, method in zip(acts, saved):
            act._forward_method = method
