"""Every message tether sends, declared once.

A message is a msgpack envelope ``{"schema", "type", "id", "fields", "tensors"}`` followed by
one raw ZeroMQ frame per tensor. ``MESSAGES`` says, per message type, which fields it carries
(with their types) and which tensors (with their dtypes); ``protocol.codec.decode`` checks every
received message against it, so a role never sees a message that does not match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.samples import sample_fields, sample_tensors

# 15: a scored sample may carry its teacher_logprobs (models.teacher); 14: a scored sample may
# carry a drop_reason (scorer.on_reward_failure, a judge's on_unparsed: drop_group); 13:
# turn_release renamed shift_end (a device's shift, not a conversation's turn), the agent
# processes' program_* messages (environments.agent_processes, JSON before); 12: goodbye (a
# rollout or scorer stopping on an error); 11: turn_release (placement.mode colocate); 10: samples
# carry their images (image_bytes); 9: an episode's parts (part_indices, ...)
SCHEMA_VERSION = 15
# The version at which a message's fields last changed, for a message that is kept (a batch that
# learner.record_batches wrote): one written at that version or later decodes as it is. (14's
# drop_reasons is optional, and no sample of a batch has one but ""; 15's teacher_logprobs is
# optional: older batches decode.)
UNCHANGED_SINCE = {"batch": 10}

# Field type names the codec knows how to check. A trailing "?" means the value may be None.
FIELD_TYPES = ("int", "float", "str", "bool", "list[int]", "list[str]", "list[float]", "dict", "any")

# The most characters a string field (or each string of a list[str] field) may hold, by the field's
# name: what no tether process sends past, so a 100 MB worker id or reason is refused at decode, never
# held or logged. A sample's conversation (``messages``) is the long one; run_id is the run
# directory's name (a file name: 255); a name not listed: STRING_LIMIT.
STRING_LIMIT = 4096
STRING_LIMITS = {"role": 32, "worker_id": 64, "run_id": 255, "incarnation": 64, "checksum": 128, "sample_ids": 256,
                 "finish_reasons": 64, "reasons": 256, "drop_reasons": 256, "messages": 16 << 20, "key": 256,
                 "body": 1 << 28}


def string_limit(field: str) -> int:
    """The most characters a string of field ``field`` may hold."""
    return STRING_LIMITS.get(field, STRING_LIMIT)


@dataclass(frozen=True)
class MessageSchema:
    fields: dict[str, str] = field(default_factory=dict)
    # name -> dtype ("int32", "float32", ...); a trailing "?": the tensor may be left out
    tensors: dict[str, str] = field(default_factory=dict)


_SAMPLE_FIELDS, _SCORED_FIELDS = sample_fields(scored=False), sample_fields(scored=True)
_SAMPLE_TENSORS, _SCORED_TENSORS = sample_tensors(scored=False), sample_tensors(scored=True)

MESSAGES: dict[str, MessageSchema] = {
    # any role -> buffer: first contact; the reply says the buffer is there and its run id
    "hello": MessageSchema(fields={"role": "str", "worker_id": "str"}),
    # incarnation: this buffer process's own id; a new one means the buffer restarted and lost what it held
    "welcome": MessageSchema(fields={"run_id": "str", "incarnation": "str", "max_staleness": "int",
                                     "batch_size": "int"}),
    # any role -> buffer, while it waits for a held request: are you there? (no hello needed)
    "ping": MessageSchema(),
    "pong": MessageSchema(fields={"run_id": "str", "incarnation": "str"}),
    # rollout -> buffer: how many samples may I generate? (held until credits or new weights exist)
    # policy_version: the version of the weights the engine holds now
    "credit_request": MessageSchema(fields={"policy_version": "int", "wanted": "int"}),
    # buffer -> rollout: generate ``credits`` samples, samples_per_prompt for each prompt index
    # (positions in the run's prompt stream, which the buffer owns: common.prompts); with the
    # newest published policy_version and where its weights lie
    "credits": MessageSchema(
        fields={"credits": "int", "prompt_indices": "list[int]", "policy_version": "int",
                "weights_manifest": "dict?", "stop": "bool"}
    ),
    # rollout -> buffer: the weights of policy_version could not be loaded, ``failures`` times in a row;
    # the engine generates nothing until a load succeeds (the buffer names it among the stalled)
    "weights_refused": MessageSchema(fields={"policy_version": "int", "failures": "int", "reason": "str"}),
    # rollout -> buffer (placement.mode colocate): everything granted is generated and sent, and the
    # devices are free for the next shift (buffer.shifts)
    "shift_end": MessageSchema(fields={"policy_version": "int"}),
    # rollout -> buffer: generated, unscored samples
    "samples": MessageSchema(fields=dict(_SAMPLE_FIELDS), tensors=dict(_SAMPLE_TENSORS)),
    # rollout -> buffer: episodes that end without a sample to send (an environment failed before the
    # policy's first turn, or a member of their group did): one entry each, its credit comes back
    "episodes_dropped": MessageSchema(fields={"prompt_indices": "list[int]", "reasons": "list[str]"}),
    # scorer -> buffer: give me work (held until there is some); buffer -> scorer: the work
    "score_request": MessageSchema(fields={"max_samples": "int"}),
    "score_work": MessageSchema(fields={**_SAMPLE_FIELDS, "stop": "bool"}, tensors=dict(_SAMPLE_TENSORS)),
    # scorer -> buffer: samples with reference logprobs and scores (RM + reward functions)
    "scored": MessageSchema(fields=dict(_SCORED_FIELDS), tensors=dict(_SCORED_TENSORS)),
    # learner -> buffer: a batch for this policy version (held until one is ready)
    "batch_request": MessageSchema(fields={"policy_version": "int", "batch_size": "int", "max_staleness": "int"}),
    "batch": MessageSchema(fields={**_SCORED_FIELDS, "stop": "bool"}, tensors=dict(_SCORED_TENSORS)),
    # learner -> buffer: a new version is written; the manifest says where its buckets lie
    # (weight_sync.buckets.WeightManifest.to_dict) and how to check them
    "weights_published": MessageSchema(fields={"policy_version": "int", "weights_manifest": "dict"}),
    # learner -> buffer: training is over; the buffer tells the other roles to stop
    "finish": MessageSchema(fields={"policy_version": "int"}),
    # learner -> buffer: write your state to ``path`` (part of an atomic checkpoint); policy_version:
    # the learner's, so a batch served for it and never trained goes back with the samples waiting
    "snapshot": MessageSchema(fields={"path": "str", "policy_version": "int"}),
    # learner -> rollouts (PUB): a bucket of a version is written and can be checked
    "weights_bucket_ready": MessageSchema(fields={"policy_version": "int", "buckets_total": "int", "bucket": "dict"}),
    # rollout -> learner's weight server (across hosts): one bucket of a version, as a raw frame
    "weights_fetch": MessageSchema(fields={"policy_version": "int", "bucket": "int"}),
    "weights_bucket": MessageSchema(fields={"policy_version": "int", "bucket": "int", "checksum": "str"},
                                    tensors={"payload": "uint8"}),
    # rollout or scorer -> buffer, its last words when it stops on an error (the buffer never told it
    # to): what it holds goes back to the pool now, and the run's end does not wait for it. No reply
    "goodbye": MessageSchema(fields={"reason": "str"}),
    "ack": MessageSchema(fields={"accepted": "int"}),
    "error": MessageSchema(fields={"reason": "str"}),
    # the rollout <-> a process of its agent programs (environments.agent_processes), over a pipe of
    # their own; ``key`` is the episode's. To the process: run the program on a data row, cancel it
    # (its episode ended first), a call's answer (the endpoint's status and body). From it: a call of
    # the program's to the endpoint, its return (the reward: a number, None or a dict of numbers) or
    # its error ({type, message, traceback, where}; ``deadline``: it ran past agent_deadline_s)
    "program_run": MessageSchema(fields={"key": "str", "row": "dict"}),
    "program_cancel": MessageSchema(fields={"key": "str"}),
    "program_answer": MessageSchema(fields={"key": "str", "id": "int", "status": "int", "answer": "any",
                                            "streamed": "bool"}),
    "program_call": MessageSchema(fields={"key": "str", "id": "int", "path": "str", "body": "str"}),
    "program_return": MessageSchema(fields={"key": "str", "value": "any"}),
    "program_raise": MessageSchema(fields={"key": "str", "error": "dict"}),
}

# Who may send each request to the buffer ("hello" says who one is; everything after is checked
# against it). A learner of several ranks talks through rank 0 alone.
SENDER_ROLES = ("rollout", "scorer", "learner")
SENDERS: dict[str, tuple[str, ...]] = {
    "hello": ("rollout", "scorer", "learner"),
    "ping": ("rollout", "scorer", "learner", ""),  # "": a client the buffer does not know (yet, or any more)
    "credit_request": ("rollout",),
    "weights_refused": ("rollout",),
    "samples": ("rollout",),
    "episodes_dropped": ("rollout",),
    "shift_end": ("rollout",),
    "goodbye": ("rollout", "scorer"),
    "score_request": ("scorer",),
    "scored": ("scorer",),
    "batch_request": ("learner",),
    "weights_published": ("learner",),
    "finish": ("learner",),
    "snapshot": ("learner",),
}
