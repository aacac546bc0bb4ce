"""``metrics.trackers``: the run where teams already watch runs (Weights & Biases, MLflow, trackio).

Every role writes its records to ``RUN_DIR/metrics/<name>.jsonl`` (and TensorBoard, itself). One
process sends them on: ``tether run`` (or ``tether track RUN_DIR`` beside roles started by hand)
follows every file and each new line goes to one tracker run per tether run, its values under
``<name>/<key>`` against that role's own step (``<name>/step``: the learner's optimizer step, the
rollout's policy version, ...). The config goes with the run; each evaluation's worst cases
(``eval/step-N.jsonl``) go as a table. Roles on other nodes are covered as their records land in
the driver's run directory (``launch.ray_cluster``).

Why one follower and not each role logging itself: a tracker run is opened once, by one process,
the roles import nothing more and wait on no network, and a tracker that fails to start or to
send is one warning, after which the run goes on without it. What was sent is remembered in
``RUN_DIR/trackers.json`` (each run's id, each file's offset), so ``--resume`` continues the same
tracker runs where they stopped.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import threading
import time
import uuid
from typing import Any

from common.config import TetherConfig, dump_config

STATE_FILE = "trackers.json"
SKIPPED = ("startup.jsonl",)  # phases without a step: tether profile's, not a series


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in record.items()
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"learner": {"kl_coef": 0.1}}`` -> ``{"learner.kl_coef": 0.1}``: the keys -o takes."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class WandbRun:
    """A wandb run; each role's series on its own step axis (``define_metric``), since wandb's own
    step must only grow and the roles' steps do not agree."""

    def __init__(self, config: TetherConfig, name: str, run_id: str | None, settings: dict) -> None:
        import wandb

        self.wandb, self.run_id = wandb, run_id or uuid.uuid4().hex[:12]
        self.run = wandb.init(project=config.metrics.project, entity=config.metrics.wandb_entity, name=name,
                              id=self.run_id, resume="allow", dir=config.run_dir, config=settings,
                              reinit="create_new", settings=wandb.Settings(quiet=True))  # its end: no 50-line summary
        self.axes: set[str] = set()

    def log(self, role: str, step: int, values: dict[str, float]) -> None:
        if role not in self.axes:
            self.run.define_metric(f"{role}/step", hidden=True)
            self.run.define_metric(f"{role}/*", step_metric=f"{role}/step")
            self.axes.add(role)
        self.run.log({f"{role}/step": step, **{f"{role}/{key}": value for key, value in values.items()}})

    def table(self, key: str, rows: list[dict]) -> None:
        columns = list(rows[0])
        self.run.log({key: self.wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])})

    def close(self) -> None:
        self.run.finish()


def mlflow_tracking_uri(config: TetherConfig) -> str:
    """``metrics.mlflow_tracking_uri``, else MLFLOW_TRACKING_URI, else ``./mlruns`` (where ``mlflow
    ui`` looks when started there). MLflow 3's own default is a sqlite store, which mlflow-skinny
    cannot open (no SQLAlchemy), and it refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set:
    tether sets it for a file store, which is what a user of ./mlruns asked for."""
    uri = config.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"file://{os.path.abspath('mlruns')}"
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


