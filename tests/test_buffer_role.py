"""The buffer role over real ZeroMQ sockets: credits, dispatch, batches, weights, stop; bad
messages refused while it keeps serving."""

import time

import msgpack
import numpy as np
import pytest
import zmq

from common.runlog import read_metrics
from protocol.codec import decode
from protocol.samples import pack_samples, unpack_samples
from protocol.schema import SCHEMA_VERSION
from protocol.transport import BufferClient, BufferUnreachable, RemoteError
from tests.helpers import buffer_process, random_sample, start_buffer

pytestmark = pytest.mark.buffer_overrides("buffer.max_staleness=0", "transport.max_frame_bytes=65536")


def client(config, role):
    c = BufferClient(config.buffer_address, role, "0")
    welcome = c.connect(retries=20, interval_s=0.5)
    assert welcome.fields["batch_size"] == 2 and welcome.fields["max_staleness"] == config.buffer.max_staleness
    return c


def test_buffer_serves_a_synchronous_step_and_stops_everyone(buffer_role):
    config, result, thread = buffer_role
    rollout, scorer, learner = client(config, "rollout"), client(config, "scorer"), client(config, "learner")

    grant = rollout.request("credit_request", {"policy_version": 0, "wanted": 10})
    assert grant.fields["credits"] == 2 and grant.fields["prompt_indices"] == [0, 1] and grant.fields["stop"] is False
    late = BufferClient(config.buffer_address, "rollout", "1")  # a second engine of the pool
    assert late.connect(5, 1.0).type == "welcome"
    samples = [random_sample(0), random_sample(1)]
    for s in samples:
        s.behavior_version = s.last_behavior_version = 0
    assert rollout.request("samples", *pack_samples(samples)).fields["accepted"] == 2

    work = unpack_samples(scorer.request("score_request", {"max_samples": 8}))
    assert [s.sample_id for s in work] == ["s0", "s1"]
    for s in work:
        s.ref_logprobs = np.full(len(s.response_tokens), -1.5, np.float32)
        s.reward = 0.25
    assert scorer.request("scored", *pack_samples(work, scored=True)).fields["accepted"] == 2

    batch = unpack_samples(learner.request("batch_request", {"policy_version": 0, "batch_size": 2, "max_staleness": 0}))
    assert [s.sample_id for s in batch] == ["s0", "s1"]
    np.testing.assert_array_equal(batch[0].ref_logprobs, np.full(4, -1.5, np.float32))
    np.testing.assert_array_equal(batch[1].response_tokens, samples[1].response_tokens)

    # k = 0: no more credits for version 0 weights; the request is held, not answered
    with pytest.raises(TimeoutError):
        rollout.request("credit_request", {"policy_version": 0, "wanted": 10}, timeout_s=0.5)
    manifest = {"policy_version": 1, "buckets": [{"index": 0, "nbytes": 8, "checksum": "ab", "path": "/dev/shm/b0",
                                           "tensors": [["w", "float32", [2], 0]]}]}
    with pytest.raises(Exception, match="published as 2"):
        learner.request("weights_published", {"policy_version": 2, "weights_manifest": manifest})
    learner.request("weights_published", {"policy_version": 1, "weights_manifest": manifest})
    grant = rollout.request("credit_request", {"policy_version": 1, "wanted": 10})
    assert grant.fields["credits"] == 1 and grant.fields["policy_version"] == 1  # two engines: a share each
    assert grant.fields["prompt_indices"] == [2]  # the stream goes on, never repeating a prompt
    assert late.request("credit_request", {"policy_version": 1, "wanted": 10}).fields["prompt_indices"] == [3]
    assert grant.fields["weights_manifest"] == manifest

    learner.request("finish", {"policy_version": 1})
    # what an engine says after the learner finished: a load that failed because the learner's weights
    # went with it is expected (0: not counted against the engine), and samples are counted, not trained
    refusal = {"policy_version": 1, "failures": 1, "reason": "slot 0 does not exist"}
    assert rollout.request("weights_refused", refusal).fields["accepted"] == 0
    late_samples = [random_sample(2)]
    late_samples[0].behavior_version = late_samples[0].last_behavior_version = 1
    assert rollout.request("samples", *pack_samples(late_samples)).fields["accepted"] == 0
    assert rollout.request("credit_request", {"policy_version": 1, "wanted": 10}).fields["stop"] is True
    assert scorer.request("score_request", {"max_samples": 8}).fields["stop"] is True
    assert late.request("credit_request", {"policy_version": 1, "wanted": 1}).fields["stop"] is True
    # everyone was told to stop: what is already on its way is still taken in and counted
    late_samples[0].sample_id = "s3"
    assert rollout.request("samples", *pack_samples(late_samples), timeout_s=5).fields["accepted"] == 0
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert result["trained"] == 2 and result["generated"] == 4 and result["identity_holds"]
    assert result["dropped"] == {"after_finish": 2} and result["staleness_violations"] == 0
    final = read_metrics(config.run_dir, "buffer")[-1]  # the buffer's last record is its final state
    assert (final["step"], final["generated"], final["trained"]) == (1, result["generated"], result["trained"])


