"""The registry of names (model-free): every registered name loads what it stands for, and the
fidelity presets set the reuse knobs or refuse a contradiction."""

from __future__ import annotations

import pytest

from tokendance import registry
from tokendance.config import EngineConfig
from tokendance.errors import InvalidRequestError
from tokendance.reuse.policy import ReusePolicy, policy_class
from tokendance.reuse.selection import Selector, make_selector


def test_every_registered_name_loads_its_class():
    for name in registry.REUSE_POLICIES:
        cls = policy_class(name)
        assert issubclass(cls, ReusePolicy) and cls.name == name
    assert not policy_class("full").enables_prefix_caching and policy_class("prefix").enables_prefix_caching
    for name in registry.SELECTIONS:
        assert isinstance(make_selector(name, 0.1), Selector)
    for name, choice in registry.TRANSPARENT_RULES.items():  # the vLLM plugin's, plain Python
        rule = registry.load(choice)()
        assert rule.is_candidate([{"role": "user", "content": "hi"}]) == (name == "shared")
    with pytest.raises(InvalidRequestError, match="^reuse must be one of full, prefix, pic, tokendance"):
        EngineConfig(reuse="mine")


def test_fidelity_presets_set_the_reuse_knobs():
    assert EngineConfig().fidelity_name == "exact"  # the default serves exactly
    assert EngineConfig(reuse="tokendance").fidelity_name == "fast"  # collective reuse's defaults are `fast`
    for name, preset in registry.FIDELITY.items():
        config = EngineConfig(fidelity=name)
        assert {k: getattr(config, k) for k in preset.settings} == preset.settings
        assert config.fidelity_name == name
    assert EngineConfig(reuse="pic").fidelity_name == "custom"
    assert EngineConfig(anchors=2).fidelity_name == "custom"  # every knob a preset sets counts
    assert EngineConfig(fidelity="balanced").anchors == 4
    with pytest.raises(InvalidRequestError, match="fidelity='balanced' sets anchors=4"):
        EngineConfig(fidelity="balanced", anchors=2)
    assert EngineConfig(fidelity="floor", recompute_ratio=0.95).recompute_ratio == 0.95  # agreeing is fine
    with pytest.raises(InvalidRequestError, match="fidelity='exact' sets reuse='prefix'") as error:
        EngineConfig(fidelity="exact", reuse="pic")
    assert error.value.param == "fidelity"
    with pytest.raises(InvalidRequestError, match="^fidelity must be one of exact, floor, balanced, fast"):
        EngineConfig(fidelity="perfect")


def test_batch_invariant_with_a_reuse_mode_that_is_not_says_so():
    from tokendance.config import EngineConfig

    assert EngineConfig(batch_invariant=True, reuse="tokendance").warnings  # rounds depend on the round
    assert EngineConfig(batch_invariant=True, reuse="prefix").warnings == []
    assert EngineConfig(reuse="tokendance").warnings == []
