"""Logging and JSON-lines metrics, the same for every role (the file layout is part of the contract:
``RUN_DIR/metrics/<role>.jsonl``, one JSON object per line with ``step`` and ``time``)."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any

from common.config import STAGES, ConfigError


ANSI = re.compile(r"\x1b\[[0-9;]*m")


class PlainText(logging.Filter):
    """Terminal colour codes out of a record: transformers writes its load report's title in bold
    whatever the output is, which a log file shows as raw escapes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "\x1b[" in record.msg:
            record.msg = ANSI.sub("", record.msg)
        return True


def new_file(path: str, mode: str = "wb"):
    """``path`` opened for writing as a new file of this process's own: whatever stood there (a
    link someone left, pointing outside the run) is removed, never followed (O_NOFOLLOW, O_EXCL)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), mode)


def setup_logging(role: str, level: str = "INFO", libraries: bool = True) -> logging.Logger:
    """The process's log: a line a record, with the time and the role, on stderr. With ``libraries``
    (a role that loads models), transformers' records come through the same lines (its own handler
    off), its colour codes stripped."""
    logging.basicConfig(
        level=getattr(logging, level),
        format=f"%(asctime)s {role:>8} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(PlainText())
    if libraries:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_default_handler()
        transformers_logging.enable_propagation()
    return logging.getLogger(role)


class MetricsWriter:
    """Appends one JSON object per record to ``RUN_DIR/metrics/<name>.jsonl``, flushed each write
    so a crash loses at most the record being written, and the numeric values as TensorBoard
    scalars under ``RUN_DIR/tensorboard/<name>`` (tag ``<name>/<key>``, the record's step and
    wall time)."""

    def __init__(self, run_dir: str, name: str, tensorboard: bool = True) -> None:
        directory = os.path.join(run_dir, "metrics")
        os.makedirs(directory, exist_ok=True)
        self.name = name
        self.path = os.path.join(directory, f"{name}.jsonl")
        self.file = open(self.path, "a", buffering=1)
        self.records = 0
        self.board = None
        if tensorboard:
            from tensorboard.summary import Writer

            self.board = Writer(os.path.join(run_dir, "tensorboard", name))
            self.board_flushed = 0.0

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        self.file.write(json.dumps(record, default=float) + "\n")
        if self.board is not None:
            step = int(record.get("step", self.records))
            for key, value in record.items():
                if key not in ("time", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.board.add_scalar(f"{self.name}/{key}", float(value), step=step, wall_time=record["time"])
            # each flush costs milliseconds on a loaded box; TensorBoard can lag a second, the JSONL can't
            if time.monotonic() - self.board_flushed >= 1.0:
                self.board.flush()
                self.board_flushed = time.monotonic()
        self.records += 1

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def metrics_writer(config, name: str) -> MetricsWriter:
    """A role's writer of ``config`` (a TetherConfig): TensorBoard where ``metrics.trackers`` has it."""
    return MetricsWriter(config.run_dir, name, tensorboard="tensorboard" in config.metrics.trackers)


def read_metrics(run_dir: str, name: str) -> list[dict[str, Any]]:
    """The records of a role's ``metrics/<name>.jsonl``, whole lines only: a role may be appending
    as this reads (`tether run` reads the learner's every half second), and a read can see part of
    a line being written (seen: `tether run` failing on "Expecting ',' delimiter" mid-run); that
    line is read the next time, whole."""
    path = os.path.join(run_dir, "metrics", f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as file:
        text = file.read()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def process_start_time(pid: int | None = None) -> float:
    """When a process started, in seconds since the epoch (``time.time()``'s clock): from
    /proc, so the interpreter's own start-up and imports count. Elsewhere: now."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as file:
            started_ticks = int(file.read().rsplit(")", 1)[1].split()[19])  # field 22, after the name
        with open("/proc/stat") as file:
            boot_time = next(int(line.split()[1]) for line in file if line.startswith("btime"))
        return boot_time + started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


class StartupTimeline:
    """A process's start-up, phase by phase, appended to ``RUN_DIR/metrics/startup.jsonl`` (one
    file for every role: ``tether profile`` lays them side by side). ``phase(name)`` closes the
    phase that ran since the previous one (the first since the process started) with that name;
    each record is ``{"role", "phase", "start", "end"}`` in ``time.time()`` seconds. A line is one
    small append, so the roles' writes do not interleave."""

    FILE = "startup.jsonl"

    def __init__(self, run_dir: str, name: str) -> None:
        self.path = os.path.join(run_dir, "metrics", self.FILE)
        self.name = name
        self.last = process_start_time()

    def phase(self, phase: str) -> float:
        """Close the phase ``phase``; returns its seconds."""
        now = time.time()
        record = {"role": self.name, "phase": phase, "start": self.last, "end": now}
        if os.environ.get("TETHER_NODE"):  # the Ray node `tether run --ray` placed this process on
            record["node"] = os.environ["TETHER_NODE"]
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")
        seconds, self.last = now - self.last, now
        return seconds


def stage_files(name: str) -> set[str]:
    """The run-directory entries a stage owns (kept when a PPO run there is replaced)."""
    if name not in STAGES:
        raise ConfigError(f"unknown stage {name!r}")
    return {os.path.join("metrics", f"{name}.jsonl"), os.path.join("tensorboard", name),
            os.path.join("logs", f"{name}.log")}
