"""A sample as it travels rollout -> buffer -> scorer -> buffer -> learner, and its ragged packing.

Samples of different lengths travel as one message: token ids and logprobs of every sample
concatenated into one flat tensor each, with the per-sample lengths as fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.codec import Message, ProtocolError


@dataclass(eq=False)
class _Chunk:
    """The flat tensors of one received message, which its samples view into."""
    tensors: dict[str, np.ndarray]
    prompt_ends: np.ndarray  # cumulative prompt lengths
    response_ends: np.ndarray  # cumulative response lengths


@dataclass
class Sample:
    sample_id: str
    prompt_index: int
    behavior_version: int  # policy version of the weights that generated it: the oldest, if they changed meanwhile
    prompt_tokens: np.ndarray  # [prompt_len] int32
    response_tokens: np.ndarray  # [resp_len] int32
    behavior_logprobs: np.ndarray  # [resp_len] float32, from the rollout engine
    finish_reason: str  # "stop" (end-of-sequence) or "length" (hit max_new_tokens)
    ref_logprobs: np.ndarray | None = None  # [resp_len] float32, from the scorer
    score: float | None = None  # from the scorer: the reward model's plus the reward functions' (the trained one)
    gold_score: float | None = None  # from the scorer's rule-based reward, where the task has one
    # where a received sample's arrays lie, so consecutive samples of one message are re-sent as
    # one slice rather than concatenated one by one (a 512-sample batch: 1.5 ms -> well under)
    data_row: int = -1  # the prompt's row in the data file (``prompt_index`` is its place in the stream)
    # the version that generated its last token: newer than behavior_version when the weights changed
    # while it was generated (a streaming rollout loads them between engine steps); None: the same
    last_behavior_version: int | None = None
    chunk: _Chunk | None = field(default=None, repr=False, compare=False)
    row: int = field(default=-1, repr=False, compare=False)

    @property
    def newest_version(self) -> int:
        """The newest policy version among the weights that generated it."""
        return self.behavior_version if self.last_behavior_version is None else self.last_behavior_version

    @property
    def scored(self) -> bool:
        return self.ref_logprobs is not None and self.score is not None


_PROMPT_TENSORS = ("prompt_tokens",)
_RESPONSE_TENSORS = ("response_tokens", "behavior_logprobs", "ref_logprobs")
_DTYPES = {"prompt_tokens": "int32", "response_tokens": "int32", "behavior_logprobs": "float32",
           "ref_logprobs": "float32"}


def _runs(samples: list[Sample]) -> list[tuple[int, int]]:
    """[start, stop) index ranges of consecutive rows of one received message (or single samples)."""
    runs, start = [], 0
    for i in range(1, len(samples) + 1):
        if (i == len(samples) or samples[i].chunk is None or samples[i].chunk is not samples[i - 1].chunk
                or samples[i].row != samples[i - 1].row + 1):
            runs.append((start, i))
            start = i
    return runs


def _flat_tensor(samples: list[Sample], runs: list[tuple[int, int]], name: str) -> np.ndarray:
    """One flat tensor of attribute ``name`` of every sample: a run of one message's rows whose
    arrays still view that message is sliced in one piece; anything else is copied sample by sample."""
    pieces = []
    ends_name = "prompt_ends" if name in _PROMPT_TENSORS else "response_ends"
    for start, stop in runs:
        chunk = samples[start].chunk
        source = chunk.tensors.get(name) if chunk is not None else None
        # numpy points every view at the object that owns the memory: the message's frame
        owner = source if source is None or source.base is None else source.base
        if source is not None and all(getattr(s, name).base is owner for s in samples[start:stop]):
            ends = getattr(chunk, ends_name)
            first, last = samples[start].row, samples[stop - 1].row
            pieces.append(source[(int(ends[first - 1]) if first > 0 else 0):int(ends[last])])
        else:
            pieces.extend(getattr(s, name) for s in samples[start:stop])
    dtype = _DTYPES[name]
    return np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype)


def pack_samples(samples: list[Sample], scored: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Fields and flat tensors for a ``samples``/``score_work``/``scored``/``batch`` message."""
    fields = {
        "sample_ids": [s.sample_id for s in samples],
        "prompt_indices": [s.prompt_index for s in samples],
        "data_rows": [s.data_row for s in samples],
        "behavior_versions": [s.behavior_version for s in samples],
        "last_behavior_versions": [s.newest_version for s in samples],
        "prompt_lengths": [len(s.prompt_tokens) for s in samples],
        "response_lengths": [len(s.response_tokens) for s in samples],
        "finish_reasons": [s.finish_reason for s in samples],
    }
    names = ["prompt_tokens", "response_tokens", "behavior_logprobs"]
    if scored:
        unscored = [s.sample_id for s in samples if not s.scored]
        if unscored:
            raise ValueError(f"samples {unscored[:5]} are not scored")
        names.append("ref_logprobs")
    runs = _runs(samples)
    tensors = {name: _flat_tensor(samples, runs, name) for name in names}
    if scored:
        tensors["scores"] = np.array([s.score for s in samples], dtype=np.float32)
        golds = [s.gold_score for s in samples]
        fields["gold_scores"] = None if any(g is None for g in golds) else [float(g) for g in golds]
    return fields, tensors


