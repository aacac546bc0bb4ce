"""What a tether process's exit code says, named once: `tether launch` and the other commands exit
with these, `tether run` reads them (a config error is not worth a restart)."""

from __future__ import annotations

import signal
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the role failed: a rollout whose engine needs a restart, a buffer that cannot be reached
    CONFIG_ERROR = 2  # a bad config, model, data file or argument: a restart would be refused the same way
    TRAINING_STOPPED = 3  # the learner stopped on a NaN loss or non-finite gradients, its last good weights saved
    ENVIRONMENT_FAILED = 4  # rollout.env_failure_limit episodes in a row ended by their environment: a restart fails alike


WHY = {ExitCode.FAILED: "the role failed", ExitCode.CONFIG_ERROR: "a config, model or data error",
       ExitCode.TRAINING_STOPPED: "training stopped on a non-finite loss or gradient",
       ExitCode.ENVIRONMENT_FAILED: "the environment failed every episode (rollout.env_failure_limit)"}


# a role's code that `tether run` exits with too when the role ends the run: each tells a scheduler
# more than "failed" (a restart is refused alike: 2, 4; the learner saved its last good weights: 3)
PASSED_ON = (ExitCode.CONFIG_ERROR, ExitCode.TRAINING_STOPPED, ExitCode.ENVIRONMENT_FAILED)


def run_exit_code(role_code: int) -> int:
    """`tether run`'s exit code when a role that exited with ``role_code`` ended the run."""
    return role_code if role_code in PASSED_ON else ExitCode.FAILED


def describe(code: int) -> str:
    """``code`` and what it says, for `tether run`'s report of a role that exited."""
    if code in WHY:
        return f"code {code}: {WHY[ExitCode(code)]}"
    if code < 0:  # what Popen reports for a process a signal ended
        return f"code {code}: ended by signal {signal.Signals(-code).name}"
    return f"code {code}"


def signalled(number: int) -> int:
    """The exit code of a process stopped by signal ``number``, as a shell reports it: 128 + the number."""
    return 128 + number