def _generated(*indices: int, version: int = 0) -> list:
    samples = [random_sample(i) for i in indices]
    for sample in samples:
        sample.behavior_version = sample.last_behavior_version = version
    return samples


def _scored(work: list) -> list:
    for sample in work:
        sample.ref_logprobs = np.full(len(sample.response_tokens), -1.0, np.float32)
        sample.reward = 1.0
    return work


@pytest.mark.buffer_overrides("buffer.max_staleness=1", "transport.max_frame_bytes=65536", "placement.mode=colocate",
                              "placement.shift_deadline_s=2")
def test_colocated_roles_work_in_shifts_and_a_shift_past_its_deadline_is_refused(buffer_role):
    """placement.mode colocate: generate, score and train one after the other, each shift granted by
    the buffer's own answers; an engine that keeps its shift past placement.shift_deadline_s is
    refused, and what it held goes back to the pool."""
    config, result, thread = buffer_role
    rollout, scorer, learner = client(config, "rollout"), client(config, "scorer"), client(config, "learner")
    held_batch = learner.send("batch_request", {"policy_version": 0, "batch_size": 2, "max_staleness": 1})
    held_work = scorer.send("score_request", {"max_samples": 8})
    assert rollout.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["prompt_indices"] == [0, 1]
    assert rollout.request("samples", *pack_samples(_generated(0, 1))).fields["accepted"] == 2
    # the engine holds the devices until it says it ran dry: its samples wait unscored meanwhile
    assert scorer.reply_to(held_work, "score_request", 0.5) is None

    assert rollout.request("shift_end", {"policy_version": 0}).fields["accepted"] == 1
    work = scorer.wait(held_work)
    assert [sample.sample_id for sample in unpack_samples(work)] == ["s0", "s1"]
    # k = 1 allows a second batch of credits, but not while the scorer holds the devices
    held_credits = rollout.send("credit_request", {"policy_version": 0, "wanted": 2})
    assert rollout.reply_to(held_credits, "credit_request", 0.5) is None
    assert learner.reply_to(held_batch, "batch_request", 0.1) is None
    assert scorer.request("scored", *pack_samples(_scored(unpack_samples(work)), scored=True)).fields["accepted"] == 2
    # scored: the batch goes first (training), and the credits wait for its weights
    assert [sample.sample_id for sample in unpack_samples(learner.wait(held_batch))] == ["s0", "s1"]
    assert rollout.reply_to(held_credits, "credit_request", 0.5) is None
    manifest = {"policy_version": 1, "buckets": [{"index": 0, "nbytes": 8, "checksum": "ab", "path": "/dev/shm/b0",
                                                  "tensors": [["w", "float32", [2], 0]]}]}
    learner.request("weights_published", {"policy_version": 1, "weights_manifest": manifest})
    grant = rollout.wait(held_credits)
    assert grant.fields["prompt_indices"] == [2, 3] and grant.fields["policy_version"] == 1

    # this engine keeps the devices past the deadline: named, its credits and prompts go back,
    # and its late shift_end is refused, as is any other grant (it stops; a new process starts clean)
    time.sleep(2.5)
    with pytest.raises(RemoteError, match=r"rollout:0 held the generate shift for \ds, past placement.shift_deadline_s"):
        rollout.request("shift_end", {"policy_version": 1})
    with pytest.raises(RemoteError, match="past placement.shift_deadline_s"):
        rollout.request("credit_request", {"policy_version": 1, "wanted": 2})
    rollout.close()  # the engine the shift ended exits; its restart says hello
    restarted = BufferClient(config.buffer_address, "rollout", "0")
    restarted.connect(retries=5, interval_s=0.5)
    regrant = restarted.request("credit_request", {"policy_version": 1, "wanted": 2})
    assert regrant.fields["prompt_indices"] == [2, 3]  # the prompts it never generated, to the new process
    assert restarted.request("shift_end", {"policy_version": 1}).fields["accepted"] == 0  # it owes them
    assert restarted.request("samples", *pack_samples(_generated(2, 3, version=1))).fields["accepted"] == 2
    learner.request("finish", {"policy_version": 1})
    # after the last step no shift holds anything back: what is left is scored (counted, never trained)
    # although the engine never ended its shift
    assert len(unpack_samples(scorer.request("score_request", {"max_samples": 8}))) == 2
    assert restarted.request("credit_request", {"policy_version": 1, "wanted": 2}).fields["stop"] is True
    assert scorer.request("score_request", {"max_samples": 8}).fields["stop"] is True
    thread.join(timeout=10)
    assert result["identity_holds"] and result["credits_returned"] == 2
    assert read_metrics(config.run_dir, "buffer")[-1]["shifts_generate"] == 3


