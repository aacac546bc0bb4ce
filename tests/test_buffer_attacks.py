"""The buffer survives any message (issue 53): each attack that once killed it, wrote outside the run
or spoke for another worker, made against a real `tether launch buffer` process while two honest
workers hold work (a rollout with credits, a scorer with a score request). After each, the buffer
is alive, answers the attacker with the reason, and serves the honest workers as before."""

import json
import os
import resource
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import DEFAULT_MAX_FRAME_BYTES, decode, encode
from protocol.errors import ProtocolError
from protocol.samples import pack_samples
from protocol.schema import MESSAGES, SCHEMA_VERSION, string_limit
from protocol.transport import BufferClient, RemoteError
from tests.helpers import buffer_process, random_sample


def _generated(first: int, count: int, version: int = 0):
    samples = [random_sample(first + i) for i in range(count)]
    for index, sample in enumerate(samples):
        sample.prompt_index, sample.behavior_version, sample.last_behavior_version = index, version, version
    return samples


class Honest:
    """A rollout holding credits and a scorer holding a score request, on the buffer of ``config``."""

    def __init__(self, config) -> None:
        self.rollout = BufferClient(config.buffer_address, "rollout", "0")
        self.rollout.connect(retries=60, interval_s=0.5)
        self.credits = self.rollout.request("credit_request", {"policy_version": 0, "wanted": 2})
        self.scorer = BufferClient(config.buffer_address, "scorer", "0")
        self.scorer.connect(retries=60, interval_s=0.5)
        self.held = self.scorer.send("score_request", {"max_samples": 4})

    def still_served(self) -> None:
        """The rollout's samples are taken against its credits, and the scorer's held request is
        answered with them: nothing the attack did took their work away."""
        assert self.credits.fields["prompt_indices"] == [0, 1]
        assert self.rollout.request("samples", *pack_samples(_generated(0, 2))).fields["accepted"] == 2
        work = self.scorer.wait(self.held, timeout_s=10)
        assert work.type == "score_work" and len(work.fields["sample_ids"]) == 2

    def close(self) -> None:
        self.rollout.close()
        self.scorer.close()


@pytest.fixture
def attacked(tmp_path):
    """(config, the buffer's process, the honest workers, a raw DEALER that speaks as it likes)."""
    config, process = buffer_process(tmp_path)
    honest, raw = None, zmq.Context.instance().socket(zmq.DEALER)
    try:
        honest = Honest(config)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(config.buffer_address)
        yield config, process, honest, raw
    finally:
        raw.close()
        if honest is not None:
            honest.close()
        process.kill()
        process.wait(timeout=10)


def _answer(raw, frames) -> dict:
    """What the buffer answers ``frames``: the decoded reply's type and fields."""
    raw.send_multipart(frames)
    assert raw.poll(10_000), "the buffer did not answer"
    reply = decode(raw.recv_multipart())
    return {"type": reply.type, **reply.fields}


def _envelope(msg_type: str, fields: dict, tensors: list | None = None, schema=SCHEMA_VERSION) -> bytes:
    return msgpack.packb({"schema": schema, "type": msg_type, "id": 7, "fields": fields, "tensors": tensors or []})


def _nested(depth: int):
    value = []
    for _ in range(depth):
        value = [value]
    return value


def test_a_tensor_shape_whose_size_wraps_is_refused_and_the_buffer_serves_on(attacked):
    """[2**32, 2**32] int32 is 0 bytes in int64 arithmetic: an empty frame passed the size check and
    the reshape's ValueError killed the buffer's loop, before any hello."""
    config, process, honest, raw = attacked
    frames = encode("samples", *pack_samples(_generated(0, 1)), msg_id=7)
    envelope = msgpack.unpackb(bytes(frames[0]))
    envelope["tensors"][0][2] = [2 ** 32, 2 ** 32]
    frames = [msgpack.packb(envelope), b"", *[bytes(frame) for frame in frames[2:]]]
    answer = _answer(raw, frames)
    assert answer["type"] == "error" and "needs" in answer["reason"] and process.poll() is None
    honest.still_served()


def test_a_field_nested_past_the_interpreters_depth_is_refused_and_the_buffer_serves_on(attacked):
    """A schema field holding a list nested 1,010 deep: msgpack reads it, and the error text's repr
    of it raised RecursionError, which killed the buffer."""
    config, process, honest, raw = attacked
    answer = _answer(raw, [_envelope("hello", {"role": "rollout", "worker_id": "9"}, schema=_nested(1010))])
    assert answer["type"] == "error" and "schema version" in answer["reason"] and len(answer["reason"]) < 1000
    answer = _answer(raw, [_envelope("hello", {"role": _nested(1010), "worker_id": "9"})])
    assert answer["type"] == "error" and process.poll() is None
    honest.still_served()


def test_a_snapshot_never_writes_through_a_symlink_outside_the_run(attacked, tmp_path):
    """The learner's snapshot path is checked, but its ``.tmp`` was opened following a symlink
    there: a file outside the run was overwritten. Now the link is replaced, never followed."""
    config, process, honest, raw = attacked
    outside = tmp_path / "outside.txt"
    outside.write_text("not the buffer's" * 60)
    checkpoints = os.path.join(config.run_dir, "checkpoints")
    os.makedirs(checkpoints, exist_ok=True)
    os.symlink(outside, os.path.join(checkpoints, "buffer.snapshot.tmp"))
    learner = BufferClient(config.buffer_address, "learner", "0")
    learner.connect(retries=20, interval_s=0.5)
    learner.request("snapshot", {"path": os.path.join(checkpoints, "buffer.snapshot"), "policy_version": 0})
    learner.close()
    assert outside.read_text() == "not the buffer's" * 60
    assert not os.path.islink(os.path.join(checkpoints, "buffer.snapshot"))
    assert os.path.getsize(os.path.join(checkpoints, "buffer.snapshot")) > 0 and process.poll() is None
    honest.still_served()


