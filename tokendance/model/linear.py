"""Linear-layer kernels: y = x W^T over the flat batch, chosen for the dtype and the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseLinear:
    """y = x W^T with the weight as an ordinary tensor (any device and dtype)."""

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # A single row goes through matrix-vector: measured ~25% faster than a 1-row GEMM on CPU.
        if x.shape[0] == 1:
            return torch.mv(weight, x[0])[None]
        return F.linear(x, weight)


class UpcastBF16Linear(DenseLinear):
    """bf16 on a CPU without bf16 dot products (AVX2), where a bf16 GEMM is emulated: the rows times
    the weight converted to float32 for the call, the result rounded back to bf16. The rounding is a
    bf16 GEMM's (bf16 inputs, products exact in float32, float32 sums, a bf16 result) and the weights
    stay bf16 in memory. Measured on AVX2 (one thread): 600 rows x 1536x576 in 11 ms against 54 ms,
    32 rows in 0.73 against 2.87 ms. The conversion costs about a 2**19th of the weight per row saved,
    so fewer rows (decode, the vocabulary's projection of a small batch) stay in bf16."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < 4 or rows * 2**19 < weight.numel():
            return super().__call__(x, weight)
        return F.linear(x.float(), weight.float()).to(x.dtype)


class PackedBF16Linear:
    """bf16 on CPU: weights reordered once into oneDNN's blocked layout. An unpacked bf16 weight
    is reordered on every call; packing measured 1.4-1.6x faster from 1 to 512 rows, same results."""

    def __init__(self, max_batch_tokens: int):
        self.batch_hint = max_batch_tokens

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


class TiledLinear:
    """Any linear kernel, called on row tiles of one fixed size (the last one padded): a GEMM's
    result for a row depends on the number of rows it is called with (measured: 1 row differs from
    2+ in packed bf16, 1-3 rows from 4+ in float32), never on the other rows' values, so every row
    gets the same result whatever the batch."""

    ROWS = 32

    def __init__(self, inner):
        self.inner = inner

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return self.inner.prepare(weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = -(-rows // self.ROWS) * self.ROWS
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        tiles = [self.inner(x[i:i + self.ROWS], weight) for i in range(0, padded, self.ROWS)]
        return torch.cat(tiles)[:rows]


def choose_linear_kernel(dtype, device, max_batch_tokens: int, packed_bf16: bool, native_bf16: bool):
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and dtype == torch.bfloat16 and packed_bf16:
        return PackedBF16Linear(max_batch_tokens)
    if on_cpu and dtype == torch.bfloat16 and not native_bf16:
        return UpcastBF16Linear()
    return DenseLinear()