@pytest.mark.buffer_overrides("buffer.max_staleness=1", "placement.mode=colocate", "placement.shift_deadline_s=60")
def test_a_colocated_engine_that_says_goodbye_holds_its_shift_until_its_restart_says_hello(buffer_role):
    """Colocated, an engine that stops on an error says goodbye with its engine still on the devices:
    the scorer's shift waits for the restart's hello (its old process is gone by then), not for
    placement.shift_deadline_s."""
    config, result, thread = buffer_role
    rollout, scorer, learner = client(config, "rollout"), client(config, "scorer"), client(config, "learner")
    held_work = scorer.send("score_request", {"max_samples": 8})
    assert rollout.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["prompt_indices"] == [0, 1]
    assert rollout.request("samples", *pack_samples(_generated(0, 1))).fields["accepted"] == 2
    rollout.goodbye(RuntimeError("the engine died"))
    assert scorer.reply_to(held_work, "score_request", 1.0) is None  # the devices are not free yet
    restarted = BufferClient(config.buffer_address, "rollout", "0")
    restarted.connect(retries=5, interval_s=0.5)
    work = scorer.reply_to(held_work, "score_request", 5.0)
    assert work is not None and [sample.sample_id for sample in unpack_samples(work)] == ["s0", "s1"]
    learner.request("finish", {"policy_version": 0})
    assert restarted.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["stop"] is True
    assert scorer.request("score_request", {"max_samples": 8}).fields["stop"] is True
    thread.join(timeout=10)
    assert not thread.is_alive() and result["identity_holds"]


