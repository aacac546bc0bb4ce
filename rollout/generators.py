"""What the rollout's loop drives, whatever makes the tokens: a ``Generator`` turns granted prompts
into engine requests and finished requests into samples. ``rollout.responses.Responses`` (one
request a prompt) and ``rollout.episodes.Episodes`` (turns with an environment's observations
between them, whatever answers them: ``environments.interface.Environment``, agent programs
included) are the two.

``common.engines.InFlight`` is the engine's side of the cycle every driver repeats: add what a
generator has ready, step the engine, hand each finished request back to the generator. The
rollout's loop runs it between credit grants; ``generate_to_end`` runs it alone (the evaluator: no
buffer, one version).
"""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

from common.engines import InFlight
from protocol.samples import Sample

ENVIRONMENT_POLL_S = 0.05  # with nothing in the engine: the longest wait for an environment's answer


@runtime_checkable
class Generator(Protocol):
    """The interface the rollout's loop drives. ``what`` is the generator's own handle on a request
    (a prompt, an episode's turn), given back with the request's output."""

    @property
    def active(self) -> int:
        """Prompts started and not finished: in the engine, ready for it, or waiting on an answer."""

    def start(self, prompt_index: int, row: int) -> None:
        """Prompt ``prompt_index`` of the run's stream (row ``row`` of the kept prompts) begins."""

    def take_ready(self, version: int) -> list[tuple[Any, list[int], Any]]:
        """(what, prompt token ids, sampling params) of each request to add to the engine now, which
        holds policy version ``version``."""

    def turn_finished(self, what: Any, output: Any, version: int) -> None:
        """A request's finished vLLM output; ``version``: the weights that generated its last token."""

    def advance(self, now: float, timeout: float = 0.0) -> None:
        """Take what answered since (an environment's observation), waiting up to ``timeout``."""

    def finished(self) -> tuple[list[Sample], list[tuple[int, str]]]:
        """The samples done since the last call (``sample_id`` left to the sender), and the prompts
        that end without one, each with its reason (their credits go back)."""

    def record(self) -> dict:
        """The generator's own figures for the rollout's metrics record."""

    def close(self) -> None:
        """The run is over: what is under way outside the engine ends (an environment's session)."""


def generate_to_end(engine, generator: Generator, rows: list[int], version: int = 0) -> tuple[list[Sample], int]:
    """Every prompt of the kept prompts at ``rows`` to its end, on a ``vllm.LLM`` of its own (the
    evaluator's: no buffer, no weight changes); ``prompt_index`` is the position in ``rows``.
    Returns the samples, ordered by prompt, and how many prompts could not give one."""
    for index, row in enumerate(rows):
        generator.start(index, row)
    in_flight = InFlight(engine)
    samples, dropped = [], 0
    while generator.active:
        in_flight.add(generator, version)
        if in_flight:
            in_flight.step(generator, version)
        generator.advance(time.monotonic(), timeout=0.0 if in_flight else ENVIRONMENT_POLL_S)
        done, failed = generator.finished()
        samples += done
        dropped += len(failed)
    return sorted(samples, key=lambda sample: sample.prompt_index), dropped