def test_a_second_hello_for_a_live_worker_is_refused_and_a_restart_is_taken(attacked):
    """On plain TCP (or ipc) anyone who can connect may say hello as rollout:0: that evicted the
    running rollout:0 and returned its credits. A hello for a worker whose connection is alive is
    refused; once that connection is gone, the same hello is a restart and is taken."""
    config, process, honest, raw = attacked
    answer = _answer(raw, encode("hello", {"role": "rollout", "worker_id": "0"}, msg_id=7))
    assert answer["type"] == "error" and "rollout:0 is connected from another process" in answer["reason"]
    honest.still_served()
    honest.rollout.close()
    time.sleep(0.5)  # its connection closed: the next hello as rollout:0 is a restart
    restarted = BufferClient(config.buffer_address, "rollout", "0")
    try:
        assert restarted.connect(retries=20, interval_s=0.5).type == "welcome"
    finally:
        restarted.close()
    assert process.poll() is None


def test_strings_past_their_bound_are_refused_and_what_is_logged_is_cut(attacked):
    """A 100 MB worker_id was welcomed and a 100 MB goodbye reason accepted: the log grew 300 MiB.
    Every string field has a bound (protocol.schema.string_limit), checked at decode."""
    config, process, honest, raw = attacked
    huge = "x" * (100 << 20)
    answer = _answer(raw, [_envelope("hello", {"role": "rollout", "worker_id": huge})])
    assert answer["type"] == "error" and f"at most {string_limit('worker_id')}" in answer["reason"]
    answer = _answer(raw, [_envelope("goodbye", {"reason": huge})])
    assert answer["type"] == "error" and process.poll() is None
    honest.still_served()
    log = os.path.join(config.run_dir, "logs", "buffer.log")
    assert not os.path.exists(log) or os.path.getsize(log) < 1 << 20


# --------------------------------------------------------------------------- the codec alone

def _frames():
    """Frames of a valid samples message, then mutated: wrapped, negative and huge dimensions,
    dtype, shape and frame mismatches, deep nesting, huge strings, wrong types per field."""
    valid = [bytes(frame) for frame in encode("samples", *pack_samples(_generated(0, 2)), msg_id=3)]
    envelope = msgpack.unpackb(valid[0])
    dimension = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.sampled_from([2 ** 32, 2 ** 63, 2 ** 64 - 1, -1, 0]),
                          st.text(max_size=3), st.none(), st.floats())
    value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64 - 1), st.floats(),
                                   st.text(max_size=20), st.binary(max_size=20)),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=10)

    @st.composite
    def mutated(draw):
        mutation = draw(st.sampled_from(["shape", "dtype", "frames", "field", "nesting", "string", "bytes"]))
        copy = json.loads(json.dumps(envelope, default=lambda b: b.decode("latin-1")))
        frames = list(valid)
        if mutation == "shape":
            spec = draw(st.sampled_from(copy["tensors"]))
            spec[2] = draw(st.lists(dimension, min_size=0, max_size=40))
        elif mutation == "dtype":
            draw(st.sampled_from(copy["tensors"]))[1] = draw(st.sampled_from(["float64", "object", "V8", "<U4", "x"]))
        elif mutation == "frames":
            cut = draw(st.integers(1, len(frames)))
            frames = frames[:cut] + draw(st.lists(st.binary(max_size=64), max_size=3))
        elif mutation == "field":
            copy["fields"][draw(st.sampled_from(sorted(copy["fields"])))] = draw(value)
        elif mutation == "nesting":
            copy[draw(st.sampled_from(["schema", "type", "id", "fields", "tensors"]))] = _nested(
                draw(st.integers(900, 1100)))
        elif mutation == "string":
            copy["fields"]["sample_ids"] = ["y" * draw(st.integers(1, 1 << 20))] * 2
        else:
            data = bytearray(frames[0])
            for _ in range(draw(st.integers(1, 8))):
                data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
            return [bytes(data), *frames[1:]]
        try:
            packed = msgpack.packb(copy)
        except (ValueError, OverflowError, TypeError):  # a value msgpack cannot hold: garbage bytes instead
            packed = b"\xc1" + bytes(10)
        return [packed, *frames[1:]]

    return mutated()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(frames=_frames())
def test_every_bad_message_is_a_protocol_error_within_a_time_and_memory_bound(frames):
    """Whatever the frames, decode gives a message or raises ProtocolError (never another error, which
    a receive loop would not catch), within 1 s and without holding more than the frames' size."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    try:
        message = decode(frames, DEFAULT_MAX_FRAME_BYTES)
    except ProtocolError as error:
        assert len(str(error)) < 2000
    else:
        assert message.type in MESSAGES
    assert time.perf_counter() - started < 1.0
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024 + 4 * sum(len(frame) for frame in frames) // 1024


def test_an_honest_message_at_every_string_bound_still_decodes():
    """The bounds refuse what no tether process sends: a sample's whole conversation and a stopping
    role's reason at their bound still travel."""
    samples = _generated(0, 1)
    samples[0].messages = json.dumps([{"role": "user", "content": "z" * (string_limit("messages") - 100)}])
    assert decode(encode("samples", *pack_samples(samples))).fields["messages"] == [samples[0].messages]
    reason = "r" * string_limit("reason")
    assert decode(encode("goodbye", {"reason": reason})).fields["reason"] == reason
    with pytest.raises(ProtocolError, match=f"at most {string_limit('reason')} characters"):
        encode("goodbye", {"reason": reason + "r"})