def test_bad_messages_are_refused_and_the_buffer_keeps_serving(buffer_role):
    config, result, thread = buffer_role
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(config.buffer_address)
    bad_messages = [
        [b"garbage"],
        [msgpack.packb({"schema": 0, "type": "hello", "id": 1, "fields": {}, "tensors": []})],
        [msgpack.packb({"schema": SCHEMA_VERSION, "type": "samples", "id": 2, "fields": {}, "tensors": []})],
        [msgpack.packb({"schema": SCHEMA_VERSION, "type": "ack", "id": 3, "fields": {"accepted": 1},
                        "tensors": [["x", "uint8", [70_000]]]}), b"\0" * 70_000],
    ]
    reasons = []
    for frames in bad_messages:
        raw.send_multipart(frames)
        assert raw.poll(5000)
        reply = decode(raw.recv_multipart())
        assert reply.type == "error"
        reasons.append(reply.fields["reason"])
    assert "not valid msgpack" in reasons[0]
    assert f"schema version 0, this process speaks {SCHEMA_VERSION}" in reasons[1]
    assert "missing field" in reasons[2]
    assert "frame 1 has 70000 bytes, over the limit of 65536" in reasons[3]
    raw.close()
    # a sample batch whose lengths do not add up: refused by the buffer, which keeps serving
    learner, rollout = client(config, "learner"), client(config, "rollout")
    fields, tensors = pack_samples([random_sample(0)])
    fields["response_lengths"] = [99]
    with pytest.raises(Exception, match="response_tokens has shape"):
        rollout.request("samples", fields, tensors)
    learner.request("finish", {"policy_version": 0})
    assert rollout.request("credit_request", {"policy_version": 0, "wanted": 1}).fields["stop"]  # everyone told: it exits
    thread.join(timeout=10)
    assert result["refused_messages"] == 5


def test_a_role_without_a_buffer_gives_up_with_a_clear_message(tmp_path):
    c = BufferClient(f"ipc://{tmp_path}/nobody", "rollout", "0")
    with pytest.raises(BufferUnreachable, match=f"buffer at ipc://{tmp_path}/nobody did not answer after 2 tries"):
        c.connect(retries=2, interval_s=0.2)


def test_a_scorer_that_goes_silent_with_work_is_named(tmp_path):
    import json
    import time

    config, _, thread = start_buffer(tmp_path, "buffer.stall_warn_s=0.5", "buffer.max_staleness=0")
    rollout, scorer, learner = client(config, "rollout"), client(config, "scorer"), client(config, "learner")
    rollout.request("credit_request", {"policy_version": 0, "wanted": 2})
    samples = [random_sample(0), random_sample(1)]
    for s in samples:
        s.behavior_version = s.last_behavior_version = 0
    assert rollout.request("samples", *pack_samples(samples)).fields["accepted"] == 2
    with pytest.raises(TimeoutError):  # held at the buffer: the rollout waits, it is not stuck
        rollout.request("credit_request", {"policy_version": 0, "wanted": 2}, timeout_s=0.3)
    scorer.request("score_request", {"max_samples": 8})  # takes the work, then goes silent
    time.sleep(3.0)
    learner.request("finish", {"policy_version": 0})
    assert scorer.request("score_request", {"max_samples": 8}).fields["stop"]  # the last one to be told
    thread.join(timeout=40)
    with open(tmp_path / "run" / "metrics" / "buffer.jsonl") as file:
        stalled = [json.loads(line)["stalled"] for line in file]
    assert any("scorer:0" in names for names in stalled)
    assert not any("rollout:0" in names for names in stalled)


def test_each_message_is_taken_only_from_the_role_that_may_send_it(buffer_role, tmp_path):
    """A client is what its hello says; a scorer cannot end the run or ask for credits, nobody can
    make the buffer write outside the run's checkpoints, a second learner rank cannot talk."""
    config, result, thread = buffer_role
    scorer, learner = client(config, "scorer"), client(config, "learner")
    with pytest.raises(Exception, match="does not take 'finish' from scorer:0"):
        scorer.request("finish", {"policy_version": 0})
    with pytest.raises(Exception, match="does not take 'credit_request' from scorer:0"):
        scorer.request("credit_request", {"policy_version": 0, "wanted": 2})
    target = tmp_path / "elsewhere.snapshot"
    with pytest.raises(Exception, match="inside this run's checkpoint directory"):
        learner.request("snapshot", {"path": str(target), "policy_version": 0})
    with pytest.raises(Exception, match="inside this run's checkpoint directory"):
        learner.request("snapshot", {"path": str(tmp_path / "run" / "checkpoints" / ".." / "escape"),
                                     "policy_version": 0})
    assert not target.exists() and not (tmp_path / "run" / "escape").exists()
    rank1 = BufferClient(config.buffer_address, "learner", "1")
    with pytest.raises(Exception, match="through rank 0 alone"):
        rank1.request("hello", {"role": "learner", "worker_id": "1"}, timeout_s=5)
    with pytest.raises(Exception, match="No such file or directory"):  # a failed write is said, not fatal
        learner.request("snapshot", {"path": str(tmp_path / "run" / "checkpoints" / "state-1.tmp" / "buffer.snapshot"),
                                     "policy_version": 0})
    (tmp_path / "run" / "checkpoints" / "state-1.tmp").mkdir(parents=True)
    learner.request("snapshot", {"path": str(tmp_path / "run" / "checkpoints" / "state-1.tmp" / "buffer.snapshot"),
                                 "policy_version": 0})
    learner.request("finish", {"policy_version": 0})
    assert scorer.request("score_request", {"max_samples": 8}).fields["stop"]
    thread.join(timeout=10)
    assert result["refused_messages"] == 6


