"""The learning-rate schedule (training.schedule): warm-up, then constant, linear or cosine decay."""

import math

import pytest


@pytest.mark.parametrize("step, schedule, expected", [
    (0, "constant", 1 / 4), (3, "constant", 1.0), (9, "constant", 1.0),  # warm-up: (s + 1) / 4
    (4, "linear", 0.1 + 0.9 * (1 - 0 / 5)), (7, "linear", 0.1 + 0.9 * (1 - 3 / 5)), (9, "linear", 0.1),
    (4, "cosine", 1.0), (7, "cosine", 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 5))),
    (9, "cosine", 0.1),  # the last step (9 of 0..9) runs at lr_min_ratio
])
def test_the_learning_rate_at_a_step_is_its_formula(step, schedule, expected):
    from training.schedule import lr_factor

    assert lr_factor(step, total_steps=10, warmup_steps=4, schedule=schedule, min_ratio=0.1) == pytest.approx(expected)
