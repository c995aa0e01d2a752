"""The quality measures a user reads (model-free): loops, repeated runs, variety, and how sure an
accuracy is."""

import pytest

from tokendance.bench.quality import degeneration, loops, wilson


def test_a_reply_that_repeats_a_sentence_or_a_run_of_words_loops():
    assert loops("I'm glad to hear that. " * 6)
    assert loops("we should go to the market, we should go to the market, we should go to the market")
    assert not loops("I'm glad to hear that. The bridge is closed until Friday. I'm glad to hear that.")
    assert not loops("Ok. Ok. Ok.")  # one-word sentences are not a loop by themselves


def test_degeneration_counts_loops_repeats_and_variety_across_replies():
    varied = ["The bridge is closed until Friday.", "The market opens at nine with fresh rye bread."]
    stuck = ["I'm glad to hear that. " * 6, "I'm glad to hear that. " * 6]
    good, bad = degeneration(varied), degeneration(stuck)
    assert good == {"loop_fraction": 0.0, "repeated_4grams": 0.0, "distinct_2": 1.0}
    assert bad["loop_fraction"] == 1.0 and bad["repeated_4grams"] > 0.5 and bad["distinct_2"] < 0.2
    assert degeneration([])["loop_fraction"] == 0.0


def test_the_wilson_interval_holds_the_share_and_narrows_with_more_answers():
    low, high = wilson(8, 10)
    assert low < 0.8 < high and high - low > 0.3
    low_many, high_many = wilson(800, 1000)
    assert low_many < 0.8 < high_many and high_many - low_many < 0.06
    assert wilson(0, 0) == (0.0, 1.0) and wilson(0, 20)[0] == 0.0 and wilson(20, 20)[1] == pytest.approx(1.0)


def test_replies_that_say_the_same_once_the_speakers_name_is_dropped_converge():
    from tokendance.bench.quality import convergence
    from tokendance.convergence import repeated_replies

    same = ["Hana: I'm so glad of you, I'm glad of you.", "Viktor Nguyen: I'm so glad of you, I'm glad of you.",
            "Abigail: The bridge is closed until Friday."]
    # the engine knows no names: a leading label is dropped; an empty reply never repeats another
    assert repeated_replies(same) == 2 and repeated_replies([*same, "", ""]) == 2
    assert repeated_replies(["As Hana, I'll bake bread.", "As Bo, I'll bake bread."]) == 0  # names inside differ
    found = convergence(same, ["Hana Novak", "Viktor Nguyen", "Abigail Yamamoto"])
    assert found["identical_pairs"] == pytest.approx(1 / 3)
    assert found["ngram_overlap"] == pytest.approx(1 / 3)  # the third shares no 3 words in a row
    assert convergence(["I will bake bread today", "I will bake cakes today"], "AB")["ngram_overlap"] == 1 / 5
    # with the speakers known, their names are dropped wherever they stand
    assert convergence(["As Hana, I'll bake bread.", "As Bo, I'll bake bread."], ["Hana", "Bo"])["identical_pairs"] == 1
    assert convergence(["one reply"], ["Hana"]) == {"identical_pairs": 0.0, "ngram_overlap": 0.0}
    # two empty replies are not the same reply; a copy that keeps another agent's label is
    assert convergence(["", "", "I'll bake."], ["Hana", "Bo", "Cy"]) == {"identical_pairs": 0.0, "ngram_overlap": 0.0}
    copied = convergence(["Hana Novak: I will bake bread.", "I will bake bread."], ["Hana Novak", "Bo Chen"])
    assert copied["identical_pairs"] == 1
    assert repeated_replies(["Bo Chen: I will bake bread.", "I will bake bread."]) == 2


def test_the_quality_report_counts_over_runs_and_judges_against_full_and_the_floor():
    from tokendance.bench.quality_report import interval, summarize

    mean, low, high = interval([0.1, 0.2, 0.3])
    assert mean == pytest.approx(0.2) and low < 0.1 and high > 0.3  # t with 2 degrees of freedom: wide
    assert interval([0.5])[0] == 0.5

    def figures(pairs, loops, distinct, accuracy=None):
        return {"identical_pairs": pairs, "worst_round_identical_pairs": pairs, "ngram_overlap": pairs,
                "loop_fraction": loops, "distinct_2": distinct, "accuracy": accuracy, "computed_share": 0.5,
                "shared_compression": 3.0}

    runs = [{"workload": "w", "settings": {"full": figures(0.0, 0.1, 0.4), "floor": figures(0.0, 0.2, 0.38),
                                            "good": figures(0.02, 0.2, 0.39), "bad": figures(0.5 * i, 0.1, 0.4)}}
            for i in range(3)]
    table = summarize(runs, ["good", "bad"])["workloads"]["w"]["settings"]
    assert table["good"]["verdict"]["passes"]
    assert table["floor"]["loop_fraction_drift"][0] == pytest.approx(0.1)
    bad = table["bad"]["verdict"]
    assert not bad["convergence_mean"] and not bad["convergence_worst_run"] and bad["loops_drift"]
    assert table["bad"]["worst_run_identical_excess"] == pytest.approx(1.0)
    # read on the interval's bound: a mean within 5 points whose upper bound passes 10 fails
    spread = [{"workload": "w", "settings": {"full": figures(0.0, 0.1, 0.4), "floor": figures(0.0, 0.1, 0.4),
                                              "s": figures(x, 0.1, 0.4)}} for x in (0.0, 0.0, 0.0, 0.18)]
    wide = summarize(spread, ["s"])["workloads"]["w"]["settings"]["s"]
    assert wide["identical_pairs_excess"][0] <= 0.05 < 0.10 < wide["identical_pairs_excess"][2]
    assert not wide["verdict"]["convergence_mean"]
    # signs over runs: distinct-2 below full's in more runs than the floor's fails, whatever the mean drift
    signs = [{"workload": "w", "settings": {"full": figures(0.0, 0.1, 0.40, 0.5), "floor": figures(0.0, 0.1, 0.41, 0.5),
                                             "s": figures(0.0, 0.1, 0.399, 0.4 + 0.01 * (i - 1))}} for i in range(3)]
    lower = summarize(signs, ["s"])["workloads"]["w"]["settings"]["s"]
    assert lower["distinct_2_worse_runs"] == 3 and lower["verdict"]["distinct_2_drift"]
    assert not lower["verdict"]["distinct_2_sign"] and lower["verdict"]["loops_sign"]
    # accuracy paired run by run: lower in every run fails even where the unpaired intervals overlap
    assert lower["accuracy_excess"][2] < 0 and not lower["verdict"]["accuracy"]


def test_quality_settings_are_presets_modes_or_engine_fields_and_bad_ones_are_refused_by_name():
    from tokendance.bench.quality_report import quality_settings
    from tokendance.errors import InvalidRequestError

    found = quality_settings(["fast", "prefix", "agent=reuse:tokendance,masters:agent,recompute_ratio:0.15"])
    assert found == {"fast": {"fidelity": "fast"}, "prefix": {"reuse": "prefix"},
                     "agent": {"reuse": "tokendance", "masters": "agent", "recompute_ratio": 0.15}}
    for bad in ("x=ratio", "x=bogus:1", "x=masters:nowhere", "floor=reuse:full", "nope"):
        with pytest.raises(InvalidRequestError):
            quality_settings([bad])