def test_an_engine_gone_while_idle_keeps_no_share_of_the_credits_and_a_long_run_name_is_welcome(tmp_path):
    """Two engines say hello; one never asks and is not heard of again. While it may still be there,
    the other holds at most its share of the pool's credits (one of k + 1 = 1 batch of 2); past
    rollout.deadline_s it holds them all. The run's name (its directory's) may be a long one."""
    from protocol.transport import free_port

    run_dir = tmp_path / ("run-" + "x" * 200)  # on TCP: an ipc socket's path under it would be too long
    config, result, thread = start_buffer(tmp_path, "buffer.max_staleness=0", "rollout.deadline_s=1",
                                          f"run_dir={run_dir}", f"transport.buffer_address=tcp://127.0.0.1:{free_port()}")
    idle, alive = client(config, "rollout"), BufferClient(config.buffer_address, "rollout", "1")
    assert alive.connect(retries=20, interval_s=0.5).fields["run_id"] == run_dir.name
    assert alive.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["prompt_indices"] == [0]
    time.sleep(1.5)  # the idle engine is heard of no more
    assert alive.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["prompt_indices"] == [1]
    learner = client(config, "learner")
    learner.request("finish", {"policy_version": 0})
    for each in (idle, alive):
        assert each.request("credit_request", {"policy_version": 0, "wanted": 1}).fields["stop"]
    thread.join(timeout=10)
    assert result["identity_holds"]


def test_an_engine_silent_past_its_deadline_loses_its_prompts_to_the_pool(tmp_path):
    """Two engines started by hand; one takes credits and dies without a word (no restart will
    say hello for it): after rollout.deadline_s its prompts go to the other."""
    config, result, thread = start_buffer(tmp_path, "buffer.max_staleness=0", "rollout.deadline_s=1")
    dead, alive = client(config, "rollout"), BufferClient(config.buffer_address, "rollout", "1")
    alive.connect(retries=20, interval_s=0.5)
    learner = client(config, "learner")
    assert dead.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["prompt_indices"] == [0]
    assert alive.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["prompt_indices"] == [1]
    grant = alive.request("credit_request", {"policy_version": 0, "wanted": 2}, timeout_s=10)  # held until then
    assert grant.fields["prompt_indices"] == [0]
    samples = [random_sample(0), random_sample(1)]
    for s in samples:
        s.behavior_version = s.last_behavior_version = 0
    assert alive.request("samples", *pack_samples(samples)).fields["accepted"] == 2
    late = random_sample(0)
    late.sample_id, late.behavior_version, late.last_behavior_version = "late", 0, 0
    assert dead.request("samples", *pack_samples([late])).fields["accepted"] == 0  # too late: refused
    learner.request("finish", {"policy_version": 0})
    for c in (dead, alive):
        assert c.request("credit_request", {"policy_version": 0, "wanted": 1}).fields["stop"]
    thread.join(timeout=10)
    assert result["dropped"] == {"not_granted": 1} and result["identity_holds"]


