"""Single responses, the simple case of an episode: one vLLM request per prompt, whose
``samples_per_prompt`` completions are the prompt's group, with no environment to answer them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.images import pack_images
from protocol.samples import Sample


@dataclass
class Generating:
    """A prompt in the engine: its place in the prompt stream, its row in the data file, and the
    policy version its first token was generated with (the oldest: weights may change before it ends)."""
    prompt_index: int
    data_row: int
    version: int
    images: list[bytes] | None = None  # its prompt's, encoded (a policy that sees)


def to_samples(outputs, generating: list[Generating], last_version: int) -> list[Sample]:
    """Samples of finished vLLM requests (a group of ``samples_per_prompt`` each), ``generating[i]``
    saying what ``outputs[i]`` was; ``last_version``: the weights the engine holds now, which
    generated each request's last token. Their ``sample_id`` is left to the sender."""
    samples = []
    for request, prompt in zip(outputs, generating):
        for completion in request.outputs:
            tokens = list(completion.token_ids)
            logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
            samples.append(Sample(
                sample_id="",
                prompt_index=prompt.prompt_index,
                behavior_version=prompt.version,
                last_behavior_version=last_version,
                prompt_tokens=np.asarray(request.prompt_token_ids, dtype=np.int32),
                response_tokens=np.asarray(tokens, dtype=np.int32),
                behavior_logprobs=np.asarray(logprobs, dtype=np.float32),
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                data_row=prompt.data_row,
                images=pack_images(prompt.images) if prompt.images else None,
            ))
    return samples


class Responses:
    """What the rollout's loop drives, in the simple case (``rollout.episodes.Episodes`` is the
    other): prompts ``start``, requests come out of ``take_ready``, each finished request goes to
    ``turn_finished``, and ``finished`` hands over the samples."""

    def __init__(self, prompts: list[list[int]], data_rows: list[int], sampling,
                 images: list[list[bytes]] | None = None) -> None:
        self.prompts, self.data_rows, self.sampling = prompts, data_rows, sampling
        self.images = images  # each kept prompt's images (a policy that sees), else None
        self.ready: list[tuple[int, int]] = []  # (prompt index, row of the kept prompts)
        self.generating = 0
        self.done: list[Sample] = []

    def start(self, prompt_index: int, row: int) -> None:
        self.ready.append((prompt_index, row))

    @property
    def active(self) -> int:
        return len(self.ready) + self.generating

    def take_ready(self, version: int) -> list[tuple[Generating, list[int], object]]:
        """(what the request is, its prompt ids, its sampling) for each prompt to add to the engine."""
        ready, self.ready = self.ready, []
        self.generating += len(ready)
        return [(Generating(index, self.data_rows[row], version, self.images[row] if self.images else None),
                 self.prompts[row], self.sampling) for index, row in ready]

    def turn_finished(self, generating: Generating, output, version: int) -> None:
        self.generating -= 1
        self.done += to_samples([output], [generating], version)

    def advance(self, now: float, timeout: float = 0.0) -> None:
        """Nothing to wait on: no environment answers a single response."""

    def finished(self) -> tuple[list[Sample], list[tuple[int, str]]]:
        done, self.done = self.done, []
        return done, []

    def record(self) -> dict:
        return {}

    def close(self) -> None:
        pass  # nothing runs outside the engine
