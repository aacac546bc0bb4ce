"""Thousands of random and mutated messages at the buffer's socket: it never crashes, refuses and
counts every bad one with a reason, and still serves good traffic afterwards. Nothing on the wire
is ever unpickled (the codec is msgpack and raw frames only)."""

import random

import msgpack
import numpy as np
import pytest
import zmq

from protocol.codec import decode, encode
from protocol.samples import pack_samples
from protocol.transport import BufferClient
from tests.helpers import random_sample

pytestmark = pytest.mark.buffer_overrides("transport.max_frame_bytes=65536", "log_level=ERROR")

MESSAGES = 3000


def mutations(rng: random.Random):
    """An endless mix of hostile messages built from a valid one."""
    valid = encode("samples", *pack_samples([random_sample(i) for i in range(3)]), msg_id=1)
    valid = [bytes(frame) for frame in valid]
    envelope = msgpack.unpackb(valid[0])
    while True:
        kind = rng.randrange(8)
        frames = list(valid)
        if kind == 0:  # random bytes, random frame count
            frames = [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 5))]
        elif kind == 1:  # flipped bytes in the envelope
            data = bytearray(frames[0])
            for _ in range(rng.randrange(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            frames[0] = bytes(data)
        elif kind == 2:  # a truncated or dropped tensor frame
            index = rng.randrange(1, len(frames))
            frames[index] = frames[index][:rng.randrange(len(frames[index]))] if rng.random() < 0.5 else b""
        elif kind == 3:  # wrong dtype or shape declared
            mutated = msgpack.unpackb(frames[0])
            spec = rng.choice(mutated["tensors"])
            spec[1 if rng.random() < 0.5 else 2] = rng.choice(["float64", "int8", [10**9], [-1], "x"])
            frames[0] = msgpack.packb(mutated)
        elif kind == 4:  # unknown type, other schema version, missing or extra fields
            mutated = dict(envelope)
            mutated[rng.choice(["type", "schema", "fields", "id"])] = rng.choice(["nope", 99, {}, None, [1]])
            frames[0] = msgpack.packb(mutated)
        elif kind == 5:  # NaN in the logprobs
            logprobs = np.frombuffer(frames[3], dtype=np.float32).copy()
            logprobs[rng.randrange(len(logprobs))] = np.nan
            frames[3] = logprobs.tobytes()
        elif kind == 6:  # an oversized frame
            frames[1] = b"\0" * (70_000 + rng.randrange(1000))
        else:  # an extra frame nobody declared
            frames.append(rng.randbytes(16))
        yield frames


def test_the_buffer_survives_a_flood_of_hostile_messages(buffer_role):
    config, result, thread = buffer_role
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(config.buffer_address)
    replies = {"error": 0, "other": 0}
    source = mutations(random.Random(0))
    for _ in range(MESSAGES):
        raw.send_multipart(next(source))
        assert raw.poll(5000), "the buffer stopped answering"
        reply = decode(raw.recv_multipart())
        replies["error" if reply.type == "error" else "other"] += 1
    raw.close()
    assert replies["error"] > MESSAGES * 0.9  # nearly all of them are bad; the rest are valid samples

    # good traffic is still served
    learner = BufferClient(config.buffer_address, "learner", "0")
    assert learner.connect(retries=5, interval_s=1.0).type == "welcome"
    rollout = BufferClient(config.buffer_address, "rollout", "0")
    rollout.connect(retries=5, interval_s=1.0)
    assert rollout.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["credits"] >= 0
    learner.request("finish", {"policy_version": 0})
    rollout.request("credit_request", {"policy_version": 0, "wanted": 2})
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert result["refused_messages"] == replies["error"]  # every refusal counted
    assert result["identity_holds"]


def test_the_weight_server_survives_a_flood_too(tmp_path):
    import torch

    from weight_sync.buckets import ShmWeightWriter, read_manifest
    from weight_sync.tcp import WeightServer, fetch_over_tcp

    writer = ShmWeightWriter(str(tmp_path / "learner"), bucket_bytes=4096)
    manifest = writer.publish(1, [("w", torch.arange(3000, dtype=torch.float32))])
    server = WeightServer(writer, "tcp://127.0.0.1:0", max_frame_bytes=65536)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    rng = random.Random(1)
    valid = bytes(encode("weights_fetch", {"policy_version": 1, "bucket": 0}, msg_id=1)[0])
    errors = 0
    for _ in range(MESSAGES):
        choice = rng.randrange(4)
        if choice == 0:
            frames = [rng.randbytes(rng.randrange(1, 100))]
        elif choice == 1:
            data = bytearray(valid)
            data[rng.randrange(len(data))] = rng.randrange(256)
            frames = [bytes(data)]
        elif choice == 2:
            frames = [bytes(encode("weights_fetch", {"policy_version": rng.randrange(-5, 5), "bucket": rng.randrange(-5, 50)},
                                   msg_id=2)[0])]
        else:
            frames = [bytes(encode("hello", {"role": "x", "worker_id": "y"})[0])]
        raw.send_multipart(frames)
        assert raw.poll(5000), "the weight server stopped answering"
        errors += decode(raw.recv_multipart()).type == "error"
    raw.close()
    staging = ShmWeightWriter(str(tmp_path / "rollout"), bucket_bytes=1)
    with read_manifest(fetch_over_tcp(manifest, server.address, staging)) as tensors:  # still serving
        assert torch.equal(tensors["w"], torch.arange(3000, dtype=torch.float32))
    assert server.refused == errors and errors > MESSAGES // 2
    server.close()


def test_the_weight_server_answers_a_request_it_fails_on_and_serves_on(tmp_path, monkeypatch):
    """An error of the server's own while it reads a slot (a slot recycled mid-read) fails that
    request with the reason, never the server's thread."""
    import torch

    from weight_sync.buckets import ShmWeightWriter, read_manifest
    from weight_sync.tcp import WeightServer, fetch_over_tcp

    writer = ShmWeightWriter(str(tmp_path / "learner"), bucket_bytes=4096)
    manifest = writer.publish(1, [("w", torch.arange(3000, dtype=torch.float32))])
    server = WeightServer(writer, "tcp://127.0.0.1:0", max_frame_bytes=65536)
    bucket, failed = WeightServer._bucket, []

    def once_failing(self, version, index):
        if not failed:
            failed.append(index)
            raise OSError("the slot went away")
        return bucket(self, version, index)

    monkeypatch.setattr(WeightServer, "_bucket", once_failing)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    raw.send_multipart(encode("weights_fetch", {"policy_version": 1, "bucket": 0}, msg_id=5))
    assert raw.poll(5000)
    reply = decode(raw.recv_multipart())
    assert reply.type == "error" and "OSError: the slot went away" in reply.fields["reason"]
    raw.close()
    staging = ShmWeightWriter(str(tmp_path / "rollout"), bucket_bytes=1)
    with read_manifest(fetch_over_tcp(manifest, server.address, staging)) as tensors:  # still serving
        assert torch.equal(tensors["w"], torch.arange(3000, dtype=torch.float32))
    server.close()
