"""`--fidelity auto`'s controller and the probe's pull: pure Python, no model."""

from __future__ import annotations

import pytest

from tokendance.config import EngineConfig
from tokendance.errors import InvalidRequestError
from tokendance.round_core.fidelity_control import TARGETS, Controller, Reading, pull


def reading(kl=0.0, pull_=0.0, setting="fast") -> Reading:
    return Reading("a", setting, kl, 1.0, pull_, 16)


def test_every_agent_is_probed_in_turn_and_nobody_at_exact_or_alone():
    controller = Controller()
    agents = ["c", "a", "b"]
    probed = []
    for _ in range(6):
        probed.append(controller.probe_agent(agents))
        controller.observe(controller.setting, reading())
    assert probed == ["a", "b", "c", "a", "b", "c"]
    assert controller.probe_agent(["a"]) is None
    controller.level = len(controller.ladder) - 1
    assert controller.probe_agent(agents) is None


def test_a_breach_moves_up_at_once_and_calm_rounds_bring_it_back_twice_as_slowly():
    target = TARGETS["default"]
    controller = Controller(("fast", "balanced", "exact"), target, calm_rounds=2)
    step = controller.observe("fast", reading(kl=target.kl * 2))
    assert step.breach and step.move == "fast -> balanced" and controller.setting == "balanced"
    moves = []
    for _ in range(5):  # fast breached once: balanced must stay calm 2 x 2 rounds
        moves.append(controller.observe(controller.setting, reading(setting=controller.setting)).move)
    assert moves == [None, None, None, "balanced -> fast", None]
    step = controller.observe("fast", reading(pull_=target.pull + 0.01))  # pull alone breaches too
    assert step.breach and controller.setting == "balanced" and controller.patience[0] == 4


def test_exact_is_the_top_and_counts_calm_rounds_without_a_probe():
    controller = Controller(("fast", "exact"), TARGETS["strict"], calm_rounds=1)
    assert controller.observe("fast", reading(kl=1.0)).move == "fast -> exact"
    assert controller.observe("exact", reading(kl=1.0)).move is None  # (breaching at the top stays there)
    assert controller.setting == "exact"
    steps = [controller.observe("exact", None) for _ in range(3)]
    assert [s.move for s in steps] == [None, "exact -> fast", None]  # fast breached once: 1 x 2 calm rounds


def test_a_reading_of_a_round_that_ran_below_the_current_rung_still_moves_from_its_own():
    """Rounds overlap: a round that ran at fast may report after the controller moved."""
    controller = Controller(("fast", "balanced", "exact"), TARGETS["default"])
    controller.observe("fast", reading(kl=1.0))
    controller.observe("fast", reading(kl=1.0))  # the breach of a round still at fast: not two rungs
    assert controller.setting == "balanced"


def test_pull_reads_a_reused_reply_that_copies_another_members():
    others = ["Hana: the harvest festival starts at noon by the old mill", "Viktor: I will bring bread"]
    exact = "I think we should meet near the river before the festival"
    assert pull("Hana: the harvest festival starts at noon by the old mill", exact, others) == 1.0
    assert pull(exact, exact, others) == 0.0
    assert pull(exact, others[0], others) < 0  # the exact reply was the copy


@pytest.mark.parametrize("field,value", [("fidelity_target", "medium"), ("fidelity_ladder", ("fast", "fastest", "exact")),
                                         ("fidelity_ladder", ("exact", "fast")), ("fidelity_ladder", ("fast", "fast", "exact"))])
def test_unknown_targets_and_ladders_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError) as error:
        EngineConfig(fidelity="auto", **{field: value})
    assert error.value.param == field


def test_auto_is_its_own_fidelity_name():
    config = EngineConfig(fidelity="auto", fidelity_ladder=["balanced", "exact"])
    assert config.fidelity_name == "auto" and config.fidelity_ladder == ("balanced", "exact")
