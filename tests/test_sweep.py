"""Splits, and the plan's arithmetic."""

import pytest

from launch.sweep import RoleCost, best_splits, parse_split, predict, predict_colocated


def test_parse_split():
    assert parse_split("rollout=0;scorer=1;learner=1-3;buffer=0") == {
        "rollout": [0], "scorer": [1], "learner": [1, 2, 3], "buffer": [0]}
    assert parse_split("rollout=0,2;scorer=1;learner=1")["rollout"] == [0, 2]
    with pytest.raises(ValueError, match="gives no devices to learner"):
        parse_split("rollout=0;scorer=1")
    with pytest.raises(ValueError, match="critic=1"):
        parse_split("rollout=0;scorer=1;learner=1;critic=1")
    # the colocated mode: every role on the same devices, one process each
    assert parse_split("colocate=0-1") == {"rollout": [0, 1], "scorer": [0, 1], "learner": [0, 1]}
    with pytest.raises(ValueError, match="not a list of devices"):
        parse_split("colocate=all")


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
    # with perfect scaling the total 3.5 ms spread over two devices is the floor, 1.75 ms a token:
    # every role on both devices, taking turns (the colocated mode, rated apart from the splits)
    assert predict_colocated(costs, 2) == pytest.approx(1 / 1.75e-3)
    assert all(not all(len(s[role]) == 2 for role in s) for _, s in ranked)
    assert ranked[0][0] == pytest.approx(1 / 2e-3)
    # measured scaling: the learner 80% efficient on two devices costs the colocated mode its lead
    slower = {**costs, "learner": RoleCost({1: 2e-3, 2: 2.5e-3})}
    assert predict_colocated(slower, 2) == pytest.approx(1 / 2e-3)
    rates = {(tuple(s["rollout"]), tuple(s["scorer"]), tuple(s["learner"])): r for r, s in ranked}
    assert rates[((0,), (0,), (1,))] == pytest.approx(1 / 2e-3)  # learner alone: core 1 is busiest
    assert rates[((0,), (1,), (0,))] == pytest.approx(1 / 3e-3)  # rollout + learner share core 0


def test_a_split_names_processes_per_role():
    from launch.sweep import format_split, parse_counts

    text = "rollout=0-1x2;scorer=1;learner=1x2;buffer=0"
    assert parse_split(text) == {"rollout": [0, 1], "scorer": [1], "learner": [1], "buffer": [0]}
    assert parse_counts(text) == {"rollout": 2, "scorer": 1, "learner": 2, "buffer": 1}
    assert format_split(parse_split(text), parse_counts(text)) == "rollout=0,1x2;scorer=1;learner=1x2;buffer=0"
    with pytest.raises(ValueError, match="the buffer is one process"):
        parse_counts("rollout=0;scorer=1;learner=1;buffer=0x2")
    with pytest.raises(ValueError, match="is not role=devices"):
        parse_split("rollout=0xy;scorer=1;learner=1")


def test_the_plan_scales_a_role_as_it_was_measured_to_scale():
    # measured: 2 ms per token on one device, 2.5 device-ms on two (80% efficient)
    learner = RoleCost({1: 2e-3, 2: 2.5e-3})
    assert learner.at(1) == pytest.approx(2e-3) and learner.at(2) == pytest.approx(2.5e-3)
    assert learner.efficiency(2) == pytest.approx(0.8)
    # a power law through the two points: 4 devices cost 2.5 * 1.25 device-ms
    assert learner.at(4) == pytest.approx(2e-3 * 1.25 ** 2)
    costs = {"rollout": 1e-3, "scorer": 0.5e-3, "learner": learner}
    # learner on cores 1-2: each busy 1.25 ms a token, rollout + scorer 1.5 ms on core 0
    assert predict(costs, {"rollout": [0], "scorer": [0], "learner": [1, 2]}) == pytest.approx(1 / 1.5e-3)
    # linear scaling would have said the same learner takes 1 ms on each of cores 1 and 2
    linear = predict({**costs, "learner": 2e-3}, {"rollout": [0], "scorer": [1], "learner": [1, 2]})
    measured = predict(costs, {"rollout": [0], "scorer": [1], "learner": [1, 2]})
    assert linear == pytest.approx(1 / 1.5e-3) and measured == pytest.approx(1 / 1.75e-3)
    one_point = RoleCost({1: 3e-3})
    assert not one_point.measured_scaling and one_point.at(4) == 3e-3
