"""Recording the batches an asynchronous run trained on, and `tether replay`: the learner alone on
them, step for step.

With ``learner.record_batches``, rank 0 writes each batch as the buffer sent it (the message's
frames, the same bytes the codec decodes: sample ids, tokens, behavior logprobs, scores,
reference logprobs, versions) to ``RUN_DIR/batches/batch-<policy version>.frames``. What the
learner does with a batch depends on nothing else that varies between runs: the minibatch shuffle
is seeded by (seed, policy version), the KL controller and reward moments are its own state.
Replay hands the learner those batches through ``RecordedBuffer``, a stand-in for the buffer's
client that answers its requests from the files, and publishes no weights; on the CPU, with the
recorded number of threads, every step's losses and the final weights come out bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import struct

from protocol.codec import Message, decode, encode

MAGIC = b"TBATCH1\n"
RECORDING = "recording.json"  # what replay must reproduce of the learner's process: its torch threads


def batch_path(directory: str, policy_version: int) -> str:
    return os.path.join(directory, f"batch-{policy_version:06d}.frames")


class BatchRecorder:
    """Writes each trained batch (rank 0), each file whole or not at all."""

    def __init__(self, run_dir: str) -> None:
        import torch

        self.directory = os.path.join(run_dir, "batches")
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, RECORDING), "w") as file:
            json.dump({"torch_threads": torch.get_num_threads()}, file)

    def write(self, policy_version: int, reply: Message) -> str:
        frames = [bytes(memoryview(frame)) for frame in encode("batch", reply.fields, reply.tensors)]
        path = batch_path(self.directory, policy_version)
        with open(path + ".tmp", "wb") as file:
            file.write(MAGIC + struct.pack("<I", len(frames)))
            for frame in frames:
                file.write(struct.pack("<Q", len(frame)) + frame)
        os.replace(path + ".tmp", path)
        return path


def read_batch(directory: str, policy_version: int, max_frame_bytes: int) -> Message:
    """The batch recorded for ``policy_version``, decoded and validated as the buffer's reply was."""
    path = batch_path(directory, policy_version)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no recorded batch for policy version {policy_version} ({path}): was "
                                "learner.record_batches on for the steps replayed?")
    with open(path, "rb") as file:
        data = bytearray(file.read())  # writable, as ZeroMQ's frames are: torch warns on a read-only array
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a recorded batch")
    (count,), offset, frames = struct.unpack_from("<I", data, len(MAGIC)), len(MAGIC) + 4, []
    view = memoryview(data)
    for _ in range(count):
        (size,) = struct.unpack_from("<Q", data, offset)
        frames.append(view[offset + 8:offset + 8 + size])
        offset += 8 + size
    return decode(frames, max_frame_bytes, kept=True)


class RecordedBuffer:
    """What the learner's loop asks of its buffer client, answered from a recording: a batch request
    is answered with the batch recorded for its policy version; the rest (weights published, a
    snapshot, finish) needs no answer."""

    def __init__(self, directory: str, max_frame_bytes: int) -> None:
        self.directory, self.max_frame_bytes = directory, max_frame_bytes
        self.counters = {"heartbeats_missed": 0, "buffer_restarts": 0}
        self._requests: dict[int, dict] = {}

    def send(self, msg_type: str, fields: dict | None = None, tensors: dict | None = None) -> int:
        self._requests[len(self._requests) + 1] = dict(fields or {})
        return len(self._requests)

    def reply_to(self, request_id: int, msg_type: str, wait_s: float) -> Message:
        return read_batch(self.directory, self._requests.pop(request_id)["policy_version"], self.max_frame_bytes)

    def request(self, msg_type: str, fields: dict | None = None, tensors: dict | None = None, **_) -> None:
        return None

    def close(self) -> None:
        pass


def replay_config(run_dir: str, out: str, until: int | None, checkpoint: str | None):
    """The recorded run's config for a learner alone in ``out``: to step ``until`` (default: the
    run's last), from ``checkpoint`` (a ``state-N``) if given, recording, evaluating and
    checkpointing nothing."""
    from common.config import ConfigError, load_config

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise ConfigError(f"{run_dir} holds no config.yaml: not a tether run directory")
    if checkpoint is not None and not os.path.exists(os.path.join(checkpoint, "COMPLETE")):
        saved = sorted(name for name in os.listdir(os.path.join(run_dir, "checkpoints"))
                       if name.startswith("state-") and os.path.exists(os.path.join(run_dir, "checkpoints", name,
                                                                                    "COMPLETE"))) \
            if os.path.isdir(os.path.join(run_dir, "checkpoints")) else []
        raise ConfigError(f"--checkpoint {checkpoint} is not a complete state-N directory of a run; this run's are: "
                          f"{', '.join(os.path.join(run_dir, 'checkpoints', name) for name in saved) or 'none'}")
    config = load_config(path, [f"run_dir={out}", "learner.record_batches=false", "learner.checkpoint_every=0",
                                "eval.every=0", f"resume_from={checkpoint if checkpoint else 'null'}"], saved=True)
    if until is not None:
        if not 1 <= until <= config.learner.total_steps:
            raise ConfigError(f"--until {until} is not a step of the run (1..{config.learner.total_steps})")
        config = config.model_copy(update={"learner": config.learner.model_copy(update={"total_steps": until})})
    return config


def compare(run_dir: str, out: str) -> dict:
    """Each replayed step's losses against the recorded run's, and the final weights against its
    ``checkpoints/final`` when the replay went to the run's last step: the largest differences."""
    from common.runlog import read_metrics

    recorded = {r["step"]: r for r in read_metrics(run_dir, "learner") if "policy_loss" in r}
    replayed = [r for r in read_metrics(out, "learner") if "policy_loss" in r]
    keys = ("policy_loss", "value_loss", "kl", "entropy", "approx_kl", "clipfrac")
    loss_gap = 0.0
    for record in replayed:
        original = recorded[record["step"]]
        for key in keys:
            if record.get(key) is not None and original.get(key) is not None:
                loss_gap = max(loss_gap, abs(record[key] - original[key]))
    report = {"steps": [r["step"] for r in replayed], "max_metric_difference": loss_gap, "max_weight_difference": None}
    final, mine = (os.path.join(directory, "checkpoints", "final", "model.safetensors") for directory in (run_dir, out))
    if replayed and replayed[-1]["step"] == max(recorded) and os.path.exists(final) and os.path.exists(mine):
        from safetensors.torch import load_file

        theirs, ours = load_file(final), load_file(mine)
        report["max_weight_difference"] = max((float((ours[k] - theirs[k]).abs().max()) for k in theirs),
                                              default=math.nan)
    return report
