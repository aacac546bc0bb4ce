"""Several hosts, on loopback: every role started by hand with `tether launch`, each "host" with
its own run directory, the buffer and the weight server on TCP with CURVE, weights fetched over
TCP, and the learner as a DeepSpeed job over two "hosts" (--nnodes 2, one rank each)."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from common.runlog import read_metrics
from protocol.security import make_keys
from protocol.transport import free_port
from tests.helpers import REPO, base_config

BATCH = 16


def host_config(tmp_path, assets, host: str, keys: str, ports: dict) -> str:
    config = base_config(tmp_path / host, assets)
    config["run_dir"] = str(tmp_path / host / "run")
    config["rollout"] = {"max_new_tokens": 6, "prompts_per_generate": 16, "max_model_len": 64}
    config["learner"] = {"batch_size": BATCH, "minibatch_size": 8, "ppo_epochs": 1, "total_steps": 3,
                         "dist_port": ports["dist"]}
    config["transport"].update({
        "buffer_address": f"tcp://127.0.0.1:{ports['buffer']}", "weight_transport": "tcp",
        "weights_address": f"tcp://127.0.0.1:{ports['weights']}",
        "curve": {"enabled": True, "server_key": f"{keys}/server.key_secret", "server_public_key": f"{keys}/server.key",
                  "client_key": f"{keys}/{host}.key_secret", "allowed_clients": f"{keys}/allowed"}})
    (tmp_path / host).mkdir(parents=True, exist_ok=True)
    path = tmp_path / host / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_roles_on_separate_hosts_over_tcp_with_curve(tmp_path, tiny_assets):
    keys = str(tmp_path / "keys")
    make_keys(keys, "server")
    hosts = ("buffer-host", "scorer-host", "rollout-host", "learner-host-0", "learner-host-1")
    for host in hosts:
        public, _ = make_keys(keys, host)
        os.makedirs(f"{keys}/allowed", exist_ok=True)
        os.replace(public, f"{keys}/allowed/{host}.key")
        os.symlink(f"{keys}/allowed/{host}.key", public)
    ports = {"buffer": free_port(), "weights": free_port(), "dist": free_port()}
    configs = {host: host_config(tmp_path, tiny_assets, host, keys, ports) for host in hosts}
    commands = {
        "buffer-host": ["buffer"], "scorer-host": ["scorer"], "rollout-host": ["rollout"],
        "learner-host-0": ["learner", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"],
        "learner-host-1": ["learner", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"],
    }
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    processes = {}
    try:
        for host, command in commands.items():
            log = open(tmp_path / host / "role.log", "wb")
            processes[host] = subprocess.Popen([sys.executable, "-m", "launch.cli", "launch", *command, "--config",
                                                configs[host]], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                               env=env, start_new_session=True)
        deadline = time.monotonic() + 400
        while any(p.poll() is None for p in processes.values()) and time.monotonic() < deadline:
            failed = [host for host, p in processes.items() if p.poll() not in (None, 0)]
            assert not failed, {host: (tmp_path / host / "role.log").read_text()[-3000:] for host in failed}
            time.sleep(0.5)
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, 9)
    logs = {host: (tmp_path / host / "role.log").read_text() for host in hosts}
    assert all(p.returncode == 0 for p in processes.values()), {h: logs[h][-2000:] for h in hosts}

    buffer_run = str(tmp_path / "buffer-host" / "run")
    with open(os.path.join(buffer_run, "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["trained"] == 3 * BATCH
    assert accounting["staleness_violations"] == 0 and accounting["refused_messages"] == 0
    learner_run = str(tmp_path / "learner-host-0" / "run")
    records = read_metrics(learner_run, "learner")
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["ranks"] == 2 for r in records)
    assert os.path.exists(os.path.join(learner_run, "checkpoints", "final", "model.safetensors"))
    assert "fetch over tcp and load" in logs["rollout-host"]
    # each host's files stay on that host: the rollout's metrics are in its own run directory
    assert read_metrics(str(tmp_path / "rollout-host" / "run"), "rollout0")
    assert not os.path.exists(os.path.join(buffer_run, "metrics", "rollout0.jsonl"))