def test_a_rollout_or_scorer_that_says_goodbye_gives_back_what_it_held_at_once(tmp_path):
    """Roles started by hand that stop on an error say goodbye: the engine's credits and prompts go
    to the other engine at once (not after rollout.deadline_s, 60 s here), the scorer's samples to
    the other scorer, and the buffer ends without waiting for either to hear "stop"."""
    config, result, thread = start_buffer(tmp_path, "buffer.max_staleness=0", "rollout.deadline_s=60",
                                          "learner.batch_size=2")
    leaving, staying = client(config, "rollout"), BufferClient(config.buffer_address, "rollout", "1")
    staying.connect(retries=20, interval_s=0.5)
    scorers = [BufferClient(config.buffer_address, "scorer", str(i)) for i in (0, 1)]
    for scorer in scorers:
        scorer.connect(retries=20, interval_s=0.5)
    learner = client(config, "learner")
    assert leaving.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["prompt_indices"] == [0]
    assert staying.request("credit_request", {"policy_version": 0, "wanted": 2}).fields["prompt_indices"] == [1]
    leaving.goodbye(RuntimeError("the engine died"))
    asked = time.monotonic()
    grant = staying.request("credit_request", {"policy_version": 0, "wanted": 2}, timeout_s=10)
    assert grant.fields["prompt_indices"] == [0] and time.monotonic() - asked < 5  # at once, not after 60 s
    samples = [random_sample(0), random_sample(1)]
    for s in samples:
        s.behavior_version = s.last_behavior_version = 0
    assert staying.request("samples", *pack_samples(samples)).fields["accepted"] == 2
    work = scorers[0].request("score_request", {"max_samples": 2})
    assert len(unpack_samples(work)) == 2
    scorers[0].goodbye(ValueError("a reward function raised"))
    again = scorers[1].request("score_request", {"max_samples": 2}, timeout_s=10)  # not after scorer.deadline_s
    assert sorted(s.sample_id for s in unpack_samples(again)) == sorted(s.sample_id for s in samples)
    learner.request("finish", {"policy_version": 0})
    for c in (staying, scorers[1]):
        stop = c.request("credit_request" if c is staying else "score_request",
                         {"policy_version": 0, "wanted": 1} if c is staying else {"max_samples": 1})
        assert stop.fields["stop"]
    finished = time.monotonic()
    thread.join(timeout=40)
    assert not thread.is_alive() and time.monotonic() - finished < 10  # no wait for the two that left
    assert result["identity_holds"]


