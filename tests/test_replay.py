"""tether replay: an asynchronous run (k = 2, two rollout engines) recorded and trained again by the
learner alone, from the start and from a mid-run checkpoint; every step's losses and the final
weights must come out exactly as the run's (on the CPU, with the run's thread count). The run's
learner and scorer pack each pass as a prefix tree (two responses a prompt share it): a packed run
replays exactly too."""

import json

import pytest
import yaml

from common.runlog import read_metrics
from launch.exit_codes import ExitCode
from tests.helpers import TWO_CORES, base_config, tether

STEPS = 4


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, tiny_assets):
    tmp_path = tmp_path_factory.mktemp("recorded")
    config = base_config(tmp_path, tiny_assets, buffer={"max_staleness": 2},
                         rollout={"engines": 2, "max_new_tokens": 6, "prompts_per_generate": 8, "max_model_len": 64,
                                  "samples_per_prompt": 2},
                         learner={"total_steps": STEPS, "batch_size": 16, "minibatch_size": 8, "ppo_epochs": 2,
                                  "checkpoint_every": 2, "record_batches": True, "actor_lr": 1e-3,
                                  "packing": "tree"},
                         scorer={"packing": "tree"})
    config["placement"] = dict(TWO_CORES)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = tether("run", "--config", str(path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp_path / "run"


@pytest.mark.slow
def test_replay_from_the_start_reproduces_every_step_and_the_final_weights(recorded_run):
    steps = read_metrics(str(recorded_run), "learner")
    assert max(r["staleness_max"] for r in steps) >= 1  # asynchronous: stale samples were trained
    # trees that share a prompt, in the learner's passes and the scorer's, which kept the packing
    assert min(r["prefix_share"] for r in steps) > 0.2
    assert min(r["prefix_share"] for r in read_metrics(str(recorded_run), "scorer0")) > 0.2
    logs = {path.name: path.read_text() for path in (recorded_run / "logs").glob("*.log")}
    assert {"learner.log", "scorer0.log"} <= set(logs) and not any("packing tree is off" in t for t in logs.values())
    engines = {name for name in ("rollout0", "rollout1") if read_metrics(str(recorded_run), name)}
    assert engines == {"rollout0", "rollout1"}
    result = tether("replay", str(recorded_run), "--out", str(recorded_run.parent / "replay"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "largest difference from the run's losses 0, from its final weights 0" in result.stdout, result.stdout
    replayed = read_metrics(str(recorded_run.parent / "replay"), "learner")
    assert [r["policy_loss"] for r in replayed] == [r["policy_loss"] for r in steps]  # exactly, step for step


@pytest.mark.slow
def test_replay_from_a_checkpoint_reproduces_the_rest(recorded_run):
    checkpoint = recorded_run / "checkpoints" / "state-000002"
    out = recorded_run.parent / "replay-from-2"
    result = tether("replay", str(recorded_run), "--checkpoint", str(checkpoint), "--out", str(out))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(str(out), "learner")] == [3, 4]
    assert "from its final weights 0" in result.stdout
    until = tether("replay", str(recorded_run), "--until", "3", "--out", str(recorded_run.parent / "replay-to-3"))
    assert until.returncode == 0 and "replayed steps 1..3" in until.stdout, until.stdout + until.stderr[-2000:]
    size = sum(p.stat().st_size for p in (recorded_run / "batches").glob("batch-*.frames"))
    print(f"recorded batches: {size / (STEPS * 16) * 1000 / 1e6:.2f} MB per 1,000 samples")
    assert json.loads((recorded_run / "batches" / "recording.json").read_text())["torch_threads"] == 1


def test_replay_refuses_a_run_without_recorded_batches(tmp_path):
    (tmp_path / "config.yaml").write_text("models: {policy: /p, reward: /r}\ndata: {prompts: /q}\n")
    result = tether("replay", str(tmp_path))
    assert result.returncode == ExitCode.CONFIG_ERROR and "has no recorded batches" in result.stderr


def test_replay_names_a_checkpoint_that_is_not_a_saved_state(tmp_path):
    """`--checkpoint state-4` (a name, not the directory) was a 130-line DeepSpeed assertion."""
    (tmp_path / "config.yaml").write_text("models: {policy: /p, reward: /r}\ndata: {prompts: /q}\n")
    (tmp_path / "batches").mkdir()
    (tmp_path / "batches" / "recording.json").write_text('{"torch_threads": 1}')
    (tmp_path / "checkpoints" / "state-000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "state-000004" / "COMPLETE").write_text("4")
    result = tether("replay", str(tmp_path), "--checkpoint", "state-4")
    assert result.returncode == ExitCode.CONFIG_ERROR, result.stderr
    assert "--checkpoint state-4 is not a complete state-N directory" in result.stderr
    assert f"{tmp_path}/checkpoints/state-000004" in result.stderr  # what it could have named
