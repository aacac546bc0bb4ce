"""CURVE on TCP endpoints: only allowed keys get in; nobody else is answered or heard."""

import shutil
import threading

import pytest

from protocol.config import CurveConfig
from protocol.security import make_keys
from protocol.transport import BufferClient, BufferServer, free_port


@pytest.fixture
def keys(tmp_path):
    make_keys(str(tmp_path), "server")
    for name in ("allowed", "stranger"):
        make_keys(str(tmp_path), name)
    (tmp_path / "allowed_clients").mkdir()
    shutil.copy(tmp_path / "allowed.key", tmp_path / "allowed_clients")
    curve = lambda client: CurveConfig(
        enabled=True, server_key=str(tmp_path / "server.key_secret"), server_public_key=str(tmp_path / "server.key"),
        client_key=str(tmp_path / f"{client}.key_secret"), allowed_clients=str(tmp_path / "allowed_clients"))
    return curve


@pytest.fixture
def server(keys):
    address = f"tcp://127.0.0.1:{free_port()}"
    server = BufferServer(address, curve=keys("allowed"))
    heard = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            received = server.receive(timeout_ms=50)
            if received is not None:
                identity, message = received
                heard.append(message.fields["worker_id"])
                server.reply(identity, message.id, "welcome", {"run_id": "r", "max_staleness": 1, "batch_size": 1})

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield address, heard
    stop.set()
    thread.join()
    server.close()


def test_an_allowed_key_is_answered(server, keys):
    address, heard = server
    client = BufferClient(address, "rollout", "allowed", curve=keys("allowed"))
    assert client.connect(retries=5, interval_s=1.0).type == "welcome"
    assert heard == ["allowed"]


def test_an_unknown_key_or_no_key_gets_no_reply_and_is_not_heard(server, keys):
    address, heard = server
    stranger = BufferClient(address, "rollout", "stranger", curve=keys("stranger"))
    with pytest.raises(TimeoutError):
        stranger.request("hello", {"role": "rollout", "worker_id": "stranger"}, timeout_s=1.5)
    plain = BufferClient(address, "rollout", "plain")
    with pytest.raises(TimeoutError):
        plain.request("hello", {"role": "rollout", "worker_id": "plain"}, timeout_s=1.5)
    assert heard == []


def test_a_missing_key_file_names_the_setting(tmp_path):
    curve = CurveConfig(enabled=True, client_key=str(tmp_path / "none.key_secret"))
    with pytest.raises(FileNotFoundError, match="transport.curve.client_key: .* does not exist"):
        BufferClient("tcp://127.0.0.1:1", "rollout", "x", curve=curve)


def test_an_ipc_endpoint_in_a_directory_others_can_enter_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(PermissionError, match="shared, the directory of the ipc endpoint .* is open to other users"):
        BufferServer(f"ipc://{shared}/buffer")
    private = tmp_path / "private" / "sockets"
    BufferServer(f"ipc://{private}/buffer").close()
    assert (private.stat().st_mode & 0o777) == 0o700
