"""The connector's settings (`kv_connector_extra_config`), validated by name, shared by its two
sides; plain Python (no vLLM import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokendance.registry import (DEFAULT_RECOMPUTE_RATIO, DEFAULT_SELECTION, DEFAULT_TRANSPARENT_RULE, MAX_ANCHORS,
                                 SELECTIONS, TRANSPARENT_RULES, valid_anchors)
from tokendance.reuse.selection import SCORES, make_selector
from tokendance.vllm_plugin.faults import check_rates


@dataclass
class Settings:
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO  # the engine's defaults: one choice for both front doors
    selection: str = DEFAULT_SELECTION
    check_layer: int = 1
    round_timeout_s: float = 0.25
    hold_timeout_s: float = 30.0
    claim_tokens_per_step: int = 8192
    anchors: int = 1  # in-round anchors: each shared piece computed in full by up to this many masters
    store_gib: float = 0.0  # the session store's budget (0: no store)
    # the endpoint gathers chat requests that name no round into rounds (`http/gathering.py`)
    transparent_rounds: bool = False
    transparent_rule: str = DEFAULT_TRANSPARENT_RULE  # ... which requests it holds (registry.TRANSPARENT_RULES)
    gather_window_s: float = 0.05  # ... closing a gathering once no candidate came for this long
    faults: dict = field(default_factory=dict)  # stage -> probability of a planted fault (`faults.py`; off)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "Settings":
        extra = dict(extra or {})
        unknown = set(extra) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"TokenDanceConnector: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        settings = cls(**extra)
        check_rates(settings.faults)
        for name in ("check_layer", "claim_tokens_per_step", "round_timeout_s", "hold_timeout_s", "store_gib",
                     "gather_window_s"):
            value, kind = getattr(settings, name), cls.__dataclass_fields__[name].type
            numeric = (int,) if kind in (int, "int") else (int, float)
            if isinstance(value, bool) or not isinstance(value, numeric) or value < 0:
                raise ValueError(f"TokenDanceConnector: {name} must be a non-negative "
                                 f"{'integer' if numeric == (int,) else 'number'}, got {value!r}")
        if not isinstance(settings.transparent_rounds, bool):
            raise ValueError(f"TokenDanceConnector: transparent_rounds must be true or false, got "
                             f"{settings.transparent_rounds!r}")
        if not isinstance(settings.transparent_rule, str) or settings.transparent_rule not in TRANSPARENT_RULES:
            raise ValueError(f"TokenDanceConnector: transparent_rule must be one of {sorted(TRANSPARENT_RULES)}, got "
                             f"{settings.transparent_rule!r}")
        if not valid_anchors(settings.anchors):
            raise ValueError(f"TokenDanceConnector: anchors must be an integer in [1, {MAX_ANCHORS}], got {settings.anchors!r}")
        selector = make_selector(settings.selection, settings.recompute_ratio)  # validates both
        if selector.score not in (None, "deviation"):  # the worker's check pass measures key deviation only
            usable = [name for name in SELECTIONS if make_selector(name, 0.0).score in (None, "deviation")]
            raise ValueError(f"TokenDanceConnector: selection {settings.selection!r} ranks tokens by "
                             f"{SCORES[selector.score]}, which the plugin does not measure; use one of {usable}")
        return settings
