"""CURVE on TCP endpoints: only allowed keys get in; nobody else is answered or heard."""

import shutil

import pytest

from common.config import CurveConfig
from protocol.security import make_keys
from protocol.transport import BufferClient, BufferServer, free_port


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


def curve_buffer(tmp_path, names: tuple[str, ...]):
    """The buffer in a thread on TCP with CURVE, admitting client keys of ``names``: (``curve(name)``,
    the transport.curve config of that client, the address, the buffer's result and its thread)."""
    from tests.helpers import start_buffer

    make_keys(str(tmp_path), "server")
    (tmp_path / "allowed").mkdir()
    for name in names:
        make_keys(str(tmp_path), name)
        shutil.copy(tmp_path / f"{name}.key", tmp_path / "allowed")
    curve = lambda name: CurveConfig(
        enabled=True, server_key=str(tmp_path / "server.key_secret"), server_public_key=str(tmp_path / "server.key"),
        client_key=str(tmp_path / f"{name}.key_secret"), allowed_clients=str(tmp_path / "allowed"))
    address = f"tcp://127.0.0.1:{free_port()}"
    _, result, thread = start_buffer(
        tmp_path, f"transport.buffer_address={address}", "transport.curve.enabled=true",
        f"transport.curve.server_key={tmp_path / 'server.key_secret'}",
        f"transport.curve.server_public_key={tmp_path / 'server.key'}",
        f"transport.curve.allowed_clients={tmp_path / 'allowed'}")
    return curve, address, result, thread


def test_a_client_key_speaks_only_as_the_role_it_is_named_after(tmp_path):
    """With CURVE the buffer knows which key sent each message: a scorer's key cannot say hello as
    the learner, nor send finish; the learner's key can. A key named after no role speaks as none."""
    from protocol.transport import RemoteError

    curve, address, result, thread = curve_buffer(tmp_path, ("scorer-0", "learner", "nobody"))

    scorer = BufferClient(address, "scorer", "0", curve=curve("scorer-0"))
    assert scorer.connect(retries=20, interval_s=0.5).type == "welcome"
    with pytest.raises(RemoteError, match="does not take 'finish' from scorer:0"):
        scorer.request("finish", {"policy_version": 0})
    impostor = BufferClient(address, "learner", "0", curve=curve("scorer-0"))
    with pytest.raises(RemoteError, match="the client key 'scorer-0' may not speak as learner"):
        impostor.request("hello", {"role": "learner", "worker_id": "0"}, timeout_s=10)
    nobody = BufferClient(address, "rollout", "0", curve=curve("nobody"))
    with pytest.raises(RemoteError, match="the client key 'nobody' may not speak as rollout"):
        nobody.request("hello", {"role": "rollout", "worker_id": "0"}, timeout_s=10)
    impostor.close()
    nobody.close()  # their identities (role, worker, pid) are the next clients'
    learner = BufferClient(address, "learner", "0", curve=curve("learner"))
    learner.connect(retries=20, interval_s=0.5)
    assert learner.request("finish", {"policy_version": 0}).type == "ack"
    assert scorer.request("score_request", {"max_samples": 4}).fields["stop"]
    thread.join(timeout=40)
    assert result["refused_messages"] == 3


@pytest.mark.parametrize("address, refused", [("tcp://10.1.2.3:5555", True), ("tcp://0.0.0.0:5555", True),
                                              ("tcp://127.0.0.1:5555", False), ("tcp://[::1]:5555", False)])
def test_a_tcp_endpoint_beyond_loopback_needs_curve_or_an_explicit_setting(tmp_path, address, refused):
    from common.config import ConfigError, load_config
    from tests.helpers import base_config

    base = base_config(tmp_path, {"policy": "/unused", "reward": "/unused", "prompts": "/unused"})
    if refused:
        with pytest.raises(ConfigError, match="transport.buffer_address .* without CURVE.*transport.allow_plain_tcp"):
            load_config(None, [f"transport.buffer_address={address}"], base=base)
        load_config(None, [f"transport.buffer_address={address}", "transport.allow_plain_tcp=true"], base=base)
    else:
        assert load_config(None, [f"transport.buffer_address={address}"], base=base).buffer_address == address


def test_a_client_key_speaks_for_one_worker_of_its_role(tmp_path):
    """With CURVE a key is one worker's: ``scorer-0`` says hello as scorer:0 alone (it once evicted a
    running scorer:1, dropping its held request); a key that names no number (``scorer-gpu``) is the
    first worker it says hello as. The evicted-no-more scorer:1 keeps its held request."""
    from protocol.transport import RemoteError

    curve, address, result, thread = curve_buffer(tmp_path, ("scorer-0", "scorer-1", "scorer-gpu", "learner"))
    honest = BufferClient(address, "scorer", "1", curve=curve("scorer-1"))
    honest.connect(retries=20, interval_s=0.5)
    held = honest.send("score_request", {"max_samples": 4})
    impostor = BufferClient(address, "scorer", "1", curve=curve("scorer-0"))
    with pytest.raises(RemoteError, match="the client key 'scorer-0' speaks for scorer:0, not scorer:1"):
        impostor.request("hello", {"role": "scorer", "worker_id": "1"}, timeout_s=10)
    host = BufferClient(address, "scorer", "5", curve=curve("scorer-gpu"))
    assert host.connect(retries=20, interval_s=0.5).type == "welcome"
    other = BufferClient(address, "scorer", "6", curve=curve("scorer-gpu"))
    with pytest.raises(RemoteError, match="the client key 'scorer-gpu' speaks for scorer:5, not scorer:6"):
        other.request("hello", {"role": "scorer", "worker_id": "6"}, timeout_s=10)
    learner = BufferClient(address, "learner", "0", curve=curve("learner"))
    learner.connect(retries=20, interval_s=0.5)
    learner.request("finish", {"policy_version": 0})
    assert honest.wait(held, timeout_s=10).fields["stop"]  # its held request still its own, answered
    for client in (impostor, other):
        client.close()
    assert host.request("score_request", {"max_samples": 4}).fields["stop"]
    thread.join(timeout=40)
    assert result["refused_messages"] == 2
