"""buffer.max_staleness auto: the off-policy health the learner reads of a batch, and the
controller that moves k from it (additive increase, multiplicative decrease)."""

import json
import math

import pytest
import torch
import yaml

from common.config import BufferConfig, ConfigError, dump_config, load_config
from learner.staleness import StalenessController, behavior_health

HEALTHY = {"behavior_ess": 0.99, "behavior_truncated_frac": 0.0, "behavior_kl": 0.001}


def test_health_by_hand():
    old = torch.tensor([[-1.0, -1.0, -2.0, 0.0]])
    behavior = torch.tensor([[-1.0, -1.0 - math.log(2), -2.0, 5.0]])  # weights 1, 2, 1 and a padding token
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    health = behavior_health(old, behavior, mask, cap=1.5)
    assert health["behavior_ess"] == pytest.approx(16 / (3 * 6))  # (1 + 2 + 1)^2 / (3 (1 + 4 + 1))
    assert health["behavior_truncated_frac"] == pytest.approx(1 / 3)  # the weight 2 is over the cap
    assert health["behavior_kl"] == pytest.approx(-math.log(2) / 3)
    on_policy = behavior_health(old, old, mask, cap=2.0)
    assert on_policy == {"behavior_ess": pytest.approx(1.0), "behavior_truncated_frac": 0.0, "behavior_kl": 0.0}


def test_auto_raises_on_a_healthy_mean_and_halves_on_a_mean_over_a_target():
    controller = StalenessController(BufferConfig(max_staleness="auto", auto_staleness={"min": 1, "max": 3,
                                                                                    "raise_after": 2}))
    assert controller.k == 1  # starts at 1
    assert controller.update(HEALTHY) is None
    assert controller.update(HEALTHY).startswith("k 1 -> 2: within targets (mean of 2 steps")
    controller.update(HEALTHY)
    controller.update(HEALTHY)
    assert controller.k == 3
    for _ in range(5):
        assert controller.update(HEALTHY) is None  # auto_staleness.max
    # one batch's spike is not a trend: the mean of (0.001, 0.05) is within kl_max 0.05
    assert controller.update({**HEALTHY, "behavior_kl": 0.05}) is None and controller.k == 3
    assert controller.update({**HEALTHY, "behavior_ess": 0.6}) == ("k 3 -> 1: behavior_ess 0.795 < 0.9 "
                                                                  "(mean of 2 steps); next raise after 4 steps")
    assert controller.update({**HEALTHY, "behavior_kl": 0.5}) is None  # one step since the change: no mean yet
    assert controller.update({**HEALTHY, "behavior_kl": 0.5}) is None  # at auto_staleness.min already
    state = controller.state_dict()
    again = StalenessController(controller.cfg)
    again.load_state_dict(state)
    assert again.state_dict() == state
    assert again.update(HEALTHY) is None  # 3 steps since the fall; a raise waits for 4
    assert again.update(HEALTHY) == ("k 1 -> 2: within targets (mean of 2 steps: ess 0.99 >= 0.9, truncated 0 <= "
                                     "0.02, kl 0.001 <= 0.05)")
    assert again.patience == 4  # halved only once k = 2 holds and earns a raise in turn
    for _ in range(4):
        again.update(HEALTHY)
    assert again.k == 3 and again.patience == 2


def test_auto_doubles_k_until_its_first_fall_and_adds_one_after():
    controller = StalenessController(BufferConfig(max_staleness="auto", auto_staleness={"max": 8, "raise_after": 1}))
    assert [controller.k] + [(controller.update(HEALTHY), controller.k)[1] for _ in range(4)] == [1, 2, 4, 8, 8]
    assert controller.update({**HEALTHY, "behavior_kl": 0.5}).startswith("k 8 -> 4: behavior_kl 0.5 > 0.05")
    for expected in (4, 5, 5, 6, 7):  # the fall doubled the wait to 2; a raise adds one, and halves the wait
        controller.update(HEALTHY)   # once the bound it reached earns a raise in turn
        assert controller.k == expected
    assert controller.patience == 1


