"""`tether run --ray` on a Ray cluster of two nodes made on this machine (each with two logical CPUs
and a custom resource naming it), everything bound to loopback."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from common.runlog import read_metrics
from launch.exit_codes import ExitCode
from tests.helpers import REPO, base_config

# Ray otherwise resolves this machine's own address for "127.0.0.1" (its cluster mode): the test's
# traffic stays on loopback
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# the roles' share of the nodes' CPUs: all four fit on one node when the other is lost
CPUS = {"buffer": 0.1, "rollout": 0.3, "scorer": 0.3, "learner": 0.3}
NODES = {"buffer": "node_a", "learner": "node_a", "rollout": "node_b", "scorer": "node_b"}
STEPS = 16  # GRPO steps on the gold rule: enough for its gain on the tiny assets


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes; yields the cluster (the tests that stop a node add one back)."""
    os.environ.update(LOOPBACK_ONLY)
    import ray._private.ray_constants as constants
    from ray.cluster_utils import Cluster

    # the variable is read when ray is first imported, which an earlier test of the session may have
    # done (vLLM imports ray): unread, ray.init turns 127.0.0.1 into the host's IP, where no node listens
    enabled, constants.ENABLE_RAY_CLUSTER = constants.ENABLE_RAY_CLUSTER, False

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1},
                                                            "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={"node_b": 1}, node_ip_address="127.0.0.1")
    yield cluster
    cluster.shutdown()
    constants.ENABLE_RAY_CLUSTER = enabled


def node_ids(cluster) -> dict[str, str]:
    """Custom resource -> node id, of the live nodes."""
    import ray

    ray.init(address=cluster.address, namespace="tether-test", log_to_driver=False)
    try:
        return {name: node["NodeID"] for node in ray.nodes() if node["Alive"] for name in ("node_a", "node_b")
                if name in node["Resources"]}
    finally:
        ray.shutdown()


def ray_config(tmp_path, assets, steps, **ray_placement) -> str:
    config = base_config(tmp_path, assets, learner={"total_steps": steps, "batch_size": 32, "minibatch_size": 16})
    config["rollout"] = {"max_new_tokens": 8, "max_model_len": 64, "prompts_per_generate": 32, "kv_cache_gib": 0.1}
    config["placement"] = {"ray": {"cpus": CPUS, "nodes": NODES, **ray_placement}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def tether_on(cluster, config: str, *args, timeout=400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", "run", "-c", config, "--ray-address", cluster.address,
                           *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **LOOPBACK_ONLY})


def left_behind(run_dir: str) -> list[str]:
    """Command lines of processes still running for ``run_dir`` (its config is in each)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "launch.cli launch" in command and run_dir in command:
            found.append(command)
    return found


# --------------------------------------------------------------------------- a cluster tether starts itself
# (first in the file: no cluster of the module's fixture may run yet, or `ray.init()` would join it)


def ray_sessions() -> set[str]:
    import glob
    import tempfile

    return set(glob.glob(os.path.join(tempfile.gettempdir(), "ray", "session_2*")))


def demo_on_ray_alone(tmp_path, assets, *overrides, **popen) -> subprocess.Popen:
    """`tether run -c configs/demo.yaml --ray`, no address and no RAY_ADDRESS: tether starts Ray on
    this machine; the demo's own config on the tiny assets, its placement untouched."""
    paths = [f"models.policy={assets['policy']}", f"models.reward={assets['reward']}",
             f"data.prompts={assets['prompts']}", f"run_dir={tmp_path / 'run'}", *overrides]
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "-c", "configs/demo.yaml", "--ray",
                             *(item for o in paths for item in ("-o", o))], cwd=REPO, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.slow
def test_the_demo_config_runs_with_ray_on_a_two_cpu_box_as_it_is(tmp_path, tiny_assets):
    """The four processes would ask 1 CPU each of this machine's 2: each gets an equal share and the
    demo trains; CPUs set by hand that cannot fit are refused at once, naming the key and what the
    cluster has; Ray's session directory goes with the cluster tether started."""
    before = ray_sessions()
    refused = demo_on_ray_alone(tmp_path, tiny_assets, "placement.ray.cpus.learner=4")
    _, stderr = refused.communicate(timeout=120)
    assert refused.returncode == ExitCode.CONFIG_ERROR, stderr[-3000:]
    assert "placement.ray.cpus: the run's processes ask 4 CPUs (learner 4 x 1)" in stderr
    assert "the cluster has 2" in stderr

    run = demo_on_ray_alone(tmp_path, tiny_assets, "learner.total_steps=4")
    stdout, stderr = run.communicate(timeout=400)
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "the cluster has 2 CPUs for 4 asked: each process whose role placement.ray.cpus leaves unset gets 0.5" \
        in stderr
    assert [r["step"] for r in read_metrics(str(tmp_path / "run"), "learner")] == [1, 2, 3, 4]
    assert left_behind(str(tmp_path / "run")) == []
    assert ray_sessions() <= before  # what tether's own Ray wrote is gone


