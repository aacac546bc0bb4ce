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
    # every role on both devices, working in shifts (the colocated mode, rated apart from the splits)
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


def test_the_plan_recommends_a_mode_only_where_a_profile_measured_it():
    """Predicted from a split profile alone, colocated leaves out its hand-overs between shifts (one
    such plan said 1.02x the best split; colocated measured 8% slower): it is named to measure, not
    recommended. On one device every role shares it either way: no "side by side"."""
    from launch.sweep import format_split, recommendation

    costs = {"rollout": 1e-3, "scorer": 0.5e-3, "learner": 2e-3}  # colocated: 1.75 ms a token, the best split 2 ms
    best, colocated = best_splits(costs, 2)[0], predict_colocated(costs, 2)
    assert recommendation(best, colocated, 2, {"split", "colocate"}).startswith("would run: colocated, 1.14x")
    unmeasured = recommendation(best, colocated, 2, {"split"})
    assert unmeasured.startswith(f"would run: {format_split(best[1])}, the mode measured; colocated is predicted 1.14x")
    assert "tether sweep --split 'colocate=0-1'" in unmeasured
    slower_colocated = {**costs, "learner": RoleCost({1: 2e-3, 2: 3e-3})}
    best = best_splits(slower_colocated, 2)[0]
    only_colocated = recommendation(best, predict_colocated(slower_colocated, 2), 2, {"colocate"})
    assert only_colocated.startswith("would run: colocated, the mode measured")
    one = recommendation(best_splits(costs, 1)[0], predict_colocated(costs, 1), 1, {"split"})
    assert one.startswith("would run: rollout=0;scorer=0;learner=0, the mode measured: on 1 device every role")
    assert "side by side" not in one and "own devices" not in one


def _config(tmp_path, *overrides):
    from common.config import load_config
    from tests.helpers import base_config

    return load_config(None, list(overrides),
                       base=base_config(tmp_path, {"policy": "/unused", "reward": "/unused", "prompts": "/unused"}))


def test_role_cores_are_checked_before_any_process_starts(tmp_path):
    """A core past the machine's made the role's start fail inside the child, after the other roles
    had started; an empty list read as every core."""
    from common.config import ConfigError
    from launch.preflight import check_placement

    check_placement(_config(tmp_path, "placement.cores.rollout=[0,1]", "placement.cores.learner=[1]"), {0, 1})
    with pytest.raises(ConfigError, match=r"placement.cores.learner: core 7 is not among the cores this machine "
                                          r"gives tether \(0-1\)"):
        check_placement(_config(tmp_path, "placement.cores.rollout=[0]", "placement.cores.learner=[1,7]"), {0, 1})
    with pytest.raises(ConfigError, match="placement.cores.scorer: an empty list"):
        check_placement(_config(tmp_path, "placement.cores.scorer=[]"), {0, 1})
    with pytest.raises(ConfigError, match="placement.cores.agent: cores 2, 3 are not among"):
        check_placement(_config(tmp_path, "placement.cores.agent=[2,3]"), {0, 1})


def test_a_sweep_trial_keeps_the_users_cores_for_what_its_split_does_not_place(tmp_path):
    """A trial sets the devices its split names, of the kind it names; the buffer's and the agent
    programs' cores, and every core of a GPU trial, stay the user's."""
    from common.config import load_config
    from launch.sweep import trial_overrides

    user = _config(tmp_path, "placement.cores.buffer=[1]", "placement.cores.agent=[0]", "placement.cores.rollout=[1]")

    def trial(split, gpus=False):
        return load_config(None, trial_overrides(split, 1, 2, str(tmp_path / "trial"), gpus, None),
                           base=user.model_dump(mode="json"))

    cpu = trial("rollout=0;scorer=1;learner=1")
    assert cpu.placement.cores == {"buffer": [1], "agent": [0], "rollout": [0], "scorer": [1], "learner": [1]}
    gpu = trial("rollout=0;scorer=1;learner=1", gpus=True)
    assert gpu.placement.cores == user.placement.cores
    assert gpu.placement.cuda_visible_devices == {"rollout": "0", "scorer": "1", "learner": "1"}
    assert trial("colocate=0-1").placement.cores["buffer"] == [1]


def test_tether_run_refuses_a_core_the_machine_lacks_before_starting_anything(tmp_path):
    import os

    import yaml
    from typer.testing import CliRunner

    from launch.cli import app
    from launch.exit_codes import ExitCode
    from tests.helpers import base_config

    raw = base_config(tmp_path, {"policy": "/unused", "reward": "/unused", "prompts": "/unused"})
    raw["placement"] = {"cores": {"learner": [max(os.sched_getaffinity(0)) + 1]}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["run", "--config", str(tmp_path / "config.yaml")])
    assert result.exit_code == ExitCode.CONFIG_ERROR and "error: placement.cores.learner: core" in result.output
    assert not (tmp_path / "run" / "logs").exists()
