"""Splits, and the plan's arithmetic."""

import pytest

from launch.sweep import best_splits, parse_split, predict


def test_parse_split():
    assert parse_split("rollout=0;scorer=1;learner=1-3;buffer=0") == {
        "rollout": [0], "scorer": [1], "learner": [1, 2, 3], "buffer": [0]}
    assert parse_split("rollout=0,2;scorer=1;learner=1")["rollout"] == [0, 2]
    with pytest.raises(ValueError, match="gives no devices to learner"):
        parse_split("rollout=0;scorer=1")
    with pytest.raises(ValueError, match="critic=1"):
        parse_split("rollout=0;scorer=1;learner=1;critic=1")


def test_predict_shares_devices_and_scales_roles():
    costs = {"rollout": 2e-3, "scorer": 1e-3, "learner": 3e-3}  # device-seconds per token
    # everything on one core: 6 ms per token
    assert predict(costs, {"rollout": [0], "scorer": [0], "learner": [0]}) == pytest.approx(1 / 6e-3)
    # learner alone on core 1 (3 ms), rollout + scorer on core 0 (3 ms)
    assert predict(costs, {"rollout": [0], "scorer": [0], "learner": [1]}) == pytest.approx(1 / 3e-3)
    # learner over cores 1-2 (1.5 ms each), the busiest is core 0 with 3 ms
    assert predict(costs, {"rollout": [0], "scorer": [0], "learner": [1, 2]}) == pytest.approx(1 / 3e-3)


def test_best_split_for_two_devices_balances_the_load():
    costs = {"rollout": 1e-3, "scorer": 0.5e-3, "learner": 2e-3}
    ranked = best_splits(costs, devices=2, top=100)
    rate, split = ranked[0]
    # with perfect scaling the total 3.5 ms spread over two devices is the floor: 1.75 ms a token
    assert rate == pytest.approx(1 / 1.75e-3)
    rates = {(tuple(s["rollout"]), tuple(s["scorer"]), tuple(s["learner"])): r for r, s in ranked}
    assert rates[((0,), (0,), (1,))] == pytest.approx(1 / 2e-3)  # learner alone: core 1 is busiest
    assert rates[((0,), (1,), (0,))] == pytest.approx(1 / 3e-3)  # rollout + learner share core 0
