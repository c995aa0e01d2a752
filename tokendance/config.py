"""Configuration objects, passed explicitly down the layers (never stored in globals)."""

from __future__ import annotations

from dataclasses import dataclass

from tokendance.errors import InvalidRequestError


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from GGUF metadata or a config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_model_len: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. `dtype` is "bfloat16" by default: measured 2-6x faster matmuls than float32 on
    CPUs with AVX-512 BF16/AMX (benchmarks/throughput.py), with top-1 agreement kept (tests)."""

    model: str | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    kv_cache_bytes: int = 512 * 2**20
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None
    # Rounds (LLM.run_round): how shared spans are reused; see tokendance/engine/rounds.py.
    reuse: str = "prefix"  # "full" | "prefix" | "pic" | "tokendance"
    recompute_ratio: float = 0.05  # chosen by benchmarks/round.py's sweep (see README)
    selection: str = "epic"  # "epic" | "cacheblend" | "cacheblend-block"
    check_layer: int = 1
    collective_selection: str = "agent"  # "agent" | "block" (tokendance ablation)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise InvalidRequestError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise InvalidRequestError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_batched_tokens and max_num_seqs must be >= 1")