@pytest.mark.slow
def test_a_background_tether_run_waiting_for_placement_stops_on_sigint(tmp_path, tiny_assets):
    """A rollout that asks for a GPU this cluster has not: the wait shows progress, and SIGINT stops
    it at once, though the shell started the job with SIGINT ignored."""
    import signal as signals

    run = demo_on_ray_alone(tmp_path, tiny_assets, "placement.ray.gpus.rollout=1",
                            preexec_fn=lambda: signals.signal(signals.SIGINT, signals.SIG_IGN))
    try:
        for line in run.stderr:  # the first progress line: the wait is on
            if "for Ray to place rollout0 (0.5 CPU, 1 GPU)" in line:
                break
        stopped_at = time.monotonic()
        run.send_signal(signals.SIGINT)
        _, rest = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130 and time.monotonic() - stopped_at < 30, rest[-3000:]
    assert "got SIGINT while Ray placed the processes" in rest
    assert left_behind(str(tmp_path / "run")) == []


@pytest.mark.slow
def test_the_demo_learns_on_two_ray_nodes_placed_as_the_config_says(tmp_path, tiny_assets, cluster):
    """The buffer on node_a, the rollout and the scorer on node_b, the learner on both (learner.nodes
    2: one placement group, a bundle on each node; node rank 0's address and port are found, not
    typed): each process's start-up records name its node; the rollout, on another node than the
    learner's rank 0, fetches weights over TCP (CURVE on: the run's keys); every sample is
    accounted for; the policy learns as it does locally: the demo's config on the gold rule alone
    (GRPO, as tests/test_verifiable_reward.py trains it) raises held-out gold by 0.1 or more over SFT."""
    from demos.parity import held_out_figures

    ids = node_ids(cluster)
    with open(os.path.join(REPO, "configs", "demo.yaml")) as file:
        config = yaml.safe_load(file)
    nodes = {role: node for role, node in NODES.items() if role != "learner"}
    config.update(run_dir=str(tmp_path / "run"), placement={"ray": {"cpus": CPUS, "nodes": nodes}})
    config["models"] = {"policy": tiny_assets["policy"], "reward": None}
    config["scorer"]["reward_functions"] = [{"function": "demos.parity:gold_reward", "weight": 1.0}]
    config["data"]["prompts"] = tiny_assets["prompts"]
    config["rollout"].update(samples_per_prompt=4, prompts_per_generate=8)
    config["learner"].update(total_steps=STEPS, batch_size=32, minibatch_size=16, actor_lr=5e-4, kl_coef=0.01,
                             advantage_estimator="grpo", kl_in="loss", nodes=2)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = tether_on(cluster, str(path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "placed by Ray on 2 node(s)" in result.stdout
    run_dir = str(tmp_path / "run")
    nodes = {record["role"]: record["node"] for record in read_metrics(run_dir, "startup") if "node" in record}
    assert {name: node for name, node in nodes.items() if name != "learner1"} == {
        "buffer": ids["node_a"], "rollout0": ids["node_b"], "scorer0": ids["node_b"], "learner": nodes["learner"]}
    assert {nodes["learner"], nodes["learner1"]} == set(ids.values()), nodes  # rank 1 on the other node
    assert [record["step"] for record in read_metrics(run_dir, "learner")] == list(range(1, STEPS + 1))
    if nodes["learner"] != ids["node_b"]:
        with open(os.path.join(run_dir, "logs", "rollout0.log")) as file:
            assert "fetch over tcp and load" in file.read()
    with open(os.path.join(run_dir, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["trained"] == STEPS * config["learner"]["batch_size"]
    sft, ppo = (held_out_figures(policy, tiny_assets["policy"], tiny_assets["reward"], tiny_assets["eval_prompts"], 8)
                for policy in (tiny_assets["policy"], os.path.join(run_dir, "checkpoints", "final")))
    print(f"held-out gold on two Ray nodes: {sft['gold_reward']:.3f} -> {ppo['gold_reward']:.3f}")
    assert ppo["gold_reward"] >= sft["gold_reward"] + 0.1, (sft, ppo)
    assert left_behind(run_dir) == []


@pytest.mark.slow
def test_a_node_that_does_not_see_run_dir_ships_metrics_and_logs_back(tmp_path, tiny_assets, cluster):
    """placement.ray.share_run_dir: no, as on nodes without a shared filesystem: every process runs in
    a directory of its node, and the driver's run_dir still gets every role's metrics and log, so
    `tether status` works from the head."""
    from tests.helpers import tether

    config = ray_config(tmp_path, tiny_assets, steps=3, share_run_dir="no")
    result = tether_on(cluster, config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "its checkpoints stay in" in result.stderr  # said at start
    run_dir = str(tmp_path / "run")
    assert [record["step"] for record in read_metrics(run_dir, "learner")] == [1, 2, 3]
    for name in ("buffer", "rollout0", "scorer0", "learner"):
        assert os.path.getsize(os.path.join(run_dir, "logs", f"{name}.log")) > 0, name
    assert read_metrics(run_dir, "rollout0") and read_metrics(run_dir, "scorer0")
    assert not os.path.exists(os.path.join(run_dir, "checkpoints"))  # they stayed on the learner's node
    status = tether("status", run_dir, "--once", timeout=120)
    assert status.returncode == 0 and "3 of 3" in status.stdout


@pytest.mark.slow
def test_a_killed_rollout_and_a_lost_node_are_replaced_and_ctrl_c_leaves_nothing(tmp_path, tiny_assets, cluster):
    """The rollout's process killed (SIGKILL) is started again; then node_b is lost: its rollout and
    scorer start on node_a and training goes on; Ctrl-C then stops the run (the learner
    checkpoints) and leaves no tether process on either node."""
    config = ray_config(tmp_path, tiny_assets, steps=4000)  # ended by Ctrl-C, never by running out (in CI 400 did)
    run_dir = str(tmp_path / "run")
    driver = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "-c", config, "--ray-address",
                               cluster.address, "-o", "launch.restart_backoff_s=0.5"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **LOOPBACK_ONLY})

    def wait_for_step(step: int, deadline_s: float = 180) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            assert driver.poll() is None, driver.stdout.read()[-3000:]
            if len(read_metrics(run_dir, "learner")) >= step:
                return
            time.sleep(0.5)
        raise AssertionError(f"no step {step} within {deadline_s}s")

    try:
        wait_for_step(3)
        with open(os.path.join(run_dir, "pids.json")) as file:
            os.kill(json.load(file)["rollout0"], signal.SIGKILL)
        wait_for_step(len(read_metrics(run_dir, "learner")) + 3)
        node_b = next(iter(cluster.worker_nodes))
        cluster.remove_node(node_b)
        wait_for_step(len(read_metrics(run_dir, "learner")) + 3)
        driver.send_signal(signal.SIGINT)
        output, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
        if len(cluster.worker_nodes) == 0:
            cluster.add_node(num_cpus=2, resources={"node_b": 1}, node_ip_address="127.0.0.1")
    assert driver.returncode == 130, output[-3000:]
    assert "rollout0 exited with code" in output and "restarting it" in output
    assert "node is lost" in output  # node_b's processes, seen gone
    assert output.count("restarting it") >= 3  # the killed rollout, then node_b's rollout and scorer
    assert os.listdir(os.path.join(run_dir, "checkpoints"))  # the learner checkpointed on Ctrl-C
    assert left_behind(run_dir) == []


@pytest.mark.slow
def test_a_sweep_runs_its_trials_on_the_cluster_and_plans_from_them(tmp_path, tiny_assets, cluster):
    """`tether sweep --ray`: a split's devices are CPU counts each process asks Ray for; the trial
    runs there, is ranked, and `tether plan` reads the trial's costs in those counts."""
    from tests.helpers import tether

    config = ray_config(tmp_path, tiny_assets, steps=3)
    sweep = subprocess.run([sys.executable, "-m", "launch.cli", "sweep", "-c", config, "--ray-address", cluster.address,
                            "--split", "rollout=0;scorer=1;learner=1", "--staleness", "1", "--steps", "3",
                            "--out", str(tmp_path / "s")], cwd=REPO, capture_output=True, text=True, timeout=400,
                           env={**os.environ, **LOOPBACK_ONLY})
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    trial = json.loads((tmp_path / "s" / "sweep.json").read_text())[0]
    assert trial["tokens_per_s"] > 0 and trial["max_staleness"] == 1
    with open(os.path.join(trial["run_dir"], "config.yaml")) as file:
        assert yaml.safe_load(file)["placement"]["ray"]["cpus"] == {**CPUS, "rollout": 1.0, "scorer": 1.0,
                                                                   "learner": 1.0}
    plan = tether("plan", trial["run_dir"], "--devices", "2", timeout=120)
    assert plan.returncode == 0 and "predicted" in plan.stdout, plan.stdout + plan.stderr
    assert "colocated (placement.mode colocate" in plan.stdout and "would run: " in plan.stdout, plan.stdout


def test_a_hosts_files_land_whole_while_another_process_reads_them(tmp_path):
    """Nodes that share run_dir share its keys/: each process's host writes the server's key again
    while processes already started read it (a buffer once read an empty key). A reader never sees
    a file part written."""
    import threading

    from launch.ray_cluster import ProcessHost

    host = ProcessHost(str(tmp_path), "run", "yes", "learner")
    key = b"public-key = \"" + b"k" * 40 + b"\"\n" * 20
    host.write({"keys/server.key_secret": key})
    seen, done = set(), threading.Event()

    def read() -> None:
        while not done.is_set():
            with open(tmp_path / "keys" / "server.key_secret", "rb") as file:
                seen.add(file.read())

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(3000):
        host.write({"keys/server.key_secret": key})
    done.set()
    reader.join(timeout=10)
    assert seen == {key} and sorted(os.listdir(tmp_path / "keys")) == ["server.key_secret"]
