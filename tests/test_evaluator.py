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


def test_an_episode_in_parts_is_reported_once_with_the_turn_rewards_of_all_its_parts():
    import numpy as np

    from evaluator.main import environment_rewards, last_parts
    from tests.helpers import sample_of

    before, after = sample_of([1], [5, 6], "a", reward=0.0), sample_of([1], [7, 8], "b", reward=0.5)
    other = sample_of([1], [5], "c", prompt_index=1, reward=0.25)
    for s, (episode, part, count), turns in zip((before, after, other), [(0, 0, 2), (0, 1, 2), (0, 0, 1)],
                                                ([0, 1.0], [0, 2.0], [0.5])):
        s.episode_index, s.part_index, s.episode_parts = episode, part, count
        s.loss_mask, s.turn_rewards = np.ones(len(turns), np.uint8), np.array(turns, np.float32)
    episodes = last_parts([before, after, other])
    assert [s.sample_id for s in episodes] == ["b", "c"] and after.turn_rewards.tolist() == [0.0, 3.0]
    assert environment_rewards(episodes)["env_reward"] == 1.75  # (1 + 2) and 0.5, per episode
