"""A run trained on a verifiable reward alone (no reward model), the way R1-style runs do it: GRPO
with four responses a prompt, no critic, the KL in the loss, DAPO's dynamic sampling. `tether run`
of the demo's task with its gold rule as the only reward raises that reward on held-out prompts."""

import contextlib
import json
import os

import pytest

from common.runlog import read_metrics
from demos.parity import held_out_figures
from tests.helpers import base_config, run_to_the_end, tether
from tests.test_trackers import assert_every_tracker_holds_the_json_lines

STEPS = 12


def gold_config(tmp_path, tiny_assets, **sections) -> dict:
    """The demo's task on its gold rule alone: GRPO, four responses a prompt, DAPO's dynamic sampling."""
    return base_config(tmp_path, tiny_assets,
                       models={"reward": None},
                       scorer={"reward_functions": [{"function": "demos.parity:gold_reward", "weight": 1.0}]},
                       rollout={"max_new_tokens": 8, "prompts_per_generate": 8, "max_model_len": 64,
                                "samples_per_prompt": 4},
                       learner={"total_steps": STEPS, "batch_size": 32, "minibatch_size": 16, "ppo_epochs": 2,
                                "actor_lr": 5e-4, "kl_coef": 0.01, "advantage_estimator": "grpo",
                                "kl_in": "loss"},
                       # DAPO's dynamic sampling: groups whose four responses score the same are dropped
                       buffer={"filter_groups": True, **sections.pop("buffer", {})}, **sections)


def held_out_gold(policy: str, tiny_assets) -> float:
    return held_out_figures(policy, tiny_assets["policy"], tiny_assets["reward"], tiny_assets["eval_prompts"],
                            max_new_tokens=8)["gold_reward"]


@pytest.fixture(scope="module")
def split_run(tmp_path_factory, tiny_assets):
    """The run trained split (each role on its cores), with every tracker offline and evaluations
    during training: (its directory, the tracker store, held-out gold before, after)."""
    tmp_path = tmp_path_factory.mktemp("split")
    mlflow_uri = f"file://{tmp_path}/mlruns"
    config = gold_config(tmp_path, tiny_assets,
                         eval={"prompts": tiny_assets["eval_prompts"], "every": 6, "max_prompts": 32},
                         metrics={"trackers": ["tensorboard", "wandb", "mlflow", "trackio"],
                                  "mlflow_tracking_uri": mlflow_uri})
    with offline_trackers(tmp_path):
        run_to_the_end(tmp_path, config)
    final = os.path.join(config["run_dir"], "checkpoints", "final")
    return config, tmp_path, held_out_gold(tiny_assets["policy"], tiny_assets), held_out_gold(final, tiny_assets)


@contextlib.contextmanager
def offline_trackers(tmp_path):
    """Every tracker offline, its store under ``tmp_path``: the series each holds must be the JSON
    lines (tests/test_trackers.py)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store in maintenance mode
        yield


@pytest.mark.slow
def test_training_on_a_verifiable_reward_alone_raises_it_on_held_out_prompts(split_run):
    config, tmp_path, before, after = split_run
    with offline_trackers(tmp_path):
        assert_every_tracker_holds_the_json_lines(config["run_dir"], f"file://{tmp_path}/mlruns", evaluations=2,
                                                  total_steps=STEPS, trackio_dir=str(tmp_path / "trackio"))

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
    print(f"held-out verifiable reward: {before:.3f} -> {after:.3f}")
    assert after > before + 0.1, (before, after)

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
    # the final policy evaluated again (tether eval) gives the figures the run's own evaluation of
    # its last step gave: sampling is seeded
    result = tether("eval", final, "--config", os.path.join(config["run_dir"], "config.yaml"), "--step", "99")
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = read_metrics(config["run_dir"], "eval")[-2:]
    assert (first["step"], second["step"]) == (STEPS, 99)
    for key in ("reward", "kl_to_reference", "response_length", "repetition_rate"):
        assert first[key] == second[key], key


@pytest.mark.slow
def test_colocated_the_run_reaches_the_split_runs_gold_and_a_killed_engine_loses_nothing(tmp_path, tiny_assets,
                                                                                         split_run):
    """placement.mode colocate: the rollout, scorer and learner on both cores, working in shifts
    granted by the buffer. kill -9 of the engine while it holds the generate shift: the launcher starts it
    again, what it held goes back to the pool, and the run trains every step to the split run's gold."""
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from tests.helpers import REPO, TWO_CORES

    # k = 0, on-policy, as a colocated GPU run would train: after each step the engine's shift may
    # bring it only the new weights (the bound allows no credits before it holds them)
    config = gold_config(tmp_path, tiny_assets, launch={"restart_backoff_s": 0.5}, buffer={"max_staleness": 0})
    config["placement"] = {**TWO_CORES, "mode": "colocate"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = config["run_dir"]
    run = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "--config", str(path)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(run_dir, "learner")) < 3:
            assert time.monotonic() < deadline and run.poll() is None, "the run did not reach step 3"
            time.sleep(0.05)
        # the engine frozen (SIGSTOP), the run cannot end without it, and the next generate shift is
        # granted to it and stays its: kill -9 then lands mid-shift, whatever the machine's speed (a
        # run of 0.3 s a step had ended between the test seeing a generate shift and its kill)
        with open(os.path.join(run_dir, "pids.json")) as file:
            rollout = json.load(file)["rollout0"]
        os.killpg(rollout, signal.SIGSTOP)
        stopped_at = time.time()
        assert len(read_metrics(run_dir, "learner")) < STEPS, "the run went past its last generate shift"
        while not any(record["time"] > stopped_at and record["shift"] == "generate"
                      for record in read_metrics(run_dir, "buffer")):
            assert time.monotonic() < deadline and run.poll() is None, "the frozen engine holds no generate shift"
            time.sleep(0.1)
        os.killpg(rollout, signal.SIGKILL)
        stdout, stderr = run.communicate(timeout=400)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "rollout0 exited with code -9: ended by signal SIGKILL; restarting" in stderr
    assert [record["step"] for record in read_metrics(run_dir, "learner")] == list(range(1, STEPS + 1))
    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["staleness_violations"] == 0
    # the roles worked in shifts: a train shift, a score shift and at least one generate shift a
    # step (a filtered group asks for more, the killed engine's prompts too)
    buffer = read_metrics(run_dir, "buffer")[-1]
    print(f"shifts: generate {buffer['shifts_generate']}, score {buffer['shifts_score']}, "
          f"train {buffer['shifts_train']}")
    assert buffer["shifts_train"] == STEPS and min(buffer["shifts_generate"], buffer["shifts_score"]) >= STEPS
    assert all(step["staleness_max"] == 0 for step in read_metrics(run_dir, "learner"))
    _, _, before, split_after = split_run
    after = held_out_gold(os.path.join(run_dir, "checkpoints", "final"), tiny_assets)
    print(f"held-out verifiable reward: SFT {before:.3f}, split {split_after:.3f}, colocated {after:.3f}")
    assert after > before + 0.1 and abs(after - split_after) <= 0.15, (before, split_after, after)
