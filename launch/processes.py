"""A role's process as `tether run` sees it, wherever it runs: its name, its command line, the
handle it is watched and signalled through (``launch.runner.LocalProcess`` on this host,
``launch.ray_cluster.RayProcess`` on a node Ray placed it on), and the stop `tether run` gets.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Protocol

DIST_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ProcessHandle(Protocol):
    """What `tether run` does with a role's process (group)."""
    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def signal(self, number: int) -> None: ...

    def group_alive(self) -> bool: ...


@dataclass
class RoleProcess:
    name: str
    role: str
    worker_index: int
    process: ProcessHandle
    log_path: str
    restarts: int = 0


def role_command(role: str, config_path: str, worker_index: int) -> list[str]:
    """The command line of worker ``worker_index`` of ``role``: ``tether launch`` by this Python."""
    return [sys.executable, "-m", "launch.cli", "launch", role, "--config", config_path,
            "--worker-index", str(worker_index)]


def role_name(role: str, worker_index: int = 0) -> str:
    """The name of a process in logs, metrics and pids.json: ``rollout0``, ``scorer1``, ``learner``."""
    return f"{role}{worker_index}" if role in ("rollout", "scorer") else role


class Stopped(Exception):
    """tether run got SIGINT, SIGTERM or SIGHUP."""

    def __init__(self, number: int) -> None:
        super().__init__(f"got {signal.Signals(number).name}")
        self.signal = number


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
