"""Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache:
Llama 2/3.x and Mistral, Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm), with the RoPE
variants of model/rope.py.

The forward pass takes one flat batch of new tokens from many requests — prefill chunks and decode
tokens mixed — plus an `AttentionMetadata` that says where each token's K/V is written and which
cached slots each request attends to. Linear layers run once over the whole flat batch; only
attention is split per request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokendance.config import ModelConfig
from tokendance.model import kernels
from tokendance.model.attention import (
    AttentionKernels,
    AttentionMetadata,
    DecodeReads,
    FusedKeyReader,
    KeyRotation,
    PagedDecodeKernel,
    PrefillKernel,
    paged_attention,
)
from tokendance.model.linear import TiledLinear, choose_linear_kernel
from tokendance.model.platform import CpuInfo
from tokendance.model.rope import rope_frequencies

logger = logging.getLogger("tokendance")


@dataclass
class KVCacheTensors:
    """The physical KV pool: per layer, one row per slot (slot = block_id * block_size + offset).
    Keys are stored already rotated (RoPE) for the position they were computed at, which
    `positions[slot]` records, so a reader at another position can correct them."""

    keys: list[torch.Tensor]  # num_layers x [num_slots, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    positions: torch.Tensor  # [num_slots] int64

    @classmethod
    def allocate(cls, config: ModelConfig, num_slots: int, dtype, device) -> "KVCacheTensors":
        """Uninitialized but for slot 0: a slot is read only after it is written, except slot 0,
        which pads decode batches (masked, but NaN garbage would survive the mask). Zeroing a
        4 GiB pool measured 6 s and would make all of it resident up front."""
        shape = (num_slots, config.num_kv_heads, config.head_dim)
        cache = cls(
            keys=[torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)],
            values=[torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)],
            positions=torch.zeros(num_slots, dtype=torch.int64, device=device),
        )
        for tensor in (*cache.keys, *cache.values):
            tensor[0].zero_()
        return cache

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden], q/k/v projections fused
    out: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden], gate/up projections fused
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D] (Qwen2)
    qk_norm: torch.Tensor | None = None  # [Hq + Hkv, D]: each query head's, then each key head's RMSNorm weight (Qwen3)


class LlamaModel:
    """Weights plus a functional forward; holds no per-request state."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype,
        device,
        max_batch_tokens: int = 2048,
        cpu: CpuInfo | None = None,
        batch_invariant: bool = False,
        prepared: dict | None = None,
    ):
        """`cpu`: what the CPU offers (model/platform.py), which picks the linear and attention
        kernels (None: the portable ones). `batch_invariant`: each row's result does not depend on
        the other rows of the batch."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.batch_invariant = batch_invariant
        self.linear = choose_linear_kernel(dtype, device, max_batch_tokens, cpu is not None and cpu.packed_bf16,
                                           cpu is None or cpu.native_bf16)
        if batch_invariant:
            self.linear = TiledLinear(self.linear)
        # `prepared`: where models built from the same `weights` keep what they computed from them
        # (a fused or packed copy costs 0.1 s and the model's size again per engine, otherwise).
        prepared = {} if prepared is None else prepared
        kernel = getattr(self.linear, "inner", self.linear)
        key = (dtype, str(device), type(kernel).__name__, getattr(kernel, "batch_hint", None))
        if key not in prepared:
            prepared[key] = self._prepare(config, weights, dtype, device)
        self.embed_tokens, self.layers, self.norm, self.lm_head = prepared[key]
        self.cos, self.sin = rope_tables(config, device)
        # Rotations by any shift in (-max_len, max_len), per rotary pair, contiguous: gathered
        # once per step for shared keys (a contiguous table measured 2x faster to gather).
        self.max_shift = config.max_model_len - 1
        shifts = torch.arange(-self.max_shift, self.max_shift + 1, dtype=torch.float32)
        # A pure rotation: the YaRN factor on cos/sin is already in the stored keys.
        angles = torch.outer(shifts, rope_inverse_frequencies(config))[:, None, :]  # [2L-1, 1, D/2]
        self.shift_cos, self.shift_sin = angles.cos().to(device), angles.sin().to(device)
        fits = kernels.supports(config.num_kv_heads, config.num_heads, config.head_dim)
        if not fits:
            logger.info("the paged decode kernel takes at most %d KV heads, %d queries per KV head and head size %d: "
                        "decode attention of this model (%d KV heads, %d heads, head size %d) runs in eager ops",
                        kernels.MAX_KV_HEADS, kernels.MAX_GROUP, kernels.MAX_DIM, config.num_kv_heads,
                        config.num_heads, config.head_dim)
        on_cpu = torch.device(device).type == "cpu"
        self.attention = AttentionKernels(
            FusedKeyReader(),
            decode=PagedDecodeKernel.load(self.shift_cos, self.shift_sin, self.max_shift) if on_cpu and fits else None,
            prefill=PrefillKernel.load(dtype, config.head_dim, self.shift_cos, self.shift_sin, self.max_shift)
            if on_cpu and cpu is not None and cpu.prefers_prefill_kernel else None,
        )
        self.decode_reads = DecodeReads()
        fused = on_cpu and kernels.pointwise_fits(dtype, config.head_dim)
        self.pointwise = Pointwise(kernels.load_pointwise() if fused else None, self.cos, self.sin, self.dtype)

    def _prepare(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype, device) -> tuple:
        """(embeddings, layers, final norm, LM head): the weights cast to `dtype` on `device`, q/k/v
        and gate/up fused, packed for the linear kernel. The layers are a tuple: models share them."""

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        def packed(tensor: torch.Tensor) -> torch.Tensor:
            return self.linear.prepare(tensor)

        def qk_norm(p: str) -> torch.Tensor | None:
            if not config.qk_norm:
                return None
            return torch.cat([w(p + "self_attn.q_norm.weight").expand(config.num_heads, -1),
                              w(p + "self_attn.k_norm.weight").expand(config.num_kv_heads, -1)])

        embed_tokens = w("model.embed_tokens.weight")
        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=packed(torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"])),
                    out=packed(w(p + "self_attn.o_proj.weight")),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=packed(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                    down=packed(w(p + "mlp.down_proj.weight")),
                    qkv_bias=torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
                    if config.attention_bias else None,
                    qk_norm=qk_norm(p),
                )
            )
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        lm_head = packed(embed_tokens if tied else w("lm_head.weight"))
        return embed_tokens, tuple(layers), w("model.norm.weight"), lm_head

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: KVCacheTensors,
        num_layers: int | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """Run the first `num_layers` layers (all by default) and the final norm."""
        c = self.config
        pointwise = self.pointwise.bind(positions)
        hidden, delta = F.embedding(input_ids, self.embed_tokens), None
        reads = self.decode_reads if meta.decode is not None else None
        if reads is not None:
            reads.steps += 1
        num_qk = (c.num_heads + c.num_kv_heads) * c.head_dim
        for layer_index, layer in enumerate(self.layers[:num_layers]):
            hidden, x = pointwise.add_rms_norm(hidden, delta, layer.input_norm, c.rms_norm_eps)
            qkv = self.linear(x, layer.qkv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            qk = qkv[:, :num_qk].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)  # [T, Hq + Hkv, D]
            if layer.qk_norm is not None:
                qk = rms_norm(qk, layer.qk_norm, c.rms_norm_eps)
            qk = pointwise.rope(qk)  # q and k rotated in one pass
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = qkv[:, num_qk:].view(-1, c.num_kv_heads, c.head_dim)
            key_cache, value_cache = kv_cache.keys[layer_index], kv_cache.values[layer_index]
            key_cache.index_copy_(0, meta.slot_mapping, k)
            value_cache.index_copy_(0, meta.slot_mapping, v)
            attn = paged_attention(q, k, v, key_cache, value_cache, meta, self.attention, kv_cache.positions, reads,
                                   self.batch_invariant)  # [T, Hq * D]
            hidden, x = pointwise.add_rms_norm(hidden, self.linear(attn, layer.out), layer.post_norm, c.rms_norm_eps)
            delta = self.linear(pointwise.silu_mul(self.linear(x, layer.gate_up)), layer.down)
        return pointwise.add_rms_norm(hidden, delta, self.norm, c.rms_norm_eps)[1]

    def key_rotation(self, shift: torch.Tensor) -> KeyRotation:
        """Rotation tables for keys read `shift` positions after where they were stored."""
        index = shift.reshape(-1) + self.max_shift
        return KeyRotation(self.shift_cos[index], self.shift_sin[index])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab], model dtype
        return self.linear(hidden, self.lm_head)


class Pointwise:
    """A layer's element-wise steps: fused C kernels (kernels/pointwise.c) where they load, eager
    torch ops elsewhere. `bind(positions)` gives the steps for one forward pass."""

    def __init__(self, lib, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
        self.lib, self.cos, self.sin, self.dtype = lib, cos, sin, dtype

    def bind(self, positions: torch.Tensor) -> "Pointwise":
        bound = Pointwise(self.lib, self.cos, self.sin, self.dtype)
        if self.lib is None:  # eager RoPE takes the tables' rows for these positions, once per pass
            bound.cos, bound.sin = self.cos[positions].to(self.dtype), self.sin[positions].to(self.dtype)
        bound.positions = positions.to(torch.int64).contiguous()
        return bound

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, RMSNorm of it): the residual stream and the next sublayer's input."""
        if self.lib is not None:
            return hidden, kernels.add_rms_norm(self.lib, hidden, delta, weight, eps)
        hidden = hidden if delta is None else hidden + delta
        return hidden, rms_norm(hidden, weight, eps)

    def rope(self, x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> rotated [T, H, D] (in place with the kernel)
        if self.lib is not None:
            kernels.rope(self.lib, x, self.positions, self.cos, self.sin)
            return x
        return apply_rope(x, self.cos, self.sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.lib is not None:
            return kernels.silu_mul(self.lib, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:  # [head_dim / 2] float32
    return rope_frequencies(config.head_dim, config.rope_theta, getattr(config, "rope_scaling", None))[0]


def rope_tables(config: ModelConfig, device, max_len: int | None = None):
    """cos/sin of shape [max_len, 1, head_dim] in float32 (times the variant's attention factor),
    Hugging Face ("neox") pairing: dimension j rotates with j + head_dim/2."""
    max_len = max_len or config.max_model_len
    inv_freq, factor = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [L, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [L, D]
    return (angles.cos() * factor)[:, None, :].to(device), (angles.sin() * factor)[:, None, :].to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, D]."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Float32 statistics without materializing a float32 copy of x: on CPU a bf16 -> fp32 copy
    # costs more than the whole norm (measured 8 ms vs 1 ms for 4096 x 576 in bf16).
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    scale = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))
    return x * scale.to(x.dtype) * weight

