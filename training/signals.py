"""Stopping when asked: SIGTERM or SIGHUP (a scheduler taking the machine back, Ctrl-C's TERM from
``tether run``) is noted, not died of, so training ends at the next point where its state is whole
and checkpoints there; then ``Preempted`` carries the signal out, for the exit code 128 + it. The
PPO learner and the offline stages stop alike.
"""

from __future__ import annotations

import signal

from training import parallel


class Preempted(RuntimeError):
    """SIGTERM or SIGHUP (a scheduler taking the machine back): the learner saved a checkpoint to
    resume from and stopped; ``signal``: the number, for the exit code 128 + it."""

    def __init__(self, message: str, number: int) -> None:
        super().__init__(message)
        self.signal = number


class StopSignal:
    """Notes SIGTERM / SIGHUP instead of dying of it, so the learner ends at the next point where
    its state is whole (between steps, or while it waits for a batch) and checkpoints there."""

    def __init__(self) -> None:
        self.number = 0
        for number in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, self._note)

    def _note(self, number: int, frame) -> None:
        self.number = number

    def requested(self) -> bool:
        """Whether any rank got the signal (every rank calls it at the same point)."""
        return parallel.any_rank(self.number != 0)


def signal_name(number: int) -> str:
    return signal.Signals(number).name
