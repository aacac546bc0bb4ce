"""A role that finished leaves without the interpreter's teardown (`launch.cli.exit_finished`),
yet what it queued on ZeroMQ still reaches its peer, and a socket left open cannot hang it."""

import os
import subprocess
import sys
import textwrap
import time

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
