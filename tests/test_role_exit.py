"""A role that finished leaves without the interpreter's teardown (`launch.cli.exit_finished`),
yet what it queued on ZeroMQ still reaches its peer, and a socket left open cannot hang it. A role
that ends the run gives `tether run` its exit code where the code says more than "failed"."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finishing_role(address: str, close: bool) -> subprocess.Popen:
    """A process that queues one message for ``address`` and exits as a finished role does."""
    code = textwrap.dedent(f"""
        import sys, zmq
        sys.path.insert(0, {REPO!r})
        from launch.cli import exit_finished
        from protocol.transport import LINGER_MS
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, LINGER_MS)
        socket.connect({address!r})
        socket.send(b"last words")
        if {close!r}:
            socket.close()
        exit_finished()
        """)
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_finished_role_delivers_what_it_queued_to_a_peer_that_binds_after_it_sent(tmp_path):
    address = f"ipc://{tmp_path}/peer.ipc"
    role = finishing_role(address, close=True)
    time.sleep(0.3)  # the role has sent and is exiting: its message waits in ZeroMQ's queue
    peer = zmq.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.bind(address)
    try:
        assert peer.poll(10_000), "the queued message was lost with the process"
        assert peer.recv_multipart()[1] == b"last words"
        assert role.wait(timeout=30) == 0
    finally:
        peer.close()
        role.kill()


def test_a_socket_left_open_with_nobody_to_deliver_to_does_not_hang_the_exit(tmp_path):
    role = finishing_role(f"ipc://{tmp_path}/nobody.ipc", close=False)
    try:
        assert role.wait(timeout=30) == 0  # ZeroMQ's term waits for the open socket; the exit does not
    finally:
        role.kill()


def _role_exiting(exiting: str, code: int):
    """A `start` for `launch.runner._watch` whose ``exiting`` role exits with ``code`` at once and
    whose other roles wait to be stopped, as a real role under `tether run` does."""
    from launch.processes import RoleProcess, role_name
    from launch.runner import LocalProcess

    def start(config, role, config_path, worker_index=0):
        command = ([sys.executable, "-c", f"import sys; sys.exit({code})"] if role == exiting
                   else ["sleep", "60"])
        name = role_name(role, worker_index)
        log_path = os.path.join(config.run_dir, "logs", f"{name}.log")
        return RoleProcess(name, role, worker_index, LocalProcess(subprocess.Popen(command, start_new_session=True)),
                           log_path)
    return start


@pytest.mark.parametrize("role, code, run_code", [
    ("rollout", 4, 4),  # the environment failed every episode: a restart would fail alike
    ("rollout", 2, 2),  # a bad config, found by the role
    ("learner", 3, 3),  # training stopped on a non-finite loss, its last good weights saved
    ("scorer", 1, 1),  # a failure past launch.max_restarts
    ("rollout", 7, 1),  # a code with no meaning of its own: failed
])
def test_tether_run_exits_with_the_code_of_the_role_that_ended_the_run(tmp_path, monkeypatch, role, code, run_code):
    from common.config import load_config
    from common.runlog import StartupTimeline
    from launch import runner
    from tests.helpers import base_config

    config = load_config(None, ["launch.max_restarts=0", "metrics.trackers=[]"],
                         base=base_config(tmp_path, {"policy": "/unused", "reward": "/unused", "prompts": "/unused"}))
    for directory in ("logs", "metrics"):
        os.makedirs(os.path.join(config.run_dir, directory))
    monkeypatch.setattr(runner, "_remove_shared_memory", lambda config: None)  # /dev/shm is not this test's
    timeline = StartupTimeline(config.run_dir, "tether run")
    assert runner._watch(config, "unused.yaml", False, timeline, _role_exiting(role, code)) == run_code
