"""metrics.trackers: every role's records, the config and the evaluations' worst cases sent to one
tracker run per tether run. Here the follower's logic against a recording stand-in, and each real
tracker (offline: WANDB_MODE=offline, MLflow's file store, trackio's local store) against the JSON
lines it was sent from; tests/test_verifiable_reward.py checks them after a real `tether run`."""

import json
import os

import pytest

from common.config import load_config
from launch import trackers as trackers_module
from launch.trackers import Trackers


class Recording:
    """A tracker run that keeps what it is sent."""
    made: list = []

    def __init__(self, config, name, run_id, settings):
        self.run_id, self.name, self.settings = run_id or "fresh", name, settings
        self.logged, self.tables, self.closed = [], [], False
        Recording.made.append(self)

    def log(self, role, step, values):
        self.logged.append((role, step, values))

    def table(self, key, rows):
        self.tables.append((key, rows))

    def close(self):
        self.closed = True


class Refusing(Recording):
    def __init__(self, *args):
        raise RuntimeError("not logged in")


class FailingToSend(Recording):
    def log(self, role, step, values):
        raise ConnectionError("server gone")


def config_of(tmp_path, *trackers):
    return load_config(None, ["models.policy=/p", "models.reward=/r", "data.prompts=/q", f"run_dir={tmp_path}",
                              f"metrics.trackers=[{','.join(trackers)}]", "metrics.run_name=trial"])


def append(path, text):
    with open(path, "a") as file:
        file.write(text)


def test_the_follower_sends_whole_new_lines_once_and_a_failing_tracker_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(trackers_module, "RUNS", {"wandb": Recording, "mlflow": Refusing, "trackio": FailingToSend})
    Recording.made = []
    (tmp_path / "metrics").mkdir()
    learner, startup = tmp_path / "metrics" / "learner.jsonl", tmp_path / "metrics" / "startup.jsonl"
    append(learner, '{"time": 1.0, "step": 1, "policy_loss": 0.5, "ranks": 2, "done": true, "note": "x"}\n'
                    '{"time": 2.0, "step": 2, "policy_loss": 0.25')  # the second line is still being written
    append(startup, '{"role": "learner", "phase": "import", "start": 0, "end": 1}\n')
    warnings = []
    trackers = Trackers(config_of(tmp_path, "tensorboard", "wandb", "mlflow", "trackio"), warn=warnings.append)
    assert list(trackers.runs) == ["wandb", "trackio"] and "mlflow did not start (RuntimeError: not logged in)" in warnings[0]
    run = trackers.runs["wandb"]
    assert run.name == "trial" and run.settings["learner"]["kl_coef"] == trackers.config.learner.kl_coef
    trackers.poll()
    assert run.logged == [("learner", 1, {"policy_loss": 0.5, "ranks": 2.0})]  # numbers only; bools and text stay
    assert "trackio failed to send (ConnectionError: server gone)" in warnings[1] and list(trackers.runs) == ["wandb"]
    append(learner, ', "nan": NaN}\n')
    append(tmp_path / "metrics" / "rollout0.jsonl", '{"time": 3.0, "step": 1, "samples_per_s": 9.5}\n')
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "step-000002.jsonl").write_text('{"case": "lowest reward", "reward": -1.0}\n')
    trackers.poll()
    trackers.poll()  # nothing new: nothing sent twice
    assert run.logged[1:] == [("learner", 2, {"policy_loss": 0.25}), ("rollout0", 1, {"samples_per_s": 9.5})]
    assert run.tables == [("eval_worst_cases/step_000002", [{"case": "lowest reward", "reward": -1.0}])]
    trackers.close()
    assert run.closed

    # --resume: the same tracker run goes on from where it stopped; a file a resume cut is read from its end
    state = json.loads((tmp_path / "trackers.json").read_text())
    assert state["ids"]["wandb"] == run.run_id and "mlflow" not in state["ids"]  # what started
    learner.write_text('{"time": 1.0, "step": 1, "policy_loss": 0.5}\n')
    again = Trackers(config_of(tmp_path, "wandb"), warn=warnings.append)
    resumed = again.runs["wandb"]
    assert resumed.run_id == run.run_id
    append(learner, '{"time": 5.0, "step": 2, "policy_loss": 0.125}\n')
    again.poll()
    assert resumed.logged == [("learner", 2, {"policy_loss": 0.125})] and resumed.tables == []


