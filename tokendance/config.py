"""Configuration objects, passed explicitly down the layers (never stored in globals)."""

from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

from tokendance import registry
from tokendance.errors import InvalidRequestError
from tokendance.registry import MAX_ANCHORS, valid_anchors
from tokendance.round_core import fidelity_control

if TYPE_CHECKING:  # a type only: the configuration imports nothing of the model
    from tokendance.model.rope import RopeScaling

REUSE_MODES = tuple(registry.REUSE_POLICIES)  # how rounds reuse shared spans


AUTO = "auto"  # fidelity: the setting chosen per round by a probe (round_core/fidelity_control.py)
BATCH_INVARIANT_REUSE = ("full", "prefix")  # the reuse modes whose rounds batch_invariant covers
BATCH_INVARIANT_CHUNK = 256  # batch_invariant: prompt chunks end at multiples of this (or at the prompt's end)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from GGUF metadata or a config.json: Llama and Mistral
as they are, Qwen2 with q/k/v biases (`attention_bias`), Qwen3 with RMSNorm on each head's queries
and keys before RoPE (`qk_norm`)."""

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
    architecture: str = "llama"  # the family's name (model_type / GGUF general.architecture)
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None  # None: default RoPE


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. `dtype="auto"` is bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX:
    2-6x faster matmuls than float32, top-1 agreement kept), else float32 (model/platform.py).
    `kv_cache_bytes="auto"` is a quarter of the memory available at start, capped at 4 GiB."""

    model: str | None = None
    dtype: str = registry.DEFAULT_DTYPE
    device: str = "cpu"
    kv_cache_bytes: int | str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # Tokens of a round's KV preparation per step while requests decode beside it (all of the
    # step's budget when nothing decodes): smaller groups give the decoding requests more steps.
    round_group_tokens: int = 256
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None
    # Rounds (LLM.run_round): how shared spans are reused; see tokendance/engine/rounds.py.
    reuse: str = registry.DEFAULT_REUSE  # a name of registry.REUSE_POLICIES
    recompute_ratio: float = registry.DEFAULT_RECOMPUTE_RATIO
    selection: str = registry.DEFAULT_SELECTION  # a name of registry.SELECTIONS
    # A named preset of the reuse knobs (registry.FIDELITY: "exact", "floor", "balanced", "fast");
    # it sets reuse, recompute_ratio and anchors, and refuses other values for them. "auto": each
    # simulation's rounds move along `fidelity_ladder` (presets, cheapest first, ending at exact) by
    # a probe per round kept within `fidelity_target` (round_core/fidelity_control.py).
    fidelity: str | None = None
    fidelity_target: str = fidelity_control.DEFAULT_TARGET
    fidelity_ladder: tuple[str, ...] = fidelity_control.DEFAULT_LADDER
    check_layer: int = 1
    # Greedy outputs independent of what else runs in the batch (full and prefix reuse): linear
    # layers in fixed row tiles, prompts computed in chunks that end at fixed positions, every
    # decode attended alone. See `BATCH_INVARIANT_CHUNK` and docs/workloads.md#reproducible-simulations.
    batch_invariant: bool = False
    # In-round anchors (tokendance): each shared span computed in full in up to this many agents'
    # contexts, its reused base the mean of those encodings (docs/concepts.md#in-round-anchors).
    anchors: int = 1
    # Where a round's shared spans get their base KV (registry.MASTERS; in-round anchors > 1 are
    # agents' contexts by definition).
    masters: str = registry.DEFAULT_MASTERS

    def _apply_fidelity(self) -> None:
        if self.fidelity == AUTO:
            fidelity_control.check_target(self.fidelity_target)
            fidelity_control.check_ladder(self.fidelity_ladder)
            object.__setattr__(self, "fidelity_ladder", tuple(self.fidelity_ladder))
            object.__setattr__(self, "reuse", "tokendance")  # sessions kept, as every sharing rung needs
            return
        preset = registry.FIDELITY[registry.check("fidelity", self.fidelity, registry.FIDELITY)]
        defaults = {"reuse": registry.DEFAULT_REUSE, "recompute_ratio": registry.DEFAULT_RECOMPUTE_RATIO,
                    "selection": registry.DEFAULT_SELECTION, "anchors": 1}
        for name, value in preset.settings.items():
            given = getattr(self, name)
            if given != value and given != defaults[name]:
                raise InvalidRequestError(f"fidelity={self.fidelity!r} sets {name}={value!r}; it cannot be "
                                          f"{given!r} too (drop one of them)", "fidelity")
            object.__setattr__(self, name, value)

    @property
    def warnings(self) -> list[str]:
        """Settings that do not do all they seem to."""
        if self.batch_invariant and self.reuse not in BATCH_INVARIANT_REUSE:
            return [f"batch_invariant holds for reuse {' and '.join(BATCH_INVARIANT_REUSE)}; rounds with reuse "
                    f"{self.reuse!r} are not batch-invariant (reused KV depends on the round by design)"]
        return []

    @property
    def fidelity_name(self) -> str:
        """The preset these reuse settings are ("custom" if none)."""
        if self.fidelity == AUTO:
            return AUTO
        for name, preset in registry.FIDELITY.items():
            settings = {"selection": registry.DEFAULT_SELECTION, "anchors": 1, "masters": registry.DEFAULT_MASTERS,
                        **preset.settings}
            if all(getattr(self, k) == v for k, v in settings.items()):
                return name
        return "custom"

    def __post_init__(self) -> None:
        registry.check("dtype", self.dtype, registry.DTYPES)
        if self.fidelity is not None:
            self._apply_fidelity()
        registry.check("reuse", self.reuse, registry.REUSE_POLICIES)
        registry.check("selection", self.selection, registry.SELECTIONS)
        registry.check("masters", self.masters, registry.MASTERS)
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes != "auto" and (
            not isinstance(self.kv_cache_bytes, int) or isinstance(self.kv_cache_bytes, bool) or self.kv_cache_bytes <= 0
        ):
            raise InvalidRequestError(f"kv_cache_bytes must be 'auto' or an integer > 0, got {self.kv_cache_bytes!r}")
        if not (isinstance(self.recompute_ratio, (int, float)) and 0.0 <= self.recompute_ratio <= 1.0):
            raise InvalidRequestError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio!r}", "recompute_ratio")
        if not valid_anchors(self.anchors):
            raise InvalidRequestError(f"anchors must be an integer in [1, {MAX_ANCHORS}], got {self.anchors!r}", "anchors")
        for name in ("max_model_len", "num_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}", name)
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.round_group_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens, max_num_seqs and round_group_tokens must be >= 1")
        if self.batch_invariant and self.max_num_batched_tokens < BATCH_INVARIANT_CHUNK:
            raise InvalidRequestError(f"batch_invariant computes prompts in chunks of {BATCH_INVARIANT_CHUNK} tokens: "
                                      "max_num_batched_tokens must be at least that", "max_num_batched_tokens")
