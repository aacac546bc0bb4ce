"""What a tether process's exit code says, named once: `tether launch` and the other commands exit
with these, `tether run` reads them (a config error is not worth a restart)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the role failed: a rollout whose engine needs a restart, a buffer that cannot be reached
    CONFIG_ERROR = 2  # a bad config, model, data file or argument: a restart would be refused the same way
    TRAINING_STOPPED = 3  # the learner stopped on a NaN loss or non-finite gradients, its last good weights saved


def signalled(number: int) -> int:
    """The exit code of a process stopped by signal ``number``, as a shell reports it: 128 + the number."""
    return 128 + number