def unpack_samples(message: Message) -> list[Sample]:
    """Samples from a decoded message; lengths must add up to the flat tensors exactly."""
    fields, tensors = message.fields, message.tensors
    count = len(fields["sample_ids"])
    for name in ("prompt_indices", "data_rows", "behavior_versions", "last_behavior_versions", "prompt_lengths",
                 "response_lengths", "finish_reasons"):
        if len(fields[name]) != count:
            raise ProtocolError(f"{message.type}: {name} has {len(fields[name])} entries for {count} samples")
    prompt_lengths, response_lengths = fields["prompt_lengths"], fields["response_lengths"]
    if any(n < 1 for n in prompt_lengths) or any(n < 1 for n in response_lengths):
        raise ProtocolError(f"{message.type}: every sample needs a prompt and a response of length >= 1")
    for name, lengths in (("prompt_tokens", prompt_lengths), ("response_tokens", response_lengths),
                          ("behavior_logprobs", response_lengths), ("ref_logprobs", response_lengths)):
        if name in tensors and tensors[name].shape != (sum(lengths),):
            raise ProtocolError(f"{message.type}: {name} has shape {tensors[name].shape}, lengths add to {sum(lengths)}")
    if any(last < first for first, last in zip(fields["behavior_versions"], fields["last_behavior_versions"])):
        raise ProtocolError(f"{message.type}: a sample's last_behavior_version is older than its behavior_version")
    scores = tensors.get("scores")
    gold_scores = fields.get("gold_scores")
    if gold_scores is not None and len(gold_scores) != count:
        raise ProtocolError(f"{message.type}: gold_scores has {len(gold_scores)} entries for {count} samples")
    if scores is not None and scores.shape != (count,):
        raise ProtocolError(f"{message.type}: scores has shape {scores.shape} for {count} samples")
    for name in ("behavior_logprobs", "ref_logprobs", "scores"):
        if name in tensors and not np.isfinite(tensors[name]).all():
            raise ProtocolError(f"{message.type}: {name} holds NaN or inf")

    prompt_ends, response_ends = np.cumsum(prompt_lengths), np.cumsum(response_lengths)
    chunk = _Chunk(tensors, prompt_ends, response_ends)
    samples = []
    for i in range(count):
        p0, p1 = prompt_ends[i] - prompt_lengths[i], prompt_ends[i]
        r0, r1 = response_ends[i] - response_lengths[i], response_ends[i]
        samples.append(Sample(
            sample_id=fields["sample_ids"][i],
            prompt_index=fields["prompt_indices"][i],
            data_row=fields["data_rows"][i],
            behavior_version=fields["behavior_versions"][i],
            last_behavior_version=fields["last_behavior_versions"][i],
            prompt_tokens=tensors["prompt_tokens"][p0:p1],
            response_tokens=tensors["response_tokens"][r0:r1],
            behavior_logprobs=tensors["behavior_logprobs"][r0:r1],
            finish_reason=fields["finish_reasons"][i],
            ref_logprobs=tensors["ref_logprobs"][r0:r1] if "ref_logprobs" in tensors else None,
            score=float(scores[i]) if scores is not None else None,
            gold_score=gold_scores[i] if gold_scores is not None else None,
            chunk=chunk,
            row=i,
        ))
    return samples