class MlflowRun:
    """An MLflow run of experiment ``metrics.project``; the config as its params (and config.yaml)."""

    def __init__(self, config: TetherConfig, name: str, run_id: str | None, settings: dict) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(mlflow_tracking_uri(config))
        if run_id is None:
            experiment = self.client.get_experiment_by_name(config.metrics.project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(config.metrics.project))
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            params = [Param(key, str(value)[:6000]) for key, value in _flat(settings).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a call
                self.client.log_batch(run_id, params=params[start:start + 100])
            self.client.log_text(run_id, dump_config(config), "config.yaml")
        self.run_id = run_id

    def log(self, role: str, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"{role}/{key}", value, now, step)
                                                    for key, value in values.items()])

    def table(self, key: str, rows: list[dict]) -> None:
        self.client.log_table(self.run_id, {column: [row[column] for row in rows] for column in rows[0]},
                              f"{key}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioRun:
    """A trackio run (its local store, or the Space ``TRACKIO_SPACE_ID`` names)."""

    def __init__(self, config: TetherConfig, name: str, run_id: str | None, settings: dict) -> None:
        import trackio

        self.trackio, self.run_id = trackio, name  # trackio resumes a run by its name
        self.run = trackio.init(project=config.metrics.project, name=name, config=settings, resume="allow")

    def log(self, role: str, step: int, values: dict[str, float]) -> None:
        self.run.log({f"{role}/step": step, **{f"{role}/{key}": value for key, value in values.items()}})

    def table(self, key: str, rows: list[dict]) -> None:
        import pandas

        self.run.log({key: self.trackio.Table(dataframe=pandas.DataFrame(rows))})

    def close(self) -> None:
        self.run.finish()


RUNS = {"wandb": WandbRun, "mlflow": MlflowRun, "trackio": TrackioRun}


class Trackers:
    """The tracker runs of ``config``'s run and what was sent to them. ``poll`` sends what the files
    gained since; ``start`` does it every ``metrics.every_s`` on a thread until ``close``."""

    def __init__(self, config: TetherConfig, warn=lambda text: print(text, file=sys.stderr, flush=True)) -> None:
        self.config, self.warn = config, warn
        self.path = os.path.join(config.run_dir, STATE_FILE)
        state = {"ids": {}, "offsets": {}, "tables": []}
        if os.path.exists(self.path):
            with open(self.path) as file:
                state = json.load(file)
        self.ids, self.offsets, self.tables = state["ids"], state["offsets"], set(state["tables"])
        for path, (offset, count) in list(self.offsets.items()):  # a resumed run cut its files at its checkpoint:
            if not os.path.exists(path) or os.path.getsize(path) < offset:  # what is left was sent
                self.offsets[path] = (os.path.getsize(path) if os.path.exists(path) else 0, count)
        name = config.metrics.run_name or os.path.basename(os.path.abspath(config.run_dir))
        settings = json.loads(config.model_dump_json())
        self.runs: dict[str, Any] = {}
        for tracker in (t for t in config.metrics.trackers if t in RUNS):
            try:
                run = RUNS[tracker](config, name, self.ids.get(tracker), settings)  # None: a new run
            except Exception as error:  # not installed, not logged in, no server: the run goes on
                self.warn(f"tether: metrics.trackers {tracker} did not start ({type(error).__name__}: {error}); the "
                          "run goes on without it")
                continue
            self.runs[tracker], self.ids[tracker] = run, run.run_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        """Send every complete line the metrics files and the evaluations' tables gained."""
        if not self.runs:
            return
        for path in sorted(glob.glob(os.path.join(self.config.run_dir, "metrics", "*.jsonl"))):
            if os.path.basename(path) in SKIPPED:
                continue
            role = os.path.basename(path)[:-len(".jsonl")]
            for number, record in self._new_records(path):
                self._send(lambda run: run.log(role, int(record.get("step", number)), _numbers(record)))
        for path in sorted(glob.glob(os.path.join(self.config.run_dir, "eval", "step-*.jsonl"))):
            if path in self.tables:  # written whole by the evaluator, sent once
                continue
            with open(path) as file:
                rows = [json.loads(line) for line in file if line.strip()]
            self.tables.add(path)
            if rows:
                # not under "eval/": wandb would stamp the row with the eval role's step, as a series
                key = f"eval_worst_cases/{os.path.basename(path)[:-len('.jsonl')].replace('-', '_')}"
                self._send(lambda run: run.table(key, rows))
        with open(self.path, "w") as file:
            json.dump({"ids": self.ids, "offsets": self.offsets, "tables": sorted(self.tables)}, file)

    def _new_records(self, path: str) -> list[tuple[int, dict]]:
        """(line number, record) of the whole lines past the offset sent, which then moves on; a
        line still being written waits for the next poll."""
        offset, count = self.offsets.get(path, (0, 0))
        if os.path.getsize(path) < offset:  # the file was cut (a resumed run forgets later steps)
            offset = os.path.getsize(path)
        with open(path, "rb") as file:
            file.seek(offset)
            data = file.read()
        whole = data[:data.rfind(b"\n") + 1]
        records = []
        for line in whole.splitlines():
            if line.strip():
                try:
                    records.append((count, json.loads(line)))
                except json.JSONDecodeError:
                    continue
                count += 1
        self.offsets[path] = (offset + len(whole), count)
        return records

    def _send(self, call) -> None:
        for tracker, run in list(self.runs.items()):
            try:
                call(run)
            except Exception as error:
                self.warn(f"tether: metrics.trackers {tracker} failed to send ({type(error).__name__}: {error}); the "
                          "run goes on without it")
                del self.runs[tracker]

    def start(self) -> "Trackers":
        if self.runs:
            self._thread = threading.Thread(target=self._follow, name="trackers", daemon=True)
            self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.wait(self.config.metrics.every_s):
            try:
                self.poll()
            except Exception as error:  # a file that vanished, a full disk: the next poll tries again
                self.warn(f"tether: metrics.trackers: reading the run's records failed ({type(error).__name__}: "
                          f"{error})")

    def close(self) -> None:
        """The last records, then each run closed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.poll()
        for tracker, run in self.runs.items():
            try:
                run.close()
            except Exception as error:
                self.warn(f"tether: metrics.trackers {tracker} did not close ({type(error).__name__}: {error})")
        self.runs = {}


def follow(config: TetherConfig) -> int:
    """``tether track``: send the run's records as they come, for roles started by hand with
    ``tether launch``, until the learner has written its final policy (or Ctrl-C). The exit code."""
    from launch.exit_codes import ExitCode

    os.makedirs(config.run_dir, exist_ok=True)  # roles started by hand may not have made it yet
    trackers = Trackers(config)
    if not trackers.runs:
        print(f"tether track: no tracker to send to (metrics.trackers: {config.metrics.trackers})", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    print(f"tether track: sending {config.run_dir}/metrics to {', '.join(trackers.runs)}", flush=True)
    try:
        while not os.path.isdir(os.path.join(config.run_dir, "checkpoints", "final")):
            trackers.poll()
            time.sleep(config.metrics.every_s)
    except KeyboardInterrupt:
        pass
    finally:
        trackers.close()
    return ExitCode.OK
