"""The evaluator's figures that need no model: the repetition rate."""

import pytest


def test_the_repetition_rate_counts_repeated_ngrams():
    from evaluator.main import repetition_rate

    assert repetition_rate([1, 2, 3, 4, 5]) == 0.0
    assert repetition_rate([7, 7, 7, 7, 7]) == pytest.approx(2 / 3)  # 3 trigrams, 1 distinct
    assert repetition_rate([1, 2, 3, 1, 2, 3]) == pytest.approx(1 / 4)  # (1,2,3) twice of 4 trigrams
    assert repetition_rate([1, 2]) == 0.0


def test_an_episodes_environment_rewards_are_reported_per_episode_and_per_turn():
    import numpy as np

    from evaluator.main import environment_rewards
    from tests.helpers import sample_of

    two_turns, one_turn = sample_of([1], [5, 6, 0, 0, 7], reward=0.5), sample_of([1], [5, 6], "s1", reward=0.25)
    two_turns.loss_mask, two_turns.turn_rewards = np.array([1, 1, 0, 0, 1], np.uint8), np.array([0, 1, 0, 0, 2.0])
    one_turn.loss_mask, one_turn.turn_rewards = np.array([1, 1], np.uint8), np.array([0, 1.0])
    figures = environment_rewards([two_turns, one_turn])
    assert figures == {"env_reward": 2.0, "env_reward_per_turn": pytest.approx(4 / 3), "scorer_reward": 0.375}