def test_a_bound_that_keeps_falling_is_probed_less_and_less_often():
    """The stress case of docs/benchmarks.md: at k = 0 health is perfect, at k = 1 it is not."""
    controller = StalenessController(BufferConfig(max_staleness="auto", auto_staleness={"max": 8, "raise_after": 2}))
    waits = []
    for _ in range(6):
        while controller.k == 1:
            controller.update({**HEALTHY, "behavior_kl": 0.3})
        waits.append(controller.patience)
        while controller.k == 0:
            controller.update(HEALTHY)
    assert waits == [4, 8, 16, 32, 32, 32]  # 16 x auto_staleness.raise_after at most


def test_a_fixed_bound_never_moves_and_auto_bounds_are_checked():
    fixed = StalenessController(BufferConfig(max_staleness=2))
    assert fixed.k == 2 and all(fixed.update({**HEALTHY, "behavior_ess": 0.1}) is None for _ in range(3))
    assert fixed.k == 2
    with pytest.raises(ConfigError, match=r"buffer.auto_staleness: min \(3\) is above max \(1\)"):
        load_config(None, ["models.policy=/p", "models.reward=/r", "data.prompts=/q", "buffer.max_staleness=auto",
                           "buffer.auto_staleness.min=3", "buffer.auto_staleness.max=1"])
    with pytest.raises(ConfigError, match="buffer.staleness_max: moved to buffer.auto_staleness.max"):
        load_config(None, ["models.policy=/p", "models.reward=/r", "data.prompts=/q", "buffer.staleness_max=3"])


def test_a_run_saved_before_auto_staleness_moved_is_read_with_its_values(tmp_path):
    """A run's config.yaml written with the flat buffer.staleness_* keys (--resume and tether replay
    read it) loads with each value in buffer.auto_staleness; a config a user writes so is refused."""
    saved = yaml.safe_load(dump_config(load_config(None, ["models.policy=/p", "models.reward=/r", "data.prompts=/q",
                                                          "buffer.max_staleness=auto"])))
    saved["buffer"].pop("auto_staleness")
    saved["buffer"].update({"staleness_min": 1, "staleness_max": 6, "staleness_kl_max": 0.2})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    auto = load_config(path, saved=True).buffer.auto_staleness
    assert (auto.min, auto.max, auto.kl_max, auto.raise_after) == (1, 6, 0.2, 3)
    with pytest.raises(ConfigError, match="buffer.staleness_kl_max: moved to buffer.auto_staleness.kl_max"):
        load_config(path)
    with pytest.raises(ConfigError, match="buffer.max_staleness"):
        load_config(None, ["models.policy=/p", "models.reward=/r", "data.prompts=/q", "buffer.max_staleness=often"])


@pytest.mark.slow
def test_tether_run_with_auto_raises_k_and_no_batch_passes_its_bound(tmp_path, tiny_assets):
    from common.runlog import read_metrics
    from tests.helpers import run_to_the_end, base_config

    config = base_config(tmp_path, tiny_assets, buffer={"max_staleness": "auto",
                                                        "auto_staleness": {"max": 2, "raise_after": 1}},
                         rollout={"max_new_tokens": 6, "prompts_per_generate": 16, "max_model_len": 64},
                         learner={"total_steps": 8, "batch_size": 16, "minibatch_size": 8, "ppo_epochs": 1})
    run_to_the_end(tmp_path, config)
    steps = read_metrics(config["run_dir"], "learner")
    bounds = [record["max_staleness"] for record in steps]
    assert bounds[0] == 1 and max(bounds) == 2, bounds  # healthy at this learning rate: up to auto_staleness.max
    for record in steps:
        assert record["staleness_max"] <= record["max_staleness"]  # the bound in force for that batch
        assert 0 < record["behavior_ess"] <= 1 + 1e-9
    changes = [record["staleness_change"] for record in steps if "staleness_change" in record]
    assert changes[0].startswith("k 1 -> 2: within targets (mean of 1 step"), changes
    # the buffer applied each bound (its last record is written after the last request)
    assert {record["max_staleness"] for record in read_metrics(config["run_dir"], "buffer")} <= {0, 1, 2}
    with open(f"{config['run_dir']}/metrics/buffer_accounting.json") as file:
        accounting = json.load(file)
    assert accounting["max_staleness"] == bounds[-1] and accounting["staleness_violations"] == 0
