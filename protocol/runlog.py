"""Logging and JSON-lines metrics, the same for every role (the file layout is part of the contract:
``RUN_DIR/metrics/<role>.jsonl``, one JSON object per line with ``step`` and ``time``)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any


def setup_logging(role: str, level: str = "INFO") -> logging.Logger:
    logging.basicConfig(
        level=getattr(logging, level),
        format=f"%(asctime)s {role:>8} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
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


def read_metrics(run_dir: str, name: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics", f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]