def test_roles_hear_a_dead_or_restarted_buffer_through_heartbeats(tmp_path):
    """`tether launch buffer` killed under roles started by hand: a waiting role says the buffer is
    lost within its deadline instead of waiting forever; a buffer started again for the same run is
    told by its new incarnation: a scorer says hello again and asks again (and is answered), the
    learner, whose batches and versions lived in the dead buffer, stops with the reason."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    import yaml

    from common.config import load_config
    from protocol.transport import BufferLost, Liveness
    from tests.helpers import base_config

    assets = {"policy": "/unused", "reward": "/unused", "prompts": "/unused"}
    raw = base_config(tmp_path, assets)
    raw["learner"] = {"batch_size": 2, "minibatch_size": 1}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_config(str(path))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def start():
        return subprocess.Popen([sys.executable, "-m", "launch.cli", "launch", "buffer", "--config", str(path)],
                                cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def connected(role, liveness):
        c = BufferClient(config.buffer_address, role, "0", liveness=liveness)
        c.connect(retries=60, interval_s=0.5)
        return c

    def wait_in_thread(c, msg_type, fields):
        outcome = {}

        def target():
            try:
                outcome["reply"] = c.request(msg_type, fields)
            except Exception as error:  # what the role would exit with
                outcome["error"] = error

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return outcome, thread

    # 1. killed, and nobody comes back: a deadline, not a hang
    buffer = start()
    try:
        scorer = connected("scorer", Liveness(heartbeat_s=0.2, peer_deadline_s=1.5))
        outcome, thread = wait_in_thread(scorer, "score_request", {"max_samples": 4})
        time.sleep(1.0)  # held: no work yet; the heartbeats are answered
        assert thread.is_alive() and scorer.counters == {"heartbeats_missed": 0, "buffer_restarts": 0}
        buffer.send_signal(signal.SIGKILL)
        buffer.wait()
        thread.join(timeout=10)
        assert not thread.is_alive() and isinstance(outcome["error"], BufferLost)
        assert "answered no heartbeat" in str(outcome["error"]) and "score_request" in str(outcome["error"])
        scorer.close()

        # 2. killed and started again for the same run
        buffer = start()
        scorer = connected("scorer", Liveness(heartbeat_s=0.2, peer_deadline_s=30))
        learner = connected("learner", Liveness(heartbeat_s=0.2, peer_deadline_s=30, reconnect=False))
        first_incarnation = scorer.incarnation
        scored, scorer_thread = wait_in_thread(scorer, "score_request", {"max_samples": 4})
        batch, learner_thread = wait_in_thread(learner, "batch_request", {"policy_version": 0, "batch_size": 2, "max_staleness": 0})
        time.sleep(1.0)
        buffer.send_signal(signal.SIGKILL)
        buffer.wait()
        buffer = start()
        learner_thread.join(timeout=30)
        assert isinstance(batch["error"], BufferLost) and "restarted" in str(batch["error"])
        assert "--resume" in str(batch["error"])
        learner.close()  # its identity (role, worker, pid) is the finisher's
        # the scorer's request, asked again of the new buffer, is held there: a learner's finish answers it
        finisher = connected("learner", Liveness())
        # the finish only once the scorer has said hello to the new buffer and asked again: sent at its
        # restart's first sign, it ended the buffer before the scorer reached it (seen in CI on a loaded box)
        deadline = time.monotonic() + 30
        while scorer.incarnation in (None, first_incarnation) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)  # its request, sent right after the hello, is at the buffer before the finish
        finisher.request("finish", {"policy_version": 0})
        scorer_thread.join(timeout=30)
        assert scored["reply"].fields["stop"] is True and scorer.counters["buffer_restarts"] == 1
        assert buffer.wait(timeout=60) == 0
    finally:
        if buffer.poll() is None:
            buffer.kill()


@pytest.mark.parametrize("number", ["SIGTERM", "SIGHUP"])
def test_a_buffer_stopped_before_the_learner_finished_writes_its_accounting(tmp_path, number):
    """A run that another role ended (an environment failing every episode: the rollout exits 4,
    `tether run` stops the others with SIGTERM) can still be checked against the identity: the
    buffer writes its accounting on a stop signal too, with what ended it, and exits 128 + it."""
    import json
    import signal

    config, buffer = buffer_process(tmp_path)
    try:
        rollout = BufferClient(config.buffer_address, "rollout", "0")
        rollout.connect(retries=60, interval_s=0.5)
        rollout.request("credit_request", {"policy_version": 0, "wanted": 2})
        assert rollout.request("samples", *pack_samples(_generated(0, 1))).fields["accepted"] == 2
        buffer.send_signal(getattr(signal, number))
        assert buffer.wait(timeout=30) == 128 + getattr(signal, number)
    finally:
        if buffer.poll() is None:
            buffer.kill()
    with open(tmp_path / "run" / "metrics" / "buffer_accounting.json") as file:
        report = json.load(file)
    assert report["ended_by"] == number and report["identity_holds"]
    assert (report["generated"], report["trained"], report["in_flight"]) == (2, 0, 2)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the error, as meant
def test_a_buffer_whose_loop_fails_still_writes_its_accounting(tmp_path, monkeypatch):
    import json

    from buffer.state import BufferState

    def fail(self, now):
        raise RuntimeError("a bug in the bookkeeping")

    monkeypatch.setattr(BufferState, "redispatch", fail)
    config, result, thread = start_buffer(tmp_path, "buffer.max_staleness=0")
    thread.join(timeout=10)
    assert not thread.is_alive() and result == {}  # the error went up, past the accounting
    with open(tmp_path / "run" / "metrics" / "buffer_accounting.json") as file:
        report = json.load(file)
    assert report["ended_by"] == "RuntimeError: a bug in the bookkeeping" and report["identity_holds"]