def test_without_a_tracker_nothing_is_read_or_written(tmp_path):
    trackers = Trackers(config_of(tmp_path, "tensorboard")).start()
    trackers.close()
    assert trackers.runs == {} and not (tmp_path / "trackers.json").exists()


def test_each_real_tracker_holds_the_json_lines_offline(tmp_path, monkeypatch):
    """wandb (WANDB_MODE=offline), MLflow (its file store), trackio (its local store): a role's
    records written while the follower runs, lines cut mid-write, two evaluations."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir, uri = tmp_path / "trial", f"file://{tmp_path}/mlruns"
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "eval").mkdir()
    config = load_config(None, ["models.policy=/p", "models.reward=/r", "data.prompts=/q", f"run_dir={run_dir}",
                                "metrics.trackers=[wandb,mlflow,trackio]", f"metrics.mlflow_tracking_uri={uri}",
                                "learner.total_steps=7"])
    trackers = Trackers(config, warn=pytest.fail)
    for step in range(1, 8):
        append(run_dir / "metrics" / "learner.jsonl", json.dumps({"time": step, "step": step, "kl": 1 / step,
                                                                  "policy_loss": -step / 3, "ranks": 1}) + "\n")
        record = json.dumps({"time": step, "step": step // 2, "samples_per_s": 10.5 * step, "in_flight": step % 3})
        append(run_dir / "metrics" / "rollout0.jsonl", record[:9])
        trackers.poll()  # half a rollout line: sent with its second half, next time
        append(run_dir / "metrics" / "rollout0.jsonl", record[9:] + "\n")
        if step % 3 == 0:  # an evaluation: its record, then its worst cases (what wandb stamped with eval/step)
            append(run_dir / "metrics" / "eval.jsonl", json.dumps({"time": step, "step": step, "reward": -step}) + "\n")
            (run_dir / "eval" / f"step-{step:06d}.jsonl").write_text(json.dumps(
                {"case": "lowest reward", "reward": -step, "kl": 0.5, "tokens": 4, "repetition": 0.0,
                 "conversation": "  - prompt: `a`\n  - response: `b`"}) + "\n")
    trackers.close()
    import trackio.sqlite_storage  # in this process trackio writes where TRACKIO_DIR said at its first import

    assert_every_tracker_holds_the_json_lines(str(run_dir), uri, evaluations=2, total_steps=7,
                                              trackio_dir=str(trackio.sqlite_storage.TRACKIO_DIR))


# --- reading back what each real tracker holds (offline), to compare with the JSON lines ---------

def series_of_jsonl(run_dir) -> dict:
    """{"role/key": sorted [(step, value)]} of every record file, as the trackers should hold it."""
    import glob

    from launch.trackers import SKIPPED, _numbers

    series = {}
    for path in glob.glob(os.path.join(run_dir, "metrics", "*.jsonl")):
        if os.path.basename(path) in SKIPPED:
            continue
        role = os.path.basename(path)[:-len(".jsonl")]
        with open(path) as file:
            for number, record in enumerate(json.loads(line) for line in file if line.strip()):
                for key, value in _numbers(record).items():
                    series.setdefault(f"{role}/{key}", []).append((int(record.get("step", number)), value))
    return {key: sorted(points) for key, points in series.items()}


def _by_role_step(rows) -> dict:
    """Rows of ``{"role/step": s, "role/key": v, ...}`` (as wandb and trackio hold them) as series."""
    series = {}
    for row in rows:
        for key, value in row.items():
            role, _, name = key.partition("/")
            if name and name != "step" and f"{role}/step" in row and isinstance(value, (int, float)):
                series.setdefault(key, []).append((int(row[f"{role}/step"]), float(value)))
    return {key: sorted(points) for key, points in series.items()}


def wandb_series(wandb_file) -> tuple[dict, int]:
    """The history an offline wandb run wrote (``run-ID.wandb``: a LevelDB-style log of protobuf
    records, 32 KiB blocks, read here without wandb's service), and how many tables it logged."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = open(wandb_file, "rb").read()
    assert data[:4] == b":W&B"
    position, pending, rows, tables = 7, b"", [], 0
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            break
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                tables += any(key.endswith("/_type") and value == "table-file" for key, value in row.items())
                rows.append(row)
    return _by_role_step(rows), tables


def mlflow_series(tracking_uri, run_id, keys) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in keys}


