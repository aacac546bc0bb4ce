"""A run trained on a verifiable reward alone (no reward model), the way R1-style runs do it: GRPO
with four responses a prompt, no critic, the KL in the loss, DAPO's dynamic sampling. `tether run`
of the demo's task with its gold rule as the only reward raises that reward on held-out prompts."""

import json
import os

import pytest

from common.runlog import read_metrics
from demos.parity import held_out_figures
from tests.helpers import base_config, run_to_the_end, tether
from tests.test_trackers import assert_every_tracker_holds_the_json_lines

STEPS = 12


@pytest.mark.slow
def test_training_on_a_verifiable_reward_alone_raises_it_on_held_out_prompts(tmp_path, tiny_assets, monkeypatch):
    # every tracker too, offline: the series each holds must be the JSON lines (tests/test_trackers.py)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store in maintenance mode
    mlflow_uri = f"file://{tmp_path}/mlruns"
    config = base_config(tmp_path, tiny_assets,
                         models={"reward": None},
                         scorer={"reward_functions": [{"function": "demos.parity:gold_reward", "weight": 1.0}]},
                         rollout={"max_new_tokens": 8, "prompts_per_generate": 8, "max_model_len": 64,
                                  "samples_per_prompt": 4},
                         learner={"total_steps": STEPS, "batch_size": 32, "minibatch_size": 16, "ppo_epochs": 2,
                                  "actor_lr": 5e-4, "kl_coef": 0.01, "advantage_estimator": "grpo",
                                  "kl_in": "loss"},
                         # DAPO's dynamic sampling: groups whose four responses score the same are dropped
                         buffer={"filter_groups": True},
                         eval={"prompts": tiny_assets["eval_prompts"], "every": 6, "max_prompts": 32},
                         metrics={"trackers": ["tensorboard", "wandb", "mlflow", "trackio"],
                                  "mlflow_tracking_uri": mlflow_uri})
    run_to_the_end(tmp_path, config)
    assert_every_tracker_holds_the_json_lines(config["run_dir"], mlflow_uri, evaluations=2, total_steps=STEPS,
                                              trackio_dir=str(tmp_path / "trackio"))  # where `tether run` wrote

    steps = read_metrics(config["run_dir"], "learner")
    assert len(steps) == STEPS and all("value_loss" not in step and "kl_loss" in step for step in steps)
    # the groups filtered are dropped whole, their credits given back, and the accounting adds up
    with open(os.path.join(config["run_dir"], "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    print(f"groups filtered: {accounting['groups_filtered']}, kept past the bound: {accounting['groups_unfiltered']}")
    assert accounting["identity_holds"] and accounting["staleness_violations"] == 0
    assert accounting["dropped"].get("group_filtered", 0) == 4 * accounting["groups_filtered"]  # 4 in the run seen
    assert read_metrics(config["run_dir"], "buffer")[-1]["groups_filtered"] == accounting["groups_filtered"]
    scorer = read_metrics(config["run_dir"], "scorer0")
    assert all("rm_score" not in record and "demos.parity:gold_reward" in record for record in scorer)
    final = os.path.join(config["run_dir"], "checkpoints", "final")
    before = held_out_figures(tiny_assets["policy"], tiny_assets["policy"], tiny_assets["reward"],
                      tiny_assets["eval_prompts"], max_new_tokens=8)
    after = held_out_figures(final, tiny_assets["policy"], tiny_assets["reward"], tiny_assets["eval_prompts"],
                     max_new_tokens=8)
    print(f"held-out verifiable reward: {before['gold_reward']:.3f} -> {after['gold_reward']:.3f}")
    assert after["gold_reward"] > before["gold_reward"] + 0.1, (before, after)

    # evaluation during training: the export of step 6, then the final policy, each evaluated once
    # (vLLM, the scorer's reference and reward functions) and the export removed
    evaluations = read_metrics(config["run_dir"], "eval")
    assert [record["step"] for record in evaluations] == [6, STEPS]
    for record in evaluations:
        assert record["prompts"] == 32 and 0.0 <= record["repetition_rate"] <= 1.0
        assert record["reward"] == pytest.approx(record["demos.parity:gold_reward"])  # the only reward
    assert not any(name.startswith("eval-step") for name in os.listdir(os.path.join(config["run_dir"], "checkpoints")))
    with open(os.path.join(config["run_dir"], "eval", f"step-{STEPS:06d}.md")) as file:
        text = file.read()
    assert "## Lowest reward" in text and "## Highest KL to the reference" in text and "- response: `" in text
    # the same checkpoint evaluated twice (tether eval) gives the same figures: sampling is seeded
    for step in ("98", "99"):
        result = tether("eval", final, "--config", os.path.join(config["run_dir"], "config.yaml"), "--step", step)
        assert result.returncode == 0, result.stderr[-2000:]
    first, second = read_metrics(config["run_dir"], "eval")[-2:]
    for key in ("reward", "kl_to_reference", "response_length", "repetition_rate"):
        assert first[key] == second[key], key
