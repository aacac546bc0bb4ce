"""The evaluator's figures that need no model: the repetition rate."""

import pytest


def test_the_repetition_rate_counts_repeated_ngrams():
    from evaluator.main import repetition_rate

    assert repetition_rate([1, 2, 3, 4, 5]) == 0.0
    assert repetition_rate([7, 7, 7, 7, 7]) == pytest.approx(2 / 3)  # 3 trigrams, 1 distinct
    assert repetition_rate([1, 2, 3, 1, 2, 3]) == pytest.approx(1 / 4)  # (1,2,3) twice of 4 trigrams
    assert repetition_rate([1, 2]) == 0.0