def trackio_series(trackio_dir, project, name) -> tuple[dict, int]:
    """What trackio's local store holds (``TRACKIO_DIR/<project>.db``, a row of JSON a log call),
    read with sqlite3: trackio's own reader takes its directory from where it was first imported."""
    import sqlite3

    with sqlite3.connect(os.path.join(trackio_dir, f"{project}.db")) as db:
        rows = [json.loads(raw) for (raw,) in db.execute("SELECT metrics FROM metrics WHERE run_name = ? ORDER BY id",
                                                         (name,))]
    tables = sum(isinstance(value, dict) and value.get("_type") == "trackio.table" for row in rows for value in row.values())
    return _by_role_step(rows), tables


def assert_every_tracker_holds_the_json_lines(run_dir, mlflow_uri, evaluations: int, total_steps: int,
                                              trackio_dir: str) -> None:
    """After a real `tether run` with metrics.trackers [tensorboard, wandb, mlflow, trackio] offline."""
    import glob

    expected = series_of_jsonl(run_dir)
    assert any(key.startswith("learner/") for key in expected) and any(key.startswith("rollout0/") for key in expected)
    ids = json.loads(open(os.path.join(run_dir, "trackers.json")).read())["ids"]
    (wandb_file,) = glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{ids['wandb']}", f"run-{ids['wandb']}.wandb"))
    in_wandb, wandb_tables = wandb_series(wandb_file)
    in_trackio, trackio_tables = trackio_series(trackio_dir, "tether", os.path.basename(run_dir))
    assert in_wandb == expected and in_trackio == expected
    assert mlflow_series(mlflow_uri, ids["mlflow"], expected) == expected
    assert wandb_tables == trackio_tables == evaluations
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    assert len(client.list_artifacts(ids["mlflow"], "eval_worst_cases")) == evaluations
    assert client.get_run(ids["mlflow"]).data.params["learner.total_steps"] == str(total_steps)  # the config


def test_mlflow_with_no_tracking_uri_writes_to_mlruns_where_tether_runs(tmp_path, monkeypatch):
    """MLflow 3's own default (a sqlite store) cannot be opened by mlflow-skinny, and its file store
    refuses to start without MLFLOW_ALLOW_FILE_STORE: tether's default, ./mlruns, works as it is."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "learner.jsonl").write_text(json.dumps({"time": 1, "step": 1, "kl": 0.5}) + "\n")
    trackers = Trackers(config_of(tmp_path, "mlflow"), warn=pytest.fail)
    trackers.poll()
    run_id = trackers.runs["mlflow"].run_id
    trackers.close()
    assert mlflow_series(f"file://{tmp_path}/mlruns", run_id, ["learner/kl"]) == {"learner/kl": [(1, 0.5)]}
    assert MlflowClient(f"file://{tmp_path}/mlruns").get_run(run_id).info.run_name == "trial"
