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
